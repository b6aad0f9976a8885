"""Nemotron-H's Mamba-2 mixer over a packed batch: in_proj (with LoRA) -> z | xBC | dt; causal depthwise conv1d +
SiLU over xBC; the chunked SSD scan with dt = clamp(softplus(dt + dt_bias), time_step_min) and the D skip; the gated
RMSNorm with groups (x * silu(z)); out_proj (with LoRA). Under TP each rank holds whole heads with their groups
(nemotron_h_weights.mamba_rows), so conv and scan run on local columns; the gated norm too, unless a group spans
ranks (TP > n_groups: one all-reduce of its sums of squares); out_proj's output is all-reduced.

Per-prompt reset: on the kernels (impl triton: CUDA, or the interpreter) conv and scan take the packed tokens with
the batch's positions / cu_seqlens (kernels/ssd_varlen.py); on the torch path they read them as a right-padded
(B, L_max) batch (Batch.pad), one prompt per row (kernels/ssd.py). Either way no conv window and no scan state
crosses a prompt boundary, and padding after a prompt's end never reaches its real positions (both ops are causal).

The scan (the engine's ``mamba_scan`` option, scan_impl): "recurrence" runs kernels/ssd_varlen.py's token-by-token
kernel on the kernels path and kernels/ssd.py's chunked torch form otherwise; "chunked" runs mamba_ssm's chunked
Triton kernels (kernels/ssd_chunked.py; interpreted on CPU) on every run; "auto" picks "chunked" for bf16/fp16 on
CUDA only. fp32 runs keep the recurrence under "auto": fp32 runs exist for parity with HF+PEFT within 1e-4, which
the recurrence holds at ~1e-6; "chunked" asked for in fp32 runs IEEE dots (ssd_chunked.dot_env), 1.1e-5 max |d| on
the zoo model on CPU. In 16 bits the chunked kernels round the chunk states and y to the model dtype, which the
recurrence does not: options.py's mamba_scan comment has what that costs. The conv, the gated norm and the fault
paths are the same under every choice.
"""

from __future__ import annotations

import torch

from lpdiff.engines.triton.batch import Batch
from lpdiff.kernels import faults
from lpdiff.kernels._triton import device_const, resolve_impl
from lpdiff.kernels.gated_norm import gate_then_norm
from lpdiff.kernels.ssd import causal_conv1d, discretise_dt, ssd_scan
from lpdiff.kernels.ssd_chunked import ssd_scan_chunked
from lpdiff.kernels.ssd_varlen import causal_conv1d_varlen, ssd_scan_varlen


def _rows(batch: Batch, t: torch.Tensor, across: bool) -> torch.Tensor:
    """(T, ...) packed -> (B, L_max, ...) one prompt per row; ``across``: the whole pack as one row (a fault)."""
    return t[None] if across else batch.pad(t)


def _packed(batch: Batch, t: torch.Tensor, across: bool) -> torch.Tensor:
    return t[0] if across else batch.unpad(t)


def _group_sum(model, part: torch.Tensor) -> torch.Tensor:
    """(T,) sum of squares of this rank's share of its norm group -> the whole group's, when TP > n_groups: each
    rank writes its share into its group's column and one all-reduce sums the ranks of every group at once."""
    cfg, shard = model.cfg, model.shard
    group = shard.heads(cfg.mamba_heads, cfg.n_groups)[1].start
    sums = part.new_zeros(part.shape[0], cfg.n_groups)
    sums[:, group] = part
    return model.all_reduce(sums)[:, group]


def scan_impl(option: str, h: torch.Tensor) -> str:
    """The mamba_scan option (one of options.MAMBA_SCAN, checked once by TritonOptions) -> "chunked" or
    "recurrence" for a run whose activations look like ``h``."""
    if option == "auto":
        return "chunked" if h.is_cuda and h.dtype in (torch.bfloat16, torch.float16) else "recurrence"
    return option


def mamba_mixer(model, h: torch.Tensor, lay, batch: Batch, trace: dict | None = None) -> torch.Tensor:
    """h (T, H) normed -> (T, H) this rank's partial out_proj output. ``model``: the NemotronHModel (its config
    and LoRA-aware linear). ``trace`` (lpdiff bisect, TP 1): filled with each sub-step's output as (T, width),
    named as engines/hf_steps.py names transformers' (the D skip split out of the scan as D * x)."""
    cfg, p = model.cfg, lay.p
    heads = p["A"].shape[0]
    hd, n = cfg.mamba_head_dim, cfg.ssm_state
    inner = heads * hd
    groups = (p["conv_w"].shape[0] - inner) // (2 * n)
    T = h.shape[0]
    zxbcdt = model.linear(h, lay.mods["in_proj"], batch)
    z, xbc, dt = zxbcdt.split([inner, inner + 2 * groups * n, heads], dim=-1)
    tracing, trace = trace is not None, {} if trace is None else trace  # untraced: dict stores, nothing computed
    trace["in_proj"] = zxbcdt

    conv_across, across = faults.on("conv_across_prompts"), faults.on("state_not_reset")
    kernels = resolve_impl(model.impl, h) == "triton"
    if kernels:  # packed prompts straight into kernels/ssd_varlen.py; a fault's pack is one long prompt
        whole = device_const((0, T), h.device)
        pos = torch.arange(T, device=h.device) if conv_across else batch.positions
        xbc = causal_conv1d_varlen(
            xbc, p["conv_w"], p["conv_b"], pos, whole if conv_across else batch.cu_seqlens, "silu", impl="triton"
        )
    else:
        xbc = _packed(
            batch, causal_conv1d(_rows(batch, xbc, conv_across), p["conv_w"], p["conv_b"], "silu"), conv_across
        )
    trace["conv1d"] = xbc
    x, B, C = xbc.split([inner, groups * n, groups * n], dim=-1)
    x, B, C = x.reshape(T, heads, hd), B.reshape(T, groups, n), C.reshape(T, groups, n)
    dt = discretise_dt(dt, p["dt_bias"], cfg.dt_min)

    if scan_impl(model.mamba_scan, h) == "chunked":  # a fault's pack is one long prompt: one seq_idx for all
        seq_idx = torch.zeros_like(batch.seq) if across else batch.seq
        y = ssd_scan_chunked(x, dt, p["A"], B, C, p["D"], seq_idx, cfg.chunk_size)
    elif kernels:
        y = ssd_scan_varlen(x, dt, p["A"], B, C, p["D"], whole if across else batch.cu_seqlens, impl="triton")
    else:
        y = ssd_scan(
            _rows(batch, x, across),
            _rows(batch, dt, across),
            p["A"],
            _rows(batch, B, across),
            _rows(batch, C, across),
            cfg.chunk_size,
            p["D"],
        )
        y = _packed(batch, y, across)
    y = y.reshape(T, inner)
    if tracing:  # the D skip as HF's scan adds it (in fp32), the scan's share the rest
        trace["d_skip"] = (p["D"][:, None].float() * x.float()).reshape(T, inner)
        trace["ssd_scan"] = y.float() - trace["d_skip"]
    y = gate_then_norm(  # Zamba2RMSNormGated's rounding; one fused pass on CUDA with whole groups
        y,
        z,
        p["gate_norm"],
        cfg.mamba_inner // cfg.n_groups,
        cfg.rms_norm_eps,
        h.dtype,
        lambda part: _group_sum(model, part),
    )
    trace["gated_norm"] = y
    trace["out_proj"] = out = model.linear(y, lay.mods["out_proj"], batch)
    return out
