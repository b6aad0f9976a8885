"""The committed adapters of the tiny zoo (harness/zoo_adapters/<model>/<adapter>/, PEFT format).

Three per model, so that verdicts can name which part of an adapter an engine mishandles:
  all        every target group the architecture has (attention, linear attention / mamba, dense MLP, shared
             expert, routed experts), rank 8
  experts    routed experts only (PEFT ``target_parameters``), rank 4 — a different rank from ``all`` on purpose
  attention  attention projections only, rank 8
Generated deterministically (``python -m lpdiff.harness.spec.adapter_zoo``); the committed files are the source of truth.
Their size depends on the model's weights (generate_adapter scales each delta to its weight), so rebuild them
after the zoo changes, then ``lpdiff regen``.
"""
from __future__ import annotations

import shutil
import sys

import torch

from lpdiff.harness.spec.adapters import GROUPS, ModelLayout, generate_adapter, resolve_targets
from lpdiff.harness.spec.catalog import ZOO, get_model, load_hf_model
from lpdiff.harness.spec.resolve import ZOO_ADAPTERS

SEED = 20261121
MOE_MODELS = [m for m, arch in ZOO.items() if arch != "qwen3"]


def available_groups(model) -> list[str]:
    layout, out = ModelLayout.of(model), []
    for g in GROUPS:
        try:
            resolve_targets(layout, [g])
        except ValueError:  # the architecture has no such modules (or PEFT refuses them)
            continue
        out.append(g)
    return out


def plan(model) -> dict[str, dict]:
    groups = available_groups(model)
    return {
        "all": {"groups": groups, "rank": 8},
        "experts": {"groups": ["experts"], "rank": 4},
        "attention": {"groups": ["attention"], "rank": 8},
    }


def build(name: str) -> list[str]:
    model = load_hf_model(get_model(name), torch.float32, "cpu")
    root = ZOO_ADAPTERS / name
    if root.exists():
        shutil.rmtree(root)
    made = []
    for i, (adapter, p) in enumerate(plan(model).items()):
        generate_adapter(model, root / adapter, groups=p["groups"], rank=p["rank"], alpha=2 * p["rank"],
                         seed=SEED + i)
        made.append(f"{name}/{adapter}: groups={','.join(p['groups'])} rank={p['rank']}")
    return made


def main(argv: list[str] | None = None) -> int:
    names = (argv if argv is not None else sys.argv[1:]) or MOE_MODELS
    for n in names:
        for line in build(n):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
