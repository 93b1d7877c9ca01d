"""Rank-aware logging: INFO from global rank 0 only; warnings and errors from every rank, prefixed [rank r/w]."""

from __future__ import annotations

import logging
import sys

from lockstep.runtime.process_group import current_topology

_HANDLER_FLAG = "_lockstep_handler"


class RankFilter(logging.Filter):
    """Drops records below WARNING on ranks other than 0 and stamps every record with its rank."""

    def filter(self, record: logging.LogRecord) -> bool:
        topo = current_topology()
        record.rank_prefix = f"[rank {topo.rank}/{topo.world_size}] " if topo.world_size > 1 else ""
        return topo.rank == 0 or record.levelno >= logging.WARNING


def get_logger(name: str = "lockstep", level: int = logging.INFO) -> logging.Logger:
    """A logger that writes to stderr with the rank rules above. Adding its handler is idempotent."""
    logger = logging.getLogger(name)
    if not any(getattr(h, _HANDLER_FLAG, False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.addFilter(RankFilter())
        handler.setFormatter(logging.Formatter("%(rank_prefix)s%(levelname)s %(name)s: %(message)s"))
        setattr(handler, _HANDLER_FLAG, True)
        logger.addHandler(handler)
        logger.setLevel(level)
        logger.propagate = False
    return logger
