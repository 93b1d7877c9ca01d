"""A run's settings: `FitConfig`, from Python, config files and `--key value` flags (no torch imported:
`lockstep train` reads a job's settings and checks its plan before any worker starts).

Modules:
- config.py: FitConfig: every setting of a training run in one dataclass, type-checked per field from Python,
  files and flags.
- config_sources.py: Settings from outside Python: config files (JSON or YAML), `--key value` flags, and the
  checked mapping they make, each value named with where it came from when it is wrong.
"""
