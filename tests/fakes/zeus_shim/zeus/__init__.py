"""A stand-in for Zeus (`zeus-ml`) where it matters to `bench/real_gpu.py`: its logs.

Zeus's `zeus.utils.logging.get_logger` gives each module a logger with its own
`StreamHandler(sys.stdout)` (propagate off), made when the module is imported, and
`ZeusMonitor` logs at INFO as it starts ("Monitoring GPU indices [0]."). This package does the
same, and measures nothing (energy 0, as Zeus's short windows often read).
"""

from __future__ import annotations

import logging
import sys

__version__ = "0.16.0+fake"


def get_logger(name: str) -> logging.Logger:
    """Like Zeus's: INFO, not propagated, a handler on the `sys.stdout` of the moment."""
    logger = logging.getLogger(name)
    logger.propagate = False
    logger.setLevel(logging.INFO)
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("[%(asctime)s] [%(name)s] %(message)s"))
    logger.addHandler(handler)
    return logger
