"""matplotlib for the demo's pictures, without a display (`pyplot`)."""

from __future__ import annotations

from typing import Any

__all__ = ["pyplot"]


def pyplot(error: type[Exception]) -> Any:
    """`matplotlib.pyplot` on the Agg backend.

    Raises:
        error: matplotlib is not installed (the message says how to get it).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise error("the plots need matplotlib: pip install 'zeus-bus[plot]'") from e
    return plt
