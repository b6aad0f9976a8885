"""Training one zoo model (recipe steps 3 and 4 in zoo.py): AdamW on next-token loss plus the router terms
(margin, balance, z) read through ``RouterTap``, Nemotron's aux-loss-free bias update, then ``sharpen``."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from lpdiff.harness.build.zoo_configs import SEED, init_model

SEQ_LEN = 128


@dataclass(slots=True)
class TrainConfig:
    steps: int = 1000
    batch: int = 16
    lr: float = 3e-3
    warmup: int = 30
    weight_decay: float = 0.01
    balance_weight: float = 1.0
    margin_weight: float = 0.3
    margin_target: float = 1.0  # wanted u_k - u_k+1 (scores standardized over experts) per token and MoE layer
    router_z_weight: float = 1e-3  # mean(router logit^2): keeps sigmoid routers out of saturation
    bias_update_rate: float = 1e-4  # Nemotron's aux-loss-free correction-bias step
    target_entropy: float = 0.32  # conditioning: lm_head scaled until mean entropy = this x log V (train windows)
    seed: int = SEED

    def __post_init__(self):
        assert self.steps > 0 and self.batch > 0 and self.lr > 0 and self.margin_target > 0


class RouterTap:
    """Keeps the router logits of the current forward (with their graph) for the router loss terms."""

    def __init__(self, model):
        from lpdiff.harness.spec.routing import is_router

        self.routers = [m for m in model.modules() if is_router(m)]
        self.logits: list[tuple[torch.nn.Module, torch.Tensor]] = []
        self._handles = [m.register_forward_hook(self._hook) for m in self.routers]

    def _hook(self, module, args, output):
        logits = output[0] if isinstance(output, tuple) else output
        self.logits.append((module, logits.reshape(-1, logits.shape[-1])))

    def pop(self) -> list[tuple[torch.nn.Module, torch.Tensor]]:
        out, self.logits = self.logits, []
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


# softmax(3u) is close to the hard top-k choice (a 1-sigma gap is a factor e^3), so P_e tracks real expert usage;
# with softmax(u) the penalty for sending every token to the same two experts was too soft to stop it.
BALANCE_SHARPNESS = 3.0


def standardized(scores: torch.Tensor) -> torch.Tensor:
    """Router scores in units of their spread over experts, per token: free of the router's scale."""
    return (scores - scores.mean(-1, keepdim=True)) / (scores.std(-1, keepdim=True) + 1e-6)


def router_losses(taps, tc: TrainConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (balance, margin, z) averaged over MoE layers; zero for a dense model.

    Both read the standardized scores u, so that neither can be met by rescaling the router: margin is the hinge
    relu(target - (u_k - u_k+1)); balance is E * sum_e P_e^2, P_e the batch mean of softmax(BALANCE_SHARPNESS * u)_e
    (1 when usage is uniform). On raw probabilities (Switch's f_e * P_e, or P_e^2) a tiny-scale router with one
    fixed ranking met the balance term while every token went to the same experts."""
    from lpdiff.harness.spec.routing import choice_scores, topk_margin

    balance = margin = z = torch.zeros(())
    for module, logits in taps:
        logits = logits.float()
        u = standardized(choice_scores(module, logits))
        margin = margin + torch.relu(tc.margin_target - topk_margin(u, int(module.top_k))).mean()
        balance = balance + u.shape[-1] * torch.softmax(BALANCE_SHARPNESS * u, dim=-1).mean(0).pow(2).sum()
        z = z + logits.pow(2).mean()
    n = max(1, len(taps))
    return balance / n, margin / n, z / n


@torch.no_grad()
def update_correction_bias(taps, rate: float) -> None:
    """Aux-loss-free balancing (how Nemotron-H / DeepSeek-V3 train the bias): raise the bias of under-used
    experts, lower it for over-used ones."""
    from lpdiff.harness.spec.routing import choice_scores

    for module, logits in taps:
        bias = getattr(module, "e_score_correction_bias", None)
        if bias is None:
            continue
        chosen = choice_scores(module, logits.detach()).topk(int(module.top_k), dim=-1).indices
        load = torch.bincount(chosen.reshape(-1), minlength=bias.numel()).float()
        bias += rate * torch.sign(load.mean() - load)


def lr_at(step: int, tc: TrainConfig) -> float:
    if step < tc.warmup:
        return tc.lr * (step + 1) / tc.warmup
    t = (step - tc.warmup) / max(1, tc.steps - tc.warmup)
    return tc.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def train(name: str, stream: torch.Tensor, tc: TrainConfig, log_every: int = 50):
    """Seeded training of one zoo model from transformers' init; returns (model, log lines)."""
    model = init_model(name, tc.seed)
    model.train()
    gen = torch.Generator().manual_seed(tc.seed)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "router" not in n and ".gate." not in n]
    other = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "router" not in n and ".gate." not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": tc.weight_decay}, {"params": other, "weight_decay": 0}],
        lr=tc.lr,
        betas=(0.9, 0.95),
    )
    tap = RouterTap(model)
    log, t0 = [], time.time()
    for step in range(tc.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, tc)
        starts = torch.randint(0, stream.numel() - SEQ_LEN, (tc.batch,), generator=gen)
        x = torch.stack([stream[s : s + SEQ_LEN] for s in starts.tolist()])
        lm = model(input_ids=x, labels=x, use_cache=False).loss
        taps = tap.pop()
        balance, margin, z = router_losses(taps, tc)
        loss = lm + tc.balance_weight * balance + tc.margin_weight * margin + tc.router_z_weight * z
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        update_correction_bias(taps, tc.bias_update_rate)
        if step % log_every == 0 or step == tc.steps - 1:
            log.append(
                f"step {step:4d} lm {lm.item():.3f} balance {balance.item():.3f} "
                f"margin {margin.item():.3f} z {z.item():.2f} t {time.time() - t0:.0f}s"
            )
            print(f"[{name}] {log[-1]}", flush=True)
    tap.remove()
    model.eval()
    scale = sharpen(model, stream, tc.target_entropy, tc.seed)
    log.append(f"sharpen: lm_head x {scale:.4f}")
    return model, log


@torch.no_grad()
def sharpen(model, stream: torch.Tensor, target: float, seed: int, windows: int = 32) -> float:
    """Conditioning step: scale lm_head so that the mean next-token entropy on fixed training windows is
    ``target`` x log V. A few CPU minutes leave a ~1M-parameter model calibrated but unsure (entropy ~0.5 log V on
    held-out text); a logit temperature gives the peaked distributions of a trained LLM at a lower NLL cost than an
    entropy penalty during training (both measured; see docs/zoo.md)."""
    gen = torch.Generator().manual_seed(seed + 1)
    starts = torch.randint(0, stream.numel() - SEQ_LEN, (windows,), generator=gen).tolist()
    x = torch.stack([stream[s : s + SEQ_LEN] for s in starts])
    logits = model(input_ids=x, use_cache=False).logits.float()
    want = target * math.log(logits.shape[-1])

    def entropy(s: float) -> float:
        logp = (logits * s).log_softmax(-1)
        return float(-(logp.exp() * logp).sum(-1).mean())

    lo, hi = 0.25, 8.0
    for _ in range(40):  # entropy falls monotonically with the scale
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if entropy(mid) > want else (lo, mid)
    scale = round((lo + hi) / 2, 4)
    model.lm_head.weight.mul_(scale)
    return scale
