"""What ``lpdiff check`` prints and appends (commands/check.py): the result's table with its threshold and the lanes
not served, and one CSV row per lane (benchmarks/results/engines_gpu.csv)."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from lpdiff.harness.pipeline.provenance import device_name, git_commit
from lpdiff.harness.pipeline.report import append_csv, verdict_table

if TYPE_CHECKING:
    from lpdiff.harness.commands.check import CheckResult

CSV_COLUMNS = (
    "date",
    "commit",
    "gpu",
    "engine_version",
    "model",
    "layers",
    "tp",
    "dtype",
    "adapter",
    "adapter_format",
    "engine_pair",
    "k2",
    "max_abs",
    "mean_abs",
    "delta_fidelity",
    "near_tie_share",
    "threshold_k2",
    "threshold_max",
    "threshold_fidelity",
    "ref_noise_k2",
    "ref_noise_max",
    "ref_noise_fidelity",
    "rerun_noise_k2",
    "rerun_noise_max",
    "rerun_noise_fidelity",
    "expected",
    "verdict",
    "reasons",
    "init_recipe",
)


def format_result(res: CheckResult) -> str:
    if res.error is not None:
        return "\n".join(
            [
                (
                    f"{res.engine} {res.dtype} (tp={res.tp}) on {res.model} x{res.layers} layers: FAIL, the "
                    f"engine failed before giving logprobs:\n{res.error}"
                ),
                *_refused_lines(res),
            ]
        )
    ok = "as expected" if res.as_expected else "NOT AS EXPECTED"
    t = res.threshold
    assert t is not None  # set unless the engine failed (res.error, above)
    head = (
        f"{res.engine} {res.dtype} (tp={res.tp}, {res.engine_version}) vs {res.reference} fp32 on {res.model} "
        f"x{res.layers} layers: {ok}\nthreshold = {t.margin_factor:g} x noise: k2 "
        f"{t.k2:.3g}, max |Δ| "
        f"{t.max_abs:.3g}, fidelity {t.delta_fidelity:.3g} ({t.note})"
    )
    bad = [
        f"  {v.adapter}: expected {v.expected}" for v in res.verdicts if ("PASS" if v.passed else "FAIL") != v.expected
    ]
    return "\n".join([head, verdict_table(res.verdicts), *bad, *_refused_lines(res)])


def _refused_lines(res: CheckResult) -> list[str]:
    return [f"  {lane}: not served ({why})" for lane, why in res.refused.items()]


def csv_rows(res: CheckResult) -> list[dict]:
    return [{**row, "init_recipe": res.init_recipe} for row in _rows(res)]


def _rows(res: CheckResult) -> list[dict]:
    date, commit, gpu = datetime.date.today().isoformat(), git_commit(), device_name()
    head = {
        "date": date,
        "commit": commit,
        "gpu": gpu,
        "model": res.model,
        "layers": res.layers,
        "tp": res.tp,
        "dtype": res.dtype,
    }
    if res.error is not None:
        lines = res.error.strip().splitlines()
        last = next((ln for ln in reversed(lines) if "Error" in ln), lines[-1])[:300]  # the cause, not the teardown
        return [{**head, "engine_pair": res.engine_pair, "verdict": "FAIL", "reasons": f"engine failed: {last}"}]
    t = res.threshold
    assert t is not None  # set unless the engine failed (res.error, above)
    head.update(engine_version=res.engine_version, engine_pair=t.engine_pair)
    rows = [
        {
            **head,
            "adapter": lane.partition(".")[0],
            "adapter_format": lane.partition(".")[2],
            "verdict": "SKIP",
            "reasons": f"not served: {why}"[:300],
        }
        for lane, why in res.refused.items()
    ]
    for v in res.verdicts:
        name, _, layout = v.adapter.partition(".")
        m = v.metrics
        fid = "" if v.delta_fidelity is None else f"{v.delta_fidelity:.4g}"
        rows.append(
            {
                **head,
                "adapter": name,
                "adapter_format": layout or "-",
                "k2": f"{m.k2:.4g}",
                "max_abs": f"{m.max_abs:.4g}",
                "mean_abs": f"{m.mean_abs:.4g}",
                "delta_fidelity": fid,
                "near_tie_share": "" if m.near_tie_share is None else f"{m.near_tie_share:.3f}",
                "threshold_k2": f"{t.k2:.4g}",
                "threshold_max": f"{t.max_abs:.4g}",
                "threshold_fidelity": f"{t.delta_fidelity:.4g}",
                "ref_noise_k2": f"{res.ref_noise.k2:.4g}",
                "ref_noise_max": f"{res.ref_noise.max_abs:.4g}",
                "ref_noise_fidelity": f"{res.ref_noise.fidelity:.4g}",
                "rerun_noise_k2": f"{res.rerun_noise.k2:.4g}",
                "rerun_noise_max": f"{res.rerun_noise.max_abs:.4g}",
                "rerun_noise_fidelity": f"{res.rerun_noise.fidelity:.4g}",
                "expected": v.expected,
                "verdict": "PASS" if v.passed else "FAIL",
                "reasons": "; ".join(v.reasons),
            }
        )
    return rows


def write_csv(res: CheckResult, path: str | Path) -> Path:
    return append_csv(path, CSV_COLUMNS, csv_rows(res))
