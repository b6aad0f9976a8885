#!/usr/bin/env bash
# Wheel check: build lpdiff's wheel from the working tree, install it into a fresh virtualenv beside Hugging Face's
# `kernels` package, and from a directory outside the repo run `lpdiff --version` and the default job. Proves the
# package data (zoo, zoo adapters, tokenizer, baselines, thresholds) ships and that lpdiff claims no top-level
# import name but `lpdiff` (a top-level `kernels` would shadow or be shadowed by Hugging Face's).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=.ci/lib.sh
source "$repo/.ci/lib.sh"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# Build from a copy of what git would commit (tracked + untracked, minus ignored): a stale build/ in the checkout
# cannot leak into the wheel.
mkdir "$work/src"
git -C "$repo" ls-files -z -co --exclude-standard | (cd "$repo" && xargs -0 -r sh -c \
  'for f; do [ -e "$f" ] && printf "%s\0" "$f"; done' sh) | tar -C "$repo" --null -T - -cf - | tar -C "$work/src" -xf -
fresh_venv "$work/venv"
pipq wheel -q --no-deps "$work/src" -w "$work/dist"
whl=$(ls "$work"/dist/lpdiff-*.whl)
echo "== built $(basename "$whl") ($(( $(stat -c %s "$whl") / 1024 )) KiB)"
python - "$whl" "$work/src" <<'PY'
import sys
import zipfile
from pathlib import Path

names = zipfile.ZipFile(sys.argv[1]).namelist()
src = Path(sys.argv[2])
# every file of the source tree (code and data), under the name it installs as: harness/x -> lpdiff/harness/x
want = sorted(str(p.relative_to(src)) if top == "lpdiff" else f"lpdiff/{p.relative_to(src)}"
              for top in ("lpdiff", "harness", "engines", "kernels", "baselines")
              for p in (src / top).rglob("*")
              if p.is_file() and "__pycache__" not in p.parts and not p.name.startswith("."))
lost = [w for w in want if w not in names]
assert not lost, (f"{len(lost)} files of the tree are missing from the wheel (pyproject's packages / package-data "
                  f"must name them): {lost[:20]}")
tops = sorted({n.split("/")[0] for n in names})
bad = [t for t in tops if t != "lpdiff" and not t.endswith(".dist-info")]
assert not bad, f"the wheel claims top-level names besides lpdiff: {bad}"
need = {"zoo": "lpdiff/harness/zoo/", "zoo adapters": "lpdiff/harness/zoo_adapters/",
        "tokenizer": "tokenizer", "baselines": "lpdiff/baselines/", "thresholds": "thresholds.json"}
missing = [what for what, part in need.items() if not any(part in n for n in names)]
assert not missing, f"the wheel lacks package data: {missing}"
print(f"== wheel: {len(names)} files, top level {tops}; all {len(want)} files of lpdiff/ harness/ engines/ kernels/ "
      f"baselines/ in it (zoo, zoo adapters, tokenizer, baselines, thresholds among them)")
PY

pipq install -q torch==2.13.0  # README's torch first (the CPU build where one is on offer)
pipq install -q "$whl" kernels -c "$repo/constraints.txt"
print_stack "wheel + kernels"

mkdir "$work/elsewhere"
cd "$work/elsewhere"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
python -c "import kernels, lpdiff; print('== kernels from', kernels.__file__, '| lpdiff from', lpdiff.__file__)"
python -c "import kernels, sys; sys.exit(0 if '/site-packages/kernels/' in kernels.__file__ else 1)" \
  || { echo "top-level 'kernels' is not Hugging Face's package"; exit 1; }
lpdiff --version
python -c "import triton; print('== triton', triton.__version__, 'installed as a dependency of the wheel')"
lpdiff run  # the default job: the triton engine against the shipped HF+PEFT baselines
