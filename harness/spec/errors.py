"""The errors that mean bad input. The CLI maps ``InputError`` (and click's own usage errors) to one line and exit
2; every other exception is a bug in lpdiff and exits 3 with its traceback (README "Exit codes")."""

from __future__ import annotations


class InputError(ValueError):
    """Base of every bad-input error: the message names the file or argument at fault and the fix, on one line.
    A ValueError, so that library code that catches ValueError around a parse keeps doing so."""


class SpecError(InputError):
    """A model, adapter or prompt set that cannot be resolved; the message names it and the fix."""


class UsageError(InputError):
    """Bad input found after parsing (a missing engine, an unknown adapter, a flag combination)."""


def user_file_error(path, e: OSError) -> InputError:
    """An OSError met while reading a file the user named, as bad input naming the path (wrap at the point of
    reading: an OSError anywhere else is lpdiff's own)."""
    return InputError(f"cannot read {path}: {e.strerror or e}")


class UnknownName(InputError, KeyError):
    """A name that is not among the known ones (an engine, an adapter, a prompt set); a KeyError too, for callers
    that look names up in a mapping. Its message prints as given (KeyError's own str() would quote it)."""

    __str__ = Exception.__str__
