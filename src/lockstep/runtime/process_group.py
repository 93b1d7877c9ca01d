"""Own the default process group's lifetime: form it from a Topology, leave it, explain failures.

Topology is a frozen description and owns nothing; `with lockstep.init():` (a JoinedTopology) leaves the
group on exit only where that very init() call formed it.
"""

from __future__ import annotations

import atexit
import os
from dataclasses import dataclass, field, fields, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# torch.distributed.nn.functional binds `group=group.WORLD` as default arguments at import time. Imported
# after the group exists (torch imports it lazily, e.g. the first time an optimizer is built), it keeps
# the default group alive past destroy_process_group(); gloo's threads then outlive the interpreter and a
# worker can die with SIGABRT ("terminate called without an active exception") as it exits. Importing it
# first (3 ms) binds None, which means "the default group" when called.
import torch.distributed.nn.functional  # noqa: F401  isort: skip

from lockstep.errors import BackendUnavailableError, ConfigError, InitTimeoutError, rank_tag
from lockstep.runtime import watchdog
from lockstep.runtime.env.env_contract import CUDA_VISIBLE_DEVICES_VAR
from lockstep.runtime.env.topology import (
    Topology,
    live_settings_from_env,
    report_dir_from_env,
    resolve_topology,
)
from lockstep.runtime.live_host import ProcessHost
from lockstep.runtime.membership.group import LiveGroup, form_live_group
from lockstep.runtime.progress import JOINING, PROGRESS


def unpin_world_group_defaults() -> None:
    """Undo the pin above when torch.distributed.nn.functional was imported after the group existed.

    A program that calls init_process_group itself and only then touches lockstep imports that module
    late: its defaults then hold the group object itself. None has the same meaning ("the default
    group") and lets destroy_process_group() really destroy it (a caught wrap-time error followed by
    destroy_process_group() and exit aborted in about 1 run of 6 before this).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    world = dist.group.WORLD
    for fn in vars(torch.distributed.nn.functional).values():
        defaults = getattr(fn, "__defaults__", None)
        if defaults and any(d is world for d in defaults):
            fn.__defaults__ = tuple(None if d is world else d for d in defaults)


# lockstep's names load lazily (lockstep/__init__.py): a program that formed its group with
# dist.init_process_group and then calls lockstep.init() imports this module, and with it the one above,
# only now (in about 1 run of 6 such a program aborted at exit before this call).
unpin_world_group_defaults()


DEFAULT_TIMEOUT = timedelta(minutes=10)
_BACKENDS = ("gloo", "nccl", "mpi")


@dataclass(frozen=True, eq=False, repr=False)
class JoinedTopology(Topology):
    """The Topology that init() returns; as a context manager, it leaves the group on exit only if the
    init() call that returned it formed the group. A group that existed before (the caller's own init()
    or dist.init_process_group) is left alone, so library code may write `with lockstep.init():` too.
    Equal to a Topology with the same facts."""

    # Which group this init() call formed (the process's count of formed groups), None: it joined one.
    formed_group: int | None = field(default=None, repr=False)

    def __enter__(self) -> JoinedTopology:
        # The name bound by `as` describes the group; ownership stays with this `with` statement, so a
        # nested `with topo:` cannot leave the group under the outer block.
        return _formed.current() or replace(self, formed_group=None)

    def __exit__(self, *exc: object) -> None:
        if self.formed_group is not None and self.formed_group == _formed.count and _formed.view is not None:
            shutdown()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Topology):
            return NotImplemented
        return _facts(self) == _facts(other)

    __hash__ = Topology.__hash__


def _facts(topo: Topology) -> dict[str, Any]:
    return {f.name: getattr(topo, f.name) for f in fields(Topology)}


@dataclass
class _FormedGroups:
    """The groups init() formed in this process: the current one, returned by every later init(), how
    many there were, so that a `with` over a group since left (and formed again) does nothing, and in
    live mode the LiveGroup whose generations replace the group over time."""

    view: JoinedTopology | None = None
    count: int = 0
    live: LiveGroup[Topology] | None = None

    def current(self) -> JoinedTopology | None:
        """The view of the group now: in live mode, numbered as the current generation numbers ranks."""
        view, group = self.view, self.live
        if view is not None and group is not None:
            m = group.membership
            if (view.rank, view.world_size) != (m.rank, m.world_size):
                view = self.view = replace(view, rank=m.rank, world_size=m.world_size)
        return view


_formed = _FormedGroups()


def live_group() -> LiveGroup[Topology] | None:
    """This worker's live membership (runtime/membership/) when init() formed a live-mode group, else None."""
    return _formed.live


def start_watchdog(hang_timeout: float | None = None) -> None:
    """Watch this process for hangs (runtime/watchdog.py), once a group of more than one rank exists."""
    if hang_timeout is not None:
        if not hang_timeout >= 0:
            raise ConfigError(
                f"hang_timeout={hang_timeout!r}: expected seconds >= 0 (0 turns the watchdog off)"
            )
        watchdog.set_hang_timeout(hang_timeout)
    report_dir = report_dir_from_env(os.environ)
    watchdog.start(watchdog.hang_timeout_setting(), report_dir, membership=_formed.live)


def choose_backend(device_type: str) -> str:
    """nccl for CUDA devices, gloo for everything else."""
    return "nccl" if device_type == "cuda" else "gloo"


def check_backend(backend: str, device_type: str) -> None:
    """Raise a clear error when `backend` cannot serve `device_type` in this build of torch."""
    if backend not in _BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}; expected one of {', '.join(_BACKENDS)}")
    available = {
        "gloo": dist.is_gloo_available(),
        "nccl": dist.is_nccl_available(),
        "mpi": dist.is_mpi_available(),
    }
    if not available[backend]:
        usable = [name for name, ok in available.items() if ok]
        raise BackendUnavailableError(
            f"backend {backend!r} is not available in this build of torch {torch.__version__}; "
            f"available: {usable!r}. Use backend='gloo' for CPU tensors"
        )
    if backend == "nccl" and device_type != "cuda":
        raise BackendUnavailableError(
            f"backend 'nccl' needs CUDA devices but this process has device type {device_type!r} "
            f"(torch.cuda.is_available() = {torch.cuda.is_available()}); use backend='gloo' on CPU"
        )


def _local_device(topo: Topology, backend: str | None) -> torch.device:
    if backend not in (None, "nccl") or not torch.cuda.is_available():
        return torch.device("cpu")
    index = local_cuda_index(
        topo, backend, torch.cuda.device_count(), os.environ.get(CUDA_VISIBLE_DEVICES_VAR)
    )
    return torch.device("cpu") if index is None else torch.device("cuda", index)


def local_cuda_index(
    topo: Topology, backend: str | None, device_count: int, visible: str | None
) -> int | None:
    """Which of the `device_count` CUDA devices this process drives (None: the CPU). Pure: the count and
    CUDA_VISIBLE_DEVICES (`visible`) are arguments.

    - A process that sees exactly one device, set for it alone (`srun --gpus-per-task=1`, or a launcher
      that gives each process its own CUDA_VISIBLE_DEVICES), drives cuda:0 whatever its local rank.
    - Otherwise local rank i drives device i; more processes on this node than devices cannot work with
      nccl (backend None means nccl here), so that is a ConfigError saying what to change.
    """
    if backend not in (None, "nccl") or device_count < 1:
        return None
    if device_count == 1 and _one_device_for_this_process(topo, visible):
        return 0
    if topo.local_world_size > device_count:
        shown = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
        raise ConfigError(
            f"{rank_tag(topo.rank, topo.world_size)}{topo.local_world_size} processes on this node but only "
            f"{device_count} CUDA device(s) visible{shown}, and nccl needs one device per process; run at most "
            f"{device_count} processes per node (lockstep run -n {device_count}, or srun "
            f"--ntasks-per-node={device_count}; with srun, --gpus-per-task=1 gives each task its own), make "
            "more devices visible, or pass backend='gloo'"
        )
    return topo.local_rank % device_count


def _one_device_for_this_process(topo: Topology, visible: str | None) -> bool:
    """CUDA_VISIBLE_DEVICES names one device, and it was chosen for this process rather than shared by the
    node: under SLURM each task gets its own; elsewhere local rank 0 (or a node of one process) cannot
    tell, and a local rank > 0 that sees one device shares it with local rank 0."""
    if visible is None or len([d for d in visible.split(",") if d.strip()]) != 1:
        return False
    return topo.launcher == "slurm" or topo.local_rank == 0 or topo.local_world_size == 1


def init(
    backend: str | None = None,
    *,
    timeout: timedelta | float = DEFAULT_TIMEOUT,
    rank: int | None = None,
    world_size: int | None = None,
    hang_timeout: float | None = None,
) -> JoinedTopology:
    """Join the job's default process group and bind this process's device; return its Topology.

    Reads torchrun's or SLURM's variables (or the explicit `rank`/`world_size` of the tutorials'
    `setup(rank, world_size)`), or runs a world of 1 when there are none, so that `python train.py` works.
    Under `lockstep run --min-world M` it forms live mode's first generation instead (runtime/membership/).
    Idempotent: once the group exists, every call returns the same facts (the same object, when init()
    formed the group). `with lockstep.init() as topo:` leaves the group on exit if this call formed it,
    and leaves a group that existed before alone.

    Args:
        backend: "gloo", "nccl" or "mpi"; None: nccl when this process drives a CUDA device, else gloo.
        timeout: how long collectives and the rendezvous may wait (a timedelta or seconds; 10 minutes).
        rank: this process's place when no launcher set the environment (the tutorials'
            `mp.spawn(setup, args=(world_size,))`).
        world_size: the number of processes, with `rank`.
        hang_timeout: seconds a rank may wait in a collective for a peer before the hang watchdog ends the
            job with a report naming the culprit (default LOCKSTEP_HANG_TIMEOUT or 300; 0: off).

    Returns:
        A JoinedTopology: rank, local_rank, world_size, nodes and the rendezvous address; a context
        manager that leaves the group on exit if this call formed it.

    Raises:
        ConfigError: inconsistent or missing rank/world variables, a bad hang_timeout, more processes per
            node than CUDA devices with nccl.
        BackendUnavailableError: the backend is not built into this torch, or nccl without CUDA.
        InitTimeoutError: the group could not be formed in time (names the address, port and what to check).
        WorldTooSmallError: live mode lost members at start-up until fewer than --min-world remain.
    """
    if isinstance(timeout, (int, float)):
        timeout = timedelta(seconds=timeout)
    if dist.is_initialized():
        start_watchdog(hang_timeout)
        return _formed.current() or _topology_of_existing_group()
    topo = resolve_topology(os.environ, rank=rank, world_size=world_size)
    device = _local_device(topo, backend)
    backend = backend or choose_backend(device.type)
    check_backend(backend, device.type)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if topo.world_size == 1 and topo.launcher in ("none", "explicit"):
        # No peers: an in-memory store needs no port and cannot collide with anything.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    elif (live := live_settings_from_env(os.environ)) is not None:
        if live.joining:
            _warm_up_before_joining()
        # `lockstep run --min-world`: the launcher's store; a replacement learns its rank when admitted
        _formed.live = form_live_group(
            topo,
            ProcessHost(report_dir_from_env(os.environ)),
            backend,
            timeout,
            min_world=live.min_world,
            member_id=live.member_id,
            joining=live.joining,
            attempt=live.attempt,
        )
        topo = _formed.live.topology()
        # The others wait for this process from now on: its set-up is timed from here, not from its start
        # (a loaded machine can spend the hang watchdog's start-up allowance on imports alone).
        if live.joining:
            PROGRESS.set_phase(JOINING)
        else:
            PROGRESS.phase_starts_now()
    else:
        _rendezvous(topo, backend, timeout)
    _formed.count += 1
    _formed.view = JoinedTopology(**_facts(topo))
    if backend != "nccl":
        # Leave a gloo group while the interpreter is whole: its threads must not outlive it (see above).
        # Not for nccl, where tearing down beside a failed peer can block the exit.
        atexit.register(shutdown)
    start_watchdog(hang_timeout)
    return replace(_formed.view, formed_group=_formed.count)


def _warm_up_before_joining() -> None:
    """A replacement, before it queues to join: load what a training loop's first steps would load lazily
    after the members admitted it, while they wait for it. The first torch.optim optimizer imports
    torch._dynamo (about 2 s on a loaded 2-core machine): once here, that time is its own, not the group's."""
    import torch._dynamo  # noqa: F401 (imported for its side effect: loaded once per process)


def _rendezvous(topo: Topology, backend: str, timeout: timedelta) -> None:
    try:
        if topo.agent_store_attempt is not None:
            # Under torch's elastic agent (lockstep run, torchrun) the agent hosts the store and keeps it
            # across restarts; without a per-attempt prefix a restarted worker reads the addresses that
            # the previous attempt's workers left there, and fails or hangs.
            client = dist.TCPStore(topo.master_addr, topo.master_port, topo.world_size, False, timeout)
            store = dist.PrefixStore(f"lockstep/attempt_{topo.agent_store_attempt}", client)
            dist.init_process_group(
                backend, store=store, rank=topo.rank, world_size=topo.world_size, timeout=timeout
            )
        else:
            url = f"tcp://{_bracket(topo.master_addr)}:{topo.master_port}"
            dist.init_process_group(
                backend, init_method=url, rank=topo.rank, world_size=topo.world_size, timeout=timeout
            )
    except (RuntimeError, dist.DistError, TimeoutError, OSError) as exc:
        raise InitTimeoutError(
            f"{rank_tag(topo.rank, topo.world_size)}could not form the process group at {topo.endpoint} "
            f"within {timeout.total_seconds():.0f} s ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}). "
            f"Check that all {topo.world_size} processes were started, that rank 0's host {topo.master_addr!r} "
            f"is reachable from this one, that port {topo.master_port} is free there and not firewalled, "
            "and that every process uses the same MASTER_ADDR/MASTER_PORT"
        ) from exc


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _topology_of_existing_group() -> JoinedTopology:
    """The user called dist.init_process_group themselves (drop-in use): describe what exists."""
    topo = resolve_topology(os.environ)
    return JoinedTopology(
        rank=dist.get_rank(),
        local_rank=topo.local_rank if topo.world_size == dist.get_world_size() else dist.get_rank(),
        world_size=dist.get_world_size(),
        local_world_size=topo.local_world_size
        if topo.world_size == dist.get_world_size()
        else dist.get_world_size(),
        node_rank=topo.node_rank,
        num_nodes=topo.num_nodes,
        master_addr=topo.master_addr,
        master_port=topo.master_port,
        launcher=topo.launcher if topo.launcher != "none" else "explicit",
    )


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def shutdown() -> None:
    """Leave the process group, whoever formed it. Safe to call twice, or without init()."""
    _formed.view = None
    watchdog.stop()
    if is_initialized():
        dist.destroy_process_group()


def current_topology() -> Topology:
    """The Topology of this process: from init(), from an existing group, or from the environment."""
    if is_initialized():
        return _formed.current() or _topology_of_existing_group()
    return resolve_topology(os.environ)
