"""Core-test fixtures: `clean_emit`, for the tests of `zeus_agent.emit` and what is built on it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from zeus_agent import emit


@pytest.fixture
def clean_emit(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No CUDA, rank or agent-socket variable from the environment; the default publisher closed
    after the test (modules that use it name it in `pytestmark`)."""
    for var in ("CUDA_VISIBLE_DEVICES", "LOCAL_RANK", "RANK", emit.ENV_SOCKET):
        monkeypatch.delenv(var, raising=False)
    yield
    emit.close()
