"""What mamba_ssm's chunked scan's bf16 rounding costs end to end, measured on CPU: the triton runtime's torch path on
the zoo's tiny-nemotron-h (adapter 'mamba' on rows 0 and 2), bf16, with its scan (kernels/ssd.ssd_scan: fp32 inside,
as the recurrence) and with the chunked kernels' roundings emulated in it (tests/helpers/ssd_rounding.py, checked
against the compiled kernels by tests/kernels/test_ssd_chunked.py's gpu1 test), each against the fp32 forward in the
harness's metrics, over several seeded prompt sets of lengths 300, 17, 129, 64 (seed 8 is the gpu1 test's,
tests/engines/triton/test_mamba_scan.py), and the state_not_reset fault for scale. The numbers behind the comment on
engines/triton/options.py's mamba_scan.

    python -m benchmarks.ssd_rounding_noise [--seeds 8,1,2,3,4]
"""

from __future__ import annotations

import argparse
import functools

import torch

import lpdiff.engines.triton.mamba as mamba
from lpdiff.engines.base import EngineConfig, open_engine
from lpdiff.harness.pipeline.metrics import compare
from lpdiff.harness.spec.resolve import resolve_model, zoo_adapters
from lpdiff.harness.types import LogprobRun
from lpdiff.kernels import faults
from tests.helpers.ssd_rounding import ssd_scan_rounded

ZOO = "tiny-nemotron-h"
LENS = (300, 17, 129, 64)
CHOICE = ["mamba", None, "mamba", None]


def _run(prompts: list, dtype: str, scan, fault: str | None = None) -> LogprobRun:
    cfg = EngineConfig(
        model=resolve_model(ZOO),
        adapters={"mamba": zoo_adapters(ZOO)["mamba"]},
        dtype=dtype,
        device="cpu",
        options={"impl": "torch"},
    )
    original = mamba.ssd_scan
    mamba.ssd_scan = scan  # the torch path's scan, as mamba_mixer calls it
    try:
        with open_engine("triton", cfg) as eng:
            if fault is None:
                return LogprobRun(eng.prompt_logprobs(prompts, CHOICE, top_k=0))
            with faults.injected(fault):
                return LogprobRun(eng.prompt_logprobs(prompts, CHOICE, top_k=0))
    finally:
        mamba.ssd_scan = original


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="8,1,2,3,4")
    args = ap.parse_args(argv)
    plain = mamba.ssd_scan
    emulated = functools.partial(ssd_scan_rounded, dtype=torch.bfloat16)
    print(f"{'seed':>4} {'bf16 run':<26} {'k2':>9} {'max|d|':>7} {'mean|d|':>8} {'k2 x':>6} {'mean x':>6}")
    for seed in (int(s) for s in args.seeds.split(",")):
        g = torch.Generator().manual_seed(seed)
        prompts = [torch.randint(1, 1024, (n,), generator=g).tolist() for n in LENS]
        ref = _run(prompts, "float32", plain)
        rows = {
            "fp32 scan (recurrence)": _run(prompts, "bfloat16", plain),
            "chunked roundings": _run(prompts, "bfloat16", emulated),
            "fp32 scan, state_not_reset": _run(prompts, "bfloat16", plain, "state_not_reset"),
        }
        base = None
        for name, run in rows.items():
            m = compare(run, ref)
            base = base or m
            print(
                f"{seed:>4} {name:<26} {m.k2:9.3g} {m.max_abs:7.3g} {m.mean_abs:8.3g} "
                f"{m.k2 / base.k2:6.3g} {m.mean_abs / base.mean_abs:6.3g}"
            )


if __name__ == "__main__":
    main()
