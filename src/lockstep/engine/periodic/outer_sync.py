"""Low-communication training: the replicas step locally and meet every H optimizer steps.

With `SyncPolicy(sync=...)` other than "allreduce", no gradient is averaged during backward; each replica
takes its own (inner) optimizer steps on its own data, and `after_optimizer_step()` brings the replicas
together every `sync_every` (H) steps, by the algorithm `sync` names (one class each, sync_algorithms.py):

- local_sgd: the parameters are averaged (torch's PostLocalSGD, without its synchronous warm-up);
- diloco: the outer gradient of each replica, anchor - local (the anchor: the parameters at the last
  sync, in float32), is averaged; an outer SGD step (Nesterov momentum when outer_momentum > 0, as in
  DiLoCo, rising from 0 over the first outer_momentum_warmup outer steps) moves the anchor, and every
  replica starts the next round from it;
- streaming_diloco: the parameters in `fragments` pieces (engine/periodic/fragments.py: every parameter's
  rows sliced by default, or strided layers, or contiguous runs), each synced
  DiLoCo's way every H steps, the fragments' syncs staggered evenly over the round (fragment f at steps
  (f + 1) H / F + kH), so that the traffic of a round is spread over it instead of peaking at its end.
  A fragment's collective overlaps the next inner steps: launched after step t, it is waited for after
  step t + tau (SyncPolicy.fragment_delay, 1 by default; Streaming DiLoCo's tau), and the outer step's
  result is merged into the local values that moved on meanwhile, mix * local + (1 - mix) * global
  (Streaming DiLoCo's merge, SyncPolicy.mix, 0.5 by default). Several fragments may be in flight at
  once (tau > H / F); they are applied in the order they were launched.

With SyncPolicy.warmup_steps = N, the first N steps are data-parallel: before_optimizer_step() averages
the gradients (float32, counted in bytes_sent), and the rounds start after step N from the (equal)
replicas, whose values become the anchors.

Floating buffers (BatchNorm statistics) are averaged with the last fragment of each round. The average
is computed in float32 on every rank in rank order: the values travel in `delta_dtype` (float32,
bfloat16/float16 to send half the bytes, or the outer gradients quantized to int8 or 4 bits: the codecs
of engine/core/outer_codec.py), gathered from every rank, decoded and summed locally in float32; in float32
without deterministic mode it is one all-reduce (a sum, then / W). Quantized outer gradients over
W >= 3 ranks take a quantized reduce-scatter and an all-gather of the re-quantized mean instead
(engine/periodic/outer_reduce.py: the payload ratio saved on the wire at any W; its first phase is waited for at
the launch, its second is what stays in flight). Either way every rank gets the same bits; with
gathering, the same bits run after run whatever the backend's reduction order.

The state that a resume needs (inner steps counted, the anchor and the outer optimizer's momentum) is
`state_dict()`; `state_dict(wait=False)` does not wait for the fragments' means in flight and holds this
rank's own contribution to each instead, which `load_state_dict` sends again over the group it is loaded
into (live mode: a lost member's contribution is dropped, the survivors' mean is taken over themselves);
the rank's own parameters and inner optimizer state are the caller's (trainer/run/low_comm.py's
WorkerStates gathers every rank's; a sharded model's ShardedWorkers has each rank write its own). On a
sharded model (engine/sharded, ShardPolicy.sync) the values are each rank's local shards, and `group` the
ranks that hold the same shard in every replica group. Every collective is numbered for the hang watchdog
(runtime/waits.tracked, op "outer sync").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from lockstep.engine.core.outer_codec import Codec, codec_for, for_values
from lockstep.engine.core.policy import SyncPolicy
from lockstep.engine.core.sync_algorithms import MIX as MIX  # re-exported: streaming's merge share
from lockstep.engine.core.sync_algorithms import SyncAlgorithm, parse_sync
from lockstep.engine.periodic.fragments import Part, due_fragments, layout_fragments
from lockstep.engine.periodic.fragments import fragment_bounds as fragment_bounds  # re-exported (tests)
from lockstep.engine.periodic.outer_reduce import ScatteredMean, scatters
from lockstep.errors import ConfigError, InternalError, NotSupportedError
from lockstep.runtime.progress import PROGRESS
from lockstep.runtime.waits import wait_tracked


class _Mean:
    """A mean over the ranks, launched: `result()` waits, sums the gathered parts in rank order in float32
    (or takes the all-reduced sum), divides by the world size, and keeps the answer; or, `scattered`,
    waits for the second phase of engine/periodic/outer_reduce.py, which holds the mean. `contribution`: this
    rank's own values, until the answer is back (what a rollback in live mode sends again)."""

    def __init__(
        self,
        shapes: list[torch.Size],
        flat: torch.Tensor,
        *,
        record: Any = None,
        parts: list[torch.Tensor] | None = None,
        contribution: torch.Tensor | None = None,
        unsent: bool = False,
        codec: Codec | None = None,
        scattered: ScatteredMean | None = None,
    ) -> None:
        self.shapes, self.flat, self.record, self.parts = shapes, flat, record, parts
        self.codec = codec or Codec()  # what the gathered parts are in (outer_codec.py)
        self.scattered = scattered
        self.contribution = flat if unsent else contribution
        self.done = record is None and scattered is None and not unsent

    def launch(self, owner: OuterSync) -> None:
        """Send this rank's contribution, when it was loaded unsent (every rank launches in the same order)."""
        if self.record is None and self.scattered is None and not self.done:
            launched = owner._start_mean([self.flat])
            self.flat, self.record, self.parts = launched.flat, launched.record, launched.parts
            self.codec, self.scattered = launched.codec, launched.scattered
            self.done = launched.done

    def result(self, owner: OuterSync) -> list[torch.Tensor]:
        self.launch(owner)
        if not self.done and self.scattered is not None:
            self.flat = self.scattered.result()  # the mean already
            self.done, self.scattered, self.contribution = True, None, None
        if not self.done:
            wait_tracked(self.record, self.record.work)
            if self.parts is not None:
                numel = self.flat.numel()
                self.flat = self.codec.decode(self.parts[0], numel)
                for part in self.parts[1:]:  # in rank order: the same bits on every rank and in every run
                    self.flat += self.codec.decode(part, numel)
            self.flat.div_(owner.world)
            self.done, self.record, self.parts, self.contribution = True, None, None, None
        out, offset = [], 0
        for shape in self.shapes:
            n = shape.numel()
            out.append(self.flat[offset : offset + n].view(shape))
            offset += n
        return out


@dataclass
class _InFlight:
    """A streaming fragment's mean on its way: applied after inner step `launched` + fragment_delay."""

    fragment: int
    launched: int
    mean: _Mean


class OuterSync:
    """One replica's periodic sync (see the module docstring): the schedule and what the algorithms share;
    the algorithm (sync_algorithms.py), chosen once from the policy, says what a fragment sends and what
    the mean does to it."""

    def __init__(self, module: nn.Module, policy: SyncPolicy, group: Any, *, world: int) -> None:
        self.policy, self.group, self.world = policy, group, world
        # the periodic knobs (the policy's PeriodicSettings); of the rest only `deterministic` is read here
        self.settings = settings = policy.periodic_settings
        kind = settings.algorithm
        if kind is None:
            raise InternalError("OuterSync for SyncPolicy(sync='allreduce'): it has no periodic sync")
        self.algorithm: SyncAlgorithm = kind(mix=settings.mix, momentum_warmup=settings.outer_momentum_warmup)
        trained = [p for p in module.parameters() if p.requires_grad]
        # A sharded model's (FSDP2's DTensors): this rank's shard of each, which the ranks holding the same
        # shard in the other replica groups meet on (`group`); views of the parameters' own storage.
        self.params = [local_shard(p) for p in trained]
        self.names = [name for name, p in module.named_parameters() if p.requires_grad]  # for errors
        self.codec = codec_for(settings.delta_dtype)  # the outer gradients' wire format
        self.buffers = [b for b in module.buffers() if b.is_floating_point()]
        count = settings.fragments if kind.fragmented else 1
        held = [held_rows(p) for p in trained] if any(isinstance(p, DTensor) for p in trained) else None
        self.fragments: list[list[Part]] = layout_fragments(
            module, trained, count, settings.fragment_layout, held_rows=held
        )
        self.pieces = [
            self.algorithm.fragment(
                [part.view(self.params) for part in fragment],
                outer_lr=settings.outer_lr,
                outer_momentum=settings.outer_momentum,
            )
            for fragment in self.fragments
        ]
        # the data-parallel warm-up's steps: the policy's, or on resume the saved run's (fit's default
        # follows the run's length, which a resumed run may change)
        self.warmup_steps = settings.warmup_steps
        self.inner_steps = 0  # optimizer steps since the start (after_optimizer_step calls)
        self.outer_syncs = 0  # fragments synced so far
        self.bytes_sent = 0  # payload sent by the collectives' inputs, every phase (what comm_bytes counts)
        self.anchor = [
            a for piece in self.pieces for a in piece.anchor
        ]  # in parameter order (none: local SGD)
        self.outer = [piece.outer for piece in self.pieces if piece.outer is not None]
        self.delay = settings.fragment_delay if self.algorithm.delayed else 0
        self.pending: list[_InFlight] = []  # delayed (streaming): fragments' means on their way, oldest first
        self.buffer_means = 0  # times the float buffers took their mean (a sharded model's group shares it)

    # ---------------------------------------------------------------- the rounds

    def due(self, step: int) -> list[int]:
        """The fragments synced after inner step `step` (1-based): fragment f of F at (f + 1) H / F + kH,
        counted from the end of the warm-up (none during it)."""
        warmup = self.warmup_steps
        if step <= warmup:
            return []
        return due_fragments(step - warmup, self.settings.sync_every, len(self.fragments))

    def warming_up(self) -> bool:
        """True while the next optimizer step is one of the data-parallel warm-up's."""
        return self.inner_steps < self.warmup_steps

    def before_optimizer_step(self) -> bool:
        """The data-parallel warm-up (SyncPolicy.warmup_steps): average the gradients before each of the
        first optimizer steps, as the every-step sync does, in float32 (in rank order in deterministic
        mode). True when it did; after the warm-up, nothing to do."""
        if not self.warming_up() or self.world == 1:
            return False
        with torch.no_grad():
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
            for p, mean in zip(self.params, self._mean(grads, codec=codec_for(None))):
                p.grad = mean.to(p.dtype).view(p.shape).clone()
        return True

    def after_optimizer_step(self) -> bool:
        """Count one inner step; sync the fragments it completes. True when something was synced (or, with
        a delayed algorithm (streaming), started: it is applied fragment_delay inner steps later). The
        warm-up's last step restarts the anchors from the (equal) replicas: the first round starts there."""
        self.inner_steps += 1
        if self.inner_steps == self.warmup_steps:
            self._restart_anchors()
            return True
        self._apply_due()  # means launched fragment_delay inner steps ago
        due = self.due(self.inner_steps)
        for f in due:
            with torch.no_grad():
                names = [_part_name(self.names, part) for part in self.fragments[f]]
                reduction = self._start_mean(self.algorithm.contribution(self.pieces[f]), names=names)
            if self.algorithm.delayed:
                self.pending.append(_InFlight(f, self.inner_steps, reduction))
                self._apply_due()  # fragment_delay = 0: at once
            else:
                self._apply(f, reduction)
        return bool(due)

    def _apply_due(self) -> None:
        """Apply, oldest first, the means in flight whose fragment_delay inner steps are over."""
        while self.pending and self.pending[0].launched + self.delay <= self.inner_steps:
            entry = self.pending.pop(0)
            self._apply(entry.fragment, entry.mean)

    def flush(self) -> bool:
        """A delayed algorithm (streaming_diloco): apply the fragments still in flight now (at the end of
        training), instead of fragment_delay inner steps after their launch. True when there was one."""
        flushed = bool(self.pending)
        while self.pending:
            entry = self.pending.pop(0)
            self._apply(entry.fragment, entry.mean)
        return flushed

    def _apply(self, f: int, reduction: _Mean) -> None:
        """The fragment's mean, waited for, applied by the algorithm."""
        with torch.no_grad():
            self.algorithm.apply(self.pieces[f], reduction.result(self))
        self._after_fragment(f)

    def _after_fragment(self, f: int) -> None:
        if f == len(self.fragments) - 1 and self.buffers:  # buffers: with the last fragment of a round
            with torch.no_grad():
                buffers = [b.detach() for b in self.buffers]  # values, not differences: never quantized
                for b, value in zip(self.buffers, self._mean(buffers, codec=for_values(self.codec))):
                    b.copy_(value)
            self.buffer_means += 1
        self.outer_syncs += 1

    def _restart_anchors(self) -> None:
        """The end of the warm-up: the anchors take the replicas' values (equal on every rank: the same
        averaged gradients stepped the same optimizers), the buffers their mean; no outer momentum yet."""
        with torch.no_grad():
            for piece in self.pieces:
                for a, p in zip(piece.anchor, piece.params):
                    a.copy_(p.detach().float())
            if self.buffers:
                buffers = [b.detach() for b in self.buffers]
                for b, value in zip(self.buffers, self._mean(buffers, codec=for_values(self.codec))):
                    b.copy_(value)

    def _mean(self, tensors: list[torch.Tensor], *, codec: Codec | None = None) -> list[torch.Tensor]:
        """The float32 mean over the ranks of each tensor (the same bits on every rank; module doc)."""
        return self._start_mean(tensors, codec=codec).result(self)

    def _start_mean(
        self, tensors: list[torch.Tensor], *, codec: Codec | None = None, names: list[str] | None = None
    ) -> _Mean:
        """Launch the collective of a mean (module doc); `result()` waits for it (a wait only: one rank may
        call it alone). `codec`: the wire format (default: the outer gradients'); `names`: the tensors'
        parameters, for a codec's error."""
        flat = torch.cat([t.reshape(-1).float() for t in tensors])
        shapes = [t.shape for t in tensors]
        codec = codec or self.codec
        if self.world == 1:
            return _Mean(shapes, flat)
        sizes = [t.numel() for t in tensors]
        # quantized, W >= 3: a reduce-scatter, then an all-gather (outer_reduce.py)
        if scatters(codec, self.world):
            scattered = ScatteredMean(flat, codec, self.group, self.world, names=names or (), sizes=sizes)
            self.bytes_sent += scattered.sent
            return _Mean(shapes, flat, contribution=flat, codec=codec, scattered=scattered)
        if codec.name == "fp32" and not self.policy.deterministic:
            self.bytes_sent += flat.numel() * flat.element_size()
            mine = flat.clone()  # the all-reduce sums in place
            record = PROGRESS.issue("outer sync (all_reduce)", [flat], self.group)
            record.work = dist.all_reduce(flat, group=self.group, async_op=True)
            return _Mean(shapes, flat, record=record, contribution=mine)
        payload = codec.encode(flat, names=names or (), sizes=sizes)
        parts = [torch.empty_like(payload) for _ in range(self.world)]
        self.bytes_sent += payload.numel() * payload.element_size()
        record = PROGRESS.issue("outer sync (all_gather)", [payload], self.group)
        record.work = dist.all_gather(parts, payload, group=self.group, async_op=True)
        return _Mean(shapes, flat, record=record, parts=parts, contribution=flat, codec=codec)

    # ---------------------------------------------------------------- resume

    def state_dict(self, *, wait: bool = True) -> dict[str, Any]:
        """What a resume needs beyond the rank's own parameters and inner optimizer: the counts, the
        anchor and the outer optimizers' momentum (the same on every rank), and in streaming mode the
        means in flight (waited for here, applied when they would have been), oldest first, each with its
        fragment and the inner step it was launched after. With wait=False, a mean not back yet is not
        waited for: the state holds this rank's contribution to it, sent again (over the group it is
        loaded into) when it is due."""
        pending = []
        for entry in self.pending:
            saved: dict[str, Any] = {"fragment": entry.fragment, "launched": entry.launched}
            reduction = entry.mean
            if not wait and not reduction.done and reduction.contribution is not None:
                saved["contribution"] = reduction.contribution.clone()
            else:
                saved["mean"] = torch.cat([t.reshape(-1) for t in reduction.result(self)])
            pending.append(saved)
        return {
            "sync": self.settings.sync,
            "inner_steps": self.inner_steps,
            "warmup_steps": self.warmup_steps,
            "outer_syncs": self.outer_syncs,
            "bytes_sent": self.bytes_sent,
            "anchor": [a.clone() for a in self.anchor],
            "outer": [opt.state_dict() for opt in self.outer],
            "pending": pending,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if parse_sync(state["sync"]) is not type(self.algorithm) or len(state["outer"]) != len(self.outer):
            raise ConfigError(
                f"this state was saved by sync={state['sync']!r} with {len(state['outer'])} fragment(s); this "
                f"replica runs sync={self.settings.sync!r} with {len(self.outer)}: resume with the same settings"
            )
        self.inner_steps, self.outer_syncs = int(state["inner_steps"]), int(state["outer_syncs"])
        self.warmup_steps = int(state.get("warmup_steps", 0))  # saved before warm-ups existed: none
        self.bytes_sent = int(state["bytes_sent"])
        with torch.no_grad():
            for a, saved in zip(self.anchor, state["anchor"]):
                a.copy_(saved)
        for opt, saved in zip(self.outer, state["outer"]):
            opt.load_state_dict(saved)
        self.pending = [self._in_flight(saved) for saved in in_flight_entries(state, self.inner_steps)]
        for entry in self.pending:  # contributions sent again now, on every rank alike: a mean waited for
            entry.mean.launch(self)  # by one rank alone later (rank 0's checkpoint) finds it sent

    def _in_flight(self, saved: dict[str, Any]) -> _InFlight:
        f = int(saved["fragment"])
        shapes = [p.shape for p in self.pieces[f].params]
        if "contribution" in saved:  # sent again over this replica's group (load_state_dict)
            mean = _Mean(shapes, saved["contribution"].float().clone(), unsent=True)
        else:
            mean = _Mean(shapes, saved["mean"].float().clone())
        return _InFlight(f, int(saved["launched"]), mean)


def local_shard(param: torch.Tensor) -> torch.Tensor:
    """A parameter's values that this rank holds: a DTensor's local shard (a view of its storage: written in
    place, the parameter changes), a plain tensor itself."""
    if isinstance(param, DTensor):
        return param.to_local().detach()
    return param


def held_rows(param: torch.Tensor) -> range:
    """The rows of `param` that this rank holds: all of a plain tensor's; a DTensor sharded on its rows over
    a 1-D mesh (FSDP2's Shard(0)), its chunk (torch.chunk's: ceil(rows / ranks) each, the last ones
    shorter or empty)."""
    rows = param.shape[0] if param.dim() > 0 else 0
    if not isinstance(param, DTensor):
        return range(rows)
    mesh, placements = param.device_mesh, param.placements
    if mesh.ndim != 1 or not isinstance(placements[0], Shard) or placements[0].dim != 0:
        raise NotSupportedError(
            f"a periodic sync on a parameter laid out as {placements} over a {mesh.ndim}-D mesh: only FSDP2's "
            "rows sharded over one shard group (Shard(0) on a 1-D mesh) are built"
        )
    size = -(-rows // mesh.size())
    start = min(mesh.get_local_rank() * size, rows)
    local = param.to_local().shape[0] if param.dim() > 0 else 0
    return range(start, start + local)


def in_flight_entries(state: dict[str, Any], inner_steps: int) -> list[dict[str, Any]]:
    """A saved state's means in flight, oldest first, each with its "fragment" and "launched" step (a
    state saved before fragment_delay existed held at most one, launched after its last inner step)."""
    pending = state.get("pending") or []
    if isinstance(pending, dict):
        return [{**pending, "launched": inner_steps}]
    return list(pending)


def _part_name(names: list[str], part: Part) -> str:
    """A fragment's part as an error names it: the parameter, and its rows when the part is a slice."""
    name = names[part.index]
    return name if part.stop is None else f"{name}[{part.start}:{part.stop}]"
