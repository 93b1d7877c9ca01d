"""The bucketed reducer: the default engine, averaging gradients in buckets while backward runs.

The drop-in class and `replicate` both use it (through engine/replica/mode.py). Per backward: each
parameter's gradient arrives (arrivals, fast_hooks), is copied into its bucket (bucket_memory, laid out by
bucket_layout, chosen by bucket_plan or measured by bucket_tuner), and each full bucket is handed to the
communication hook in order (bucket_launch); step and phase keep one backward's books, unused handles
parameters a forward did not reach, and join and shadow let ranks that ran out of inputs follow along.

Modules:
- arrivals.py: The reducer's per-parameter path: a parameter's `.grad` is complete for this backward.
- bucket_launch.py: A reducer's buckets from copy-in to write-back: filled, handed to the communication hook
  in order, waited.
- bucket_layout.py: Bucket assignment: which parameters share a flat gradient buffer, as a pure function of
  their specs.
- bucket_memory.py: The memory of gradient buckets: flat buffers and views, per-step state, and what a hook
  receives.
- bucket_plan.py: Which buckets the reducer uses: lockstep's assignment or torch's, at construction and at the
  rebuild.
- bucket_tuner.py: Bucket size chosen by measurement (SyncPolicy(bucket_cap_mb="auto")): try a few caps, keep
  the fastest.
- fast_hooks.py: The reducer's per-parameter hooks: Python ones, and C ones that report gradients into a list.
- join.py: Uneven inputs: `join()`, in which ranks that ran out of batches shadow the collectives of the
  others.
- phase.py: The reducer's per-step phases as one enum, and the table of the changes between them that are
  legal.
- reducer.py: The reducer: averages gradients across ranks in buckets, overlapping communication with
  backward.
- shadow.py: join()'s shadow step: a synced backward's collectives, with zeros, on a rank that ran out of
  inputs.
- step.py: One backward's bookkeeping: which parameters are ready, which bucket launches next, what it cost.
- unused.py: Unused parameters: which ones a forward did not reach, and how all ranks agree on them and on
  errors.
"""
