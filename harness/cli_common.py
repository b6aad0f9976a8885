"""What every face of the ``lpdiff`` command tree shares: exit codes, the option types, ``--option`` parsing, the
log and the check that an engine is installed. Imports click and the engine registry alone (``--help`` starts
without numpy or torch)."""

from __future__ import annotations

import json
import sys

import click

from lpdiff.engines import ENGINES  # the registry alone: numpy and torch load with an engine
from lpdiff.harness.spec.errors import UsageError

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_CRASH = 0, 1, 2, 3
DTYPES = click.Choice(["float32", "bfloat16", "float16"])
# spec.adapters.LAYOUTS, spelt out so that the CLI starts without importing torch (tests/harness/test_cli.py compares
# them)
LAYOUTS = click.Choice(["peft3d", "per_expert", "per_expert_gate"])


class EngineChoice(click.Choice):
    """An engine of the registry (engines/registry.py), as it stands when the CLI loads: an engine added there (its
    one line) is offered by every command without an edit here; an unknown name is one line naming the known ones."""

    def __init__(self) -> None:
        super().__init__(list(ENGINES))

    def convert(self, value, param, ctx):
        if value not in ENGINES:
            self.fail(f"unknown engine {value!r}; known engines: {', '.join(ENGINES)}", param, ctx)
        return value


ENGINE = EngineChoice()


def parse_options(items) -> dict:
    """``--option KEY=VALUE`` (repeatable): VALUE is JSON when it parses as JSON, else a string."""
    out = {}
    for item in items or ():
        if "=" not in item:
            raise click.BadParameter(f"takes KEY=VALUE, got {item!r}", param_hint="--option")
        k, v = item.split("=", 1)
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


def log(msg: str) -> None:
    click.echo(msg, err=True)


def progress(items, desc: str):
    from tqdm import tqdm

    return tqdm(items, desc=desc, unit="model", file=sys.stderr, disable=len(items) < 2 or not sys.stderr.isatty())


def need_engine(engine: str) -> None:
    from lpdiff.harness.pipeline.session import engine_missing

    if why := engine_missing(engine):
        raise UsageError(why)
