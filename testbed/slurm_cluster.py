"""A real SLURM cluster (munged + slurmctld + slurmd, run as root) in a temporary directory.

    with slurm_cluster(tmp_path) as cluster:                      # one node: this machine
        out = cluster.run(["srun", "-N1", "-n2", "python", "script.py"])
        job = cluster.submit(script_path)                         # sbatch --parsable
        cluster.wait(job, {"COMPLETED"})

    with netns_hosts(2) as hosts, slurm_cluster(tmp_path, hosts=hosts, cpus=1) as cluster:   # two nodes
        cluster.run(["srun", "-N2", "-n2", ...])

Everything lives under the given directory: munge key and socket, slurm.conf (client commands find it
through SLURM_CONF in `cluster.env`), state, spool and logs. Each daemon runs in the foreground as a child of
this process; slurmctld and each slurmd run inside their own PID namespace (`unshare --pid --kill-child
--mount-proc`), so stopping the `unshare` process by its PID also ends every slurmstepd and job task the
daemon started: nothing outlives the fixture, even when a test fails or a job hangs.

Setup (found on Debian 12, slurm-wlm 22.05): proctrack/linuxproc and task/none (no cgroup setup), cons_tres
with CR_CPU, accounting off. One node: named after `hostname -s`, at 127.0.0.1. Namespace hosts: node<i> at
the host's address, each slurmd also in its own UTS and mount namespace (hostname node<i>, a private
/etc/hosts naming every node), entered with nsenter (`ip netns exec` would hide /sys/fs/cgroup). The
cluster is idle about 1-2 s after start.

A requeued job is held by SLURM for about 2 minutes (Reason=BeginTime); a test may shorten that with
`scontrol update JobId=N StartTime=now+3`, never to the same second as the kill (slurmd refuses the launch:
"Job credential revoked").
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from testbed.netns import Host
from testbed.system import free_port, is_root, require_commands, stop_process

COMMANDS = (
    "munged",
    "slurmctld",
    "slurmd",
    "srun",
    "sbatch",
    "scontrol",
    "squeue",
    "scancel",
    "sinfo",
    "unshare",
)
PACKAGES = ("slurm-wlm", "munge", "util-linux")  # installed by `make testbed` (Makefile: TESTBED_PACKAGES)
START_TIMEOUT = 30.0
FINAL_STATES = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "BOOT_FAIL",
        "DEADLINE",
    }
)


def unavailable_reason() -> str | None:
    """Why this machine cannot host the cluster (not root, or slurm-wlm and munge not installed)."""
    if not is_root():
        return "a SLURM cluster needs root (slurmd runs jobs as any user); run the tests as root"
    return require_commands(COMMANDS, PACKAGES)


@dataclass
class SlurmCluster:
    """Handles to a running cluster: its directory, config, node name and client environment."""

    root: Path
    node: str
    cpus: int
    hosts: list[Host] = field(default_factory=list)  # namespace hosts, one node each; empty: this machine
    env: dict[str, str] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def nodes(self) -> list[str]:
        return [f"node{i}" for i in range(len(self.hosts))] if self.hosts else [self.node]

    def command(self, cmd: Sequence[str]) -> list[str]:
        """`cmd` as run on the first node (inside its network namespace when the nodes are namespaces)."""
        return self.hosts[0].command(cmd) if self.hosts else list(cmd)

    def run(
        self,
        cmd: Sequence[str],
        *,
        timeout: float = 60.0,
        cwd: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run a command (srun, sbatch, scontrol, ...) against this cluster; never raises on exit codes."""
        return subprocess.run(
            self.command(cmd),
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=cwd,
            env={**self.env, **(env or {})},
        )

    def submit(self, script: Path, *extra: str, cwd: Path | None = None) -> int:
        result = self.run(["sbatch", "--parsable", *extra, str(script)], cwd=cwd)
        if result.returncode != 0:
            raise RuntimeError(f"sbatch failed (rc {result.returncode}): {result.stderr}")
        return int(result.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job -o` as a dict (JobState, Restarts, StdOut, BatchHost, ...); {} once purged."""
        result = self.run(["scontrol", "show", "job", "-o", str(job_id)])
        if result.returncode != 0:
            return {}
        return dict(re.findall(r"(\w+)=(\S*)", result.stdout))

    def state(self, job_id: int) -> str:
        return self.job(job_id).get("JobState", "UNKNOWN")

    def wait(
        self,
        job_id: int,
        states: set[str] | frozenset[str] = FINAL_STATES,
        *,
        timeout: float = 90.0,
        restarts: int = 0,
    ) -> dict[str, str]:
        """Poll until the job is in one of `states` (with at least `restarts` requeues); the job's record."""
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in states and int(info.get("Restarts", "0")) >= restarts:
                return info
            time.sleep(0.3)
        raise TimeoutError(
            f"job {job_id} not in {sorted(states)} after {timeout:.0f} s: {info}\n{self.logs()}"
        )

    def logs(self) -> str:
        parts = []
        for name in ("slurmctld.log", *[f"slurmd-{n}.log" for n in self.nodes], "munged.log"):
            path = self.root / name
            if path.exists():
                parts.append(
                    f"--- {name} (tail) ---\n"
                    + "\n".join(path.read_text(errors="replace").splitlines()[-30:])
                )
        return "\n".join(parts)


@contextlib.contextmanager
def slurm_cluster(
    root: Path, *, cpus: int | None = None, hosts: Sequence[Host] = ()
) -> Iterator[SlurmCluster]:
    """Start munged, slurmctld and slurmd under `root`; yield once the nodes are idle; always stop them.

    With `hosts` (testbed/netns.py), each host is a node named node<i> at its address: its slurmd runs
    in that network namespace and in its own UTS and mount namespaces (hostname node<i>, an /etc/hosts
    that names every node), slurmctld runs on node0, and `cluster.run` runs client commands there.
    """
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o700)  # munged refuses a key or socket directory others can write to
    cluster = SlurmCluster(
        root=root,
        node=socket.gethostname().split(".")[0],
        cpus=cpus or os.cpu_count() or 1,
        hosts=list(hosts),
    )
    try:
        _start(cluster)
        yield cluster
    finally:
        _stop(cluster)


def _start(cluster: SlurmCluster) -> None:
    root = cluster.root
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    os.chmod(key, 0o400)
    socket_path = root / "munge.socket"
    cluster.procs["munged"] = subprocess.Popen(
        [
            "munged",
            "-F",
            "-f",
            f"--socket={socket_path}",
            f"--key-file={key}",
            f"--pid-file={root / 'munged.pid'}",
            f"--log-file={root / 'munged.log'}",
            f"--seed-file={root / 'munged.seed'}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    _wait_for(lambda: socket_path.exists(), "munged socket", cluster)
    for sub in ("state", "spool"):
        (root / sub).mkdir(exist_ok=True)
    ctld_port, slurmd_port = free_port(), free_port()
    cluster.conf.write_text(_slurm_conf(cluster, socket_path, ctld_port, slurmd_port))
    cluster.env = {**os.environ, "SLURM_CONF": str(cluster.conf)}
    for var in [k for k in cluster.env if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))]:
        if var != "SLURM_CONF":
            cluster.env.pop(var)  # a test itself running inside a SLURM job must not leak its job here
    for name, argv in _daemons(cluster):
        cluster.procs[name] = subprocess.Popen(
            argv,
            env=cluster.env,
            stdout=open(root / f"{name}.out", "wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    _wait_for(lambda: _nodes_idle(cluster), f"nodes {', '.join(cluster.nodes)} idle", cluster)


def _daemons(cluster: SlurmCluster) -> list[tuple[str, list[str]]]:
    """(name, argv) of slurmctld and each slurmd. Each daemon is PID 1 of its own PID namespace: killing
    its `unshare` parent ends everything it started (slurmstepd, job tasks)."""
    conf = str(cluster.conf)
    in_pid_ns = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc"]
    if not cluster.hosts:
        return [
            ("slurmctld", [*in_pid_ns, "slurmctld", "-D", "-i", "-f", conf]),
            ("slurmd", [*in_pid_ns, "slurmd", "-D", "-N", cluster.node, "-f", conf]),
        ]
    hosts_file = cluster.root / "hosts"
    hosts_file.write_text(
        "127.0.0.1 localhost\n" + "".join(f"{h.addr} {n}\n" for h, n in zip(cluster.hosts, cluster.nodes))
    )
    # Its own hostname and /etc/hosts (a private mount: the machine's file is untouched), then the daemon.
    as_node = [
        *in_pid_ns,
        "--uts",
        "sh",
        "-c",
        f'hostname "$0" && mount --bind {hosts_file} /etc/hosts && exec "$@"',
    ]
    daemons = [
        (
            "slurmctld",
            cluster.hosts[0].command([*as_node, cluster.nodes[0], "slurmctld", "-D", "-i", "-f", conf]),
        )
    ]
    for host, node in zip(cluster.hosts, cluster.nodes):
        daemons.append(
            (f"slurmd-{node}", host.command([*as_node, node, "slurmd", "-D", "-N", node, "-f", conf]))
        )
    return daemons


def _slurm_conf(cluster: SlurmCluster, munge_socket: Path, ctld_port: int, slurmd_port: int) -> str:
    root = cluster.root
    if cluster.hosts:
        ctld = f"{cluster.nodes[0]}({cluster.hosts[0].addr})"
        node_lines = "".join(
            f"NodeName={n} NodeAddr={h.addr} CPUs={cluster.cpus} State=UNKNOWN\n"
            for h, n in zip(cluster.hosts, cluster.nodes)
        )
    else:
        ctld = f"{cluster.node}(127.0.0.1)"
        node_lines = f"NodeName={cluster.node} NodeAddr=127.0.0.1 CPUs={cluster.cpus} State=UNKNOWN\n"
    return f"""\
ClusterName=lockstep-test
SlurmctldHost={ctld}
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
StateSaveLocation={root / "state"}
SlurmdSpoolDir={root / "spool"}/%n
SlurmctldPidFile={root / "slurmctld.pid"}
SlurmdPidFile={root / "slurmd-%n.pid"}
SlurmctldLogFile={root / "slurmctld.log"}
SlurmdLogFile={root / "slurmd-%n.log"}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
SchedulerParameters=sched_interval=1
MinJobAge=300
KillWait=5
InactiveLimit=0
{node_lines}PartitionName=debug Nodes={",".join(cluster.nodes)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
"""


def _nodes_idle(cluster: SlurmCluster) -> bool:
    for name, proc in cluster.procs.items():
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode} while starting\n{cluster.logs()}")
    result = cluster.run(["sinfo", "-h", "-N", "-o", "%t"], timeout=10)
    states = result.stdout.split()
    return result.returncode == 0 and len(states) == len(cluster.nodes) and all(s == "idle" for s in states)


def _wait_for(check: object, what: str, cluster: SlurmCluster) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return
        time.sleep(0.1)
    raise RuntimeError(f"timed out after {START_TIMEOUT:.0f} s waiting for {what}\n{cluster.logs()}")


def _stop(cluster: SlurmCluster) -> None:
    """Cancel what is left, then stop slurmd, slurmctld and munged by the processes this fixture started."""
    if "slurmctld" in cluster.procs and cluster.procs["slurmctld"].poll() is None and cluster.env:
        with contextlib.suppress(Exception):
            cluster.run(["scancel", "--full", "--user=root"], timeout=10)
    for name in [*[n for n in cluster.procs if n.startswith("slurmd")], "slurmctld", "munged"]:
        proc = cluster.procs.get(name)
        if proc is not None:
            stop_process(proc)
