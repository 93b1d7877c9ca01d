"""Live mode in the trainer: fit's side of it and `LiveLoop`, a loop of the program's own that survives
a lost rank (the recovery itself is runtime/membership/recovery.py, shared by both).

Modules:
- live_agreed.py: Live mode inside fit: work between steps that counts on every member or on none, as a step
  does.
- live_loop.py: Live mode for a training loop of your own: `lockstep.LiveLoop`.
- live_rounds.py: Live mode for a low-communication run (FitConfig.sync): the round counts on every member or
  on none.
- live_shards.py: Live mode inside a sharded fit (issue 46): a replacement group receives its state shard for
  shard.
- live_side.py: fit's side of live mode: a part of `FitRun`, chosen once per run, and what
  runtime/membership/recovery.py asks of it (its Recoverable).
- live_takeover.py: Live mode inside fit: a new rank 0 takes over what the lost members did (their metric
  rows, the log), and the progress line that tells of a change.
"""
