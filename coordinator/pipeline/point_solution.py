"""`PointSolution`: run one precomputed frequency plan (Zeus 0.16's `PointSolution`).

A plan file holds, for each rank (or, with `PointSolution3D`, each pipeline stage), the
(instruction name, SM frequency in MHz) pairs of one iteration in execution order, either as
JSON (`[[["forward", 1410], ...], ...]`) or as a Python literal, the format lowtime's script
writes to `freqs_pipeline_%05d.py` (`[[("forward", 1410), ...], ...]`).

Zeus 0.16 `eval()`s that file. Here it is parsed, never executed: JSON with `json`, otherwise
Python with `ast`, refusing any file whose syntax tree holds anything but literals (calls, names,
attribute access, comprehensions, lambdas, operators, f-strings, imports, statements...); only
then is `ast.literal_eval` applied to it.

Clocks are read as Zeus's pydantic model reads them: `1410`, `1410.0` (pandas writes floats) and
`"1410"` are all 1410 MHz; only what cannot be a clock is refused (not a number, not positive,
beyond NVML's 32 bits).
A clock the rank's GPU does not list (a plan made on another GPU model) runs at the nearest one it
does, a tie going to the higher clock (never slower than planned where a choice exists); one
warning per plan names every substitution.
"""

from __future__ import annotations

import ast
import bisect
import json
import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from coordinator.pipeline.scheduler import (
    FrequencyScheduler,
    ScheduleGenerator,
    SchedulerError,
    make_3d_parallel,
)
from zeus_agent.models import (
    MAX_NAME_CHARS,
    MAX_SCHEDULE_LENGTH,
    FrequencySchedule,
    JobInfo,
    RankInfo,
)

__all__ = [
    "MAX_FREQUENCY_MHZ",
    "MAX_PLAN_BYTES",
    "PointSolution",
    "PointSolution3D",
    "load_plan",
    "nearest_clock",
]

logger = logging.getLogger(__name__)

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


def nearest_clock(clock: Clock, offered: Sequence[int]) -> int:
    """The clock of `offered` (sorted ascending) nearest `clock`; a tie goes to the higher one.

    With nothing offered (the GPU did not say), a whole clock is kept and another is rounded
    half up (at least 1 MHz).
    """
    if not offered:
        return int(clock) if isinstance(clock, int) else max(1, math.floor(clock + 0.5))
    i = bisect.bisect_left(offered, clock)
    if i == len(offered):
        return offered[-1]
    if i == 0 or offered[i] == clock:
        return offered[i]
    lower, higher = offered[i - 1], offered[i]
    return lower if clock - lower < higher - clock else higher


def _short(value: Any) -> str:
    text = repr(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    return f"{type(value).__name__} {text}"


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


class PointSolution(FrequencyScheduler):
    """Run one precomputed frequency plan (Zeus 0.16's `PointSolution`).

    The plan (see `load_plan`) is read when the scheduler is built and must hold one row per
    rank of the job it plans for (with `PointSolution3D`, one per pipeline stage). A clock a
    rank's GPU does not list runs at the nearest one it does (`nearest_clock`), logged once per
    plan; when the rank's instruction order is known (`RankInfo.instructions`), a row's names
    must match it. The plan is yielded once and then served for as long as the job runs.

    Attributes:
        rank_rows: Rank -> the (instruction, MHz) pairs it runs, clocks mapped to its GPU's.
        substitutions: (row, rank, planned clock, clock run, entries) for each clock replaced.
    """

    @classmethod
    def check_args(cls, solution_path: str, **_: object) -> None:
        """Read and check the plan when the coordinator starts (raises `SchedulerError`)."""
        load_plan(solution_path)

    def __init__(
        self,
        job_info: JobInfo,
        rank_infos: Sequence[RankInfo],
        pfo_settings: Any,
        solution_path: str,
    ) -> None:
        """Load the plan at `solution_path` and fit it to the job's ranks.

        Raises:
            SchedulerError: The plan cannot be loaded or does not fit the job.
        """
        self.solution_path = os.fspath(solution_path)
        self.plan = load_plan(self.solution_path)
        self.rank_rows: dict[int, list[tuple[str, int]]] = {}
        self.substitutions: list[tuple[int, int, Clock, int, int]] = []
        super().__init__(job_info, rank_infos, pfo_settings)
        self._check_plan()

    def _check_plan(self) -> None:
        # The 3D wrapper (make_3d_parallel) keeps the job's own rank infos: every rank of a stage
        # runs the stage's row, so all of them are checked.
        orig_infos: list[RankInfo] | None = getattr(self, "_orig_rank_infos", None)
        per_stage = orig_infos is not None
        unit = "pipeline stage" if per_stage else "rank"
        source = self.solution_path
        if len(self.plan) != self.world_size:
            raise SchedulerError(
                f"{type(self).__name__}: plan file {source} has {len(self.plan)} rows but "
                f"{self.world_size} are needed, one per {unit}"
                + (" (pp_degree)" if per_stage else " (world size)")
            )
        ranks = [info.rank for info in self.rank_infos]
        if ranks != list(range(self.world_size)):
            raise SchedulerError(
                f"{type(self).__name__} needs one RankInfo per {unit} numbered 0 to "
                f"{self.world_size - 1}, got {ranks}"
            )
        self._rows: list[list[tuple[str, int]]] = []
        for index, row in enumerate(self.plan):
            if orig_infos is not None:
                checked = [info for info in orig_infos if info.pp_rank == index]
            else:
                checked = [self.rank_infos[index]]
            for info in checked:
                self._check_row(index, row, info, unit)
                self.rank_rows[info.rank] = self._fit_row(index, row, info)
            # The row the (wrapped) scheduler yields: its dp_rank = tp_rank = 0 rank's.
            first = next((i for i in checked if i.dp_rank == 0 and i.tp_rank == 0), checked[0])
            self._rows.append(self.rank_rows[first.rank])
        if self.substitutions:
            logger.warning("%s", self.substitution_warning())

    def _fit_row(
        self, index: int, row: list[tuple[str, Clock]], info: RankInfo
    ) -> list[tuple[str, int]]:
        """`row` with each clock the rank's GPU offers or the nearest one (noted)."""
        offered = sorted(set(info.available_frequencies))
        fitted: list[tuple[str, int]] = []
        count: dict[tuple[Clock, int], int] = {}
        mapped: dict[Clock, int] = {}
        for name, clock in row:
            run = mapped.get(clock)
            if run is None:
                run = mapped[clock] = nearest_clock(clock, offered)
            if run != clock:
                count[(clock, run)] = count.get((clock, run), 0) + 1
            fitted.append((name, run))
        self.substitutions += [(index, info.rank, clock, run, n)
                               for (clock, run), n in count.items()]
        return fitted

    def substitution_warning(self) -> str:
        """One line naming every clock of the plan replaced, per row (ranks, clocks, entries)."""
        unit = "stage" if getattr(self, "_orig_rank_infos", None) is not None else "rank"
        grouped: dict[tuple[int, Clock, int], list[tuple[int, int]]] = {}
        for index, rank, clock, run, n in self.substitutions:
            grouped.setdefault((index, clock, run), []).append((rank, n))
        parts = []
        for (index, clock, run), who in sorted(grouped.items(), key=lambda kv: kv[0]):
            ranks = ", ".join(str(rank) for rank, _ in who)
            where = (f"stage {index} (rank{'s' if len(who) > 1 else ''} {ranks})"
                     if unit == "stage" else f"rank {index}")
            entries = who[0][1]
            parts.append(f"{where}: {clock} -> {run} MHz ({entries} "
                         f"entr{'ies' if entries > 1 else 'y'})")
        return (f"{type(self).__name__} (job {self.job_info.job_id or '?'}): plan file "
                f"{self.solution_path} asks for clocks the GPUs do not offer; running the "
                f"nearest offered (a tie goes to the higher clock; rounded where a GPU lists "
                f"none): {'; '.join(parts)}")

    def _check_row(
        self, index: int, row: list[tuple[str, Clock]], info: RankInfo, unit: str
    ) -> None:
        who = f"{unit} {index}" + (f" (rank {info.rank})" if unit != "rank" else "")
        where = f"{type(self).__name__}: plan file {self.solution_path}, row {index} for {who}"
        if info.instructions is not None:
            names = [name for name, _ in row]
            if names != info.instructions:
                mismatch = next(
                    (
                        j
                        for j, (a, b) in enumerate(zip(names, info.instructions, strict=False))
                        if a != b
                    ),
                    min(len(names), len(info.instructions)),
                )
                planned = names[mismatch] if mismatch < len(names) else "nothing"
                run = (
                    info.instructions[mismatch] if mismatch < len(info.instructions) else "nothing"
                )
                raise SchedulerError(
                    f"{where}: the instructions do not match the order the rank runs: entry "
                    f"{mismatch} plans {planned!r} where the rank runs {run!r} (the plan has "
                    f"{len(names)} instructions, the rank runs {len(info.instructions)})"
                )

    def _run(self) -> ScheduleGenerator:
        """Yield the plan once; the framework keeps serving it afterwards."""
        yield [
            FrequencySchedule(rank=info.rank, frequencies=list(row))
            for info, row in zip(self.rank_infos, self._rows, strict=True)
        ]


class PointSolution3D(make_3d_parallel(PointSolution, "PointSolution3D")):  # type: ignore[misc]
    """`PointSolution` planned per pipeline stage: one plan row per stage, run by all its ranks.

    Each rank runs its stage's row with the clocks fitted to its own GPU (`rank_rows`).
    """

    def next_schedule(self) -> list[FrequencySchedule]:
        """Every rank's schedule: its stage's row, clocks fitted to its own GPU."""
        return [FrequencySchedule(rank=s.rank, frequencies=list(self.rank_rows[s.rank]))
                for s in super().next_schedule()]
