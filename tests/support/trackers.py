"""The experiment trackers' real back ends for tests: a `mlflow server` on loopback, and a reader for the
run file W&B writes in offline mode (OUTPUT_DIR/wandb/offline-run-*/run-ID.wandb).

wandb 0.31 has no Python reader of its own for that file (its Go core writes and syncs it), so the
reader here follows the format's definition: a 7-byte header (b":W&B", magic 0xBEE1, version 0), then
32 KiB blocks of chunks, each a 7-byte header (CRC-32 of the type byte and the data, length, type:
1 full, 2 first, 3 middle, 4 last) and its data; a block's tail shorter than a header is padding. Each
whole record is a `wandb.proto.wandb_internal_pb2.Record`, parsed with wandb's own protobuf classes.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.request
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BLOCK, CHUNK_HEADER = 32768, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
STALL_S = 60  # the server start fails after this long without new log output (a hang, not a slow start)
#: the libraries' own reports home (MLflow's usage telemetry, W&B's error reports) stay off in tests:
#: no traffic leaves the machine
NO_TELEMETRY = {"MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true", "WANDB_ERROR_REPORTING": "false"}
#: the history key holding the trainer's step (W&B's own `_step` only counts log calls)
WANDB_STEP = "trainer/step"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    """`mlflow server` on 127.0.0.1 with a SQLite store under `d`, in its own process group (it starts
    workers) so stop() ends exactly what start() began."""

    def __init__(self, d: Path):
        self.d, self.port = d, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = d / "server.log"
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}, **NO_TELEMETRY}
        cmd = [
            sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port),
            "--backend-store-uri", f"sqlite:///{d / 'mlflow.db'}", "--default-artifact-root", str(d / "artifacts"),
            "--workers", "1",
        ]  # fmt: skip
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.started_s = self._wait_ready()

    def _wait_ready(self) -> float:
        """Poll /health while the server makes progress (its log grows); seconds it took."""
        start = last_change = time.monotonic()
        seen = -1
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - start
            except OSError:
                pass
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(
                    f"mlflow server exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}"
                )
            size = self.log.stat().st_size
            if size != seen:
                seen, last_change = size, time.monotonic()
            if time.monotonic() - last_change > STALL_S:
                self.stop()
                raise TimeoutError(
                    f"mlflow server: no new output for {STALL_S} s\n{self.log.read_text()[-3000:]}"
                )
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def wandb_records(path: Path) -> Iterator[Any]:
    """Every record of a W&B run file, in order (CRC-checked)."""
    from wandb.proto import wandb_internal_pb2

    raw = path.read_bytes()
    assert struct.unpack("<4sHB", raw[:7]) == (b":W&B", 0xBEE1, 0), "not a W&B run file"
    pos, parts = 7, b""
    while pos + CHUNK_HEADER <= len(raw):
        left = BLOCK - pos % BLOCK
        if left < CHUNK_HEADER:
            pos += left
            continue
        crc, n, kind = struct.unpack("<IHB", raw[pos : pos + CHUNK_HEADER])
        if (crc, n, kind) == (0, 0, 0):  # the unwritten rest of a block
            pos += left
            continue
        if pos + CHUNK_HEADER + n > len(raw):  # the chunk being written: the file ends here for now
            return
        data = raw[pos + CHUNK_HEADER : pos + CHUNK_HEADER + n]
        pos += CHUNK_HEADER + n
        assert zlib.crc32(data, zlib.crc32(bytes([kind]))) == crc, f"{path}: bad chunk at {pos}"
        parts = data if kind in (FULL, FIRST) else parts + data
        if kind in (FULL, LAST):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(parts)
            yield rec


def wandb_run(output_dir: Path) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
    """The offline run under OUTPUT_DIR/wandb, every process's file of it in order (a resumed run
    writes one more): (its config, {trainer step: {key: value}}, the rows of one step merged, later
    ones winning), a histogram's parts under KEY/values, KEY/bins."""
    files = sorted((output_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert files, f"no W&B offline run under {output_dir}"
    # wandb-core (its own process) may still be writing the last file when run.finish() has returned:
    # read it once its exit record is there, waiting while the file still grows
    size, still = -1, time.monotonic()
    while not any(r.WhichOneof("record_type") == "exit" for r in wandb_records(files[-1])):
        now = files[-1].stat().st_size
        if now != size:
            size, still = now, time.monotonic()
        assert time.monotonic() - still < 30, f"{files[-1]}: no exit record, and it stopped growing"
        time.sleep(0.2)
    config: dict[str, Any] = {}
    history: dict[int, dict[str, Any]] = {}
    for rec in (r for f in files for r in wandb_records(f)):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            config.update({i.key: json.loads(i.value_json) for i in rec.run.config.update})
        elif kind == "config":
            config.update({i.key: json.loads(i.value_json) for i in rec.config.update})
        elif kind == "history":
            row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
            history.setdefault(int(row[WANDB_STEP]), {}).update(row)
    return config, history
