"""README's "Test your own model" block, run line by line as printed, in a folder holding a copy of the tiny zoo's
Qwen3-MoE as ``./my-model``: each line must exit with the code its comment states (the planted fault FAILs)."""

from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path

from lpdiff.harness.cli import main
from lpdiff.harness.spec.catalog import ZOO_DIR
from tests.helpers.paths import REPO

README = REPO / "README.md"


def own_model_block() -> list[tuple[list[str], int]]:
    section = README.read_text().split("## Test your own model", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    lines = []
    for ln in block.strip().splitlines():
        cmd, _, comment = ln.partition("#")
        lines.append((shlex.split(cmd), int(re.search(r"exit (\d)", comment).group(1))))
    return lines


def test_readme_own_model_block_runs_as_printed(tmp_path, monkeypatch, capsys):
    lines = own_model_block()
    assert [argv[:2] for argv, _ in lines] == [
        ["lpdiff", "adapters"],
        ["lpdiff", "regen"],
        ["lpdiff", "run"],
        ["lpdiff", "run"],
    ]
    assert [code for _, code in lines] == [0, 0, 0, 1] and "--option" in lines[-1][0]
    shutil.copytree(ZOO_DIR / "tiny-qwen3-moe", tmp_path / "my-model")
    monkeypatch.chdir(tmp_path)
    for argv, code in lines:
        capsys.readouterr()
        rc = main(argv[1:])
        out, err = capsys.readouterr()
        assert rc == code, f"{shlex.join(argv)} exited {rc}, README says {code}:\n{err[-2000:]}"
        if argv[1] == "run":
            assert out.startswith("triton (float32) judged against the stored hf (float32) reference runs")
            assert ("FAIL" in out) == (code == 1)
            assert code == 0 or "next step: lpdiff bisect ./my-model --adapter ./my-adapter" in out + err
    assert not list(Path(ZOO_DIR / "tiny-qwen3-moe").glob("*lpdiff*"))
