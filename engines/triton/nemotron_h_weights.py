"""Nemotron-H's config, weights and stacked LoRA (nemotron_h.py's build assembles them; nemotron_h_model.py runs).

Nemotron-H (Nemotron-3 Nano 30B-A3B, Super 120B-A12B): a hybrid whose layers are each one mixer after an RMSNorm,
as ``layers_block_type`` (or the Hub's ``hybrid_override_pattern``) names them: M Mamba-2, * attention (no rotary),
E MoE (sigmoid router with correction bias and group-limited top-k, routed scaling, non-gated relu² experts, one
shared expert; Super runs the routed experts in a latent width between fc1_latent_proj and fc2_latent_proj),
- dense relu² MLP. Weights are read by their in-memory names (checkpoints save under ``backbone.``, in memory
``model.``; experts one by one on disk, 3D in memory); LoRA is stacked per slot onto each projection it targets.

Tensor parallelism (Megatron-style, as shard.py): mamba heads split with their groups (with fewer groups than
ranks, B/C of a group are replicated on the ranks sharing it and the gated norm sums its squares over them),
attention heads as the MoE archs, experts and MLPs on their
width; the router, latent fc1 and the lm head are replicated; every row-parallel output is all-reduced.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from lpdiff.engines.triton.lora import AdapterSlots, sharded_moe_lora
from lpdiff.engines.triton.shard import Shard
from lpdiff.harness.spec.errors import InputError
from lpdiff.kernels import MoeLoraWeights, faults
from lpdiff.kernels.lora_linear import pack_lora_b

Tensor = torch.Tensor
KINDS = {"linear_attention": "M", "full_attention": "*", "attention": "*", "moe": "E", "mlp": "-", "mamba": "M"}


@dataclass(slots=True)
class NemotronHConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    kinds: tuple[str, ...]  # per layer: M | * | E | -
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mamba_heads: int
    mamba_head_dim: int
    n_groups: int
    ssm_state: int
    conv_kernel: int
    chunk_size: int
    conv_bias: bool
    mamba_bias: bool
    dt_min: float  # transformers clamps the discretised dt to [time_step_min, inf)
    num_experts: int
    top_k: int
    expert_width: int
    shared_width: int
    mlp_width: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling: float
    latent_size: int | None
    mlp_bias: bool
    attention_bias: bool
    rms_norm_eps: float
    tie_word_embeddings: bool
    # Batch.build's rope tables: Nemotron-H's attention has no rotary embedding, so they are empty
    rope_inv_freq: Tensor = field(default_factory=lambda: torch.zeros(0))
    rope_attention_scaling: float = 1.0

    @property
    def mamba_inner(self) -> int:
        return self.mamba_heads * self.mamba_head_dim

    @property
    def moe_width(self) -> int:
        """The width the routed experts read and write: the latent size on Super, else hidden."""
        return self.latent_size or self.hidden_size


def config_from_hf(hf) -> NemotronHConfig:
    types = getattr(hf, "layers_block_type", None)
    if types is None:  # older configs carry only the pattern string
        types = [{"M": "mamba", "*": "attention", "E": "moe", "-": "mlp"}[c] for c in hf.hybrid_override_pattern]
    kinds = tuple(KINDS[t] for t in types)[: hf.num_hidden_layers]
    if getattr(hf, "mamba_hidden_act", "silu") != "silu":
        raise ValueError(f"Nemotron-H with mamba_hidden_act={hf.mamba_hidden_act!r} is not supported (expected silu)")
    if hf.mlp_hidden_act != "relu2":
        raise ValueError(f"Nemotron-H with mlp_hidden_act={hf.mlp_hidden_act!r} is not supported (expected relu2)")
    if "E" in kinds and getattr(hf, "n_shared_experts", 1) not in (1, None):
        raise ValueError(f"Nemotron-H with n_shared_experts={hf.n_shared_experts} is not supported (expected 1)")
    return NemotronHConfig(
        arch="nemotron_h",
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        num_layers=len(kinds),
        kinds=kinds,
        num_heads=hf.num_attention_heads,
        num_kv_heads=hf.num_key_value_heads,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
        mamba_heads=hf.mamba_num_heads,
        mamba_head_dim=hf.mamba_head_dim,
        n_groups=hf.n_groups,
        ssm_state=hf.ssm_state_size,
        conv_kernel=hf.conv_kernel,
        chunk_size=hf.chunk_size,
        conv_bias=bool(hf.use_conv_bias),
        mamba_bias=bool(hf.use_bias),
        dt_min=float(hf.time_step_min),
        num_experts=hf.n_routed_experts,
        top_k=hf.num_experts_per_tok,
        expert_width=hf.moe_intermediate_size,
        shared_width=hf.moe_shared_expert_intermediate_size,
        mlp_width=hf.intermediate_size,
        n_group=hf.n_group,
        topk_group=hf.topk_group,
        norm_topk_prob=bool(hf.norm_topk_prob),
        routed_scaling=float(hf.routed_scaling_factor),
        latent_size=getattr(hf, "moe_latent_size", None),
        mlp_bias=bool(hf.mlp_bias),
        attention_bias=bool(hf.attention_bias),
        rms_norm_eps=hf.layer_norm_epsilon,
        tie_word_embeddings=bool(hf.tie_word_embeddings),
    )


# -- weights ------------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Linear:
    """One projection of this rank, and its LoRA of every slot once stacked (lora_linear's layout)."""

    w: Tensor  # (out_loc, in_loc)
    bias: Tensor | None = None  # column-parallel: this rank's rows; row-parallel: rank 0 only
    # which slice of the full weight this rank holds: output rows (dim 0), input columns (dim 1) or all (None)
    dim: int | None = None
    index: Tensor | None = None
    a: Tensor | None = None  # (L, 1, R, in_loc)
    b: Tensor | None = None  # (L, out_loc, R)
    # kernels.lora_linear.pack_lora_b(b, scaling): built once when the adapters are stacked, so that a forward does
    # not repack it per call (5 small kernels per LoRA linear, 20 per attention layer in a replayed graph)
    b_packed: Tensor | None = None  # (out_loc, L*R)


@dataclass(slots=True)
class Layer:
    kind: str
    norm: Tensor
    mods: dict[str, Linear]  # in_proj/out_proj | q/k/v/o_proj | up/down_proj (mlp) | shared_up/shared_down/fc1/fc2
    # mamba: conv_w (C_loc, K), conv_b, dt_bias, A (= -exp(A_log), fp32), D, gate_norm; moe: router, router_bias,
    # w_up (E, I_loc, Hm), w_down (E, Hm, I_loc)
    p: dict[str, Tensor | None] = field(default_factory=dict)
    moe_lora: MoeLoraWeights | None = None

    def need(self, name: str) -> Tensor:
        """A weight of ``p`` this layer's kind always has."""
        t = self.p.get(name)
        if t is None:
            raise ValueError(f"a {self.kind!r} layer has no {name}")
        return t


@dataclass(slots=True)
class Weights:
    embed: Tensor
    norm: Tensor
    lm_head: Tensor
    layers: list[Layer]

    def nbytes(self) -> int:
        ts = [self.embed, self.norm, self.lm_head]
        for lay in self.layers:
            ts += [t for t in lay.p.values() if t is not None]
            ts += [t for m in lay.mods.values() for t in (m.w, m.bias) if t is not None]
        seen: dict[int, int] = {t.data_ptr(): t.numel() * t.element_size() for t in ts}
        return sum(seen.values())


class Names:
    """In-memory names (``model.layers.N...``) read from either source: a live state dict (in-memory names, 3D
    experts) or a checkpoint (``backbone.`` names, experts saved one by one)."""

    def __init__(self, source, dtype, device):
        self.source, self.dtype, self.device = source, dtype, device

    def key(self, name: str) -> str | None:
        alt = "backbone." + name.removeprefix("model.") if name.startswith("model.") else name
        return next((k for k in (name, alt) if self.source.has(k)), None)

    def has(self, name: str) -> bool:
        return self.key(name) is not None

    def take(self, name: str, dtype=None) -> Tensor:
        key = self.key(name)
        if key is None:
            raise KeyError(f"weight {name!r} (or its backbone. name) missing from the Nemotron-H checkpoint")
        return self.source.take(key).to(device=self.device, dtype=dtype or self.dtype)

    def experts(self, prefix: str, param: str, num: int) -> Tensor:
        """(E, out, in) of ``{prefix}experts.{param}``, fused in memory or stacked from per-expert tensors."""
        if self.has(f"{prefix}experts.{param}"):
            return self.take(f"{prefix}experts.{param}")
        return torch.stack([self.take(f"{prefix}experts.{e}.{param}.weight") for e in range(num)])


def mamba_rows(cfg: NemotronHConfig, shard: Shard) -> tuple[Tensor, Tensor]:
    """-> (in_proj rows, conv channels) of this rank: in_proj's output is z | x | B | C | dt, conv's input x | B | C
    (transformers' split order); heads and their groups of this rank."""
    if cfg.n_groups % shard.size and shard.size % cfg.n_groups:
        raise InputError(
            f"Nemotron-H's {cfg.n_groups} mamba groups do not split over tp={shard.size} (use a TP size "
            "that divides the groups or that they divide)"
        )
    h, g = shard.heads(cfg.mamba_heads, cfg.n_groups)
    p, n, inner = cfg.mamba_head_dim, cfg.ssm_state, cfg.mamba_inner
    heads_cols = torch.arange(h.start * p, h.stop * p)
    group_cols = torch.arange(g.start * n, g.stop * n)
    gn = cfg.n_groups * n
    conv = torch.cat([heads_cols, inner + group_cols, inner + gn + group_cols])
    dt = torch.arange(h.start, h.stop)
    rows = torch.cat([heads_cols, inner + conv, inner + inner + 2 * gn + dt])
    return rows, conv


def load(cfg: NemotronHConfig, names: Names, shard: Shard) -> Weights:
    dev = names.device

    def even(n: int) -> Tensor:
        return shard.split(torch.arange(n), 0)

    def col(name: str, rows: Tensor | None = None, bias: bool = False) -> Linear:
        """Column-parallel: this rank's output rows (an even split, or ``rows``)."""
        w = names.take(name + ".weight")
        b = names.take(name + ".bias") if bias else None
        rows = (even(w.shape[0]) if rows is None else rows).to(dev)
        return Linear(w.index_select(0, rows).contiguous(), None if b is None else b.index_select(0, rows), 0, rows)

    def row(name: str, cols: Tensor | None = None, bias: bool = False) -> Linear:
        """Row-parallel: this rank's input columns; the bias on rank 0 only (added once before the all-reduce)."""
        w = names.take(name + ".weight")
        cols = (even(w.shape[1]) if cols is None else cols).to(dev)
        b = names.take(name + ".bias") if bias and shard.first else None
        return Linear(w.index_select(1, cols).contiguous(), b, 1, cols)

    layers = []
    for i, kind in enumerate(cfg.kinds):
        p = f"model.layers.{i}.mixer."
        lay = Layer(kind, names.take(f"model.layers.{i}.norm.weight"), {})
        if kind == "M":
            rows, conv = mamba_rows(cfg, shard)
            h, _ = shard.heads(cfg.mamba_heads, cfg.n_groups)
            head_cols = torch.arange(h.start * cfg.mamba_head_dim, h.stop * cfg.mamba_head_dim, device=dev)
            lay.mods["in_proj"] = col(p + "in_proj", rows, cfg.mamba_bias)
            lay.mods["out_proj"] = row(p + "out_proj", head_cols, cfg.mamba_bias)
            conv = conv.to(dev)
            lay.p.update(
                conv_w=names.take(p + "conv1d.weight").squeeze(1).index_select(0, conv).contiguous(),
                conv_b=names.take(p + "conv1d.bias").index_select(0, conv) if cfg.conv_bias else None,
                dt_bias=names.take(p + "dt_bias")[h.start : h.stop].contiguous(),
                A=-torch.exp(names.take(p + "A_log", torch.float32)[h.start : h.stop]),
                D=names.take(p + "D")[h.start : h.stop].contiguous(),
                gate_norm=names.take(p + "norm.weight").index_select(0, head_cols),
            )
        elif kind == "*":
            qh, kvh = shard.heads(cfg.num_heads, cfg.num_kv_heads)
            d = cfg.head_dim
            for proj, hs in (("q", qh), ("k", kvh), ("v", kvh)):
                lay.mods[f"{proj}_proj"] = col(
                    p + f"{proj}_proj", torch.arange(hs.start * d, hs.stop * d), cfg.attention_bias
                )
            lay.mods["o_proj"] = row(p + "o_proj", torch.arange(qh.start * d, qh.stop * d), cfg.attention_bias)
        elif kind == "-":
            lay.mods["up_proj"] = col(p + "up_proj", bias=cfg.mlp_bias)
            lay.mods["down_proj"] = row(p + "down_proj", bias=cfg.mlp_bias)
        else:
            lay.mods["shared_experts.up_proj"] = col(p + "shared_experts.up_proj", bias=cfg.mlp_bias)
            lay.mods["shared_experts.down_proj"] = row(p + "shared_experts.down_proj", bias=cfg.mlp_bias)
            if cfg.latent_size is not None:  # fc1 replicated (every rank's experts read the whole latent), fc2
                # applied to each rank's partial expert sum (linear: the all-reduce after it sums the partials)
                lay.mods["fc1_latent_proj"] = Linear(
                    names.take(p + "fc1_latent_proj.weight"),
                    names.take(p + "fc1_latent_proj.bias") if cfg.mlp_bias else None,
                )
                fc2_b = names.take(p + "fc2_latent_proj.bias") if cfg.mlp_bias else None
                lay.mods["fc2_latent_proj"] = Linear(
                    names.take(p + "fc2_latent_proj.weight"), fc2_b if shard.first else None
                )
            up = names.experts(p, "up_proj", cfg.num_experts)  # (E, I, Hm)
            down = names.experts(p, "down_proj", cfg.num_experts)  # (E, Hm, I)
            lay.p.update(
                # in the model dtype as transformers loads it (only the correction bias is kept in fp32)
                router=names.take(p + "gate.weight"),
                router_bias=names.take(p + "gate.e_score_correction_bias", torch.float32),
                w_up=shard.split(up, 1).contiguous(),
                w_down=shard.split(down, 2).contiguous(),
            )
        layers.append(lay)
    embed = names.take("model.embeddings.weight")
    lm_head = embed if cfg.tie_word_embeddings else names.take("lm_head.weight")
    return Weights(embed, names.take("model.norm_f.weight"), lm_head, layers)


# -- LoRA ---------------------------------------------------------------------------------------------------------

_DENSE = re.compile(r"^model\.layers\.(\d+)\.mixer\.(.+)$")
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mixer\.experts\.(up_proj|down_proj)$")
MAMBA_MODULES = ("in_proj", "out_proj")
SUPPORTED_TARGETS = (
    "mixer.{in_proj,out_proj} (mamba), mixer.{q,k,v,o}_proj, mixer.{up,down}_proj (mlp), "
    "mixer.shared_experts.{up,down}_proj, mixer.fc{1,2}_latent_proj, mixer.experts.{up,down}_proj"
)


@dataclass(slots=True)
class HybridLora(AdapterSlots):
    """Every adapter's slot (archs.Built's ``lora``): the factors live in the layers' Linear.a/.b and moe_lora."""

    weights: Weights

    def nbytes(self) -> int:
        ts = []
        for lay in self.weights.layers:
            ts += [t for m in lay.mods.values() for t in (m.a, m.b, m.b_packed) if t is not None]
            if lay.moe_lora is not None:
                m = lay.moe_lora
                ts += [m.gate_up_a, m.gate_up_b, m.down_a, m.down_b]
        return sum(t.numel() * t.element_size() for t in ts)


def _targets(cfg: NemotronHConfig, weights: Weights, name: str, adapter) -> tuple[dict, dict]:
    """-> ({(layer, module): (A, B)}, {(layer, param): (A, B)}) for layers < num_layers; unknown targets fail."""
    dense, experts = {}, {}
    for key, ab in adapter.experts.items():
        m = _EXPERT.match(key)
        if m is None or (int(m.group(1)) < cfg.num_layers and cfg.kinds[int(m.group(1))] != "E"):
            raise ValueError(
                f"adapter {name!r} targets {key!r}, which the triton engine does not run LoRA on for "
                f"Nemotron-H; supported targets: {SUPPORTED_TARGETS}"
            )
        if int(m.group(1)) < cfg.num_layers:
            experts[int(m.group(1)), m.group(2)] = ab
    for key, ab in adapter.dense.items():
        m = _DENSE.match(key)
        i = int(m.group(1)) if m else -1
        if m is None or (i < cfg.num_layers and m.group(2) not in weights.layers[i].mods):
            raise ValueError(
                f"adapter {name!r} targets {key!r}, which the triton engine does not run LoRA on for "
                f"Nemotron-H; supported targets: {SUPPORTED_TARGETS}"
            )
        if i < cfg.num_layers:
            dense[i, m.group(2)] = ab
    if faults.on("mamba_lora_dropped"):
        dense = {k: v for k, v in dense.items() if not (cfg.kinds[k[0]] == "M" and k[1] in MAMBA_MODULES)}
    if faults.on("expert_adapter_dropped"):
        experts = {}
    return dense, experts


def stack_adapters(
    cfg: NemotronHConfig, weights: Weights, adapters: dict, shard: Shard, dtype: torch.dtype, device: torch.device
) -> HybridLora | None:
    """``adapters``: name -> CanonicalAdapter in slot order. Each targeted Linear gets A (L, 1, R, in_loc) and
    B (L, out_loc, R), zero-padded (unused slots and rank columns add exactly nothing), sliced as its weight."""
    if not adapters:
        return None
    names = list(adapters)
    ranks_of = {n: max({int(a.rank)} | a.inner_dims) for n, a in adapters.items()}
    L, R = len(names), max(ranks_of.values())
    parsed = [_targets(cfg, weights, n, adapters[n]) for n in names]
    scaling = torch.tensor([float(adapters[n].scaling) for n in names], dtype=torch.float32, device=device)
    ranks = torch.tensor([ranks_of[n] for n in names], dtype=torch.int32, device=device)

    def put(dst: Tensor, src: Tensor) -> None:
        dst[tuple(slice(0, s) for s in src.shape)] = src.to(device=device, dtype=dtype)

    for i, lay in enumerate(weights.layers):
        for mod, lin in lay.mods.items():
            hits = [(s, d[i, mod]) for s, (d, _) in enumerate(parsed) if (i, mod) in d]
            if not hits:
                continue
            A0, B0 = hits[0][1]
            a = torch.zeros(L, 1, R, A0.shape[1], dtype=dtype, device=device)
            b = torch.zeros(L, B0.shape[0], R, dtype=dtype, device=device)
            for s, (A, B) in hits:
                put(a[s, 0], A)
                put(b[s], B)
            # the Linear's own slice: B's rows of a column-parallel weight, A's columns of a row-parallel one
            if lin.dim in (0, 1):
                assert lin.index is not None  # a sharded Linear keeps the index of its slice
                if lin.dim == 0:
                    b = b.index_select(1, lin.index)
                else:
                    a = a.index_select(3, lin.index)
            lin.a, lin.b = a.contiguous(), b.contiguous()
            lin.b_packed = pack_lora_b(lin.b, scaling, None, R)
        hits = [(s, e) for s, (_, e) in enumerate(parsed) if any(k[0] == i for k in e)]
        if not hits:
            continue
        E, Hm, I = cfg.num_experts, cfg.moe_width, cfg.expert_width
        up_a, up_b = (
            torch.zeros(L, E, R, Hm, dtype=dtype, device=device),
            torch.zeros(L, E, I, R, dtype=dtype, device=device),
        )
        dn_a, dn_b = (
            torch.zeros(L, E, R, I, dtype=dtype, device=device),
            torch.zeros(L, E, Hm, R, dtype=dtype, device=device),
        )
        for s, ex in hits:
            if (i, "up_proj") in ex:
                put(up_a[s], ex[i, "up_proj"][0])
                put(up_b[s], ex[i, "up_proj"][1])
            if (i, "down_proj") in ex:
                put(dn_a[s], ex[i, "down_proj"][0])
                put(dn_b[s], ex[i, "down_proj"][1])
        lay.moe_lora = sharded_moe_lora((up_a, up_b, dn_a, dn_b), scaling, ranks, shard, gated=False)
    return HybridLora(names, scaling, ranks, weights)
