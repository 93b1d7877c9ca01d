"""What every part of the engine shares, at the bottom of it: the settings (`SyncPolicy`, with the names
it reads: the periodic sync algorithms and the wire formats of their deltas), the statistics, and the
wrap-time agreement of every rank on the model.

SyncPolicy takes every knob and hands each part of the engine its own: the bucketed reducer reads
BucketSettings (bucket_settings.py, which imports nothing of the periodic sync), engine/periodic/ reads
PeriodicSettings (periodic_settings.py, with the algorithms and the wire formats).

Modules:
- bucket_settings.py: BucketSettings: SyncPolicy's knobs that the bucketed reducer reads (engine/buckets/), and
  nothing else.
- init_sync.py: Wrap-time agreement: every rank holds the same model structure, then rank 0's values
  everywhere.
- outer_codec.py: The outer sync's wire formats: how a rank's float32 values travel to the others, and back to
  float32.
- periodic_settings.py: PeriodicSettings: SyncPolicy's knobs of low-communication training, read by
  engine/periodic/.
- policy.py: SyncPolicy: the frozen user knobs of the data-parallel engine.
- stats.py: Per-step timings and sizes of the engine, public (torch keeps them in private logging data).
- sync_algorithms.py: The periodic sync algorithms, one small class each, and `parse_sync`: the one place a
  `sync` name is read.
"""
