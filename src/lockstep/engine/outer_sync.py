"""Low-communication training: the replicas step locally and meet every H optimizer steps.

With `SyncPolicy(sync=...)` other than "allreduce", no gradient is averaged during backward; each replica
takes its own (inner) optimizer steps on its own data, and `after_optimizer_step()` brings the replicas
together every `sync_every` (H) steps:

- local_sgd: the parameters are averaged (torch's PostLocalSGD, without its synchronous warm-up);
- diloco: the outer gradient of each replica, anchor - local (the anchor: the parameters at the last
  sync, in float32), is averaged; an outer SGD step (Nesterov momentum when outer_momentum > 0, as in
  DiLoCo) moves the anchor, and every replica starts the next round from it;
- streaming_diloco: the parameters in `fragments` contiguous pieces of about equal size, each synced
  DiLoCo's way every H steps, the fragments' syncs staggered evenly over the round (fragment f at steps
  (f + 1) H / F + kH), so that the traffic of a round is spread over it instead of peaking at its end.

Floating buffers (BatchNorm statistics) are averaged with the last fragment of each round. The average
is computed in float32 on every rank in rank order: the values travel in `delta_dtype` (float32, or
bfloat16/float16 to send half the bytes), gathered from every rank and summed locally in float32; in
float32 without deterministic mode it is one all-reduce (a sum, then / W). Either way every rank gets the
same bits; with gathering, the same bits run after run whatever the backend's reduction order.

The state that a resume needs (inner steps counted, the anchor and the outer optimizer's momentum) is
`state_dict()`; the rank's own parameters and inner optimizer state are the caller's (trainer/
worker_states.py saves every rank's). Every collective is numbered for the hang watchdog
(runtime/waits.tracked, op "outer sync").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lockstep.engine.policy import SyncPolicy
from lockstep.errors import ConfigError
from lockstep.runtime.waits import tracked


def fragment_bounds(numels: Sequence[int], fragments: int) -> list[range]:
    """Parameter index ranges, contiguous and in order, of about equal total size and at least one
    parameter each: fragment f ends at the first parameter where the running total reaches (f + 1) T / F."""
    n = len(numels)
    if not 1 <= fragments <= n:
        raise ConfigError(
            f"SyncPolicy(fragments={fragments}) needs 1 to {n} fragments: the model has {n} parameters"
        )
    total, cuts, running, i = sum(numels), [0], 0, 0
    for f in range(1, fragments):
        i = max(i, cuts[-1] + 1)
        running = sum(numels[:i])
        while i < n - (fragments - f) and running < f * total / fragments:
            running += numels[i]
            i += 1
        cuts.append(i)
    cuts.append(n)
    return [range(a, b) for a, b in zip(cuts, cuts[1:])]


class OuterSync:
    """One replica's periodic sync (see the module docstring)."""

    def __init__(self, module: nn.Module, policy: SyncPolicy, group: Any, *, world: int) -> None:
        self.policy, self.group, self.world = policy, group, world
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.buffers = [b for b in module.buffers() if b.is_floating_point()]
        count = policy.fragments if policy.sync == "streaming_diloco" else 1
        self.fragments = fragment_bounds([p.numel() for p in self.params], count)
        self.inner_steps = 0  # optimizer steps since the start (after_optimizer_step calls)
        self.outer_syncs = 0  # fragments synced so far
        self.bytes_sent = 0  # payload handed to the collectives (what comm_bytes counts)
        self.anchor: list[torch.Tensor] = []
        self.outer: list[torch.optim.SGD] = []
        if policy.sync != "local_sgd":
            with torch.no_grad():
                self.anchor = [p.detach().float().clone() for p in self.params]
            self.outer = [self._outer_optimizer(fragment) for fragment in self.fragments]

    def _outer_optimizer(self, fragment: range) -> torch.optim.SGD:
        momentum = self.policy.outer_momentum
        return torch.optim.SGD(
            [self.anchor[i] for i in fragment],
            lr=self.policy.outer_lr,
            momentum=momentum,
            nesterov=momentum > 0,
        )

    # ---------------------------------------------------------------- the rounds

    def due(self, step: int) -> list[int]:
        """The fragments synced after inner step `step` (1-based): fragment f of F at (f + 1) H / F + kH."""
        every, count = self.policy.sync_every, len(self.fragments)
        return [f for f in range(count) if step % every == ((f + 1) * every // count) % every]

    def after_optimizer_step(self) -> bool:
        """Count one inner step; sync the fragments it completes. True when something was synced."""
        self.inner_steps += 1
        due = self.due(self.inner_steps)
        for f in due:
            self._sync(f)
        return bool(due)

    def _sync(self, f: int) -> None:
        fragment = self.fragments[f]
        params = [self.params[i] for i in fragment]
        last = f == len(self.fragments) - 1
        with torch.no_grad():
            if self.policy.sync == "local_sgd":
                averaged = self._mean([p.detach() for p in params])
                for p, value in zip(params, averaged):
                    p.copy_(value)
            else:
                anchor = [self.anchor[i] for i in fragment]
                outer_grads = self._mean([a - p.detach().float() for a, p in zip(anchor, params)])
                for a, grad in zip(anchor, outer_grads):
                    a.grad = grad
                self.outer[f].step()
                for a, p in zip(anchor, params):
                    a.grad = None
                    p.copy_(a)
            if last and self.buffers:
                for b, value in zip(self.buffers, self._mean([b.detach() for b in self.buffers])):
                    b.copy_(value)
        self.outer_syncs += 1

    def _mean(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The float32 mean over the ranks of each tensor (the same bits on every rank; module doc)."""
        flat = torch.cat([t.reshape(-1).float() for t in tensors])
        wire = self.policy.delta_dtype or torch.float32
        if self.world > 1:
            if wire == torch.float32 and not self.policy.deterministic:
                self._all_reduce(flat)
            else:
                flat = self._gather_sum(flat.to(wire))
            flat.div_(self.world)
        out, offset = [], 0
        for t in tensors:
            out.append(flat[offset : offset + t.numel()].view(t.shape))
            offset += t.numel()
        return out

    def _all_reduce(self, flat: torch.Tensor) -> None:
        self.bytes_sent += flat.numel() * flat.element_size()
        with tracked("outer sync (all_reduce)", [flat], self.group):
            dist.all_reduce(flat, group=self.group)

    def _gather_sum(self, payload: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(payload) for _ in range(self.world)]
        self.bytes_sent += payload.numel() * payload.element_size()
        with tracked("outer sync (all_gather)", [payload], self.group):
            dist.all_gather(parts, payload, group=self.group)
        total = parts[0].float()
        for part in parts[1:]:
            total += part.float()  # in rank order: the same bits on every rank and in every run
        return total

    # ---------------------------------------------------------------- resume

    def state_dict(self) -> dict[str, Any]:
        """What a resume needs beyond the rank's own parameters and inner optimizer: the counts, the
        anchor and the outer optimizers' momentum (the same on every rank)."""
        return {
            "sync": self.policy.sync,
            "inner_steps": self.inner_steps,
            "outer_syncs": self.outer_syncs,
            "bytes_sent": self.bytes_sent,
            "anchor": [a.clone() for a in self.anchor],
            "outer": [opt.state_dict() for opt in self.outer],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["sync"] != self.policy.sync or len(state["outer"]) != len(self.outer):
            raise ConfigError(
                f"this state was saved by sync={state['sync']!r} with {len(state['outer'])} fragment(s); this "
                f"replica runs sync={self.policy.sync!r} with {len(self.outer)}: resume with the same settings"
            )
        self.inner_steps, self.outer_syncs = int(state["inner_steps"]), int(state["outer_syncs"])
        self.bytes_sent = int(state["bytes_sent"])
        with torch.no_grad():
            for a, saved in zip(self.anchor, state["anchor"]):
                a.copy_(saved)
        for opt, saved in zip(self.outer, state["outer"]):
            opt.load_state_dict(saved)
