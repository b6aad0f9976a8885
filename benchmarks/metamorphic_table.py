"""The latest metamorphic verdict of every engine x model x adapter x relation, as markdown tables (one per model),
from benchmarks/results/metamorphic.csv: what a closing note lists.

    python -m benchmarks.metamorphic_table [CSV] [--gpu-only] [--engines vllm sglang triton]

A later row for the same key replaces an earlier one (rows are appended run after run), so a relation re-run after
a fix shows its new verdict; the commit column says which run each cell comes from.
"""

from __future__ import annotations

import argparse
import csv
from collections import defaultdict
from pathlib import Path

DEFAULT = Path(__file__).resolve().parent / "results" / "metamorphic.csv"


def latest(rows, gpu_only: bool, engines) -> dict:
    out = {}
    for r in rows:
        if (gpu_only and r["gpu"] == "cpu") or (engines and r["engine"] not in engines):
            continue
        out[(r["model"], r["engine"], r["adapter"], r["relation"])] = r
    return out


def cell(r: dict) -> str:
    if r["verdict"] in ("", "n/a") or r["relation"].startswith("noise:"):
        return f"noise {r['max_abs']}" if r["relation"].startswith("noise:") else "n/a"
    return f"{r['verdict']} {r['ratio']} ({r['max_abs']})"


def tables(rows: dict) -> str:
    by_model = defaultdict(dict)
    for (model, engine, adapter, relation), r in rows.items():
        by_model[model][(engine, adapter, relation)] = r
    parts = []
    for model in sorted(by_model):
        cells = by_model[model]
        cols = sorted({(e, a) for e, a, _ in cells})
        relations = sorted({rel for _, _, rel in cells})
        head = ["relation"] + [f"{e} {a}" for e, a in cols]
        lines = [f"### {model}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for rel in relations:
            vals = [
                cell(cells[(e, a, rel)]) + f" `{cells[(e, a, rel)]['commit']}`" if (e, a, rel) in cells else ""
                for e, a in cols
            ]
            lines.append("| " + " | ".join([rel, *vals]) + " |")
        fails = [r for r in cells.values() if r["verdict"] == "FAIL"]
        if fails:
            lines += ["", "FAIL notes:"]
            lines += [f"- {r['engine']} {r['adapter']} {r['relation']}: {r['note']}" for r in fails]
        parts.append("\n".join(lines))
    return "\n\n".join(parts) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("csv", nargs="?", default=str(DEFAULT))
    p.add_argument("--gpu-only", action="store_true", help="leave out the CPU (tiny-model) rows")
    p.add_argument("--engines", nargs="*", default=None)
    args = p.parse_args(argv)
    with open(args.csv, newline="") as f:
        rows = list(csv.DictReader(f))
    print(tables(latest(rows, args.gpu_only, args.engines)), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
