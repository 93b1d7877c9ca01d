"""Every key of the live-membership protocol on the job's c10d store: its name, who writes it, who reads it.

The launcher (launch/live_supervisor.py, launch/node_heartbeat.py) and the workers (this package) meet on
one TCPStore that node 0's launcher hosts. This module is the one place that names the keys; docs/live.md
draws the protocol around them. A member of the job is named by its **member id** everywhere: 0..W-1 for
the W workers launched first (node * nproc_per_node + local rank), then W, W+1, ... for replacements, in
the order the launchers start them. A member's rank in the current generation is another thing: ranks are
renumbered over the members of each generation, in member-id order.

| key | written by | read by |
| --- | --- | --- |
| `changes` (a counter) | the launcher when a worker dies, a survivor before it checks in, an evicting watchdog | every worker while it waits in a collective or a commit; the launcher (to find evicted workers) |
| `dead/<member>` = how it ended | the launcher (exit, signal), a survivor's watchdog (evicted), the members that left it out of a generation (it did not check in) | every worker agreeing on members; the launcher (kills the evicted) |
| `proc/<member>` = JSON {host, pid} | each worker as it starts | the members agreeing on a generation (a member this host sees stopped or dead is left out early) |
| `gen<g>/in/<member>` | each member of generation g-1 checking in to g | the members agreeing on g's members |
| `gen<g>/members` = JSON list | the first member to propose (compare_set: first writer wins) | every member of g, the replacements admitted to g |
| `gen<g>/formed/<member>` | each member whose group of generation g formed | every member of g (it goes on in g once all have) |
| `gen<g>` (a store prefix) | torch's init_process_group for generation g | the same (a fresh prefix per generation: reusing one reads old addresses) |
| `gen<g>/done/<step>/<member>` (a counter) and `.../rows` | each member after its collectives of `step` (commit) | every member of g (the step counts when all are done); rank 0 takes over a lost member's rows |
| `gen<g>/verdict/<step>` = "commit" or "redo" | the first member to decide (compare_set): all done, or a change seen first | every member of g (each follows it, whatever it saw) |
| `gen<g>/grow` = JSON {step, joiners} | rank 0 of g (compare_set), planning a growth | the other members of g, by the next step |
| `join/count`, `join/<position>` = member id | a replacement queueing | rank 0 (joiners due) |
| `admit/<member>` = generation | every member of the generation that admits it | the replacement; the launcher (is a queued one admitted?) |
| `healed/<member>` = generation | a replacement once it received the run's state | tools watching a job (tools/chaos.py: a member still joining is not yet one to count on) |
| `closed` | the launcher, when only unadmitted replacements still run | a queued replacement (it exits 0) |
| `group_size` = S | every member, once the trainer holds the group in replica groups of S (a sharded run: `LiveGroup.hold_in_groups`) | the launcher (a replica group lost, however many of its members it sees end, costs one of --max-restarts: launch/live_account.py) |
| `replacements` (a counter) | each launcher starting a replacement | each launcher (the next member id; the last line) |
| `node/<n>/beat`, `node/<n>/done`, `node/<n>/idle` | node n's launcher | node 0's launcher (keeps the store up), every launcher (closing) |
"""

from __future__ import annotations

ROOT = "lockstep/live/"

CHANGES = f"{ROOT}changes"
CLOSED = f"{ROOT}closed"
GROUP_SIZE = f"{ROOT}group_size"
JOIN_COUNT = f"{ROOT}join/count"
REPLACEMENTS = f"{ROOT}replacements"


def dead(member: int) -> str:
    return f"{ROOT}dead/{member}"


def whereabouts(member: int) -> str:
    return f"{ROOT}proc/{member}"


def join_entry(position: int) -> str:
    return f"{ROOT}join/{position}"


def admit(member: int) -> str:
    return f"{ROOT}admit/{member}"


def healed(member: int) -> str:
    return f"{ROOT}healed/{member}"


def generation_prefix(generation: int) -> str:
    """The store prefix under which generation `generation`'s process group is formed."""
    return f"{ROOT}gen{generation}"


def checkin(generation: int, member: int) -> str:
    return f"{ROOT}gen{generation}/in/{member}"


def members(generation: int) -> str:
    return f"{ROOT}gen{generation}/members"


def formed(generation: int, member: int) -> str:
    return f"{ROOT}gen{generation}/formed/{member}"


def growth(generation: int) -> str:
    return f"{ROOT}gen{generation}/grow"


def done(generation: int, step: int | str, member: int) -> str:
    """`member` completed `step` in `generation` (or the work between steps `step` names: "40/_after_step")."""
    return f"{ROOT}gen{generation}/done/{step}/{member}"


def verdict(generation: int, step: int | str) -> str:
    """Whether `step` counted in `generation`: "commit" or "redo", the first writer's word (compare_set)."""
    return f"{ROOT}gen{generation}/verdict/{step}"


def done_rows(generation: int, step: int | str, member: int) -> str:
    return f"{done(generation, step, member)}/rows"


def node_beat(node: int) -> str:
    return f"{ROOT}node/{node}/beat"


def node_mark(node: int, what: str) -> str:
    """`what`: "done" (its workers all ended) or "idle" (only unadmitted replacements still run)."""
    return f"{ROOT}node/{node}/{what}"
