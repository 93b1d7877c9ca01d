"""Built-in training jobs (`lockstep train JOB`): models, data that ships with the install, and their configs."""

from __future__ import annotations
