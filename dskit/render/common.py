"""Shared by every render target: the template environment, shell quoting, and atomic output."""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable, Iterable
from pathlib import Path

import jinja2
import yaml

from dskit.errors import SpecError
from dskit.io.atomic import atomic_dir
from dskit.io.text import comment
from dskit.launch import torchrun
from dskit.launch.contract import DEEPSPEED_JSON, RUN_YAML
from dskit.plan.schema import Plan, dump_plan
from dskit.spec import yamlsafe
from dskit.spec.values import ENV_NAME_RE


def package_data_dir(installed: str, checkout: str) -> Path:
    """A directory that lives at the top of the repository (the user's layout) and inside the package
    in an installed wheel (pyproject's force-include): dskit/INSTALLED there, CHECKOUT here."""
    package = Path(__file__).resolve().parent.parent
    for candidate in (package / installed, package.parent / checkout):
        if candidate.is_dir():
            return candidate
    raise RuntimeError(f"dskit's {checkout} not found: the installation is incomplete")


def templates_dir() -> Path:
    return package_data_dir("templates", "templates")


def environment() -> jinja2.Environment:
    # StrictUndefined: a missing variable is an error, never an empty string in a script.
    # No autoescape: outputs are shell/Dockerfile, and every value arrives pre-quoted from Python.
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )


def render_template(name: str, **context) -> str:
    return environment().get_template(name).render(**context)


def q(value: object) -> str:
    """Quote one shell word."""
    return shlex.quote(str(value))


def sq(value: object) -> str:
    """Always single-quote, even when shlex would not (commas in pyxis mount lists trip shellcheck)."""
    return "'" + str(value).replace("'", "'\"'\"'") + "'"


def env_lines(env: dict[str, str]) -> list[str]:
    """`export NAME=value` lines, values quoted, names checked (they come from catalogs and code)."""
    out = []
    for name, value in env.items():
        if not ENV_NAME_RE.match(name):
            raise ValueError(f"invalid environment variable name {name!r}")
        out.append(f"export {name}={q(value)}")
    return out


def shell_words(words: list[str]) -> str:
    """A command line for a shell, every word quoted (Ray entrypoints, KubeRay submitters)."""
    return shlex.join(str(w) for w in words)


class _YamlDumper(yaml.SafeDumper):
    """Rendered YAML (values.yaml, rayjob.yaml, runtime_env.yaml): multi-line strings (the plan) as
    literal blocks so they stay readable and diffable. Output is ASCII (allow_unicode off): every other
    character is a \\u escape inside a double-quoted scalar, so no reader (PyYAML's YAML 1.1 or Helm's
    Go YAML 1.2) can take U+2028, U+0085 or a C1 control for a line break or refuse the file.

    Every other string, keys included, is double-quoted: YAML 1.1 readers (Helm's and kubectl's Go
    YAML among them) read plain `y`, `off`, `~`, `0o17` or `1_01e3` as a bool, null or number, so no
    string is left for a reader's resolver to guess at."""


_YamlDumper.add_representer(
    str,
    lambda dumper, s: dumper.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else '"'),
)


def dump_yaml(data: object) -> str:
    return yaml.dump(data, Dumper=_YamlDumper, sort_keys=False, width=120, allow_unicode=False)


def dump_yaml_all(docs: list[object]) -> str:
    return yaml.dump_all(docs, Dumper=_YamlDumper, sort_keys=False, width=120, allow_unicode=False)


def comment_block(*lines: str) -> str:
    """Comment lines for a rendered shell script or YAML file; each line stays one line whatever it
    holds (dskit.io.text.comment)."""
    return "".join(comment(line) + "\n" for line in lines)


def k8s_literal(word: str) -> str:
    """Escape a value for a container's command, args or env, where Kubernetes expands $(VAR) and
    reads $$ as '$'."""
    return word.replace("$", "$$")


def torchrun_words(plan: Plan, *, quote: Callable[[str], str], endpoint: str, rdzv_id: str) -> list[str]:
    """What every node runs, on every target that starts one process per node (Slurm task, Kubernetes
    pod): torchrun with a c10d rendezvous on the first node, then the trainer (dskit/launch/torchrun.py).

    `quote` escapes the one user-supplied word (the interpreter) for the target's syntax; `endpoint` and
    `rdzv_id` arrive in that syntax already (shell `${VAR}` for Slurm, `$(VAR)` for Kubernetes).
    """
    hw = plan.hardware
    return torchrun.torchrun_words(
        quote(plan.launch.python),
        nproc_per_node=hw.procs_per_node,
        nodes=hw.nodes,
        endpoint=endpoint,
        rdzv_id=rdzv_id,
    )


def run_files(plan: Plan) -> dict[str, str]:
    """Files every target's run directory carries: the plan (trainer input) and its DeepSpeed config."""
    run_yaml = dump_plan(plan)
    if len(run_yaml.encode()) > yamlsafe.MAX_BYTES:
        raise SpecError(
            RUN_YAML,
            f"would be {len(run_yaml.encode())} bytes; the trainer reads at most {yamlsafe.MAX_BYTES} "
            "(a smaller config.json under model.path, or fewer/shorter values, are allowed)",
        )
    return {
        RUN_YAML: run_yaml,
        DEEPSPEED_JSON: json.dumps(plan.deepspeed, indent=2) + "\n",
    }


def write_output(
    files: dict[str, str],
    out_dir: Path,
    *,
    force: bool = False,
    executable: tuple[str, ...] = (),
    inputs: Iterable[str | Path | None] = (),
) -> Path:
    """Write all files or none (see dskit.io.atomic); `inputs` are paths the output must not contain."""
    with atomic_dir(out_dir, kind="run", force=force, inputs=inputs) as tmp:
        for rel, text in files.items():
            path = tmp / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            if rel in executable:
                path.chmod(0o755)
    return Path(out_dir).resolve()
