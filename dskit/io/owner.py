"""Whether the dskit process building a directory still runs, so its leftover may be removed.

The builder creates the directory's MARKER, takes an exclusive flock() on it, then writes who it is,
and holds the lock until the directory is published or removed. The kernel drops a dead process's
locks, SIGKILL included, so where the marker names this kernel (its boot id is ours) a free lock says
the builder is gone, whatever its pid namespace or host name (a container) and however its pid has
been reused since. A pid alone says neither: another container's pid 7 is not ours, and ours may
belong to a new process by now.

A lock taken on another kernel is not seen here (another machine; NFS without locking), so a marker
of another boot is judged only when it is this installation's (same machine and host name) from
before a reboot, when every process of that boot is gone. Any other marker, or none, is kept: not
provably a dead dskit build. Markers of dskit before boot ids keep that version's rule: this host
name, and no process with the pid.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import socket
from pathlib import Path
from typing import Any

BOOT_ID = "/proc/sys/kernel/random/boot_id"  # Linux: a random id per boot
MACHINE_ID = "/etc/machine-id"


def _first_line(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.readline().strip() or None
    except OSError:
        return None


def identity() -> dict[str, Any]:
    """Who this process is, as a marker records it."""
    machine = _first_line(MACHINE_ID)
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "boot_id": _first_line(BOOT_ID),
        # machine-id(5) asks for it to be kept private: an app-specific hash stands in for it
        "machine": hashlib.sha256(f"dskit:{machine}".encode()).hexdigest()[:32] if machine else None,
    }


def hold(path: Path, text: str) -> int:
    """Create `path`, lock it, write `text`: the lock lasts while the returned descriptor is open.

    Locked before written: a marker with content always had its lock, so a reader that finds it free
    and filled knows the writer let go (an empty one may be a builder between open and flock)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
    try:
        with contextlib.suppress(OSError):  # a filesystem without locks: the build still runs
            fcntl.flock(fd, fcntl.LOCK_EX)
        data = text.encode()
        written = 0
        while written < len(data):
            written += os.write(fd, data[written:])
    except BaseException:
        os.close(fd)
        raise
    return fd


def gone(marker: Path) -> bool:
    """Whether the process that wrote `marker` (a build directory's MARKER) is provably gone."""
    try:  # read-write: where flock is emulated with POSIX locks, an exclusive one needs it
        fd = os.open(marker, os.O_RDWR | os.O_NOFOLLOW)
    except OSError:  # none yet, a link, or not ours to write: keep
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            free: bool | None = True
        except BlockingIOError:
            return False  # its builder holds it
        except OSError:
            free = None  # no locks on this filesystem: the lock says nothing
        info = json.loads(os.pread(fd, 1 << 16, 0))  # read once locked: see hold()
    except ValueError:  # empty (a builder between open and flock) or not JSON: keep
        return False
    finally:
        os.close(fd)
    return isinstance(info, dict) and _judge(info, free, identity())


def _judge(info: dict, free: bool | None, me: dict[str, Any]) -> bool:
    boot = info.get("boot_id")
    if boot is not None and boot == me["boot_id"] and free is not None:
        return free  # this kernel's lock: authoritative
    if boot is not None and me["boot_id"] is not None and boot != me["boot_id"]:
        # another kernel: this installation before a reboot (all its processes gone), else not ours
        mine = info.get("machine") == me["machine"] and info.get("host") == me["host"]
        return me["machine"] is not None and mine
    return info.get("host") == me["host"] and _pid_gone(info.get("pid"))  # no boot id or no locks: pid rule


def _pid_gone(pid: object) -> bool:
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OverflowError:  # beyond any pid_t: no process has it
        return True
    except OSError:  # EPERM: it runs, as another user
        return False
    return False
