"""Where the checkout's folders are, for tests in any depth of tests/ (so that moving a test file moves no path)."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # tests/helpers/paths.py -> the checkout's root
TESTS = REPO / "tests"
HELPERS = TESTS / "helpers"
