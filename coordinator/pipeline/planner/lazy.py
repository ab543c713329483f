"""The planner's compiled kernels, loaded at their first use rather than at import.

Every coordinator replica imports the planner (its Perseus scheduler and the budgets' view of
pipeline jobs do), but few replicas plan, and numba takes 0.1-0.5 s of CPU to import (more on a
loaded host): a replica's start, and every test that starts one, paid it for nothing.
`kernels` here is the module `coordinator.pipeline.planner.kernels`, executed on its first
attribute access (`importlib.util.LazyLoader`); type checkers see the module itself.

An I/O edge of the pure planner: loading the kernels reads (and the first time writes) numba's
cache of their machine code; the planner's arithmetic stays in the pure modules.
"""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

__all__ = ["lazy_module"]


def lazy_module(name: str) -> ModuleType:
    """Module `name`, executed on its first attribute access (at once if already imported)."""
    loaded = sys.modules.get(name)
    if loaded is not None:
        return loaded
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        raise ImportError(f"no module named {name!r}")
    spec.loader = importlib.util.LazyLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
