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
            inner = {
                "qkv": s.H + (3 * 4 if lora else 0),
                "o": s.heads * s.d,
                "router": s.H,
                "lm_head": s.H,
                "gate_up": s.H + (4 if lora else 0),
                "down": s.I + (4 if lora else 0),
                "qkv shrink": s.H,
                "o expand": 4,
                "gate_up shrink": s.H,
                "down shrink": s.I,
            }[name]
            assert flops == 2 * out.numel() * inner, name
    # balanced routing: every expert gets T*K/E rows
    assert fwd.w[0]["xe"].shape[:2] == (s.E, s.T * s.K // s.E)


# the smallest run main() measures on a CPU: two 8-token prompts, one timed rep, a rank-4 LoRA
SMALL_CPU = ["--device", "cpu", "--batch", "2", "--seq", "8", "--reps", "1", "--warmup", "0", "--rank", "4"]


def test_main_reports_base_and_lora_on_cpu(capsys):
    res = sol_forward.main(["--models", "tiny-qwen3-moe", "--layers", "1", *SMALL_CPU])
    (r,) = res
    assert r["base_tokens_per_s"] > 0 and r["lora_tokens_per_s"] > 0 and r["floor_ms"] > 0
    assert "lm_head" in capsys.readouterr().out


# -- the hybrids (benchmarks/sol_hybrid.py) ------------------------------------------------------------------------


def _inner(s, r: int) -> dict:
    """The contracted dimension of each hybrid product at shapes ``s`` with LoRA rank ``r`` (0: base)."""
    from benchmarks.sol_hybrid import GDN_CHUNK

    C_gdn, C_ssd = min(GDN_CHUNK, s.S), min(s.mamba.get("chunk", 1), s.S)
    g, mb = s.gdn, s.mamba
    return {
        "qkv": s.H + 3 * r,
        "qkv shrink": s.H,
        "o": s.heads * s.d,
        "o expand": r,
        "router": s.H,
        "gdn in_proj": s.H,
        "gdn [k|q] k^T": g.get("dk"),
        "gdn T [k|v]": C_gdn,
        "gdn [w|q] S": g.get("dk"),
        "gdn k^T v'": C_gdn,
        "gdn (q k^T) v'": C_gdn,
        "gdn out_proj": g.get("nv", 0) * g.get("dv", 0),
        "mamba in_proj": s.H,
        "ssd C B^T": mb.get("N"),
        "ssd (C B^T) x": C_ssd,
        "ssd B^T x": C_ssd,
        "ssd C S": mb.get("N"),
        "mamba out_proj": mb.get("nh", 0) * mb.get("P", 0),
        "mlp up": s.H,
        "mlp down": s.mlp,
        "gate_up": s.He + r,
        "up": s.He + r,
        "gate_up shrink": s.He,
        "up shrink": s.He,
        "down": s.I + r,
        "down shrink": s.I,
        "fc1_latent_proj": s.H,
        "fc2_latent_proj": s.latent,
        "shared gate_up": s.H,
        "shared up": s.H,
        "shared down": s.shared,
        "lm_head": s.H,
    }


def _latent_nemotron():
    """Nemotron-Super's layer kinds and latent MoE at sizes a CPU test runs (its real experts are 5.6 GB a layer)."""
    from benchmarks.sol_hybrid import HybridShapes

    return HybridShapes(
        model="latent",
        family="nemotron_h",
        T=24,
        B=2,
        S=12,
        H=40,
        V=96,
        kinds=[("mamba",), ("moe",), ("attn",), ("moe",)],
        E=6,
        I=20,
        K=3,
        heads=4,
        kv_heads=2,
        d=8,
        shared=28,
        latent=16,
        mamba=dict(nh=4, P=8, ng=2, N=12, chunk=8),
    )


@pytest.mark.parametrize("model", ["tiny-qwen3.5-moe", "tiny-nemotron-h", "latent"])
def test_hybrid_flops_match_the_products_run(model):
    from benchmarks import sol_hybrid

    s = _latent_nemotron() if model == "latent" else sol_hybrid.hybrid_shapes(model, batch=2, seq=8, layers=None)
    fwd = sol_hybrid.HybridForward(s, rank=4, device="cpu", dtype=torch.float32)
    for lora in (False, True):
        ops = fwd.gemms(lora)
        assert ("down shrink" in ops) == lora and ("qkv shrink" in ops) == lora
        assert not any(n.endswith("shrink") for n in ops if n.split()[0] in ("gdn", "mamba", "ssd", "shared", "mlp"))
        inner = _inner(s, 4 if lora else 0)
        for name, (fn, flops) in (ops | {"lm_head": fwd.lm_head_op()}).items():
            out = fn()
            if name == "attention":
                assert flops == 2 * 2 * out.numel() * s.S // 2, name
                continue
            assert flops == 2 * out.numel() * inner[name], name
    # the q|k|v GEMM of Qwen3.5 carries the output gate: q twice
    if model == "tiny-qwen3.5-moe":
        assert fwd.gemms(False)["qkv"][0]().shape[1] == 2 * s.heads * s.d + 2 * s.kv_heads * s.d
    if model == "latent":  # the experts run in the latent dim, the shared expert in the hidden dim
        assert fwd.gemms(True)["up"][0]().shape == (s.E, s.m, s.I)
        assert fwd.gemms(True)["down"][0]().shape == (s.E, s.m, s.latent)


@pytest.mark.parametrize("model", ["tiny-qwen3.5-moe", "tiny-nemotron-h", "latent"])
def test_hybrid_call_runs_each_product_once_per_layer_of_its_kind(model):
    from benchmarks import sol_hybrid

    s = _latent_nemotron() if model == "latent" else sol_hybrid.hybrid_shapes(model, batch=2, seq=8, layers=None)
    fwd = sol_hybrid.HybridForward(s, rank=4, device="cpu", dtype=torch.float32)
    calls: dict = {}
    for lora in (False, True):
        ops = fwd.gemms(lora)
        for name, (fn, flops) in list(ops.items()):
            ops[name] = (
                (
                    lambda name=name, fn=fn, lora=lora: (
                        calls.__setitem__((lora, name), calls.get((lora, name), 0) + 1) or fn()
                    )
                ),
                flops,
            )
        fwd.call(lora)
        for name in ops:
            assert calls[(lora, name)] == fwd.count(name), name
    kinds = {k for ks in s.kinds for k in ks}
    assert fwd.count("down") == sum("moe" in ks for ks in s.kinds) and "moe" in kinds
    assert fwd.floor_bytes() > 0


def test_super_runs_at_the_depth_that_fits_one_h200():
    from benchmarks import sol_hybrid

    full = sol_hybrid.hybrid_shapes("nemotron-3-super-120b-a12b", 8, 512, None)
    w, lora = sol_hybrid.weight_bytes(full, 32)
    assert 235e9 < w < 245e9  # 120B parameters in bf16 (the embedding, lm_head and every layer; no MTP layer)
    n = sol_hybrid.fit_depth("nemotron-3-super-120b-a12b", 8, 512, 32, sol_hybrid.FIT_GB * 1e9)
    assert n == 43
    w, lora = sol_hybrid.weight_bytes(sol_hybrid.hybrid_shapes("nemotron-3-super-120b-a12b", 8, 512, n), 32)
    assert w + lora <= sol_hybrid.FIT_GB * 1e9
    assert sol_hybrid.hybrid_shapes("nemotron-3-super-120b-a12b", 8, 512, n).m == 8 * 512 * 22 // 512


def test_main_reports_every_family_on_cpu(capsys):
    res = sol_forward.main(["--models", "tiny-qwen3-moe", "tiny-qwen3.5-moe", "tiny-nemotron-h", *SMALL_CPU])
    assert [r["model"] for r in res] == ["tiny-qwen3-moe", "tiny-qwen3.5-moe", "tiny-nemotron-h"]
    assert all(r["base_tokens_per_s"] > 0 and r["lora_tokens_per_s"] > 0 and r["floor_ms"] > 0 for r in res)
    out = capsys.readouterr().out
    assert "gdn [w|q] S" in out and "ssd C S" in out and "shared up" in out


def test_hybrid_floor_bytes_by_hand():
    """The latent shape's floor, term by term (fp32: 4 bytes): T 24, H 40, one mamba, two MoE, one attention layer."""
    from benchmarks import sol_hybrid

    fwd = sol_hybrid.HybridForward(_latent_nemotron(), rank=4, device="cpu", dtype=torch.float32)
    T, H, el = 24, 40, 4
    norms = 5 * 4 * T * H * el  # one per layer + the final one
    moe = 2 * (3 * T * 16 * el + T * H * el)  # top-k sum in the latent dim + the shared expert's add
    di, xbc, chunks = 4 * 8, 4 * 8 + 2 * 2 * 12, 2  # d_inner, x|B|C channels, ceil(12 / 8)
    mamba = (
        2 * T * xbc * el
        + T * xbc * el
        + T * 4 * 4
        + T * di * el  # conv; scan inputs, dt (fp32), output
        + 2 * 2 * 4 * chunks * 12 * 8 * el  # the state, written and read once per chunk of each head
        + 3 * T * di * el
    )  # gated RMSNorm
    assert fwd.floor_bytes() == norms + moe + mamba  # Nemotron's attention layer adds nothing (no rope, no gate)


def test_padded_rows_are_the_runtime_blocks_at_spread_routing():
    """--expert-rows padded: the rows the runtime's routing blocks run at evenly spread routing, per expert, rounded
    up: above the balanced T*K/E (Qwen3's 256 rows pad ~12 %), below one whole block more; the same at one seed."""
    m = sol_forward.padded_rows(4096, 128, 8)
    assert 256 < m < 256 + 128 and m == sol_forward.padded_rows(4096, 128, 8)
    assert 512 < sol_forward.padded_rows(4096, 32, 4) < 512 * 1.1  # gpt-oss: 512 rows an expert pad ~6 %
    assert sol_forward.padded_rows(4096, 256, 8) > 128 * 1.15  # Qwen3.5: 128 rows an expert pad ~24 %


@pytest.mark.parametrize("model", ["tiny-qwen3-moe", "tiny-nemotron-h"])
def test_main_runs_the_padded_expert_rows(model, capsys):
    (r,) = sol_forward.main(["--models", model, "--layers", "2", "--expert-rows", "padded", *SMALL_CPU])
    assert r["lora_tokens_per_s"] > 0
    assert "padded as the runtime's blocks pad evenly spread routing: +" in capsys.readouterr().out


def test_expert_rows_pad_each_group_and_halve_half_used_last_blocks():
    counts = [0, 1, 64, 65, 128, 129, 256, 300]
    # half: 0, 64, 64, 128, 128, 128 + 64, 256, 256 + 64; whole blocks: 0, 128, 128, 128, 128, 256, 256, 384
    assert sol_forward.expert_rows(counts, 128, True) == 1152
    assert sol_forward.expert_rows(counts, 128, False) == 1408
    assert sol_forward.expert_rows([16] * 5, 16, True) == 80  # full blocks only: no padding either way
    assert sol_forward.expert_rows([1, 17], 16, True) == 48  # 16-row blocks have no half-height tiles (half_tail)
