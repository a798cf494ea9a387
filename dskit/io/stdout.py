"""stdout for the CLI: a closed pipe or a full disk behind stdout ends a command cleanly, not in a traceback.

`guarded(fn)` runs a command with sys.stdout wrapped so that a failed write or flush is known to be
stdout's (the command's own file writes fail with the same OSErrors: ENOSPC from a run dir on a full
disk must still name that file). Exit codes, also in `dskit --help` and docs/usage.md:

- EPIPE (`dskit plan | head -c1`): quiet, exit 141, what a shell reports for a program that SIGPIPE
  ended (coreutils' `cat` or `yes` in the same pipe): the reader left on purpose, nothing to say.
- anything else (ENOSPC on `> /dev/full`, EIO, a stdout closed with `>&-`): one line on stderr,
  `dskit: error: cannot write to stdout: <reason>`, exit 74 (EX_IOERR in sysexits.h), kept apart
  from 2 (bad input) and 1 (`dskit doctor` found a failure).
"""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Callable
from typing import Any

EXIT_STDOUT = 74
EXIT_EPIPE = 141  # 128 + SIGPIPE


class StdoutError(Exception):
    """stdout refused a write; not an OSError, so no command's `except OSError` takes it for its own."""

    def __init__(self, err: OSError):
        super().__init__(str(err))
        self.err = err


class _Guarded:
    """sys.stdout as it was, except that its write and flush errors become StdoutError."""

    def __init__(self, stream: Any):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            if self._stream is None:  # started with stdout closed (`>&-`): Python left sys.stdout None
                raise OSError(errno.EBADF, os.strerror(errno.EBADF))
            return self._stream.write(text)
        except OSError as e:
            raise StdoutError(e) from e

    def flush(self) -> None:
        try:
            if self._stream is not None:
                self._stream.flush()
        except OSError as e:
            raise StdoutError(e) from e

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, buffer...
        return getattr(self._stream, name)


def guarded(fn: Callable[[], int]) -> int:
    """fn()'s exit code, with stdout flushed before returning; a stdout failure ends it as above."""
    real = sys.stdout
    sys.stdout = _Guarded(real)
    try:
        try:
            code = fn()
        except SystemExit:  # argparse's --help prints, then exits: its text must reach stdout too
            sys.stdout.flush()
            raise
        sys.stdout.flush()
        return code
    except StdoutError as e:
        return _failed(e.err, real)
    finally:
        sys.stdout = real


def _failed(err: OSError, real: Any) -> int:
    _discard(real)
    if err.errno == errno.EPIPE:
        return EXIT_EPIPE
    try:
        print(f"dskit: error: cannot write to stdout: {err.strerror or err}", file=sys.stderr, flush=True)
    except (OSError, ValueError):  # stderr is gone too: the exit code still says it
        pass
    return EXIT_STDOUT


def _discard(real: Any) -> None:
    """Point stdout's descriptor at /dev/null: the unwritten text still buffered would otherwise fail
    again at interpreter exit ("Exception ignored ... BrokenPipeError"), a second message and exit 120.
    The recipe of Python's signal docs (note on SIGPIPE)."""
    try:
        fd = real.fileno()
    except (
        AttributeError,
        OSError,
        ValueError,
    ):  # no descriptor (a test's capture): nothing to flush at exit
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)
