"""Rank 0's work on the checkpoint directories: a new temp directory, a complete one published (`latest`
pointed at it), leftovers of crashed saves removed (or a step a save had moved aside moved back), and the
checkpoints beyond `keep` pruned."""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path

from lockstep.checkpoint.layout import CheckpointLayout, parse_step, step_dirname, steps_to_prune
from lockstep.checkpoint.storage import explain_os_error, publish_dir, remove_quietly, write_atomic
from lockstep.errors import CheckpointError


class StepDirectories:
    """The step directories of one run's checkpoints (layout.py says where they are)."""

    def __init__(self, layout: CheckpointLayout, keep: int, log: logging.Logger) -> None:
        self.layout, self.keep, self._log = layout, keep, log

    def steps(self) -> list[int]:
        """Steps of the checkpoint directories present (valid or not), oldest first."""
        if not self.layout.root.is_dir():
            return []
        found = (parse_step(p.name) for p in self.layout.root.iterdir() if p.is_dir())
        return sorted(s for s in found if s is not None)

    def make_temp(self, step: int) -> Path:
        """The checkpoint root made, leftovers of crashed saves removed, and a new temp directory."""
        root = self.layout.root
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(
                f"cannot create the checkpoint directory {root} ({exc.strerror}): {explain_os_error(exc)}"
            ) from exc
        self.remove_leftovers()
        temp = self.layout.temp_dir(step, f"{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            temp.mkdir()
        except OSError as exc:
            raise CheckpointError(f"cannot create {temp} ({exc.strerror}): {explain_os_error(exc)}") from exc
        return temp

    def old_dir(self, step: int, temp: Path) -> Path:
        """Where a published `temp` moves the step directory it replaces (the same token)."""
        token = temp.name.rsplit("-", 2)
        return self.layout.old_dir(step, f"{token[-2]}-{token[-1]}")

    def remove_leftovers(self) -> None:
        self.recover_replaced()
        for path in self.layout.root.iterdir():
            if self.layout.is_leftover(path.name):
                remove_quietly(path)

    def recover_replaced(self) -> None:
        """A save that died between moving a step aside and publishing its replacement: move it back."""
        for path in self.layout.root.iterdir():
            step = self.layout.replaced_step(path.name)
            if step is not None and not self.layout.step_dir(step).exists():
                os.rename(path, self.layout.step_dir(step))
                self._log.warning("recovered %s, left aside by an interrupted save", step_dirname(step))

    def publish(self, step: int, temp: Path, old: Path) -> None:
        """The complete checkpoint of `step` in `temp` becomes its step directory (the one it replaces moved
        aside to `old` first); `latest` points at it, and older ones beyond `keep` are pruned."""
        final = self.layout.step_dir(step)
        publish_dir(temp, final, old)
        try:
            write_atomic(self.layout.latest, f"{final.name}\n".encode())
        except OSError as exc:  # the checkpoint itself is complete; the pointer is a convenience
            self._log.warning(
                "checkpoint %s is complete but %s could not be updated: %s", final, self.layout.latest, exc
            )
        self.prune(step)
        self._log.info("checkpoint saved: %s", final)

    def prune(self, saved: int) -> None:
        steps = self.steps()
        newer = [s for s in steps if s > saved]
        if newer:  # only reachable after resuming from an older checkpoint: those belong to an abandoned run
            self._log.warning(
                "removing checkpoints newer than the one just saved (%s): %s",
                step_dirname(saved),
                ", ".join(step_dirname(s) for s in newer),
            )
        for old in newer + steps_to_prune([s for s in steps if s <= saved], self.keep):
            remove_quietly(self.layout.step_dir(old))
