"""Public neural-network layers of lockstep: SyncBatchNorm that works on every device and backend.

Drop-in for torch's names: `torch.nn.SyncBatchNorm` -> `lockstep.nn.SyncBatchNorm`, and
`torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)` -> `lockstep.nn.convert_sync_batchnorm(model)`
(the classmethod `lockstep.nn.SyncBatchNorm.convert_sync_batchnorm` works too).
"""

from __future__ import annotations

from lockstep.engine.syncbn import SyncBatchNorm, convert_sync_batchnorm

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm"]
