"""Inside a hybrid mixer that ``lpdiff bisect`` named (commands/bisect.py drill): the first of its sub-steps that
leaves HF + PEFT. A Mamba-2 or Gated DeltaNet layer's mixer is re-run once more, at TP 1, with every sub-step's output
captured in both engines (HF: engines/hf_steps.py; the triton runtime: its mixers' ``trace``), on the same mixer
input (HF's) and the same batch as the module comparison (so a fault that needs a packed neighbour still shows).
Each step's error is relative to HF's own output of that step; the steps are compared in data-flow order, base
weights for a "mamba" / "linear_attention" finding, the adapter's delta for a "_lora" one, and the first above
``factor`` x the module noise floor and above STEP_SHARE of the module's error is named (the steps after it inherit
its error).

  mamba             in_proj (z|xBC|dt), conv1d (x|B|C after the causal conv + SiLU), ssd_scan (the chunked scan,
                    its state carried within each prompt), d_skip (D * x), gated_norm (RMSNorm with groups,
                    x * silu(z)), out_proj
  linear_attention  in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, conv1d (q|k|v after the causal conv + SiLU),
                    gate (g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)), delta_rule (the chunked gated
                    delta rule, its state carried within each prompt), gated_norm (RMSNorm x silu(z)), out_proj

A fault only a TP > 1 run commits (a rank's share of a norm group) leaves every TP-1 step within noise: the module
stands as found, with no step named.
"""

from __future__ import annotations

import torch

STEPS = {
    "mamba": ("in_proj", "conv1d", "ssd_scan", "d_skip", "gated_norm", "out_proj"),
    "linear_attention": (
        "in_proj_qkv",
        "in_proj_z",
        "in_proj_b",
        "in_proj_a",
        "conv1d",
        "gate",
        "delta_rule",
        "gated_norm",
        "out_proj",
    ),
}


# a step whose error is under this share of its module's is not where the module's error comes from, whatever the
# noise floor: a diverging step's error was 0.41-36x its mixer's over every step of both mixers on the tiny zoo
# (one weight of each step moved, tests/harness/commands/test_bisect_steps.py; the hybrid faults 0.5-25x), while
# fp32 rounding grows with width and sequence length and could pass a fixed floor before the step at fault
STEP_SHARE = 0.01


def mixer_of(module: str) -> str | None:
    """The mixer kind with sub-steps that a bisect module name ("mamba", "linear_attention_lora" ...) is, or None."""
    kind = module.removesuffix("_lora")
    return kind if kind in STEPS else None


def rel(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor) -> float:
    den = float(scale.float().norm())
    return float((a.float() - b.float()).norm()) / max(den, 1e-30)


def step_errors(got: dict, ref: dict, layer: int, kind: str) -> dict[str, float]:
    """Two captures' sub-steps of one mixer -> {step: error on the base weights, step + "_lora": the adapter's
    delta's error relative to the reference step's full output}, in data-flow order."""
    err: dict[str, float] = {}
    for step in STEPS[kind]:
        p = f"{kind}.{step}"
        for k in (p, p + "_base"):
            if (layer, k) not in ref or (layer, k) not in got:
                raise RuntimeError(f"no {k} of layer {layer} was captured (both engines trace every step of {kind})")
        out, base, r, r_base = got[layer, p], got[layer, p + "_base"], ref[layer, p], ref[layer, p + "_base"]
        err[step] = rel(base, r_base, r_base)
        err[step + "_lora"] = rel(out - base, r - r_base, r)
    return err


def first_step(errors: dict[str, float], kind: str, lora: bool, limit: float) -> tuple[str, float] | None:
    """The first step (in data-flow order) of the base weights, or of the adapter's delta, above ``limit``."""
    for step in STEPS[kind]:
        e = errors[step + "_lora" if lora else step]
        if not e <= limit:  # NaN counts as above
            return step, e
    return None
