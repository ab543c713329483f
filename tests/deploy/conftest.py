"""Fixtures of the deployment tests: `pki`, a throwaway TLS PKI (deploy_kit.py has the helpers)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from tests.deploy.deploy_kit import Pki, make_pki


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pki]:
    """Certificates made with the openssl command (skips when it is missing)."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed: no certificates to test TLS with")
    yield make_pki(tmp_path_factory.mktemp("pki"))
