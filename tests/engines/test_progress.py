"""engines/progress.py: each line carries the tag and the message on stderr and in the log file, which
LPDIFF_CHECK_CSV_DIR names when no path is given; without either, nothing is written to disk."""

import re

from lpdiff.engines.progress import progress_log


def test_lines_go_to_stderr_and_the_named_file(tmp_path, capsys):
    log = progress_log("[job 3] ", tmp_path / "deep" / "p.log")
    log("loading")
    log("done")
    err = capsys.readouterr().err.splitlines()
    lines = (tmp_path / "deep" / "p.log").read_text().splitlines()
    assert err == lines and len(lines) == 2
    assert re.fullmatch(r"\d\d:\d\d:\d\d \+ *\d+\.\ds \[job 3\] loading", lines[0]), lines[0]
    assert lines[1].endswith("[job 3] done")


def test_the_job_directory_from_the_environment(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LPDIFF_CHECK_CSV_DIR", str(tmp_path / "job"))
    progress_log()("step")
    assert (tmp_path / "job" / "progress.log").read_text().endswith(" step\n")
    monkeypatch.delenv("LPDIFF_CHECK_CSV_DIR")
    before = sorted(tmp_path.rglob("*"))
    progress_log()("nowhere")
    assert sorted(tmp_path.rglob("*")) == before and "nowhere" in capsys.readouterr().err
