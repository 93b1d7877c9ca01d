"""The summary of a fit() run: what summary.json holds, and rank 0's last words (log, plot, one line)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lockstep.checkpoint import CheckpointManager
from lockstep.runtime import get_logger, stragglers
from lockstep.runtime.run_account import describe as describe_goodput
from lockstep.runtime.timeline import merge_trace
from lockstep.trainer.reporting.progress import ProgressBar
from lockstep.trainer.reporting.run_log import RunLog
from lockstep.trainer.reporting.timeline_plot import draw_timeline
from lockstep.trainer.run.batches import BatchPlan
from lockstep.trainer.run.run_state import RunState
from lockstep.trainer.settings.config import FitConfig, config_to_dict


def straggler_summary() -> dict[str, Any]:
    """summary.json's `stragglers`: each rank that was persistently slower than the others (rank, host,
    factor, phase, steps), as rank 0's watchdog judged them (runtime/straggler_reports.py)."""
    return {"stragglers": [report.as_dict() for report in stragglers()]}


def checkpoint_summary(checkpoints: CheckpointManager) -> dict[str, Any]:
    """What saving cost this rank (rank 0's is published): seconds blocked in saves (blocking or background,
    with the end's wait for the last write), checkpoints written, and the CPU copy a background save keeps."""
    return {
        "checkpoint_stall_s": round(checkpoints.stall_s, 4),
        "checkpoints_written": checkpoints.written,
        "checkpoint_cpu_copy_bytes": checkpoints.cpu_copy_bytes,
    }


def build_summary(
    state: RunState,
    config: FitConfig,
    *,
    world_size: int,
    plan: BatchPlan,
    restarts: int | None,
    run: tuple[float, int, int],
    comm_bytes: Mapping[str, int],
) -> dict[str, Any]:
    """The summary of a run whose state is `state`; `run`: (wall seconds, samples, steps) of this call;
    `comm_bytes`: what this rank handed to the engine's collectives in this call (comm_bytes_so_far's
    counts: summary.json's comm_bytes, and per sample over all ranks; a sharded run's comm_bytes_in_group);
    `restarts`: live mode's whole-job restarts before this attempt (None outside live mode)."""
    wall, samples, steps = run
    sent = comm_bytes["comm_bytes"]
    counters, record = state.counters, state.record
    hashes = state.hashes or state.take_hashes()  # taken at the run's end (RunState.consolidate_optimizer)
    summary = {
        "world_size": world_size,
        "steps": counters.step,
        "epochs_completed": counters.epoch,
        "steps_this_run": steps,
        "samples_this_run": samples,
        "wall_time_s": round(wall, 3),
        "samples_per_second": round(samples / wall, 2) if samples and wall > 0 else None,
        "comm_bytes": sent,
        "comm_bytes_per_sample": round(sent * world_size / samples, 3) if samples else None,
        **{k: n for k, n in comm_bytes.items() if k == "comm_bytes_in_group"},
        "sync": config.sync,
        "global_batch_size": plan.global_batch_size,
        "micro_batch_size": plan.micro_batch_size,
        "deterministic": config.deterministic,
        "faults": record.faults,
        "restarts": restarts,
        # full values (a sharded model's DTensors gathered at the run's end): the same hash at any layout
        "params_sha256": hashes[0],
        "optimizer_sha256": hashes[1],  # consolidated if sharded
        "memory": state.memory.summary(state.module, state.optimizer),
        "final_train": record.last_train or None,
        **record.last_eval,
        "config": config_to_dict(config),
    }
    if "eval_accuracy" in record.last_eval:
        summary["test_accuracy"] = record.last_eval["eval_accuracy"]
    return summary


def comm_bytes_since(engine: Any, start: Mapping[str, int]) -> dict[str, int]:
    """What comm_bytes_so_far counts now, less `start` (its counts earlier)."""
    return {name: n - start.get(name, 0) for name, n in comm_bytes_so_far(engine).items()}


def comm_bytes_so_far(engine: Any) -> dict[str, int]:
    """The payload this rank's engine (a replica handle, the drop-in class, a sharded handle) has handed to
    its collectives so far, by summary.json's name: `comm_bytes`, the gradients (or, with sync, the outer
    sync's values) between the replicas; a sharded run's are between its replica groups (HSDP's
    all-reduces, a periodic sync's), and what FSDP2 sends inside a shard group is `comm_bytes_in_group`."""
    extras = engine.stats().extras
    sent = {"comm_bytes": int(extras.get("bytes_communicated_total", 0))}
    if "bytes_in_group" in extras:
        sent["comm_bytes_in_group"] = int(extras["bytes_in_group"])
    return sent


def publish_summary(summary: dict[str, Any], run_dir: Path, runlog: RunLog, bar: ProgressBar) -> None:
    """Rank 0: close the metric log, write summary.json and the plot, say how the run went."""
    runlog.close()
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot = runlog.plot(run_dir / "curves.png")
    timeline = _trace_and_picture(run_dir)
    bar.close()
    get_logger("lockstep.fit").info("run finished: %s", _headline(summary, plot, timeline))


def _trace_and_picture(run_dir: Path) -> Path | None:
    """trace.json from every rank's part (Perfetto, chrome://tracing) and timeline.png; a failure costs the
    picture, never the run's end (logged)."""
    try:
        merge_trace(run_dir)
        return draw_timeline(run_dir)
    except (OSError, ValueError) as exc:
        get_logger("lockstep.fit").warning("no trace.json or timeline.png: %s: %s", type(exc).__name__, exc)
        return None


def _headline(summary: dict[str, Any], plot: Path | None, timeline: Path | None) -> str:
    parts = [
        f"{summary['steps']} steps",
        f"{summary['wall_time_s']:.1f} s",
        f"{summary['samples_per_second']} samples/s",
    ]
    if summary.get("goodput") is not None:
        parts.append(describe_goodput(summary))
    if memory := summary.get("memory"):
        parts.append(f"model state {_size(memory['model_state_bytes'])}, peak {_size(memory['peak_bytes'])}")
    if "test_accuracy" in summary:
        parts.append(f"test_accuracy={summary['test_accuracy']:.4f}")
    if plot:
        parts.append(f"plot {plot}")
    if timeline:
        parts.append(f"timeline {timeline} (trace.json beside it)")
    return ", ".join(parts)


def _size(count: int) -> str:
    """A byte count for a person: 2656 -> '2.6 KiB'."""
    value, unit = float(count), "B"
    for larger in ("KiB", "MiB", "GiB", "TiB"):
        if value < 1024:
            break
        value, unit = value / 1024, larger
    return f"{value:.0f} B" if unit == "B" else f"{value:.1f} {unit}"
