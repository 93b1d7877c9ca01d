"""Communication hooks with torch's contract, public in `lockstep.hooks` under torch's names.

Modules:
- compression.py: Communication hooks with torch's contract: plain all-reduce and half-precision compression,
  byte-counted.
- powersgd.py: PowerSGD: low-rank gradient compression with error feedback and warm start, as a communication
  hook.
"""
