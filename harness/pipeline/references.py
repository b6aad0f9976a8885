"""The one path to reference runs: answer from the baseline store, and call the reference engine only when the
policy allows it (lm-evaluation-harness's CachingLM, for logprob runs).

Policies: ``stored`` (run / compare: a missing baseline is an error naming the regen command), ``regen``
(recompute and overwrite, nothing else touched), ``cache`` (check, calibrate: compute what is missing and keep it).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from lpdiff.engines import REFERENCE_ENGINE, capabilities
from lpdiff.harness.pipeline.session import Lanes, run_session
from lpdiff.harness.pipeline.store import BaselineError, BaselineStore
from lpdiff.harness.pipeline.store_key import baseline_key
from lpdiff.harness.spec.adapters import peft_signature
from lpdiff.harness.spec.validate import check_reference_runs
from lpdiff.harness.types import AdapterSpec, ModelSpec

POLICIES = ("stored", "regen", "cache")
PACKAGE_BASELINES = Path(__file__).resolve().parents[2] / "baselines"  # the source tree's or the wheel's


def default_store(root: str | os.PathLike | None = None) -> BaselineStore:
    """The one default store: ``root`` (--baselines), else ``$LPDIFF_BASELINES``, else the baselines shipped with
    lpdiff (the tiny zoo's committed references). ``hf://datasets/ORG/NAME[@REV]`` is a Hub dataset, pulled at the
    pinned revision (or served from the HF cache offline)."""
    from lpdiff.harness.pipeline.hub import resolve_store

    return BaselineStore(resolve_store(str(root or os.environ.get("LPDIFF_BASELINES") or PACKAGE_BASELINES)))


def peft_groups(adapters: dict[str, AdapterSpec]) -> list[dict[str, AdapterSpec]]:
    """Adapters split into groups one PeftModel can hold (it refuses adapters whose target_parameters are spelled
    differently)."""
    groups: dict[str, dict[str, AdapterSpec]] = {}
    for name, a in adapters.items():
        groups.setdefault(peft_signature(a.path), {})[name] = a
    return list(groups.values())


@dataclass(slots=True)
class References:
    """Reference runs of one engine configuration, through ``store`` under ``policy``. ``regen_command`` is the
    command line that regenerates them: the store quotes it in every missing/stale/corrupt error."""

    store: BaselineStore
    engine: str = REFERENCE_ENGINE
    dtype: str = "float32"
    options: dict | None = None
    top_k: int = 0
    policy: str = "stored"
    regen_command: str | None = None
    prompt_set: str | None = None  # the prompt set's name: lets regen / prune tell a changed set from another one
    log: Callable[[str], None] = lambda s: None

    def __post_init__(self):
        assert self.policy in POLICIES, f"policy must be one of {POLICIES}, got {self.policy!r}"

    def runs(self, spec: ModelSpec, adapters: dict[str, AdapterSpec], prompts: Sequence[Sequence[int]]) -> Lanes:
        """Base + one run per adapter (reference engines run at TP 1: the reference does not shard)."""
        keys = {
            a: baseline_key(
                spec,
                adapters.get(a) if a else None,
                prompts,
                self.dtype,
                1,
                self.engine,
                self.top_k,
                extra=self.options or None,
                prompt_set=self.prompt_set,
                regen_command=self.regen_command,
            )
            for a in [None, *adapters]
        }
        if self.policy != "regen":
            try:
                runs = {a: self.store.get(k) for a, k in keys.items()}
                self.log(
                    f"{self.engine}:{self.dtype}{self.options or ''} reference runs of {spec.name} from "
                    f"{self.store.root}"
                )
                return runs
            except BaselineError:  # missing, stale or corrupt: only the cache may compute it afresh
                if self.policy == "stored":
                    raise
        runs = self.compute(spec, adapters, prompts)
        check_reference_runs(runs, f"{self.engine}:{self.dtype} reference runs of {spec.name}")  # before any put
        try:
            for a, k in keys.items():
                self.store.put(k, runs[a], overwrite=True)
        except BaselineError as e:
            if self.policy == "regen":
                raise
            self.log(f"reference runs not cached ({e})")  # a read-only store: the runs are still good to judge
        return runs

    def compute(self, spec: ModelSpec, adapters: dict[str, AdapterSpec], prompts: Sequence[Sequence[int]]) -> Lanes:
        t0 = time.perf_counter()
        groups = peft_groups(adapters) if adapters and capabilities(self.engine).peft_sessions else [adapters]
        runs: Lanes = {}
        for i, group in enumerate(groups):
            sess = run_session(self.engine, spec, group, prompts, self.dtype, 1, self.top_k, self.options)
            runs.update({a: r for a, r in sess.first.items() if a is not None or i == 0})
        self.log(
            f"{self.engine}:{self.dtype}{self.options or ''} reference runs of {spec.name} computed in "
            f"{time.perf_counter() - t0:.1f}s"
        )
        return runs
