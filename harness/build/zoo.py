"""The tiny model zoo: five small checkpoints (four MoE architectures and one dense model) that behave like trained
models, so that verdicts on a laptop mean something (docs/models.md, "Random init is a trap").

    python -m lpdiff.harness.build.zoo build [--name N] [--steps S] [--corpus F] [--out DIR]
                                                    # tokenizer + held-out text (if missing) + model(s)
    python -m lpdiff.harness.build.zoo measure [--name N] [--prompt-set S] [--dir DIR] [--markdown]

Recipe (seeded; the committed weights are the source of truth, a rebuild on another machine or torch may differ):
  1. Corpus: the top-level modules of the running Python's standard library (``Lib/*.py``), minus a few held-out
     modules whose text is committed to ``harness/data/heldout.txt`` (prompt sets are cut from it).
  2. Tokenizer: byte-level BPE with ``VOCAB`` entries trained on that corpus (one tokenizer for the whole zoo,
     committed to ``harness/data/tokenizer/`` and copied into every model directory).
  3. Each model: transformers' own init under ``torch.manual_seed(SEED)``, then AdamW on next-token loss over
     random windows of ``SEQ_LEN`` tokens, plus three router terms on MoE layers:
       - margin: a hinge on the scale-free routing margin, u_k - u_k+1 < ``margin_target``, where u are the scores
         the router ranks by, standardized over experts per token. Scaling the router does not move u (bf16
         rounding and the propagated noise of bf16 hidden states scale with the scores too), so only a real gap
         satisfies it;
       - balance: E * sum_e P_e^2, P_e the batch mean of softmax(3u)_e, so that the margins are not bought by
         sending every token to the same experts (Nemotron also updates its ``e_score_correction_bias``
         aux-loss-free, as the real model is trained);
       - z: mean squared router logit, which keeps sigmoid routers out of saturation (saturated scores tie).
  4. Conditioning: ``sharpen`` scales lm_head so that the mean next-token entropy on fixed training windows is
     ``target_entropy`` x log V (a logit temperature; peaked distributions like a trained LLM's).
  5. Saved with ``save_pretrained`` in fp32 (the Hub layout transformers writes) plus the tokenizer files.

Files: zoo_data.py (corpus, held-out text, tokenizer), zoo_configs.py (the configs and their init), zoo_train.py
(training and conditioning), zoo_measure.py (the measured properties); this one builds, saves and runs the commands.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import torch

from lpdiff.harness.build.zoo_configs import TINY_CONFIGS, hub_compat
from lpdiff.harness.build.zoo_data import (
    HELDOUT,
    TOKENIZER_DIR,
    build_tokenizer,
    load_tokenizer,
    save_tokenizer,
    token_stream,
    training_docs,
    write_heldout,
)
from lpdiff.harness.build.zoo_measure import markdown, measure
from lpdiff.harness.build.zoo_train import SEQ_LEN, TrainConfig, train
from lpdiff.harness.spec.catalog import ZOO_DIR

RECIPE = "zoo-recipe/v1 (harness/zoo.py docstring)"


def save(out: Path, model, info: dict) -> Path:
    if out.exists():
        shutil.rmtree(out)
    model.config.use_cache = True
    model.save_pretrained(out)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(hub_compat(cfg), indent=2, sort_keys=True) + "\n")
    save_tokenizer(out)
    (out / "build.json").write_text(json.dumps(info, indent=1, sort_keys=True) + "\n")
    return out


def build_one(name: str, stream: torch.Tensor, tc: TrainConfig, out: Path) -> dict:
    """Train ``name`` and save it to ``out`` with a build.json recording how."""
    import platform

    import transformers

    t0 = time.time()
    model, log = train(name, stream, tc)
    info = {
        "name": name,
        "train": asdict(tc),
        "seq_len": SEQ_LEN,
        "corpus_tokens": stream.numel(),
        "log": log,
        "build_s": round(time.time() - t0, 1),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "recipe": RECIPE,
    }
    save(out, model, info)
    print(f"[{name}] saved to {out} in {info['build_s']}s", flush=True)
    return info


def build(names: list[str], steps: int | None = None, corpus: str | None = None, out: Path = ZOO_DIR) -> None:
    """Train and save ``names`` under ``out`` (the zoo by default). ``corpus``: a token file written by an earlier
    build (created when missing), so that a build under another Python version trains on the same stdlib text."""
    torch.set_num_threads(max(1, min(torch.get_num_threads(), 2)))  # the recipe's stated budget: 2 cores
    if not HELDOUT.exists():
        write_heldout()
    tok = load_tokenizer() if (TOKENIZER_DIR / "tokenizer.json").exists() else build_tokenizer(training_docs())
    if corpus and Path(corpus).exists():
        stream = torch.load(corpus)
    else:
        stream = token_stream(tok)
        if corpus:
            torch.save(stream, corpus)
    for name in names:
        build_one(name, stream, TrainConfig() if steps is None else TrainConfig(steps=steps), Path(out) / name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lpdiff.harness.build.zoo", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="train and save zoo model(s) (all by default)")
    b.add_argument("--name", action="append", choices=list(TINY_CONFIGS))
    b.add_argument("--steps", type=int, help=f"training steps (default {TrainConfig().steps})")
    b.add_argument("--corpus", help="token file of an earlier build (written when missing)")
    b.add_argument("--out", default=str(ZOO_DIR), help="where to write the model directories (default: the zoo)")
    m = sub.add_parser("measure", help="print the zoo's measured properties as JSON lines")
    m.add_argument("--name", action="append", choices=list(TINY_CONFIGS))
    m.add_argument("--prompt-set", default="default")
    m.add_argument("--dir", default=str(ZOO_DIR), help="where the model directories are (default: the zoo)")
    m.add_argument("--markdown", action="store_true", help="print the table of docs/zoo.md")
    args = ap.parse_args(argv)
    names = args.name or list(TINY_CONFIGS)
    if args.cmd == "build":
        build(names, args.steps, args.corpus, Path(args.out))
    else:
        torch.set_num_threads(max(1, min(torch.get_num_threads(), 2)))
        rows = []
        for n in names:
            rows.append(measure(n, args.prompt_set, Path(args.dir) / n))
            print(json.dumps(rows[-1]), flush=True)
        if args.markdown:
            print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
