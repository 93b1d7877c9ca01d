"""Public communication hooks under torch's names: only the import changes.

    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook as powerSGD
    ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    state = powerSGD.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=10)
    ddp.register_comm_hook(state, powerSGD.powerSGD_hook)

becomes

    from lockstep import hooks
    ddp.register_comm_hook(None, hooks.fp16_compress_hook)
    state = hooks.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=10)
    ddp.register_comm_hook(state, hooks.powerSGD_hook)

on torch's DistributedDataParallel or on lockstep's. Pass `hooks.HookState(group)` instead of a group to
the stateless hooks to count the bytes they send (`state.counter`, a BytesCounter; PowerSGDState counts
too), or `HookState(group, sum_in_fp32=True)` to sum half-precision payloads in fp32.
"""

from __future__ import annotations

from lockstep.engine.comm.compression import (
    BytesCounter,
    HookState,
    allreduce_hook,
    bf16_compress_hook,
    fp16_compress_hook,
)
from lockstep.engine.comm.powersgd import PowerSGDState, powerSGD_hook

__all__ = [
    "BytesCounter",
    "HookState",
    "PowerSGDState",
    "allreduce_hook",
    "bf16_compress_hook",
    "fp16_compress_hook",
    "powerSGD_hook",
]
