"""``lpdiff``: one click command tree over the commands in harness/commands/ (faces in harness/cli_*.py).

Exit codes (README "Exit codes"): 0 every verdict as expected; 1 a verdict failed (or was not as expected);
2 bad input, a missing/stale/corrupt baseline or an engine that is not installed — one line naming the fix;
3 lpdiff itself crashed (a bug: the traceback is printed). ``lpdiff`` alone runs ``lpdiff run``.
"""

from __future__ import annotations

import signal
import sys
import traceback

import click

import lpdiff
from lpdiff.harness.cli_adapters import adapters, models
from lpdiff.harness.cli_common import EXIT_CRASH, EXIT_FAILED, EXIT_OK, EXIT_USAGE, LAYOUTS, log
from lpdiff.harness.cli_engines import bisect, calibrate, check, compare, doctor, metamorphic
from lpdiff.harness.cli_run import regen, run
from lpdiff.harness.cli_store import baselines, report

# The error classes only, from a module that imports nothing: `lpdiff --help` and `--version` start in well under a
# second (importing torch costs seconds); tests/harness/test_cli.py checks that nothing heavier is imported.
from lpdiff.harness.spec.errors import InputError

__all__ = ["EXIT_CRASH", "EXIT_FAILED", "EXIT_OK", "EXIT_USAGE", "LAYOUTS", "cli", "main"]


@click.group(invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(lpdiff.__version__, "--version", prog_name="lpdiff")
@click.pass_context
def cli(ctx: click.Context) -> None:
    """Logprob-diff regression harness for LoRA adapters on Mixture-of-Experts LLMs."""
    if ctx.invoked_subcommand is None:
        ctx.exit(ctx.invoke(run))


for command in (
    run,
    regen,
    compare,
    models,
    adapters,
    calibrate,
    check,
    metamorphic,
    doctor,
    bisect,
    baselines,
    report,
):
    cli.add_command(command)


def main(argv: list[str] | None = None) -> int:
    """Entry point: the exit-code contract lives here, so every command keeps it."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        rc = cli.main(args=argv, prog_name="lpdiff", standalone_mode=False)
    except click.exceptions.Exit as e:
        return e.exit_code
    except click.ClickException as e:  # usage errors: unknown option, bad value, missing argument
        e.show()
        return EXIT_USAGE
    except (click.exceptions.Abort, KeyboardInterrupt):  # click turns Ctrl-C into Abort
        log("aborted")
        return 128 + signal.SIGINT  # the shell's code for a SIGINT death (130), never a FAIL's 1
    except InputError as e:  # bad input, whatever layer found it: one line naming the fix
        log(f"error: {e}")
        return EXIT_USAGE
    except Exception:  # noqa: BLE001 - a bug in lpdiff: show everything
        traceback.print_exc()
        log("error: lpdiff crashed (the traceback above is a bug; please report it)")
        return EXIT_CRASH
    return EXIT_OK if rc is None else int(rc)


if __name__ == "__main__":
    sys.exit(main())
