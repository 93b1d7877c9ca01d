"""Atomic, rank-0-written, weights_only-loadable checkpoints of everything a run needs to continue exactly
(a sharded run's models and optimizers, and entries held rank by rank: written by every rank, its own).

Public: `CheckpointManager(run_dir, keep=3)` (save, load, steps), `CheckpointLayout` (where a run's
checkpoints live on disk) and `Stateful` (the state_dict()/load_state_dict() protocol every entry follows;
checkpoints never import the engine or the data package), `compare_checkpoints` (are two checkpoints or
runs bitwise equal, and if not, the first entry that differs) and `state_sha256` (the hash summary.json
records).

Modules:
- background.py: Checkpoints written on a thread of the writer rank while training goes on (one write at a
  time).
- compare.py: Bitwise comparison of runs: a hash of a state, and the first tensor where two checkpoints
  differ.
- directories.py: Rank 0's work on the checkpoint directories: temp directories, leftovers of crashed saves,
  pruning.
- layout.py: Where a run's checkpoints live on disk: pure path arithmetic, no I/O.
- loading.py: What a load reads and checks, then puts into the state's objects (replicated entries, a
  sharded part at any layout, a replicated checkpoint into a sharded model).
- manager.py: `CheckpointManager`: rank 0 writes atomic, checksummed checkpoints; every rank loads the newest
  valid one.
- meta.py: meta.json: what a checkpoint directory holds (step, world size, versions, each file's size and
  sha256).
- rank_part.py: Entries held rank by rank (each rank's own state, e.g. a sharded periodic run's shards
  mid-round): written by every rank into the sharded part under its rank, read back by that rank at the same
  layout only.
- rng.py: Random number generator states (python, numpy, torch, cuda) as plain JSON, captured and restored per
  rank.
- serialize.py: A checkpoint's entries read from the run's objects, the bytes of its files, and the way back
  (load_plan).
- sharded.py: A sharded run's models (DTensor parameters: FSDP2, HSDP) and optimizers through
  torch.distributed.checkpoint: pairing, every rank's shards, weights_only reading, any layout.
- sharded_save.py: A sharded checkpoint's part written by every rank, its outcome agreed by all.
- snapshot.py: A background save's copy of a checkpoint's entries in CPU memory, reused from one save to the
  next (a sharded run's: every rank's shards).
- stateful.py: The one door between checkpoints and the objects they hold: state_dict() / load_state_dict().
- storage.py: Durable file operations: atomic writes (temp file, fsync, rename, fsync dir), checksums, clear
  I/O errors.
"""

from __future__ import annotations

from lockstep.checkpoint.compare import Comparison, compare_checkpoints, state_sha256
from lockstep.checkpoint.layout import CheckpointLayout
from lockstep.checkpoint.manager import CheckpointManager
from lockstep.checkpoint.stateful import Stateful

__all__ = [
    "CheckpointLayout",
    "CheckpointManager",
    "Comparison",
    "Stateful",
    "compare_checkpoints",
    "state_sha256",
]
