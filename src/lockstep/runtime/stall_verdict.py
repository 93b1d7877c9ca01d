"""Judge a stall from every rank's published state, and write the one report a user reads.

Pure functions over plain dicts (what each rank's watchdog publishes to the c10d store, see
runtime/watchdog.py), so every rule is unit-testable without processes:

- `classify` says where one rank is: waiting in a collective, busy outside any (in which phase, for how
  long), not responding (its heartbeat stopped: stopped or dead), or exited;
- `judge` decides, from the point of view of a rank that has waited longer than the hang timeout,
  whether this is a hang and who is to blame: the ranks not in its collective (behind), a rank in the
  same collective with another op or other shapes (desync), or at another sequence number (diverged);
- `divergence` finds the first sequence number at which two ranks' recent collectives differ;
- `not_a_hang` and `evictable_culprits` read a verdict: peers that left on purpose, culprits that stopped
  publishing heartbeats or replacements too slow to join (live mode evicts those); `merge_issued` folds a collective published as it was
  issued into a rank's heartbeat;
- `format_report` renders the report for a terminal.

A rank that is busy in a slow phase (checkpoint, evaluate) or in its first two steps (compilation, bucket
rebuild) is allowed `slow_factor` times the timeout before it counts as behind.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from lockstep.runtime.progress import JOINING, SLOW_PHASES

WAITING, BUSY, SILENT, EXITED = "waiting", "busy", "not responding", "exited"
# Frames every worker has below the user's code (`python -m`, lockstep's worker bootstrap): not shown.
_BOOTSTRAP = ("<frozen runpy>", os.path.join("lockstep", "launch", "worker.py"))
FIRST_STEPS = 2  # steps_done below this: compilation and the bucket rebuild may still be running


def classify(state: Mapping[str, Any]) -> str:
    """WAITING, BUSY, SILENT or EXITED: where this rank is, from its published state."""
    if state.get("exited"):
        return EXITED
    if state.get("silent"):
        return SILENT
    if state.get("waiting") is not None or state.get("untracked"):
        return WAITING
    return BUSY


def _same_op(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    return a.get("op") == b.get("op") and a.get("shapes") == b.get("shapes")


def judge(
    me: int, states: Mapping[int, Mapping[str, Any]], timeout: float, slow_factor: float
) -> dict[str, Any] | None:
    """The verdict of rank `me` (which has waited over `timeout` s, or whose collective failed), or None
    when the others are still allowed to keep it waiting."""
    mine = states[me]
    coll = mine.get("waiting") or {}
    culprits: dict[int, str] = {}
    waiters = [me]
    for rank, state in sorted(states.items()):
        if rank == me:
            continue
        where = classify(state)
        theirs = state.get("waiting") or {}
        if where == SILENT:
            culprits[rank] = state.get("liveness") or "not responding (its heartbeat stopped)"
        elif where == EXITED:
            culprits[rank] = "exited (its program ended or left the process group)"
        elif where == BUSY:
            allowed = timeout * (slow_factor if _is_slow(state) else 1.0)
            if float(state.get("phase_for") or 0.0) < allowed and not mine.get("failed"):
                return None  # still within what its phase may take
            culprits[rank] = f"busy in phase {state.get('phase')!r} for {state.get('phase_for', 0):.1f} s"
        elif theirs and coll and theirs.get("group") == coll.get("group"):
            if theirs.get("seq") != coll.get("seq"):
                culprits[rank] = f"at {_name(theirs)} while rank {me} is at {_name(coll)}: sequences diverged"
            elif not _same_op(theirs, coll):
                culprits[rank] = f"issued {_name(theirs)} {theirs.get('shapes')} where rank {me} issued " + (
                    f"{_name(coll)} {coll.get('shapes')}: collective mismatch"
                )
            else:
                waiters.append(rank)
        else:
            waiters.append(rank)
    div = divergence(states)
    kind = _kind(culprits, mine, div)
    return {
        "kind": kind,
        "detected_by": me,
        "timeout": timeout,
        "culprits": sorted(culprits),
        "waiting": sorted(waiters),
        "why": {str(r): why for r, why in sorted(culprits.items())},
        "collective": coll or None,
        "divergence": div,
        "summary": _summary(kind, me, culprits, waiters, mine) + _parted(div),
    }


def _is_slow(state: Mapping[str, Any]) -> bool:
    return state.get("phase") in SLOW_PHASES or int(state.get("steps_done") or 0) < FIRST_STEPS


def _kind(culprits: Mapping[int, str], mine: Mapping[str, Any], div: Mapping[str, Any] | None) -> str:
    whys = " ".join(culprits.values())
    if "mismatch" in whys or (div and div["differs_in"] == "op"):
        return "desync"
    if "diverged" in whys or div:
        return "diverged"
    if "not responding" in whys or "dead" in whys or "stopped" in whys or "exited" in whys:
        return "rank lost"
    if culprits:
        return "stall"
    return "collective failed" if mine.get("failed") else "all waiting"


def _name(coll: Mapping[str, Any]) -> str:
    return f"{coll.get('op')} #{coll.get('seq')} ({coll.get('group')})"


def _summary(
    kind: str, me: int, culprits: Mapping[int, str], waiters: list[int], mine: Mapping[str, Any]
) -> str:
    coll = mine.get("waiting")
    where = f"{_name(coll)} at step {coll.get('step')}" if coll else (mine.get("untracked") or "a collective")
    many = len(waiters) > 1
    waiting = f"rank{'s' if many else ''} {', '.join(map(str, sorted(waiters)))} wait{'' if many else 's'} in {where}"
    if not culprits:
        if mine.get("failed"):
            return f"{mine['failed']} on rank {me}; {waiting}"
        return f"every rank waits in the same collective ({where}) and none completes it"
    blamed = "; ".join(f"rank {r} {why}" for r, why in sorted(culprits.items()))
    return f"{blamed}; {waiting}"


def _parted(div: Mapping[str, Any] | None) -> str:
    if not div:
        return ""
    sides = "; ".join(
        f"rank {r}: {rec.get('op')} {rec.get('shapes')} at step {rec.get('step')} from {rec.get('site')}"
        for r, rec in div["ranks"].items()
    )
    return f". Collective sequences part at #{div['seq']} ({div['group']}): {sides}"


def divergence(states: Mapping[int, Mapping[str, Any]]) -> dict[str, Any] | None:
    """The first (group, seq) that every rank recorded but with another op, shapes or step: where the
    ranks' collective sequences parted (within the records they still keep)."""
    by_key: dict[tuple[str, int], dict[int, Mapping[str, Any]]] = {}
    for rank, state in states.items():
        for rec in state.get("recent") or []:
            by_key.setdefault((rec["group"], rec["seq"]), {})[rank] = rec
    for (group, seq), recs in sorted(by_key.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        if len(recs) < 2:
            continue
        first = next(iter(recs.values()))
        op_differs = any(not _same_op(r, first) for r in recs.values())
        if op_differs or any(r.get("step") != first.get("step") for r in recs.values()):
            return {
                "group": group,
                "seq": seq,
                "differs_in": "op" if op_differs else "step",
                "ranks": {str(r): dict(rec) for r, rec in sorted(recs.items())},
            }
    return None


def not_a_hang(verdict: Mapping[str, Any]) -> bool:
    """A collective failed because its peers left the group on purpose (their program ended, most often
    with an exception that the launcher reports with its traceback), and their collective sequences
    agree with this rank's: nothing hung."""
    states = verdict.get("states") or {}
    culprits = verdict.get("culprits") or []
    mine = states.get(verdict.get("detected_by"), {})
    return bool(
        mine.get("failed")
        and culprits
        and all(states.get(r, {}).get("exited") for r in culprits)
        and verdict.get("divergence") is None
    )


def evictable_culprits(verdict: Mapping[str, Any]) -> list[int]:
    """The culprits that live mode evicts: those that stopped publishing heartbeats (stopped, hung hard,
    cut off), and replacements still setting up past their allowance (busy in phase 'joining': the members
    go on without a replacement too slow to join). Others blamed beside them are usually their victims (a
    broadcast or ring that reached some ranks but not all parts their sequences by one); if a real bug
    remains, the next generation reports it."""
    states = verdict.get("states") or {}
    return [r for r in verdict.get("culprits") or [] if _evictable(states.get(r, {}))]


def _evictable(state: Mapping[str, Any]) -> bool:
    where = classify(state)
    return where == SILENT or (where == BUSY and state.get("phase") == JOINING)


def merge_issued(state: dict[str, Any], rec: dict[str, Any]) -> None:
    """A collective published as it was issued, newer than the heartbeat: the rank is (or died) in it."""
    recent = state.setdefault("recent", [])
    if any(r.get("group") == rec.get("group") and r.get("seq") == rec.get("seq") for r in recent):
        return
    recent.append(rec)
    if not state.get("exited"):
        state.update(waiting=rec, step=rec.get("step"), phase=rec.get("phase"), phase_for=0.0)


def format_report(report: Mapping[str, Any]) -> str:
    """The report as a terminal block: the verdict, then one section per rank with its main stack."""
    bar = "=" * 78
    out = [
        bar,
        f"lockstep: HANG DETECTED ({report.get('kind')}, hang timeout {report.get('timeout')} s): "
        f"{report.get('summary')}",
    ]
    div = report.get("divergence")
    if div:
        out.append(f"  collective sequences part at #{div['seq']} ({div['group']}):")
        for rank, rec in div["ranks"].items():
            out.append(
                f"    rank {rank}: {rec.get('op')} {rec.get('shapes')} at step {rec.get('step')} "
                f"({rec.get('phase')}) from {rec.get('site')}"
            )
    culprits = set(report.get("culprits") or [])
    for rank, state in sorted((report.get("ranks") or {}).items(), key=lambda kv: int(kv[0])):
        out += [""] + _rank_lines(int(rank), state, int(rank) in culprits)
    if report.get("path"):
        out += ["", f"full report (every thread's stack): {report['path']}"]
    out.append(bar)
    return "\n".join(out)


def _rank_lines(rank: int, state: Mapping[str, Any], culprit: bool) -> list[str]:
    where = classify(state)
    head = f"[rank {rank}] {'CULPRIT: ' if culprit else ''}{where}, at step {state.get('step')}, "
    head += f"phase {state.get('phase')!r} for {float(state.get('phase_for') or 0):.1f} s"
    if state.get("host"):
        head += f" (host {state.get('host')}, pid {state.get('pid')})"
    lines = [head]
    coll = state.get("waiting")
    if coll:
        lines.append(
            f"  in {_name(coll)} {coll.get('shapes')} for {float(state.get('waiting_for') or 0):.1f} s, "
            f"{coll.get('state')}, issued at step {coll.get('step')} from {coll.get('site')}"
        )
    elif state.get("untracked"):
        lines.append(f"  in {state['untracked']}")
    if state.get("failed"):
        lines.append(f"  failed: {state['failed']}")
    if state.get("liveness"):
        lines.append(f"  {state['liveness']}")
    stack = [f for f in state.get("stack") or [] if not any(part in f for part in _BOOTSTRAP)]
    if stack:
        note = " (as last published)" if where == SILENT else ""
        lines.append(f"  main thread stack{note}, innermost last:")
        lines += [f"    {frame}" for frame in stack[-12:]]
    return lines
