"""Shared pytest setup: repo root importable, the tiers, the hypothesis profile, plus fake-Ollama
fixtures."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent
ROOT = TESTS_DIR.parent
for _p in (str(ROOT), str(TESTS_DIR)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import budgets  # after the sys.path entries above; registers the hypothesis profiles
from fake_ollama import FakeOllama
from helpers import copy_index, copy_sample, ingest_in_process
from hypothesis import settings

FAST_TIER = "not slow and not process and not heavy"
EVERY_TIER = "not slow"  # the fault loops marked slow run only when asked for: -m slow
ALL_WORKERS = 3  # on the 2-core machines the suite is made for: its tests wait on processes and
# sockets a third of the time (457 s against 518 s with two workers)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--all", action="store_true",
                     help=f"every tier ({EVERY_TIER}), on {ALL_WORKERS} workers (what CI runs)")


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which turns -n into workers
def pytest_cmdline_main(config: pytest.Config) -> None:
    """Which tests run, unless -m says: plain `pytest` the fast tier; `pytest --all` every tier on
    ALL_WORKERS workers, a test file each (a module's fixtures are built once; -n N overrides the
    count); a file or test named on the command line runs whatever its tier."""
    everything = config.option.all
    if not config.option.markexpr:
        named = config.args_source is pytest.Config.ArgsSource.ARGS
        config.option.markexpr = EVERY_TIER if everything or named else FAST_TIER
    if everything and getattr(config.option, "numprocesses", 0) is None and not hasattr(config, "workerinput"):
        config.option.numprocesses = ALL_WORKERS
        config.option.dist = "loadfile"
        config.option.loadscopereorder = False


def pytest_configure(config: pytest.Config) -> None:
    """The hypothesis profile (tests/budgets.py), loaded before any test module is imported: the
    one HYPOTHESIS_PROFILE names, else "ci" under --all (CI's full budgets) and "dev" (a tenth of
    each budget) for the edit-and-test loop. hypothesis's own --hypothesis-profile wins over both."""
    if config.getoption("hypothesis_profile", None):
        return
    name = os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if config.option.all else "dev")
    if name not in budgets.PROFILES:
        raise pytest.UsageError(f"HYPOTHESIS_PROFILE={name!r}: the profiles are {', '.join(budgets.PROFILES)}")
    settings.load_profile(name)


def pytest_report_header(config: pytest.Config) -> str:
    return f"hypothesis profile: {settings.get_current_profile_name()} (tests/budgets.py)"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked `heavy` run first. xdist hands out whole files in collection order (--dist
    loadfile, --no-loadscope-reorder: its own reorder puts the files with the most tests first,
    which left the one-test minute-long files for the end, a worker busy with one while the other
    idled)."""
    items.sort(key=lambda item: item.get_closest_marker("heavy") is None)  # stable: files stay whole


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeOllama]:
    """One fake Ollama per test module (modules that need a fresh one per test define their own)."""
    with FakeOllama() as instance:
        yield instance


@pytest.fixture
def fakes() -> Iterator[tuple[FakeOllama, FakeOllama]]:
    """Two fake Ollamas, fresh per test: hosts of one OLLAMA_HOST (helpers.Hosts)."""
    with FakeOllama() as first, FakeOllama() as second:
        yield first, second


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


@pytest.fixture(scope="session")
def indexed_sample(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The sample corpus and the store ingest built from it (in this process), once per test
    process (an xdist worker): never changed, only copied (see `sample_index`)."""
    tmp = tmp_path_factory.mktemp("indexed-sample")
    with FakeOllama() as fake:
        corpus, store = copy_sample(tmp), tmp / "store"
        done = ingest_in_process(fake, corpus, store)
        assert done.code == 0, done.err
    return corpus, store


@pytest.fixture
def sample_index(indexed_sample: tuple[Path, Path], tmp_path: Path) -> tuple[Path, Path]:
    """tmp_path/corpus and tmp_path/store: a fresh copy of the indexed sample, as an ingest of
    the copy would have left it (every FakeOllama embeds the same text to the same vector)."""
    return copy_index(*indexed_sample, tmp_path)
