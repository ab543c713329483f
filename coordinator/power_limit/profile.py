"""Profile files in Zeus's JSON format (the only file I/O of the power-limit package).

`{"measurements": [{"power_limit": W, "energy": J, "time": s}, ...]}`, highest limit first, as
Zeus's `GlobalPowerLimitOptimizer` writes with `profile_path` and reads back; files are
interchangeable with Zeus's. The functions live in `zeus_agent.models`, where the trainer's
drop-in uses them too.

* `save_profile(path, measurements)`: write a profile (highest limit first).
* `load_profile(path)`: read and validate a profile; pass it to `PowerLimitStateMachine` as
  `measurements`.
"""

from __future__ import annotations

from zeus_agent.models import load_power_limit_profile as load_profile
from zeus_agent.models import save_power_limit_profile as save_profile

__all__ = ["load_profile", "save_profile"]
