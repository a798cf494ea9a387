"""Every class of bad input, through the real CLI: exit 2, exactly one line on stderr, nothing written.

One row per class (a reproducer of each and its neighbours). Each row prepares its files in a
fresh directory, runs `dskit` there (its main, in this process: tests/support/cli.py; the process's own
exit codes are the stdout tests' below), and the directory must be exactly as it was afterwards.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.cli import cli

TINY = ["--gpu", "cpu", "--gpus-per-node", "2", "--model", "tiny-v2", "--set", "training.seq_len=128"]
CPU = [*TINY, "--set", "storage.root=/shared/dskit"]
TINY_CONFIG = {
    "model_type": "deepseek_v2",
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
}


Setup = Callable[[Path], list[str]]


def spec(content: bytes | str, *extra: str) -> Callable[[Path], list[str]]:
    """A row that renders a spec file with this content."""

    def setup(d: Path) -> list[str]:
        f = d / "s.yaml"
        f.write_bytes(content.encode() if isinstance(content, str) else content)
        return ["render", "slurm", str(f), *TINY, "-o", str(d / "out"), *extra]

    return setup


def sets(*exprs: str, target: str = "slurm") -> Callable[[Path], list[str]]:
    def setup(d: Path) -> list[str]:
        args = ["render", target, *TINY]
        for e in exprs:
            args += ["--set", e]
        return [*args, "-o", str(d / "out")]

    return setup


def model_config(cfg: object | bytes) -> Callable[[Path], list[str]]:
    def setup(d: Path) -> list[str]:
        (d / "m").mkdir()
        data = cfg if isinstance(cfg, bytes) else json.dumps(cfg).encode()
        (d / "m" / "config.json").write_bytes(data)
        return ["plan", *TINY[:4], "--set", "training.seq_len=128", "--set", f"model.path={d / 'm'}"]

    return setup


def safetensors(header: object) -> bytes:
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + bytes(8)


def weights(**files: object) -> Callable[[Path], list[str]]:
    """A model dir with TINY_CONFIG and these files (bytes as is; a dict as JSON; `st_*` names hold a
    safetensors header)."""

    def setup(d: Path) -> list[str]:
        (d / "m").mkdir()
        (d / "m" / "config.json").write_text(json.dumps(TINY_CONFIG))
        for name, content in files.items():
            name = name.replace("__", ".").replace("st_", "", 1)
            data = content if isinstance(content, bytes) else json.dumps(content).encode()
            (d / "m" / name).write_bytes(data)
        return ["plan", *TINY[:4], "--set", "training.seq_len=128", "--set", f"model.path={d / 'm'}"]

    return setup


def st(header: object) -> Callable[[Path], list[str]]:
    return weights(model__safetensors=safetensors(header))


def index(weight_map: object, raw: bytes | None = None) -> Callable[[Path], list[str]]:
    content = raw if raw is not None else {"weight_map": weight_map}
    return weights(model__safetensors__index__json=content)


T = {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}


def rendered(d: Path, name: str = "run") -> Path:
    out = d / name
    cli("render", "slurm", *CPU, "-o", str(out), check=True)
    return out


def force_into_cwd(d: Path) -> list[str]:
    os.chdir(rendered(d))
    return ["render", "slurm", *CPU, "-o", ".", "--force"]


def force_into_parent(d: Path) -> list[str]:
    (rendered(d) / "sub").mkdir()
    os.chdir(d / "run" / "sub")
    return ["render", "slurm", *CPU, "-o", "..", "--force"]


def force_onto_file(d: Path) -> list[str]:
    (d / "notes.txt").write_text("mine")
    return ["render", "slurm", *CPU, "-o", str(d / "notes.txt"), "--force"]


def force_onto_foreign_dir(d: Path) -> list[str]:
    (d / "project").mkdir()
    (d / "project" / "main.py").write_text("mine")
    return ["render", "slurm", *CPU, "-o", str(d / "project"), "--force"]


def force_onto_data_path(d: Path) -> list[str]:
    run = rendered(d)
    (run / "shards").mkdir()
    return ["render", "slurm", *CPU, "--set", f"data.path={run / 'shards'}", "-o", str(run), "--force"]


def prepare_onto_input(d: Path) -> list[str]:
    (d / "a.txt").write_text("text")
    return ["data", "prepare", str(d / "a.txt"), "-o", str(d / "a.txt"), "--force"]


def prepare_jsonl(data: bytes) -> Callable[[Path], list[str]]:
    def setup(d: Path) -> list[str]:
        (d / "a.jsonl").write_bytes(data)
        return ["data", "prepare", str(d / "a.jsonl"), "-o", str(d / "shards")]

    return setup


def export_onto_run(d: Path) -> list[str]:
    run = rendered(d)
    return ["export", str(run), "-o", str(run), "--force"]


def export_manifest(manifest: bytes, done: bytes = b'{"step": 1, "world_size": 1}') -> Setup:
    def setup(d: Path) -> list[str]:
        out = d / "run"
        cli(
            "render", "slurm", *CPU, "--set", f"storage.checkpoint_dir={d / 'ck'}", "-o", str(out), check=True
        )
        tag = d / "ck" / "step00000001"
        tag.mkdir(parents=True)
        (tag / "dskit.json").write_bytes(done)
        (tag / "dskit-manifest-rank0.json").write_bytes(manifest)
        return ["export", str(out), "-o", str(d / "hf")]

    return setup


def output_under_file(d: Path) -> list[str]:
    (d / "f").write_text("x")
    return ["render", "slurm", *CPU, "-o", str(d / "f" / "out")]


def kubeconfig(content: str) -> Callable[[Path], list[str]]:
    def setup(d: Path) -> list[str]:
        (d / "kc").write_text(content)
        return ["status", "run", "--kubeconfig", str(d / "kc")]

    return setup


UNREACHABLE = """apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://127.0.0.1:1"}}]
users: [{name: u, user: {token: t}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
"""

NO_TRAIN = "needs the train extra"
NO_K8S = "needs the Kubernetes client"
ALIASES = "a: &a [" + ",".join(["x"] * 1000) + "]\nb: [" + ",".join(["*a"] * 500) + "]\n"

#: name -> (setup returning the CLI args, words the one line must contain; '|' separates alternatives)
CASES: dict[str, tuple[Setup, str]] = {
    # spec files that cannot be read as a spec
    "latin-1 spec": (spec(b"name: caf\xe9\n"), "s.yaml: spec file is not UTF-8 text"),
    "UTF-16 spec": (spec("name: x\n".encode("utf-16")), "s.yaml: spec file is not UTF-8 text"),
    "deeply nested YAML": (spec("[" * 5000 + "]" * 5000), "nested deeper than 64 levels"),
    "5000-digit integer": (spec("hardware: {nodes: " + "9" * 5000 + "}\n"), "4300 digits"),
    "integer beyond 2**53": (spec(f"training: {{steps: {2**70}}}\n"), "training.steps: must be between"),
    "alias amplification": (spec(ALIASES), "through aliases"),
    "alias amplification through a long string": (
        spec("runtime: {mounts: [&m '/" + "a" * 100_000 + ":/b', " + ", ".join(["*m"] * 200) + "]}\n"),
        "more than 4 MiB of text through aliases",
    ),
    "spec over 1 MiB": (
        spec("# " + "x" * (1 << 20) + "\n"),
        "spec file is 1,048,579 bytes, over the 1,048,576 a spec file can be",
    ),
    "spec is a directory": (lambda d: ["plan", str(d)], "spec file is not a file"),
    "newline in the spec's name": (
        lambda d: ["plan", str(d / "no\nsuch.yaml")],
        "no\\nsuch.yaml: spec file not found",
    ),
    "duplicate key in the spec": (spec("training: {steps: 1, steps: 2}\n"), "duplicate key 'steps' (line 1)"),
    "duplicate key in a --set mapping": (
        sets("kubernetes.node_selector={a: b, a: c}"),
        "kubernetes.node_selector: duplicate key 'a'",
    ),
    "spec not a mapping": (spec("- a\n"), "the spec must be a YAML mapping"),
    # accepted nonsense
    ".inf learning rate": (spec("training: {lr: .inf}\n"), "training.lr: Input should be a finite number"),
    ".nan weight decay": (
        spec("training: {weight_decay: .nan}\n"),
        "training.weight_decay: Input should be a finite",
    ),
    "inf grad clip via --set": (
        sets("training.grad_clip=inf"),
        "training.grad_clip: Input should be a finite",
    ),
    "infinite aux coefficient": (
        spec("training: {aux_loss_coeff: .inf}\n"),
        "training.aux_loss_coeff: Input should",
    ),
    "lr above 10": (sets("training.lr=11"), "training.lr: Input should be less than or equal to 10"),
    "weight_decay above 10": (
        sets("training.weight_decay=1e9"),
        "training.weight_decay: Input should be less",
    ),
    "grad_clip above 1e6": (sets("training.grad_clip=1e7"), "training.grad_clip: Input should be less"),
    "aux_loss_coeff above 1e3": (
        sets("training.aux_loss_coeff=1e4"),
        "training.aux_loss_coeff: Input should be",
    ),
    "host_memory_gib above 1e6": (
        sets("hardware.host_memory_gib=1e7"),
        "hardware.host_memory_gib: Input should",
    ),
    "checkpoint.keep above 1000": (sets("checkpoint.keep=100000"), "checkpoint.keep: Input should be less"),
    "slurm.grace_seconds beyond --signal": (sets("slurm.grace_seconds=65536"), "slurm.grace_seconds: Input"),
    "max_restarts beyond int32 backoffLimit": (
        sets("kubernetes.max_restarts=9007199254740992", target="helm"),
        "kubernetes.max_restarts: Input should be less",
    ),
    "rdma_per_node above 1024": (
        sets("kubernetes.rdma_per_node=5000", target="helm"),
        "kubernetes.rdma_per_node",
    ),
    "kubernetes.grace_seconds beyond int32": (
        sets("kubernetes.grace_seconds=2147483648"),
        "kubernetes.grace_",
    ),
    "peer_dns_timeout beyond int32": (sets("kubernetes.peer_dns_timeout=2147483648"), "kubernetes.peer_dns"),
    "true as a node count": (
        spec("hardware: {nodes: true}\n"),
        "hardware.nodes: must be a number, not true/false",
    ),
    "empty runtime.python": (
        sets("runtime.python="),
        "runtime.python: is empty; leave the key out (or null) for the default",
    ),
    "non-ASCII digits in slurm.time": (sets("slurm.time=٤٨:00:00"), "slurm.time: must look like HH:MM:SS"),
    "blank runtime.python": (sets("runtime.python= "), "runtime.python: is empty"),
    "slurm.time with 99 seconds": (sets("slurm.time=0:99"), "minutes and seconds must be below 60"),
    "slurm.time of zero": (sets("slurm.time=00:00"), "must be more than 0 and at most 365 days"),
    "slurm.time of 9999 days": (sets("slurm.time=9999-00:00"), "must be more than 0 and at most 365 days"),
    "checkpoint_dir at /": (
        sets("storage.checkpoint_dir=/"),
        "storage.checkpoint_dir: / is a filesystem root",
    ),
    "output_dir equal to checkpoint_dir": (
        sets("storage.checkpoint_dir=/x", "storage.output_dir=/x/"),
        "storage.output_dir: /x is also storage.checkpoint_dir",
    ),
    "newline after a node-selector key": (
        spec('kubernetes: {node_selector: {"a\\n": b}}\n'),
        "kubernetes.node_selector: must not contain control characters",
    ),
    "newline after a node-selector value": (
        spec('kubernetes: {node_selector: {a: "b\\n"}}\n'),
        "kubernetes.node_selector: must not contain control characters",
    ),
    "U+2028 in model.path": (
        spec('model: {path: "/m\\u2028x"}\n'),
        "model.path: must not contain control characters or line separators (found U+2028",
    ),
    "NEL in storage.root": (
        spec('storage: {root: "/s\\x85x"}\n'),
        "storage.root: must not contain control characters or line separators (found U+0085",
    ),
    "C1 control in runtime.image": (
        spec('runtime: {image: "i\\x9b1m"}\n'),
        "runtime.image: must not contain control characters or line separators (found U+009B",
    ),
    "bidi override in a mount": (
        spec('runtime: {mounts: ["/a:/b\\u202e"]}\n'),
        "runtime.mounts: must not contain control characters or line separators (found U+202E",
    ),
    "newline in a --set key": (sets("training.st\neps=1"), "training.st\\neps: unknown key"),
    "nested list in --set": (sets("runtime.mounts=[[a]]"), "is not a [a, b] list"),
    "secret_env shadowing the launch contract": (
        sets("kubernetes.secret_env={DSKIT_RUN_FILE: s/k}", target="helm"),
        "kubernetes.secret_env: DSKIT_RUN_FILE is set by dskit",
    ),
    "secret_env shadowing the launcher": (
        sets("kubernetes.secret_env={MASTER_ADDR: s/a}", target="helm"),
        "kubernetes.secret_env: MASTER_ADDR is set by dskit",
    ),
    "secret_env shadowing the plan's env": (
        sets("kubernetes.secret_env={NCCL_DEBUG: s/a}", target="helm"),
        "kubernetes.secret_env: NCCL_DEBUG is set by dskit",
    ),
    "a ZeRO stage that does not exist": (
        sets("overrides.zero_stage=4"),
        "overrides.zero_stage: Input should be less than or equal to 3",
    ),
    "optimizer offload with ZeRO-2": (
        sets("overrides.zero_stage=2", "overrides.offload_optimizer=cpu"),
        "overrides.offload_optimizer: cpu is searched with ZeRO-3 only, and overrides.zero_stage is 2; "
        "one of: auto, none (or overrides.zero_stage 3)",
    ),
    "micro_batch not dividing the per-rank batch": (
        sets("training.global_batch=12", "overrides.micro_batch=4"),
        "overrides.micro_batch: 4 does not divide the per-rank batch 6 (global_batch 12 / world 2); "
        "valid: 1, 2, 3, 6",
    ),
    "sdpa_cudnn on a V100": (
        lambda d: [
            "render",
            "slurm",
            *CPU,
            "--gpu",
            "v100-32gb",
            "--set",
            "overrides.attention=sdpa_cudnn",
            "-o",
            str(d / "out"),
        ],
        "overrides.attention: sdpa_cudnn cannot run on v100-32gb (sm70): cuDNN SDPA takes MLA's 192/128 head "
        "dims only on sm90 and newer; one of: auto, sdpa, eager",
    ),
    "sdpa_cudnn on an A100": (
        lambda d: ["plan", *TINY, "--gpu", "a100-80gb", "--set", "overrides.attention=sdpa_cudnn"],
        "sdpa_cudnn cannot run on a100-80gb (sm80)",
    ),
    "flash_attention_2 on the cpu profile": (
        sets("overrides.attention=flash_attention_2"),
        "flash_attention_2 cannot run on cpu (no CUDA device): the cpu profile runs only sdpa and eager; "
        "one of: auto, sdpa, eager",
    ),
    "'$' in runtime.python for ray": (
        sets("runtime.python=/opt/$HOME/python", target="ray"),
        "runtime.python: '/opt/$HOME/python' contains '$'",
    ),
    # config.json under model.path
    "config.json is a list": (model_config([1, 2]), "must hold a JSON object, not a list"),
    "config.json with nulls": (
        model_config({**TINY_CONFIG, "hidden_size": None}),
        "model.path: hidden_size in",
    ),
    "config.json missing keys": (model_config({"model_type": "deepseek_v2"}), "model.path: vocab_size in"),
    "n_routed_experts: 0": (
        model_config({**TINY_CONFIG, "n_routed_experts": 0}),
        "model.path: n_routed_experts in",
    ),
    "config.json with NaN": (
        model_config(json.dumps({**TINY_CONFIG, "rope_theta": float("nan")}).encode()),
        "NaN or Infinity",
    ),
    "config.json not UTF-8": (
        model_config(b'{"model_type": "deepseek_v2", "x": "\xff"}'),
        "is not UTF-8 text",
    ),
    # safetensors headers and indexes under model.path: every field checked against the format
    "safetensors header is a list": (st([1, 2]), "header must be a JSON object"),
    "safetensors header only __metadata__": (st({"__metadata__": {}}), "header lists no tensors"),
    "safetensors tensor not an object": (st({"a": 5}), "tensor 'a' is not an object"),
    "safetensors tensor without dtype": (st({"a": {**T, "dtype": None}}), "tensor 'a' has no string dtype"),
    "safetensors shape not a list": (st({"a": {**T, "shape": "2"}}), "tensor 'a' has no shape"),
    "safetensors data_offsets short": (st({"a": {**T, "data_offsets": [0]}}), "has no data_offsets"),
    "safetensors data_offsets negative": (st({"a": {**T, "data_offsets": [-4, 4]}}), "has no data_offsets"),
    "safetensors data_offsets floats": (st({"a": {**T, "data_offsets": [0.0, 4.5]}}), "has no data_offsets"),
    "safetensors data_offsets NaN": (
        st(b'{"a": {"dtype": "BF16", "shape": [2], "data_offsets": [0, NaN]}}'),
        "has no data_offsets",
    ),
    "safetensors header nested deep": (st(b"[" * 100_000 + b"]" * 100_000), "nests deeper than 32"),
    "index is a list": (index(None, raw=b"[1]"), "is not a safetensors index: not a JSON object"),
    "index weight_map is a list": (index(["a"]), "weight_map must be a non-empty mapping"),
    "index weight_map value is an int": (index({"a": 5}), "weight_map must be a non-empty mapping"),
    "index weight_map empty": (index({}), "weight_map must be a non-empty mapping"),
    "index nested deep": (
        index(None, raw=b'{"weight_map":' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
        "index.json nests deeper than 32 levels",
    ),
    "index over 64 MiB": (
        index(None, raw=b'{"weight_map": {}, "x": "' + b"a" * (64 << 20) + b'"}'),
        "over the 67,108,864 a safetensors index can be",
    ),
    "index shard escapes with ..": (index({"a": "../w.safetensors"}), "only files inside"),
    "index shard is absolute": (index({"a": "/etc/passwd"}), "only files inside"),
    "config.json nested deep": (
        model_config({**TINY_CONFIG, "x": json.loads("[" * 400 + "]" * 400)}),
        "nests deeper than 32 levels",
    ),
    "config.json nested 33 deep in a dict": (
        model_config({**TINY_CONFIG, "x": json.loads("[" * 33 + "1" + "]" * 33)}),
        "nests deeper than 32 levels",
    ),
    "config.json over 1 MiB": (
        model_config({**TINY_CONFIG, "x": "a" * (1 << 20)}),
        "over the 1,048,576 a config.json can be",
    ),
    # where the output goes
    "-o under a file": (output_under_file, "is not a directory"),
    "render -o ''": (lambda d: ["render", "slurm", *CPU, "-o", ""], "--output: is empty"),
    "render -o onto a dangling link": (
        lambda d: ((d / "l").symlink_to(d / "nowhere"), ["render", "slurm", *CPU, "-o", str(d / "l")])[1],
        "is a link to nothing",
    ),
    "newline in -o": (lambda d: ["render", "slurm", *CPU, "-o", str(d / "a\nb")], "a\\nb contains U+000A"),
    "init -o into a missing dir": (
        lambda d: ["init", "-o", str(d / "missing" / "s.yaml")],
        "--output: cannot write",
    ),
    "init -o onto a FIFO": (
        lambda d: (os.mkfifo(d / "fifo"), ["init", "-o", str(d / "fifo"), "--force"])[1],
        "is not a regular file",
    ),
    "init -o onto a dangling link": (
        lambda d: ((d / "l").symlink_to(d / "nowhere"), ["init", "-o", str(d / "l"), "--force"])[1],
        "is a directory or a link",
    ),
    "init -o ''": (lambda d: ["init", "-o", ""], "--output: is empty"),
    "init -o with a 300-character name": (lambda d: ["init", "-o", "x" * 300], "File name too long"),
    "init -o onto a directory": (lambda d: ["init", "-o", str(d), "--force"], "is a directory or a link"),
    "--force onto the cwd": (force_into_cwd, "is the current directory or contains it"),
    "--force onto a parent of the cwd": (force_into_parent, "is the current directory or contains it"),
    "--force onto a file": (force_onto_file, "is not a directory; --force replaces only"),
    "--force onto a dir dskit did not write": (force_onto_foreign_dir, "was not written by dskit"),
    "--force onto a dir holding data.path": (force_onto_data_path, "an input of this command"),
    "data prepare onto its own input": (prepare_onto_input, "is not a directory; --force replaces only"),
    "export onto its own run dir": (export_onto_run, "an input of this command"),
    # data prepare inputs (without the train extra: the line names the extra instead)
    "latin-1 JSONL": (prepare_jsonl('{"text": "café"}\n'.encode("latin-1")), f"not UTF-8 text|{NO_TRAIN}"),
    "data prepare of a directory": (
        lambda d: ["data", "prepare", str(d), "-o", str(d / "shards")],
        f"is a directory; give the .txt/.jsonl/.parquet files|{NO_TRAIN}",
    ),
    "binary JSONL": (prepare_jsonl(bytes(range(256)) * 4), f"not UTF-8 text|{NO_TRAIN}"),
    # flags
    "non-integer --nodes": (lambda d: ["plan", "--nodes", "two"], "argument --nodes: invalid int value"),
    "Arabic-Indic digit in --nodes": (lambda d: ["plan", "--nodes", "\u0661"], "ASCII digits 0-9 only"),
    "underscore in --gpus-per-node": (lambda d: ["plan", "--gpus-per-node", "1_0"], "ASCII digits 0-9 only"),
    "signed --chain": (lambda d: ["plan", "--chain", "+2"], "ASCII digits 0-9 only"),
    "non-digit --nproc": (lambda d: ["train", "--local", "--nproc", " 2"], "ASCII digits 0-9 only"),
    "non-digit --shard-mib": (lambda d: ["export", "run", "-o", "x", "--shard-mib", "1e3"], "ASCII digits"),
    "unknown target": (lambda d: ["render", "k8s"], "invalid choice: 'k8s'"),
    "unknown flag": (lambda d: ["plan", "--nodez", "2"], "unrecognized arguments: --nodez"),
    # export of a checkpoint dskit did not write (without the train extra: the line names the extra)
    "export: manifest not JSON": (export_manifest(b"nope"), f"unreadable|{NO_TRAIN}"),
    "export: manifest names ../../etc/passwd": (
        export_manifest(b'{"../../etc/passwd": [1, 2]}'),
        f"not a file inside the checkpoint|{NO_TRAIN}",
    ),
    "export: manifest entry not [size, crc]": (
        export_manifest(b'{"a": "x"}'),
        f"has no [size, crc]|{NO_TRAIN}",
    ),
    "export: no world_size": (export_manifest(b"{}", done=b'{"step": 1}'), f"has no world_size|{NO_TRAIN}"),
    # names the OS refuses
    "export RUN with a 300-character name": (
        lambda d: ["export", "x" * 300, "-o", "o"],
        "File name too long",
    ),
    "train --local RUN with a 300-character name": (
        lambda d: ["train", "--local", "x" * 300],
        f"File name too long|{NO_TRAIN}",
    ),
    "data prepare --tokenizer with a 300-character name": (
        lambda d: (
            d.joinpath("a.txt").write_text("t"),
            ["data", "prepare", "a.txt", "--tokenizer", "x" * 300, "-o", "o"],
        )[1],
        f"File name too long|{NO_TRAIN}",
    ),
    "data prepare INPUT with a 300-character name": (
        lambda d: ["data", "prepare", "x" * 300, "-o", "o"],
        f"File name too long|{NO_TRAIN}",
    ),
    # dskit status (without the k8s extra: the line names the extra instead)
    "garbage kubeconfig": (kubeconfig("garbage: [\n"), f"--kubeconfig: cannot load it|{NO_K8S}"),
    "kubeconfig that is a string": (kubeconfig("just words\n"), f"--kubeconfig: cannot load it|{NO_K8S}"),
    "unreachable API server": (kubeconfig(UNREACHABLE), f"cannot reach the Kubernetes API|{NO_K8S}"),
    "status release not a Kubernetes name": (
        lambda d: ["status", "Bad_Name"],
        "RELEASE: 'Bad_Name' is not a Kubernetes",
    ),
    "status namespace not a Kubernetes name": (
        lambda d: ["status", "run", "-n", "../x"],
        "--namespace: '../x' is not a Kubernetes name",
    ),
}


def _snapshot(d: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(d)): (p.read_bytes() if p.is_file() else None) for p in sorted(d.rglob("*"))}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, monkeypatch, case):
    d = tmp_path / "w"
    d.mkdir()
    monkeypatch.chdir(d)
    setup, words = CASES[case]
    args = setup(d)
    before = _snapshot(tmp_path)
    r = cli(*args)
    lines = r.stderr.splitlines()
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert len(lines) == 1 and lines[0].startswith("dskit: error: "), r.stderr
    assert any(w in lines[0] for w in words.split("|")), lines[0]
    assert _snapshot(tmp_path) == before, "something was written"


def test_a_deleted_current_directory_is_one_line(tmp_path, monkeypatch, capsys):
    from dskit import cli

    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    assert cli.main(["plan", "--set", "storage.root=rel"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("dskit: error: current directory (deleted")


@pytest.mark.parametrize("body", [b"not json", b'{"items": 5}', b'{"items": [{"status": 7}]}'])
def test_status_against_a_server_answering_garbage_is_one_line(tmp_path, body):
    pytest.importorskip("kubernetes")
    import http.server
    import threading

    class Garbage(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Garbage)
    # shutdown() waits for the loop's next poll: 0.05 s, not the default half-second
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        kc = tmp_path / "kc"
        kc.write_text(UNREACHABLE.replace("https://127.0.0.1:1", f"http://127.0.0.1:{server.server_port}"))
        r = cli("status", "run", "--kubeconfig", str(kc))
    finally:
        server.shutdown()
    lines = r.stderr.splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-2000:]
    assert lines[0].startswith("dskit: error: ") and r.stdout == "", (lines, r.stdout)


def test_a_jsonl_with_a_byte_order_mark_is_read(tmp_path):
    pytest.importorskip("numpy")
    from dskit.data.readers import records

    f = tmp_path / "a.jsonl"
    f.write_bytes(b'\xef\xbb\xbf{"text": "hello"}\n')
    t = tmp_path / "b.txt"
    t.write_bytes(b"\xef\xbb\xbfhi")
    assert list(records([str(f), str(t)])) == ["hello", "hi"]


def test_shards_linked_into_a_cache_are_accepted(tmp_path):
    # the Hugging Face cache layout: snapshots/REV/*.safetensors are links to ../../blobs/HASH
    from dskit.formats.hf_checkpoint import check_checkpoint

    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "rev"
    blobs.mkdir()
    snap.mkdir(parents=True)
    (blobs / "h1").write_bytes(safetensors({"a": T}))
    (snap / "w.safetensors").symlink_to("../../blobs/h1")
    (snap / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "w.safetensors"}}))
    assert check_checkpoint(str(snap)) == {"a": ("BF16", [2])}


def test_a_failing_ds_to_universal_is_one_line_pointing_at_its_log(tmp_path, monkeypatch, capsys):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import subprocess
    import zlib

    from dskit.cli import main
    from dskit.train import export

    run, ck = tmp_path / "run", tmp_path / "ck"
    cli("render", "slurm", *CPU, "--set", f"storage.checkpoint_dir={ck}", "-o", str(run), check=True)
    tag = ck / "step00000001"
    tag.mkdir(parents=True)
    (tag / "f.pt").write_bytes(b"x")
    (tag / "dskit-manifest-rank0.json").write_text(json.dumps({"f.pt": [1, zlib.crc32(b"x")]}))
    (tag / "dskit.json").write_text('{"step": 1, "world_size": 1}')

    def failing(args, **kw):
        return subprocess.CompletedProcess(args, 3, stdout="boom\n", stderr="Traceback: deep inside\n")

    monkeypatch.setattr(export.subprocess, "run", failing)
    assert main(["export", str(run), "-o", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "ds_to_universal failed" in err[0] and "(exit 3)" in err[0], err
    log = Path(err[0].rsplit(" ", 1)[1])
    try:
        assert "Traceback: deep inside" in log.read_text()
    finally:
        log.unlink()
    assert not (tmp_path / "hf").exists()


def _dskit_to(stdout: int | str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """The real CLI with stdout on a given descriptor (or opened from a path)."""
    out = os.open(stdout, os.O_WRONLY) if isinstance(stdout, str) else stdout
    try:
        return subprocess.run(
            [sys.executable, "-m", "dskit", *args], stdout=out, stderr=subprocess.PIPE, text=True, cwd=cwd
        )
    finally:
        os.close(out)


NEEDS_DEV_FULL = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")


@NEEDS_DEV_FULL
@pytest.mark.parametrize(
    "args",
    [["plan"], ["plan", "--explain"], ["--help"], ["render", "--help"], ["init", "-o", "-"], ["--version"]],
    ids=" ".join,
)
def test_stdout_on_a_full_disk_is_one_line_and_exit_74(tmp_path, args):
    """`dskit plan > /dev/full` ended in a traceback (an OSError out of print)."""
    r = _dskit_to("/dev/full", *args, cwd=tmp_path)
    assert (r.returncode, r.stderr) == (74, "dskit: error: cannot write to stdout: No space left on device\n")


@NEEDS_DEV_FULL
def test_a_render_whose_stdout_fails_still_wrote_its_run_dir_whole(tmp_path):
    r = _dskit_to("/dev/full", "render", "slurm", *CPU, "-o", str(tmp_path / "out"), cwd=tmp_path)
    assert r.returncode == 74 and r.stderr.count("\n") == 1
    assert (tmp_path / "out" / "run.yaml").is_file()  # the summary line is what was lost, not the output


def test_stdout_into_a_closed_pipe_exits_141_quietly(tmp_path):
    """`dskit plan | head -c1`: the reader left; like `cat` killed by SIGPIPE, exit 141, nothing said."""
    read, write = os.pipe()
    os.close(read)  # before dskit writes: its first write gets EPIPE
    r = _dskit_to(write, "plan", cwd=tmp_path)
    assert (r.returncode, r.stderr) == (141, "")


def test_a_closed_stdout_is_one_line(tmp_path):
    """`dskit plan >&-`: Python starts with sys.stdout None, and print() would drop the plan silently."""
    r = subprocess.run(
        ["bash", "-c", 'exec "$0" -m dskit plan >&-', sys.executable],
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    assert (r.returncode, r.stderr) == (74, "dskit: error: cannot write to stdout: Bad file descriptor\n")
