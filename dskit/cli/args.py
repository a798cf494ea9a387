"""What several commands share: the parser's one-line error, integer and fraction flag types, the spec
flags (`--set` and the SPEC_FLAGS shortcuts)."""

from __future__ import annotations

import argparse
import re
from typing import Any

from dskit.errors import EXIT_BAD_INPUT
from dskit.io.text import ascii_int, escape

# what add_subparsers() returns; argparse names no public type for it
Subparsers = argparse._SubParsersAction


class Parser(argparse.ArgumentParser):
    """argparse with the one-line promise: a bad flag or value is `dskit: error: ...`, exit 2, without
    the usage block (`--help` still shows it). Sub-commands inherit this class; `python -m` entry points
    outside the CLI (dskit.host.jit_ops) use it too."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(EXIT_BAD_INPUT, f"dskit: error: {escape(self.prog)}: {escape(message)} (see --help)\n")


def count(text: str) -> int:
    """An integer flag: ASCII digits only (`ascii_int`)."""
    if (n := ascii_int(text)) is None:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r} (ASCII digits 0-9 only)")
    return n


def fraction(text: str) -> float:
    """A share in [0, 1) written as a plain decimal (no 'nan', 'inf', '1e-2' surprises: 0.01)."""
    if not re.fullmatch(r"0?\.[0-9]{1,12}|0", text):
        raise argparse.ArgumentTypeError(
            f"invalid fraction: {text!r} (a decimal from 0 to below 1, e.g. 0.01)"
        )
    return float(text)


# Flags that map 1:1 onto spec fields (dest -> dotted spec key).
SPEC_FLAGS: dict[str, tuple[str, Any, str]] = {
    "job_name": ("name", str, "run/job name (spec: name)"),
    "model": ("model.preset", str, "catalog model (spec: model.preset)"),
    "gpu": ("hardware.gpu", str, "GPU profile (spec: hardware.gpu)"),
    "gpus_per_node": ("hardware.gpus_per_node", count, "GPUs per node (spec: hardware.gpus_per_node)"),
    "nodes": ("hardware.nodes", count, "node count (spec: hardware.nodes)"),
    "fabric": ("network.fabric", str, "network fabric (spec: network.fabric)"),
    "runtime": ("runtime.kind", str, "Slurm: pyxis | apptainer | none (spec: runtime.kind)"),
    "image": ("runtime.image", str, "container image (spec: runtime.image)"),
    "calibration": (
        "hardware.calibration",
        str,
        "calibration.json from `dskit calibrate` on this cluster (spec: hardware.calibration)",
    ),
    "chain": ("slurm.chain", count, "Slurm: a chain of N jobs for long runs (spec: slurm.chain)"),
}


def add_spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", nargs="?", help="run spec YAML (default: built-in defaults; see `dskit init`)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override any spec field, e.g. --set training.steps=100 --set slurm.time=48:00:00 "
        "(repeatable). VALUE is taken literally (no YAML: '#' and quotes are characters) unless it is "
        "a number, true/false, null, a [a, b] list or a {k: v} mapping",
    )
    for dest, (_, typ, help_) in SPEC_FLAGS.items():
        p.add_argument("--" + dest.replace("_", "-"), dest=dest, type=typ, help=help_)


def spec_words(a: argparse.Namespace, *, leave_out: tuple[str, ...] = ()) -> list[str]:
    """The spec and its flags as the user gave them (`add_spec_args`), for a printed command that must
    plan the same spec; the flags named in `leave_out` (dests) are not repeated."""
    words = [a.spec] if a.spec else []
    for dest in SPEC_FLAGS:
        if dest not in leave_out and getattr(a, dest) is not None:
            words += ["--" + dest.replace("_", "-"), str(getattr(a, dest))]
    for s in a.set:
        words += ["--set", s]
    return words


def spec_from_args(a: argparse.Namespace):
    from dskit.spec import load_spec

    flags = {key: getattr(a, dest) for dest, (key, _, _) in SPEC_FLAGS.items()}
    return load_spec(a.spec, a.set, flags)


def refuse_empty_values(parser: argparse.ArgumentParser) -> None:
    """Every argument of `parser` and its sub-commands that takes a value refuses an empty or blank one,
    naming itself (argparse's `argument -o/--output: ...`), as every spec field does (BLANK in
    dskit/spec/values.py): it is a slip (`--tag "$TAG"` with TAG unset), never a choice, and taken as
    given it meant the default (`calibrate slurm -o ''` wrote runs/NAME-calibrate-slurm) or an odd
    refusal far from the flag. Wraps each one's type: checked as argparse reads the value, before any
    command starts."""
    for action in parser._actions:
        if isinstance(action, Subparsers):
            for sub in dict.fromkeys(action.choices.values()):  # aliases map to the same parser
                refuse_empty_values(sub)
        elif action.nargs != 0:
            action.type = _non_empty(
                action.type, optional=bool(action.option_strings) and not action.required
            )


def _non_empty(typ: Any, *, optional: bool) -> Any:
    hint = "give a value, or leave the flag out for its default" if optional else "give a value"

    def convert(text: str) -> Any:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"is empty; {hint}")
        return text if typ is None else typ(text)

    # argparse names the type in "invalid <type> value" when it raises ValueError
    convert.__name__ = getattr(typ, "__name__", "str")
    return convert
