"""Bad environments give the documented messages: init timeout, unavailable backend, logging by rank."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import lockstep
from lockstep.errors import BackendUnavailableError, ConfigError
from lockstep.runtime.process_group import check_backend
from lockstep.testing import run_distributed
from tests.helpers import free_port


def _run_python(code: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    clean = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    return subprocess.run(
        [sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True, timeout=timeout
    )


def test_init_timeout_names_address_port_and_what_to_check() -> None:
    port = free_port()  # nobody listens there
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    proc = _run_python("import lockstep; lockstep.init(timeout=3)", env)  # how soon: failure_latency.py
    assert proc.returncode != 0
    assert "InitTimeoutError" in proc.stderr
    assert f"[rank 1/2] could not form the process group at 127.0.0.1:{port} within 3 s" in proc.stderr
    assert "Check that all 2 processes were started" in proc.stderr


def test_partial_environment_fails_before_any_network_call() -> None:
    proc = _run_python("import lockstep; lockstep.init()", {"RANK": "0"})
    assert proc.returncode != 0
    assert "ConfigError: partial launcher environment" in proc.stderr


def test_plain_python_is_a_world_of_one_and_init_is_idempotent() -> None:
    code = (
        "import lockstep, torch.distributed as dist\n"
        "with lockstep.init() as topo:\n"
        "    again = lockstep.init()\n"
        "    print(topo.rank, topo.world_size, again is topo, dist.get_world_size(), dist.get_backend())\n"
        "print(dist.is_initialized())\n"
    )
    proc = _run_python(code, {})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["0", "1", "True", "1", "gloo", "False"]


def test_nccl_on_cpu_is_refused_with_advice() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA, so nccl on cuda is legitimate")
    with pytest.raises(BackendUnavailableError, match=r"backend 'nccl' (needs CUDA|is not available).*gloo"):
        check_backend("nccl", "cpu")
    with pytest.raises(ConfigError, match=r"unknown backend 'tcp'"):
        check_backend("tcp", "cpu")


def _log_from_every_rank() -> None:
    log = lockstep.get_logger("lockstep.test")
    log.info("info line from rank %d", lockstep.init().rank)
    log.warning("warning line from rank %d", lockstep.init().rank)


def test_rank_aware_logging(capfd: pytest.CaptureFixture[str]) -> None:
    run_distributed(_log_from_every_rank, 2, timeout=60)
    err = capfd.readouterr().err
    assert "[rank 0/2] INFO lockstep.test: info line from rank 0" in err
    assert "info line from rank 1" not in err
    assert "[rank 0/2] WARNING lockstep.test: warning line from rank 0" in err
    assert "[rank 1/2] WARNING lockstep.test: warning line from rank 1" in err
