"""The one error type users see: a bad input, reported as one line naming the field."""

from __future__ import annotations

from dskit.text import escape

#: Exit code for bad input (spec, CLI flags, run.yaml, missing data). Matches argparse's usage errors.
EXIT_BAD_INPUT = 2


class SpecError(Exception):
    """Bad input. ``field`` is a dotted path into the run spec (or a CLI flag / file name).

    Both parts are escaped (dskit.text.escape): a path or key with a newline in it still makes one line.
    """

    def __init__(self, field: str, message: str):
        field, message = escape(str(field)), escape(str(message))
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def one_of(values) -> str:
    """Render allowed values for an error message: 'one of: a, b, c'."""
    return "one of: " + ", ".join(str(v) for v in values)
