"""Every environment variable dskit reads, and the form each may take: read here, through `read`, or
nowhere (tests/test_env_vars.py finds any other read under dskit/).

A value that does not parse is bad input like any other: one line naming the variable and the form it
allows (a SpecError), never a ValueError's traceback from deep inside a command. `dskit doctor` turns
it into a FAIL line; the trainer and `python -m dskit.host.jit_ops` exit 2 with it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from dskit.errors import SpecError, one_of
from dskit.io.text import ascii_int


@dataclass(frozen=True)
class Form:
    """What a variable may hold: `parse` returns its value, or None where `text` is not of the form
    `allowed` says (the refusal's words)."""

    allowed: str
    parse: Callable[[str], object]


_digits = ascii_int  # as the CLI's integer flags


def _choice(*values: str) -> Form:
    return Form(one_of(values), lambda text: text if text in values else None)


def _gpu_profile(text: str) -> str | None:
    from dskit.catalog import gpus

    return text if text in gpus() else None


#: any text at all (a path, a command, a URI): read here so that no read escapes the list, and printed
#: escaped like every other value (dskit.io.text.escape)
TEXT = Form("any text", lambda text: text)
WHOLE = Form("a whole number in ASCII digits, e.g. 3", _digits)

#: name -> form, for every variable dskit reads
VARIABLES: dict[str, Form] = {
    # the launch contract (dskit/launch/contract.py: Env)
    "DSKIT_RUN_FILE": TEXT,
    "DSKIT_GPU_PROFILE": Form(
        "a GPU of the catalog (dskit catalog gpus), e.g. h100-80gb or cpu", _gpu_profile
    ),
    "DSKIT_SHM_BYTES": Form("a whole number of bytes in ASCII digits, e.g. 17179869184", _digits),
    "DSKIT_EXIT_DIR": TEXT,
    "DSKIT_EXIT_FILE": TEXT,
    # the launcher's (torchrun, Ray Train)
    "RANK": WHOLE,
    "LOCAL_RANK": WHOLE,
    "WORLD_SIZE": WHOLE,
    # what a dskit image says it carries (templates/image/Dockerfile.j2)
    "DSKIT_IMAGE_ARCH": Form(
        "a compute capability MAJOR.MINOR, e.g. 9.0, or empty (a CPU image)",
        lambda text: text if re.fullmatch(r"([0-9]{1,2}\.[0-9]{1,2})?", text) else None,
    ),
    "DSKIT_IMAGE_FLASH_ATTN": _choice("fa2", "fa4", "none"),
    # the fabric's, as `dskit doctor` reads them (NCCL and libfabric read them themselves)
    "NCCL_IB_DISABLE": _choice("0", "1"),
    "FI_PROVIDER": TEXT,
    # the host's
    "PATH": TEXT,
    "CC": TEXT,
    "TORCH_EXTENSIONS_DIR": TEXT,
    "XDG_CACHE_HOME": TEXT,
    "MLFLOW_TRACKING_URI": TEXT,
}


def read(name: str):
    """`name`'s value in its form (VARIABLES), None where it is unset; SpecError where it does not
    parse."""
    form = VARIABLES[name]
    text = os.environ.get(name)
    if text is None:
        return None
    value = form.parse(text)
    if value is None:
        raise SpecError(name, f"{text!r} is not {form.allowed}")
    return value


def unset(names: Iterable[str]) -> list[str]:
    """Those of `names` not set at all (the launch contract's and the launcher's, which other code reads)."""
    return [n for n in names if n not in os.environ]


def recorded(names: Iterable[str]) -> dict[str, str | None]:
    """`names`' values verbatim (None where unset), for a record of what a run was launched with
    (launch-env.json): kept, never interpreted, so not parsed."""
    return {n: os.environ.get(n) for n in names}
