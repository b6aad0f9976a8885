"""The triton engine's options (``EngineConfig.options``, listed in engines/triton/__init__.py): one slotted object,
validated once when the engine is made and handed to the runtime and to every tensor-parallel worker as it is."""

from __future__ import annotations

from dataclasses import dataclass, fields

from lpdiff.harness.spec.errors import InputError
from lpdiff.kernels import BACKENDS, LORA_SHRINK, PADDING, faults

IMPLS = ("auto", "triton", "torch")
ATTENTION = ("auto", "flash", "sdpa", "triton")
MAMBA_SCAN = ("recurrence", "chunked", "auto")


@dataclass(slots=True)
class TritonOptions:
    impl: str = "auto"  # kernels implementation: auto = Triton on CUDA, the torch references otherwise
    attention: str = "auto"  # engines/triton/attention.py
    max_batch_tokens: int = 8192  # packed tokens per forward
    logit_chunk: int = 1024  # rows per log-softmax chunk
    timeout_s: float = 600.0  # tensor-parallel start-up and collective timeout
    fault: str | None = None  # a bug-zoo fault (kernels/faults.py); resolved here against $LPDIFF_FAULT
    moe_backend: str = "triton"  # kernels.BACKENDS
    cuda_graphs: int = 4  # CUDA graphs kept of whole calls (0 = none)
    moe_lora_shrink: str = "auto"  # "auto" | "once" | "fused" | "fused:G,D" (parse_shrink)
    moe_padding: str = "auto"  # "auto" or one of kernels.PADDING
    capture_routing: bool = False  # return expert ids / weights / margins per MoE layer (engines/triton/routing.py)
    # Nemotron-H's SSD scan (engines/triton/mamba.py scan_impl). "auto" (the default) takes mamba_ssm's chunked
    # kernels for bf16/fp16 on CUDA and the recurrence otherwise (fp32 runs keep their 1e-4 parity with HF+PEFT).
    # Why chunked in 16 bits: 1.85x the recurrence's throughput end to end on an H200 at 8 x 512 tokens (Nano, LoRA:
    # 61.7k against 33.4k tokens/s; Super at 43 layers: 33.5k against 18.9k; benchmarks/results/e2e.md), for a
    # forward that the GPU measured 1.08x as far from the fp32 recurrence as the bf16 recurrence (mean |d| 0.0309
    # against 0.0285 on tiny-nemotron-h; engines_gpu.md): the chunked kernels round chunk states and y to bf16 where
    # the recurrence keeps fp32. "recurrence" stays an option for a run that wants those fp32 states.
    mamba_scan: str = "auto"

    def __post_init__(self):
        _choice("impl", self.impl, IMPLS)
        _choice("attention", self.attention, ATTENTION)
        _choice("moe_backend", self.moe_backend, BACKENDS)
        _choice("mamba_scan", self.mamba_scan, MAMBA_SCAN)
        if self.moe_padding not in ("auto", *PADDING):
            raise InputError(
                f"option moe_padding must be auto or one of {PADDING} (what the expert GEMMs do with a "
                f"group's padding rows), got {self.moe_padding!r}"
            )
        parse_shrink(self.moe_lora_shrink)  # one clear error now, not in every TP worker later
        for name in ("max_batch_tokens", "logit_chunk"):
            _count(name, getattr(self, name), 1)
        _count("cuda_graphs", self.cuda_graphs, 0)
        if not isinstance(self.capture_routing, bool):
            raise InputError(f"option capture_routing must be true or false, got {self.capture_routing!r}")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) or self.timeout_s <= 0:
            raise InputError(f"option timeout_s must be a positive number of seconds, got {self.timeout_s!r}")
        self.fault = faults.resolve({"fault": self.fault})  # resolved once, so TP workers run the same one

    @classmethod
    def from_dict(cls, options: dict) -> TritonOptions:
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise InputError(f"unknown triton engine options {unknown}; known: {', '.join(known)}")
        return cls(**options)

    @property
    def moe_shrink(self) -> tuple[str, tuple[int, int] | None]:
        """(lora_shrink, n_tiles) of kernels.moe_forward."""
        return parse_shrink(self.moe_lora_shrink)


DEFAULTS = {f.name: f.default for f in fields(TritonOptions)}  # (a slotted class holds no default as an attribute)


def _choice(name: str, value, choices: tuple) -> None:
    if value not in choices:
        raise InputError(f"option {name} must be one of {choices}, got {value!r}")


def _count(name: str, value, lo: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise InputError(f"option {name} must be an integer >= {lo}, got {value!r}")


def parse_shrink(option: str) -> tuple[str, tuple[int, int] | None]:
    """The moe_lora_shrink option -> (lora_shrink, n_tiles): "auto" | "once" | "fused" | "fused:G,D" (the shrink in
    the first tile's K-loop, gate_up programs walking G N tiles and down programs D)."""
    mode, _, tiles = str(option).partition(":")
    ok = mode in LORA_SHRINK and (not tiles or mode == "fused")
    try:
        n = tuple(int(t) for t in tiles.split(",")) if tiles else None
    except ValueError:
        ok = False
    if not ok or (n is not None and (len(n) != 2 or min(n) < 1)):
        raise InputError(
            f"option moe_lora_shrink must be auto, once, fused or fused:G,D (N tiles per program of the "
            f"gate_up and down GEMMs, e.g. fused:3,4), got {option!r}"
        )
    return mode, n
