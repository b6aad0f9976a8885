"""What an engine can serve and where it is known to go wrong, declared by the engine in one typed object.

Each engine module declares ``CAPABILITIES`` at module level without importing its engine's own library (vLLM,
SGLang, Triton), so the harness (doctor, check, metamorphic, the GPU suites) reads every engine's facts on any
machine through ``lpdiff.engines.base.capabilities(name)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DTYPES = ("float32", "bfloat16", "float16")
# expert adapter layouts: PEFT 3D (target_parameters on fused experts), one module per expert
# (experts.{e}.gate_proj ...), per-expert with a non-gated expert's input named gate_proj (SGLang's reading), and
# per-expert with A of gate_up / B of down shared by every expert
LAYOUTS = ("peft3d", "per_expert", "per_expert_gate", "shared_outer")
# what a metamorphic mode needs of the run: an MoE model, a GPU, a bf16/fp16 run, or Triton kernels that can run
# (a GPU or TRITON_INTERPRET=1)
MODE_NEEDS = ("experts", "cuda", "low_precision", "triton_kernels")
ROUTER_LORA = ("applied", "refused", "peft")  # "peft": whatever PEFT can wrap (the hf engine)
SEVERITIES = ("error", "warning", "info")
# the logprobs a verdict judges: the engine's prompt logprobs (lpdiff run / check / the metamorphic relations), or the
# logprobs it samples with while generating (lpdiff run --decode / check --decode: commands/decode.py)
VERDICTS = ("prefill", "decode")


def model_type(arch: str) -> str:
    """The checkpoint's model type for an in-memory arch: a multimodal checkpoint's text model ("qwen3_5_moe_text",
    what transformers builds for Qwen3.5's text_config) is served by engines as the checkpoint ("qwen3_5_moe")."""
    return arch.removesuffix("_text")


@dataclass(slots=True, frozen=True)
class KnownDefect:
    """One engine behaviour a user must know before running: the engine refuses the adapter, dies, or silently
    computes something else. ``what`` and ``fix`` are one line each; they may hold ``{name}`` fields that the
    reader fills (doctor: ``arch``, ``where``, ``convert_to_peft3d``, ``convert_to_per_expert``, ...)."""

    id: str  # stable code: doctor's finding code, a suite's expected failure
    what: str  # what happens
    fix: str
    versions: str  # the engine versions it was measured on or read in (e.g. "vLLM 0.25.1")
    archs: tuple[str, ...] = ()  # model_type names it applies to; () = any
    layouts: tuple[str, ...] = ()  # expert adapter layouts it applies to; () = any
    tp: tuple[int, ...] = ()  # tensor-parallel sizes it applies to; () = any
    severity: str = "error"  # error: fails or silently wrong; warning: may; info: handled, good to know
    when: str = ""  # the adapter condition beyond arch/layout/tp ("" = every adapter of that layout)
    verdicts: tuple[str, ...] = ()  # of VERDICTS: the logprobs it spoils (prompt or sampled); () = both

    def __post_init__(self):
        assert self.severity in SEVERITIES, self.severity
        assert set(self.layouts) <= set(LAYOUTS), self.layouts
        assert set(self.verdicts) <= set(VERDICTS), self.verdicts
        assert "\n" not in self.what and "\n" not in self.fix, self.id

    def applies(
        self, arch: str | None = None, layout: str | None = None, tp: int | None = None, verdict: str | None = None
    ) -> bool:
        """Whether it applies to this arch / layout / TP size / verdict (None: not asked, matches)."""
        return (
            (arch is None or not self.archs or model_type(arch) in self.archs)
            and (layout is None or not self.layouts or layout in self.layouts)
            and (tp is None or not self.tp or tp in self.tp)
            and (verdict is None or not self.verdicts or verdict in self.verdicts)
        )

    def message(self, **fields: Any) -> tuple[str, str]:
        """-> (what, fix) with the fields filled."""
        return self.what.format(**fields), self.fix.format(**fields)


@dataclass(slots=True, frozen=True)
class Mode:
    """A metamorphic mode: the same run under other engine options, which must not change the logprobs beyond
    rounding."""

    name: str
    options: dict[str, Any]
    needs: tuple[str, ...] = ()  # of MODE_NEEDS

    def __post_init__(self):
        assert set(self.needs) <= set(MODE_NEEDS), self.needs


@dataclass(slots=True, frozen=True)
class Capabilities:
    engine: str
    label: str  # how messages name it ("vLLM", "HF+PEFT")
    versions: str  # the engine versions these facts were read from
    archs: tuple[str, ...] | None  # model_type names it serves; None = whatever transformers loads
    layouts: tuple[str, ...]  # expert adapter layouts it reads (before arch-specific defects)
    dtypes: tuple[str, ...]
    lora_fp32: bool  # LoRA runs in fp32 (else an fp32 run with adapters is refused)
    max_rank: int | None  # largest LoRA rank it accepts; None = no limit
    max_moe_rank: int | None  # largest expert (MoE) LoRA rank; None = max_rank
    tp: tuple[int, ...]
    modes: tuple[Mode, ...] = ()
    cpu_tp: tuple[int, ...] = (1,)  # the TP sizes it runs on a machine without GPUs (triton: gloo ranks)
    lora_targets: frozenset[str] | None = None  # module leaf names it has LoRA for; None = any
    # (model_type, leaf names) where an arch's LoRA modules differ from lora_targets (hybrids' own projections)
    arch_lora_targets: tuple[tuple[str, frozenset[str]], ...] = ()
    arch_layouts: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (model_type, layouts) where an arch reads others
    router_lora: str = "applied"  # of ROUTER_LORA
    refused_features: tuple[str, ...] = ()  # adapter_config.json features it refuses (use_dora, bias, ...)
    ignored_features: tuple[str, ...] = ()  # features it reads past (rank_pattern, use_rslora, ...)
    moe_lora_cpu: bool = True  # MoE models with LoRA run without a GPU
    # one forward runs rows of different adapters and base rows together (a batch's rows share its row count, which
    # can change a row's rounding); False: rows are grouped by adapter, base rows run as their own batch (HF+PEFT
    # sets one adapter per forward). The LoRA neutrality relation's reference batch follows it (relations._neutral)
    mixed_batches: bool = True
    per_layer_capture: bool = False  # offers capture_layers (lpdiff bisect)
    # (model_type, root) where the engine maps adapter names from the checkpoint's decoder root rather than the text
    # model's ``model.`` (a multimodal wrapper's ``model.language_model``): adapters must name modules under it
    adapter_roots: tuple[tuple[str, str], ...] = ()
    known_defects: tuple[KnownDefect, ...] = field(default_factory=tuple)
    # tokens the engine prefills in one forward step under lpdiff's settings (vLLM max_num_batched_tokens, SGLang
    # chunked_prefill_size, the triton runtime's and HF's max_batch_tokens): a longer prompt crosses a step
    # boundary (chunked prefill), which long-prompt sets must reach. None: not known. ``arch_prefill_steps``:
    # (model_type, step) where lpdiff's engine asks for another; ``prefill_step_option``: the engine option path
    # that sets it (("llm_kwargs", "max_num_batched_tokens")), which wins over both
    prefill_step: int | None = None
    arch_prefill_steps: tuple[tuple[str, int], ...] = ()
    prefill_step_option: tuple[str, ...] = ()
    # installing it: the command that installs its own package at the version lpdiff ran (README "Engines"; lpdiff is
    # not on PyPI, so `pip install 'lpdiff[vllm]'` resolves nothing) and the module that says it is installed;
    # "" for both: it runs on lpdiff's own dependencies. ``offline_python``: it also runs from an unpacked bundle
    # named by LPDIFF_<ENGINE>_PYTHONPATH (its lane's ``python`` option).
    install: str = ""
    module: str = ""
    offline_python: bool = False
    # its reference noise in fp32: the engine options of two correct runs that differ only by rounding (two kernels
    # for one op); ``fp32_twins_cuda`` where a GPU runs other kernels. ({}, {}): its rerun noise
    fp32_twins: tuple[dict[str, Any], dict[str, Any]] = ({}, {})
    fp32_twins_cuda: tuple[dict[str, Any], dict[str, Any]] | None = None
    adapter_doctor: bool = False  # lpdiff doctor knows how it reads (refuses, drops) adapter files
    # one session holds only adapters of one PEFT signature (PeftModel refuses adapters whose target_parameters are
    # spelled differently): reference runs and metamorphic sessions are split by signature
    peft_sessions: bool = False
    routing_replay: bool = False  # prompt_logprobs takes ``routing=`` (forced expert ids): check --routing-replay
    # lpdiff bisect re-runs it module by module against the reference (lpdiff's own runtime): a lane of it that went
    # wrong is localised there, base rows too (they go wrong with the adapters beside them)
    bisects: bool = False
    max_lora_rank_option: bool = False  # started with a max_lora_rank (its LoRA buffers' size): doctor --max-lora-rank

    def twins(self, cuda: bool) -> tuple[dict[str, Any], dict[str, Any]]:
        """The options of its two correct fp32 runs (``fp32_twins``) on this machine."""
        pair = self.fp32_twins_cuda if cuda and self.fp32_twins_cuda is not None else self.fp32_twins
        return dict(pair[0]), dict(pair[1])

    def __post_init__(self):
        assert set(self.layouts) <= set(LAYOUTS), self.layouts
        assert all(set(lays) <= set(LAYOUTS) for _, lays in self.arch_layouts), self.arch_layouts
        assert set(self.dtypes) <= set(DTYPES), self.dtypes
        assert self.router_lora in ROUTER_LORA, self.router_lora
        assert set(self.cpu_tp) <= set(self.tp), (self.cpu_tp, self.tp)
        for d in self.known_defects:  # one id twice only as an arch-specific entry beside its any-arch fallback
            twins = [e for e in self.known_defects if e.id == d.id and e is not d]
            assert all(bool(e.archs) != bool(d.archs) or not set(e.archs) & set(d.archs) for e in twins), d.id

    def lora_targets_for(self, arch: str) -> frozenset[str] | None:
        """The module leaf names it has LoRA for on this arch (None = any)."""
        return dict(self.arch_lora_targets).get(model_type(arch), self.lora_targets)

    def adapter_root(self, arch: str) -> str | None:
        """The decoder root (no trailing dot) the engine reads adapter names under on this arch; None: ``model``,
        the text model's own names."""
        return dict(self.adapter_roots).get(model_type(arch))

    def prefill_step_for(self, arch: str, options: dict[str, Any] | None = None) -> int | None:
        """Tokens per prefill step this engine runs ``arch`` with, given its options (None: not known)."""
        where: Any = options or {}
        for key in self.prefill_step_option:
            where = where.get(key) if isinstance(where, dict) else None
        if isinstance(where, int) and not isinstance(where, bool) and self.prefill_step_option:
            return where
        return dict(self.arch_prefill_steps).get(model_type(arch), self.prefill_step)

    def serves(self, arch: str) -> bool:
        return self.archs is None or model_type(arch) in self.archs

    def defect(self, id: str, arch: str | None = None) -> KnownDefect:
        for d in self.defects(arch):
            if d.id == id:
                return d
        raise KeyError(f"engine {self.engine!r} declares no defect {id!r}")

    def defects(
        self, arch: str | None = None, layout: str | None = None, tp: int | None = None, verdict: str | None = None
    ) -> tuple[KnownDefect, ...]:
        """The defects that apply; of an id declared for some archs and as an any-arch fallback, the entry for
        ``arch`` wins."""
        assert verdict is None or verdict in VERDICTS, verdict
        hits = [d for d in self.known_defects if d.applies(arch, layout, tp, verdict)]
        specific = {d.id for d in hits if d.archs}
        return tuple(d for d in hits if d.archs or d.id not in specific)

    def layouts_for(self, arch: str) -> tuple[str, ...]:
        """The layouts it reads correctly on this arch: its layouts (or the arch's own), less those an
        unconditional error defect of this arch (at any TP size) rules out."""
        layouts = dict(self.arch_layouts).get(model_type(arch), self.layouts)
        return tuple(
            lay
            for lay in layouts
            if not any(
                d.severity == "error" and not d.when and not d.tp and d.layouts and d.applies(arch, lay)
                for d in self.known_defects
            )
        )

    @property
    def moe_rank(self) -> int | None:
        return self.max_moe_rank if self.max_moe_rank is not None else self.max_rank

    def mode_table(self) -> dict[str, Mode]:
        return {m.name: m for m in self.modes}
