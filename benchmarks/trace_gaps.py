"""Where the GPU waits for the host: idle gaps between the kernels of a torch-profiler chrome trace, each with the
host work that was going on meanwhile.

    python -m benchmarks.trace_gaps TRACE.json[.gz] [--min-gap-us 20] [--top 15]

bench_e2e.py --profile writes such a trace of one LoRA call. A gap is a stretch with no kernel or memcpy/memset on
any GPU stream; the host side of it is the outermost CPU ops (and CUDA runtime calls: a cudaStreamSynchronize or a
blocking copy shows there) overlapping it. The wall a call loses to the host is span - busy.
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
from dataclasses import dataclass
from pathlib import Path

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATS = ("cpu_op", "cuda_runtime", "cuda_driver", "python_function", "user_annotation")


@dataclass(frozen=True, slots=True)
class Span:
    start: float  # us
    end: float
    name: str
    cat: str = ""


def load_events(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def spans(events: list[dict], cats: tuple[str, ...]) -> list[Span]:
    out = [
        Span(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e.get("name", "?"), e.get("cat", ""))
        for e in events
        if e.get("ph") == "X" and e.get("cat") in cats
    ]
    return sorted(out, key=lambda s: s.start)


def busy_union(gpu: list[Span]) -> list[tuple[float, float]]:
    """Merged intervals during which some GPU stream runs something."""
    merged: list[list[float]] = []
    for s in gpu:
        if merged and s.start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], s.end)
        else:
            merged.append([s.start, s.end])
    return [(a, b) for a, b in merged]


def outermost(host: list[Span], start: float, end: float, limit: int = 3) -> list[str]:
    """Names of the longest host spans overlapping [start, end], outermost first (a parent contains its
    children, so sorting by length puts it first)."""
    over = [h for h in host if h.start < end and h.end > start]
    over.sort(key=lambda h: h.end - h.start, reverse=True)
    names: list[str] = []
    for h in over:
        label = f"{h.name} [{h.cat}]" if h.cat != "cpu_op" else h.name
        if label not in names:
            names.append(label)
        if len(names) == limit:
            break
    return names


def analyse(events: list[dict], min_gap_us: float = 20.0) -> dict:
    gpu, host = spans(events, GPU_CATS), spans(events, HOST_CATS)
    if not gpu:
        raise ValueError("no GPU kernels in the trace: profile with ProfilerActivity.CUDA on a GPU")
    busy = busy_union(gpu)
    first_host = min((h.start for h in host), default=busy[0][0])
    last_host = max((h.end for h in host), default=busy[-1][1])
    span_start, span_end = min(first_host, busy[0][0]), max(last_host, busy[-1][1])
    gaps = [(span_start, busy[0][0], "before the first kernel")]
    gaps += [(a[1], b[0], "") for a, b in itertools.pairwise(busy)]
    gaps.append((busy[-1][1], span_end, "after the last kernel"))
    big = [(a, b, where) for a, b, where in gaps if b - a >= min_gap_us]
    big.sort(key=lambda g: g[0] - g[1])
    return {
        "span_us": span_end - span_start,
        "busy_us": sum(b - a for a, b in busy),
        "idle_us": sum(b - a for a, b, _ in gaps if b > a),
        "gaps": [
            {"start_us": a - span_start, "dur_us": b - a, "where": where, "host": outermost(host, a, b)}
            for a, b, where in big
        ],
        "kernels": len(gpu),
    }


def report(res: dict, top: int = 15) -> str:
    lines = [
        (
            f"span {res['span_us'] / 1e3:.2f} ms, GPU busy {res['busy_us'] / 1e3:.2f} ms, idle "
            f"{res['idle_us'] / 1e3:.2f} ms over {res['kernels']} GPU events; gaps >= threshold: "
            f"{len(res['gaps'])}, {sum(g['dur_us'] for g in res['gaps']) / 1e3:.2f} ms"
        )
    ]
    lines.extend(
        f"  at {g['start_us'] / 1e3:8.3f} ms  {g['dur_us']:8.1f} us  {g['where']}  host: " + " > ".join(g["host"])
        for g in res["gaps"][:top]
    )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace", type=Path)
    p.add_argument("--min-gap-us", type=float, default=20.0)
    p.add_argument("--top", type=int, default=15)
    a = p.parse_args()
    print(report(analyse(load_events(a.trace), a.min_gap_us), a.top))


if __name__ == "__main__":
    main()
