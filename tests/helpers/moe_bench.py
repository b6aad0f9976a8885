"""The MoE launches that benchmarks/bench_kernels.py times and the kernel tests check on CPU: expert shapes and
seeded inputs, moe_forward_triton's default tiles, each launch staged on its own, the LoRA shrink sweep and the
sm90 compile report. Benchmarks import these; tests never import benchmarks."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

from lpdiff.kernels._triton import next_pow2
from lpdiff.kernels.fused_moe_lora import (
    expert_lora_kwargs,
    expert_shrink,
    moe_configs,
    moe_forward_triton,
    shrink_once,
)
from lpdiff.kernels.gemm_config import SMEM_BUDGET, ShrinkConfig, shrink_block_k
from lpdiff.kernels.lora_gemm import launch_gemm
from lpdiff.kernels.lora_weights import MoeLoraWeights
from lpdiff.kernels.moe_align import moe_align
from lpdiff.kernels.moe_inputs import MoeInputs


@dataclass(slots=True)
class MoeShape:
    name: str
    E: int
    H: int
    I: int
    K: int
    activation: str
    bias: bool

    @property
    def n1(self) -> int:
        return self.I if self.activation == "relu2" else 2 * self.I

    def label(self, rank: int) -> str:
        return f"{self.name}(E{self.E},H{self.H},I{self.I},K{self.K},r{rank})"


SHAPES = [
    MoeShape("qwen3-30b-a3b", 128, 2048, 768, 8, "silu", False),
    MoeShape("gpt-oss-20b", 32, 2880, 2880, 4, "swiglu_oai", True),
]


def make_inputs(s: MoeShape, T: int, L: int, rank: int, dtype, device, seed=0) -> MoeInputs:
    """device "meta": shapes only (--compile-sm90 builds launches from them)."""
    g = torch.Generator(device=device).manual_seed(seed) if device != "meta" else None

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, device=device, dtype=dtype) * scale

    x = rnd(T, s.H)
    w, ids = torch.randn(T, s.E, generator=g, device=device).softmax(-1).topk(s.K, dim=-1)
    lora, token_adapter = None, None
    if L:
        lora = MoeLoraWeights(
            rnd(L, s.E, rank, s.H, scale=s.H**-0.5),
            rnd(L, s.E, s.n1, rank, scale=0.02),
            rnd(L, s.E, rank, s.I, scale=s.I**-0.5),
            rnd(L, s.E, s.H, rank, scale=0.02),
            scaling=torch.full((L,), 2.0, device=device),
            ranks=torch.full((L,), rank, dtype=torch.int32, device=device),
        )
        # contiguous runs of tokens per adapter, as prompts of a batch would be
        token_adapter = (torch.arange(T, device=device) * L // T).to(torch.int32)
    return MoeInputs(
        x=x,
        topk_ids=ids.to(torch.int32),
        topk_weights=(w / w.sum(-1, keepdim=True)).float(),
        w_gate_up=rnd(s.E, s.n1, s.H, scale=s.H**-0.5),
        w_down=rnd(s.E, s.H, s.I, scale=s.I**-0.5),
        activation=s.activation,
        b_gate_up=rnd(s.E, s.n1, scale=0.1) if s.bias else None,
        b_down=rnd(s.E, s.H, scale=0.1) if s.bias else None,
        lora=lora,
        token_adapter=token_adapter,
    )


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def bench(fn, rep=100) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


def untimed(fn, rep=0) -> float:
    """bench's stand-in on CPU: runs fn once, so the staged launches can be checked without a GPU."""
    fn()
    return 0.0


def configs(p: MoeInputs, lora_shrink: str = "once", device=None, **flags) -> dict:
    """moe_forward_triton's default tiles of both GEMMs with GemmConfig flags changed, as its keywords; device:
    the tiles for that device instead of x's."""
    c1, c2 = moe_configs(p, shrink_once(p.lora, lora_shrink), device, **flags)
    return dict(config=c1, down_config=c2)


def stage_breakdown(p: MoeInputs, lora_shrink: str = "once", rep=50, timer=None, **flags) -> tuple[dict, torch.Tensor]:
    """Times each launch of moe_forward_triton alone (same inputs, tiles and order of operations); with
    lora_shrink "once" the two shrink launches are stages of their own. timer(fn, rep) -> ms (default: bench);
    flags: GemmConfig fields changed in both GEMMs. Also returns the (T, H) output of the staged launches, so that
    a CPU test can check they compute the layer."""
    timer = timer or bench
    x, lora = p.x, p.lora
    once = shrink_once(lora, lora_shrink)
    cfg1, cfg2 = configs(p, lora_shrink, **flags).values()
    T, H = x.shape
    E, _n1, _ = p.w_gate_up.shape
    K = p.topk_ids.shape[1]
    I = p.w_down.shape[2]
    L = lora.num_slots if lora is not None else 0

    def align():
        return moe_align(p.topk_ids, p.token_adapter, E, L, cfg1.block_m, impl="triton")

    r = align()
    M = r.sorted_ids.shape[0]
    inter = torch.empty(M, I, dtype=x.dtype, device=x.device)
    y = torch.empty(T * K, H, dtype=x.dtype, device=x.device)
    tw = p.topk_weights.reshape(-1).float()
    t = {"align": timer(align, rep)}
    s1 = s2 = None
    if once:
        t["shrink1"] = timer(lambda: expert_shrink(x, lora, "gate_up", r), rep)
        s1 = expert_shrink(x, lora, "gate_up", r)

    def g1():
        return launch_gemm(
            x,
            p.w_gate_up,
            inter,
            r,
            cfg1,
            x_sorted=False,
            out_sorted=True,
            activation=p.activation,
            bias=p.b_gate_up,
            **expert_lora_kwargs(lora, "gate_up", s1),
        )

    g1()
    t["gemm1"] = timer(g1, rep)
    if once:
        t["shrink2"] = timer(lambda: expert_shrink(inter, lora, "down", r), rep)
        s2 = expert_shrink(inter, lora, "down", r)

    def g2():
        return launch_gemm(
            inter,
            p.w_down,
            y,
            r,
            cfg2,
            x_sorted=True,
            out_sorted=False,
            bias=p.b_down,
            topk_weights=tw,
            **expert_lora_kwargs(lora, "down", s2),
        )

    g2()
    t["gemm2"] = timer(g2, rep)
    t["sum"] = timer(lambda: y.view(T, K, H).sum(dim=1), rep)
    return t, (y.view(T, K, H).sum(dim=1) if K > 1 else y)


def shrink_sweep_configs(R: int, dtype=torch.bfloat16) -> list[ShrinkConfig]:
    """Today's launch (ShrinkConfig()) first, then rows per program (sub-blocks of the 128-row routing blocks
    first) x block_k x (warps, stages) whose pipelined tiles fit in shared memory."""
    cfgs = [ShrinkConfig()]
    d = ShrinkConfig()  # what it resolves to at T=4096 (128-row routing blocks)
    today = (128, shrink_block_k(128, next_pow2(R), dtype, True), d.num_warps, d.num_stages)
    for rows, bk, (warps, stages) in itertools.product((64, 32, 128), (128, 64, 256), ((4, 3), (8, 3), (4, 4), (4, 2))):
        fits = stages * (rows + next_pow2(R)) * bk * torch.finfo(dtype).bits // 8 <= SMEM_BUDGET
        if fits and (rows, bk, warps, stages) != today:
            cfgs.append(ShrinkConfig(rows, bk, warps, stages))
    return cfgs


def shrink_label(c: ShrinkConfig) -> str:
    return f"rows={c.rows or 'block_m'} bk={c.block_k or 'auto'} w={c.num_warps} s={c.num_stages}"


def shrink_sweep(
    log, record_row, shapes, T: int, R: int, budget_s: float, device="cuda", dtype=torch.bfloat16, timer=None, cfgs=None
) -> list[tuple[float, ShrinkConfig]]:
    """expert_shrink of both GEMMs (gate_up over x gathered per pair, down over the sorted intermediate) at each
    shape, T tokens, one adapter, under each ShrinkConfig (default shrink_sweep_configs); each output is checked
    against the default launch's. Stops starting configs after budget_s. record_row(shape, gemm, cfg, ms, err).
    Returns (ms summed over shapes and GEMMs, cfg) of the configs that ran everywhere, best first."""
    timer = timer or bench
    cases = []
    for s in shapes:
        p = make_inputs(s, T, 1, R, dtype, device)
        block_m = configs(p)["config"].block_m  # the routing the GEMMs would use
        r = moe_align(p.topk_ids, p.token_adapter, s.E, 1, block_m, impl="triton")
        used = int(r.num_padded)  # rows past it are never written
        inter = torch.randn(r.sorted_ids.shape[0], s.I, device=device, dtype=dtype)
        for gemm, inp in (("gate_up", p.x), ("down", inter)):
            cases.append((s, gemm, inp, p.lora, r, used, expert_shrink(inp, p.lora, gemm, r)[:used]))
    t0, totals = time.time(), []
    for cfg in cfgs or shrink_sweep_configs(R, dtype):
        if time.time() - t0 > budget_s:
            log(f"shrink sweep: budget {budget_s:.0f} s spent, configs from {shrink_label(cfg)} on not tried")
            break
        total = 0.0
        for s, gemm, inp, lora, r, used, ref in cases:

            def fn(inp=inp, lora=lora, gemm=gemm, r=r, cfg=cfg):
                return expert_shrink(inp, lora, gemm, r, cfg)

            try:
                err = rel_err(fn()[:used], ref)
                ms = timer(fn)
            except Exception as exc:  # noqa: BLE001 (a config that does not compile or fit must not end the run)
                log(f"shrink sweep {s.name} {gemm} {shrink_label(cfg)} failed: {type(exc).__name__}: {str(exc)[:200]}")
                break
            record_row(s, gemm, cfg, ms, err)
            total += ms
        else:
            totals.append((total, cfg))
    totals.sort(key=lambda t: t[0])
    for total, cfg in totals[:5]:
        log(f"shrink sweep best (sum over shapes and GEMMs): {total:.4f} ms {shrink_label(cfg)}")
    return totals


# ------------------------------------------------------------------------------------- sm90 compile, no GPU

SM90_SMEM = 232448  # bytes of shared memory one block may use on sm90 (227 KiB)


def record_launches(fn) -> list[tuple]:
    """Runs fn with every Triton launch recorded instead of run: [(kernel, args, kwargs)]."""
    from lpdiff.kernels._triton import DualKernel

    launches, original = [], DualKernel.__getitem__
    DualKernel.__getitem__ = lambda kernel, grid_device: lambda *a, **kw: launches.append((kernel, a, kw))
    try:
        fn()
    finally:
        DualKernel.__getitem__ = original
    return launches


def sm90_compiled(kernel, args, kwargs):
    """One recorded launch compiled for sm90 with the JIT's own argument specialization (pointers and ints
    divisible by 16, ints equal to 1 as constants; Triton 3.6 internals), no GPU needed: Triton's compiled kernel,
    its IR of every stage in .asm (ttir, ttgir, llir, ptx)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", 90, 64)
    backend, jf, kwargs = make_backend(target), kernel.jit, dict(kwargs)
    if kwargs.get("UPCAST"):  # meta tensors count as interpreted; the GPU multiplies bf16 in tl.dot
        kwargs.update(UPCAST=False, DOT_PREC="tf32")
    bound, spec, options = create_function_from_signature(jf.signature, jf.params, backend)(*args, **kwargs)
    options, sig, const, attrs = jf._pack_args(backend, kwargs, bound, spec, options)
    return triton.compile(
        ASTSource(jf, sig, const, attrs),
        target=target,
        options=dict(num_warps=options.num_warps, num_stages=options.num_stages),
    )


def compile_sm90(kernel, args, kwargs) -> dict:
    """One recorded launch compiled for sm90 (sm90_compiled); ptxas -v gives the registers and spills, the TTGIR
    which loads are TMA / cp.async and whether the dots are wgmma."""
    import re
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    k = sm90_compiled(kernel, args, kwargs)
    with tempfile.TemporaryDirectory() as tmp:
        with open(f"{tmp}/k.ptx", "w") as f:
            f.write(k.asm["ptx"])
        log = subprocess.run(
            [get_ptxas(90).path, "-v", "--gpu-name=sm_90a", f"{tmp}/k.ptx", "-o", f"{tmp}/k.cubin"],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    ttgir = k.asm["ttgir"]
    return dict(
        regs=int(re.search(r"Used (\d+) registers", log).group(1)),
        spill=int(re.search(r"(\d+) bytes spill stores", log).group(1)),
        smem=k.metadata.shared,
        tma="async_tma_copy_global_to_local" in ttgir,
        cp_async="async_copy_global_to_local" in ttgir,
        wgmma="warp_group_dot" in ttgir,
        warp_specialized="ttg.warp_specialize" in ttgir,
    )


SM90_KEYS = (
    "LORA",
    "X_SORTED",
    "GATED",
    "HAS_BIAS",
    "PREFETCH",
    "TMA",
    "TMA_X",
    "N_TILES",
    "ZERO_PAD",
    "HALF_TAIL",
    "BLOCK_M",
    "BLOCK_N",
    "BLOCK_K",
    "num_stages",
)


# --compile-sm90's variants: default, prefetch off, TMA; then the programs walking several N tiles (GemmConfig
# n_tiles): the shrink in the first tile's K-loop ("fused") at 1-4 tiles, and "once" / no LoRA at 2; padding
# "half" (two tile heights in one kernel) with each shrink placement
SM90_FLAG_SETS = (
    [{}, dict(prefetch=False), dict(tma=True)]
    + [dict(lora_shrink="fused", n_tiles=k) for k in (1, 2, 3, 4)]
    + [dict(n_tiles=2)]
    + [dict(padding="half"), dict(lora_shrink="fused", n_tiles=3, padding="half")]
)


def sm90_report(log, shapes, T: int, R: int, flag_sets) -> list[dict]:
    """moe_forward_triton's shrink and GEMM launches at each shape (T tokens, one adapter, and without LoRA; bf16;
    the default GPU tiles with each set of GemmConfig flags; a set's "lora_shrink" key picks the shrink mode)
    compiled for sm90 on this machine: shared memory against the 227 KiB a block may use, registers, spills, TMA.
    One line per distinct launch. Needs a process in which the Triton interpreter has not run: Triton 3.6 leaves
    triton.language patched after an interpreted device-function call, and compiling then fails."""
    from lpdiff.kernels._triton import next_pow2 as np2

    seen, out = set(), []
    for s, flags in itertools.product(shapes, flag_sets):
        flags = dict(flags)
        mode = flags.pop("lora_shrink", "once")
        p = make_inputs(s, T, 1, R, torch.bfloat16, "meta")
        for q in (p, p.without_lora()):
            cfg = configs(q, mode, device=torch.device("cuda"), **flags)
            shrink = ShrinkConfig(block_k=shrink_block_k(cfg["config"].block_m, np2(R), torch.bfloat16, True))

            def run(q=q, cfg=cfg, shrink=shrink, mode=mode):
                return moe_forward_triton(q, **cfg, shrink_config=shrink, lora_shrink=mode)

            for kernel, args, kw in record_launches(run):
                name = kernel.fn.__name__
                key = (s.name, name, tuple(sorted(kw.items())))
                if name.startswith("_align") or key in seen:
                    continue
                seen.add(key)
                r = dict(
                    compile_sm90(kernel, args, kw),
                    shape=s.name,
                    kernel=name,
                    **{k: kw[k] for k in SM90_KEYS if k in kw},
                )
                out.append(r)
                log(
                    f"sm90 {s.name:14s} {name:22s} "
                    + " ".join(f"{k}={kw[k]}" for k in SM90_KEYS if k in kw)
                    + f" | smem {r['smem']}{' OVER' if r['smem'] > SM90_SMEM else ''} regs {r['regs']} spill "
                    f"{r['spill']} B tma {int(r['tma'])} cp.async {int(r['cp_async'])} wgmma {int(r['wgmma'])}"
                )
    return out
