"""mamba_ssm's chunked SSD scan (kernels/ssd_chunked.py) with its 16-bit roundings, in torch on padded rows: a
stand-in for the compiled kernels where no GPU is (the Triton interpreter multiplies bf16 dot operands as raw bits,
kernels._triton.dot_flags), so that the end-to-end cost of those roundings can be measured on CPU
(benchmarks/ssd_rounding_noise.py). tests/kernels/test_ssd_chunked.py checks it against kernels/ssd.ssd_scan when it
rounds nothing, and (gpu1) that its error against the fp32 reference is the size of the real kernels'.

Where the kernels round to the model dtype (ssd_chunk_scan._chunk_scan_fwd_kernel, ssd_chunk_state.
_chunk_state_fwd_kernel, ssd_state_passing, every dot accumulating in fp32): the intra-chunk scores
C.B * decay * dt before their dot with x; B * decay-to-chunk-end * dt before its dot with x; the chunk states handed
on (out_dtype = C's dtype); y on the way out. x, B, C arrive already in the model dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lpdiff.kernels.ssd import segsum


def ssd_scan_rounded(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk: int,
    D: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """kernels/ssd.ssd_scan's arguments (x (b, l, h, p), dt (b, l, h), A (h,), B/C (b, l, g, n), D (h,)) -> y
    (b, l, h, p) in ``dtype``, each rounding point above rounded to ``dtype`` (float32: none)."""

    def r(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype).float()

    b, l, h, p = x.shape
    g = B.shape[2]
    pad = -l % chunk
    xf = x.float()
    Bf = B.float().repeat_interleave(h // g, dim=2)
    Cf = C.float().repeat_interleave(h // g, dim=2)
    dtf = dt.float()

    def chunks(t: torch.Tensor) -> torch.Tensor:  # (b, l, ...) -> (b, c, Q, ...), zero-padded at the end
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
        return t.view(b, -1, chunk, *t.shape[2:])

    xc, Bc, Cc = chunks(xf), chunks(Bf), chunks(Cf)
    a = chunks(A.float()[None, None, :] * dtf).permute(0, 3, 1, 2)  # (b, h, c, Q)
    dtc = chunks(dtf).permute(0, 3, 1, 2)
    a_cum = torch.cumsum(a, dim=-1)

    scores = torch.einsum("bcihn,bcjhn->bhcij", Cc, Bc) * torch.exp(segsum(a)) * dtc[..., None, :]
    y_diag = torch.einsum("bhcij,bcjhp->bcihp", r(scores), xc)

    to_end = (torch.exp(a_cum[..., -1:] - a_cum) * dtc).permute(0, 2, 3, 1)  # (b, c, Q, h)
    states = torch.einsum("bcjhn,bcjhp->bchpn", r(Bc * to_end[..., None]), xc)
    states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)
    chunk_decay = torch.exp(segsum(F.pad(a_cum[..., -1], (1, 0))))
    entering = r(torch.einsum("bhzc,bchpn->bzhpn", chunk_decay, states)[:, :-1])
    y_off = torch.einsum("bcihn,bchpn,bhci->bcihp", Cc, entering, torch.exp(a_cum))

    y = (y_diag + y_off).reshape(b, -1, h, p)[:, :l] + D.float()[:, None] * xf
    return y.to(dtype)
