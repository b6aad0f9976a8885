#!/usr/bin/env bash
# Re-split an offline bundle (the parts gpu-bundles/*.sh wrote) so that each part travels beside this repo in one
# device call: a call carries the working tree (23 MB) plus what it names, 64 MiB in all, so the vLLM bundle's two
# 58 MB parts must become three of 38 MiB (cap 39). unpack.sh concatenates part.* in name order, so the names keep
# their order across the new folders.
#   bash benchmarks/gpu/split_bundle.sh .bundles/vllm .bundles/vllm-split [MB]   -> .bundles/vllm-split/p1 p2 ...
# Then call k carries p<k> and copies it into one folder (e.g. ~/vw); the last part's folder holds unpack.sh.
set -euo pipefail
SRC=${1:?usage: $0 BUNDLE_DIR OUT_DIR [MB]}; OUT=${2:?usage: $0 BUNDLE_DIR OUT_DIR [MB]}; MB=${3:-39}
mkdir -p "$OUT"; tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
cat $(find "$SRC" -name 'part.*' -printf '%f %p\n' | sort | cut -d' ' -f2) > "$tmp/bundle"
size=$(stat -c %s "$tmp/bundle"); cap=$((MB * 1048576)); n=$(( (size + cap - 1) / cap ))
split -n "$n" -d -a 2 "$tmp/bundle" "$tmp/part."  # n equal parts, none over MB
i=0; for p in "$tmp"/part.*; do i=$((i + 1)); mkdir -p "$OUT/p$i"; mv "$p" "$OUT/p$i/"; done
cp "$(find "$SRC" -name unpack.sh | head -1)" "$OUT/p$i/"
sha256sum "$tmp/bundle" | cut -c1-64 | sed 's/^/sha256 of the whole: /'
du -sh "$OUT"/p*
