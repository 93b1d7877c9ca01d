"""The lockstep exception hierarchy: every error a user can meet, each with a message that says what to do.

Every `raise` in lockstep names a subclass of LockstepError (tests/unit/test_error_hierarchy.py checks it).
Where torch raises a builtin for the same situation, lockstep's class subclasses that builtin too, so that
programs written for torch still catch it. Which class for what:

===========================  =====================  =========================================================
class                        also a                 raised when
===========================  =====================  =========================================================
ConfigError                  ValueError             a setting, argument, input or environment value is wrong
NoTrainableParametersError   Value-, RuntimeError   the module to wrap has no parameter that requires grad
NoProcessGroupError          Value-, RuntimeError   the engine needs a process group and none exists
NotSupportedError            Value-, NotImpl.Error  a feature of torch's DDP that lockstep does not offer
DDPArgumentError             Value-, RuntimeError   DDP arguments torch refuses with a RuntimeError
BackendUnavailableError      ValueError             the backend cannot run on this device or build
UsageError                   RuntimeError           a call fine in itself but not now (a second hook, ...)
CommHookTypeError            TypeError              a communication hook, or its state, of the wrong type
CommHookValueError           ValueError             a hook's annotations, or a bucket it cannot handle
CommHookResultError          RuntimeError           a hook returned something other than a Future
GradientError                RuntimeError           a gradient the engine cannot reduce (sparse, twice)
UnusedParameterError         RuntimeError           a parameter got no gradient where all must get one
CollectiveMismatchError      RuntimeError           ranks disagree on what must be identical
UnevenInputsError            RuntimeError           join(throw_on_early_termination=True): a rank ran out
InitTimeoutError             TimeoutError           the process group did not form in time
StateLostError               RuntimeError           live mode: every copy of part of the state was lost
CheckpointError              RuntimeError           a checkpoint cannot be written or read
LaunchError                  RuntimeError           the launcher cannot start or supervise the workers
DistributedTestError         RuntimeError           lockstep.testing: a function failed or hung on a rank
ParityError                  AssertionError         lockstep.testing.parity: two trainings differ
NetnsError                   RuntimeError           testbed/netns.py: a namespace command failed
UnknownNameError             AttributeError         `lockstep.X` for a name lockstep does not export
TorchInternalAttributeError  AttributeError         an internal of torch's C++ DDP that lockstep lacks
InternalError                RuntimeError           a bug in lockstep itself (never the user's mistake)
===========================  =====================  =========================================================

User mistakes are ConfigError or a subclass; a broken invariant of lockstep's own code is InternalError,
whose message says so. CommHookError is the common base of the three CommHook* classes.
"""

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


class NoProcessGroupError(ConfigError, RuntimeError):
    """The engine needs a process group and none is initialized (torch raises ValueError or RuntimeError)."""


class NotSupportedError(ConfigError, NotImplementedError):
    """An argument or feature of torch's DDP that lockstep's engine does not offer (NotImplementedError)."""


class DDPArgumentError(ConfigError, RuntimeError):
    """DistributedDataParallel arguments that torch's DDP refuses with a RuntimeError: both process_group and
    device_mesh, a mesh that is not 1-D, uninitialized (lazy) parameters, pickling on a non-default group."""


class UsageError(LockstepError, RuntimeError):
    """A call that is right in itself but not at this point: a second communication hook, _set_static_graph()
    after training started (torch raises RuntimeError for both)."""


class CommHookError(LockstepError):
    """A communication hook or its state breaks torch's contract hook(state, GradBucket) -> Future[Tensor]."""


class CommHookTypeError(CommHookError, TypeError):
    """The hook is not callable, or its state is of a type the hook cannot use (TypeError, like torch)."""


class CommHookValueError(CommHookError, ValueError):
    """The hook's annotations are not torch's, or a bucket is not laid out as the hook needs (ValueError)."""


class CommHookResultError(CommHookError, RuntimeError):
    """The hook returned something other than a torch.futures.Future (torch raises RuntimeError then)."""


class GradientError(LockstepError, RuntimeError):
    """A gradient the engine cannot reduce: sparse where dense was declared (or the reverse), or a second
    gradient for a parameter whose bucket was already reduced in this backward (RuntimeError, like torch)."""


class TorchInternalAttributeError(LockstepError, AttributeError):
    """An attribute of torch's DDP that only its C++ reducer gives meaning to (reducer, logger, ...); an
    AttributeError, so that hasattr() and getattr(obj, name, default) work as on any object."""


def rank_tag(rank: int | None, world_size: int | None) -> str:
    """The `[rank r/w]` prefix used in every message that involves a rank."""
    if rank is None or world_size is None:
        return ""
    return f"[rank {rank}/{world_size}] "


class ParityError(LockstepError, AssertionError):
    """lockstep.testing.parity: two trainings that must agree (lockstep, torch's DDP, one process) differ."""


class UnknownNameError(LockstepError, AttributeError):
    """`lockstep.X` for a name that lockstep does not export; an AttributeError, so that hasattr() works and
    `from lockstep import X` raises ImportError as it does for any module."""


class NetnsError(LockstepError, RuntimeError):
    """The test bed's network-namespace "hosts" (testbed/netns.py): a command that builds or shapes
    them failed."""


class WorldTooSmallError(LockstepError, RuntimeError):
    """Live mode (`lockstep run --min-world M`): ranks died and fewer than M remain, so the job ends."""


class StateLostError(LockstepError, RuntimeError):
    """Live mode: the members that held the only copies of part of the training state (a share of a
    sharded optimizer's state) were lost together; the run cannot go on from the survivors."""


class MembershipChanged(LockstepError, RuntimeError):
    """Live mode: a member of the group died or left while this rank waited in a collective; the loop
    re-forms the group over the survivors and redoes its step."""
