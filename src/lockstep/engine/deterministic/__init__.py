"""Deterministic mode and `accumulate()`: the same bits at any world size.

A step is K micro-batches spread over the ranks (micro_step); their gradients are summed exactly, in
fixed point, so the order of the sum does not matter (exact, exact_buckets, fixed_point, small_grads), and
BatchNorm's running statistics are those of one process running the micro-batches in order (running_stats).

Modules:
- exact.py: Exact, order-independent gradient sums for deterministic mode: fixed-point accumulation of micro-
  batches.
- exact_norm.py: Deterministic mode's gradient norm: one exact value whatever the layout, for clipping.
- exact_buckets.py: Deterministic mode's accumulators: which gradients are large, their float64 buckets, their
  all-reduces.
- fixed_point.py: The arithmetic of deterministic mode's exact sums: per-parameter scales and fixed-point
  kernels.
- micro_step.py: `accumulate()`: one step of K micro-batches over the ranks, by one driver with the reduction
  as a parameter.
- running_stats.py: BatchNorm running statistics in deterministic mode: as if one process had run the micro-
  batches in order.
- small_grads.py: Deterministic mode's small gradients: views of one flat buffer, handled as a few whole-
  vector operations.
"""
