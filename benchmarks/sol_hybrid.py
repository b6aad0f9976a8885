"""Speed of light of one prompt-logprob call for the hybrid families -- Qwen3.5-MoE (Gated DeltaNet + gated full
attention + MoE with a shared expert) and Nemotron-H (Mamba-2, attention, relu² MoE with a shared expert, Super's
latent MoE) -- counted the way benchmarks/sol_forward.py counts Qwen3-MoE and gpt-oss: every matrix product one
cuBLAS GEMM (or batched GEMM) on random buffers, the whole call replayed from one CUDA graph, the memory-bound
passes as bytes at the copy bandwidth measured in the same run. sol_forward.py runs this for these model types.

Per layer, by kind (T = batch x seq tokens, B prompts of S; el = the model dtype's bytes):
  every MoE block   router (+ Qwen3.5's shared-expert gate as one more output row of it) one GEMM, Nemotron-H's
                    with fp32 sums as the model forms them (transformers' NemotronHTopkRouter casts input and weight
                    to fp32; bf16 logits would pick other experts): the bf16 products are exact in fp32, so its floor
                    is its FLOPs at the tensor-core rate, counted as cuBLAS's bf16 GEMM with fp32 output (the
                    runtime's kernels.fp32_sums_gemm adds one IEEE add per 64 of K to those FLOPs; an IEEE fp32
                    GEMM is ~11x the floor at Super's shape on an H200); the routed experts
                    as batched GEMMs over E experts of exactly T*K/E rows (balanced routing, no gather, no padding):
                    Qwen3.5 gate_up (2I) then down, Nemotron's non-gated relu² experts one up (I) then down; Super's
                    experts in the latent dim (1024) between fc1_latent_proj (H -> 1024) and fc2_latent_proj
                    (1024 -> H), one GEMM each; the shared expert as two dense GEMMs (Qwen3.5: gate_up 2I_s and down;
                    Nemotron: up and down); activations, the sigmoid gate's multiply and routing are free.
  gated full        q|k|v one GEMM, q doubled for the output gate (Qwen3.5; Nemotron's attention has no gate), one
  attention         causal SDPA on (B, heads, S, head_dim) with k and v at every query head (GQA's FLOPs), o one
                    GEMM; partial rotary and the q/k norms are in the floor below, not in the GEMMs.
  Gated DeltaNet    in_proj_qkv | in_proj_z | in_proj_b | in_proj_a as ONE GEMM (one input, four weights: the
  (Qwen3.5 linear   fused form an implementation may use) and out_proj one GEMM. The chunked gated delta rule
  attention)        (chunk C = 64, as fla and engines/triton/gdn.py; per value head, q/k heads shared as the model
                    does; Nc = B x value heads x ceil(S / C) chunks) at its FLOP floor as five batched GEMMs of the
                    chunk form's products, each on (Nc, ., .) random buffers:
                      [k | q] k^T           (Nc, 2C, dk) x (Nc, dk, C)   the decay-masked intra-chunk scores
                      T [k | v]             (Nc, C, C) x (Nc, C, dk+dv)  the WY/UT transform's w and u
                      [w | q] S             (Nc, 2C, dk) x (Nc, dk, dv)  v' = u - w S and the output from the state
                      k^T v'                (Nc, dk, C) x (Nc, C, dv)    the state update
                      (q k^T) v'            (Nc, C, C) x (Nc, C, dv)     the intra-chunk output
                    products sharing an operand stacked into one GEMM; the unit-triangular inverse T (a C x C
                    forward substitution, ~C³/3 multiply-adds per chunk: < 4 % of these products at C = 64,
                    d = 128) and the decay factors are not counted; chunks are independent here, so the
                    sequential state pass across a prompt's chunks is not a cost either (B x heads = 256 rows of it
                    run side by side at 8 x 512 tokens). Its bytes are in the floor.
  Mamba-2           in_proj (z | xBC | dt) and out_proj one GEMM each. The SSD chunked scan (chunk C from the
  (Nemotron)        config, 128; Nc = B x heads x chunks, Ng = B x groups x chunks; P head dim, N state) at its
                    FLOP floor as four batched GEMMs: C B^T (Ng, C, N) x (Ng, N, C) per group; the decay-masked
                    intra-chunk output (Nc, C, C) x (Nc, C, P); the chunk states B^T x (Nc, N, C) x (Nc, C, P);
                    the output from the previous state C S (Nc, C, N) x (Nc, N, P). Decays, dt, the D skip free.
  dense MLP         (Nemotron 'mlp' layers) up and down, one GEMM each.
  lm_head           one (T, H) x (H, V) GEMM.
LoRA (rank R, one adapter) on what benchmarks/bench_e2e.py's adapter covers on these models, groups ("attention",
"experts"): q/k/v/o of the full-attention layers and the routed experts' two projections (not the GDN / Mamba
projections, the shared expert, the router or the latent projections). As for the other families: each shrink its
own GEMM (q|k|v: (T, H) x (H, 3R); experts: batched over E), each expand folded -- q|k|v and the experts as R more
K of the base GEMM (3R for q|k|v), o's shrink as R more output rows of its GEMM and its expand one addmm.

Floor (memory-bound passes, bytes at the measured copy bandwidth, read + write):
  per residual add + RMSNorm 4 T H el (two per Qwen3.5 layer, one per Nemotron layer, one final);
  per MoE block the top-k sum K T H_e el (H_e: the experts' output width, Super's latent 1024) and the shared
  expert's add T H el; per full-attention layer (Qwen3.5) q/k norm + partial rope 2 T (heads + kv) d el and the
  output gate 3 T heads d el (read attn and gate, write); per GDN layer the conv1d over q|k|v (read + write
  2 T C_qkv el), the delta rule's inputs and output (T C_qkv el + T nv dv el, plus g and beta in fp32), its state
  written once per chunk by the state pass and read once by the output pass (2 x Nc x dk x dv x el), and the gated
  RMSNorm 3 T nv dv el; per Mamba layer the conv1d over xBC (2 T C_xbc el), the scan's inputs and output
  (T C_xbc el + T nh 4 + T d_inner el), its state written and read once per chunk (2 x Nc x N x P x el) and the gated
  RMSNorm 3 T d_inner el. The per-chunk states are counted in the model dtype, the narrower of the two stores in use
  (fla keeps them in the input dtype, mamba_ssm in fp32): a floor. A kernel that kept the state on chip across chunks
  would not move them at all; the bound counts the chunked algorithms as implemented (the runtime's and the peers').
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


def tensor_core_fp32_out(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T with fp32 output at the tensor-core rate (cuBLAS, torch >= 2.8 on CUDA): the floor of a fp32 router's
    FLOPs (module docstring); elsewhere the fp32 GEMM."""
    if x.is_cuda and "dtype" in torch.ops.aten.mm.overloads():
        return torch.mm(x, w.t(), out_dtype=torch.float32)
    return F.linear(x.float(), w.float())


GDN_CHUNK = 64  # engines/triton/gdn.py CHUNK; fla's chunk_gated_delta_rule uses 64 too
HYBRID_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text", "nemotron_h")
# weights + LoRA (bf16) that one H200 (141 GB) holds for a bound at a depth the runtime can run on it: 16 GB left for
# activations, the graph pool and the CUDA context (Qwen3-30B-A3B's LoRA call peaked at weights + LoRA + 2.8 GB,
# benchmarks/results/e2e.md). Nemotron-3-Super: 43 of 88 layers (116.0 GB + LoRA 4.6 GB at rank 32)
FIT_GB = 125


def is_hybrid(model: str) -> bool:
    from lpdiff.harness.spec.catalog import get_model

    return get_model(model).arch in HYBRID_TYPES


@dataclass(slots=True)
class HybridShapes:
    """One hybrid model at one batch: ``kinds`` per layer ("gdn" / "attn" then "moe" for Qwen3.5; one of "mamba",
    "attn", "moe", "mlp" for Nemotron-H), and the sizes each kind needs."""

    model: str
    family: str  # "qwen3_5" | "nemotron_h"
    T: int
    B: int
    S: int
    H: int
    V: int
    kinds: list
    E: int
    I: int
    K: int
    heads: int
    kv_heads: int
    d: int
    shared: int  # shared expert width
    latent: int | None = None  # Super's latent MoE dim
    mlp: int = 0  # Nemotron dense MLP width
    gated_attention: bool = False
    gdn: dict = field(default_factory=dict)  # nk, nv, dk, dv, conv
    mamba: dict = field(default_factory=dict)  # nh, P, ng, N, chunk
    padded_m: int = 0  # rows per expert when the bound counts the routing's padding (sol_forward --expert-rows)

    @property
    def L(self) -> int:
        return len(self.kinds)

    @property
    def m(self) -> int:  # rows per expert at perfectly balanced routing (or padded_m)
        return self.padded_m or self.T * self.K // self.E

    @property
    def He(self) -> int:  # the routed experts' input / output width
        return self.latent or self.H


def hybrid_shapes(model: str, batch: int, seq: int, layers: int | None) -> HybridShapes:
    from lpdiff.harness.spec.catalog import get_model, hf_config

    t = hf_config(get_model(model, num_layers=layers)).get_text_config()
    T = batch * seq
    common = dict(
        model=model,
        T=T,
        B=batch,
        S=seq,
        H=t.hidden_size,
        V=t.vocab_size,
        K=t.num_experts_per_tok,
        heads=t.num_attention_heads,
        kv_heads=t.num_key_value_heads,
        d=t.head_dim,
    )
    if t.model_type.startswith("qwen3_5"):
        kinds = [("gdn" if k == "linear_attention" else "attn", "moe") for k in t.layer_types]
        s = HybridShapes(
            family="qwen3_5",
            kinds=kinds,
            E=t.num_experts,
            I=t.moe_intermediate_size,
            shared=t.shared_expert_intermediate_size,
            gated_attention=True,  # q_proj carries the output gate (engines/triton/qwen3_5.py)
            gdn=dict(
                nk=t.linear_num_key_heads,
                nv=t.linear_num_value_heads,
                dk=t.linear_key_head_dim,
                dv=t.linear_value_head_dim,
                conv=t.linear_conv_kernel_dim,
            ),
            **common,
        )
    elif t.model_type == "nemotron_h":
        names = {
            "linear_attention": "mamba",
            "mamba": "mamba",
            "full_attention": "attn",
            "attention": "attn",
            "moe": "moe",
            "mlp": "mlp",
        }
        kinds = [(names[k],) for k in t.layers_block_type]
        s = HybridShapes(
            family="nemotron_h",
            kinds=kinds,
            E=t.n_routed_experts,
            I=t.moe_intermediate_size,
            shared=t.moe_shared_expert_intermediate_size,
            latent=getattr(t, "moe_latent_size", None),
            mlp=t.intermediate_size,
            mamba=dict(nh=t.mamba_num_heads, P=t.mamba_head_dim, ng=t.n_groups, N=t.ssm_state_size, chunk=t.chunk_size),
            **common,
        )
    else:
        raise ValueError(f"{model}: model type {t.model_type} is not a hybrid ({', '.join(HYBRID_TYPES)})")
    assert (s.T * s.K) % s.E == 0, "balanced routing needs T * K to be a multiple of E"
    return s


def _chunks(S: int, C: int) -> tuple[int, int]:
    """(chunk length, chunks per prompt): a prompt shorter than a chunk is one chunk of its length."""
    C = min(C, S)
    return C, math.ceil(S / C)


class HybridForward:
    """Buffers and products of one call (sol_forward.SolForward's interface: gemms, lm_head_op, call, floor_bytes,
    count). One layer's weights of each kind serve every layer of that kind, as in SolForward."""

    def __init__(self, s: HybridShapes, rank: int, device: str, dtype: torch.dtype):
        self.s, self.R, self.dtype, self.device = s, rank, dtype, device
        self._g = torch.Generator(device=device).manual_seed(0)
        self._inputs: dict = {}
        self.kind_of: dict[str, str] = {}  # product name -> the layer kind that runs it
        self.x = self._input(s.T, s.H)
        self.lm_head = self._rnd(s.V, s.H)
        self.ops = {r: self._build(r) for r in sorted({0, rank})}

    def _rnd(self, *shape) -> torch.Tensor:  # random, not zeros: zeros cost the tensor cores less energy
        return torch.randn(*shape, generator=self._g, device=self.device, dtype=self.dtype) * 0.02

    def _input(self, *shape) -> torch.Tensor:
        """Activations are shared by shape (weights are not): they are small next to the weights."""
        if shape not in self._inputs:
            self._inputs[shape] = self._rnd(*shape)
        return self._inputs[shape]

    # -- the products ------------------------------------------------------------------------------------------
    def _dense(self, ops: dict, name: str, k: int, n: int, lora: str | None, r: int) -> None:
        """(T, k) x (k, n). lora "k3": q|k|v (3R more K + a (T, H) x (H, 3R) shrink); "rows": o (R more output
        rows + a (T, R) x (R, n) addmm expand); None: no LoRA."""
        T = self.s.T
        if lora == "k3" and r:
            xa, w = self._input(T, k + 3 * r), self._rnd(n, k + 3 * r)
            a, x = self._rnd(3 * r, k), self._input(T, k)
            ops[name] = (lambda: F.linear(xa, w), 2 * T * n * (k + 3 * r))
            ops[f"{name} shrink"] = (lambda: F.linear(x, a), 2 * T * 3 * r * k)
        elif lora == "rows" and r:
            x, w = self._input(T, k), self._rnd(n + r, k)
            s_, b, out = self._input(T, r), self._rnd(n, r), self._rnd(T, n)
            ops[name] = (lambda: F.linear(x, w), 2 * T * (n + r) * k)
            ops[f"{name} expand"] = (lambda: out.addmm_(s_, b.T), 2 * T * n * r)
        else:
            x, w = self._input(T, k), self._rnd(n, k)
            ops[name] = (lambda: F.linear(x, w), 2 * T * n * k)

    def _experts(self, ops: dict, name: str, k: int, n: int, r: int) -> None:
        """Batched over E experts of m rows: (E, m, k [+R]) x (E, k [+R], n), the shrink (E, m, k) x (E, k, R)."""
        E, m = self.s.E, self.s.m
        xe, w = self._input(E, m, k + r), self._rnd(E, n, k + r)
        ops[name] = (lambda: torch.bmm(xe, w.transpose(1, 2)), 2 * E * m * n * (k + r))
        if r:
            x, a = self._input(E, m, k), self._rnd(E, r, k)
            ops[f"{name} shrink"] = (lambda: torch.bmm(x, a.transpose(1, 2)), 2 * E * m * r * k)

    def _bmm(self, ops: dict, name: str, n: int, a: int, b: int, c: int) -> None:
        """(n, a, b) x (n, b, c) on random buffers."""
        x, y = self._input(n, a, b), self._input(n, b, c)
        ops[name] = (lambda: torch.bmm(x, y), 2 * n * a * b * c)

    def _build(self, r: int) -> dict:
        """name -> (fn, flops) of every distinct product of the call with LoRA rank r (0: base), in the order a
        layer runs them; ``kind_of`` says which layer kind runs each."""
        s, ops = self.s, {}
        kinds = {k for ks in s.kinds for k in ks}
        for kind in ("attn", "gdn", "mamba", "mlp", "moe"):
            if kind in kinds:
                before = set(ops)
                getattr(self, f"_build_{kind}")(ops, r)
                self.kind_of.update(dict.fromkeys(set(ops) - before, kind))
        return ops

    def _build_attn(self, ops: dict, r: int) -> None:
        s = self.s
        q = s.heads * s.d
        self._dense(ops, "qkv", s.H, q * (2 if s.gated_attention else 1) + 2 * s.kv_heads * s.d, "k3", r)
        qb, kb, vb = (self._rnd(s.B, s.heads, s.S, s.d) for _ in range(3))
        ops["attention"] = (
            lambda: F.scaled_dot_product_attention(qb, kb, vb, is_causal=True),
            2 * 2 * s.B * s.heads * s.S * s.S * s.d // 2,
        )
        self._dense(ops, "o", q, s.H, "rows", r)

    def _build_gdn(self, ops: dict, r: int) -> None:
        s = self.s
        g = s.gdn
        c_qkv = 2 * g["nk"] * g["dk"] + g["nv"] * g["dv"]
        self._dense(ops, "gdn in_proj", s.H, c_qkv + g["nv"] * g["dv"] + 2 * g["nv"], None, r)
        C, n = _chunks(s.S, GDN_CHUNK)
        nc = s.B * g["nv"] * n
        dk, dv = g["dk"], g["dv"]
        self._bmm(ops, "gdn [k|q] k^T", nc, 2 * C, dk, C)
        self._bmm(ops, "gdn T [k|v]", nc, C, C, dk + dv)
        self._bmm(ops, "gdn [w|q] S", nc, 2 * C, dk, dv)
        self._bmm(ops, "gdn k^T v'", nc, dk, C, dv)
        self._bmm(ops, "gdn (q k^T) v'", nc, C, C, dv)
        self._dense(ops, "gdn out_proj", g["nv"] * dv, s.H, None, r)

    def _build_mamba(self, ops: dict, r: int) -> None:
        s = self.s
        mb = s.mamba
        di, xbc = mb["nh"] * mb["P"], mb["nh"] * mb["P"] + 2 * mb["ng"] * mb["N"]
        self._dense(ops, "mamba in_proj", s.H, di + xbc + mb["nh"], None, r)
        C, n = _chunks(s.S, mb["chunk"])
        nc, ng = s.B * mb["nh"] * n, s.B * mb["ng"] * n
        self._bmm(ops, "ssd C B^T", ng, C, mb["N"], C)
        self._bmm(ops, "ssd (C B^T) x", nc, C, C, mb["P"])
        self._bmm(ops, "ssd B^T x", nc, mb["N"], C, mb["P"])
        self._bmm(ops, "ssd C S", nc, C, mb["N"], mb["P"])
        self._dense(ops, "mamba out_proj", di, s.H, None, r)

    def _build_mlp(self, ops: dict, r: int) -> None:
        self._dense(ops, "mlp up", self.s.H, self.s.mlp, None, r)
        self._dense(ops, "mlp down", self.s.mlp, self.s.H, None, r)

    def _build_moe(self, ops: dict, r: int) -> None:
        s = self.s
        gated = s.family == "qwen3_5"
        if gated:
            self._dense(ops, "router", s.H, s.E + 1, None, r)
        else:  # Nemotron-H's router: fp32 sums of the bf16 products (module docstring)
            x, w = self._input(s.T, s.H), self._rnd(s.E, s.H)
            ops["router"] = (lambda: tensor_core_fp32_out(x, w), 2 * s.T * s.E * s.H)
        if s.latent:
            self._dense(ops, "fc1_latent_proj", s.H, s.latent, None, r)
        self._experts(ops, "gate_up" if gated else "up", s.He, (2 if gated else 1) * s.I, r)
        self._experts(ops, "down", s.I, s.He, r)
        if s.latent:
            self._dense(ops, "fc2_latent_proj", s.latent, s.H, None, r)
        self._dense(ops, "shared gate_up" if gated else "shared up", s.H, (2 if gated else 1) * s.shared, None, r)
        self._dense(ops, "shared down", s.shared, s.H, None, r)

    # -- SolForward's interface --------------------------------------------------------------------------------
    def gemms(self, lora: bool) -> dict:
        return self.ops[self.R if lora else 0]

    def lm_head_op(self):
        return (lambda: F.linear(self.x, self.lm_head)), 2 * self.s.T * self.s.V * self.s.H

    def _layer_ops(self, kinds: tuple, ops: dict) -> list:
        return [fn for name, (fn, _) in ops.items() if self.kind_of[name] in kinds]

    def count(self, name: str) -> int:
        """How many times the call runs product ``name`` (lm_head: once)."""
        return 1 if name == "lm_head" else sum(self.kind_of[name] in kinds for kinds in self.s.kinds)

    def call(self, lora: bool) -> None:
        ops = self.gemms(lora)
        plans = {kinds: self._layer_ops(kinds, ops) for kinds in set(self.s.kinds)}
        for kinds in self.s.kinds:
            for fn in plans[kinds]:
                fn()
        self.lm_head_op()[0]()

    def floor_bytes(self) -> int:
        """Bytes of the memory-bound passes of one call (see the module docstring)."""
        s = self.s
        el = torch.empty(0, dtype=self.dtype).element_size()
        T, H = s.T, s.H
        norm = 4 * T * H * el
        total = norm  # the final norm
        for kinds in s.kinds:
            total += norm * (2 if s.family == "qwen3_5" else 1)
            for kind in kinds:
                if kind == "moe":
                    total += s.K * T * s.He * el + T * H * el
                elif kind == "attn" and s.family == "qwen3_5":
                    total += 2 * T * (s.heads + s.kv_heads) * s.d * el + 3 * T * s.heads * s.d * el
                elif kind == "gdn":
                    g = s.gdn
                    c_qkv, o = 2 * g["nk"] * g["dk"] + g["nv"] * g["dv"], g["nv"] * g["dv"]
                    _, n = _chunks(s.S, GDN_CHUNK)
                    total += (
                        2 * T * c_qkv * el
                        + T * c_qkv * el
                        + 2 * T * g["nv"] * 4
                        + T * o * el
                        + 2 * s.B * g["nv"] * n * g["dk"] * g["dv"] * el
                        + 3 * T * o * el
                    )
                elif kind == "mamba":
                    mb = s.mamba
                    di, xbc = mb["nh"] * mb["P"], mb["nh"] * mb["P"] + 2 * mb["ng"] * mb["N"]
                    _, n = _chunks(s.S, mb["chunk"])
                    total += (
                        2 * T * xbc * el
                        + T * xbc * el
                        + T * mb["nh"] * 4
                        + T * di * el
                        + 2 * s.B * mb["nh"] * n * mb["N"] * mb["P"] * el
                        + 3 * T * di * el
                    )
        return total


def weight_bytes(s: HybridShapes, rank: int, el: int = 2) -> tuple[int, int]:
    """(weights, LoRA) bytes of the model at this depth in the model dtype: what the runtime holds on one GPU
    (embedding + lm_head + every layer; the LoRA of benchmarks/bench_e2e.py's adapter, rank ``rank``)."""
    w, lora = 2 * s.V * s.H, 0
    q = s.heads * s.d
    for kinds in s.kinds:
        for kind in kinds:
            if kind == "attn":
                qkv = q * (2 if s.gated_attention else 1) + 2 * s.kv_heads * s.d
                w += s.H * qkv + q * s.H
                lora += rank * (3 * s.H + qkv) + rank * (q + s.H)
            elif kind == "gdn":
                g = s.gdn
                c_qkv = 2 * g["nk"] * g["dk"] + g["nv"] * g["dv"]
                w += s.H * (c_qkv + g["nv"] * g["dv"] + 2 * g["nv"]) + g["nv"] * g["dv"] * s.H + c_qkv * g["conv"]
            elif kind == "mamba":
                mb = s.mamba
                di, xbc = mb["nh"] * mb["P"], mb["nh"] * mb["P"] + 2 * mb["ng"] * mb["N"]
                w += s.H * (di + xbc + mb["nh"]) + di * s.H + xbc * 4
            elif kind == "mlp":
                w += 2 * s.H * s.mlp
            elif kind == "moe":
                up = (2 if s.family == "qwen3_5" else 1) * s.I
                w += s.E * (s.He * up + s.I * s.He) + s.H * s.E + s.H * s.shared * (3 if up == 2 * s.I else 2)
                w += 2 * s.H * s.latent if s.latent else 0
                lora += s.E * rank * (s.He + up + s.I + s.He)
    return w * el, lora * el


def fit_depth(model: str, batch: int, seq: int, rank: int, budget: float) -> int:
    """The largest depth (first layers of the model) whose weights + LoRA fit ``budget`` bytes."""
    full = hybrid_shapes(model, batch, seq, None)
    best = 1
    for n in range(1, full.L + 1):
        w, lo = weight_bytes(hybrid_shapes(model, batch, seq, n), rank)
        if w + lo > budget:
            break
        best = n
    return best
