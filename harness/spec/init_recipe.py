"""Init recipe "peaked/v1" for config-built (full-size) MoE models: routers as decisive and next-token distributions
as peaked as a trained model's, set in closed form on the build device (one probe forward, no optimisation). It
starts from the default recipe's model (transformers' own init, bf16) and changes:

1. **Code subspace.** U = E + 1 orthonormal directions of the hidden space (one per expert slot, one constant
   "offset" channel). Every weight that adds into the residual stream (o_proj, out_proj, down_proj, the experts' down
   projection and biases, Nemotron-Super's fc2_latent_proj) is projected off U, so the residual stream's U
   coordinates stay the embedding's at every layer, whatever attention, mamba and the experts compute.
2. **Token codes.** Token v gets a random top-k set S_v (inside topk_group random groups where routing is grouped);
   its embedding's U coordinates are beta * (c_v, 1), c_v in U[1, 1.5] on S_v and 0 elsewhere. beta comes from the
   probe forward: the code unit is then >= ``kappa`` x the RMS of the normalised hidden state at every MoE layer
   (kappa 4 at full width, less where the code would hold over ``max_code_share`` of the hidden state's energy). A
   LoRA delta of the generator's default size (0.2 x the weight's RMS) moves a code coordinate by about 0.2 of that
   RMS: 1/20 of the gap, so adapted models route decisively too.
3. **Routers.** MoE layer l's row for expert e is (gap / kappa) * (u_pi_l(e) - o * u_offset) plus a unit context
   row (random, off U) times ``context`` x gap: the top-k set is pi_l^-1(S_v), about ``gap`` logits clear of the next
   expert at the deepest MoE layer (the spread of per-token RMS takes 5-15 % off at p1; shallow layers get more,
   the code holds more of their hidden state), and the weights still vary with the context. pi_l: a random
   group-preserving permutation per layer. Softmax routers: o = 0 (chosen logits from gap up, the rest ~0).
   Sigmoid routers (Nemotron): o = 1 (chosen scores from sigmoid(0) up, the rest sigmoid(-gap) or below).
   gpt-oss's router bias draws U(+-0.1 gap), Nemotron's correction bias U(+-0.02): real, below the margin.
4. **Output.** lm_head scaled so that its softmax over V has mean entropy ``entropy`` x log V on inputs of the
   final norm's output shape (RMS 1 through the final norm): the lm_head rows are i.i.d., so a token's entropy
   depends only on that norm, not on which hidden state it is.

The weights depend on forward numerics only through beta, rounded up to a power of sqrt(2) (a probe that differs in
its last bits on another GPU or library gives the same weights unless it sits at a grid point); the rest is the
seeded draws and float64 arithmetic. Deterministic per seed and device type. Bump PEAKED's version with any change.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

PEAKED = "peaked/v1"
_CHUNK = 1 << 22  # elements per float64 block (32 MiB): a 35B model leaves little GPU memory beside its weights


@dataclass(slots=True, frozen=True)
class PeakedParams:
    kappa: float = 4.0  # code unit / RMS of the normalised hidden state, at least, at every MoE layer
    max_code_share: float = 0.5  # kappa is lowered where the code would hold more of the hidden state's energy
    gap: float = 2.0  # router logits per code unit at kappa
    context: float = 0.1  # context part of the router logits: std at most this x gap
    entropy: float = 0.35  # mean next-token entropy / log V (the tiny zoo's trained models: 0.33-0.34)
    probe_batch: int = 4
    probe_len: int = 64

    def __post_init__(self):
        assert self.kappa > 0 and 0 < self.max_code_share < 1 and self.gap > 0, self
        assert 0 <= self.context < 0.25, "a context part near the gap would bring near-ties back"
        assert 0 < self.entropy < 1 and self.probe_batch >= 1 and self.probe_len >= 2, self


def _snap(x: float, steps: int, up: bool = False) -> float:
    """x on the grid 2^(n / steps)."""
    e = steps * math.log2(x)
    return 2.0 ** ((math.ceil(e) if up else round(e)) / steps)


def residual_writers(model: torch.nn.Module, moe) -> list[tuple[str, torch.nn.Parameter, int]]:
    """(name, parameter, axis of the hidden size) of every parameter whose output is added to the residual
    stream. ``moe`` is the model's catalog MoeFields."""
    out = []
    for name, p in model.named_parameters():
        if ".layers." not in name:
            continue
        if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight", "fc2_latent_proj.weight")):
            axis = 0
        elif name.endswith(
            ("o_proj.bias", "out_proj.bias", "down_proj.bias", "fc2_latent_proj.bias", "experts.down_proj_bias")
        ):
            axis = p.dim() - 1
        elif name.endswith("experts.down_proj"):
            if moe.latent_size:  # latent experts write fc2_latent_proj's input, not the residual stream
                continue
            axis = 2 if moe.experts_transposed else 1
        else:
            continue
        if p.shape[axis] != moe.hidden:
            raise ValueError(f"{PEAKED}: {name} {tuple(p.shape)} has no hidden-size axis where expected ({axis})")
        out.append((name, p, axis))
    return out


def _blocks(rows: torch.Tensor):
    """Row blocks of a (n, ..., H) view small enough for float64."""
    step = max(1, _CHUNK // max(1, rows[0].numel()))
    for i in range(0, rows.shape[0], step):
        yield rows[i : i + step]


def _representable(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in ``dtype`` through bf16: every weight the recipe writes is bf16-representable, so the fp32 reference and
    the bf16 checkpoint the engines load hold the same numbers, also where transformers keeps a module in fp32
    (Nemotron-H's router under transformers 5.24 differed by 9e-4 otherwise)."""
    return x.to(torch.bfloat16).to(dtype)


@torch.no_grad()
def _project_off(p: torch.Tensor, axis: int, U: torch.Tensor) -> None:
    """p <- p without its components along U's rows on the hidden axis (float64, rounded back once)."""
    v = p.data.movedim(axis, -1)
    v = v.reshape(1, *v.shape) if v.dim() == 1 else v
    for blk in _blocks(v):
        w = blk.double()
        blk.copy_(_representable(w - (w @ U.T) @ U, p.dtype))


def _token_sets(V: int, E: int, k: int, n_group: int, topk_group: int, gen, device) -> torch.Tensor:
    """(V, k) expert slots per token; with grouped routing all inside topk_group groups."""
    r = torch.rand(V, E, generator=gen, device=device)
    if n_group > 1:
        groups = torch.rand(V, n_group, generator=gen, device=device).topk(topk_group, dim=1).indices
        keep = torch.zeros(V, n_group, dtype=torch.bool, device=device).scatter_(1, groups, True)
        r = r.masked_fill(~keep.repeat_interleave(E // n_group, dim=1), -1.0)
    return r.topk(k, dim=1).indices


def _slot_perm(E: int, n_group: int, gen, device) -> torch.Tensor:
    """Expert e reads code slot perm[e]: a permutation that maps routing groups onto routing groups."""
    g = E // n_group
    order = torch.randperm(n_group, generator=gen, device=device)
    within = torch.stack([torch.randperm(g, generator=gen, device=device) for _ in range(n_group)])
    return (order[:, None] * g + within).flatten()


def _final_norm(model: torch.nn.Module) -> torch.nn.Module:
    base = model.base_model
    for name in ("norm", "norm_f", "final_layernorm"):
        if isinstance(getattr(base, name, None), torch.nn.Module):
            return getattr(base, name)
    raise ValueError(f"{PEAKED}: no final norm found on {type(base).__name__}")


def _entropy_scale(model, target: float, gen, n: int = 64) -> tuple[float, float]:
    """The lm_head factor t giving mean entropy = target x log V on n random inputs passed through the final norm
    (bisection: entropy falls monotonically with t), on a 2^(1/16) grid; -> (t, entropy / log V at t)."""
    head = model.get_output_embeddings().weight
    g = torch.randn(n, head.shape[1], generator=gen, device=head.device)
    x = _final_norm(model)(g.to(head.dtype)).double()
    logits = torch.cat([x @ blk.double().T for blk in _blocks(head.data)], dim=1)
    log_v = math.log(logits.shape[-1])

    def ent(t: float) -> float:
        lp = (t * logits).log_softmax(-1)
        return float(-(lp.exp() * lp).sum(-1).mean()) / log_v

    lo, hi = -8.0, 12.0  # log2 t
    for _ in range(48):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ent(2**mid) > target else (lo, mid)
    t = _snap(2 ** ((lo + hi) / 2), 16)
    return t, ent(t)


class _Probe:
    """Forward pre-hooks on every router: per MoE layer and token the code unit kappa_t (least squares of the router
    input's U coordinates on the token's code) and the share of those coordinates the code does not explain."""

    def __init__(self, routers, U, codes, ids):
        self.U, self.codes, self.ids = U, codes, ids.flatten()
        self.kappa: list[torch.Tensor] = []
        self.leak: list[float] = []
        self._handles = [r.register_forward_pre_hook(self._hook) for r in routers]

    def _hook(self, module, args):
        coords = args[0].reshape(-1, self.U.shape[1]).double() @ self.U.T
        c = self.codes[self.ids].double()
        kap = (coords * c).sum(-1) / (c * c).sum(-1)
        self.kappa.append(kap)
        self.leak.append(float(((coords - kap[:, None] * c).norm(dim=-1) / (kap[:, None] * c).norm(dim=-1)).median()))

    def run(self, model, ids) -> None:
        try:
            model.base_model(input_ids=ids, use_cache=False)
        finally:
            for h in self._handles:
                h.remove()


def apply_peaked(model: PreTrainedModel, moe, seed: int, params: PeakedParams = PeakedParams()) -> dict[str, Any]:
    """Condition a freshly built bf16 model (transformers' init) in place; ``moe`` is its catalog MoeFields.
    Returns what was chosen and measured (beta, kappa and leakage per MoE layer, lm_head factor, entropy).
    TF32 is off meanwhile (the caller's setting is restored): the fp32 parts must not depend on the process."""
    flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        return _apply_peaked(model, moe, seed, params)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags


@torch.no_grad()
def _apply_peaked(model: PreTrainedModel, moe, seed: int, params: PeakedParams) -> dict[str, Any]:
    from lpdiff.harness.spec.routing import is_router

    t0 = time.perf_counter()
    if not moe.is_moe:
        raise ValueError(f"{PEAKED} conditions MoE routers; {moe.arch} has none")
    head_module = model.get_output_embeddings()
    if head_module is None:
        raise ValueError(f"{PEAKED} scales lm_head; {type(model).__name__} has none")
    emb, head = model.get_input_embeddings().get_parameter("weight"), head_module.get_parameter("weight")
    if head is emb:
        raise ValueError(f"{PEAKED} scales lm_head apart from the embedding; tied embeddings are not supported")
    device, H, E, k, V = emb.device, moe.hidden, moe.num_experts, moe.top_k, emb.shape[0]
    routers = [m for m in model.modules() if is_router(m)]
    assert len(routers) == len(moe.moe_layers), (len(routers), moe.moe_layers)
    gen = torch.Generator(device=device).manual_seed(int(seed) * 1_000_003 + 0x7065616B)

    U = torch.linalg.qr(torch.randn(H, E + 1, generator=gen, device=device, dtype=torch.float64)).Q.T.contiguous()
    sets = _token_sets(V, E, k, moe.n_group, moe.topk_group, gen, device)
    codes = torch.zeros(V, E + 1, device=device)
    codes.scatter_(1, sets, 1.0 + 0.5 * torch.rand(V, k, generator=gen, device=device))
    codes[:, E] = 1.0
    ids = torch.randint(0, V, (params.probe_batch, params.probe_len), generator=gen, device=device)
    code_sq = float((codes[ids].double() ** 2).sum(-1).mean())
    kappa = min(params.kappa, math.sqrt(params.max_code_share * H / code_sq))

    for _, p, axis in residual_writers(model, moe):
        _project_off(p, axis, U)
    _project_off(emb, 1, U)
    sigma = math.sqrt(sum(float(blk.double().pow(2).sum()) for blk in _blocks(emb.data)) / emb.numel())
    base = emb.data.clone()  # the embedding's own part, off U

    def set_embedding(beta: float, base: torch.Tensor) -> None:
        for i in range(0, V, max(1, _CHUNK // H)):
            rows = slice(i, i + max(1, _CHUNK // H))
            emb.data[rows] = _representable(base[rows].double() + beta * (codes[rows].double() @ U), emb.dtype)

    # probe: the branches' energy in the hidden state at each MoE layer, with a code of 4x the embedding's own part
    beta0 = 2 * sigma * math.sqrt(H / code_sq)
    set_embedding(beta0, base)
    probe = _Probe(routers, U, codes, ids)
    probe.run(model, ids)
    c_sq = (codes[ids.flatten()].double() ** 2).sum(-1)
    # token t at layer l: kappa_t = beta / rms(h_t), rms(h_t)^2 = sigma^2 + beta^2 |c_t|^2 / H + branch_t^2
    branch_sq = max(float(((beta0 / kap) ** 2 - sigma**2 - beta0**2 * c_sq / H).mean()) for kap in probe.kappa)
    beta = _snap(math.sqrt((sigma**2 + max(branch_sq, 0.0)) / (1 / kappa**2 - code_sq / H)), 2, up=True)
    set_embedding(beta, base)
    del base

    alpha, ctx, offset = params.gap / kappa, params.context * params.gap, float(moe.router == "sigmoid")
    bias_scale = 0.02 if moe.router == "sigmoid" else 0.1 * params.gap
    for module in routers:
        perm = _slot_perm(E, moe.n_group, gen, device)
        r = torch.randn(E, H, generator=gen, device=device, dtype=torch.float64)
        r -= (r @ U.T) @ U
        w = alpha * (U[perm] - offset * U[E]) + ctx * r / r.norm(dim=-1, keepdim=True)
        weight = module.get_parameter("weight")
        weight.data.copy_(_representable(w, weight.dtype))
        bias = ((torch.rand(E, generator=gen, device=device) * 2 - 1) * bias_scale).to(torch.bfloat16)
        for name in ("bias", "e_score_correction_bias"):  # gpt-oss / Nemotron
            if isinstance(getattr(module, name, None), torch.Tensor):
                getattr(module, name).data.copy_(bias.to(getattr(module, name).dtype))

    t, entropy = _entropy_scale(model, params.entropy, gen)
    for blk in _blocks(head.data):
        blk.copy_(_representable(blk.double() * t, head.dtype))

    # check: the code reaches every router as placed (a residual writer left unprojected shows as leakage)
    check = _Probe(routers, U, codes, ids)
    check.run(model, ids)
    kappas = [float(k_.median()) for k_ in check.kappa]
    for i, (kap, leak) in enumerate(zip(kappas, check.leak)):
        if not kap > 0 or leak > 0.1:  # bf16 rounding of the hidden state is ~1e-3 of a code unit at kappa
            raise RuntimeError(
                f"{PEAKED}: the token code reaches MoE layer {moe.moe_layers[i]} with code unit "
                f"{kap:.3g} and {leak:.0%} leakage: a weight that writes the residual stream is not "
                "projected off it (residual_writers knows o_proj/out_proj/down_proj/fc2_latent_proj)"
            )
    return {
        "recipe": PEAKED,
        "beta": beta,
        "sigma": sigma,
        "kappa_target": kappa,
        "kappa": kappas,
        "leakage": check.leak,
        "lm_head_scale": t,
        "entropy": entropy,
        "seconds": time.perf_counter() - t0,
    }
