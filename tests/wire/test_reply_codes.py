"""Every error that answers a request carries its reply code; `reply_for` is the one mapping.

The agent's GPU commands, its trainer gateway and the coordinator's endpoints answer through
`zeus_agent.errors.reply_for`: these tests walk every module of both packages for exception
classes with a `code` and check that the code is a known one and that `reply_for` answers it.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import coordinator
import zeus_agent
from coordinator.budget.budgets import BudgetRefused
from coordinator.jobs import DuplicateError, UnknownJobError
from coordinator.optimizer import StragglerError
from coordinator.state.jetstream import StateUnavailableError
from zeus_agent.agent.core.energy_ring import WindowOutOfRange
from zeus_agent.broker import PermissionRefusedError, PortInUseError
from zeus_agent.emit.records import RegistrationError
from zeus_agent.errors import (
    UNEXPECTED,
    BrokerError,
    ForbiddenError,
    GPUNotSupportedError,
    GPUPermissionError,
    GPUUnavailableError,
    GPUValueError,
    PayloadError,
    ReadOnlyError,
    ReplyError,
    SettingRefusedError,
    TrainerLeftError,
    UnansweredError,
    ZeusAgentError,
    reply_for,
)
from zeus_agent.wire.messages import REPLY_CODES, Reply


def _subclasses(cls: type[BaseException]) -> Iterator[type[BaseException]]:
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def _coded_classes() -> list[type[BaseException]]:
    """Every exception class of `zeus_agent` and `coordinator` that has a `code`."""
    for package in (zeus_agent, coordinator):
        for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            importlib.import_module(module.name)
    ours = {c for c in _subclasses(BaseException)
            if c.__module__.partition(".")[0] in ("zeus_agent", "coordinator")}
    return sorted((c for c in ours if hasattr(c, "code")),
                  key=lambda c: f"{c.__module__}.{c.__qualname__}")


def _instance(cls: type[BaseException]) -> BaseException:
    """An instance of `cls` whose message is "why" (constructors differ)."""
    if issubclass(cls, WindowOutOfRange):
        return cls("why", 0, None)
    if issubclass(cls, StragglerError):
        return cls(cls.code, "why")
    if issubclass(cls, RegistrationError):
        return cls("job", "quota", "why")
    if issubclass(cls, PortInUseError):
        return cls("why", 4222)
    return cls("why")


CODED = _coded_classes()


def test_the_walk_finds_the_errors_of_both_packages() -> None:
    names = {c.__qualname__ for c in CODED}
    assert {"PayloadError", "WindowOutOfRange", "ReadOnlyError", "UnknownJobError",
            "StragglerError", "StateUnavailableError"} <= names


@pytest.mark.parametrize("cls", CODED, ids=lambda c: f"{c.__module__}.{c.__qualname__}")
def test_every_coded_error_has_a_known_code_and_reply_for_answers_it(cls: Any) -> None:
    assert issubclass(cls, ReplyError), "a class with a code answers through reply_for"
    assert cls.code in REPLY_CODES
    error = _instance(cls)
    assert isinstance(error, ReplyError)
    reply = reply_for(error)
    assert (reply.ok, reply.code, reply.error) == (False, error.code, str(error))
    assert "why" in reply.error


@pytest.mark.parametrize(
    ("error", "code"),
    [  # The codes the agent's commands, the gateway and the coordinator answered with before.
        (PayloadError("why", "field"), "bad_request"),
        (WindowOutOfRange("why", 0, None), "out_of_range"),
        (GPUValueError("why"), "out_of_range"),
        (GPUNotSupportedError("why"), "not_supported"),
        (GPUPermissionError("why"), "permission"),
        (GPUUnavailableError("why"), "unavailable"),
        (TrainerLeftError("why"), "trainer_left"),
        (ReadOnlyError("why"), "read_only"),
        (SettingRefusedError("why"), "conflict"),
        (BrokerError("why"), "internal"),
        (ZeusAgentError("why"), "internal"),
        (UnknownJobError("why"), "unknown_job"),
        (DuplicateError("why"), "duplicate"),
        (StateUnavailableError("why"), "unavailable"),
        (StragglerError("conflict", "why"), "conflict"),
        (BudgetRefused("why"), "bad_request"),
        (PermissionRefusedError("why"), "forbidden"),
        (UnansweredError("why"), "unavailable"),
        (ForbiddenError("why"), "forbidden"),
    ],
)
def test_reply_codes_are_the_ones_replies_carry(error: BaseException, code: str) -> None:
    assert reply_for(error) == Reply.failure(code, "why")


def test_an_error_relaying_a_reply_answers_with_that_reply_code() -> None:
    error = RegistrationError("job", "quota", "too many jobs")
    assert reply_for(error) == Reply.failure("quota", "registering the job failed: [quota] too "
                                             "many jobs")


def test_an_error_without_a_code_is_internal_and_shows_none_of_its_text() -> None:
    assert reply_for(RuntimeError("secret internals")) == Reply.failure("internal", UNEXPECTED)
    reply = reply_for(KeyError("secret"), "internal error in the agent; see its log")
    assert reply == Reply.failure("internal", "internal error in the agent; see its log")


def test_a_reply_is_cut_to_fit() -> None:
    reply = reply_for(SettingRefusedError("x" * 10_000))
    assert reply.code == "conflict" and len(reply.error) < 10_000


def test_a_straggler_error_takes_only_a_known_code() -> None:
    with pytest.raises(ValueError, match="not a reply code"):
        StragglerError("no_such_code", "why")


def test_a_payload_error_within_a_request_names_it_and_keeps_its_field() -> None:
    error = PayloadError("t1_ns must not precede t0_ns", "t1_ns").within("WINDOW")
    assert error.field == "t1_ns"
    assert reply_for(error) == Reply.failure("bad_request",
                                             "WINDOW: t1_ns must not precede t0_ns")


def _replies_built_in_except_handlers() -> list[str]:
    """`file:line` of every `Reply.failure(...)` / `Reply(ok=...)` inside an `except` block."""
    root = Path(__file__).resolve().parents[2]
    found = []
    for package in ("zeus_agent", "coordinator"):
        for path in sorted((root / package).rglob("*.py")):
            for handler in ast.walk(ast.parse(path.read_text())):
                if not isinstance(handler, ast.ExceptHandler):
                    continue
                for node in ast.walk(handler):
                    if not isinstance(node, ast.Call):
                        continue
                    name = ast.unparse(node.func)
                    if name.endswith("Reply.failure") or (
                            name.endswith("Reply") and any(k.arg == "ok" for k in node.keywords)):
                        found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_no_exception_is_mapped_to_a_reply_by_hand() -> None:
    """An exception's reply comes from `reply_for` (raise a coded error), never a literal code."""
    assert _replies_built_in_except_handlers() == []
