"""The lockstep exception hierarchy: every error a user can meet, each with a message that says what to do."""

from __future__ import annotations


class LockstepError(Exception):
    """Base class of every error lockstep raises on purpose."""


class ConfigError(LockstepError, ValueError):
    """A setting, argument or environment variable is wrong or missing."""


class NoTrainableParametersError(ConfigError, RuntimeError):
    """The module to replicate has no parameter that requires grad (a RuntimeError in torch's DDP too)."""


class BackendUnavailableError(ConfigError):
    """The requested collective backend cannot be used for this device or build of torch."""


class InitTimeoutError(LockstepError, TimeoutError):
    """The process group could not be formed in time (rendezvous never completed)."""


class CollectiveMismatchError(LockstepError, RuntimeError):
    """Ranks disagree about something that must be identical (model structure, bucket layout, ...)."""


class UnevenInputsError(CollectiveMismatchError):
    """join(throw_on_early_termination=True): some rank ran out of inputs; raised on every rank."""


class UnusedParameterError(LockstepError, RuntimeError):
    """A parameter got no gradient although the engine expected one from every parameter."""


class CheckpointError(LockstepError, RuntimeError):
    """A checkpoint cannot be written or read (missing, corrupt, of another model, disk full, ...)."""


class LaunchError(LockstepError, RuntimeError):
    """The launcher could not start or supervise the workers."""


class DistributedTestError(LockstepError, RuntimeError):
    """A function run by lockstep.testing failed or hung on one or more ranks."""


class InternalError(LockstepError, RuntimeError):
    """A bug in lockstep itself (an internal invariant does not hold), not a mistake of the user."""


def rank_tag(rank: int | None, world_size: int | None) -> str:
    """The `[rank r/w]` prefix used in every message that involves a rank."""
    if rank is None or world_size is None:
        return ""
    return f"[rank {rank}/{world_size}] "
