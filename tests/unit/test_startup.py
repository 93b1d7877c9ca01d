"""lockstep's class under torch's names (lockstep/startup, issue 37): the flag, the hook, the function.

`lockstep run --ddp lockstep` puts the start-up hook first on the workers' PYTHONPATH and says so in its
first line; the hook swaps only once torch has been imported (a process that never imports torch loads
neither torch nor the engine), reaches names that modules bound at their import (as Lightning does), and
still runs a sitecustomize it shadows. `use_lockstep_ddp()` does the same in a running process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lockstep.errors import ConfigError
from lockstep.launch.agent_config import worker_env
from lockstep.launch.console_lines import ddp_note
from lockstep.launch.spec import LaunchSpec, parse_run_args
from lockstep.startup import HOOK_DIRECTORY, python_path
from tests.helpers import child_env

SRC = str(Path(__file__).resolve().parents[2] / "src")


def test_the_flag_puts_the_hook_first_on_the_workers_path() -> None:
    spec = parse_run_args(["-n", "2", "--ddp", "lockstep", "train.py"])
    assert spec.ddp == "lockstep" and parse_run_args(["train.py"]).ddp == "torch"
    env = worker_env(spec, "1", None)
    assert env["PYTHONPATH"].split(os.pathsep)[0] == HOOK_DIRECTORY
    user = LaunchSpec("train.py", env={"PYTHONPATH": "/mine"}, ddp="lockstep")
    assert worker_env(user, "1", None)["PYTHONPATH"] == os.pathsep.join([HOOK_DIRECTORY, "/mine"])
    assert "PYTHONPATH" not in worker_env(LaunchSpec("train.py"), "1", None)
    assert ddp_note(spec) == "DDP engine lockstep (lockstep's class under torch's names)"
    assert ddp_note(LaunchSpec("train.py")) == "DDP engine torch"
    with pytest.raises(ConfigError, match="--ddp 'mine' is not one of torch, lockstep"):
        LaunchSpec("train.py", ddp="mine")
    with pytest.raises(ConfigError, match="invalid choice"):
        parse_run_args(["--ddp", "mine", "train.py"])


def test_python_path_names_the_hook_once() -> None:
    twice = python_path(python_path("/a" + os.pathsep + "/b"))
    assert twice.split(os.pathsep) == [HOOK_DIRECTORY, "/a", "/b"]
    assert python_path(None) == HOOK_DIRECTORY


_PROBE = """
import sys
import bound_early  # binds torch's class at its import, as Lightning does
import torch, torch.nn.parallel.distributed as tdist
from lockstep.engine.ddp import TorchDDP
print("TORCH", torch.nn.parallel.DistributedDataParallel.__module__, tdist.DistributedDataParallel.__module__)
print("BOUND", bound_early.DDP.__module__)
print("SUBCLASS", issubclass(torch.nn.parallel.DistributedDataParallel, TorchDDP))
print("SHADOWED", "shadowed_ran" in sys.modules)
"""


def test_the_start_up_hook_swaps_after_torch_loads(tmp_path: Path) -> None:
    (tmp_path / "bound_early.py").write_text(
        "from torch.nn.parallel.distributed import DistributedDataParallel as DDP\n"
    )
    shadowed = tmp_path / "site"  # a sitecustomize further down the path, which ours shadows
    shadowed.mkdir()
    (shadowed / "sitecustomize.py").write_text(
        "import sys, types\nsys.modules['shadowed_ran'] = types.ModuleType('x')\n"
    )
    path = os.pathsep.join([HOOK_DIRECTORY, SRC, str(tmp_path), str(shadowed)])
    env = child_env(PYTHONPATH=path)
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "TORCH lockstep.engine.ddp lockstep.engine.ddp" in out.stdout
    assert "BOUND lockstep.engine.ddp" in out.stdout and "SUBCLASS True" in out.stdout
    assert "SHADOWED True" in out.stdout
    idle = "import sys; print(sorted(m for m in ('torch', 'lockstep.engine') if m in sys.modules))"
    quiet = subprocess.run([sys.executable, "-c", idle], env=env, capture_output=True, text=True, timeout=60)
    assert quiet.stdout.strip() == "[]", quiet.stdout + quiet.stderr


def test_use_lockstep_ddp_rebinds_names_already_bound(tmp_path: Path) -> None:
    (tmp_path / "bound_early.py").write_text("from torch.nn.parallel import DistributedDataParallel as DDP\n")
    body = textwrap.dedent(
        """
        import os, bound_early, lockstep, torch
        lockstep.use_lockstep_ddp()
        lockstep.use_lockstep_ddp()  # twice is harmless
        print("BOUND", bound_early.DDP is lockstep.DistributedDataParallel)
        print("NAME", torch.nn.parallel.DistributedDataParallel is lockstep.DistributedDataParallel)
        from lockstep.startup import HOOK_DIRECTORY
        print("PATH", os.environ["PYTHONPATH"].split(os.pathsep).count(HOOK_DIRECTORY))
        """
    )
    env = child_env(PYTHONPATH=os.pathsep.join([SRC, str(tmp_path)]))
    out = subprocess.run(
        [sys.executable, "-c", body], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "BOUND True" in out.stdout and "NAME True" in out.stdout and "PATH 1" in out.stdout
