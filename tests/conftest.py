"""Shared pytest setup: repo root importable, plus fake-Ollama fixtures."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent
ROOT = TESTS_DIR.parent
for _p in (str(ROOT), str(TESTS_DIR)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from fake_ollama import FakeOllama  # noqa: E402  (needs the sys.path entry above)


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeOllama]:
    """One fake Ollama per test module (modules that need a fresh one per test define their own)."""
    with FakeOllama() as instance:
        yield instance


@pytest.fixture
def fake_ollama() -> Iterator[FakeOllama]:
    fake = FakeOllama().start()
    try:
        yield fake
    finally:
        fake.stop()


@pytest.fixture
def fake_ollama_env(fake_ollama: FakeOllama, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeOllama]:
    monkeypatch.setenv("OLLAMA_HOST", fake_ollama.host)
    yield fake_ollama
