"""Testing distributed code for real: N gloo ranks in subprocesses with a hard timeout, and parity checks.

Public: `run_distributed` (run a function on N fresh gloo ranks; a hang fails in seconds with every rank's
stack), `watch_collectives` (see every tensor handed to all_reduce/all_gather), from `parity` the
three-way check behind the engine's tests (`run_parity` trains `ParityCase`s with lockstep's class,
`lockstep.replicate` and torch's DDP on every rank plus one process on the whole batch, returns
`ParityRun`s and raises ParityError on the first difference: `assert_parity`, `assert_tensors_close`),
and from `pool` `RankPool`, rank processes kept alive across calls (torch imported once, a fresh group per
call; `use_pool` routes run_distributed through one). The network-namespace "hosts" and the delaying wire
of the multi-host tests and benchmarks are this repository's test bed, not the library's: testbed/.

Modules:
- collectives.py: See every tensor handed to `dist.all_reduce` / `all_gather` / `all_to_all_single`: how tests
  count bytes.
- parity.py: Train the same weights on the same data with lockstep, torch's DDP and one process, and compare
  them.
- pool.py: A pool of gloo rank processes kept alive across calls: torch is imported once, each call forms a
  fresh group.
- pool_worker.py: The process side of lockstep.testing.pool: one rank process that runs call after call, each
  on a fresh group, and says after each whether it is back in the state it started in.
- spawn.py: Run a function on N real gloo ranks in fresh subprocesses, with a fresh rendezvous and a hard
  timeout.
"""

from __future__ import annotations

from lockstep.testing.collectives import watch_collectives
from lockstep.testing.parity import ParityCase, ParityRun, assert_parity, assert_tensors_close, run_parity
from lockstep.testing.pool import RankPool, use_pool
from lockstep.testing.spawn import run_distributed

__all__ = [
    "ParityCase",
    "ParityRun",
    "RankPool",
    "assert_parity",
    "assert_tensors_close",
    "run_distributed",
    "run_parity",
    "use_pool",
    "watch_collectives",
]
