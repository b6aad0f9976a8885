"""Per-layer capture for lpdiff bisect (engines.base.CapturesLayers): each module of the runtime re-run on another
engine's inputs to that module, so that a module's error is its own and not inherited from the layers before.
Under TP every rank runs the same capture on its shard (``CaptureWork`` is broadcast to the workers, tp.py): the
attention and expert outputs are all-reduced as in a forward, so rank 0 returns full (tokens, hidden) outputs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

import lpdiff.engines.triton.tp as tp
from lpdiff.engines.base import check_request
from lpdiff.engines.triton.batch import Batch
from lpdiff.engines.triton.model import MoeTransformer
from lpdiff.engines.triton.moe import experts, route

# what the re-runs read of ``inputs``: every module's input ("attention_in", a hybrid's "linear_attention_in",
# "mamba_in", "mlp_in", "moe_in", "shared_expert_in", "experts_in" ...) and the reference's routing of the experts
ROUTING_POINTS = ("router_ids", "router_weights")


def is_input(point: str) -> bool:
    return point.endswith("_in") or point in ROUTING_POINTS


def put_steps(cap: dict, layer: int, kind: str, trace: dict, suffix: str = "") -> None:
    """A mixer's ``trace`` (step -> tensor, or a tuple of tensors joined along their widths) into ``cap`` as
    (layer, "<kind>.<step><suffix>"): (tokens, width), fp32, the points engines/hf_steps.py records for HF."""
    for step, t in trace.items():
        parts = t if isinstance(t, tuple) else (t,)
        n = parts[0].shape[0]
        cap[layer, f"{kind}.{step}{suffix}"] = torch.cat([p.float().reshape(n, -1) for p in parts], dim=-1)


@dataclass(slots=True)
class CaptureWork:
    """One capture call as every rank runs it (rank 0 in the engine's process, the workers from a broadcast)."""

    prompts: list[list[int]]
    slots: list[int]  # the adapter slot of each prompt (-1: none), so a batch may mix adapters and base rows
    inputs: dict | None  # {(layer, point): tensor} of input points (is_input), on the CPU when broadcast
    steps: tuple[int, ...] = ()  # layers whose hybrid mixer's sub-steps are traced too (TP 1)

    def __call__(self, runtime) -> dict | None:
        return run_capture(runtime, self)


def capture_layers(
    engine, prompts: Sequence[Sequence[int]], adapter=None, inputs: dict | None = None, steps: Sequence[int] = ()
) -> dict[tuple[int, str], torch.Tensor]:
    """``engine``: an open TritonEngine, any TP size; ``adapter``: one name, None, or one choice per prompt.
    -> {(layer, point): tensor}: "hidden" from the runtime's own forward; with ``inputs`` (e.g. the hf engine's
    capture, prompts in the same order) also each module with and without the adapters (attention and experts; a
    hybrid model's own capture_modules: each layer's mixer by its kind and the shared expert too), and the routing,
    each computed on that capture's inputs to the module. ``steps``: layers whose Mamba-2 / Gated DeltaNet mixer
    also reports its sub-steps ("mamba.conv1d", "linear_attention.delta_rule" ..., with and without "_base"),
    whole-width, so at TP 1 only."""
    rt = engine.runtime
    if steps and engine.workers is not None:
        raise ValueError("mixer sub-steps are captured at TP 1 (a rank holds only its heads' columns of each step)")
    if rt is None:
        raise RuntimeError("use the engine as a context manager: `with open_engine('triton', cfg) as eng:`")
    names = check_request(prompts, adapter, engine.config.adapters, engine.config.model)
    if inputs is not None:
        inputs = {k: v for k, v in inputs.items() if is_input(k[1])}
        if engine.workers is not None:  # pickled to every rank: host tensors, each rank moves them to its device
            inputs = {k: v.detach().cpu() for k, v in inputs.items()}
    work = CaptureWork([list(map(int, p)) for p in prompts], [rt.slot(n) for n in names], inputs, tuple(steps))
    if engine.workers is not None:
        tp.broadcast(work)
    cap = work(rt)
    assert cap is not None  # rank 0 (this process) holds the capture
    return cap


@torch.inference_mode()
def run_capture(rt, work: CaptureWork) -> dict | None:
    """One rank's part: the same forward and module re-runs, in the same order, on every rank (each all-reduce is a
    collective). Rank 0 returns the capture, other ranks None."""
    m, cfg = rt.model, rt.cfg
    batch = Batch.build(work.prompts, work.slots, cfg, rt.dtype, rt.device)
    m.capture = {}
    try:
        m.forward(batch)
        free = m.capture
    finally:
        m.capture = None
    cap: dict = {(i, "hidden"): h for i, h in free.items()}
    inputs = work.inputs
    rerun = getattr(m, "capture_modules", None)  # a hybrid arch's own model (archs.Built) re-runs its own modules
    if inputs is not None and rerun is not None:
        cap.update(rerun(batch, inputs, work.steps))
        return cap if rt.shard.first else None
    if inputs is not None and not isinstance(m, MoeTransformer):
        raise ValueError(
            f"the triton engine's {cfg.arch} model does not re-run its modules on another engine's "
            "inputs; capture its layer outputs only (inputs=None)"
        )
    ins: dict = inputs if inputs is not None else {}
    for i, lw in enumerate(m.w.layers if inputs is not None else ()):
        ll = m.lora.layers[i] if m.lora is not None else None
        h = ins[i, "attention_in"].to(rt.device, rt.dtype)
        cap[i, "attention"] = m.attend(h, lw, ll, batch, cfg.sliding_windows[i])  # all-reduced inside
        cap[i, "attention_base"] = m.attend(h, lw, None, batch, cfg.sliding_windows[i])
        x = ins[i, "experts_in"].to(rt.device, rt.dtype)
        ids, w32 = ins[i, "router_ids"].to(rt.device), ins[i, "router_weights"].to(rt.device).float()
        own_ids, own_weights, _ = route(x, lw, cfg, m.impl)
        cap[i, "router_ids"], cap[i, "router_weights"] = own_ids, own_weights
        # as the forward runs them, summed over top-k; the all-reduce turns each rank's partial into the output
        cap[i, "experts"] = m.all_reduce(
            experts(
                x,
                ids,
                w32,
                lw,
                cfg,
                ll.moe if ll is not None else None,
                batch.token_adapter,
                m.lora_impl,
                m.moe_backend,
                shrink=m.moe_shrink,
                padding=m.moe_padding,
            )
        )
        cap[i, "experts_base"] = m.all_reduce(
            experts(x, ids, w32, lw, cfg, None, None, m.lora_impl, m.moe_backend, padding=m.moe_padding)
        )
    return cap if rt.shard.first else None
