"""Trainer ranks forked from a preloaded interpreter: the suite's local trainings start their ranks
without importing torch, DeepSpeed and transformers again (a pytest plugin fixture, tests/conftest.py).

Why: on CI's two cores the suite is bound by CPU, and most of a short CPU training's CPU is its ranks'
imports (about 6 s of each rank's start: torch, DeepSpeed, transformers' model code and what they pull
in), paid by every rank of every `dskit train --local` the tests run.

How: torchrun starts each worker as `$PYTHON_EXEC -u -m dskit.train` (torch.distributed.run's documented
override). The session points PYTHON_EXEC at a shim (`python` in the session's directory), which asks a
**zygote** over a Unix socket to fork the rank: the zygote imported the libraries once (under the environment the
session gives a CPU plan's ranks), and its fork gets the shim's stdin/stdout/stderr, working directory,
environment and arguments, then runs `dskit.train` as `python -m` would. The shim stays what torchrun
sees: it relays every signal torchrun or a test sends it to the rank, and leaves with the rank's exit
status (killed by a signal where the rank was), so torchrun's teardown, exit codes and watchdog paths
are the same; if the shim is killed outright, the zygote kills the rank.

What is not the same, and how the suite keeps it honest:
- The rank starts cold (the shim execs the real interpreter) wherever a fork could differ from a fresh
  process: an environment that differs from the zygote's in anything but the variables read at run time
  (DSKIT_*, torchrun's, the trackers'; `VOLATILE`), other interpreter flags, or another Linux namespace
  (the Slurm nodes and pod hosts are network namespaces: their ranks always start cold). A test that
  puts its own sitecustomize on PYTHONPATH gets cold ranks that run it.
- Two zygotes, one for even and one for odd local ranks, each with its own hash seed: a rank pair never
  shares string hashing, as two fresh processes do not.
- The real rank's pid is not the shim's: `rank_pid(shim_pid)` maps one to the other for tests that signal
  a rank directly (a SIGSTOP cannot be relayed).
Every cold start and its reason is appended to the session directory's `cold.log`.
"""

from __future__ import annotations

import array
import contextlib
import io
import json
import os
import re
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

#: what a rank imports that takes its time: loaded once per zygote, before its first fork
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.elastic.multiprocessing.errors",
    "deepspeed",
    "transformers",
    "transformers.modeling_utils",
    "transformers.models.deepseek_v2.modeling_deepseek_v2",
    "transformers.models.deepseek_v3.modeling_deepseek_v3",
    "safetensors.torch",
    "yaml",
    "pydantic",
)
#: variables the preloaded libraries read when they are used, not when they are imported: a rank whose
#: environment differs from the zygote's only in these is forked; any other difference starts it cold
VOLATILE = re.compile(
    r"DSKIT_.*|RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|GROUP_RANK|GROUP_WORLD_SIZE|ROLE_.*|"
    r"MASTER_ADDR|MASTER_PORT|TORCHELASTIC_.*|TORCH_NCCL_.*|NCCL_.*|PYTEST_.*|MLFLOW_.*|WANDB_.*|"
    r"OTEL_.*|PYTHON_EXEC|_TORCHINDUCTOR_.*|_|OLDPWD|PWD|SHLVL"
)
NAMESPACES = ("net", "mnt", "pid", "ipc", "uts", "user", "cgroup")
MODULE = "dskit.train"


def _frame(sock: socket.socket, obj: dict) -> None:
    data = json.dumps(obj).encode()
    sock.sendall(struct.pack("!I", len(data)) + data)


# ------------------------------------------------------------------------------------------- the shim

SHIM = r"""#!{python} -IS
# torchrun's PYTHON_EXEC for the test session: tests/support/warm_ranks.py says what and why.
import array, json, os, signal, socket, struct, sys
REAL, SESSION = {python!r}, {session!r}

def started(pid):
    with open(f"/proc/{{pid}}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[19]

def cold(reason):
    with open(os.path.join(SESSION, "cold.log"), "a") as f:
        f.write(json.dumps({{"pid": os.getpid(), "argv": sys.argv[1:], "reason": reason}}) + "\n")
    os.execv(REAL, [REAL, *sys.argv[1:]])

args = sys.argv[1:]
if args[:3] != ["-u", "-m", {module!r}]:
    os.execv(REAL, [REAL, *args])
rank = int(os.environ.get("LOCAL_RANK", "0"))
path = os.path.join(SESSION, f"zygote{{rank % 2}}.sock")
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    sock.connect(path)
except OSError as e:
    cold(f"no zygote at {{path}}: {{e}}")
req = json.dumps({{"args": args[3:], "env": dict(os.environ), "cwd": os.getcwd()}}).encode()
sock.sendmsg([struct.pack("!I", len(req)) + req], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0, 1, 2]))])

def frame():
    buf = b""
    while len(buf) < 4:
        c = sock.recv(4 - len(buf))
        if not c:
            return None
        buf += c
    n = struct.unpack("!I", buf)[0]
    body = b""
    while len(body) < n:
        c = sock.recv(n - len(body))
        if not c:
            return None
        body += c
    return json.loads(body)

reply = frame()
if reply is None or "cold" in reply:
    sock.close()
    cold(reply["cold"] if reply else "the zygote hung up")
child = reply["pid"]
with open(os.path.join(SESSION, f"shim-{{os.getpid()}}"), "w") as f:  # pids are reused: the start time tells
    f.write(f"{{child}} {{started(os.getpid())}}")

def relay(sig, _frame):
    try:
        os.kill(child, sig)
    except ProcessLookupError:
        pass

for s in signal.valid_signals():
    if s not in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD, signal.SIGWINCH):
        try:
            signal.signal(s, relay)
        except (OSError, ValueError):
            pass
done = frame()
if done is None:  # the zygote is gone: the rank must not outlive what torchrun sees
    try:
        os.kill(child, signal.SIGKILL)
    except ProcessLookupError:
        pass
    sys.stderr.write("warm rank: the zygote hung up\n")
    os._exit(1)
code = done["exit"]
if code < 0:
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
os._exit(code & 0xFF)
"""


def rank_pid(shim_pid: int, session: Path | None = None) -> int:
    """The trainer rank behind a shim process (the pid itself where the rank started cold)."""
    session = session or _session()
    if session is None:
        return shim_pid
    try:
        argv = Path(f"/proc/{shim_pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return shim_pid
    if str(session / "python").encode() not in argv:
        return shim_pid  # started cold: the shim exec'd the interpreter, the rank is this process
    f = session / f"shim-{shim_pid}"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with contextlib.suppress(FileNotFoundError, ValueError):
            child, started = f.read_text().split()
            if started == _started(shim_pid):  # not an earlier shim's of the same pid
                return int(child)
        time.sleep(0.05)
    return shim_pid  # exec'd cold since


def _started(pid: int) -> str:
    """A process's start time (clock ticks since boot): with its pid, which process it is."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except OSError:
        return ""


def _session() -> Path | None:
    exe = os.environ.get("PYTHON_EXEC")
    return (
        Path(exe).parent
        if exe and Path(exe).name == "python" and (Path(exe).parent / "zygote0.sock").exists()
        else None
    )


# ----------------------------------------------------------------------------------------- the zygote


class Zygote:
    """Forks ranks from one preloaded interpreter, imported under `base` (a rank's environment)."""

    def __init__(self, path: Path, base: dict[str, str]):
        self.path = path
        self.base = base
        self.children: dict[int, socket.socket] = {}
        self.cpu_s = 0.0
        self.set_by_imports: dict[str, str] = {}
        self.sel = selectors.DefaultSelector()
        self.own_ns = {ns: os.readlink(f"/proc/self/ns/{ns}") for ns in NAMESPACES}

    def serve(self) -> None:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(self.path))
        listener.listen(64)
        self.listener = listener
        os.environ.clear()
        os.environ.update(self.base)
        for module in PRELOAD:  # requests wait in the backlog meanwhile
            __import__(module)
        # py-cpuinfo's answer, which a rank asks once (dskit/host/jit_ops.py `cpu_info_once`): the same
        # machine's CPU, an interpreter's start less per rank
        from dskit.host.jit_ops import cpu_info_once

        cpu_info_once()
        __import__("cpuinfo").get_cpu_info()
        self.path.with_suffix(".ready").touch()  # Session.wait_ready
        # what the imports set themselves (DeepSpeed: PYTORCH_NVML_BASED_CUDA_CHECK, with setdefault): a
        # rank without it is a rank that has not imported yet, and gets it as a cold one would
        self.set_by_imports = {k: v for k, v in os.environ.items() if k not in self.base}
        r, w = os.pipe()
        os.set_blocking(w, False)
        signal.set_wakeup_fd(w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.wakeup = r
        self.sel.register(listener, selectors.EVENT_READ, "accept")
        self.sel.register(r, selectors.EVENT_READ, "reap")
        while True:
            for key, _ in self.sel.select():
                try:
                    if key.data == "accept":
                        self._request(listener.accept()[0])
                    elif key.data == "reap":
                        os.read(r, 4096)
                        self._reap()
                    else:  # a shim's connection closed before its rank ended: the shim was killed
                        self._hung_up(key.data, key.fileobj)
                except Exception:  # noqa: BLE001 (one shim's trouble, a kill mid-handshake: not the zygote's end)
                    import traceback

                    traceback.print_exc()

    def _request(self, conn: socket.socket) -> None:
        try:
            msg, fds = _recv_request(conn)
        except (OSError, ValueError, struct.error):  # the shim went away mid-request: it exec'd nothing
            conn.close()
            raise
        try:
            why = self._why_cold(conn, msg)
            if why:
                _frame(conn, {"cold": why})
                conn.close()
                return
            pid = os.fork()
            if pid == 0:
                self._become_rank(conn, msg, fds)
            self.children[pid] = conn
            self.sel.register(conn, selectors.EVENT_READ, pid)
            _frame(conn, {"pid": pid})
        finally:
            for fd in fds:
                os.close(fd)

    def _why_cold(self, conn: socket.socket, msg: dict) -> str | None:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        peer = struct.unpack("3i", creds)[0]
        for ns, own in self.own_ns.items():
            try:
                theirs = os.readlink(f"/proc/{peer}/ns/{ns}")
            except OSError as e:
                return f"cannot read the shim's {ns} namespace: {e}"
            if theirs != own:
                return f"another {ns} namespace ({theirs}, the zygote's {own})"
        env = msg["env"]
        imported = self.set_by_imports
        differ = sorted(
            k
            for k in set(env) | set(self.base)
            if env.get(k) != self.base.get(k) and not (k in imported and env.get(k) in (None, imported[k]))
        )
        fixed = [k for k in differ if not VOLATILE.fullmatch(k)]
        if fixed:
            return f"environment differs from the zygote's in {', '.join(fixed)}"
        if threads := _other_threads():
            return f"the zygote runs threads a fork would lose: {', '.join(threads)}"
        return None

    def _become_rank(self, conn: socket.socket, msg: dict, fds: list[int]) -> None:
        code = 1
        try:
            os.setsid()
            signal.set_wakeup_fd(-1)
            for s in (signal.SIGCHLD, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
                signal.signal(s, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
            keep = {0, 1, 2}
            for fd in [
                *fds,
                self.wakeup,
                self.listener.fileno(),
                conn.fileno(),
                *(c.fileno() for c in self.children.values()),
            ]:
                if fd not in keep:
                    with contextlib.suppress(OSError):
                        os.close(fd)
            os.chdir(msg["cwd"])
            os.environ.clear()
            os.environ.update({**self.set_by_imports, **msg["env"]})
            sys.path[0] = msg["cwd"]
            # python -u: unbuffered binary layer, text written through
            sys.stdout = _unbuffered(1, sys.stdout)
            sys.stderr = _unbuffered(2, sys.stderr)
            sys.stdin = open(0, closefd=False, encoding=sys.stdin.encoding)  # noqa: SIM115
            sys.argv = ["-m", *msg["args"]]
            # a fresh process draws numpy's legacy global state from the OS (Python's random reseeds
            # itself at fork; torch seeds its default generator with a constant either way)
            if (np := sys.modules.get("numpy")) is not None:
                np.random.seed()
            import runpy

            try:
                runpy._run_module_as_main(MODULE)  # noqa: SLF001 (what `python -m` calls)
                code = 0
            except SystemExit as e:
                code = _exit_code(e.code)
        except BaseException:  # noqa: BLE001 (what the interpreter does with an uncaught exception)
            import traceback

            traceback.print_exc()
            code = 1
        finally:
            import atexit
            import threading

            with contextlib.suppress(BaseException):
                threading._shutdown()  # noqa: SLF001
                atexit._run_exitfuncs()  # noqa: SLF001
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)

    def _reap(self) -> None:
        while True:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            # the ranks' CPU, which no test process can wait for: the suite's cost record adds it
            self.cpu_s += usage.ru_utime + usage.ru_stime
            tmp = self.path.with_suffix(".cpu.tmp")
            tmp.write_text(f"{self.cpu_s:.2f}")
            os.replace(tmp, self.path.with_suffix(".cpu"))
            conn = self.children.pop(pid, None)
            if conn is not None:
                self.sel.unregister(conn)
                with contextlib.suppress(OSError):
                    _frame(conn, {"exit": os.waitstatus_to_exitcode(status)})
                conn.close()

    def _hung_up(self, pid: int, conn: socket.socket) -> None:
        try:
            data = conn.recv(1)
        except OSError:
            data = b""
        if data:
            return
        self.sel.unregister(conn)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


#: threads a fork may drop: jemalloc (pyarrow's allocator, imported under DeepSpeed) restarts its
#: background thread in the child (its own fork handlers)
FORK_SAFE_THREADS = {"jemalloc_bg_thd"}


def _other_threads() -> list[str]:
    me = str(threading.get_native_id())
    names = []
    for tid in os.listdir("/proc/self/task"):
        if tid != me:
            with contextlib.suppress(OSError):
                names.append(Path(f"/proc/self/task/{tid}/comm").read_text().strip())
    return [n for n in names if n not in FORK_SAFE_THREADS]


def _recv_request(conn: socket.socket) -> tuple[dict, list[int]]:
    fds = array.array("i")
    data, anc, _, _ = conn.recvmsg(1 << 20, socket.CMSG_LEN(3 * fds.itemsize))
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - (len(payload) % fds.itemsize)])
    n = struct.unpack("!I", data[:4])[0]
    body = data[4:]
    while len(body) < n:
        more = conn.recv(n - len(body))
        if not more:
            break
        body += more
    return json.loads(body), list(fds)


def _unbuffered(fd: int, like) -> io.TextIOWrapper:
    """What `python -u` makes of fd: text written through to an unbuffered file."""
    return io.TextIOWrapper(
        io.FileIO(fd, "w", closefd=False), encoding=like.encoding, errors=like.errors, write_through=True
    )


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    sys.stderr.write(f"{code}\n")
    return 1


# ------------------------------------------------------------------------------------ the session side


class Session:
    """The shim and two zygotes under `root`; `env()` is what the suite's processes inherit."""

    def __init__(self, root: Path):
        self.root = root
        self.procs: list[subprocess.Popen] = []

    def start(self, base: dict[str, str]) -> None:
        """Start the zygotes with `base` as their environment (a rank's, minus VOLATILE's variables)."""
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "base-env.json").write_text(json.dumps(base))
        shim = self.root / "python"
        shim.write_text(SHIM.format(python=sys.executable, session=str(self.root), module=MODULE))
        shim.chmod(0o755)
        log = (self.root / "zygotes.log").open("ab")
        for i in (0, 1):
            sock = self.root / f"zygote{i}.sock"
            with contextlib.suppress(FileNotFoundError):
                sock.unlink()
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, __file__, str(sock), str(self.root / "base-env.json")],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        deadline = time.monotonic() + 60
        while not all((self.root / f"zygote{i}.sock").exists() for i in (0, 1)):
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                raise RuntimeError(f"the rank zygotes did not start under {self.root}")
            time.sleep(0.05)

    def wait_ready(self, timeout_s: float = 900) -> bool:
        """Whether both zygotes finished their imports within `timeout_s` (False: one ended first, whose
        ranks then start cold, or the time ran out, and requests keep waiting in the backlog)."""
        deadline = time.monotonic() + timeout_s
        while not all((self.root / f"zygote{i}.ready").exists() for i in (0, 1)):
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                return False
            time.sleep(0.2)
        return True

    @property
    def shim(self) -> Path:
        return self.root / "python"

    def stop(self) -> None:
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()

    def summary(self) -> dict:
        """Ranks forked and their CPU seconds, and the cold starts by reason (namespaces' ids left out)."""
        log = self.root / "cold.log"
        cold: dict[str, int] = {}
        for line in log.read_text().splitlines() if log.exists() else []:
            reason = re.sub(r" \(.*\)$", "", json.loads(line)["reason"])
            cold[reason] = cold.get(reason, 0) + 1
        return {
            # a zygote that ended early sent every later rank of its parity cold (zygotes.log says why)
            "zygotes_ended": [p.returncode for p in self.procs if p.poll() is not None],
            "forked": len(list(self.root.glob("shim-*"))),
            "forked_cpu_s": round(forked_cpu_s(self.root), 1),
            "cold": dict(sorted(cold.items(), key=lambda kv: -kv[1])),
        }


def forked_cpu_s(root: Path | None = None) -> float:
    """CPU seconds of the ranks this session's zygotes forked and reaped so far (0 without a session)."""
    root = root or _session()
    if root is None:
        return 0.0
    total = 0.0
    for f in root.glob("zygote*.cpu"):
        with contextlib.suppress(OSError, ValueError):
            total += float(f.read_text())
    return total


if __name__ == "__main__":
    Zygote(Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())).serve()
