"""The MoE op's torch reference: loops over experts and adapter slots, fp32 math, the activation rounded to x.dtype
like the kernel's intermediate buffer. The bug zoo's LoRA-path faults (faults.py) are reproduced here where the buggy
engine had them."""

from __future__ import annotations

import torch

import lpdiff.kernels.faults as faults
from lpdiff.kernels.activation import activate
from lpdiff.kernels.lora_weights import MoeLoraWeights, lora_delta
from lpdiff.kernels.moe_inputs import MoeInputs


def add_slot_deltas(
    out: torch.Tensor,
    inp: torch.Tensor,
    slots: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    lora: MoeLoraWeights,
    unmasked_b: torch.Tensor | None = None,
) -> None:
    """out[rows of slot s] += LoRA delta of slot s for every slot used (-1 rows get none); a (L, R, in),
    b (L, out, R) of one expert. ``unmasked_b`` (fault lora_b_unmasked only): the whole stacked B buffer that an
    expand without a column mask reads past this expert's rows."""
    for s in slots.unique().tolist():
        if s >= 0:
            rows = slots == s
            rank = int(lora.ranks[s])
            if unmasked_b is None:
                out[rows] += lora_delta(inp[rows], a[s], b[s], lora.scaling[s], rank)
                continue
            sub = out[rows]
            shrink = float(lora.scaling[s]) * (inp[rows].float() @ a[s][:rank].float().T)
            faults.unmasked_expand(sub, shrink, b[s], unmasked_b, rank)
            out[rows] = sub


def moe_forward_torch(moe: MoeInputs) -> torch.Tensor:
    """(T, H) in x's dtype, as moe.moe_forward.

    On CPU each expert runs on every row of the batch (slot -1 and weight 1 on the rows it was not chosen for) and
    keeps its tokens' rows, so that a token's result does not depend on how many tokens its expert got: MKL's sgemm
    computes a row differently at some row counts M (M = 1-3 at 1 thread; 1-3, 5-7, 9-11 at 2; also 17-19 and
    25-27 at 16), and torch's vectorised sigmoid / SiLU round the last elements of a tensor, the ones past a
    whole vector, otherwise than the rest (the activation of a gathered (M, I) block). An expert's M changes when
    other rows of the batch route elsewhere (an adapter's rows), which moved base rows by up to 9.5e-6 in logprobs
    on the tiny zoo (LoRA neutrality, exact in fp32). On every row M = T, the batch's own size, like every other
    GEMM of the forward. It does E / top_k times the experts' arithmetic: this call took 1.3x as long at 100 tokens
    and 2.8x at 2000 (8 experts, top-2, H 128, 1 CPU thread), and the triton engine's CPU tests as long as before.
    GPU runs of this reference keep the gathered rows (16x the arithmetic on Qwen3-30B-A3B would be too slow for its
    fallback above the kernels' rank cap)."""
    x, topk_ids, topk_weights, w_gate_up, w_down = moe.x, moe.topk_ids, moe.topk_weights, moe.w_gate_up, moe.w_down
    b_gate_up, b_down, lora = moe.b_gate_up, moe.b_down, moe.lora
    T, H = x.shape
    out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    slots = torch.full((T,), -1, device=x.device) if moe.slots is None else moe.slots.long()
    fault = faults.active() if lora is not None else None
    all_rows = x.device.type == "cpu"
    for e in range(w_gate_up.shape[0]):
        t_idx, k_idx = (topk_ids == e).nonzero(as_tuple=True)
        if t_idx.numel() == 0:
            continue
        weight = topk_weights[t_idx, k_idx, None].float()
        if all_rows:
            xe, es, we = x.float(), torch.full_like(slots, -1), torch.ones(T, 1, device=x.device)
            es[t_idx], we[t_idx] = slots[t_idx], weight
        else:
            xe, es, we = x[t_idx].float(), slots[t_idx], weight
        h = xe @ w_gate_up[e].float().T
        if b_gate_up is not None:
            h += b_gate_up[e].float()
        # the zoo's faults on the LoRA path keep the delta apart where the buggy engine did (kernels/faults.py)
        hd = torch.zeros_like(h) if fault == "lora_after_activation" else h
        if lora is not None:
            add_slot_deltas(
                hd,
                xe,
                es,
                lora.gate_up_a[:, e],
                lora.gate_up_b[:, e],
                lora,
                lora.gate_up_b if fault == "lora_b_unmasked" else None,
            )
        act = activate(h, moe.activation)
        if hd is not h:
            act = act + activate(hd, moe.activation)
        act = act.to(x.dtype).float()
        y = act @ w_down[e].float().T
        if b_down is not None:
            y += b_down[e].float()
        yd = torch.zeros_like(y) if fault in ("topk_weight_twice", "topk_weight_missing") else y
        if lora is not None:
            add_slot_deltas(yd, act, es, lora.down_a[:, e], lora.down_b[:, e], lora)
        if yd is not y:
            y = y + yd * (we if fault == "topk_weight_twice" else 1.0 / we)
        y = y * we
        out.index_add_(0, t_idx, y[t_idx] if all_rows else y)
    return out.to(x.dtype)
