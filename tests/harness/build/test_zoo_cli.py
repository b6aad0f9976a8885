"""`python -m lpdiff.harness.build.zoo`'s own command line (the zoo's contents are test_zoo.py's)."""

from __future__ import annotations

import pytest

from lpdiff.harness.build import zoo
from lpdiff.harness.build.zoo_train import TrainConfig


def test_build_help_states_the_default_step_count(capsys):
    """The --steps help names the default number (TrainConfig is a slots dataclass: its class attribute is a member
    descriptor, not the default)."""
    with pytest.raises(SystemExit) as exit_info:
        zoo.main(["build", "--help"])
    assert exit_info.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert f"(default {TrainConfig().steps})" in help_text
