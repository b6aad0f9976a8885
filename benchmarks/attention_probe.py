"""Probe: the runtime's attention paths against kernels/attention.py's Triton kernel (and its tiles), at the e2e
batch's shapes (8 x 512 tokens, bf16), q/k/v as strided views of one packed q|k|v buffer as in the runtime.

    python benchmarks/attention_probe.py          # GPU

Per model shape it prints, per layer: the runtime's "auto" path (gpt-oss: FlashAttention-2 varlen + the fp32 sink
correction; Qwen3: padded SDPA), "flash" and "sdpa" where they differ, the Triton kernel at its default tiles and
at the alternatives, and plain causal SDPA without window or sinks (sol_forward.py's attention), each with its max
|difference| from the torch reference in fp32 where it computes the same thing.
"""
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lpdiff.engines.triton.attention import attention as runtime_attention  # noqa: E402
from lpdiff.engines.triton.batch import Batch  # noqa: E402
from lpdiff.kernels.attention import attention, attention_torch  # noqa: E402
from tests.test_kernels_attention import make_qkv  # noqa: E402

SHAPES = {  # name: (query heads, kv heads, head_dim, window, sinks)
    "gpt-oss sliding": (64, 8, 64, 128, True),
    "gpt-oss full": (64, 8, 64, None, True),
    "qwen3": (32, 4, 128, None, False),
}
TILES = [  # BLOCK_M, BLOCK_N, num_warps, num_stages
    (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 32, 4, 3), (128, 64, 4, 2),
    (64, 128, 4, 3), (128, 128, 8, 2),
]


def main():
    print(f"gpu {torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    lens = [512] * 8
    for name, (hq, hkv, d, window, sinks) in SHAPES.items():
        q, k, v, cu = make_qkv(lens, hq, hkv, d, dtype=torch.bfloat16, device="cuda")
        s = torch.randn(hq, device="cuda") if sinks else None
        pos = torch.cat([torch.arange(n) for n in lens]).cuda()
        seq = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)).cuda()
        batch = Batch(pos, pos, seq, lens, cu, None, None, None)
        ref = attention_torch(q.float(), k.float(), v.float(), cu, d ** -0.5, window, s)
        keys = sum(min(i + 1, window or n) for n in lens for i in range(n))  # (query, key) pairs computed
        flops = 4 * keys * hq * d

        def report(label, fn, compare=True):
            ms = do_bench(fn, warmup=25, rep=200, return_mode="median")
            err = f"max |d| {(fn().float() - ref).abs().max().item():.3g}" if compare else "(no window / sinks)"
            print(f"{name:16s} {label:34s} {ms * 1e3:7.1f} us  {flops / ms / 1e9:5.0f} TFLOP/s  {err}",
                  flush=True)

        for impl in ("auto", "flash", "sdpa"):
            report(f"runtime {impl}", lambda: runtime_attention(q, k, v, batch, d ** -0.5, window, s, impl))
        for bm, bn, w, st in TILES:
            cfg = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st)
            try:
                report(f"triton {bm}x{bn} w{w} s{st}", lambda: attention(q, k, v, cu, 512, d ** -0.5, window, s,
                                                                        config=cfg))
            except Exception as e:  # noqa: BLE001 - a tile that does not compile (shared memory) is a result too
                print(f"{name:16s} triton {bm}x{bn} w{w} s{st}: {type(e).__name__}: {str(e)[:120]}", flush=True)
        qp, kp, vp = (torch.randn(8, hq, 512, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = 4 * sum(n * (n + 1) // 2 for n in lens) * hq * d
        report("sdpa plain causal, full heads", lambda: torch.nn.functional.scaled_dot_product_attention(
            qp, kp, vp, is_causal=True), compare=False)


if __name__ == "__main__":
    main()
