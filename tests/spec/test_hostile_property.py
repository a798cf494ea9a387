"""Property: any string in any string field of the spec is either refused (a SpecError: exit 2, one
line) or rendered inertly and byte for byte, on every target.

Hypothesis draws hostile strings (shell and YAML syntax, `$(VAR)`, quotes, line separators, C1
controls, non-ASCII digits) into several spec fields at once, then:
- Slurm: job.sbatch passes `bash -n`; its contract block and launch array, run in bash in an empty
  directory (conftest.slurm_launch), export every contract value and pass the interpreter byte for byte
  and create nothing; the whole script, run with stub srun/scontrol, hands srun exactly that array and
  creates only the checkpoint and output dirs (storage paths lie under the example's temporary dir);
- Helm: values.yaml parses to exactly the chart's keys, carries the contract and the interpreter
  literally, validates against the chart's values.schema.json, and the chart's rendered Job (Helm's own
  engine) gives the pod, after Kubernetes' $(VAR) rule, the same env, STOP/COMPLETE paths and argv;
- Ray: submit.sh passes `bash -n`, runtime_env.yaml and the RayJob's runtimeEnvYAML carry the env
  byte for byte, the entrypoint splits (as a shell would) into exactly [python, -m, dskit.launch.ray_train],
  and the RayJob's pods see the same env after $(VAR) expansion;
- image: renders (only catalog names reach it).
EXAMPLES (400) examples plus 200 for --set: about 40 s on 2 cores (the Helm engine dominates);
DSKIT_PROPERTY_EXAMPLES lowers both (make test-fast: 50 each; CI runs the full counts).
"""

from __future__ import annotations

import copy
import json
import os
import shlex
import subprocess
import tempfile
import unicodedata
from pathlib import Path

import jsonschema
import pytest
import yaml

from dskit.errors import SpecError
from dskit.launch.contract import COMPLETE_FILE, RUN_YAML, STOP_FILE, Env
from dskit.plan.build import build_plan
from dskit.render import helm, image, ray, slurm
from dskit.render.helm_values import ChartValues, values_schema
from dskit.spec import load_spec, validate_spec
from tests.conftest import REPO, slurm_launch
from tests.support.k8s_pods import container_env, expand

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

EXAMPLES = int(os.environ.get("DSKIT_PROPERTY_EXAMPLES", "400"))
LABELS = {"batch.kubernetes.io/controller-uid": "uid-1"}

# Pieces a hostile user would try (most are valid in a path, so they must render inertly), and
# characters that break line-oriented formats (they must be refused).
TOKENS = [
    "$(HOME)", "${HOME}", "$HOME", "$(MASTER_ADDR)", "$$", "$", "`id`", "$(touch pwned)", "'", '"', "\\",
    ";", "&&", "|", ">", "<", "*", "?", "~", "#", " #x", ": x", "- x", "{a: b}", "[a]", "!!python/object",
    "&a", "*a", "null", "true", "48:00:00", "0x1f", "1e3", ".inf", "--", "-m", "é", "٣", "ａ", "😀", "/",
    ".", "..", " ", "a", "x1", "%s", "\\n", "=",
]  # fmt: skip
# Whole values that YAML 1.1 readers (Helm's and kubectl's Go YAML) resolve to a bool, null or number
# when written plain: rendered YAML must hand them over as the same strings.
YAML11 = ["y", "n", "Y", "N", "yes", "No", "on", "OFF", "~", "null", "0o17", "1e3", "0.1e3", "1_01e3", "0x1f"]
BREAKERS = ["\n", "\r", "\t", "\x00", "\x85", "\x9b", "\u2028", "\u2029", "\ufeff", "\u202e", "\udc80"]
hostile = st.lists(
    st.sampled_from(TOKENS * 4 + BREAKERS) | st.characters(exclude_categories=("Cs",)), min_size=1, max_size=6
).map("".join) | st.sampled_from(YAML11)


def _inside(s: str) -> str:
    """No '..': the script creates these dirs, and they must stay inside the example's directory."""
    return s.replace("..", ".,")


#: Spec fields that hold text, and how a drawn string becomes their value. Storage paths lie under the
#: example's own directory (BASE_DIR), since the whole job.sbatch runs and creates them.
FIELDS = {
    "runtime.python": lambda s, base: s,
    "runtime.image": lambda s, base: s,
    "runtime.mounts": lambda s, base: [s],
    "storage.root": lambda s, base: f"{base}/{_inside(s)}",
    "storage.checkpoint_dir": lambda s, base: f"{base}/shared/{_inside(s)}",
    "storage.output_dir": lambda s, base: f"{base}/shared/{_inside(s)}",
    "data.path": lambda s, base: f"{base}/shared/{_inside(s)}",
    "network.interface": lambda s, base: s,
    "name": lambda s, base: s,
    "slurm.partition": lambda s, base: s,
    "slurm.time": lambda s, base: s,
    "slurm.extra_args": lambda s, base: [s],
    "kubernetes.node_selector": lambda s, base: {s: s},
    "kubernetes.tolerations": lambda s, base: [{"key": s, "operator": "Exists"}],
    "kubernetes.memory": lambda s, base: s,
    "kubernetes.secret_env": lambda s, base: {"HF_TOKEN": s},
    "kubernetes.queue": lambda s, base: s,
    "kubernetes.queue_priority": lambda s, base: s,
    "kubernetes.topology_level": lambda s, base: s,
}

#: Fields with no pattern of their own: the drawn strings reach the renders.
FREE_TEXT = [
    "runtime.python",
    "runtime.image",
    "runtime.mounts",
    "storage.root",
    "storage.checkpoint_dir",
    "storage.output_dir",
    "data.path",
    "network.interface",
]

BASE = {
    "hardware": {"gpu": "cpu", "gpus_per_node": 2, "nodes": 2},
    "network": {"fabric": "tcp"},
    "model": {"preset": "tiny-v2"},
    "training": {"seq_len": 128, "global_batch": 8},
    "runtime": {"kind": "pyxis"},
}
#: srun records its argv (NUL-separated), scontrol names the one node: the script runs, nothing else.
STUBS = {
    "srun": '#!/bin/bash\nprintf "%s\\0" "$@" > "$SRUN_LOG"\n',
    "scontrol": "#!/bin/sh\necho node1\n",
}


def _spec_data(fields: dict[str, str], base: Path) -> dict:
    data = copy.deepcopy(BASE)
    data["storage"] = {"root": f"{base}/shared"}
    for dotted, s in fields.items():
        section, _, key = dotted.rpartition(".")
        node = data.setdefault(section, {}) if section else data
        node[key] = FIELDS[dotted](s, base)
    return data


def _has_surrogate(s: str) -> bool:
    return any(unicodedata.category(c) == "Cs" for c in s)


def _bash_n(text: str, d: Path) -> None:
    f = d / "script.sh"
    f.write_text(text)
    r = subprocess.run(["bash", "-n", str(f)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    f.unlink()


def _check_slurm(plan, run_dir: Path, work: Path) -> None:
    try:
        script = slurm.render(plan, run_dir)[slurm.SCRIPT]
    except SpecError as e:  # a mount list pyxis would split differently
        assert "," in str(e) or ":" in str(e)
        return
    _bash_n(script, work)
    cwd = work / "cwd"
    cwd.mkdir()
    env, argv = slurm_launch(script, cwd)
    assert list(cwd.iterdir()) == [], "running the contract block created files"
    for k, v in plan.env.items():
        assert env[k] == v, k
    assert env[Env.RUN_FILE.value] == f"{run_dir}/{RUN_YAML}"
    assert plan.launch.python in argv
    if plan.launch.runtime == "pyxis":
        assert f"--container-image={plan.launch.image}" in argv
        root = plan.launch.storage_root
        mounts = ",".join([f"{root}:{root}", f"{run_dir}:{run_dir}", *plan.launch.mounts])
        assert f"--container-mounts={mounts}" in argv
    _run_whole_script(script, plan, argv, work)


def _run_whole_script(script: str, plan, argv: list[str], work: Path) -> None:
    """job.sbatch end to end with stub srun/scontrol, in an empty dir: srun gets exactly the launch
    array, the checkpoint and output dirs are created verbatim, and nothing else happens."""
    stub = work / "bin"
    stub.mkdir()
    for name, text in STUBS.items():
        (stub / name).write_text(text)
        (stub / name).chmod(0o755)
    (work / "job.sbatch").write_text(script)
    cwd = work / "cwd-run"
    cwd.mkdir()
    log = work / "srun.argv"
    env = {
        "PATH": f"{stub}:/usr/bin:/bin",
        "SLURM_JOB_NODELIST": "node1",
        "SLURM_JOB_ID": "7",
        "SRUN_LOG": str(log),
    }
    r = subprocess.run(["bash", str(work / "job.sbatch")], capture_output=True, env=env, cwd=cwd)
    assert r.returncode == 0, r.stderr
    assert log.read_bytes().decode().split("\0")[:-1] == argv[1:]
    assert list(cwd.iterdir()) == [] and not list(work.rglob("pwned*")), "a hostile string ran"
    assert Path(plan.run.checkpoint_dir).is_dir() and Path(plan.run.output_dir).is_dir()


def _render_chart(values: dict) -> list[dict]:
    helm_python = pytest.importorskip("helm_python")
    with helm_python.Chart.load(str(REPO / "helm" / "dskit")) as ch:
        out = ch.render(values, name="run", namespace="default", is_install=True)
    return [
        d
        for path, text in sorted(out.items())
        if path.endswith(".yaml")
        for d in yaml.safe_load_all(text)
        if d
    ]


def _check_helm(plan, schema: dict) -> None:
    try:
        text = helm.values_yaml(plan)
    except SpecError:
        return  # refused: the CLI prints it as one line and exits 2
    assert text.isascii() or all(line.startswith("#") for line in text.splitlines() if not line.isascii())
    values = yaml.safe_load(text)
    helm_python = pytest.importorskip("helm_python")
    assert helm_python.values_from_yaml(text) == values  # Helm's own (Go, YAML 1.1) reader agrees
    full = set(ChartValues.model_validate(values).model_dump(by_alias=True, exclude_none=True))
    assert set(values) <= full and full - set(values) <= {"workload", "kueue", "trainJob"}  # at defaults
    jsonschema.validate(values, schema)
    assert values["trainer"]["env"] == plan.env
    assert values["contract"]["stopFile"] == f"{plan.run.checkpoint_dir}/{STOP_FILE}"
    assert yaml.safe_load(values["plan"])["launch"]["python"] == plan.launch.python
    job = next(o for o in _render_chart(values) if o["kind"] == "Job")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    env = container_env(container, labels=LABELS, secrets={})
    for k, v in plan.env.items():
        assert env[k] == v, k
    command = [expand(w, env) for w in container["command"]]
    assert command[2:4] == [
        f"{plan.run.checkpoint_dir}/{STOP_FILE}",
        f"{plan.run.output_dir}/{COMPLETE_FILE}",
    ]
    assert expand(container["args"][0], env) == plan.launch.python
    assert container["image"] == plan.launch.image


def _check_ray(plan, work: Path) -> None:
    try:
        files = ray.render(plan, work / "ray")
    except SpecError:
        assert "$" in plan.launch.python or any("$" in v for v in plan.env.values())
        return
    _bash_n(files[ray.SUBMIT], work)
    assert yaml.safe_load(files[ray.RUNTIME_ENV])["env_vars"] == {**plan.env, Env.RUN_FILE.value: RUN_YAML}
    docs = {d["kind"]: d for d in yaml.safe_load_all(files[ray.RAYJOB])}
    config_map, job = docs["ConfigMap"], docs["RayJob"]
    assert config_map["data"][RUN_YAML] == files[RUN_YAML]
    assert shlex.split(job["spec"]["entrypoint"]) == [plan.launch.python, "-m", ray.ENTRY_MODULE]
    runtime_env = yaml.safe_load(job["spec"]["runtimeEnvYAML"])["env_vars"]
    assert {k: runtime_env[k] for k in plan.env} == plan.env
    spec = job["spec"]["rayClusterSpec"]
    for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        (container,) = group["template"]["spec"]["containers"]
        env = container_env(container, labels=LABELS, secrets={})
        assert {k: env[k] for k in plan.env} == plan.env


@pytest.fixture(scope="module")
def schema() -> dict:
    return values_schema()


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    fields=st.dictionaries(st.sampled_from(FREE_TEXT * 3 + sorted(FIELDS)), hostile, min_size=1, max_size=3),
    # no surrogates: a UTF-8 script cannot hold one (the CLI refuses them in -o, dskit.io.text)
    run_name=hostile.filter(
        lambda s: "/" not in s and "\x00" not in s and s not in (".", "..") and not _has_surrogate(s)
    ),
)
def test_hostile_strings_are_refused_or_rendered_byte_exact(schema, fields, run_name):
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        try:
            spec = validate_spec(_spec_data(fields, work))
            plan = build_plan(spec)
        except SpecError as e:
            assert "\n" not in str(e) and "\u2028" not in str(e) and "\x85" not in str(e)
            event(f"refused: {e.field.split('.')[0]}")
            return
        event("rendered")
        image.render(plan, work / "image")
        _check_slurm(plan, work / f"runs/{run_name}", work)
        _check_helm(plan, schema)
        _check_ray(plan, work)


@settings(max_examples=min(200, EXAMPLES), deadline=None)
@given(value=hostile)
def test_set_values_are_literal_text(value):
    """--set KEY=VALUE on a text field gives VALUE itself (or a refusal), never a YAML reading of it."""
    try:
        spec = load_spec(sets=[f"runtime.image={value}"])
    except SpecError:
        return
    word = value.strip()
    if word == "null" or (word[:1], word[-1:]) in (("[", "]"), ("{", "}")):
        return  # the documented exceptions (a list or mapping is refused by the field)
    assert spec.runtime.image == value


def test_examples_exercise_both_outcomes():
    """The strategy reaches both branches (a drawn field value is sometimes accepted)."""
    with tempfile.TemporaryDirectory() as d:
        plan = build_plan(validate_spec(_spec_data({"runtime.python": "/x y/$(HOME)/'q'/`id`;é"}, Path(d))))
        _check_slurm(plan, Path(d) / "runs/r \u00e9", Path(d))
        _check_helm(plan, values_schema())
        with pytest.raises(SpecError):
            validate_spec(_spec_data({"storage.root": "a\u2028b"}, Path(d)))
    assert json.loads(json.dumps(plan.deepspeed)) == plan.deepspeed
