"""SyncPolicy: the frozen user knobs of the data-parallel engine."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from lockstep.engine.core.bucket_settings import AUTO as AUTO  # re-exported: fit's bucket size
from lockstep.engine.core.bucket_settings import DEFAULT_BUCKET_CAP_MB as DEFAULT_BUCKET_CAP_MB
from lockstep.engine.core.bucket_settings import DEFAULT_FIRST_BUCKET_MB as DEFAULT_FIRST_BUCKET_MB
from lockstep.engine.core.bucket_settings import BucketSettings
from lockstep.engine.core.outer_codec import codec_for
from lockstep.engine.core.periodic_settings import PeriodicSettings
from lockstep.engine.core.sync_algorithms import SYNC_MODES as SYNC_MODES  # re-exported: FitConfig's choices
from lockstep.engine.core.sync_algorithms import SyncAlgorithm
from lockstep.plan import Plan, RunSettings

# Which of SyncPolicy's knobs each part takes: the bucketed reducer's and the periodic sync's (the other
# two, broadcast_buffers and deterministic, are the replica's: engine/replica/)
BUCKET_KNOBS = tuple(f.name for f in fields(BucketSettings))
PERIODIC_KNOBS = tuple(f.name for f in fields(PeriodicSettings))


@dataclass(frozen=True)
class SyncPolicy:
    """How gradients are bucketed and synchronized; every field has torch DDP's meaning and default.

    Each knob is read by one part of the engine, and the policy hands each part its own: `bucket_settings`
    (BucketSettings, engine/core/bucket_settings.py: the bucket knobs, what the bucketed reducer reads) and
    `periodic_settings` (PeriodicSettings, engine/core/periodic_settings.py: the knobs of the periodic
    sync, what engine/periodic/ reads); broadcast_buffers and deterministic are the replica's. Every knob
    is also a field of the policy, so `dataclasses.replace(policy, bucket_cap_mb=...)` builds both again.

    - bucket_cap_mb: size of every bucket after the first (MiB). "auto" (lockstep's, opt-in): chosen by
      measurement over the first synced steps after the rebuild among 1, 4, 10, 25, 50 and 100 MiB, the
      same on every rank (engine/buckets/bucket_tuner.py); the choice and every candidate's timings are in
      `stats().extras`. Not with torch_bucket_layout. A cap of the user's ("auto", or other than torch's
      25) is refused with deterministic or a periodic sync, which have no buckets (lockstep/plan.py).
    - first_bucket_mb: size of the first bucket, at most bucket_cap_mb (small, so that the first
      all-reduce starts early in backward).
    - find_unused_parameters: detect parameters not reached from the forward's outputs and reduce
      without them; parameters no rank used keep their `.grad` untouched (None stays None).
    - static_graph: the set of used parameters and how often each is used never changes; the first
      iteration reduces at the end of backward and learns the pattern, later ones overlap.
    - gradient_as_bucket_view: after reduction `param.grad` is a view into the flat bucket (saves a
      copy and the memory of a second copy of the gradients).
    - broadcast_buffers: broadcast buffers (BatchNorm running stats) from rank 0 before each forward
      that follows a synced training forward, like torch.
    - reduce_dtype: dtype of the bucket (the all-reduce). None: float16/bfloat16 gradients are reduced
      in float32 (summing in half precision loses bits with every rank) and cast back; every other dtype
      is reduced as is. Set it to torch.bfloat16/float16 to communicate in the parameter dtype.
    - upcast_half_precision: with reduce_dtype None, reduce float16/bfloat16 gradients in float32 (True,
      lockstep's default) or in their own dtype (False: torch's DDP, which the drop-in class follows).
    - torch_bucket_layout: lay buckets out exactly as torch's DDP does (torch's own assignment function;
      one bucket per dtype and device in the first step unless find_unused_parameters, rebuilt once in
      the observed ready order unless find_unused_parameters without static_graph; no solo buckets, no
      status element). Ring all-reduces then sum the same elements in the same order as torch's, so the
      bits equal torch's at any world size. False (lockstep's own layout): large gradients are reduced
      in place and the missing-gradient count rides in the last bucket. The drop-in class sets True.
    - deterministic: lockstep's deterministic mode (not torch's): training steps run through
      `handle.accumulate(fn, micro_batches, num_micro_batches=K, step=i)` and give the same bits at any
      world size: an exact fixed-point sum of per-micro-batch gradients, random numbers seeded per
      micro-batch, BatchNorm statistics per micro-batch, running buffers replayed in order. Buckets,
      communication hooks and join() do not apply; a training forward outside accumulate() raises.

    Low-communication training (lockstep's, opt-in; engine/periodic/outer_sync.py): with `sync` other than
    "allreduce" no gradient is averaged in backward; each replica steps its own optimizer and calls
    `handle.after_optimizer_step()` after each step, which syncs every `sync_every` steps:
    - sync: "allreduce" (every step, the default), "local_sgd" (average the parameters), "diloco" (an
      outer Nesterov SGD step on the averaged outer gradient, anchor - local), "streaming_diloco" (DiLoCo
      on `fragments` pieces of the model, their syncs staggered over the round).
    - sync_every (H), outer_lr, outer_momentum, fragments: the rounds' settings.
    - warmup_steps: data-parallel steps before the first round (gradients averaged before each optimizer
      step, through handle.before_optimizer_step()); the rounds start after them, from equal replicas.
    - outer_momentum_warmup: the outer momentum rises linearly from 0 at each fragment's first outer step
      to outer_momentum at its (outer_momentum_warmup + 1)-th (0: outer_momentum from the first).
    - fragment_layout (streaming_diloco): "sliced" (the default: every parameter's rows cut in F blocks,
      equal fragments), "strided" (layer i in fragment i mod F) or "contiguous" (engine/periodic/fragments.py).
    - mix (streaming_diloco): the local share when a fragment's outer step is merged, mix * local +
      (1 - mix) * global (Streaming DiLoCo's alpha; the anchor is the global value, saved before the mix).
    - fragment_delay (streaming_diloco): the inner steps a fragment's mean is in flight, overlapping them
      (Streaming DiLoCo's tau): launched after step t, it is applied after step t + fragment_delay (1 by
      default; 0: waited for at once; at most sync_every, so that a fragment never has two in flight).
    - delta_dtype: what the averaged values travel in: None (float32), torch.bfloat16 or torch.float16,
      or a quantized format for the outer gradients of diloco and streaming_diloco, "int8", "int4" or
      "fp4_e3m0" (per block of 128 values with a float32 scale; engine/core/outer_codec.py). The sum is in
      float32. Quantized over 3 ranks or more, the mean is quantized again for its all-gather after a
      quantized reduce-scatter (engine/periodic/outer_reduce.py: the payload ratio saved on the wire at any W).
    With deterministic=True the average is gathered and summed in rank order (the same bits run after
    run); accumulate(), buckets, hooks and join() do not apply.
    """

    bucket_cap_mb: float | str = DEFAULT_BUCKET_CAP_MB
    first_bucket_mb: float = DEFAULT_FIRST_BUCKET_MB
    find_unused_parameters: bool = False
    static_graph: bool = False
    gradient_as_bucket_view: bool = False
    broadcast_buffers: bool = True
    reduce_dtype: torch.dtype | None = None
    upcast_half_precision: bool = True
    torch_bucket_layout: bool = False
    deterministic: bool = False
    sync: str = "allreduce"
    sync_every: int = 50
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    warmup_steps: int = 0
    mix: float = 0.5
    outer_momentum_warmup: int = 10
    fragment_layout: str = "sliced"
    fragment_delay: int = 1
    fragments: int = 1
    delta_dtype: torch.dtype | str | None = None

    def __post_init__(self) -> None:
        # Each part checks its own knobs (the periodic ones first, as before the split): the same errors
        periodic = PeriodicSettings(**{name: getattr(self, name) for name in PERIODIC_KNOBS})
        buckets = BucketSettings(**{name: getattr(self, name) for name in BUCKET_KNOBS})
        object.__setattr__(self, "_periodic_settings", periodic)
        object.__setattr__(self, "_bucket_settings", buckets)
        # Which knobs combine (deterministic, the sync, "auto" against the bucket knobs) and which mode the
        # engine runs: the plan's (kept beside the fields: the policy stays a frozen value of its knobs)
        object.__setattr__(self, "_plan", Plan.of(self.run_settings()))

    @property
    def bucket_settings(self) -> BucketSettings:
        """The knobs the bucketed reducer reads (engine/buckets/): bucket_settings.py."""
        settings: BucketSettings = self.__dict__["_bucket_settings"]
        return settings

    @property
    def periodic_settings(self) -> PeriodicSettings:
        """The knobs the periodic sync reads (engine/periodic/): periodic_settings.py."""
        settings: PeriodicSettings = self.__dict__["_periodic_settings"]
        return settings

    @property
    def plan(self) -> Plan:
        """The plan of these knobs (lockstep/plan.py): its `reduction` is the engine's mode."""
        plan: Plan = self.__dict__["_plan"]
        return plan

    def run_settings(self) -> RunSettings:
        """The knobs the plan (lockstep/plan.py) decides from."""
        return RunSettings(
            deterministic=self.deterministic,
            sync=self.sync,
            sync_dtype=codec_for(self.delta_dtype).name,  # ConfigError for an unknown one
            sync_warmup=self.warmup_steps,
            fragments=self.fragments,
            fragment_delay=self.fragment_delay,
            # A cap other than torch's default is the user's (a dataclass cannot tell 25 passed from unset)
            bucket_cap_mb=None if self.bucket_cap_mb == DEFAULT_BUCKET_CAP_MB else self.bucket_cap_mb,
            static_graph=self.static_graph,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
            find_unused_parameters=self.find_unused_parameters,
            torch_bucket_layout=self.torch_bucket_layout,
            reduce_dtype=self.reduce_dtype,
        )

    # What the parts derive from their knobs, here too for the readers of the policy
    @property
    def tune_buckets(self) -> bool:
        """bucket_cap_mb="auto": the bucket tuner picks the cap (bucket_tuner.py)."""
        return self.bucket_settings.tune_buckets

    @property
    def algorithm(self) -> type[SyncAlgorithm] | None:
        """The periodic sync algorithm `sync` names (engine/core/sync_algorithms.py); None for "allreduce"."""
        return self.periodic_settings.algorithm

    @property
    def periodic(self) -> bool:
        """True for the low-communication modes: the replicas meet every sync_every steps, not every step."""
        return self.periodic_settings.periodic

    @property
    def bucket_cap_bytes(self) -> int:
        """The cap in bytes ("auto": the default's, until the tuner chooses)."""
        return self.bucket_settings.bucket_cap_bytes

    @property
    def first_bucket_bytes(self) -> int:
        return self.bucket_settings.first_bucket_bytes

    def bucket_dtype(self, grad_dtype: torch.dtype) -> torch.dtype:
        """The dtype in which gradients of `grad_dtype` are communicated."""
        return self.bucket_settings.bucket_dtype(grad_dtype)
