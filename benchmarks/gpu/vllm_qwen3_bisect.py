"""Bisect the vLLM 0.25.1 engine death on the Qwen3-MoE check (benchmarks/results/vllm_qwen3_crash.md).

The failing run (H200, commit e96732a): ONE engine, enable_mixed_moe_lora_format, max_loras 10, the 5 check
adapters (harness/check.py ADAPTERS) in both layouts (PEFT 3D and per-expert) = 10 LoRAs, plus base rows, 8 prompts
x 11 lanes = 13,387 tokens in one step; CUDA illegal memory access at the first step. Each session below changes
one thing, starts one engine, runs the mixed batch once and prints one line:

    <session>: <what changed> -> ok (<sanity numbers>) | engine died: <first error line> [at <innermost vLLM frame>]

Sessions run most-informative first, each in its own process under a time limit (a dead or hung engine costs only
that session), until the time budget is spent. Full logs go to <out>/bisect.log, the lines to <out>/bisect.txt.

    PYTHONPATH=<vllm bundle>:. python benchmarks/gpu/vllm_qwen3_bisect.py [--out DIR] [--only a,b] [--budget-s 520]
    python benchmarks/gpu/vllm_qwen3_bisect.py --dry-run     # CPU, no vLLM: the plan on the tiny zoo model
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from lpdiff.harness.commands import check

MODEL, LAYERS = "qwen3-30b-a3b", 4
DRY_MODEL = "tiny-qwen3-moe"
ALL = tuple(p.name for p in check.ADAPTERS)
BOTH = ("peft3d", "per_expert")


@dataclass(slots=True, frozen=True)
class Session:
    """One engine start. Defaults are the failing run; each session overrides what its suspect needs."""

    name: str
    why: str  # what ok / died here tells (suspect numbers as in vllm_qwen3_crash.md)
    layouts: tuple[str, ...] = BOTH
    adapters: tuple[str, ...] = ALL
    copies: int = 1  # each adapter file registered this many times (distinct LoRA ids, same weights)
    base: bool = True  # base-model rows in the batch (their tokens map to LoRA slot -1)
    prompt_div: int = 1  # prompt lengths divided by this: fewer tokens per step, same lanes
    spare_slots: int = 0  # max_loras = number of LoRAs + spare_slots
    env: dict[str, str] = field(default_factory=dict)
    mixed: bool | None = True  # enable_mixed_moe_lora_format; None: the engine decides (on only for PEFT 3D)
    async_scheduling: bool = True  # vLLM's default in the failing run (lpdiff turns it off on GPUs since 36bd4a4)

    def __post_init__(self):
        assert set(self.layouts) <= set(BOTH) and self.layouts, self.layouts
        assert set(self.adapters) <= set(ALL) and self.adapters, self.adapters
        assert self.copies >= 1 and self.prompt_div >= 1 and self.spare_slots >= 0


SESSIONS = (
    Session("repro-blocking", "the failing run with synchronous launches: the traceback names the faulting kernel "
            "(one-shot MoE-LoRA kernel or moe_lora_align op -> 1/2/5, topk or the base moe_align op -> 4, "
            "lora_shrink/expand -> attention LoRA, flash_attn -> 7); ok here but died in 'repro' -> timing (a race)",
            env={"CUDA_LAUNCH_BLOCKING": "1"}),
    Session("spare-slot", "max_loras 11 for 10 LoRAs: ok = suspect 1 (last active slot vs max_loras)",
            spare_slots=1),
    Session("no-base", "no base rows, so no slot -1 among the active LoRAs: ok = suspect 1", base=False),
    Session("per-expert-x2", "10 slots, all per-expert (each file twice): died = slot count (1/2), ok = mixing "
            "PEFT 3D and per-expert in one engine (3)", layouts=("per_expert",), copies=2),
    Session("short-prompts", "1/8 of the tokens per step, same 11 lanes: ok = size-dependent indexing (2)",
            prompt_div=8),
    Session("repro", "control: the failing run as it was (no CUDA_LAUNCH_BLOCKING)"),
    Session("peft3d-only", "5 PEFT 3D LoRAs (the GPU suite's vLLM session since 685625a)", layouts=("peft3d",)),
    Session("per-expert-only", "5 per-expert LoRAs (the GPU suite's other vLLM session)", layouts=("per_expert",)),
    # session 3 (vllm_qwen3_crash.md "Outcome"): the suite's engines, 5 adapters + a spare slot, one layout each
    Session("suite-per-expert-async-on", "the suite's per-expert engine as in run 10 (died: cuBLAS failure): died "
            "again and ok with async off -> async scheduling", layouts=("per_expert",), spare_slots=1, mixed=None),
    Session("suite-per-expert-async-off", "its control (ran as expected twice in run 11)", layouts=("per_expert",),
            spare_slots=1, mixed=None, async_scheduling=False),
    Session("suite-peft3d-async-off", "the suite's PEFT 3D engine with async off (died in run 11): the mixed path "
            "itself", layouts=("peft3d",), spare_slots=1, mixed=None, async_scheduling=False),
    Session("no-attention", "without the attention-only adapter (a slot disabled in every MoE layer): ok = 5",
            adapters=tuple(a for a in ALL if a != "attention")),
    Session("no-r8", "without the rank-8 adapter beside rank 16: ok = 6",
            adapters=tuple(a for a in ALL if a != "all_r8")),
)


# -- the plan: adapters and prompts built once, shared by every session's process ----------------------------------

def write_plan(model: str, layers: int | None, root: Path, device: str) -> Path:
    """Adapters (both layouts) and prompts exactly as harness.check builds them for the failing run."""
    case = check.build_case(model, layers, root / "adapters", layouts=BOTH, device=device)
    if device == "cuda":  # vLLM loads a checkpoint directory: write it here once, not inside a timed session
        from lpdiff.engines.vllm import checkpoint_dir

        checkpoint_dir(case.spec, None, on_cpu=False)
    plan = {"model": model, "layers": layers, "prompts": case.prompts,
            "files": [[n, layout, a.path] for (n, layout), a in case.files.items()]}
    path = root / "plan.json"
    path.write_text(json.dumps(plan))
    return path


def lanes_for(plan: dict, s: Session):
    """Lane name -> AdapterSpec, in harness.check's order (adapter by adapter, PEFT 3D first)."""
    from lpdiff.harness.types import AdapterSpec

    lanes = {}
    for name, layout, path in plan["files"]:
        if name in s.adapters and layout in s.layouts:
            for k in range(s.copies):
                lane = f"{name}.{layout}" + (f".{k}" if s.copies > 1 else "")
                lanes[lane] = AdapterSpec(lane, path)
    return lanes


def prompts_for(plan: dict, s: Session) -> list[list[int]]:
    return [p[:max(2, len(p) // s.prompt_div)] for p in plan["prompts"]]


def engine_options(s: Session, n_loras: int) -> dict:
    # the failing run had the mixed-format flag and async scheduling on; sessions change one thing at a time
    opts = {**check.engine_options("vllm"), "max_loras": n_loras + s.spare_slots,
            "llm_kwargs": {"async_scheduling": s.async_scheduling}}
    if s.mixed is not None:
        opts["mixed_moe_lora_format"] = s.mixed
    return opts


# -- one session (in its own process) --------------------------------------------------------------------------------

def run_session(plan: dict, s: Session) -> dict:
    import numpy as np

    from lpdiff.engines import EngineConfig, open_engine
    from lpdiff.harness.spec.catalog import get_model
    from lpdiff.harness.pipeline.job import mixed_batch

    lanes, prompts = lanes_for(plan, s), prompts_for(plan, s)
    choices = ([None] if s.base else []) + list(lanes)
    cfg = EngineConfig(model=get_model(plan["model"], num_layers=plan["layers"]), adapters=lanes, dtype="bfloat16",
                       options=engine_options(s, len(lanes)))
    with open_engine("vllm", cfg) as eng:
        batch = mixed_batch(eng, prompts, choices)
    runs = {c: np.concatenate([r.logprobs for r in batch[c].prompts]) for c in choices}
    # sanity on a survivor: a lane equal to base lost its adapter; two files of the same adapter (other layout,
    # other copy) must agree within LoRA rerun noise (DESIGN.md: max |d| up to 0.09)
    same_as_base = [c for c in lanes if s.base and float(np.abs(runs[c] - runs[None]).max()) == 0.0]
    twins: dict[str, list[str]] = {}
    for c in lanes:
        twins.setdefault(c.split(".")[0], []).append(c)
    worst = max(((float(np.abs(runs[g[0]] - runs[o]).max()), f"{g[0]} vs {o}") for g in twins.values()
                 for o in g[1:]), default=(0.0, "-"))
    return {"status": "ok", "same_as_base": same_as_base,
            "twin_max_abs": round(worst[0], 4), "twin_pair": worst[1]}


ERROR_LINE = re.compile(r"([A-Za-z_.]*(?:Error|Exception)): (.+)")
VLLM_FRAME = re.compile(r'File "[^"]*/(vllm/[^"]+)", line (\d+), in (\w+)')


def first_error(log: str) -> str:
    """The first exception line of the log and the innermost vLLM frame of the traceback above it."""
    frame = None
    for line in log.splitlines():
        m = VLLM_FRAME.search(line)
        if m:
            frame = f"{m.group(1)}:{m.group(2)} {m.group(3)}"
            continue
        m = ERROR_LINE.search(line)
        if m and "Traceback" not in line:
            return f"{m.group(1)}: {m.group(2)[:240]}" + (f" [at {frame}]" if frame else "")
    return "no exception line in the log"


def spawn_session(plan_path: Path, s: Session, limit_s: float, log) -> str:
    """Run one session in a child process (its own process group, killed whole at the limit); one summary line."""
    env = {**os.environ, **s.env}
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out:
        p = subprocess.Popen([sys.executable, __file__, "--session", s.name, "--plan", str(plan_path)],
                             stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            p.wait(timeout=limit_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        try:  # the session's own process group: a hung or orphaned vLLM engine core would keep the GPU memory
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()
        out.seek(0)
        text = out.read()
    took = f"{time.perf_counter() - t0:.0f}s"
    log.write(f"\n===== {s.name} (rc {p.returncode}, {took})\n{text}")
    log.flush()
    result = next((json.loads(ln[7:]) for ln in reversed(text.splitlines()) if ln.startswith("RESULT ")), None)
    if result and result["status"] == "ok":
        return (f"ok ({took}; lanes equal to base: {result['same_as_base'] or 'none'}; worst twin max|d| "
                f"{result['twin_max_abs']} {result['twin_pair']})")
    if timed_out:
        return f"no result after {limit_s:.0f}s (killed); first error line: {first_error(text)}"
    return f"engine died or refused ({took}): {first_error(text)}"


# -- plan printing (dry run) ---------------------------------------------------------------------------------------

def describe(plan: dict, s: Session) -> list[str]:
    """What the engine would be given, from lpdiff's own pure helpers (no vLLM): LoRA ids, is_3d flags, ranks."""
    from lpdiff.engines.vllm import (
        adapter_max_rank,
        pick_max_lora_rank,
        plan_moe_lora,
        vllm_native_3d,
    )
    from lpdiff.harness.spec.adapters import inspect_adapter
    from lpdiff.harness.spec.catalog import get_model, hf_config

    lanes, prompts = lanes_for(plan, s), prompts_for(plan, s)
    arch = hf_config(get_model(plan["model"], num_layers=plan["layers"])).architectures[0]
    layouts = {n: inspect_adapter(a.path).layout for n, a in lanes.items()}
    moe = plan_moe_lora(arch, list(layouts.values()), vllm_native_3d(arch), s.mixed)
    ranks = {n: adapter_max_rank(a.path) for n, a in lanes.items()}
    rows = 1 + len(lanes) if s.base else len(lanes)
    head = (f"{s.name}: {len(lanes)} LoRAs, max_loras {engine_options(s, len(lanes))['max_loras']}, "
            f"max_lora_rank {pick_max_lora_rank(ranks.values())}, mixed {moe.mixed}, base rows {s.base}, "
            f"{rows * sum(map(len, prompts))} tokens/step, async scheduling {s.async_scheduling}, env {s.env or '-'}")
    ids = [f"{i}:{n}({layouts[n]}, r{ranks[n]}, is_3d={moe.mixed and layouts[n] == 'peft3d'})"
           for i, n in enumerate(lanes, start=1)]
    return [head, "    " + " ".join(ids), f"    -> {s.why}"]


# -- main ----------------------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, no vLLM: build the plan on the tiny zoo model "
                    "and print every session's configuration")
    ap.add_argument("--only", help="comma-separated session names (default: all, in order)")
    ap.add_argument("--out", default=os.environ.get("OUT") or ".", help="where bisect.log / bisect.txt go")
    ap.add_argument("--budget-s", type=float, default=520, help="stop starting sessions after this much time")
    ap.add_argument("--session-limit-s", type=float, default=120, help="time limit of one session")
    ap.add_argument("--session", help=argparse.SUPPRESS)  # child: run this session of --plan
    ap.add_argument("--plan", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    by_name = {s.name: s for s in SESSIONS}

    if args.session:
        res = run_session(json.loads(Path(args.plan).read_text()), by_name[args.session])
        print("RESULT " + json.dumps(res), flush=True)
        return 0

    chosen = [by_name[n] for n in args.only.split(",")] if args.only else list(SESSIONS)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        if args.dry_run:
            plan = json.loads(write_plan(DRY_MODEL, None, Path(tmp), "cpu").read_text())
            for s in chosen:
                print("\n".join(describe(plan, s)))
            return 0
        from lpdiff.harness.pipeline.provenance import device_name, git_commit

        plan_path = write_plan(MODEL, LAYERS, Path(tmp), "cuda")
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        header = f"# vllm_qwen3_bisect {git_commit()} on {device_name()}, plan built in {time.perf_counter() - t0:.0f}s"
        print(header, flush=True)
        with (out / "bisect.log").open("w") as log, (out / "bisect.txt").open("w") as txt:
            txt.write(header + "\n")
            for s in chosen:
                left = args.budget_s - (time.perf_counter() - t0)
                if left < 45:  # an engine start alone takes ~35 s (gpu_run8_vllm.log)
                    line = f"{s.name}: skipped, {left:.0f}s of the budget left"
                else:
                    line = f"{s.name}: {s.why} -> {spawn_session(plan_path, s, min(args.session_limit_s, left), log)}"
                print(line, flush=True)
                txt.write(line + "\n")
                txt.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
