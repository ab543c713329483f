"""`python -m zeus_demo`: the same as the `zeus-demo` console script (`zeus_demo.cli.main`)."""

from __future__ import annotations

from zeus_demo.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
