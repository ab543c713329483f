"""`python -m zeus_agent.gpu.sim.trainers.pipeline`: run a simulated pipeline job (`cli.main`)."""

from __future__ import annotations

import sys

from zeus_agent.gpu.sim.trainers.pipeline.cli import main

if __name__ == "__main__":
    sys.exit(main())
