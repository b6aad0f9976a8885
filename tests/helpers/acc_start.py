"""Where the running sum of each dot of the expert GEMMs starts, as Triton compiles them for sm90 (no GPU needed):
the launches of moe_forward_triton at tiny gpt-oss's expert shape (biases on both GEMMs) without LoRA and with each
placement of the LoRA (shrink once with the expand "loop" / "first" / "last", the shrink in the K-loop, TMA).
Run as ``python -m tests.helpers.acc_start`` (JSON on stdout) by tests/kernels/test_gemm_bias_start.py: compiling
needs a process in which the Triton interpreter has not run (moe_bench.sm90_report says why)."""

from __future__ import annotations

import json
import re

import torch

from lpdiff.kernels.fused_moe_lora import moe_forward_triton
from tests.helpers.moe_bench import MoeShape, configs, make_inputs, record_launches, sm90_compiled

# the tiny zoo's gpt-oss experts: the down GEMM's Kdim (I = 40) is one K step of 64, a K-loop Triton folds away
TINY_GPT_OSS = MoeShape("tiny-gpt-oss", 8, 128, 40, 4, "swiglu_oai", True)
# name -> (dtype, LoRA slots, lora_shrink, GemmConfig flags); the GPU's default tiles for 16 tokens
VARIANTS = {
    "base": (torch.float32, 0, "once", {}),
    "once-loop": (torch.float32, 2, "once", dict(expand="loop")),
    "once-first": (torch.float32, 2, "once", dict(expand="first")),
    "once-last": (torch.float32, 2, "once", dict(expand="last")),
    "fused": (torch.float32, 2, "fused", {}),
    "base-bf16-tma": (torch.bfloat16, 0, "once", dict(tma=True)),  # gate and up in two accumulators (SPLIT)
    "once-bf16-tma": (torch.bfloat16, 2, "once", dict(tma=True)),
}
KEYS = ("LORA", "EXPAND", "K_TILES", "HAS_BIAS", "TMA", "BLOCK_R")

_DOT = re.compile(r"= tt\.dot (%[\w.]+), (%[\w.]+), (%[\w.]+)[^:]*: .* -> tensor<(\d+)x(\d+)x\w+>")
_DEF = re.compile(r"^\s*(%[\w.]+)(?::\d+)? = (.*)$")
_ITER = re.compile(r"iter_args\(([^)]*)\)")


def dot_starts(ttir: str) -> list[dict]:
    """Each tt.dot of a TTIR: its result width and the op its accumulator chain starts from (a loop-carried
    accumulator followed back to the loop's initial value), and whether that op is a constant zero."""
    defs, init = {}, {}
    for line in ttir.splitlines():
        m = _DEF.match(line)
        if m:
            defs[m.group(1)] = m.group(2)
        for args in _ITER.findall(line):
            for pair in args.split(", "):
                name, _, value = pair.partition(" = ")
                init[name.strip()] = value.strip()
    out = []
    for m in _DOT.finditer(ttir):
        start = m.group(3)
        while start in init:
            start = init[start]
        op = defs.get(start.split("#")[0], "argument")  # %3#0: the first result of the op defining %3
        zero = op.startswith("arith.constant dense<0.0")
        out.append(dict(width=int(m.group(5)), start=op.split(" ")[0], zero=zero))
    return out


def launches() -> list[dict]:
    out = []
    for name, (dtype, slots, shrink, flags) in VARIANTS.items():
        p = make_inputs(TINY_GPT_OSS, 16, slots, 8, dtype, "meta")
        cfg = configs(p, shrink, device=torch.device("cuda"), **flags)
        for kernel, args, kw in record_launches(
            lambda p=p, cfg=cfg, s=shrink: moe_forward_triton(p, **cfg, lora_shrink=s)
        ):
            if kernel.fn.__name__ != "_grouped_gemm_kernel":
                continue
            ttir = sm90_compiled(kernel, args, kw).asm["ttir"]
            gemm = "down" if kw["MUL_TOPK"] else "gate_up"
            out.append(dict(variant=name, gemm=gemm, dots=dot_starts(ttir), **{k: kw[k] for k in KEYS}))
    return out


if __name__ == "__main__":
    print(json.dumps(launches()))
