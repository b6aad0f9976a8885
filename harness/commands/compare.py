"""``lpdiff compare``: two engines live on the same model, adapters and prompts, or two stored runs."""

from __future__ import annotations

from lpdiff.harness.commands.run import Job, judge_runs, resolve_job
from lpdiff.harness.pipeline.metrics import compare
from lpdiff.harness.pipeline.routing import apply, attribute
from lpdiff.harness.pipeline.session import run_session
from lpdiff.harness.pipeline.thresholds import lookup
from lpdiff.harness.pipeline.verdict import Verdict, judge
from lpdiff.harness.spec.errors import InputError
from lpdiff.harness.spec.validate import check_adapters, load_run_pair
from lpdiff.harness.types import AdapterSpec


def compare_runs(path_a: str, path_b: str, allow_different: bool = False) -> Verdict:
    """Two runs saved by ``lpdiff run --save-runs``: a is judged against b (same prompts; same model and adapter
    unless ``allow_different``)."""
    a, b = load_run_pair(path_a, path_b, allow_different)
    lane = [f"{r.meta.get('engine', '?')}:{r.meta.get('dtype', 'float32')}" for r in (a, b)]
    model, dtype = a.meta.get("model", "?"), a.meta.get("dtype", "float32")
    v = judge(
        compare(a, b),
        lookup(model, f"{lane[0]}-vs-{lane[1]}", dtype, int(a.meta.get("tp", 1))),
        adapter=f"{a.meta.get('adapter') or '-'} vs {b.meta.get('adapter') or '-'}",
    )
    # both saved with the engine option capture_routing: the routing part and the fault's name (pipeline/routing.py)
    apply(v, attribute(a, b, (dtype, b.meta.get("dtype", "float32")), v.threshold))
    return v


def compare_live(
    model: str,
    engine: str,
    dtype: str,
    against: str,
    against_dtype: str,
    tp: int = 1,
    adapter: str | None = None,
    test_adapter_dir: str | None = None,
    prompt_set: str = "default",
    num_layers: int | None = None,
) -> list[Verdict]:
    """``engine`` against ``against`` (at TP 1), both live. ``test_adapter_dir``: the engine under test gets these
    adapter files under the adapter's name (e.g. a deliberately broken copy)."""
    job = Job(
        model=model,
        engine=engine,
        dtype=dtype,
        reference=against,
        ref_dtype=against_dtype,
        tp=tp,
        adapters=(adapter,) if adapter else None,
        prompt_set=prompt_set,
        num_layers=num_layers,
    )
    spec, adapters, prompts = resolve_job(job)
    test_adapters = dict(adapters)
    if test_adapter_dir:
        if len(adapters) != 1:
            raise InputError("--test-adapter-dir needs exactly one --adapter")
        name = next(iter(adapters))
        test_adapters = {name: AdapterSpec(name, test_adapter_dir)}
    check_adapters(spec, test_adapters)
    runs = run_session(engine, spec, test_adapters, prompts, dtype, tp, job.top_k).first
    refs = run_session(against, spec, adapters, prompts, against_dtype, 1, job.top_k).first
    return judge_runs(job, runs, refs)
