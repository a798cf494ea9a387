"""The one refusal for a command whose optional extra is not installed (pyproject.toml's
optional-dependencies): the core install (`pip install dskit`, no torch) renders jobs, and a command that
needs more says so in one line, exit 2, before it reads or writes anything (a run directory half made by
`dskit calibrate local` before torch failed to import, or a ModuleNotFoundError traceback, is what it
replaces). Commands check with `require`; `python -m` entry points outside the CLI with `refused`."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterable

from dskit.errors import EXIT_BAD_INPUT, SpecError

#: extra -> the top-level modules its commands import (names as imported, a subset of the extra's
#: packages in pyproject.toml; tests/test_extras.py holds them to it). The train extra's tensorboard
#: and peft are left out: the trainer runs on without TensorBoard (one warning), and only LoRA needs peft.
MODULES: dict[str, tuple[str, ...]] = {
    "train": ("torch", "deepspeed", "transformers", "accelerate", "safetensors", "numpy", "tqdm"),
    "report": ("matplotlib",),
    "data": ("pyarrow", "zstandard"),
    "fp8": ("torchao",),
}


def missing(command: str, extra: str, module: str) -> SpecError:
    """The one line: `command` needs `extra`, of which `module` is not installed."""
    return SpecError(command, f"needs the {extra} extra (missing {module}): pip install 'dskit[{extra}]'")


def require(command: str, extra: str, modules: Iterable[str] | None = None) -> None:
    """SpecError (exit 2) unless `modules` (default: all of the extra's, MODULES) can be imported. Looks
    them up without importing them: torch's import alone takes seconds."""
    for name in MODULES[extra] if modules is None else modules:
        # find_spec: None for a module that is not installed (or blocked with sys.modules[name] = None)
        if importlib.util.find_spec(name) is None:
            raise missing(command, extra, name)


def refused(command: str, extra: str) -> int | None:
    """For a `python -m` entry point: the refusal printed as the CLI prints it, and its exit code; None
    when the extra is installed."""
    try:
        require(command, extra)
    except SpecError as e:
        print(f"dskit: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return None
