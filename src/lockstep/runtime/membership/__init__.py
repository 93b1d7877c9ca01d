"""Live membership: the group's generations over one c10d store, so that training survives a lost rank.

- keys.py: every store key of the protocol, who writes and who reads it (the one place that names them);
- records.py: a generation's members (`Membership`) and each change (`Fault`);
- phases.py: a generation's life as an enum with asserted transitions;
- core.py: the state the parts share (store, current generation, counted changes);
- formation.py: check in, agree on the members, form the group, leave a broken one;
- commit.py: a step counts on every member or on none;
- admission.py: replacements queue and are admitted at a step boundary;
- replica_groups.py: a sharded run's members leave and join in whole replica groups;
- stopped.py: the rule by which a peer seen stopped is lost at once (formation and the hang watchdog);
- host.py: what a live group needs from the process it runs in: the `Host` it is handed, and the `Place`
  it renumbers;
- group.py: `LiveGroup`, this worker's side, composed of the above;
- recovery.py: `LiveRecovery`, the training loop's side (fit and LiveLoop), talking to the run through
  the `Recoverable` Protocol.

The launcher's side is launch/live_supervisor.py and launch/node_heartbeat.py; docs/live.md draws it all.
Nothing is imported here: the launcher reads keys.py without loading torch.distributed.
"""
