"""Issue 40 item 6: baselines of a ``--prompts FILE`` run are keyed by those prompts, not filed under the prompt set
'default', so ``baselines prune --yes`` never takes them for a newer default run and removes the real default
baselines (after which ``lpdiff run`` exited 2). Real CLI, real HF engine, real store."""

from __future__ import annotations

import json

from lpdiff.harness.cli import main

MODEL, ADAPTER = "tiny-qwen3-moe", "experts"


def _lpdiff(capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_prompts_file_run_then_prune_keeps_the_default_baselines(tmp_path, capsys):
    store = tmp_path / "B"
    sel = ("--model", MODEL, "--adapter", ADAPTER, "--engine", "hf", "--baselines", store)
    rc, _, err = _lpdiff(capsys, "regen", *sel)
    assert rc == 0, err
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"token_ids": [5, 17, 300, 42, 9, 801, 3, 77]}) + "\n")
    rc, _, err = _lpdiff(capsys, "regen", *sel, "--prompts", prompts)
    assert rc == 0, err
    rc, out, err = _lpdiff(capsys, "baselines", "ls", "--baselines", store)
    assert rc == 0 and out.count("prompt set 'default'") == 2, out  # the file's two runs are not 'default'
    rc, out, err = _lpdiff(capsys, "baselines", "prune", "--yes", "--baselines", store)
    assert rc == 0 and "removed" not in out, out
    rc, out, err = _lpdiff(capsys, "run", *sel)
    assert rc == 0 and "FAIL" not in out, err
    rc, out, err = _lpdiff(capsys, "run", *sel, "--prompts", prompts)
    assert rc == 0 and "FAIL" not in out, err
