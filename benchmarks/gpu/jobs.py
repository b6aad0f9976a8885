"""The GPU jobs that benchmarks/gpu/pool.py runs side by side: name -> GPUs, time limit, command, software stack.

Stacks: "image" = the device image's torch / transformers / peft (HF+PEFT and the triton runtime);
"vllm" = the vLLM 0.25.1 bundle unpacked in $VW (default ~/vw) on PYTHONPATH, in-process as in vllm.sh;
"sglang" = the SGLang 0.5.15 bundle in $SW (default ~/sw), run in a subprocess lane (LPDIFF_SGLANG_PYTHONPATH),
because it pins transformers 5.12.1 while the HF+PEFT reference stays on the image's. Unpack the bundles before
the pool starts (`bash ~/vw/unpack.sh ~/vw`, `bash ~/sw/unpack.sh ~/sw`).

``{dir}`` in a command is the job's own folder (its CSVs, pytest's basetemp, a script's --out).
"""
from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PYTEST = ("python", "-m", "pytest", "-p", "lpdiff.harness.plugin", "-q", "-s", "-W", "ignore", "-rs", "--basetemp={dir}/tmp")


@dataclass(frozen=True, slots=True)
class Job:
    name: str
    gpus: int
    limit_s: float
    argv: tuple[str, ...]
    stack: str = "image"
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        assert self.gpus in (1, 2, 4, 8) and self.limit_s > 0 and self.stack in ("image", "vllm", "sglang")


def _pytest(*args: str) -> tuple[str, ...]:
    return PYTEST + args


def _engines(engine: str, marker: str, extra: str = "") -> tuple[str, ...]:
    return _pytest("suites/test_engines_gpu.py", "-k", f"{engine}{extra}", "-m", marker)


def _metamorphic(engine: str, model: str, marker: str = "gpu1") -> tuple[str, ...]:
    which = "full_width" if marker == "gpu1" else "tensor_parallel"
    return _pytest("suites/test_metamorphic.py", "-k", " and ".join(filter(None, (engine, which, model))),
                   "-m", marker)


# a metamorphic run split in sets that fit one call each: "core" (one engine session besides the original's),
# "extra" (a checkpoint with the delta merged in, and one session per engine mode; TP is the *-mm-tp2/tp4 jobs'
# relation) and "shapes" (the experts-only and attention-only adapters on the relations that tell them apart)
MM_SETS = {
    ("qwen", "core"): ("a16", "format,rank,factors,gate_up,zero_b,batch"),
    ("qwen", "extra"): ("a16", "merged,modes"),
    ("qwen", "shapes"): ("experts16,attention16", "format,factors,zero_b,batch"),
    ("gpt", "core"): ("a16", "format,rank,factors,gate_up,zero_b,batch"),
    ("gpt", "extra"): ("a16", "merged,modes"),
    ("gpt", "shapes"): ("experts16,attention16", "format,factors,zero_b,batch"),
    # the core set's two relations changed since their last GPU run (zero_b against the session's own base rows,
    # batch:tripled), without the four that did not
    ("gpt", "zb"): ("a16", "zero_b,batch"),
}
MODEL_KEYS = {"qwen": "a3b", "gpt": "20b"}


def _jobs() -> list[Job]:
    jobs = []
    for engine in ("vllm", "sglang", "triton"):
        stack = engine if engine != "triton" else "image"
        # SGLang's PEFT 3D reproduction has its own job: it waits for a dead scheduler
        skip3d = " and not peft3d" if engine == "sglang" else ""
        jobs += [
            Job(f"{engine}-engines-qwen", 1, 420, _engines(engine, "gpu1", f"{skip3d} and a3b"), stack),
            Job(f"{engine}-engines-gpt", 1, 420, _engines(engine, "gpu1", f"{skip3d} and 20b"), stack),
            Job(f"{engine}-engines-tp2", 2, 480, _engines(engine, "gpu2"), stack),
            Job(f"{engine}-engines-tp4", 4, 480, _engines(engine, "gpu4"), stack),
            Job(f"{engine}-mm-tp2", 2, 550, _metamorphic(engine, "", "gpu2"), stack,
                {"LPDIFF_METAMORPHIC_ADAPTERS": "a16"}),
            Job(f"{engine}-mm-tp4", 4, 480, _metamorphic(engine, "", "gpu2"), stack,
                {"LPDIFF_METAMORPHIC_ADAPTERS": "a16"}),
        ]
    # vLLM 0.25.1 on Qwen3-MoE (benchmarks/results/vllm_qwen3_crash.md): CUDA_LAUNCH_BLOCKING as a second workaround,
    # and at TP 4, where the per-expert path died with an illegal memory access (2026-11-21, run 14)
    blocking = {"LPDIFF_VLLM_OPTIONS": '{"env": {"CUDA_LAUNCH_BLOCKING": "1"}}'}
    jobs += [
        Job("vllm-engines-qwen-blocking", 1, 480, _engines("vllm", "gpu1", " and a3b"), "vllm", blocking),
        Job("vllm-engines-tp4-qwen-blocking", 4, 360, _engines("vllm", "gpu4", " and a3b"), "vllm", blocking),
        # the fully sharded LoRA path skips the one-shot kernel that faults at TP 4 (fused_moe_lora_op.py): a
        # candidate workaround (the suite expects the known defect, so a PASS shows as "no longer reproduced")
        Job("vllm-engines-tp4-qwen-fullysharded", 4, 360, _engines("vllm", "gpu4", " and a3b"), "vllm",
            {"LPDIFF_VLLM_OPTIONS": '{"llm_kwargs": {"fully_sharded_loras": true}}'}),
    ]
    # vLLM / SGLang judged against lpdiff's triton runtime in fp32 instead of HF+PEFT
    vs_triton = {"LPDIFF_CHECK_REFERENCE": "triton"}
    jobs += [Job(f"{e}-engines-vs-triton", 1, 480, _engines(e, "gpu1", " and reference"), e, vs_triton)
             for e in ("vllm", "sglang")]
    # triton beside SGLang on the same GPUs (SGLang takes half their memory, the fp32 4-layer triton runs ~30 GB);
    # 550 s: SGLang's Qwen3 extra set (6 sessions, 146 s for the first) missed 480 s by one session in run 16
    def both(key: str, marker: str = "gpu1") -> tuple[str, ...]:
        runs = [shlex.join(_metamorphic(e, key, marker)).replace("{dir}/tmp", "{dir}/tmp-" + e)
                for e in ("sglang", "triton")]
        # one after the other under TP: SGLang refuses to start when its GPUs hold unequal amounts ("memory capacity
        # is unbalanced", run 20), which triton's TP 1 session on the first GPU causes
        return ("bash", "-c", " & ".join(runs) + " & wait" if marker == "gpu1" else "; ".join(runs))

    for (model, which), (adapters, relations) in MM_SETS.items():
        key = MODEL_KEYS[model]
        env = {"LPDIFF_METAMORPHIC_ADAPTERS": adapters, "LPDIFF_METAMORPHIC_RELATIONS": relations}
        jobs += [
            Job(f"vllm-mm-{model}-{which}", 1, 550, _metamorphic("vllm", key), "vllm", env),
            Job(f"sglang+triton-mm-{model}-{which}", 1, 550, both(key), "sglang", env),
        ]
    jobs.append(Job("sglang+triton-mm-tp2", 2, 550, both("", "gpu2"), "sglang", {"LPDIFF_METAMORPHIC_ADAPTERS": "a16"}))
    bisect = ("python", "benchmarks/gpu/vllm_qwen3_bisect.py", "--out", "{dir}", "--budget-s", "360")
    jobs += [
        Job("sglang-peft3d", 1, 200, _engines("sglang", "gpu1", " and peft3d and a3b"), "sglang"),
        # the vLLM Qwen3-MoE crash (benchmarks/results/vllm_qwen3_crash.md), its most telling sessions on two GPUs
        Job("vllm-bisect-a", 1, 420, bisect + ("--only", "repro-blocking,spare-slot,repro"), "vllm"),
        Job("vllm-bisect-b", 1, 420, bisect + ("--only", "no-base,per-expert-x2,short-prompts"), "vllm"),
        Job("vllm-bisect-suite", 1, 420, bisect + ("--only", "suite-per-expert-async-on,suite-per-expert-async-off,"
                                                   "suite-peft3d-async-off"), "vllm"),
        Job("triton-parity", 1, 300, _pytest("tests/test_triton_engine_gpu.py", "-m", "gpu1")),
        Job("triton-parity-tp2", 2, 420, _pytest("tests/test_triton_engine_gpu.py", "-m", "gpu2")),
        # each TP 4 engine start compiles its sharded kernels: runs 15/17 cut both models' job at 197 s
        Job("triton-parity-tp4", 4, 560, _pytest("tests/test_triton_engine_gpu.py", "-m", "gpu4")),
        Job("triton-parity-tp4-gpt", 4, 300, _pytest("tests/test_triton_engine_gpu.py", "-m", "gpu4", "-k", "20b")),
        Job("triton-zoo", 1, 240, _pytest("suites/test_bug_zoo.py", "-m", "gpu1")),
        Job("kernels-gpu", 1, 300, _pytest("tests/test_kernels_moe.py", "tests/test_kernels_lora_linear.py",
                                           "tests/test_kernels_logprob.py", "-m", "gpu1")),
        # HF / HF+PEFT at full depth were measured before (e2e.csv); --skip-hf times the runtime alone
        Job("bench-e2e", 1, 480, ("python", "benchmarks/bench_e2e.py", "--profile", "--skip-hf", "--out", "{dir}",
                                  "--commit", os.environ.get("LPDIFF_COMMIT", "unknown"))),
        Job("bench-kernels", 1, 300, ("python", "benchmarks/bench_kernels.py", "--quick", "--out", "{dir}",
                                      "--commit", os.environ.get("LPDIFF_COMMIT", "unknown"))),
    ]
    # the MoE backends A/B (kernels/moe_grouped.py vs the fused kernel) and the fused kernel's tile sweep
    commit = ("--commit", os.environ.get("LPDIFF_COMMIT", "unknown"))
    jobs += [
        Job("bench-moe", 1, 300, ("python", "benchmarks/bench_kernels.py", "--quick", "--moe-only", "--out", "{dir}")
            + commit),
        Job("bench-moe-sweep", 1, 300, ("python", "benchmarks/bench_kernels.py", "--sweep", "--sweep-budget-s",
                                        "200", "--out", "{dir}") + commit),
        # the LoRA shrink launch (ShrinkConfig: rows per program, block_k, warps, stages) at both models' shapes
        Job("bench-shrink-sweep", 1, 240, ("python", "benchmarks/bench_kernels.py", "--sweep-shrink",
                                           "--sweep-budget-s", "170", "--out", "{dir}") + commit),
        Job("kernels-grouped-gpu", 1, 300, _pytest("tests/test_kernels_moe_grouped.py", "-m", "gpu1")),
        # programs walking several N tiles (GemmConfig.n_tiles) compiled in bf16; their timings are bench-moe's
        # *_ntiles* rows and stage lines
        Job("kernels-ntiles-gpu", 1, 240, _pytest("tests/test_kernels_moe.py", "-m", "gpu1", "-k", "n_tiles")),
        Job("bench-e2e-grouped", 1, 480, ("python", "benchmarks/bench_e2e.py", "--models", "qwen3-30b-a3b",
                                          "--moe-backend", "grouped_mm", "--profile", "--skip-hf", "--out", "{dir}")
            + commit),
        # #4's measurement as its Done-means asks: HF and HF+PEFT in the same run, both models, the triton engine
        # with CUDA graphs (its default) and without ("triton-eager")
        Job("bench-e2e-all", 1, 550, ("python", "benchmarks/bench_e2e.py", "--moe-backend", "triton", "--graphs",
                                      "both", "--profile", "--out", "{dir}") + commit),
    ]
    return jobs


JOBS: dict[str, Job] = {j.name: j for j in _jobs()}


def job_env(job: Job, jdir: Path) -> dict[str, str]:
    """The environment of one job: common.sh's settings, the stack's PYTHONPATH, CSVs into the job's folder."""
    env = dict(os.environ)
    env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OUT=str(jdir),
               LPDIFF_CHECK_STORE=env.get("LPDIFF_CHECK_STORE", str(Path.home() / ".cache/lpdiff/check-store")),
               LPDIFF_CHECK_CSV_DIR=str(jdir), LPDIFF_METAMORPHIC_CSV=str(jdir / "metamorphic.csv"),
               LPDIFF_LANE_LOG_DIR=str(jdir))
    path = [str(REPO)]
    if job.stack == "vllm":
        vw = Path(env.get("VW", Path.home() / "vw"))
        path.insert(0, str(vw / "vsite"))
        env.update(VLLM_USE_FLASHINFER_SAMPLER="0", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    if job.stack == "sglang":
        sw = Path(env.get("SW", Path.home() / "sw"))
        env["LPDIFF_SGLANG_PYTHONPATH"] = f"{sw / 'ssite'}:{sw / 'sshim'}"
    env["PYTHONPATH"] = ":".join(path + [p for p in [os.environ.get("PYTHONPATH")] if p])
    env.update(job.env)
    return env


def argv_for(job: Job, jdir: Path) -> list[str]:
    return [a.replace("{dir}", str(jdir)) for a in job.argv]
