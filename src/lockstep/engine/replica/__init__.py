"""One replica's engine: its state (wrap-time sync, the buffer sync, torch's switches, join()) and its
mode, chosen once from the policy: bucketed, exact (deterministic) or periodic.

Modules:
- mode.py: The engine's modes: one object per replica, chosen once from the policy, behind one small
  interface.
- state.py: Per-model engine state: wrap-time sync, the engine's mode, the buffer sync, torch's switches and
  join().
"""
