"""Every helper that more than one test module uses, in one place (no test module imports another).

- Processes: the repository root, `alive(pid)`, `free_port()` (the kernel picks it: ports are never
  guessed), and the end-to-end helpers: `write` a script, `child_env` (the test's environment without
  launcher variables), `lockstep_cmd`/`run_cli`/`lockstep_cli` (the CLI with a hard timeout).
- The engine's multi-process tests: small models (`MODELS`, `build`), per-rank batches (`batch`) and
  lockstep.testing.parity cases on them (`case`).
- Deterministic mode: the model, data and digest that test_deterministic.py and test_float_accumulate.py
  train (`DetNet`, `det_data`, `det_micro`, `state_digest`).
- The trainer: `HostCopyCounter`, a tensor that records copies to the host.
- The tiny training job of the SLURM and multi-host tests (`TINY`, `result_line`, `tiny_run`; the
  `tiny_reference` fixture of tests/cli/conftest.py runs it once), and `slurm_cli`.
- The documentation site (tests/docs): `DOCS`, and `code_blocks(page)`, a Markdown page's fenced blocks.

The SLURM cluster and network-namespace "hosts" are a harness, not helpers: tests/testbed/.
Rank functions handed to lockstep.testing.run_distributed may live here: the ranks import this module.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

import lockstep
from lockstep.testing.parity import ParityCase, assert_tensors_close, grads_of, params_of, wrap
from tests.testbed.system import free_port

if TYPE_CHECKING:
    from tests.testbed.slurm_cluster import SlurmCluster

__all__ = [
    "BATCH",
    "DET_K",
    "DET_MICRO",
    "DET_STEPS",
    "DOCS",
    "IN",
    "MLP",
    "MODELS",
    "OUT",
    "ROOT",
    "RUN_TIMEOUT",
    "TINY",
    "TINY_STEPS",
    "DetNet",
    "JOB_TIMEOUT",
    "HostCopyCounter",
    "ParityCase",
    "WithUnused",
    "alive",
    "assert_close_lists",
    "batch",
    "build",
    "case",
    "child_env",
    "code_blocks",
    "det_data",
    "det_micro",
    "free_port",
    "grads_of",
    "lockstep_cli",
    "lockstep_cmd",
    "params_of",
    "result_line",
    "run_cli",
    "slurm_cli",
    "state_digest",
    "tiny_run",
    "wrap",
    "write",
]

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

# ---------------------------------------------------------------- processes and the CLI

RUN_TIMEOUT = 120.0  # a hang fails the test; a loaded 2-core machine still finishes a run in ~10-20 s


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie is dead, only not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def write(path: Path, source: str) -> Path:
    path.write_text(textwrap.dedent(source).lstrip())
    return path


def lockstep_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "lockstep", *args]


def child_env(**extra: str | None) -> dict[str, str]:
    """The test's environment without launcher variables, plus `extra` (None removes a variable)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
    }
    env.setdefault("OMP_NUM_THREADS", "1")
    for key, value in extra.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def run_cli(
    *args: str, cwd: Path, timeout: float = RUN_TIMEOUT, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        lockstep_cmd(*args), cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env or child_env()
    )


LIVE_PROGRAM = Path(__file__).parent / "cli" / "live_program.py"


def run_live_program(
    out: Path,
    launch: tuple[str, ...],
    fault: str,
    victim: int,
    at: int,
    extra: tuple[str, ...] = (),
    *,
    timeout: float,
) -> subprocess.CompletedProcess[str]:
    """tests/cli/live_program.py under `lockstep run LAUNCH` (its arguments: FAULT VICTIM AT EXTRA...), in a
    directory OUT (made if missing), where the program writes what it saw and the launcher its logs."""
    out.mkdir(exist_ok=True)
    return run_cli(
        "run",
        *launch,
        "--run-dir",
        str(out / "logs"),
        str(LIVE_PROGRAM),
        str(out),
        fault,
        str(victim),
        str(at),
        *extra,
        cwd=out.parent,
        timeout=timeout,
    )


def lockstep_cli(
    *args: str, timeout: float = 240, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """`python -m lockstep ARGS` from the repository root (the built-in jobs' data paths are relative)."""
    env = child_env()
    return subprocess.run(
        [sys.executable, "-m", "lockstep", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=cwd or ROOT,
    )


# ---------------------------------------------------------------- the engine's multi-process tests
# The three-way training itself (lockstep's engine and torch's DDP on N gloo ranks, one process on the
# concatenated N-rank batch) is lockstep.testing.parity; `case` builds its cases from the models here.

BATCH = 4
IN, OUT = 8, 3


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(IN, 16)
        self.fc2 = nn.Linear(16, 16)
        self.head = nn.Linear(16, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class ManySmall(nn.Module):
    """Many tiny parameters: several buckets with a small cap, bulk copy-in buckets."""

    def __init__(self, depth: int = 12) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, 6)
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(depth))
        self.head = nn.Linear(6, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


class ConvBN(nn.Module):
    """BatchNorm: buffers that differ per rank after every forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(IN, 12)
        self.bn = nn.BatchNorm1d(12)
        self.head = nn.Linear(12, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.fc(x))))


MODELS: dict[str, Callable[[], nn.Module]] = {"mlp": MLP, "many_small": ManySmall, "convbn": ConvBN}


def batch(rank: int, step: int, size: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(size, IN, generator=gen), torch.randint(0, OUT, (size,), generator=gen)


def build(name: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name]()


def case(name: str, steps: int, **fields: Any) -> ParityCase:
    """A lockstep.testing.parity case on one of MODELS and this module's per-rank batches."""
    return ParityCase(model=functools.partial(build, name), data=batch, steps=steps, **fields)


def assert_close_lists(
    a: list[Any], b: list[Any], *, atol: float = 1e-6, rtol: float = 1e-5, what: str = ""
) -> None:
    assert_tensors_close(a, b, atol, rtol, what=what)


class WithUnused(nn.Module):
    """`spare` is never used in forward; `extra` only when `use_extra` is set (per rank if wanted)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(IN, 16)
        self.extra = nn.Linear(16, 16)
        self.spare = nn.Linear(16, 16)
        self.head = nn.Linear(16, OUT)
        self.use_extra = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc(x))
        if self.use_extra:
            h = torch.relu(self.extra(h))
        return self.head(h)


class Tied(nn.Module):
    """Weight tying: the embedding matrix is also the output projection (used twice per forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(IN, 16, bias=False)
        self.mid = nn.Linear(16, 16)
        self.out = nn.Linear(16, IN, bias=False)
        self.out.weight = nn.Parameter(self.emb.weight.detach().t().contiguous())
        self.proj = nn.Linear(IN, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mid(self.emb(x)))
        h = torch.tanh(self.mid(h))  # `mid` used twice as well
        return self.proj(self.out(h))


class Checkpointed(nn.Module):
    """Activation checkpointing around the middle blocks (reentrant or not)."""

    def __init__(self, reentrant: bool = True, shared: bool = False, blocks: int = 3) -> None:
        super().__init__()
        self.order = [0, 1, 0] if shared else [0, 1, 2]  # shared: block 0 runs in two checkpoints
        self.inp = nn.Linear(IN, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(blocks))
        self.head = nn.Linear(16, OUT)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = self.inp(x)
        for i in self.order:
            h = checkpoint(self.blocks[i], h, use_reentrant=self.reentrant)
        return self.head(h)


class ToyMpModel(nn.Module):
    """The tutorials' DDP + model parallel model; both halves on cpu in CI."""

    def __init__(self, dev0: str = "cpu", dev1: str = "cpu") -> None:
        super().__init__()
        self.dev0, self.dev1 = dev0, dev1
        self.net1 = nn.Linear(IN, 10).to(dev0)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, OUT).to(dev1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.net1(x.to(self.dev0)))
        return self.net2(x.to(self.dev1)).cpu()


MODELS.update(
    {
        "unused": WithUnused,
        "tied": Tied,
        "ckpt_reentrant": lambda: Checkpointed(True),
        "ckpt_plain": lambda: Checkpointed(False),
        "toymp": ToyMpModel,
        "ckpt_shared": lambda: Checkpointed(True, shared=True),  # block 2 unused
        "ckpt_twice": lambda: Checkpointed(True, shared=True, blocks=2),  # every parameter used
    }
)

# ---------------------------------------------------------------- deterministic mode's model
# What makes bits depend on the world size in the default mode: BatchNorm (statistics and running
# buffers), SyncBatchNorm (statistics shared across ranks), dropout (random masks), a weight used twice, a
# large weight (taken in its hook) and many small ones (taken together). DET_STEPS steps of a global batch
# of DET_K micro-batches of DET_MICRO samples.

DET_STEPS, DET_K, DET_MICRO = 5, 6, 4


class DetNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(
            3, 8, 3, padding=1, bias=False
        )  # a bias before BatchNorm gets noise for a gradient
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.sync = lockstep.nn.SyncBatchNorm(8)
        self.drop = nn.Dropout(0.3)
        self.big = nn.Linear(8 * 8 * 8, 160)  # 81,920 weights: taken in its hook
        self.shared = nn.Linear(160, 160)  # used twice
        self.head = nn.Linear(160, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.conv(x)))
        h = torch.relu(self.sync(self.conv2(h)))
        h = self.drop(torch.relu(self.big(h.flatten(1))))
        h = torch.relu(self.shared(torch.relu(self.shared(h))))
        return self.head(h)


def det_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(DET_STEPS * DET_K * DET_MICRO, 3, 8, 8, generator=g) * 3 + 1
    y = torch.randint(0, 5, (DET_STEPS * DET_K * DET_MICRO,), generator=g)
    return x, y


def det_micro(
    data: tuple[torch.Tensor, torch.Tensor], step: int, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    start = (step * DET_K + k) * DET_MICRO
    return data[0][start : start + DET_MICRO], data[1][start : start + DET_MICRO]


def state_digest(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """sha256 of the model's state_dict and the optimizer's state: equal digests, equal bits."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode() + t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    for index, state in sorted(optimizer.state_dict()["state"].items()):
        for key, t in sorted(state.items()):
            h.update(
                f"{index}.{key}".encode()
                + torch.as_tensor(t).reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
            )
    return h.hexdigest()


# ---------------------------------------------------------------- the trainer


class HostCopyCounter(torch.Tensor):
    """A tensor that records every call that copies its value to the host (on a GPU, each waits for the GPU)."""

    calls: ClassVar[list[str]] = []
    HOST_COPIES: ClassVar[tuple[str, ...]] = (
        "item",
        "tolist",
        "cpu",
        "numpy",
        "__float__",
        "__int__",
        "__bool__",
    )

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") in cls.HOST_COPIES:
            cls.calls.append(func.__name__)
        return super().__torch_function__(func, types, args, kwargs or {})


# ---------------------------------------------------------------- the tiny job of the SLURM and multi-host tests

TINY = ROOT / "tests" / "testbed" / "tiny_train.py"
TINY_STEPS = "30"
JOB_TIMEOUT = 120.0  # one tiny job, local, on SLURM or on two hosts


def result_line(text: str) -> dict[str, str]:
    """The key=value pairs of the one `RESULT ...` line tiny_train.py prints."""
    lines = [line for line in text.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, f"expected one RESULT line, got {lines!r} in:\n{text}"
    return dict(item.split("=", 1) for item in lines[0].split()[1:])


def tiny_run(cwd: Path) -> dict[str, str]:
    """The tiny job on this machine with `lockstep run -n 2` (no SLURM, one host): its RESULT line."""
    out = subprocess.run(
        lockstep_cmd("run", "-n", "2", "--run-dir", "run", str(TINY), "--steps", TINY_STEPS),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT,
        env=child_env(),
    )
    assert out.returncode == 0, out.stderr
    return result_line(out.stdout)


def slurm_cli(cluster: SlurmCluster, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`lockstep slurm ...` through the CLI dispatcher, on the cluster's login side (sbatch on PATH)."""
    return cluster.run(
        [sys.executable, "-m", "lockstep", "slurm", *args], cwd=cwd, env={"OMP_NUM_THREADS": "1"}
    )


# ------------------------------------------------------------- the overlapped optimizer's tests (shared)


def warmup_decay(step: int) -> float:
    """An LR factor for LambdaLR: warm-up, then decay (the overlapped optimizer's tests)."""
    return min(1.0, (step + 1) / 2) * 0.8**step


class ReductionsStarted:
    """The asynchronous all-reduces this process starts inside `with watch:`, so that a backward can wait
    for them (`WaitInBackward`): `dist.all_reduce` is replaced by a pass-through that keeps each one's
    future, and the engine's buckets take `dist.all_reduce` while it is replaced (as under
    lockstep.testing.watch_collectives), the same collective with the same bits. `expected`: a wait with
    no reduction started before it is an error (where a test asserts a step during backward, such a wait
    would prove nothing); False where the wait only gives the overlap a chance."""

    TIMEOUT = 60.0  # a hard limit: reductions not back by then are a hang, not a slow machine

    def __init__(self, *, expected: bool = True) -> None:
        self.futures: list[torch.futures.Future[Any]] = []
        self.expected = expected
        self._real: Any = None

    def __enter__(self) -> ReductionsStarted:
        import torch.distributed as dist

        self._real = real = dist.all_reduce

        def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            work = real(tensor, *args, **kwargs)
            if work is not None:  # async_op=True: the Work whose future the engine polls
                self.futures.append(work.get_future())
            return work

        dist.all_reduce = all_reduce  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        import torch.distributed as dist

        dist.all_reduce, self._real = self._real, None  # type: ignore[assignment]

    def wait_all(self) -> None:
        """Return once every all-reduce started so far has completed (those started meanwhile too)."""
        if self.expected and not self.futures:  # the wait would prove nothing: no reduction was seen
            raise RuntimeError("no all-reduce started through dist.all_reduce before this wait")
        deadline = time.monotonic() + self.TIMEOUT
        while not all(future.done() for future in list(self.futures)):
            if time.monotonic() > deadline:
                pending = sum(not future.done() for future in self.futures)
                raise TimeoutError(f"{pending} all-reduce(s) not back after {self.TIMEOUT:.0f} s")
            time.sleep(0.001)


class WaitInBackward(torch.autograd.Function):
    """Identity whose backward waits until the all-reduces started before it are back (`watch.wait_all`;
    None: no wait): the buckets launched earlier in this backward have then completed, and an engine that
    steps a bucket as soon as its reduction is back must step them at its next launch, while backward
    goes on. An event, not a sleep: it holds on a loaded machine, and proves nothing by itself."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, watch: ReductionsStarted | None) -> torch.Tensor:
        ctx.watch = watch
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        if ctx.watch is not None:
            ctx.watch.wait_all()
        return grad, None


def small_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """6 samples of 8 features and 3 classes, a function of (rank, step)."""
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(6, 8, generator=gen), torch.randint(0, 3, (6,), generator=gen)


# ---------------------------------------------------------------- the documentation site

_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)


def code_blocks(page: Path) -> list[tuple[str, str]]:
    """(language, text) of each fenced code block of a Markdown page, in order (fences start a line)."""
    return [(m.group(1), m.group(2)) for m in _FENCE.finditer(page.read_text())]
