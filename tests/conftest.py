"""Shared fixtures.  Every test fails if asyncio logged an error (a destroyed pending task, an
unretrieved exception, an unclosed transport): a clean shutdown leaves no traceback."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from hypothesis import settings

# Same examples on every run: a failure found once is found again, and CI never flakes on a draw.
settings.register_profile("deterministic", derandomize=True, database=None)
settings.load_profile("deterministic")

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"


class _ErrorCollector(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(autouse=True)
def no_asyncio_errors():
    collector = _ErrorCollector()
    logger = logging.getLogger("asyncio")
    logger.addHandler(collector)
    try:
        yield collector
    finally:
        logger.removeHandler(collector)
    messages = [r.getMessage() for r in collector.records]
    assert not messages, f"asyncio logged errors: {messages}"


@pytest.fixture
def artifacts_dir() -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS
