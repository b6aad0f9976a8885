"""The engine sessions of ``lpdiff metamorphic`` (commands/metamorphic.py): which lanes share one engine, in which
order the sessions open, and how a lane's rows are arranged in its calls (alone, mixed with other adapters,
permuted, one prompt per call, ...)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence

import numpy as np

from lpdiff.harness.commands.relations import ORIG, OTHER, Context, Lane
from lpdiff.harness.spec.adapters import peft_signature
from lpdiff.harness.spec.transforms import negate_b, pad_rank
from lpdiff.harness.types import AdapterSpec, LogprobRun, PromptLogprobs


def _arrange(lane: Lane, n: int, seed: int, among: Sequence[str] = ()) -> list[tuple[list[int], list[str | None]]]:
    """-> calls, each (prompt indices, adapter names per row); the lane's rows are those with adapter 'lane'.
    ``among``: the session's adapter names, for among_adapters (among_base: the names of the session it stands in
    for; its engine runs every row without adapter)."""
    me = "lane"
    if lane.arrangement in ("among_adapters", "among_base"):
        group = [me, *among]
        rows: list[tuple[int, str | None]] = [
            (i, who) for i in range(n) for who in group[i % len(group) :] + group[: i % len(group)]
        ]
        return [([i for i, _ in rows], [w for _, w in rows])]
    if lane.arrangement in ("alone", "beside_other"):
        return [(list(range(n)), [me] * n)]
    if lane.arrangement == "single":
        return [([i], [me]) for i in range(n)]
    if lane.arrangement == "tripled":
        return [([i for i in range(n) for _ in range(3)], [me] * (3 * n))]
    rows = [(i, who) for i in range(n) for who in ((me, None, OTHER) if i % 2 else (None, OTHER, me))]
    if lane.arrangement == "permuted":
        order = np.random.default_rng(seed).permutation(len(rows))
        rows = [rows[j] for j in order]
    return [([i for i, _ in rows], [w for _, w in rows])]


def _run_lane(
    eng, lane: Lane, names: dict, prompts: list[list[int]], seed: int, among: Sequence[str] = ()
) -> LogprobRun:
    out: list[PromptLogprobs | None] = [None] * len(prompts)
    for idx, who in _arrange(lane, len(prompts), seed, among):
        got = eng.prompt_logprobs([prompts[i] for i in idx], [names.get(w, w) for w in who])
        for i, w, res in zip(idx, who, got):
            if w == "lane":
                out[i] = res
    done = [p for p in out if p is not None]
    assert len(done) == len(out), "every arrangement gives each prompt one 'lane' row"
    return LogprobRun(done)


def among_held(ctx: Context) -> list[str]:
    """The adapters a session with an among_adapters lane holds beside a base lane (the original, the neighbour,
    Context.neighbours), in the order execute adds them: an among_base lane's batch has their rows."""
    return [ORIG, OTHER, *(f"neighbour:{n}" for n in ctx.neighbours)]


def execute(
    ctx: Context,
    lanes: list[Lane],
    prompts: list[list[int]],
    k: int = 2,
    log: Callable[[str], None] = lambda s: None,
    after_session: Callable[[list[Lane], dict, list, list, str], None] | None = None,
) -> tuple[dict[str, LogprobRun], list[LogprobRun], list[LogprobRun], str]:
    """Run the original and base lanes k times, then every lane, one engine session per (session, model,
    options, tp); the original's session comes first. ``after_session(lanes, runs, origs, bases, version)`` after
    each (a run cut short keeps what it judged). -> (lane runs, original reruns, base reruns, engine version)."""
    from lpdiff.engines import EngineConfig, open_engine

    assert k >= 2, "rerun noise needs k >= 2 runs of the original lane"
    orig_spec = AdapterSpec(ORIG, str(ctx.adapter_dir))
    t0 = time.perf_counter()
    other_dir = ctx.write("other-neg-b-rank2x", pad_rank(negate_b(ctx.adapter), 2 * max(ctx.adapter.inner_dims)))
    log(f"write the neighbour adapter: {time.perf_counter() - t0:.1f} s")
    runs: dict[str, LogprobRun] = {}
    origs, bases, version = [], [], ""
    models = {None: None} | {lane.model.name: lane.model for lane in lanes if lane.model}
    for (session, key, options, tp), group in sessions(ctx, lanes):
        model = models[key]
        among = any(lane.arrangement == "among_adapters" for lane in group)
        uses_orig = (
            session.startswith("original") or among or any(lane.adapter == str(ctx.adapter_dir) for lane in group)
        )
        adapters = {ORIG: orig_spec} if uses_orig else {}
        for j, lane in enumerate(group):
            if lane.adapter is not None and lane.adapter != str(ctx.adapter_dir):
                adapters[f"lane{j}"] = AdapterSpec(f"lane{j}", lane.adapter)
        if any(lane.arrangement not in ("alone", "single", "tripled", "among_base") for lane in group):
            adapters[OTHER] = AdapterSpec(OTHER, other_dir)
        if among:  # a session with no adapters (the LoRA-disabled one) never gets here: among implies ORIG
            adapters.update({f"neighbour:{n}": AdapterSpec(f"neighbour:{n}", d) for n, d in ctx.neighbours.items()})
        cfg = EngineConfig(
            model=model or ctx.spec,
            adapters=adapters,
            dtype=ctx.dtype,
            tp=tp or ctx.tp,
            options={**ctx.options, **json.loads(options)},
        )
        log(f"session {session}: {len(group)} lane(s), {len(adapters)} adapter(s)")
        t0 = time.perf_counter()
        with open_engine(ctx.engine, cfg) as eng:
            version = version or eng.version()
            if session.startswith("original"):
                for _ in range(k):
                    bases.append(LogprobRun(eng.prompt_logprobs(prompts, None)))
                    origs.append(LogprobRun(eng.prompt_logprobs(prompts, ORIG)))
            for j, lane in enumerate(group):
                adapter = (
                    None if lane.adapter is None else (ORIG if lane.adapter == str(ctx.adapter_dir) else f"lane{j}")
                )
                names, beside = {"lane": adapter}, [a for a in adapters if a != adapter]
                if lane.arrangement == "among_adapters" and adapter is None:  # what among_base stands in for
                    assert beside == among_held(ctx), (beside, among_held(ctx))
                if lane.arrangement == "among_base":  # the rows of a base lane's among_adapters batch, all base
                    beside = among_held(ctx)
                    names |= dict.fromkeys(beside)
                for r in range(lane.reruns):
                    runs[rerun_name(lane.name, r)] = _run_lane(eng, lane, names, prompts, ctx.seed, beside)
        log(f"session {session}: done in {time.perf_counter() - t0:.1f} s")
        if after_session is not None:
            after_session(group, runs, origs, bases, version)
    return runs, origs, bases, version


def sessions(ctx: Context, lanes: list[Lane]) -> list[tuple[tuple, list[Lane]]]:
    """The engine sessions ``execute`` opens, in order: ((session, model name, options, tp), lanes). The original's
    first; then each session after those holding the lanes its lanes are judged against."""
    from lpdiff.engines import capabilities

    by_signature = capabilities(ctx.engine).peft_sessions

    def signature(adapter_dir: str | None) -> str:
        # PEFT holds several adapters in one model only when they name the same target_parameters; a base lane
        # runs anywhere, so it joins the original adapter's sessions
        return peft_signature(adapter_dir or str(ctx.adapter_dir)) if by_signature else ""

    out: dict[tuple, list[Lane]] = {("original" + signature(None), None, "{}", None): []}
    for lane in lanes:
        sig = signature(lane.adapter) if lane.model is None else ""
        out.setdefault((lane.session + sig, lane.model.name if lane.model else None, lane.options, lane.tp), []).append(
            lane
        )
    return _dependency_order(out)


def _dependency_order(sessions: dict[tuple, list[Lane]]) -> list[tuple[tuple, list[Lane]]]:
    """Sessions in their first-seen order, except that a session runs after every session holding a lane that one
    of its lanes is judged against: an engine with ``peft_sessions`` (hf) splits one relation's lanes over sessions
    by PEFT signature (gate_up's per-expert forms reference its PEFT 3D form, which another signature's session
    holds), and a session is judged as soon as it ends."""
    home = {lane.name: key for key, group in sessions.items() for lane in group}
    needs = {
        key: {home[lane.reference] for lane in group if lane.reference in home} - {key}
        for key, group in sessions.items()
    }
    done: list[tuple] = []
    while len(done) < len(sessions):
        ready = next((k for k in sessions if k not in done and needs[k] <= set(done)), None)
        if ready is None:  # a cycle between sessions: no order satisfies it; run_metamorphic judges such lanes last
            ready = next(k for k in sessions if k not in done)
        done.append(ready)
    return [(k, sessions[k]) for k in done]


def rerun_name(lane: str, j: int) -> str:
    """The key of a lane's j-th run: the lane's own name for the first."""
    return lane if j == 0 else f"{lane}#rerun{j}"
