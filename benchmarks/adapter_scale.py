"""How far generated adapters move the tiny zoo's logprobs, per `scale` (the calibration behind
harness.adapters.DEFAULT_SCALE).

    PYTHONPATH=. python benchmarks/adapter_scale.py [--models tiny-qwen3-moe,...] [--scales 0.1,0.2,0.4,0.8]

For each zoo model, scale and group set (all groups the model has / experts only): a rank-8, alpha-16 adapter
(seed 0) loaded by PEFT, actual-token logprobs on the "default" prompt set, d = adapted - base:
mean |d|, p99 |d|, max |d| and k2 = 0.5 mean(d^2). Prints a markdown table.
"""
from __future__ import annotations

import argparse
import copy
import platform
import tempfile

import torch

from lpdiff.harness.spec import adapters as ad
from lpdiff.harness.spec.catalog import ZOO, get_model, load_hf_model
from lpdiff.harness.spec.prompts import prompt_set


def actual_logprobs(model, prompts: list[list[int]]) -> torch.Tensor:
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            lp = model(ids).logits.float().log_softmax(-1)
            out.append(lp[0, :-1].gather(-1, ids[0, 1:, None])[:, 0])
    return torch.cat(out)


def main(argv=None) -> None:
    from peft import PeftModel

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(m for m in ZOO if m != "tiny-qwen3-dense"))
    ap.add_argument("--scales", default="0.1,0.2,0.4,0.8")
    args = ap.parse_args(argv)
    print(f"machine: {platform.machine()} {platform.processor() or ''}, torch {torch.__version__}\n")
    print("| model | groups | scale | mean abs d | p99 abs d | max abs d | k2 |")
    print("|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        model = load_hf_model(get_model(name), torch.float32, "cpu")
        prompts = prompt_set(name, "default")
        base = actual_logprobs(model, prompts)
        layout = ad.ModelLayout.of(model)
        present = sorted({ad.module_group(n) for n in [*layout.linears, *layout.experts]} & set(ad.GROUPS))
        for groups in (present, ["experts"]):
            for scale in map(float, args.scales.split(",")):
                with tempfile.TemporaryDirectory() as tmp:
                    ad.generate_adapter(model, tmp, groups, rank=8, alpha=16, seed=0, scale=scale)
                    peft = PeftModel.from_pretrained(copy.deepcopy(model), tmp).eval()
                    d = actual_logprobs(peft, prompts) - base
                print(f"| {name} | {'+'.join(groups)} | {scale} | {d.abs().mean():.3f} | "
                      f"{d.abs().quantile(0.99):.3f} | {d.abs().max():.3f} | {0.5 * (d ** 2).mean():.2e} |",
                      flush=True)


if __name__ == "__main__":
    main()
