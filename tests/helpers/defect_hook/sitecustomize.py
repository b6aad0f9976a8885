"""Test hook (tests/harness/test_default_run_defects.py): a process started with this folder on PYTHONPATH installs the
engine defects named in $LPDIFF_TEST_DEFECTS (lpdiff_test_defects.py) before it runs anything. Inert without it."""

import os

if os.environ.get("LPDIFF_TEST_DEFECTS"):
    import lpdiff_test_defects

    lpdiff_test_defects.install([n for n in os.environ["LPDIFF_TEST_DEFECTS"].split(",") if n])
