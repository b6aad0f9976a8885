"""The committed adapters of the tiny zoo (harness/zoo_adapters/<model>/<adapter>/, PEFT format).

One batch per model mixes them, so that verdicts can name which part of an adapter an engine mishandles:
  all                   every target group the architecture has, rank 8
  experts               routed experts only (PEFT ``target_parameters``), rank 4: a different rank from ``all``
  attention             attention projections only, rank 8 (Qwen3.5: q_proj with its output-gate half)
  <group>               one per other module group the architecture has, rank 8: linear_attention (Qwen3.5's
                        Gated DeltaNet), mamba (Nemotron-H's mixer in_proj: PEFT refuses out_proj), mlp
                        (Nemotron-H's dense layer), shared_expert; a verdict reports delta fidelity under the group
                        of each single-group adapter, so a dropped group is named
  experts_shared_outer  routed experts in the shared-outer form (one gate_up A and one down B for all experts),
                        rank 16, on the models the triton engine serves: a third rank in the same batch
  experts_per_expert    routed experts in the per-expert layout (experts.{e}.gate_proj ...; vLLM / SGLang's),
                        rank 8, on the models the triton engine serves (the only CPU engine that reads that layout;
                        the hf reference converts it to PEFT 3D exactly before loading)
Generated deterministically (``python -m lpdiff.harness.spec.adapter_zoo [--force] [MODEL ...]``); the committed
files are the source of truth and existing ones are kept unless ``--force``. Their size depends on the model's
weights (generate_adapter scales each delta to its weight), so rebuild them after the zoo changes (``--force``),
then ``lpdiff regen``; a new adapter needs ``lpdiff regen --model M --adapter A``.
"""
from __future__ import annotations

import argparse
import shutil
import sys

import torch

from lpdiff.harness.spec.adapters import GROUPS, ModelLayout, generate_adapter, resolve_targets
from lpdiff.harness.spec.catalog import ZOO, get_model, load_hf_model
from lpdiff.harness.spec.resolve import ZOO_ADAPTERS

SEED = 20261121
MOE_MODELS = [m for m, arch in ZOO.items() if arch != "qwen3"]
SHARED_OUTER_ARCHS = ("qwen3_moe", "gpt_oss")  # the archs the triton engine serves: it reads shared-outer and per-expert


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
    """Adapter name -> generate_adapter arguments. Seeds follow the order here: append, never reorder."""
    groups = available_groups(model)
    out = {
        "all": {"groups": groups, "rank": 8},
        "experts": {"groups": ["experts"], "rank": 4},
        "attention": {"groups": ["attention"], "rank": 8},
    }
    if model.config.model_type in SHARED_OUTER_ARCHS:
        out["experts_shared_outer"] = {"groups": ["experts"], "rank": 16, "shared_outer": True}
    out.update({g: {"groups": [g], "rank": 8} for g in groups if g not in out})
    if model.config.model_type in SHARED_OUTER_ARCHS:
        out["experts_per_expert"] = {"groups": ["experts"], "rank": 8, "layout": "per_expert"}
    return out


def build(name: str, force: bool = False) -> list[str]:
    """Write the adapters of ``plan`` that are missing (all of them with ``force``); returns one line per adapter."""
    model = load_hf_model(get_model(name), torch.float32, "cpu")
    root = ZOO_ADAPTERS / name
    made = []
    for i, (adapter, p) in enumerate(plan(model).items()):
        kept = (root / adapter / "adapter_config.json").exists() and not force
        if not kept:
            shutil.rmtree(root / adapter, ignore_errors=True)
            generate_adapter(model, root / adapter, groups=p["groups"], rank=p["rank"], alpha=2 * p["rank"],
                             seed=SEED + i, shared_outer=p.get("shared_outer", False),
                             layout=p.get("layout", "peft3d"))
        made.append(f"{name}/{adapter}: groups={','.join(p['groups'])} rank={p['rank']}"
                    f"{' shared-outer' if p.get('shared_outer') else ''}{' ' + p['layout'] if 'layout' in p else ''}"
                    f"{' (kept)' if kept else ''}")
    return made


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lpdiff.harness.spec.adapter_zoo")
    ap.add_argument("models", nargs="*", help=f"zoo models (default: {' '.join(MOE_MODELS)})")
    ap.add_argument("--force", action="store_true", help="regenerate adapters that exist too")
    args = ap.parse_args(argv)
    for n in args.models or MOE_MODELS:
        for line in build(n, args.force):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
