"""What the drop-in class (engine/ddp.py) owes torch's contract beyond training: checks, logging data,
`model.reducer`, the Joinable protocol and torch.compile.

Modules:
- compile_support.py: torch.compile: dynamo splits a replica's compiled graphs at bucket boundaries, as it
  does for torch's DDP.
- ddp_logging.py: `_get_ddp_logging_data()` of the drop-in class: torch's private debugging dict, from
  lockstep's facts.
- joinable.py: torch's Joinable protocol for both faces of the engine (the drop-in class and the handle), on
  the replica.
- torch_reducer.py: `model.reducer` of the drop-in class: the calls frameworks make on torch's C++ reducer, on
  lockstep's engine.
- wrap_checks.py: The drop-in class's checks of what it is given, with torch's exception types and messages.
"""
