"""Ingest hardening, round three (issue 42): a host answering vectors of another size mid-run."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from fake_ollama import FakeOllama
from faultlib import write_handbooks
from helpers import ingest_in_process

CALIBRATION = "task: search result"


@dataclass(frozen=True)
class Hosts:
    """Several fakes as one OLLAMA_HOST value."""

    fakes: tuple[FakeOllama, ...]

    @property
    def host(self) -> str:
        return ",".join(fake.host for fake in self.fakes)


@pytest.fixture
def fakes() -> Iterator[tuple[FakeOllama, FakeOllama]]:
    with FakeOllama() as first, FakeOllama() as second:
        yield first, second


def chunk_inputs(fake: FakeOllama) -> list[str]:
    return [text for text in fake.calls()["answered_inputs"] if not text.startswith(CALIBRATION)]


# ---------------------------------------------------------------------------
# D1: a host whose vectors change size mid-run leaves the rotation; the others finish the run.


def test_a_host_answering_another_size_mid_run_is_dropped_and_the_run_finishes(
        fakes: tuple[FakeOllama, FakeOllama], tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    tokens = write_handbooks(corpus, {f"book{i}.md": 30 for i in range(4)}, "A")
    for fake in fakes:
        fake.configure(delay_per_text_seconds=0.01)
    liar = fakes[1]
    liar.configure(wrong_dims_after_carrying=[tokens["book0.md"], 512])
    done = ingest_in_process(Hosts(fakes), corpus, tmp_path / "store", RAG_EMBED_CONCURRENCY="2")
    assert done.code == 0, done.err
    assert done.summary["vectors_pending"] == 0 and done.summary["errors"] == [], done.summary
    assert done.summary["chunks_embedded"] == done.summary["chunks_written"] > 0
    left = [host for host in done.summary["embedders"] if host["left_rotation"]]
    assert [host["host"] for host in left] == [liar.host], done.summary["embedders"]
    warning = f"Ollama at {liar.host} answered 512-dimensional vectors for 'embeddinggemma', the index holds 768"
    assert f"{warning}: that host is left out of this run" in done.err, done.err
    assert "calibration skipped" not in done.err, done.err


def test_every_host_answering_another_size_ends_with_that_cause(
        fakes: tuple[FakeOllama, FakeOllama], tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    tokens = write_handbooks(corpus, {f"book{i}.md": 30 for i in range(4)}, "A")
    for fake in fakes:
        fake.configure(wrong_dims_after_carrying=[tokens["book0.md"], 512])
    done = ingest_in_process(Hosts(fakes), corpus, tmp_path / "store")
    assert done.code == 1, done.err
    assert done.summary["vectors_pending"] > 0
    said = "\n".join(done.summary["errors"])
    assert "512-dimensional vectors for 'embeddinggemma', the index holds 768" in said, said
    assert any(fake.host in said for fake in fakes), said
    assert "start Ollama" not in said, said
