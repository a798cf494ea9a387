"""An empty or blank value is refused for every argument of every command (dskit/cli/args.py
refuse_empty_values), in one line naming it, exit 2, nothing written: the parser is walked, so an argument
added later is held to it too. The spec's fields follow the same rule (tests/spec/test_empty_values.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from dskit.cli import build_parser, main
from dskit.cli.args import Subparsers


def _arguments(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command words, the argument's name as argparse prints it, the argv giving it '') for every
    argument that takes a value; the positionals before it get a value that parses."""
    positionals = [a for a in parser._actions if not a.option_strings and not isinstance(a, Subparsers)]
    for action in parser._actions:
        if isinstance(action, Subparsers):
            for word, sub in action.choices.items():
                yield from _arguments(sub, (*path, word))
        elif action.nargs != 0:
            before = [
                list(p.choices)[-1] if p.choices else "x"  # calibrate's last target renders, its first trains
                for p in positionals[: positionals.index(action) if action in positionals else None]
                if p.nargs != "?"
            ]
            if action.option_strings:
                name, given = "/".join(action.option_strings), [action.option_strings[-1]]
            else:
                name, given = action.metavar or action.dest, []
            yield path, name, [*path, *before, *given]


CASES = {f"{' '.join(path)} {name}": (name, argv) for path, name, argv in _arguments(build_parser())}


def test_the_walk_reaches_every_command_and_the_flags_that_took_an_empty_value_for_the_default():
    assert {"calibrate -o/--output", "build --tag", "render -o/--output", "init -o/--output"} <= set(CASES)
    assert {"data prepare inputs", "status RUN_DIR|RELEASE", "export --shard-mib", "train --nproc"} <= set(
        CASES
    )


@pytest.mark.parametrize("blank", ["", " "], ids=repr)
@pytest.mark.parametrize("case", sorted(CASES))
def test_an_empty_value_is_one_line_naming_the_argument(tmp_path, monkeypatch, capsys, case, blank):
    name, argv = CASES[case]
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as ended:
        main([*argv, blank])
    err = capsys.readouterr().err
    assert ended.value.code == 2, err
    assert err.count("\n") == 1 and f": argument {name}: is empty; give a value" in err, err
    assert list(Path(tmp_path).iterdir()) == [], "something was written"
