"""Scenario 1: Ollama faults while `python ingest.py` runs, through the loopback fake.

Each test indexes revision A of a corpus (the sample corpus plus two generated handbooks large
enough to need several embedding calls and two commit groups), rewrites every file to revision B,
runs ingest under one fault, checks what the store holds, clears the fault, and checks that the
next run converges to exactly what a clean ingest of revision B produces.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from fake_ollama import FakeOllama
from faultlib import (
    OllamaProcess,
    chunk_counts,
    clean_reference,
    commit_groups,
    committed_hashes,
    index_dir,
    poll,
    write_handbooks,
)
from helpers import (
    Done,
    chroma_state,
    copy_sample,
    corpus_hashes,
    edit,
    file_listing,
    finish,
    run_ingest,
    snapshot,
    start_ingest,
)

import ingest

pytestmark = [pytest.mark.heavy, pytest.mark.process]  # a file over a minute of real processes: `pytest --all` only, scheduled first

# aa- sorts first: a group of its own (>= COMMIT_BATCH_CHUNKS chunks), then ab- shares the second
# group with the sample files, and needs two embedding calls of its own.
HANDBOOKS = {"aa-handbook.md": 260, "ab-handbook.md": 100}


@pytest.fixture
def ollama(fake: FakeOllama) -> Iterator[FakeOllama]:
    if not fake.running:
        fake.restart()
    fake.reset()
    yield fake
    if not fake.running:
        fake.restart()
    fake.reset()


@dataclass
class Revisions:
    corpus: Path
    store: Path
    old_state: dict
    old_hashes: dict[str, str]
    new_hashes: dict[str, str]
    indexed: int  # files ingest indexes (all of them change from A to B)
    ab_token: str  # in every chunk of ab-handbook.md: content-keyed faults hit the calls after its first
    aa_token: str  # in every chunk of aa-handbook.md


@pytest.fixture
def revisions(ollama: FakeOllama, tmp_path: Path) -> Revisions:
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    tokens = write_handbooks(corpus, HANDBOOKS, "A")
    first = run_ingest(ollama, corpus, store)
    assert first.code == 0, first.err
    old_state, old_hashes = chroma_state(store), corpus_hashes(corpus)
    write_handbooks(corpus, HANDBOOKS, "B")
    for path in sorted(corpus.rglob("*.md")):
        if path.relative_to(corpus).as_posix() not in HANDBOOKS:
            edit(path, path.read_text(encoding="utf-8") + "\nRevision B closing line.\n")
    new_hashes = corpus_hashes(corpus)
    counts = chunk_counts(corpus)
    # The premise of "mid-file": aa-handbook.md is a commit group of its own, and ab-handbook.md
    # needs two calls of its own (more chunks than one call carries), whatever their sizes.
    assert commit_groups(counts)[0] == ["aa-handbook.md"] and counts["ab-handbook.md"] > ingest.EMBED_BATCH
    ollama.reset()
    return Revisions(corpus, store, old_state, old_hashes, new_hashes, len(counts), tokens["ab-handbook.md"],
                     tokens["aa-handbook.md"])


def assert_old_or_new(rev: Revisions, *, new: set[str]) -> None:
    """Files in `new` committed revision B; every other file still has revision A's chunks,
    untouched: same ids, texts, metadata and vectors."""
    committed = committed_hashes(index_dir(rev.store))
    state = chroma_state(rev.store)
    indexed = set(rev.old_hashes) - {"private/offsite-backup.md"}
    assert set(committed) == indexed
    for path in indexed:
        if path in new:
            assert committed[path] == rev.new_hashes[path], path
        else:
            assert committed[path] == rev.old_hashes[path], path
            for name, collection in rev.old_state.items():
                old = {i: v for i, v in collection.items() if v[1]["path"] == path}
                assert {i: v for i, v in state[name].items() if v[1]["path"] == path} == old, path


def assert_converges(ollama: FakeOllama, rev: Revisions, tmp_path: Path) -> Done:
    again = run_ingest(ollama, rev.corpus, rev.store)
    assert again.code == 0, again.err
    assert snapshot(rev.store) == clean_reference(ollama, rev.corpus, tmp_path)
    return again


def test_ollama_down_at_start_changes_nothing_then_converges(ollama: FakeOllama, revisions: Revisions,
                                                              tmp_path: Path) -> None:
    before = file_listing(revisions.store)
    ollama.stop()
    done = run_ingest(ollama, revisions.corpus, revisions.store)  # only changed files: they keep their chunks
    assert done.code == 2, done.err
    assert done.summary["error"]["code"] == "embedder_unavailable"
    assert "start Ollama" in done.err and "ollama pull embeddinggemma" in done.err
    assert file_listing(revisions.store) == before
    fresh = run_ingest(ollama, revisions.corpus, tmp_path / "fresh")  # a first ingest: keywords first
    assert fresh.code == 1 and fresh.summary["vectors_pending"] == fresh.summary["chunks_without_vectors"] > 0
    assert "ollama pull embeddinggemma" in fresh.err
    ollama.restart()
    assert_converges(ollama, revisions, tmp_path)


def test_ollama_process_dies_mid_file_keeps_that_files_old_chunks(ollama: FakeOllama, revisions: Revisions,
                                                                  tmp_path: Path) -> None:
    # The Ollama process is SIGKILLed once every chunk of aa-handbook.md has its vector while
    # ab-handbook.md's last call (held) is still out, after at least one other call carrying it
    # (each call takes 0.5 s; the next group's calls go out while a group's last ones are
    # answered): aa-handbook.md's group is committed, ab-handbook.md keeps its old chunks.
    dying = OllamaProcess()
    held = f"{revisions.ab_token} revision-B part {HANDBOOKS['ab-handbook.md'] - 1}:"
    try:
        dying.configure(delay_seconds=0.5, hold_carrying=held)
        proc = start_ingest(dying, revisions.corpus, revisions.store)
        poll(lambda: (dying.calls_carrying(held) and dying.answered_carrying(revisions.aa_token) >= HANDBOOKS["aa-handbook.md"])
             or proc.poll() is not None, interval=0.02)
        assert dying.calls_carrying(revisions.ab_token) >= 2
        dying.kill()
        done = finish(proc)
    finally:
        dying.kill()
    assert done.code == 1 and "Traceback" not in done.err, done.err
    assert "left for the next run: ab-handbook.md" in done.err and dying.host in done.err
    assert_old_or_new(revisions, new={"aa-handbook.md"})
    assert_converges(ollama, revisions, tmp_path)


def faulted_once_aa_is_answered(ollama: FakeOllama, revisions: Revisions, **fault: object) -> Done:
    """An ingest whose calls carrying ab-handbook.md are held until every chunk of aa-handbook.md
    has its vector; then `fault` is configured and they are let go, to meet it. aa-handbook.md's
    group is committed whatever the machine's pace (with the fault keyed to ab's first call
    instead, aa's last calls could arrive after it on a loaded machine and fail too)."""
    ollama.configure(hold_carrying=revisions.ab_token)
    proc = start_ingest(ollama, revisions.corpus, revisions.store)
    poll(lambda: (ollama.calls_carrying(revisions.ab_token)
                  and ollama.answered_carrying(revisions.aa_token) >= HANDBOOKS["aa-handbook.md"])
         or proc.poll() is not None, interval=0.02)
    ollama.configure(hold_carrying=None, **fault)
    return finish(proc)


def test_ollama_500s_mid_file_keep_that_files_old_chunks(ollama: FakeOllama, revisions: Revisions,
                                                        tmp_path: Path) -> None:
    # The runner dies while ab-handbook.md's calls are out: they and every later call answer HTTP 500.
    done = faulted_once_aa_is_answered(ollama, revisions, fail_after=0)
    assert done.code == 1, done.err
    assert "Traceback" not in done.err and "HTTP 500" in done.err
    assert "left for the next run: ab-handbook.md" in done.err
    assert_old_or_new(revisions, new={"aa-handbook.md"})
    # Left for the next run, not failed: nothing is wrong with those files.
    assert (done.summary["left_for_next_run"], done.summary["failed"]) == (revisions.indexed - 1, 0)
    ollama.configure(fail_after=None)
    assert assert_converges(ollama, revisions, tmp_path).summary["updated"] == revisions.indexed - 1


def test_ollama_500s_from_the_first_call_keep_every_file(ollama: FakeOllama, revisions: Revisions,
                                                         tmp_path: Path) -> None:
    ollama.configure(fail_after=0)
    done = run_ingest(ollama, revisions.corpus, revisions.store)
    # Nothing could be embedded: exit 2, every file left for the next run.
    assert done.code == 2 and "HTTP 500" in done.err and "Traceback" not in done.err
    assert done.summary["chunks_written"] == 0 and done.summary["left_for_next_run"] == revisions.indexed
    assert_old_or_new(revisions, new=set())
    ollama.configure(fail_after=None)
    assert_converges(ollama, revisions, tmp_path)


def test_ollama_slower_than_the_timeout_keeps_every_file(ollama: FakeOllama, revisions: Revisions,
                                                         tmp_path: Path) -> None:
    ollama.configure(delay_seconds=2.0)
    done = run_ingest(ollama, revisions.corpus, revisions.store, RAG_EMBED_TIMEOUT="0.5")
    # Retried with smaller calls down to one chunk, then given up: exit 2, nothing lost.
    assert done.code == 2 and "Traceback" not in done.err, done.err
    assert "did not answer within 0.5 s" in done.err and "RAG_EMBED_TIMEOUT" in done.err
    assert "timed out; retrying with fewer" in done.err
    assert_old_or_new(revisions, new=set())
    ollama.configure(delay_seconds=0.0)
    assert_converges(ollama, revisions, tmp_path)


def test_model_404_at_start_and_mid_run(ollama: FakeOllama, revisions: Revisions, tmp_path: Path) -> None:
    before = file_listing(revisions.store)
    ollama.configure(missing_models=["embeddinggemma"])
    done = run_ingest(ollama, revisions.corpus, revisions.store)
    assert done.code == 2 and done.summary["error"]["code"] == "model_not_found"
    assert "ollama pull embeddinggemma" in done.err
    assert file_listing(revisions.store) == before
    # Mid-run: the model disappears while ab-handbook.md's calls are out.
    ollama.configure(missing_models=[])
    done = faulted_once_aa_is_answered(ollama, revisions, missing_models=["embeddinggemma"])
    assert done.code == 1 and "Traceback" not in done.err, done.err
    assert "ollama pull embeddinggemma" in done.err
    assert_old_or_new(revisions, new={"aa-handbook.md"})
    ollama.configure(missing_models=[])
    assert_converges(ollama, revisions, tmp_path)

