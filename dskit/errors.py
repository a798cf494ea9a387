"""The one error type users see: a bad input, reported as one line naming the field."""

from __future__ import annotations

from dskit.io.text import escape

#: Exit code for bad input (spec, CLI flags, run.yaml, missing data). Matches argparse's usage errors.
EXIT_BAD_INPUT = 2


class SpecError(Exception):
    """Bad input. ``field`` is a dotted path into the run spec (or a CLI flag / file name).

    Both parts are escaped (dskit.io.text.escape): a path or key with a newline in it still makes one line.
    """

    def __init__(self, field: str, message: str):
        field, message = escape(str(field)), escape(str(message))
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def __reduce__(self):
        # raised in a `data prepare` worker process and re-raised in the parent: rebuild it from the
        # escaped parts without escaping them twice
        return (_rebuild, (self.field, self.message))


def _rebuild(field: str, message: str) -> SpecError:
    e = SpecError.__new__(SpecError)
    Exception.__init__(e, f"{field}: {message}")
    e.field, e.message = field, message
    return e


def one_of(values) -> str:
    """Render allowed values for an error message: 'one of: a, b, c'."""
    return "one of: " + ", ".join(str(v) for v in values)


class RankExit(Exception):
    """A rank ends with a launcher-relevant exit code (EXIT_BAD_INPUT, the disk-full code, the requeue
    code) where no process exit carries it: a Ray Train worker raises this, and the driver decides."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code, self.message = code, message

    def __reduce__(self):  # Ray pickles a worker's exception to the driver
        return (RankExit, (self.code, self.message))
