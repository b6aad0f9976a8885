"""The baseline store's errors. Each message names the path at fault and the command or option that fixes it; the
CLI turns every BaselineError into one line and exit code 2."""

from __future__ import annotations

from lpdiff.harness.spec.errors import InputError


class BaselineError(InputError):
    """Base of every store error."""


class BaselineMissing(BaselineError):
    pass


class BaselineCorrupt(BaselineError):
    """A stored file that cannot be read back as what its name says (truncated, edited, junk)."""


class BaselineStale(BaselineError):
    pass


class BaselineExists(BaselineError):
    pass


class BaselineStorePath(BaselineError):
    """The store's folder (or one of its sub-folders) is a file, or cannot be written."""
