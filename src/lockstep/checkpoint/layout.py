"""Where a run's checkpoints live on disk: pure path arithmetic, no I/O.

run_dir/checkpoints/
    step_000500/            one complete checkpoint, published by a single directory rename
        model.safetensors   one file per entry whose state is all tensors (models)
        state.pt            the other entries (optimizer, scheduler, scaler, sampler, plain values),
                            loadable with torch.load(weights_only=True)
        rng.json            every rank's RNG states (python, numpy, torch, cuda)
        sharded/            a sharded run's models and optimizers (DTensor parameters: FSDP2, HSDP),
            .metadata       written by every rank through torch.distributed.checkpoint: one file of
            __0_0.distcp    shards per rank, and DCP's index (the optimizer keyed by parameter name);
            __1_0.distcp    an entry held rank by rank: each rank's own state, under `<entry>/rank<r>`
        meta.json           step, world size, versions, size and sha256 of each file; written last
    latest                  the name of the newest checkpoint directory (for people and tools)
    .tmp-step_000600-...    a checkpoint being written (never loaded; removed by the next save)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from lockstep.errors import ConfigError

CHECKPOINTS = "checkpoints"
STEP_PREFIX = "step_"
TEMP_PREFIX = ".tmp-"
OLD_PREFIX = ".old-"
LATEST = "latest"
META = "meta.json"
STATE = "state.pt"
RNG = "rng.json"
SHARDED = "sharded"
TENSORS_SUFFIX = ".safetensors"
_STEP_NAME = re.compile(r"^step_(\d{6,})$")
_ENTRY_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}$")


def step_dirname(step: int) -> str:
    """'step_000500': zero-padded to 6 digits so that names sort like steps up to a million."""
    return f"{STEP_PREFIX}{step:06d}"


def parse_step(name: str) -> int | None:
    """The step of a checkpoint directory name, or None for anything else (temp dirs, `latest`, ...)."""
    match = _STEP_NAME.match(name)
    return int(match.group(1)) if match else None


def tensors_filename(entry: str) -> str:
    return f"{entry}{TENSORS_SUFFIX}"


def check_entry_name(name: object) -> str:
    """State names become file names: letters, digits, `_`, `.`, `-`; not starting with a dot."""
    if not isinstance(name, str) or not _ENTRY_NAME.match(name) or name in (META, STATE, RNG):
        raise ConfigError(
            f"checkpoint state names must be strings of letters, digits, '_', '.', '-' (not starting with '.'), "
            f"got {name!r}; rename that entry of the state dict"
        )
    return name


def steps_to_prune(steps: list[int], keep: int) -> list[int]:
    """The steps to delete so that only the newest `keep` remain (oldest first)."""
    if keep < 1:
        raise ConfigError(f"keep must be >= 1, got {keep!r}")
    ordered = sorted(set(steps))
    return ordered[: max(len(ordered) - keep, 0)]


@dataclass(frozen=True)
class CheckpointLayout:
    """The paths of one run directory's checkpoints."""

    run_dir: Path

    @property
    def root(self) -> Path:
        return self.run_dir / CHECKPOINTS

    @property
    def latest(self) -> Path:
        return self.root / LATEST

    def step_dir(self, step: int) -> Path:
        return self.root / step_dirname(step)

    def temp_dir(self, step: int, token: str) -> Path:
        return self.root / f"{TEMP_PREFIX}{step_dirname(step)}-{token}"

    def old_dir(self, step: int, token: str) -> Path:
        return self.root / f"{OLD_PREFIX}{step_dirname(step)}-{token}"

    def replaced_step(self, name: str) -> int | None:
        """The step of a directory that a save moved aside to replace it ('.old-step_000500-<token>')."""
        if not name.startswith(OLD_PREFIX):
            return None
        return parse_step(name[len(OLD_PREFIX) :].rsplit("-", 2)[0])

    def is_leftover(self, name: str) -> bool:
        """A temp or replaced directory that a crashed or finished save left behind."""
        return name.startswith((TEMP_PREFIX, OLD_PREFIX))
