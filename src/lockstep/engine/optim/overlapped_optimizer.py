"""The optimizer of an overlapped step: the user's optimizer, stepped bucket by bucket by the engine.

`OverlappedOptimizer` is what `handle.overlap_optimizer(optimizer)` returns. The engine (optimizer_steps.py)
steps the parameters of each bucket as soon as its averaged gradients are back; `step()` then steps
every parameter the engine did not reach (all of them when the optimizer falls back), and a new step
begins. It holds no state of its own: `param_groups`, `state`, `state_dict()` and `load_state_dict()`
are the wrapped optimizer's, so LR schedulers, GradScaler and checkpoints see the same optimizer.

Why a step restricted to some parameters gives the bits of the whole step: SGD, Adam and AdamW compute
each parameter's update from that parameter's own gradient and state alone (no norm over the model),
and skip a parameter whose `.grad` is None. A restricted step swaps each param_group's 'params' list for
the parameters of the bucket for the duration of one `optimizer.step()` (lr, betas and the rest of the
group stay as they are, so a scheduler's lr applies), which runs the same per-parameter arithmetic as
the full step on the single-tensor path, and the same per-element kernels on the foreach and fused
paths. torch's own overlap (DDP's `_register_fused_optim`, `_apply_optimizer_in_backward`) steps a
separate optimizer per parameter or a functional copy in the all-reduce's callback thread, with state
that is not the user's optimizer's; this one keeps the user's optimizer, on the thread that runs backward.

What could make the result silently different is refused: a gradient changed after its parameter
stepped (clipping or unscaling that was not declared: the `.grad`'s version counter moved), a group's
setting changed after some buckets stepped with the old one (a scheduler stepped before `step()`), a
second synced backward before `step()`, or the wrapped optimizer stepped directly: each raises UsageError.

A ShardedOptimizer (`handle.overlap_optimizer(handle.shard_optimizer(optimizer))`) overlaps too: the
restricted steps take only the parameters this rank owns, and its broadcasts (shard_overlap.py, made by
the engine) send each bucket's updated parameters from their owners as soon as they stepped; step()
steps what is left of the share and waits for every broadcast. The fallback steps the ShardedOptimizer
whole. The two behaviours are one object each behind shard_overlap.py's `StepParams`, chosen once at
construction: `WholeParams` or `ShardedParams`; the optimizer holds it as `params_stepped`.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from lockstep.engine.optim.shard_optimizer import ShardedOptimizer
from lockstep.engine.optim.shard_overlap import BucketBroadcasts, ShardedParams, StepParams, WholeParams
from lockstep.errors import UsageError

_Stepped = tuple[torch.Tensor, "torch.Tensor | None", int]


def _registry(name: str) -> Any:
    """A read-only attribute that is the wrapped optimizer's attribute `name`."""
    return property(lambda self: getattr(self.optimizer, name))


class OverlappedOptimizer(torch.optim.Optimizer):
    """The user's optimizer with the step of each bucket's parameters taken during backward.

    `fallback`: why this optimizer cannot overlap (it then steps as a plain optimizer and says why once,
    as a warning); None when the engine steps its buckets. Use it as the optimizer: `step()`,
    `zero_grad()`, LR schedulers, `GradScaler.step(...)`, `state_dict()`. Hooks registered on it are
    the wrapped optimizer's: a step hook runs for each partial step (per bucket).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer | ShardedOptimizer,
        *,
        fallback: str | None,
        tag: str = "",
        broadcasts: BucketBroadcasts | None = None,
    ) -> None:
        # torch.optim.Optimizer.__init__ is not called: the groups and the state are the wrapped one's
        # (as torch's PostLocalSGDOptimizer does), so there is one source of truth.
        # What this rank steps, chosen once: every parameter, or its share (`broadcasts`: the owners'
        # broadcasts of each stepped bucket, sharded and overlapped at world > 1, made by the engine).
        self.params_stepped: StepParams
        if isinstance(optimizer, ShardedOptimizer):
            self.optimizer, self.params_stepped = optimizer.optimizer, ShardedParams(optimizer, broadcasts)
        else:
            self.optimizer, self.params_stepped = optimizer, WholeParams(optimizer)
        self._tag = tag
        self._fallback = fallback
        self.fallback_reasons: list[str] = []  # every reason this optimizer stepped plainly for, once each
        self.buckets_stepped_in_backward = 0  # while backward ran (the reduction came back before its end)
        self.buckets_stepped_at_finalize = 0  # at the end of backward, each after its wait
        self._stepped: dict[int, _Stepped] = {}  # id(p) -> (p, its .grad then, that grad's version)
        self._positions: dict[int, tuple[int, int]] | None = None  # id -> (group, position), this step
        self._inside = False  # a restricted step of ours runs now
        self._state_len = len(optimizer.state)  # entries in the state when this step began
        self._settings: list[dict[str, Any]] = []  # the groups' lr etc. when the engine first stepped
        self._broken = ""  # why the next step() must raise (a backward raised after some buckets stepped)
        if fallback is not None:
            self._say(fallback)
        ref = weakref.ref(self)
        self._guard = self.optimizer.register_step_pre_hook(lambda opt, args, kwargs: _guard(ref, opt))

    # Read through, never copied: load_state_dict() gives the wrapped optimizer new groups and state.
    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property  # type: ignore[override]
    def state(self) -> Any:  # type: ignore[override]
        """The wrapped optimizer's state; sharded, this rank's share (keyed by its units)."""
        return self.params_stepped.state

    @property  # type: ignore[override]
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    # torch.optim.Optimizer's hook registries, which its register_*_hook methods write into: the wrapped
    # optimizer's, so that its step() and state_dict() run the hooks registered on either object.
    _optimizer_step_pre_hooks = _registry("_optimizer_step_pre_hooks")  # type: ignore[assignment]
    _optimizer_step_post_hooks = _registry("_optimizer_step_post_hooks")  # type: ignore[assignment]
    _optimizer_state_dict_pre_hooks = _registry("_optimizer_state_dict_pre_hooks")  # type: ignore[assignment]
    _optimizer_state_dict_post_hooks = _registry("_optimizer_state_dict_post_hooks")  # type: ignore[assignment]
    _optimizer_load_state_dict_pre_hooks = _registry(  # type: ignore[assignment]
        "_optimizer_load_state_dict_pre_hooks"
    )
    _optimizer_load_state_dict_post_hooks = _registry(  # type: ignore[assignment]
        "_optimizer_load_state_dict_post_hooks"
    )

    @property
    def overlapped(self) -> bool:
        """True when the engine steps this optimizer's buckets during backward (no fallback)."""
        return self._fallback is None

    @property
    def pending(self) -> bool:
        """Some parameters stepped in the engine since the last step()."""
        return bool(self._stepped)

    # ---------------------------------------------------------------- the engine's side (optimizer_steps.py)

    def step_params(self, params: Iterable[torch.Tensor]) -> None:
        """Step `params` (those of this optimizer, each once per step) with the wrapped optimizer."""
        positions = self._positions
        if positions is None:  # this rank's parameters (its share, when sharded)
            mine = self.params_stepped.mine()
            positions = self._positions = {
                id(p): (g, k)
                for g, group in enumerate(self.param_groups)
                for k, p in enumerate(group["params"])
                if id(p) in mine
            }
        chosen = sorted(positions[id(p)] for p in params if id(p) in positions and id(p) not in self._stepped)
        if not chosen:
            return
        if not self._stepped:  # the engine's first steps of this step: the settings they step with
            self._settings = _settings(self.param_groups)
        groups: list[list[torch.Tensor]] = [[] for _ in self.param_groups]
        for g, k in chosen:
            groups[g].append(self.param_groups[g]["params"][k])
        self._restricted_step(groups)
        for group in groups:
            for p in group:
                grad = p.grad
                self._stepped[id(p)] = (p, grad, grad._version if grad is not None else -1)

    def broke(self, message: str) -> None:
        """A backward raised after the engine stepped some buckets: the next step() raises `message`."""
        self._broken = message

    def suspend(self, reason: str) -> None:
        """This step falls back (the engine steps nothing): say why, once per reason."""
        self._say(reason)

    def check_no_pending(self) -> None:
        """A synced backward begins: the previous one's steps must have been finished by step()."""
        if self._stepped or self.params_stepped.in_flight():
            raise UsageError(
                f"{self._tag}a synced backward began before optimizer.step() finished the previous one: with "
                "overlap_optimizer the engine steps each bucket's parameters during the synced backward, so a "
                "second synced backward would step them again. Call step() after each synced backward, and "
                "accumulate gradients over several backwards inside handle.no_sync()"
            )

    # ---------------------------------------------------------------- torch.optim.Optimizer's interface

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Finish the step: every parameter the engine did not step during backward takes its step now."""
        broken, self._broken = self._broken, ""
        if broken:
            self._reset()
            raise UsageError(f"{self._tag}{broken}")
        # sharded: every rank decides alike (the broadcasts are in flight), even one owning none
        if not self._stepped and not self.params_stepped.in_flight():
            return self._plain(closure)
        try:
            self._check_gradients_unchanged()
            self._check_settings_unchanged()
            if closure is not None:
                self._reset()
                raise UsageError(
                    f"{self._tag}optimizer.step(closure) re-evaluates the loss, but with overlap_optimizer the "
                    "parameters of the reduced buckets already stepped during backward; step without a "
                    "closure, or do not overlap this optimizer"
                )
        except UsageError:
            self.params_stepped.abandon()  # the broadcasts in flight end on every rank alike
            raise
        stepped, mine = self._stepped, self.params_stepped.mine()
        rest = [
            [p for p in group["params"] if id(p) not in stepped and id(p) in mine]
            for group in self.param_groups
        ]  # parameters outside the replica, or whose bucket had not come back
        if any(rest):
            self._restricted_step(rest)
        self.params_stepped.order_new_state(self._state_len, self.param_groups)
        self._reset()
        self.params_stepped.finish()  # sharded: every updated parameter from its owner, before the next forward
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.params_stepped.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.params_stepped.load_state_dict(state_dict)

    @property
    def consolidate_state_dict(self) -> Callable[..., None] | None:
        """Sharded only: the ShardedOptimizer's; None when the state is not sharded (checkpoint/stateful.py's
        `gathers_state` asks whether it is callable)."""
        return self.params_stepped.consolidate_state_dict

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)
        self._positions = None

    def __repr__(self) -> str:
        mode = "overlapped" if self.overlapped else f"plain ({self._fallback})"
        return f"OverlappedOptimizer[{mode}]({self.optimizer!r})"

    # ---------------------------------------------------------------- inside

    def _plain(self, closure: Callable[[], float] | None) -> float | None:
        self._inside = True
        try:
            return self.params_stepped.step_all(closure)
        finally:
            self._inside = False
            self._reset()

    def _restricted_step(self, chosen: list[list[torch.Tensor]]) -> None:
        """One step of the wrapped optimizer over `chosen` (per group) only; the groups are restored after."""
        self._inside = True
        try:
            self.params_stepped.step_some(chosen)
        finally:
            self._inside = False

    def _check_gradients_unchanged(self) -> None:
        changed = [
            p
            for p, grad, version in self._stepped.values()
            if p.grad is not grad or (grad is not None and grad._version != version)
        ]
        if changed:
            self._reset()
            raise UsageError(
                f"{self._tag}the gradients of {len(changed)} parameter(s) changed between backward() and "
                "optimizer.step(), after the engine had already stepped them with the averaged gradients "
                "(overlap_optimizer steps each bucket as soon as it is reduced). If you clip gradients, "
                "unscale them (GradScaler) or edit .grad before step(), say so: "
                "handle.overlap_optimizer(optimizer, clip_grad_norm=True) or scaler=your GradScaler; "
                "the step then waits for every gradient"
            )

    def _check_settings_unchanged(self) -> None:
        changed = sorted(
            {
                f"{key} of param_groups[{g}]"
                for g, (before, group) in enumerate(zip(self._settings, self.param_groups))
                for key, value in before.items()
                if not _same(value, group.get(key))
            }
        )
        if changed:
            self._reset()
            raise UsageError(
                f"{self._tag}{', '.join(changed)} changed between backward() and optimizer.step(), after the "
                "engine had already stepped some buckets with the old value (overlap_optimizer steps each "
                "bucket as soon as it is reduced). Change the settings after step() (a scheduler's step() "
                "comes after optimizer.step())"
            )

    def _reset(self) -> None:
        self._stepped = {}
        self._positions = None
        self._state_len = len(self.state)

    def _say(self, reason: str) -> None:
        if reason in self.fallback_reasons:
            return
        self.fallback_reasons.append(reason)
        warnings.warn(
            f"{self._tag}overlap_optimizer: {type(self.optimizer).__name__} takes the plain step after the "
            f"whole backward, not bucket by bucket, because {reason}",
            UserWarning,
            stacklevel=3,
        )


def _settings(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each group's settings but its parameters (tensors copied: a scheduler may change them in place)."""
    return [
        {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in g.items() if k != "params"}
        for g in groups
    ]


def _same(before: Any, now: Any) -> bool:
    if isinstance(before, torch.Tensor) or isinstance(now, torch.Tensor):
        return (
            isinstance(before, torch.Tensor)
            and isinstance(now, torch.Tensor)
            and before.shape == now.shape
            and bool(torch.equal(before, now.detach().to(before.device)))
        )
    try:
        return bool(before is now or before == now)
    except (TypeError, ValueError, RuntimeError):  # a value without a plain equality: count it as changed
        return False


def _guard(ref: weakref.ReferenceType[OverlappedOptimizer], optimizer: torch.optim.Optimizer) -> None:
    """The wrapped optimizer's step pre-hook: a direct step() would step the engine's buckets twice."""
    wrapper = ref()
    if wrapper is None or wrapper._inside or not wrapper._stepped:
        return
    raise UsageError(
        f"{wrapper._tag}{type(optimizer).__name__}.step() was called on the optimizer given to "
        "overlap_optimizer, whose buckets the engine already stepped during backward: it would step them "
        "twice. Call step() on the OverlappedOptimizer that overlap_optimizer returned"
    )
