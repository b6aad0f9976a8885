"""`lpdiff regen` of another prompt set or depth leaves the committed baselines of the same model in place (it
used to delete all of them as "stale", after which plain `lpdiff run` exited 2), and the store's CLI errors are one
line with exit 2."""

import shutil
from pathlib import Path

from lpdiff.harness.cli import main
from tests.helpers.paths import REPO

COMMITTED = REPO / "baselines"


def _files(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.glob("??/*.parquet")}


def test_regen_of_another_prompt_set_or_depth_keeps_the_committed_baselines(tmp_path, capsys):
    store = tmp_path / "store"
    shutil.copytree(COMMITTED, store)
    committed = _files(store)
    sel = ["--model", "tiny-qwen3-moe", "--adapter", "experts", "--baselines", str(store)]
    assert main(["regen", *sel, "--prompt-set", "short"]) == 0
    assert main(["regen", *sel, "--num-layers", "2"]) == 0
    assert committed < _files(store) and len(_files(store)) == len(committed) + 4  # base + adapter, twice
    capsys.readouterr()
    # the default set still runs (hf: the store is under test, not an engine)
    assert main(["run", "--model", "tiny-qwen3-moe", "--baselines", str(store), "--engine", "hf"]) == 0
    assert main(["run", *sel, "--prompt-set", "short", "--engine", "hf"]) == 0
    assert main(["run", *sel, "--num-layers", "2", "--engine", "hf"]) == 0
    assert main(["baselines", "prune", "--baselines", str(store)]) == 0
    assert "0 file(s) would be removed" in capsys.readouterr().err  # nothing superseded: every set is current


def test_store_path_errors_exit_2_with_one_line(tmp_path, capsys):
    f = tmp_path / "store.txt"
    f.write_text("a file")
    assert main(["run", "--model", "tiny-qwen3-moe", "--adapter", "experts", "--baselines", str(f)]) == 2
    err = capsys.readouterr().err
    assert f"{f} is a file; pass --baselines" in err and "Traceback" not in err
