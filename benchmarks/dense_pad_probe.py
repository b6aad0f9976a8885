"""Probe: cuBLAS time of the dense LoRA-augmented GEMMs against the width of their LoRA part.

The runtime folds dense LoRA into the base GEMM (kernels/lora_linear.py): q|k|v as extra K ([x | S] [W | B]^T,
K = H + L*3*R) and o as extra output rows ([out | S] = x [W ; A]^T, N = H + L*R). At rank 32 with one adapter the
extra width is 96 (q|k|v) / 32 (o), and cuBLAS may pick another tiling for the odd total. This times each
shape at its exact width and zero-padded to multiples of 64 / 128, bf16, T = 4096 (the e2e batch).

    python benchmarks/dense_pad_probe.py          # GPU
"""
import torch
from triton.testing import do_bench

T = 4096
SHAPES = {  # name: (hidden, q|k|v width, attention width)
    "qwen3-30b-a3b": (2048, 5120, 4096),
    "gpt-oss-20b": (2880, 5120, 4096),
}


def tflops(m, n, k, ms):
    return 2 * m * n * k / ms / 1e9


def main():
    print(f"gpu {torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    dev = "cuda"
    for _ in range(2):  # twice: the spread between identical shapes
        for name, (H, NQKV, A) in SHAPES.items():
            # q|k|v: extra K (3 slices x 32 at one rank-32 adapter = 96); o: extra output rows (1 slice x 32)
            for kind, extras in (("qkv", (0, 96, 128, 192)), ("o", (0, 32, 64, 128))):
                for extra in extras:
                    m, n, k = (T, NQKV, H + extra) if kind == "qkv" else (T, H + extra, A)
                    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
                    ms = do_bench(lambda: x @ w.T, warmup=50, rep=300)
                    print(f"{name} {kind:4s} N={n:5d} K={k:5d} (+{extra:3d}): {ms * 1e3:7.1f} us "
                          f"{tflops(m, n, k, ms):5.0f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
