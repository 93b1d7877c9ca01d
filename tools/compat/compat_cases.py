"""torch's DDP test class, run on gloo at world size 2 with the chosen engine's DistributedDataParallel.

This module plays the part of torch's `test/distributed/test_distributed_spawn.py` (which is not in the
wheel): it sets the environment that `torch.testing._internal.distributed.distributed_test` reads at
import time, and defines `CompatDistBackend`, the spawn test class (TestDistBackend + _DistTestBase).

The engine comes from the environment variable COMPAT_ENGINE ("torch" or "lockstep"). With "lockstep",
importing this module swaps lockstep's class in for the names the tests use:
`torch.nn.parallel.DistributedDataParallel` (which the tests reach as `nn.parallel.X` and
`torch.nn.parallel.X`) and `distributed_test.DistributedDataParallel` (its `from torch.nn.parallel import
DistributedDataParallel`). torch's own class stays at `torch.nn.parallel.distributed.DistributedDataParallel`
and in `TORCH_DDP`, and lockstep is imported before the swap, so a lockstep that subclasses or refers to
torch's class at import time still gets torch's.

The test processes are started with multiprocessing spawn: each child unpickles `CompatDistBackend._run`
by module and name, so it imports this module, and the swap happens there too (the child inherits
COMPAT_ENGINE). `test_compat_swap_probe` checks the swap inside the spawned children.
"""

from __future__ import annotations

import os
from typing import Any

ENGINES = ("torch", "lockstep")
ENGINE = os.environ.get("COMPAT_ENGINE", "torch")
if ENGINE not in ENGINES:
    raise SystemExit(f"COMPAT_ENGINE must be one of {ENGINES}, got {ENGINE!r}")

# What distributed_test.py reads at import time (test_distributed_spawn.py's contract; TEMP_DIR and
# INIT_METHOD are then set per test by TestDistBackend.setUp through initialize_temp_directories).
os.environ.setdefault("BACKEND", "gloo")
os.environ.setdefault("WORLD_SIZE", "2")
os.environ.setdefault("INIT_METHOD", "env://")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.parallel  # noqa: E402
from torch.nn.parallel.distributed import DistributedDataParallel as TORCH_DDP  # noqa: E402
from torch.testing._internal import common_distributed  # noqa: E402
from torch.testing._internal.distributed import distributed_test  # noqa: E402
from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend  # noqa: E402

torch.backends.cuda.matmul.allow_tf32 = False


def _engine_class() -> type:
    if ENGINE == "torch":
        return TORCH_DDP
    from lockstep.engine.ddp import DistributedDataParallel  # imported before the swap below

    return DistributedDataParallel


ENGINE_DDP: type = _engine_class()
if ENGINE_DDP is not TORCH_DDP:
    torch.nn.parallel.DistributedDataParallel = ENGINE_DDP  # type: ignore[misc,assignment]
    distributed_test.DistributedDataParallel = ENGINE_DDP  # type: ignore[misc,assignment]


def swapped_names() -> dict[str, Any]:
    """The references the tests use, as seen in this process."""
    return {
        "torch.nn.parallel.DistributedDataParallel": torch.nn.parallel.DistributedDataParallel,
        "distributed_test.nn.parallel.DistributedDataParallel": distributed_test.nn.parallel.DistributedDataParallel,
        "distributed_test.torch.nn.parallel.DistributedDataParallel": distributed_test.torch.nn.parallel.DistributedDataParallel,
        "distributed_test.DistributedDataParallel": distributed_test.DistributedDataParallel,
    }


def set_inner_timeout(seconds: int) -> None:
    """MultiProcessTestCase's own join timeout (torch's default is 300 s, 500 s for some tests).

    The driver's hard timeout kills the whole worker; this one, a little shorter, lets torch terminate
    the ranks itself and report a timeout with their tracebacks.
    """
    common_distributed.get_timeout = lambda test_id: seconds


class CompatDistBackend(TestDistBackend, DistributedTest._DistTestBase):  # type: ignore[misc]
    """TestDistBackendWithSpawn of test_distributed_spawn.py, under a name of our own."""

    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()
        torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()

    def test_compat_swap_probe(self) -> None:
        """Runs in the spawned ranks: every name the tests use is the engine's class, and it trains."""
        expected = ENGINE_DDP
        for name, value in swapped_names().items():
            self.assertIs(value, expected, f"{name} is {value!r} in rank {self.rank}, expected {expected!r}")
        self.assertIs(
            torch.nn.parallel.distributed.DistributedDataParallel, TORCH_DDP, "torch's class was replaced"
        )
        model = ENGINE_DDP(torch.nn.Linear(2, 2))
        self.assertIs(type(model), expected)
        model(torch.ones(1, 2)).sum().backward()
        self.assertEqual(dist.get_world_size(), int(os.environ["WORLD_SIZE"]))
        self._barrier()


def describe_engine() -> str:
    """`module.qualname` of the class under test, for the report."""
    return f"{ENGINE_DDP.__module__}.{ENGINE_DDP.__qualname__}"
