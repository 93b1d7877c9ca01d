"""Periodic (low-communication) sync: replicas step on their own and meet every H steps (DiLoCo and kin).

periodic_mode is the engine mode; outer_sync runs the outer step, with outer_reduce's quantized mean;
fragments cuts the model for streaming DiLoCo. The algorithms' names and classes, and the wire formats,
are engine/core/ (SyncPolicy reads them).

Modules:
- fragments.py: How streaming DiLoCo cuts the model into fragments, and when each fragment syncs.
- outer_reduce.py: The mean of quantized outer gradients over W >= 3 ranks: a quantized reduce-scatter, then
  an all-gather.
- outer_sync.py: Low-communication training: the replicas step locally and meet every H optimizer steps.
- periodic_mode.py: The engine mode of low-communication training: no reduction in backward, an outer sync
  every H steps.
"""
