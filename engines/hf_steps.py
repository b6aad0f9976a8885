"""The sub-steps inside the hybrids' token mixers of transformers' models, as ``lpdiff bisect`` compares them
(engines.base.MIXER_STEPS): the hf engine's ``capture_layers(..., steps=[layer, ...])`` records them under
``(layer, "<mixer>.<step>")`` with the adapter on and ``"<mixer>.<step>_base"`` in the base re-run.

Each step is what transformers computed, read where it lives: a projection's output from a forward hook on that
module (PEFT's LoRA wrapper where the adapter targets it, so the output includes the delta), the gated norm's output
from its module, and the sequence op's inputs and output by wrapping the modeling module's function for the time of
the capture (the mixers call it by its global name: NemotronH's ``mamba2_chunk_scan``, Qwen3.5's
``torch_chunk_gated_delta_rule``). Its inputs are the conv's outputs (x|B|C; q|k|v with q and k repeated to the value
heads) and the gates (Qwen3.5's g and beta). Mamba-2's D skip is inside HF's scan: it is split out as D * x with the
mixer's own D and the scan's own x, the scan's share being the rest."""

from __future__ import annotations

from contextlib import contextmanager

import torch

# the function each mixer kind calls for its sequence op: (modeling module, global name)
_SEQUENCE_OPS = {
    "mamba": ("transformers.models.nemotron_h.modeling_nemotron_h", "mamba2_chunk_scan"),
    "linear_attention": ("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "torch_chunk_gated_delta_rule"),
}


class StepTracer:
    """Records the steps of the mixers of ``layers`` ({layer index: (mixer module, kind)}) into ``cap`` while
    active; ``suffix`` ("" or "_base") names the pass. ``tokens``: the batch's token count (every step is stored
    as (tokens, width))."""

    def __init__(self, layers: dict, cap: dict, tokens: int):
        self.layers, self.cap, self.tokens, self.suffix = layers, cap, tokens, ""
        self.current: tuple[int, str] | None = None  # the traced mixer running now

    def put(self, layer: int, kind: str, step: str, t: torch.Tensor) -> None:
        self.cap[layer, f"{kind}.{step}{self.suffix}"] = t.detach().reshape(self.tokens, -1)

    @contextmanager
    def active(self):
        import importlib

        handles, patched = [], []
        try:
            for i, (mixer, kind) in self.layers.items():
                handles.append(mixer.register_forward_pre_hook(lambda m, a, i=i, k=kind: self._enter(i, k)))
                handles.append(mixer.register_forward_hook(lambda m, a, o: self._leave()))
                handles.extend(
                    getattr(mixer, name).register_forward_hook(self._hook(i, kind, name)) for name in _PROJECTIONS[kind]
                )
                handles.append(mixer.norm.register_forward_hook(self._hook(i, kind, "gated_norm")))
            for kind in {k for _, k in self.layers.values()}:
                module, name = _SEQUENCE_OPS[kind]
                mod = importlib.import_module(module)
                real = getattr(mod, name)
                setattr(mod, name, self._wrap(real))
                patched.append((mod, name, real))
            yield self
        finally:
            for h in handles:
                h.remove()
            for mod, name, real in patched:
                setattr(mod, name, real)

    def _enter(self, i: int, kind: str) -> None:
        self.current = (i, kind)

    def _leave(self) -> None:
        self.current = None

    def _hook(self, i: int, kind: str, step: str):
        def hook(mod, args, out):
            self.put(i, kind, step, out[0] if isinstance(out, tuple) else out)

        return hook

    def _wrap(self, real):
        def traced(*args, **kwargs):
            out = real(*args, **kwargs)
            if self.current is not None:
                i, kind = self.current
                y = out[0] if isinstance(out, tuple) else out
                (mamba_steps if kind == "mamba" else delta_rule_steps)(self, i, args, kwargs, y)
            return out

        return traced


# the projections each mixer kind calls as modules (their outputs are steps of the same name)
_PROJECTIONS = {
    "mamba": ("in_proj", "out_proj"),
    "linear_attention": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"),
}


def _arg(args: tuple, kwargs: dict, pos: int, name: str):
    return args[pos] if len(args) > pos else kwargs[name]


def mamba_steps(tr: StepTracer, i: int, args: tuple, kwargs: dict, y: torch.Tensor) -> None:
    """mamba2_chunk_scan(hidden_states (b, l, h, p), dt, A, B (b, l, g, n), C, chunk_size, D=...) -> y (b, l, h, p)
    with the D skip."""
    x, B, C = _arg(args, kwargs, 0, "hidden_states"), _arg(args, kwargs, 3, "B"), _arg(args, kwargs, 4, "C")
    n = tr.tokens
    tr.put(i, "mamba", "conv1d", torch.cat([t.reshape(n, -1) for t in (x, B, C)], dim=-1))
    D = _arg(args, kwargs, 6, "D")
    skip = (D[:, None].float() * x.float()).reshape(n, -1)
    tr.put(i, "mamba", "d_skip", skip)
    tr.put(i, "mamba", "ssd_scan", y.float().reshape(n, -1) - skip)


def delta_rule_steps(tr: StepTracer, i: int, args: tuple, kwargs: dict, o: torch.Tensor) -> None:
    """torch_chunk_gated_delta_rule(query, key, value (b, l, h, d), g=, beta=); q and k are compared repeated to v's
    heads, as transformers 5.17 passes them (later versions repeat them inside the function)."""
    q, k, v = (_arg(args, kwargs, j, name) for j, name in enumerate(("query", "key", "value")))
    if (rep := v.shape[2] // q.shape[2]) > 1:  # transformers 5.24 repeats q and k inside the function, 5.17 before it
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    g, beta = _arg(args, kwargs, 3, "g"), _arg(args, kwargs, 4, "beta")
    n = tr.tokens
    tr.put(i, "linear_attention", "conv1d", torch.cat([t.reshape(n, -1) for t in (q, k, v)], dim=-1))
    tr.put(i, "linear_attention", "gate", torch.cat([g.float().reshape(n, -1), beta.float().reshape(n, -1)], -1))
    tr.put(i, "linear_attention", "delta_rule", o)
