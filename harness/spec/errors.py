"""The one error the spec layer raises for bad user input (exit 2 at the CLI)."""
from __future__ import annotations


class SpecError(ValueError):
    """A model, adapter or prompt set that cannot be resolved; the message names it and the fix."""
