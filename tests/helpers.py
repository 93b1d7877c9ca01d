"""Every helper that more than one test module uses, in one place (no test module imports another).

- Processes: the repository root, `alive(pid)`, `wait_for_state(pid, letters)`, `free_port()` (the kernel picks it: ports are never
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
- The GPU tier (tests/gpu): `GPU_MARKS`, `GPU_DEVICE`, `GPU_BACKEND`, `gpu_device()`, `needs_cuda`, and
  the switch LOCKSTEP_GPU_TIER_ON_CPU=1 that runs the tier on the CPU to check the tests themselves.
- The periodic sync modes' reference (test_outer_sync.py, tests/gpu): `outer_model`, `outer_inner`,
  `outer_reference`, `scattered_mean`, on any device.

The SLURM cluster and network-namespace "hosts" are a harness, not helpers: testbed/.
Rank functions handed to lockstep.testing.run_distributed may live here: the ranks import this module.
"""

from __future__ import annotations

import functools
import hashlib
import multiprocessing as mp
import os
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import pytest
import torch
import torch.distributed as dist
from torch import nn

import lockstep
from lockstep.engine.core.outer_codec import codec_for
from lockstep.engine.periodic.outer_sync import MIX, fragment_bounds
from lockstep.testing.parity import ParityCase, assert_tensors_close, grads_of, params_of, wrap
from testbed.system import free_port

if TYPE_CHECKING:
    from testbed.slurm_cluster import SlurmCluster

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
    "GPU_BACKEND",
    "GPU_DEVICE",
    "GPU_MARKS",
    "GPU_TIER_ON_CPU",
    "OUTER_EVERY",
    "OUTER_STEPS",
    "OUTER_STRIDED",
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
    "gpu_device",
    "grads_of",
    "lockstep_cli",
    "lockstep_cmd",
    "needs_cuda",
    "outer_inner",
    "outer_model",
    "outer_reference",
    "params_of",
    "result_line",
    "run_cli",
    "scattered_mean",
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


def start_members(target: Callable[..., None], members: tuple[int, ...]) -> tuple[Any, list[Any], Any]:
    """Spawned processes `target(store_port, member, results)`, one per member, around a TCPStore that this
    process hosts: (the store, which must outlive them, the processes, the results queue)."""
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(store.port, member, results)) for member in members]
    for proc in procs:
        proc.start()
    return store, procs, results


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie is dead, only not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_for_state(pid: int, letters: str) -> None:
    """Wait (up to 5 s) until process `pid` is in one of the /proc states `letters` (T: stopped, R/S: running)."""
    for _ in range(500):
        with open(f"/proc/{pid}/stat") as fh:
            if fh.read().rsplit(")", 1)[1].split()[0] in letters:
                return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} never reached a state in {letters!r}")


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

TINY = ROOT / "testbed" / "tiny_train.py"
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


# ---------------------------------------------------------------- the GPU tier (tests/gpu)

# LOCKSTEP_GPU_TIER_ON_CPU=1 runs tests/gpu where there is no GPU, to check the tests' own logic before a
# GPU session: the device is then "cpu" and gloo stands in for nccl. What only CUDA can show (a replica on
# two device types) stays skipped, with `needs_cuda`.
GPU_TIER_ON_CPU = os.environ.get("LOCKSTEP_GPU_TIER_ON_CPU") == "1"
GPU_DEVICE = "cpu" if GPU_TIER_ON_CPU else "cuda"
GPU_BACKEND = "gloo" if GPU_TIER_ON_CPU else "nccl"  # NCCL: one rank per GPU, so world 1 on one GPU
GPU_MARKS = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not GPU_TIER_ON_CPU and not torch.cuda.is_available(),
        reason="needs a CUDA device (LOCKSTEP_GPU_TIER_ON_CPU=1 runs it on the CPU)",
    ),
]
needs_cuda = pytest.mark.skipif(GPU_TIER_ON_CPU, reason="only a CUDA device shows it")


def gpu_device() -> torch.device:
    """The GPU tier's device in a rank: cuda:0 (every rank shares the one GPU), or the CPU (see above)."""
    return torch.device("cpu") if GPU_TIER_ON_CPU else torch.device("cuda", 0)


# ---------------------------------------------------------------- the periodic sync modes' reference
#
# Low-communication training (SyncPolicy.sync) against a reference (tests/multiproc/test_outer_sync.py, and
# on CUDA tests/gpu/test_gpu_sync.py): every worker runs in one process, one after the other, with the
# same inner math (each its own model copy, AdamW and data) and the outer math written out plainly: the
# mean of the parameters (local SGD), or the mean of the outer gradients anchor - local fed to torch's SGD
# with Nesterov momentum (rising from 0 to 0.9 over the first outer steps, the default) on the anchor
# (DiLoCo), fragment by fragment on their staggered steps, each applied fragment_delay inner steps after
# its launch (one by default; several may be in flight at once) and merged with the local values
# (streaming). Quantized outer gradients over 3 ranks or more take the engine's reduce-scatter
# (engine/periodic/outer_reduce.py): `scattered_mean` writes it out.

OUTER_STEPS, OUTER_EVERY = 9, 3


def outer_model(width: int = 7, device: str | torch.device = "cpu") -> nn.Module:
    """The model of the periodic sync modes' tests: the same weights on every worker, on `device`."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, width), nn.Tanh(), nn.Linear(width, 3), nn.BatchNorm1d(3)).to(device)


def outer_inner(model: nn.Module, opt: torch.optim.Optimizer, worker: int, step: int) -> None:
    """One inner step of `worker` (its data a function of worker and step, made on the CPU, then moved to
    the model's device)."""
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(1000 * worker + step))
    model(x.to(next(model.parameters()).device)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


# streaming's fragments of outer_model() (fragments=2): the strided layout deals its layers (Linear, Linear,
# BatchNorm) out in turn, the contiguous one cuts runs of about equal size
OUTER_STRIDED = [[0, 1, 4, 5], [2, 3]]


def scattered_mean(flats: list[torch.Tensor], wire: str) -> torch.Tensor:
    """The quantized mean over 3 ranks or more: the values cut into one chunk of whole 128-value blocks per
    rank (B = qW + r blocks: the first r chunks take q + 1 blocks, the others q); each worker's chunk takes
    the codec's round trip, they are summed in rank order, / W, and the mean takes the round trip again."""
    codec, world, numel = codec_for(wire), len(flats), flats[0].numel()
    blocks = -(-numel // 128)

    def round_trip(values: torch.Tensor) -> torch.Tensor:
        return codec.decode(codec.encode(values), values.numel())

    chunks = []
    for j in range(world):
        q, r = divmod(blocks, world)
        start, stop = (min(numel, (i * q + min(i, r)) * 128) for i in (j, j + 1))
        total = round_trip(flats[0][start:stop])
        for flat in flats[1:]:
            total = total + round_trip(flat[start:stop])
        chunks.append(round_trip(total / world))
    return torch.cat(chunks)


def outer_reference(
    sync: str,
    world: int,
    wire: torch.dtype | str | None,
    layout: str = "strided",
    delay: int = 1,
    width: int = 7,
    gather: bool = False,
    device: str | torch.device = "cpu",
) -> list[dict[str, torch.Tensor]]:
    """Every worker in this process; the outer math written out (see this section's comment). `wire`: a
    dtype the values are cast to, or a quantized format whose round trip each worker's outer gradient
    takes (the float buffers then travel in float32; over 3 workers or more: `scattered_mean`, unless
    `gather`: what the all-gather of 2 ranks would give at this world size)."""
    models = [outer_model(width, device) for _ in range(world)]
    opts = [torch.optim.AdamW(m.parameters(), lr=0.05) for m in models]
    params = [[p for p in m.parameters()] for m in models]
    anchor = [p.detach().float().clone() for p in params[0]]
    count = 2 if sync == "streaming_diloco" else 1
    frags: list[Any] = fragment_bounds([p.numel() for p in params[0]], count)
    if count > 1 and layout == "strided":
        frags = OUTER_STRIDED
    outer = [torch.optim.SGD([anchor[i] for i in f], lr=0.7, momentum=0.9, nesterov=True) for f in frags]

    def mean(per_worker: list[list[torch.Tensor]], *, values: bool = False) -> list[torch.Tensor]:
        flats = [torch.cat([t.reshape(-1).float() for t in ts]) for ts in per_worker]
        if isinstance(wire, str) and not values and world >= 3 and not gather:
            total = scattered_mean(flats, wire)
        else:
            if isinstance(wire, str) and not values:
                codec = codec_for(wire)
                flats = [codec.decode(codec.encode(f), f.numel()) for f in flats]
            elif isinstance(wire, torch.dtype):
                flats = [f.to(wire) for f in flats]
            total = flats[0].float()
            for f in flats[1:]:
                total = total + f.float()  # rank order, as the engine sums (W=2: a + b either way)
            total = total / world
        out, offset = [], 0
        for t in per_worker[0]:
            out.append(total[offset : offset + t.numel()].view(t.shape))
            offset += t.numel()
        return out

    ramp = lockstep.SyncPolicy().outer_momentum_warmup  # the default: momentum 0 -> 0.9 over 10 outer steps
    taken = [0] * len(frags)

    def outer_step(f: int, grads: list[torch.Tensor]) -> None:
        for i, g in zip(frags[f], grads):
            anchor[i].grad = g
        taken[f] += 1
        outer[f].param_groups[0]["momentum"] = 0.9 * min(1.0, (taken[f] - 1) / ramp)
        outer[f].step()
        for i in frags[f]:
            anchor[i].grad = None

    def after_fragment(f: int) -> None:
        if f == count - 1:
            bufs = [[b for b in m.buffers() if b.is_floating_point()] for m in models]
            avg = mean(bufs, values=True)
            for w in range(world):
                for b, value in zip(bufs[w], avg):
                    b.copy_(value)

    def merge(f: int, grads: list[torch.Tensor]) -> None:  # streaming: `delay` inner steps after the launch
        outer_step(f, grads)
        for w in range(world):
            for i in frags[f]:
                params[w][i].copy_(params[w][i].float().mul_(MIX).add_(anchor[i], alpha=1 - MIX))
        after_fragment(f)

    pending: list[tuple[int, int, list[torch.Tensor]]] = []  # (apply after step, fragment, mean), in order
    for step in range(OUTER_STEPS):
        for w in range(world):
            outer_inner(models[w], opts[w], w, step)
        done = step + 1
        with torch.no_grad():
            while pending and pending[0][0] <= done:
                merge(*pending.pop(0)[1:])
            for f, frag in enumerate(frags):
                if done % OUTER_EVERY != ((f + 1) * OUTER_EVERY // count) % OUTER_EVERY:
                    continue
                if sync == "streaming_diloco":
                    grads = mean([[anchor[i] - params[w][i].float() for i in frag] for w in range(world)])
                    pending.append((done + delay, f, grads))
                    while pending and pending[0][0] <= done:  # delay 0: at once
                        merge(*pending.pop(0)[1:])
                    continue
                if sync == "local_sgd":
                    avg = mean([[params[w][i] for i in frag] for w in range(world)])
                    for w in range(world):
                        for i, value in zip(frag, avg):
                            params[w][i].copy_(value)
                else:
                    outer_step(
                        f, mean([[anchor[i] - params[w][i].float() for i in frag] for w in range(world)])
                    )
                    for w in range(world):
                        for i in frag:
                            params[w][i].copy_(anchor[i])
                after_fragment(f)
    return [m.state_dict() for m in models]
