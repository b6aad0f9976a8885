"""benchmarks/sol_forward.py (the forward's speed of light at a model's shapes) on CPU on the tiny zoo: every
product runs, and the FLOPs it reports per product are those of the shapes it actually multiplies."""
from __future__ import annotations

import pytest
import torch

from benchmarks import sol_forward


@pytest.mark.parametrize("model", ["tiny-qwen3-moe", "tiny-gpt-oss"])
@pytest.mark.parametrize("dense_experts", [False, True])
def test_flops_match_the_products_run(model, dense_experts):
    sol = sol_forward
    s = sol.shapes_of(model, batch=2, seq=8, layers=1)
    fwd = sol.SolForward(s, rank=4, device="cpu", dtype=torch.float32, dense_experts=dense_experts)
    for lora in (False, True):
        ops = fwd.gemms(lora)
        assert ("gate_up shrink" in ops) == lora
        for name, (fn, flops) in (ops | {"lm_head": fwd.lm_head_op()}).items():
            out = fn()
            if name == "attention":  # causal: half of the two (S x S) products per head
                assert flops == 2 * 2 * out.numel() * s.S // 2, name
                continue
            inner = {"qkv": s.H + (3 * 4 if lora else 0), "o": s.heads * s.d, "router": s.H, "lm_head": s.H,
                     "gate_up": s.H + (4 if lora else 0), "down": s.I + (4 if lora else 0), "qkv shrink": s.H,
                     "o expand": 4, "gate_up shrink": s.H, "down shrink": s.I}[name]
            assert flops == 2 * out.numel() * inner, name
    # balanced routing: every expert gets T*K/E rows
    assert fwd.w[0]["xe"].shape[:2] == (s.E, s.T * s.K // s.E)


def test_main_reports_base_and_lora_on_cpu(capsys):
    res = sol_forward.main(["--models", "tiny-qwen3-moe", "--device", "cpu", "--layers", "1", "--batch", "2",
                       "--seq", "8", "--reps", "1", "--warmup", "0", "--rank", "4"])
    (r,) = res
    assert r["base_tokens_per_s"] > 0 and r["lora_tokens_per_s"] > 0 and r["floor_ms"] > 0
    assert "lm_head" in capsys.readouterr().out
