"""Live mode on several nodes: each node's launcher beats on the job's store and marks how its workers stand.

Node 0's launcher hosts the store and must keep it up until every other node is done (or silent: its
link or host is gone). Every launcher writes `node/<n>/beat` twice a second, `node/<n>/done` once its
workers all ended and `node/<n>/idle` while only unadmitted replacements still run; the key names are in
runtime/membership/keys.py. On one node there is nothing to beat for: every method is a no-op there.
"""

from __future__ import annotations

import time
from typing import Any

from lockstep.runtime.membership import keys

BEAT_EVERY_S = 0.5
NODE_SILENT_S = 15.0  # node 0 stops waiting for a node whose launcher has not beaten for this long


class NodeHeartbeat:
    """This launcher's node among `nodes` nodes, on the job's store."""

    def __init__(self, store: Any, node: int, nodes: int) -> None:
        self.store, self.node, self.nodes = store, node, nodes
        self._beaten = 0.0

    def beat(self) -> None:
        now = time.monotonic()
        if self.nodes > 1 and now - self._beaten > BEAT_EVERY_S:
            self.store.set(keys.node_beat(self.node), str(time.time()))
            self._beaten = now

    def mark(self, what: str) -> None:
        """`what`: "done" or "idle" (keys.node_mark)."""
        if self.nodes > 1:
            self.store.set(keys.node_mark(self.node, what), "1")

    def marked(self, node: int, what: str) -> bool:
        return bool(self.store.check([keys.node_mark(node, what)]))

    def silent(self, node: int) -> bool:
        """Node `node`'s launcher has stopped beating (not one that has not started yet)."""
        key = keys.node_beat(node)
        if not self.store.check([key]):
            return False  # not started yet: node 0 waits for it as a rendezvous would
        return time.time() - float(bytes(self.store.get(key)).decode()) > NODE_SILENT_S

    def others_over(self) -> bool:
        """Every other node is done or silent: node 0 may let its store go."""
        return all(self.marked(n, "done") or self.silent(n) for n in self._others())

    def all_idle(self) -> bool:
        """Every node (this one included) is idle, done or silent: queued replacements will never join."""
        return all(
            self.marked(n, "idle") or self.marked(n, "done") or self.silent(n) for n in range(self.nodes)
        )

    def _others(self) -> list[int]:
        return [n for n in range(self.nodes) if n != self.node]
