"""`dskit ARGS` run in this process: dskit.cli.main's exit code and what it printed, as a
CompletedProcess like tests.conftest.dskit's, without the ~0.4 s a `python -m dskit` start costs (its
imports). For tests of what a command decides and prints; a test of the process itself (the console
script's exit code, an environment read at start, a signal, what a core install imports) keeps
tests.conftest.dskit."""

from __future__ import annotations

import importlib
import io
import os
import subprocess
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path


def cli(
    *args: str, cwd: Path | None = None, env: dict[str, str] | None = None, check: bool = False
) -> subprocess.CompletedProcess:
    """dskit.cli.main(ARGS) in `cwd` with `env` added to the environment (both restored after)."""
    from dskit.cli import main

    out, err = io.StringIO(), io.StringIO()
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    try:
        os.environ.update(env or {})
        if cwd is not None:
            os.chdir(cwd)
        with redirect_stdout(out), redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as e:  # argparse: --help, --version, a usage error
                code = _exit_status(e, err)
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
    # what the process's streams would have made of the text: stdout is strict UTF-8 (a lone surrogate
    # there fails the process), stderr writes one as a backslash escape
    stdout = out.getvalue()
    stdout.encode("utf-8")
    stderr = err.getvalue().encode("utf-8", "backslashreplace").decode("utf-8")
    proc = subprocess.CompletedProcess(["dskit", *args], code, stdout, stderr)
    if check and code != 0:
        raise AssertionError(f"dskit {' '.join(args)} -> {code}\n{stdout}\n{stderr}")
    return proc


def _exit_status(e: SystemExit, err: io.StringIO) -> int:
    """The exit status Python gives a SystemExit that ends a process (a text code is printed, status 1)."""
    if e.code is None or isinstance(e.code, int):
        return e.code or 0
    print(e.code, file=err)
    return 1


def import_first(module: str) -> None:
    """Import `module` before a cli() run would: a logger a package sets up at import (DeepSpeed's) keeps
    the sys.stdout of that moment, inside cli() the text the test reads as the command's stdout. (In a
    process, doctor keeps those import-time lines off its stdout at the descriptor: dskit/host/doctor.py.)"""
    importlib.import_module(module)
