"""The parts of one fit run below its loop: its state and registry, its data, its steps and the step
driver, its replica, optimizer and bucket size, its evaluation, low-communication training's side.

Modules:
- batches.py: Batches in the trainer: how a step's global batch is cut, split into (inputs, targets), moved,
  counted.
- buckets.py: fit's bucket size (FitConfig.bucket_cap_mb): the replica's policy with it, and what summary.json
  says of it.
- device.py: Where fit computes and in which precision: the device it trains on, and the autocast of its
  forwards.
- evaluation.py: fit's evaluation: the evaluation set cut over the ranks without padded duplicates, its
  metrics reduced.
- low_comm.py: fit's side of low-communication training (FitConfig.sync): the engine's policy, every rank's
  state in checkpoints.
- optim.py: Optimizer and learning-rate schedule from a FitConfig, and the optimizer sharded over the ranks
  (ZeRO-1).
- registry.py: One registry for a run's state: named entries, each saved and loaded by its own pair of
  functions.
- replica.py: fit's replica of the model over the current group: lockstep's handle, or torch's drop-in face.
- run_state.py: The state of one `fit()` run, its entries registered once: what a checkpoint saves, what a
  replacement receives, what a rollback puts back.
- step_driver.py: One step driver for fit's loop and `LiveLoop`: a step's work, and what a lost member makes
  of it.
- steps.py: One optimizer step of fit: its forwards and backwards, the metrics they give, then the optimizer.
- train_data.py: fit's training data: the sampler (the order, and the position a resume continues from), the
  loader, and how many of this rank's micro-batches make one step.
"""
