"""One attempt number per rendezvous round, the same on every node: the workers' store prefix after a restart.

Under `--max-restarts`, torch's agent tells each worker TORCHELASTIC_RESTART_COUNT, which counts *this
node's* failures: a node restarted because a peer failed (the rendezvous reopened) keeps its count while
the failed node's grows. Workers that build their process group under a per-attempt store prefix from that
count (see runtime/process_group.py) then wait under `attempt_0` on one node and `attempt_1` on the other,
and never meet.

Every node, however, goes through the same rendezvous rounds. `AttemptRendezvous` wraps torch's own c10d
rendezvous handler (the behaviour is torch's, unchanged) and, after each completed round, agrees on a
number through the round's store, which all its nodes share: the node of group rank 0 takes the next value
of a counter kept on the job's store (`add`, atomic), publishes it under the round's prefix, and every node
reads it there. The launcher passes the number to its workers as LOCKSTEP_ATTEMPT (launch/rank_logs.py;
the name is runtime/env/env_contract.ATTEMPT_VAR), and runtime/env/topology.py prefers it to
TORCHELASTIC_RESTART_COUNT. Only public c10d Store calls are used.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.elastic.rendezvous.api import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    rendezvous_handler_registry,
)

BACKEND = "lockstep-c10d"  # torch's c10d rendezvous, with the agreed attempt number
SINK_KEY = "lockstep_attempt_sink"  # rdzv_configs entry carrying the launch's AgreedAttempt to the handler
COUNTER_KEY = "lockstep/rounds"  # on the job's store: rounds completed so far (never under a round prefix)
ATTEMPT_KEY = "lockstep/attempt"  # under the round's prefix: the number agreed for that round


class AgreedAttempt:
    """Holds the attempt number of the last completed rendezvous round of one launch (None before it)."""

    def __init__(self) -> None:
        self.value: int | None = None

    def __repr__(self) -> str:  # torch's agent logs its rendezvous settings, this one among them
        return f"AgreedAttempt({self.value})"


def agree_attempt(round_store: Any, group_rank: int) -> int:
    """The attempt number of this round, the same on every node of it.

    `round_store` is the store torch's rendezvous returns for the round (a PrefixStore unique to the
    round over the job's store); `group_rank` is this node's rank in the round. Group rank 0 draws the
    number from a counter on the job's store; every node then reads it back under the round's prefix
    (`get` waits until it is there).
    """
    if group_rank == 0:
        number = round_store.underlying_store.add(COUNTER_KEY, 1) - 1
        round_store.set(ATTEMPT_KEY, str(number))
    return int(round_store.get(ATTEMPT_KEY))


class AttemptRendezvous(RendezvousHandler):
    """torch's rendezvous handler `inner`, plus `agree_attempt` after every completed round."""

    def __init__(self, inner: RendezvousHandler, sink: AgreedAttempt) -> None:
        self._inner = inner
        self._sink = sink

    def next_rendezvous(self) -> RendezvousInfo:
        info = self._inner.next_rendezvous()
        self._sink.value = agree_attempt(info.store, info.rank)
        return info

    def get_backend(self) -> str:
        return BACKEND  # the registry checks that the handler it made answers to the name it was asked for

    @property
    def use_agent_store(self) -> bool:
        return self._inner.use_agent_store

    def is_closed(self) -> bool:
        return self._inner.is_closed()

    def set_closed(self) -> None:
        self._inner.set_closed()

    def num_nodes_waiting(self) -> int:
        return self._inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        return self._inner.shutdown()

    def __getattr__(self, name: str) -> Any:  # anything a newer agent asks for: torch's handler answers
        inner = self.__dict__.get("_inner")
        if name.startswith("__") or inner is None:
            # Python's own lookup, which fails with the usual AttributeError: special names are never
            # forwarded, and a half-built handler (copy, unpickling) has no `_inner` to forward to.
            return object.__getattribute__(self, name)
        return getattr(inner, name)


def _create(params: RendezvousParameters) -> RendezvousHandler:
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    sink = params.config.pop(SINK_KEY, None) or AgreedAttempt()
    backend, store = create_backend(params)
    return AttemptRendezvous(create_handler(store, backend, params), sink)


def register() -> str:
    """Make BACKEND known to torch's rendezvous registry (idempotent); return its name."""
    rendezvous_handler_registry.register(BACKEND, _create)
    return BACKEND
