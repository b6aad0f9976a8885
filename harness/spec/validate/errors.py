"""What the validation layer says: one ``ValidationError`` per refusal (an InputError, so the CLI prints it as one
line and exits 2) and the ``Problem``s that doctor lists and a run refuses."""

from __future__ import annotations

from dataclasses import dataclass

from lpdiff.harness.spec.errors import InputError

SEVERITIES = ("error", "warning")


class ValidationError(InputError):
    """Bad input: the message names the file or argument, what is wrong and the fix, on one line."""

    def __init__(self, message: str):
        super().__init__(" ".join(message.split("\n")))


@dataclass(slots=True, frozen=True)
class Problem:
    code: str  # stable short name (doctor's finding code)
    what: str  # names the file and what is wrong, one line
    fix: str  # one line
    severity: str = "error"  # error: a run refuses it; warning: doctor says it, runs go on

    def __post_init__(self):
        assert self.severity in SEVERITIES and "\n" not in self.what and "\n" not in self.fix

    @property
    def line(self) -> str:
        return f"{self.what}; fix: {self.fix}"


def first_error(problems: list[Problem], more: str | None = None) -> None:
    """Raise the first error of ``problems`` as one line (``more``: the command that lists them all)."""
    errors = [p for p in problems if p.severity == "error"]
    if errors:
        rest = f" ({len(errors) - 1} more problem(s): `{more}` lists them)" if len(errors) > 1 and more else ""
        raise ValidationError(errors[0].line + rest)
