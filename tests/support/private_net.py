"""A private network on this machine for multi-host tests: a bridge with a /24 that exists only here and
one network namespace per host, each with a veth named eth0. Shared by the Slurm cluster and the
Kubernetes pod harness. `down()` removes everything `up()` made, also after a failed `up()`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path


def sh(*cmd: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), check=check, capture_output=True, text=True, **kw)


class PrivateNet:
    def __init__(self, prefix: str, net: str, hosts: int = 2):
        self.prefix, self.net, self.hosts = prefix, net, hosts
        self.bridge = f"{prefix}br0"

    def netns(self, i: int) -> str:
        """Host i (1-based)'s namespace name; its path is /run/netns/NAME."""
        return f"{self.prefix}-n{i}"

    def addr(self, i: int) -> str:
        return f"{self.net}.{10 + i}"

    @property
    def gateway(self) -> str:
        return f"{self.net}.1"

    def enter(self, i: int) -> list[str]:
        """Command prefix that runs a program on host i. nsenter (not `ip netns exec`, which remounts
        /sys and hides /sys/fs/cgroup from daemons such as slurmd)."""
        return ["nsenter", f"--net=/run/netns/{self.netns(i)}"]

    def up(self) -> None:
        self.down()
        try:
            sh("ip", "link", "add", self.bridge, "type", "bridge")
            sh("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            sh("ip", "link", "set", self.bridge, "up")
            self._allow_forwarding(True)
            for i in range(1, self.hosts + 1):
                ns, veth = self.netns(i), f"{self.prefix}v{i}"
                sh("ip", "netns", "add", ns)
                sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
                sh("ip", "link", "set", veth, "master", self.bridge, "up")
                sh("ip", "-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
                sh("ip", "-n", ns, "link", "set", "eth0", "up")
                sh("ip", "-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.down()
            raise

    def veth(self, i: int) -> str:
        """Host i's veth on the bridge side (its peer in the namespace is eth0)."""
        return f"{self.prefix}v{i}"

    @contextlib.contextmanager
    def shaped(self, rate: str, *, burst: str = "64kb", latency: str = "50ms") -> Iterator[list[str]]:
        """Every host's traffic from the bridge limited to `rate` (a tc token bucket on the bridge side of
        each veth, so what enters each host is shaped, in each direction between two hosts) for the
        `with` block; the qdiscs are removed on leaving it, whatever happened inside."""
        devs = [self.veth(i) for i in range(1, self.hosts + 1)]
        try:
            tbf = ["tbf", "rate", rate, "burst", burst, "latency", latency]
            for d in devs:
                sh("tc", "qdisc", "add", "dev", d, "root", *tbf)
            yield devs
        finally:
            for d in devs:
                sh("tc", "qdisc", "del", "dev", d, "root", check=False)

    def pids(self, i: int) -> list[int]:
        if not Path(f"/run/netns/{self.netns(i)}").exists():
            return []
        r = sh("ip", "netns", "pids", self.netns(i), check=False)
        return [int(p) for p in r.stdout.split()]

    def down(self, extra_pids: list[int] = ()) -> None:
        """Stop every process living in the namespaces (and `extra_pids`), then remove links and
        namespaces."""
        victims = [p for i in range(1, self.hosts + 1) for p in self.pids(i)] + list(extra_pids)
        stop_pids(victims)
        for i in range(1, self.hosts + 1):
            sh("ip", "link", "del", f"{self.prefix}v{i}", check=False)
            sh("ip", "netns", "del", self.netns(i), check=False)
        sh("ip", "link", "del", self.bridge, check=False)
        self._allow_forwarding(False)

    def _allow_forwarding(self, on: bool) -> None:
        """Let frames between the hosts cross the bridge whatever the FORWARD policy: docker's daemon
        sets it to DROP and loads br_netfilter, which sends bridged frames through iptables, and the
        hosts could then no longer reach each other (srun: "Communication connection failure")."""
        if shutil.which("iptables") is None:
            return
        rule = ["FORWARD", "-i", self.bridge, "-o", self.bridge, "-j", "ACCEPT"]
        if on:
            sh("iptables", "-w", "-I", *rule, check=False)
        else:
            while sh("iptables", "-w", "-D", *rule, check=False).returncode == 0:
                pass


def stop_pids(pids: list[int], grace: float = 10) -> None:
    """SIGTERM, then SIGKILL what is still alive after `grace` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + grace
        while time.time() < deadline and any(alive(p) for p in pids):
            time.sleep(0.2)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie still answers kill(0)
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False
