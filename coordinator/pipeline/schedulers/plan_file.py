"""Plan files of `PointSolution`: read and parsed, never executed. I/O edge: reads files.

A plan file holds, for each rank (or, with `PointSolution3D`, each pipeline stage), the
(instruction name, SM frequency in MHz) pairs of one iteration in execution order, either as
JSON (`[[["forward", 1410], ...], ...]`) or as a Python literal, the format lowtime's script
writes to `freqs_pipeline_%05d.py` (`[[("forward", 1410), ...], ...]`).

Zeus 0.16 `eval()`s that file. Here it is parsed, never executed: JSON with `json`, otherwise
Python with `ast`, refusing any file whose syntax tree holds anything but literals (calls, names,
attribute access, comprehensions, lambdas, operators, f-strings, imports, statements...); only
then is `ast.literal_eval` applied to it (`parse_plan`, which reads nothing).

Clocks are read as Zeus's pydantic model reads them: `1410`, `1410.0` (pandas writes floats) and
`"1410"` are all 1410 MHz; only what cannot be a clock is refused (not a number, not positive,
beyond NVML's 32 bits).
"""

from __future__ import annotations

import ast
import json
import math
import os
from pathlib import Path
from typing import Any

from coordinator.pipeline.schedulers.base import SchedulerError
from zeus_agent.models import MAX_NAME_CHARS, MAX_SCHEDULE_LENGTH

__all__ = ["MAX_FREQUENCY_MHZ", "MAX_PLAN_BYTES", "Clock", "Plan", "load_plan", "parse_plan"]

MAX_PLAN_BYTES = 64 * 1024 * 1024
"""Largest plan file read (64 MiB)."""
MAX_FREQUENCY_MHZ = 2**31 - 1
"""Largest frequency accepted in a plan (an NVML clock is a 32-bit value)."""

Clock = int | float
"""A plan's clock (MHz): an int, or a float that is not a whole number (mapped when run)."""
Plan = list[list[tuple[str, Clock]]]

_LITERAL_NODES = (ast.Constant, ast.List, ast.Tuple, ast.Set, ast.Dict, ast.Load)
"""Syntax nodes a literal is made of (a dict or set is a literal, refused later by shape)."""

_CODE_NODES: dict[type[ast.AST], str] = {
    ast.Call: "a function call",
    ast.Name: "a name",
    ast.Attribute: "an attribute access",
    ast.Subscript: "a subscript",
    ast.ListComp: "a list comprehension",
    ast.SetComp: "a set comprehension",
    ast.DictComp: "a dict comprehension",
    ast.GeneratorExp: "a generator expression",
    ast.Lambda: "a lambda",
    ast.JoinedStr: "an f-string",
    ast.FormattedValue: "an f-string",
    ast.BinOp: "an operator expression",
    ast.BoolOp: "a boolean expression",
    ast.Compare: "a comparison",
    ast.IfExp: "a conditional expression",
    ast.NamedExpr: "an assignment expression",
    ast.Starred: "an unpacking (*)",
    ast.Await: "an await",
    ast.Yield: "a yield",
    ast.YieldFrom: "a yield",
    ast.Slice: "a slice",
}


def _describe_code(node: ast.AST) -> str:
    """`node` as "a function call `__import__('os')` at line 1, column 2"."""
    what = _CODE_NODES.get(type(node), f"a {type(node).__name__} expression")
    try:
        snippet = ast.unparse(node)
    except Exception:  # A description only: any failure leaves the snippet out.
        snippet = ""
    if len(snippet) > 60:
        snippet = snippet[:57] + "..."
    where = f" at line {getattr(node, 'lineno', '?')}, column {getattr(node, 'col_offset', -1) + 1}"
    return f"{what}{f' `{snippet}`' if snippet else ''}{where}"


def _describe_statement(node: ast.stmt) -> str:
    kinds = {
        ast.Import: "an import statement",
        ast.ImportFrom: "an import statement",
        ast.Assign: "an assignment",
        ast.AnnAssign: "an assignment",
        ast.AugAssign: "an assignment",
        ast.FunctionDef: "a function definition",
        ast.AsyncFunctionDef: "a function definition",
        ast.ClassDef: "a class definition",
    }
    what = kinds.get(type(node), f"a {type(node).__name__} statement")
    return f"{what} at line {node.lineno}"


def _is_signed_number(node: ast.AST) -> bool:
    """`-5` or `+5`: a literal (refused later if it is not a valid frequency)."""
    return (
        isinstance(node, ast.UnaryOp)
        and isinstance(node.op, ast.UAdd | ast.USub)
        and isinstance(node.operand, ast.Constant)
        and type(node.operand.value) in (int, float)
    )


def _literal_from_python(text: str, source: str) -> Any:
    """The value of a file that holds one Python literal; SchedulerError for anything else."""
    try:
        module = ast.parse(text, filename=source, mode="exec")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        if isinstance(e, SyntaxError):
            detail = f"line {e.lineno}: {e.msg}"
        else:
            detail = str(e) or type(e).__name__
        raise SchedulerError(
            f"plan file {source} is neither JSON nor a Python literal ({detail})"
        ) from None
    statements = module.body
    if not statements:
        raise SchedulerError(f"plan file {source} holds no plan (only comments or blank lines)")
    expressions: list[ast.Expr] = []
    for statement in statements:
        if not isinstance(statement, ast.Expr):
            raise SchedulerError(
                f"plan file {source} holds code, not a literal plan: "
                f"{_describe_statement(statement)}; it is never executed"
            )
        expressions.append(statement)
    for node in (node for expr in expressions for node in ast.walk(expr.value)):
        if isinstance(node, _LITERAL_NODES) or _is_signed_number(node):
            continue
        if isinstance(node, ast.UAdd | ast.USub):
            continue  # The operator of a signed number.
        raise SchedulerError(
            f"plan file {source} holds code, not a literal plan: {_describe_code(node)}; "
            "it is never executed (write the plan as a literal list, e.g. "
            '[[("forward", 1410), ("backward", 1410)], ...])'
        )
    if len(expressions) > 1:
        raise SchedulerError(
            f"plan file {source} holds {len(expressions)} expressions (line "
            f"{expressions[1].lineno} starts another): it must hold one literal list"
        )
    expression = expressions[0].value
    try:
        return ast.literal_eval(expression)
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError) as e:
        raise SchedulerError(f"plan file {source}: not a valid literal ({e})") from None


def _check_shape(value: Any, source: str) -> Plan:
    """`value` as a plan: a non-empty list of non-empty lists of (name, MHz) pairs."""
    if not isinstance(value, list | tuple):
        raise SchedulerError(
            f"plan file {source} must hold a list of rows (one per rank or pipeline stage), "
            f"got {type(value).__name__}"
        )
    if not value:
        raise SchedulerError(f"plan file {source} holds an empty list: no rows")
    plan: Plan = []
    for i, row in enumerate(value):
        if not isinstance(row, list | tuple):
            raise SchedulerError(
                f"plan file {source}, row {i}: must be a list of (instruction, MHz) pairs, "
                f"got {type(row).__name__}"
            )
        if not row:
            raise SchedulerError(f"plan file {source}, row {i} is empty: no instructions")
        if len(row) > MAX_SCHEDULE_LENGTH:
            raise SchedulerError(
                f"plan file {source}, row {i}: {len(row)} instructions, more than "
                f"{MAX_SCHEDULE_LENGTH}"
            )
        checked: list[tuple[str, Clock]] = []
        for j, entry in enumerate(row):
            where = f"plan file {source}, row {i}, entry {j}"
            if not isinstance(entry, list | tuple) or len(entry) != 2:
                raise SchedulerError(
                    f"{where}: must be an (instruction, MHz) pair, got {_short(entry)}"
                )
            name, freq = entry
            if not isinstance(name, str) or not name:
                raise SchedulerError(
                    f"{where}: the instruction name must be a non-empty string, got {_short(name)}"
                )
            if len(name) > MAX_NAME_CHARS:
                raise SchedulerError(
                    f"{where}: instruction name longer than {MAX_NAME_CHARS} characters"
                )
            checked.append((name, _clock(freq, f"{where} ({name!r})")))
        plan.append(checked)
    return plan


def _clock(value: Any, where: str) -> Clock:
    """A plan entry's clock as Zeus's `int` field reads it: 1410, 1410.0 and "1410" are 1410.

    Raises:
        SchedulerError: Not a number (bool and None included), not finite, not positive, or
            beyond a 32-bit NVML clock.
    """
    number: int | float | None = None
    if isinstance(value, int | float) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str):
        try:
            number = int(value.strip())
        except ValueError:
            try:
                number = float(value.strip())
            except ValueError:
                number = None
    if number is None or (isinstance(number, float) and not math.isfinite(number)):
        raise SchedulerError(f"{where}: the frequency must be a number of MHz, got {_short(value)}")
    if isinstance(number, float) and number.is_integer():
        number = int(number)
    if not 0 < number <= MAX_FREQUENCY_MHZ:
        raise SchedulerError(
            f"{where}: the frequency must be a positive number of MHz (at most "
            f"{MAX_FREQUENCY_MHZ}), got {_short(value) if isinstance(value, str) else value}"
        )
    return number


def load_plan(path: str | os.PathLike[str]) -> Plan:
    """Read a frequency plan: one row of (instruction name, MHz) pairs per rank or stage.

    The file holds JSON or one Python literal (lists or tuples), as lowtime writes. It is parsed,
    never executed.

    Raises:
        SchedulerError: The file is missing, unreadable, larger than `MAX_PLAN_BYTES`, holds code
            or anything but a literal, or a value that is not a plan (see `_check_shape`).
    """
    source = os.fspath(path)
    file = Path(source)
    try:
        if not file.is_file():
            if file.exists():
                raise SchedulerError(f"plan file {source} is not a regular file")
            raise SchedulerError(f"plan file {source} does not exist")
        with file.open("rb") as f:
            data = f.read(MAX_PLAN_BYTES + 1)
    except OSError as e:
        raise SchedulerError(f"plan file {source} cannot be read: {e.strerror or e}") from None
    if len(data) > MAX_PLAN_BYTES:
        raise SchedulerError(
            f"plan file {source} is larger than {MAX_PLAN_BYTES // (1024 * 1024)} MiB"
        )
    return parse_plan(data, source)


def parse_plan(data: bytes, source: str = "<plan>") -> Plan:
    """A plan from a plan file's bytes (JSON or one Python literal); `source` names the file.

    Raises:
        SchedulerError: Not UTF-8, empty, code or anything but a literal, or a value that is
            not a plan (see `_check_shape`).
    """
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise SchedulerError(f"plan file {source} is not UTF-8 text ({e.reason})") from None
    if not text.strip():
        raise SchedulerError(f"plan file {source} is empty")
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        value = _literal_from_python(text, source)
    return _check_shape(value, source)


def _short(value: Any) -> str:
    text = repr(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    return f"{type(value).__name__} {text}"
