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
Trainers' adapters (``trainer_plan``; written on demand, not committed, so default runs and baselines stay as they
are: ``python -m lpdiff.harness.build.adapter_zoo --trainer OUT [MODEL ...]``, or ``build_trainer``):
  rslora_patterns       attention + experts, rank 16, rsLoRA, rank_pattern / alpha_pattern giving q_proj, one layer's
                        gate_up and o_proj / down_proj their own rank or alpha (slots zero-padded below 16)
  vocab                 lm_head + embed_tokens (PEFT's Linear and Embedding LoRA), rank 8
  all_vocab             attention + experts + lm_head + embed_tokens, rank 32, rsLoRA, lm_head at rank 4
  rank128               attention + experts, rank 128 (vLLM 0.25.1's MoE-LoRA limit; the triton runtime's LoRA layers
                        run on the torch references above its kernels' MAX_RANK)
Generated deterministically (``python -m lpdiff.harness.build.adapter_zoo [--force] [MODEL ...]``); the committed
files are the source of truth and existing ones are kept unless ``--force``. Their size depends on the model's
weights (generate_adapter scales each delta to its weight), so rebuild them after the zoo changes (``--force``),
then ``lpdiff regen``; a new adapter needs ``lpdiff regen --model M --adapter A``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

from lpdiff.harness.spec.adapters import GROUPS, VOCAB_GROUPS, ModelLayout, generate_adapter, resolve_targets
from lpdiff.harness.spec.catalog import ZOO, get_model, load_hf_model
from lpdiff.harness.spec.resolve import ZOO_ADAPTERS

SEED = 20261121
MOE_MODELS = [m for m, arch in ZOO.items() if arch != "qwen3"]
SHARED_OUTER_ARCHS = (
    "qwen3_moe",
    "gpt_oss",
)  # the archs the triton engine serves: it reads shared-outer and per-expert


def available_groups(model) -> list[str]:
    layout, out = ModelLayout.of(model), []
    for g in (g for g in GROUPS if g not in VOCAB_GROUPS):  # "all" predates them (trainer_plan has them)
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


def trainer_plan(model) -> dict[str, dict]:
    """Adapter name -> generate_adapter arguments for the adapters trainers write (module docstring). Patterns are
    PEFT's: a regex for a dotted suffix of the module path (the parameter path for 3D experts)."""
    decoder = [g for g in ("attention", "experts") if g in available_groups(model)]
    return {
        "rslora_patterns": {
            "groups": decoder,
            "rank": 16,
            "alpha": 24,
            "use_rslora": True,
            "rank_pattern": {"q_proj": 8, "layers.1.mlp.experts.gate_up_proj": 4},
            "alpha_pattern": {"o_proj": 6, "down_proj": 40},
        },
        "vocab": {"groups": list(VOCAB_GROUPS), "rank": 8, "alpha": 16},
        "all_vocab": {
            "groups": [*decoder, *VOCAB_GROUPS],
            "rank": 32,
            "alpha": 16,
            "use_rslora": True,
            "rank_pattern": {"lm_head": 4},
        },
        "rank128": {"groups": decoder, "rank": 128, "alpha": 256},
    }


def build_trainer(model, out_dir: str | Path, names=None, seed: int = SEED + 1000) -> dict[str, Path]:
    """Write ``trainer_plan`` adapters (all, or ``names``) for a loaded transformers model under out_dir/<name>;
    returns name -> directory. Seeds follow the plan's order."""
    out = {}
    for i, (name, p) in enumerate(trainer_plan(model).items()):
        if names is None or name in names:
            out[name] = Path(generate_adapter(model, Path(out_dir) / name, seed=seed + i, **p).path)
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
            generate_adapter(
                model,
                root / adapter,
                groups=p["groups"],
                rank=p["rank"],
                alpha=2 * p["rank"],
                seed=SEED + i,
                shared_outer=p.get("shared_outer", False),
                layout=p.get("layout", "peft3d"),
            )
        made.append(
            f"{name}/{adapter}: groups={','.join(p['groups'])} rank={p['rank']}"
            f"{' shared-outer' if p.get('shared_outer') else ''}{' ' + p['layout'] if 'layout' in p else ''}"
            f"{' (kept)' if kept else ''}"
        )
    return made


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lpdiff.harness.build.adapter_zoo")
    ap.add_argument("models", nargs="*", help=f"zoo models (default: {' '.join(MOE_MODELS)})")
    ap.add_argument("--force", action="store_true", help="regenerate adapters that exist too")
    ap.add_argument(
        "--trainer",
        metavar="OUT",
        help="write the trainers' adapters (trainer_plan) under OUT/<model>/ instead of the committed zoo",
    )
    args = ap.parse_args(argv)
    if args.trainer:
        for n in args.models or MOE_MODELS:
            model = load_hf_model(get_model(n), torch.float32, "cpu")
            for adapter, path in build_trainer(model, Path(args.trainer) / n).items():
                print(f"{n}/{adapter}: {path}")
        return 0
    for n in args.models or MOE_MODELS:
        for line in build(n, args.force):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
