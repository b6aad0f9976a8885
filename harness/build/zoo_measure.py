"""What the zoo's models are measured by (docs/zoo.md's table): entropy vs log V, router margins vs bf16 rounding
and measured bf16 noise, and bf16-vs-fp32 logprob noise on a prompt set."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import cast

import torch

from lpdiff.harness.build.zoo_train import RouterTap
from lpdiff.harness.spec.catalog import ZOO_DIR


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """Spacing of bf16 numbers at |x| (8 significant bits): rounding moves a value by up to half of this."""
    e = torch.floor(torch.log2(x.abs().clamp_min(1e-30)))
    return torch.exp2(e - 7)


@torch.no_grad()
def forward_stats(model, prompts: list[list[int]]) -> dict:
    """One right-padded batch (padding after a causal prompt changes none of its positions): next-token entropies
    and actual-token logprobs over all real positions, and per MoE layer the router choice scores (N, E), top-k.
    Runs on the model's device."""
    from lpdiff.harness.spec.routing import choice_scores

    device = next(model.parameters()).device
    lens = torch.tensor([len(p) for p in prompts], device=device)
    ids = torch.zeros(len(prompts), int(lens.max()), dtype=torch.int64, device=device)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p, device=device)
    real = torch.arange(ids.shape[1], device=device)[None] < lens[:, None]  # (B, T)
    tap = RouterTap(model)
    try:
        logp = model(input_ids=ids, use_cache=False).logits[:, :-1].float().log_softmax(-1)
        # top_k: an int attribute of every MoE router, which nn.Module's __getattr__ types as Tensor | Module
        routers = [(choice_scores(m, lg)[real.flatten()], cast(int, m.top_k)) for m, lg in tap.pop()]
    finally:
        tap.remove()
    pred = real[:, 1:]  # positions with a real next token
    entropy = -(logp.exp() * logp).sum(-1)
    actual = logp.gather(-1, ids[:, 1:, None])[..., 0]
    return {"entropy": entropy[pred], "logprobs": actual[pred], "routers": routers}


def _pct(x: torch.Tensor, qs=(1, 10, 50)) -> dict[str, float]:
    x = x.double().flatten()
    return {f"p{q}": float(torch.quantile(x, q / 100)) for q in qs}


def measure(name: str, set_name: str = "default", path: Path | None = None) -> dict:
    """Entropy vs log V, router margins vs bf16 rounding and vs measured bf16 noise, bf16-vs-fp32 logprob noise."""
    from transformers import AutoModelForCausalLM

    from lpdiff.harness.spec.prompts import prompt_set
    from lpdiff.harness.spec.routing import topk_margin

    path = path or ZOO_DIR / name
    prompts = prompt_set(name, set_name)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    n_params = sum(p.numel() for p in model.parameters())
    f32 = forward_stats(model, prompts)
    # loaded again rather than cast: from_pretrained honours the modules a model keeps in fp32
    b16 = forward_stats(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval(), prompts)
    d = b16["logprobs"] - f32["logprobs"]
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    out = {
        "name": name,
        "prompt_set": set_name,
        "positions": int(d.numel()),
        "params": n_params,
        "vocab": vocab,
        "log_v": math.log(vocab),
        "entropy_mean": float(f32["entropy"].mean()),
        "nll_mean": float(-f32["logprobs"].mean()),
        "bf16_k2": float(0.5 * (d**2).mean()),
        "bf16_max_abs": float(d.abs().max()),
    }
    if f32["routers"]:
        margins, ratios, noise, flips, load = [], [], [], [], []
        for (s32, k), (s16, _) in zip(f32["routers"], b16["routers"]):
            counts = torch.bincount(s32.topk(k, -1).indices.flatten(), minlength=s32.shape[-1]).float()
            load.append(counts / counts.mean())
            m = topk_margin(s32, k)
            kth = s32.topk(k, dim=-1).values[:, -1]
            margins.append(m)
            ratios.append(m / bf16_ulp(kth))
            noise.append((s16 - s32).abs().max(dim=-1).values)
            same = (s32.topk(k, -1).indices.sort(-1).values == s16.topk(k, -1).indices.sort(-1).values).all(-1)
            flips.append((~same).float())
        margin, ratio, noise_all, flip = map(torch.cat, (margins, ratios, noise, flips))
        out.update(
            {
                "router_positions": int(margin.numel()),
                "margin": _pct(margin),
                "margin_over_bf16_ulp": _pct(ratio),
                "bf16_score_noise": _pct(noise_all, (50, 99, 100)),
                "margin_below_noise_p99": float((margin < torch.quantile(noise_all.double(), 0.99)).float().mean()),
                "routing_flip_rate": float(flip.mean()),
                "expert_load_min": float(torch.cat(load).min()),
                "expert_load_max": float(torch.cat(load).max()),
            }
        )
    return out


def markdown(rows: list[dict]) -> str:
    """The measured table of docs/zoo.md."""
    head = (
        "| model | params | vocab | entropy (nats) | entropy / log V | NLL | router margin p1 / p10 / p50 | "
        "margin / bf16 spacing p1 / p10 / p50 | bf16 score noise p99 / max | fp32-vs-bf16 expert-set flips | "
        "expert load min / max | bf16-vs-fp32 k2 | max abs d |\n" + "|---" * 13 + "|\n"
    )
    lines = []
    for r in rows:
        moe = "margin" in r
        fmt3 = (lambda d: " / ".join(f"{v:.3g}" for v in d.values())) if moe else (lambda d: "-")
        lines.append(
            f"| {r['name']} | {r['params']:,} | {r['vocab']} | {r['entropy_mean']:.2f} | "
            f"{r['entropy_mean'] / r['log_v']:.2f} | {r['nll_mean']:.2f} | {fmt3(r.get('margin'))} | "
            f"{fmt3(r.get('margin_over_bf16_ulp'))} | "
            + (
                f"{r['bf16_score_noise']['p99']:.3g} / {r['bf16_score_noise']['p100']:.3g} | "
                f"{r['routing_flip_rate']:.2%} | {r['expert_load_min']:.2f} / {r['expert_load_max']:.2f} | "
                if moe
                else "- | - | - | "
            )
            + f"{r['bf16_k2']:.2e} | {r['bf16_max_abs']:.3f} |"
        )
    return head + "\n".join(lines) + "\n"
