"""Live mode inside lockstep.fit: go on over the survivors when a member is lost, let replacements in.

The group's side (who is a member, generations, the store) is runtime/live.py; this module is the
loop's side, given the fit run (`trainer/loop.py`'s _Run) it acts on:

- `recover`: a collective failed because a member died or was evicted. Re-form the group, then re-cut
  the work for the new world (the replica, the sampler's shard, the evaluation shards). The loop then
  redoes the step it was in, or the work after a step it was doing.
- `admit_joiners`: after each completed step, a growth that rank 0 planned one step ago happens: the
  members re-form with the replacements appended.
- `receive_state`: a replacement's first act in fit(): it takes the model, optimizer, scheduler, scaler,
  sampler, counters and pending metric rows from rank 0 over the new group (runtime/state_transfer.py).
  accumulate() draws every random number of a step from (seed, step, micro-batch), in deterministic
  mode and out of it, so there is no RNG stream to carry; the members receive the same broadcast and drop it.

A step counts on every member or on none: before the optimizer step each member waits until all have
counted themselves done on the store (LiveGroup.commit), because the step's last all-reduce can
complete on some ranks and fail on others. After every change the members still compare their step
counters, as a guard: a difference would make the replicas differ, so it is an InternalError on every rank.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from lockstep.engine.api import replicate
from lockstep.errors import InternalError, MembershipChanged, rank_tag
from lockstep.runtime.collectives import all_gather_object
from lockstep.runtime.live import Fault, LiveGroup
from lockstep.runtime.state_transfer import broadcast_state
from lockstep.trainer.metrics import OrderedMetrics
from lockstep.trainer.progress import ProgressBar
from lockstep.trainer.run_log import RunLog

if TYPE_CHECKING:
    from lockstep.trainer.loop import _Run

NO_STATE = -1  # the step a replacement reports before it received its state


def recover(run: _Run, exc: BaseException) -> bool:
    """A collective failed: re-form over the survivors and re-cut the work. False when this is not live
    mode, or when no member left (the error is the program's own): the caller re-raises it."""
    group = run.live
    if group is None:
        return False
    before = group.membership.members
    _release_replica(run)
    fault = group.reform(exc)
    if group.membership.members == before and not isinstance(exc, MembershipChanged):
        return False
    run.optimizer.zero_grad(set_to_none=True)  # the abandoned step's partial gradients
    _rejoin(run, group, fault)
    return True


def admit_joiners(run: _Run) -> bool:
    """At a step boundary: let the replacements that rank 0 planned for this step in. True when the
    group changed (the loop re-cuts its iteration), also when a member was lost while doing so."""
    group = run.live
    if group is None:
        return False
    joiners = group.joiners_due(run.counters.step)
    if not joiners:
        return False
    try:
        _release_replica(run)
        fault = group.reform(f"replacements {joiners} join after step {run.counters.step}", joiners)
        _rejoin(run, group, fault)
    except (RuntimeError, dist.DistError) as exc:  # a member or the replacement died in the growth
        if not recover(run, exc):
            raise
    return True


def receive_state(run: _Run) -> None:
    """A replacement, at the start of fit(): the state of the run it joins, from rank 0 (a collective
    that the members enter from admit_joiners)."""
    group = run.live
    if group is None or not group.needs_state:
        raise InternalError("receive_state is for a live-mode replacement that has no state yet")
    try:
        _converge(run, group)
    except (RuntimeError, dist.DistError) as exc:
        group.give_up(exc)  # no state to go on with: leave, so that the members need not wait for it
    run.reshard()
    run.bar.advance(run.counters.step)


def _release_replica(run: _Run) -> None:
    # Nothing may keep the old group alive: destroying it closes its sockets, which is how the survivors
    # still waiting in it (not the dead rank's neighbours) learn of the death at once.
    if run.handle is not None:
        run.handle.remove()
        run.handle = None


def _rejoin(run: _Run, group: LiveGroup, fault: Fault) -> None:
    """After a new generation formed: the replica on it, the replacements' state, the shards re-cut."""
    run.topo = group.topology()
    run.handle = replicate(run.module, policy=run.replica_policy())
    run.micro_per_step = len(run.handle.owned_micro_batches(run.plan.num_micro_batches))
    record = {"step": run.counters.step, **asdict(fault), "recover_s": round(fault.recover_s, 4)}
    run.faults.append(record)  # before _converge: a replacement receives the list with this record
    started = time.monotonic()
    _converge(run, group)
    record["detail"]["converge_s"] = round(time.monotonic() - started, 4)  # with the state sent, if any
    if run.topo.rank == 0:
        _take_over_rows(run, group, fault.lost)
        _take_over_the_log(run)
    run.reshard()
    if fault.kind == "joined":
        text = f"replacements {fault.joined} joined"
    else:
        text = f"launch ranks {fault.lost} left ({'; '.join(fault.how.values())})"
    run.bar.message(
        f"live: {text}; going on with {fault.world_size} ranks from step {run.counters.step} "
        f"({fault.recover_s:.2f} s to re-form)"
    )


def _converge(run: _Run, group: LiveGroup) -> None:
    """Every member stands at the same step; a replacement receives the state from rank 0."""
    pending = run.train_metrics.count
    mine = (
        [NO_STATE, None, None, 0]
        if group.needs_state
        else [run.counters.step, run.saved_step, run.eval_step, pending]
    )
    rows = [list(r) for r in all_gather_object(mine)]
    steps = [int(r[0]) for r in rows]
    members = {s for s in steps if s != NO_STATE}
    # A collective can complete on some ranks and fail on others: a save (or evaluation) that one member
    # finished and another did not is redone by all, so that their retried work issues the same collectives.
    for index, name in ((1, "saved_step"), (2, "eval_step")):
        if len({repr(r[index]) for r in rows if r[0] != NO_STATE}) > 1:
            setattr(run, name, None)
    if len({int(r[3]) for r in rows if r[0] != NO_STATE}) > 1:
        # The metric reduction completed on some members (their rows are gone) and not on others: the
        # interval's rows cannot all be had again, so every member drops them (the log skips it).
        run.train_metrics = type(run.train_metrics)()
        run.unlogged = []
    if len(members) > 1:
        raise InternalError(
            f"{rank_tag(run.topo.rank, run.topo.world_size)}after a change of members the ranks stand at "
            f"different steps ({min(members)} to {max(members)}), although a step counts on every member "
            "or on none (LiveGroup.commit); resume from the last checkpoint"
        )
    if NO_STATE not in steps:
        return
    tree = broadcast_state(state_tree(run) if run.topo.rank == 0 else None, src=0)
    if group.needs_state:
        load_state_tree(run, tree)
        group.state_received()


def _take_over_rows(run: _Run, group: LiveGroup, lost: list[int]) -> None:
    """Rank 0 holds from now on the metric rows that the lost members committed since the last log (from
    the store), so that the interval's logged means cover every sample, as in a run without the fault."""
    metrics = run.train_metrics
    if not lost or not isinstance(metrics, OrderedMetrics):
        return
    names = run._metric_names("train")
    for step, generation in run.unlogged:
        for uid in lost:
            rows = group.committed_rows(generation, step, uid)
            if rows is not None:
                metrics.add_packed(rows, names)


def _take_over_the_log(run: _Run) -> None:
    """This rank became rank 0 (the old one was lost): it writes the metric log and shows progress now."""
    if run.runlog.enabled:
        return
    run.runlog = RunLog(run.run_dir, enabled=True)
    run.runlog.rewind(run.counters.step)  # what the lost rank 0 wrote, up to the step the group stands at
    run.bar = ProgressBar(run.total_steps, enabled=True, mode=run.config.progress)
    run.bar.advance(run.counters.step)


def state_tree(run: _Run) -> dict[str, Any]:
    """What a replacement needs to continue exactly where the members stand."""
    return {
        "model": run.module.state_dict(),
        "optimizer": run.optimizer.state_dict(),
        "scheduler": run.scheduler.state_dict(),
        "scaler": run.scaler.state_dict(),
        "sampler": run.sampler.state_dict(),
        "counters": run.counters.state_dict(),
        "metric_rows": run.train_metrics.num_rows if hasattr(run.train_metrics, "num_rows") else 0,
        "last_train": run.last_train,
        "last_eval": run.last_eval,
        "faults": run.faults,
        "saved_step": run.saved_step,
        "eval_step": run.eval_step,
        "unlogged": run.unlogged,
    }


def load_state_tree(run: _Run, tree: dict[str, Any]) -> None:
    with torch.no_grad():
        run.module.load_state_dict(tree["model"])
    run.optimizer.load_state_dict(tree["optimizer"])
    run.scheduler.load_state_dict(tree["scheduler"])
    if tree["scaler"]:
        run.scaler.load_state_dict(tree["scaler"])
    run.sampler.load_state_dict(tree["sampler"])
    run.counters.load_state_dict(tree["counters"])
    if hasattr(run.train_metrics, "num_rows"):
        run.train_metrics.num_rows = int(tree["metric_rows"])
    run.last_train, run.last_eval = dict(tree["last_train"]), dict(tree["last_eval"])
    run.faults = list(tree["faults"])
    run.saved_step, run.eval_step = tree["saved_step"], tree["eval_step"]
    run.unlogged = [(int(step), int(generation)) for step, generation in tree["unlogged"]]
