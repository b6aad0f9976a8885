"""The init recipes of the full-size catalog models side by side: per model and recipe, the build time, how peaked
the next-token distributions are, how decisive the routers are (fp32 and with a merged random adapter), and what
bf16 does to routing and logprobs. Definitions as in docs/zoo.md's measured table.

GPU, one H100 (all five models x both recipes at the default depth, 4 layers / Nemotron 8; estimated 1-2 minutes,
not yet timed on a GPU: per model two builds of up to ~12B parameters (Nemotron-Super's 512 latent experts, 45 GB
once cast to fp32), four 512-token forwards, one merged adapter; the narrowed CPU run takes ~5 s):

    HF_HUB_OFFLINE=1 python -m benchmarks.init_recipe --device cuda
    # -> benchmarks/results/init_recipe.csv; options: --models NAME.. --recipes R.. --layers N --prompts 8
    #    --length 64 --no-adapted --out PATH

Per model: 8 random-token prompts of 64 tokens (seeded); the model is built in bf16 by the catalog
(``load_hf_model``, timed: build_s), run in bf16, cast to fp32 in place (the same bf16-representable weights the
catalog's fp32 build holds) and run again. Columns:
  entropy_over_logv     mean next-token entropy of the fp32 run / log V
  margin_p1/p10/p50     per token and MoE layer, k-th minus (k+1)-th router choice score (harness/spec/routing.py:
                        logits for softmax routers, sigmoid + correction bias for Nemotron), fp32 run
  ratio_p1/p10/p50      that margin / bf16 spacing at the k-th score (rounding the score moves it by <= half)
  flip_share            share of (token, MoE layer) whose chosen expert set differs between the bf16 and fp32 runs
  bf16_k2, bf16_max_d   0.5 mean(d^2) and max |d|, d = logprob_bf16 - logprob_fp32 of the actual next tokens
                        (harness/pipeline/metrics.py's k2)
  adapted_ratio_p1/p10  ratio percentiles of the fp32 model with a random rank-8 delta merged into every decoder
                        weight but the routers, RMS 0.2 x the weight's (the size rule of lpdiff's generated adapters,
                        harness/spec/adapters/generate.py; merged here as a stand-in because only the hidden states
                        it moves matter to routing, and PEFT at full size would cost minutes)
  adapted_route_change  share of (token, MoE layer) whose expert set that delta changes (fp32)
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import sys
import time
from pathlib import Path

import torch

from lpdiff.harness.spec.catalog import FULL_CONFIGS, INIT_RECIPES, get_model, load_hf_model
from lpdiff.harness.types import ModelSpec

OUT = Path(__file__).resolve().parent / "results" / "init_recipe.csv"
COLUMNS = (
    "model",
    "layers",
    "recipe",
    "device",
    "build_s",
    "entropy_over_logv",
    "margin_p1",
    "margin_p10",
    "margin_p50",
    "ratio_p1",
    "ratio_p10",
    "ratio_p50",
    "flip_share",
    "bf16_k2",
    "bf16_max_d",
    "adapted_ratio_p1",
    "adapted_ratio_p10",
    "adapted_route_change",
)
ADAPTER_RANK, ADAPTER_SCALE = 8, 0.2


def default_layers(name: str) -> int:
    """4, or 8 for Nemotron (its first 4 layers hold only 2 MoE layers and no attention)."""
    return 8 if name.startswith("nemotron") else 4


def prompts(vocab: int, n: int, length: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=g)


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def forward_stats(model, ids: torch.Tensor) -> dict:
    """zoo_measure's statistics (next-token entropies, actual-token logprobs, router choice scores per MoE layer) on
    equal-length prompts, with log V."""
    from lpdiff.harness.build.zoo_measure import forward_stats as stats

    return {**stats(model, ids.tolist()), "log_v": math.log(model.get_output_embeddings().weight.shape[0])}


def _sets(scores: torch.Tensor, k: int) -> torch.Tensor:
    return scores.topk(k, -1).indices.sort(-1).values


def router_stats(stats: dict) -> dict[str, torch.Tensor]:
    """Margins, margin / bf16 spacing at the k-th score, over every (token, MoE layer)."""
    from lpdiff.harness.build.zoo_measure import bf16_ulp
    from lpdiff.harness.spec.routing import topk_margin

    margins, ratios = [], []
    for s, k in stats["routers"]:
        m = topk_margin(s, k)
        margins.append(m)
        ratios.append(m / bf16_ulp(s.topk(k, -1).values[:, -1]))
    return {"margin": torch.cat(margins), "ratio": torch.cat(ratios)}


def changed_share(a: dict, b: dict) -> float:
    """Share of (token, MoE layer) whose chosen expert set differs between two runs."""
    diff = [(_sets(sa, k) != _sets(sb, k)).any(-1).float() for (sa, k), (sb, _) in zip(a["routers"], b["routers"])]
    return float(torch.cat(diff).mean())


@torch.no_grad()
def merge_random_adapter(model, seed: int = 0, rank: int = ADAPTER_RANK, scale: float = ADAPTER_SCALE) -> int:
    """Add a random rank-``rank`` delta of RMS ``scale`` x the weight's to every decoder matrix (3D experts per
    expert) except the routers, the shared-expert gate and the convolutions; -> how many tensors changed."""
    from lpdiff.harness.spec.routing import is_router

    skip = {id(p) for m in model.modules() if is_router(m) for p in m.parameters()}
    g = torch.Generator().manual_seed(seed)
    n = 0
    for name, p in model.named_parameters():
        if p.dim() < 2 or ".layers." not in name or id(p) in skip or "conv1d" in name or "expert_gate" in name:
            continue
        w = p.data.view(-1, *p.shape[-2:])
        rows, cols = w.shape[-2:]
        b_std = scale * float(w.float().pow(2).mean().sqrt()) * math.sqrt(cols / rank)
        for e in range(w.shape[0]):
            a = (torch.randn(rank, cols, generator=g) / math.sqrt(cols)).to(w.device, w.dtype)
            b = (torch.randn(rows, rank, generator=g) * b_std).to(w.device, w.dtype)
            w[e] += b @ a
        n += 1
    return n


def _pct(x: torch.Tensor, q: float) -> float:
    x = x.double().flatten().cpu()
    return float(torch.quantile(x, q / 100)) if x.numel() else float("nan")


def measure(spec: ModelSpec, device: str, ids: torch.Tensor, adapted: bool = True) -> dict:
    """One CSV row: build (timed), bf16 run, the same weights in fp32, optionally the merged random adapter."""
    _sync(device)
    t0 = time.perf_counter()
    model = load_hf_model(spec, torch.bfloat16, device)
    _sync(device)
    build_s = time.perf_counter() - t0
    ids = ids.to(device)
    b16 = forward_stats(model, ids)
    model.to(torch.float32)
    f32 = forward_stats(model, ids)
    row = {
        "model": spec.name,
        "layers": spec.num_layers,
        "recipe": spec.init_recipe,
        "device": torch.cuda.get_device_name() if torch.device(device).type == "cuda" else "cpu",
        "build_s": round(build_s, 2),
        "entropy_over_logv": float(f32["entropy"].mean()) / f32["log_v"],
    }
    d = (b16["logprobs"] - f32["logprobs"]).double()
    row.update(bf16_k2=float(0.5 * (d * d).mean()), bf16_max_d=float(d.abs().max()))
    r = router_stats(f32)
    for q in (1, 10, 50):
        row[f"margin_p{q}"] = _pct(r["margin"], q)
        row[f"ratio_p{q}"] = _pct(r["ratio"], q)
    row["flip_share"] = changed_share(b16, f32)
    if adapted:
        merge_random_adapter(model)
        a32 = forward_stats(model, ids)
        ra = router_stats(a32)["ratio"]
        row.update(
            adapted_ratio_p1=_pct(ra, 1), adapted_ratio_p10=_pct(ra, 10), adapted_route_change=changed_share(a32, f32)
        )
    del model, b16, f32
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return row


def run(
    specs: list[ModelSpec],
    recipes,
    device: str,
    n_prompts: int = 8,
    length: int = 64,
    adapted: bool = True,
    out: Path | None = OUT,
    log=print,
) -> list[dict]:
    """Every spec under every recipe; rows written to ``out`` (CSV, replaced) when given."""
    from lpdiff.harness.spec.catalog import hf_config

    if torch.device(device).type == "cuda":  # the fp32 runs are the reference: IEEE fp32, as the hf engine runs it
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    rows = []
    for spec in specs:
        t0 = time.perf_counter()
        ids = prompts(hf_config(spec).vocab_size, n_prompts, length)
        for recipe in recipes:
            row = measure(dataclasses.replace(spec, init_recipe=recipe), device, ids, adapted)
            rows.append(row)
            log(
                f"[init_recipe] {spec.name} x{spec.num_layers} {recipe}: build {row['build_s']:.1f}s, entropy/logV "
                f"{row['entropy_over_logv']:.2f}, margin/bf16 p1 {row['ratio_p1']:.3g}, flips "
                f"{row['flip_share']:.2%}, k2 {row['bf16_k2']:.2e}"
                + (f", adapted p1 {row['adapted_ratio_p1']:.3g}" if adapted else "")
            )
        log(f"[init_recipe] {spec.name}: {time.perf_counter() - t0:.1f}s")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=COLUMNS)
            w.writeheader()
            for row in rows:
                w.writerow({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in row.items()})
        log(f"[init_recipe] wrote {out}")
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.init_recipe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(FULL_CONFIGS), choices=list(FULL_CONFIGS))
    ap.add_argument("--recipes", nargs="+", default=list(INIT_RECIPES), choices=list(INIT_RECIPES))
    ap.add_argument("--layers", type=int, default=None, help="depth (default 4, Nemotron 8)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--no-adapted", action="store_true", help="skip the merged random adapter")
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args(argv)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda: no GPU visible; pass --device cpu (full-size models need ~30-90 GB)")
    specs = [get_model(m, num_layers=a.layers or default_layers(m)) for m in a.models]
    return run(specs, a.recipes, a.device, a.prompts, a.length, not a.no_adapted, a.out)


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
