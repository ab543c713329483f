"""A read-only guard as `pynvml`, like the one lent GPU machines use (`shared/real-gpu/guard`).

Put this directory first on `PYTHONPATH`: importing `pynvml` then loads the next `pynvml.py` on
`sys.path` (in the tests, `tests/fakes/pynvml_shim`; on a GPU machine, nvidia-ml-py's), copies
its names, and replaces every call that changes a GPU (`nvmlDeviceSet*`, `nvmlDeviceReset*`,
`nvmlDeviceClear*`, ...) with one that appends its name to `BLOCKED`, writes
`<pid> blocked <name>` to `$NVML_GUARD_LOG` (default `/tmp/nvml_guard.log`) and raises
`NVMLError(NVML_ERROR_NO_PERMISSION)`. `hasattr(pynvml, "BLOCKED")` says the guard is in force.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable
from typing import Any

_here = os.path.dirname(os.path.abspath(__file__))
_real = next((os.path.join(p, "pynvml.py") for p in sys.path
              if p and os.path.abspath(p) != _here
              and os.path.exists(os.path.join(p, "pynvml.py"))), None)
if _real is None:
    raise ImportError("no pynvml to guard on sys.path")
_spec = importlib.util.spec_from_file_location("_real_pynvml", _real)
assert _spec is not None and _spec.loader is not None
_mod = importlib.util.module_from_spec(_spec)
sys.modules["_real_pynvml"] = _mod
_spec.loader.exec_module(_mod)
globals().update({k: v for k, v in vars(_mod).items() if not k.startswith("__")})

BLOCKED: list[str] = []
_PREFIXES = ("nvmlDeviceSet", "nvmlDeviceReset", "nvmlDeviceClear", "nvmlSet", "nvmlGpuInstance",
             "nvmlDeviceCreate", "nvmlDeviceModify")
_ALLOW = {"nvmlDeviceSetCpuAffinity"}


def _blocker(name: str) -> Callable[..., Any]:
    def refused(*_args: Any, **_kwargs: Any) -> Any:
        BLOCKED.append(name)
        with open(os.environ.get("NVML_GUARD_LOG", "/tmp/nvml_guard.log"), "a") as fh:
            fh.write(f"{os.getpid()} blocked {name}\n")
        raise _mod.NVMLError(_mod.NVML_ERROR_NO_PERMISSION)

    return refused


for _name in list(globals()):
    if _name.startswith(_PREFIXES) and _name not in _ALLOW and callable(globals()[_name]):
        globals()[_name] = _blocker(_name)
