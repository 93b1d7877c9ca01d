"""Where each worker's output goes: `<run_dir>/rank<R>/{stdout.log,stderr.log,error.json}`, by global rank.

A `torch.distributed.elastic.multiprocessing.LogsSpecs` (the agent's own extension point for log
placement): torch redirects every worker's stdout and stderr to these files and tells each worker its
error file through TORCHELASTIC_ERROR_FILE (worker.ERROR_FILE_VAR). Attempt k > 0 (after `--max-restarts`) writes under
`<run_dir>/restart<k>/`. Each new attempt's files are announced to the launcher through `on_attempt`.

The attempt number k is the job's, the same on every node: the one the rendezvous agreed for the round
(launch/rendezvous.py), else (static rendezvous) the number of attempts this node started before. Each
worker gets it as ATTEMPT_VAR (runtime/env/env_contract.py, which says why torch's own restart count is not
enough), its store prefix in runtime/process_group.py.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs, Std

from lockstep.launch.failure_report import HANG_REPORT
from lockstep.launch.rendezvous import AgreedAttempt
from lockstep.launch.worker import ERROR_FILE_VAR, GOODPUT_FILE, PID_FILE
from lockstep.runtime.env.env_contract import ATTEMPT_VAR, RANK_VAR, REPORT_DIR_VAR

# Called with (the job's attempt, {global rank: its directory}, the first worker's environment).
OnAttempt = Callable[[int, Mapping[int, str], Mapping[str, str]], None]
_STALE = ("stdout.log", "stderr.log", "error.json", PID_FILE, GOODPUT_FILE)


class RunDirLogs(LogsSpecs):
    """Redirect every worker's stdout/stderr into its rank directory; the console relay shows them."""

    def __init__(self, run_dir: str, on_attempt: OnAttempt, agreed: AgreedAttempt | None = None) -> None:
        super().__init__(log_dir=run_dir, redirects=Std.ALL, tee=Std.NONE)
        self._run_dir = run_dir
        self._on_attempt = on_attempt
        self._agreed = agreed
        self._started = 0  # attempts this node started: the number when no rendezvous agreed one

    @property
    def root_log_dir(self) -> str:
        return self._run_dir

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        """Called by the agent right before it starts the workers of an attempt, with their environments."""
        if not envs:
            return LogsDest()
        agreed = self._agreed.value if self._agreed is not None else None
        attempt = agreed if agreed is not None else self._started
        self._started += 1
        base = self._run_dir if attempt == 0 else os.path.join(self._run_dir, f"restart{attempt}")
        stdouts, stderrs, error_files, ranks = {}, {}, {}, {}
        for local_rank, env in envs.items():
            rank = int(env.get(RANK_VAR, local_rank))
            rank_dir = os.path.join(base, f"rank{rank}")
            os.makedirs(rank_dir, exist_ok=True)
            for name in _STALE:  # a reused --run-dir: never read (or kill by) an older run's files
                _remove(os.path.join(rank_dir, name))
            stdouts[local_rank] = os.path.join(rank_dir, "stdout.log")
            stderrs[local_rank] = os.path.join(rank_dir, "stderr.log")
            error_files[local_rank] = os.path.join(rank_dir, "error.json")
            env[ERROR_FILE_VAR] = error_files[local_rank]
            env[ATTEMPT_VAR] = str(attempt)
            env[REPORT_DIR_VAR] = base  # where the hang watchdog writes hang_report.json
            ranks[rank] = rank_dir
        _remove(os.path.join(base, HANG_REPORT))
        self._on_attempt(attempt, ranks, envs[0])
        # By keyword: LogsDest gained fields over torch releases (these three exist in all of them).
        return LogsDest(stdouts=stdouts, stderrs=stderrs, error_files=error_files)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
