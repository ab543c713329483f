"""Bounded texts: every error or status message that may echo input goes through here.

A message that repeats what a peer sent (a field's value, a field's name, a subject) can be as
long as that peer likes, while the wire's free text (`MAX_TEXT_CHARS`) is bounded: a message
built from a 5 KB value would then fail to validate while the service answers the request, and
the failure would leave the handler. Two helpers, used by both services:

* `shown(value)`: the `repr` of a value a peer sent, cut to `SHOWN_CHARS` (what a person needs to
  recognise it);
* `bounded(text)`: any text, cut to fit a `Text` field, saying that it was cut.
"""

from __future__ import annotations

from typing import Any

MAX_TEXT_CHARS = 4096
"""Longest free text on the wire (error messages, status messages)."""
SHOWN_CHARS = 60
"""Longest echo of one value a peer sent, quotes and all."""
_CUT = " ... (truncated)"


def shown(value: Any, limit: int = SHOWN_CHARS) -> str:
    """`repr(value)`, cut to at most `limit` characters (never raises)."""
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a peer's value is only ever plain data, but be safe
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: max(0, limit - 3)] + "..."


def bounded(text: object, limit: int = MAX_TEXT_CHARS) -> str:
    """`str(text)` cut to at most `limit` characters, ending in a note that it was cut."""
    s = text if isinstance(text, str) else str(text)
    if len(s) <= limit:
        return s
    return s[: max(0, limit - len(_CUT))] + _CUT
