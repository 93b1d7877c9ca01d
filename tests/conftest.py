"""Shared test setup: keep every rank single-threaded on this 2-core machine."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
