"""A real 2-node Slurm cluster on this machine, for the tests (Debian slurm-wlm + munge).

Topology: a bridge with a private /24 that exists only inside this machine; one network namespace per
node with a veth called eth0; slurmctld in the root namespace. Facts this relies on (verified with
Slurm 22.05, see shared/reference/slurm-2node.md):
- slurmd always starts its cgroup plugin and `ip netns exec` hides /sys/fs/cgroup, so nodes are
  entered with `nsenter --net=`;
- each daemon runs under `unshare --uts` with its node's hostname (slurmctld insists on matching
  SlurmctldHost; job steps inherit the node's name, which torchrun's rendezvous uses);
- /etc/hosts maps the names (rewritten in place: it may be a bind mount), and is restored on `down`.

`down()` always leaves the machine as it was, also after a failed `up()`: processes are stopped by the
namespaces they live in, then links, namespaces and the hosts block are removed.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import time
from pathlib import Path

from tests.support.private_net import PrivateNet, sh

HOSTS_BEGIN, HOSTS_END = "# BEGIN dskit-test-slurm", "# END dskit-test-slurm"
PACKAGES = ("slurmctld", "slurmd", "munged", "sbatch", "nsenter", "unshare", "ip")


def missing_tools() -> list[str]:
    return [t for t in PACKAGES if shutil.which(t) is None and not Path(f"/usr/sbin/{t}").exists()]


_sh = sh


class SlurmCluster:
    def __init__(self, base: Path, *, net: str = "192.168.213", cpus: int = 2, prefix: str = "dsk"):
        self.base = Path(base)
        self.net, self.cpus, self.prefix = net, cpus, prefix
        self.nodes = ["node1", "node2"]
        self.ctl = f"{prefix}-ctl"
        self.net_ = PrivateNet(prefix, net, hosts=2)
        self.conf = self.base / "etc" / "slurm.conf"
        self.our_munged: int | None = None

    # ------------------------------------------------------------------ names
    def netns(self, i: int) -> str:
        return self.net_.netns(i)

    def addr(self, i: int) -> str:
        return self.net_.addr(i)

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    # ------------------------------------------------------------------ lifecycle
    def up(self) -> None:
        self.down()
        try:
            self._up()
        except BaseException:
            self.down()
            raise

    def _up(self) -> None:
        for d in ("etc", "state", "spool/node1", "spool/node2", "log", "run"):
            (self.base / d).mkdir(parents=True, exist_ok=True)
        self._start_munge()
        self.net_.up()
        self._hosts(add=True)
        self.conf.write_text(self._config())
        _sh("unshare", "--uts", "sh", "-c", f"hostname {self.ctl} && exec slurmctld -f {self.conf}")
        for i, node in enumerate(self.nodes, 1):
            _sh(
                "nsenter",
                f"--net=/run/netns/{self.netns(i)}",
                "unshare",
                "--uts",
                "sh",
                "-c",
                f"hostname {node} && exec slurmd -f {self.conf} -N {node}",
            )
        deadline = time.time() + 60
        while time.time() < deadline:
            r = _sh("sinfo", "-h", "-o", "%T", check=False, env=self.env)
            if r.returncode == 0 and set(r.stdout.split()) == {"idle"}:
                return
            time.sleep(0.5)
        raise RuntimeError(
            f"cluster did not become idle: {_sh('sinfo', check=False, env=self.env).stdout}\n{self.logs()}"
        )

    def _start_munge(self) -> None:
        probe = subprocess.run("munge -n | unmunge", shell=True, capture_output=True)
        if probe.returncode == 0:
            return  # a munged is already serving this machine
        if not Path("/etc/munge/munge.key").is_file():
            _sh("runuser", "-u", "munge", "--", "mungekey", "--create")
        Path("/run/munge").mkdir(parents=True, exist_ok=True)
        shutil.chown("/run/munge", "munge", "munge")
        _sh("runuser", "-u", "munge", "--", "/usr/sbin/munged")
        self.our_munged = int(Path("/run/munge/munged.pid").read_text())

    def _config(self) -> str:
        b = self.base
        # 8 stand-in GPUs per node (character devices with /dev/null's numbers), so GPU job scripts pass
        # `sbatch --test-only`; slurmd counts GRES by their device files.
        dev = b / "dev"
        dev.mkdir(exist_ok=True)
        for k in range(8):
            if not (dev / f"nvidia{k}").exists():
                os.mknod(dev / f"nvidia{k}", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        (b / "etc" / "gres.conf").write_text(
            f"AutoDetect=off\nNodeName=node[1-2] Name=gpu File={dev}/nvidia[0-7]\n"
        )
        nodes = "\n".join(
            f"NodeName={n} NodeAddr={self.addr(i)} CPUs={self.cpus} RealMemory=2000 Gres=gpu:8 State=UNKNOWN"
            for i, n in enumerate(self.nodes, 1)
        )
        return f"""ClusterName=dsktest
GresTypes=gpu
SlurmctldHost={self.ctl}({self.net}.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# Job credentials live 120 s by default and Slurm holds a requeued job back until its old one expired
# (starting earlier fails with "Job credential revoked"): shorten it so requeue tests take seconds.
AuthInfo=cred_expire=10
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
KillWait=10
MinJobAge=600
StateSaveLocation={b}/state
SlurmdSpoolDir={b}/spool/%n
SlurmctldPidFile={b}/run/slurmctld.pid
SlurmdPidFile={b}/run/slurmd-%n.pid
SlurmctldLogFile={b}/log/slurmctld.log
SlurmdLogFile={b}/log/slurmd-%n.log
SlurmctldPort=6817
SlurmdPort=6818
{nodes}
PartitionName=debug Nodes=node[1-2] Default=YES MaxTime=INFINITE State=UP
"""

    def _hosts(self, add: bool) -> None:
        text = Path("/etc/hosts").read_text()
        lines, skip = [], False
        for line in text.splitlines():
            if line.strip() == HOSTS_BEGIN:
                skip = True
            elif line.strip() == HOSTS_END:
                skip = False
            elif not skip:
                lines.append(line)
        if add:
            lines += [
                HOSTS_BEGIN,
                f"{self.net}.1 {self.ctl}",
                *(f"{self.addr(i)} {n}" for i, n in enumerate(self.nodes, 1)),
                HOSTS_END,
            ]
        with open("/etc/hosts", "w") as f:  # in place: /etc/hosts may be a bind mount
            f.write("\n".join(lines) + "\n")

    def down(self) -> None:
        pidfile = self.base / "run" / "slurmctld.pid"
        if pidfile.is_file():  # without a controller scancel retries for a minute
            subprocess.run(["scancel", "--user=root"], capture_output=True, env=self.env, timeout=30)
        victims: list[int] = []
        if pidfile.is_file():
            try:
                victims.append(int(pidfile.read_text()))
            except ValueError:
                pass
        if self.our_munged:
            victims.append(self.our_munged)
        self.net_.down(extra_pids=victims)
        self.our_munged = None
        self._hosts(add=False)
        for d in ("state", "spool", "run"):
            shutil.rmtree(self.base / d, ignore_errors=True)

    # ------------------------------------------------------------------ jobs
    def sbatch(self, *args: str, cwd: Path) -> int:
        r = _sh("sbatch", "--parsable", *args, env=self.env, cwd=cwd)
        return int(r.stdout.strip().split(";")[0])

    def state(self, job: int) -> dict[str, str]:
        r = _sh("scontrol", "show", "job", "-o", str(job), check=False, env=self.env)
        return dict(kv.split("=", 1) for kv in r.stdout.split() if "=" in kv)

    def wait(
        self, job: int, timeout: float, done=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")
    ) -> dict:
        deadline = time.time() + timeout
        while time.time() < deadline:
            st = self.state(job)
            if st.get("JobState") in done:
                return st
            time.sleep(0.5)
        raise TimeoutError(
            f"job {job} still {self.state(job).get('JobState')} after {timeout}s\n{self.logs()}"
        )

    def node_pids(self, i: int) -> list[int]:
        return self.net_.pids(i)

    def logs(self) -> str:
        out = []
        for f in sorted((self.base / "log").glob("*.log")):
            out.append(f"--- {f.name}\n" + "\n".join(f.read_text().splitlines()[-15:]))
        return "\n".join(out)
