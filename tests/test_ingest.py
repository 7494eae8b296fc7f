"""ingest.py end to end: real Chroma in temporary folders, the fake Ollama over HTTP, ingest.main()
in-process where convenient and `python ingest.py` as a real process where the process matters."""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from itertools import pairwise
from pathlib import Path
from typing import Any

import chromadb
import pytest
from chromadb.api.client import SharedSystemClient
from fake_ollama import FakeOllama, count_tokens, fake_embedding
from helpers import (
    CRASHING_CHILD,
    ENV_VARS,
    ROOT,
    SAMPLE,
    Run,
    assert_consistent,
    child_env,
    chroma_state,
    chunk_calls,
    chunk_inputs,
    copy_sample,
    corpus_hashes,
    current_of,
    edit,
    file_listing,
    ingest_in_process,
    keyword_db,
    snapshot,
    store_bytes,
)

import corpus_rules as rules
import ingest

SECRET = b"SECRET-OFFSITE-TOKEN-7731"
GEMMA = rules.PREFIX_SCHEMES["embeddinggemma"]
SUMMARY_KEYS = {"exit", "scanned", "added", "updated", "unchanged", "removed", "excluded", "ignored", "failed",
                "chunks_written", "chunks_embedded", "chunks_reused", "left_for_next_run", "chunks_without_vectors", "vectors_pending",
                "embedding_calls", "embedders", "seconds",
                "commit", "dirty", "index", "rebuilt", "model_changed", "dry_run", "estimated_chunks", "errors",
                "listing", "files_found"}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ANONYMIZED_TELEMETRY", "False")


# ---------------------------------------------------------------------------
# Helpers.


def ingest_run(corpus: Path, store: Path, *extra: str) -> Run:
    """One run in this process (vector store included), in the environment the test set up."""
    return ingest_in_process(None, corpus, store, *extra)


def ingest_process(fake: FakeOllama, corpus: Path, store: Path, *extra: str, crash_at: str = "",
                   small_batches: bool = False) -> subprocess.Popen[str]:
    args = ["--corpus", str(corpus), "--store", str(store), *extra]
    if crash_at or small_batches:
        command = [sys.executable, "-c", CRASHING_CHILD, str(ROOT), *args]
    else:
        command = [sys.executable, str(ROOT / "ingest.py"), *args]
    return subprocess.Popen(command, env=child_env(fake, INGEST_CRASH_AT=crash_at), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT.parent)


def clean_snapshot(corpus: Path, tmp_path: Path, *extra: str) -> dict[str, Any]:
    fresh = tmp_path / f"fresh-store-{time.monotonic_ns()}"
    run = ingest_run(corpus, fresh, *extra)
    assert run.code == 0, run.err
    return snapshot(fresh)


def chunks_of(state: dict[str, dict[str, Any]], path: str) -> dict[str, Any]:
    return {i: v for col in state.values() for i, v in col.items() if v[1]["path"] == path}


def sample_chunk_count(context: int = 2048) -> int:
    budget = ingest.ChunkBudget(context, rules.DEFAULT_CHUNK_MAX_TOKENS, rules.DEFAULT_CHUNK_MIN_TOKENS, GEMMA)
    total = 0
    for path in SAMPLE.rglob("*.md"):
        doc = rules.parse_document(path.read_bytes(), path.relative_to(SAMPLE).as_posix())
        if doc.rag:
            total += len(rules.chunk_document(doc, budget(doc.title), budget.min_tokens))
    return total


def wait_for(condition: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def embed_requests(fake: FakeOllama) -> list[dict[str, Any]]:
    """The embed calls' bodies, but for the model fingerprint's probe (see helpers.chunk_calls)."""
    return [body for method, path, body in fake.requests
            if path == "/api/embed" and body.get("input") != [rules.FINGERPRINT_TEXT]]


# ---------------------------------------------------------------------------
# The vector writer: one protocol, two ways to run it.


def test_both_vector_writers_speak_the_vectors_protocol_with_the_stores_signatures() -> None:
    for name in (*rules.VECTOR_WRITES, *rules.VECTOR_READS):
        expected = list(inspect.signature(getattr(rules.Vectors, name)).parameters)
        assert list(inspect.signature(getattr(rules.VectorStore, name)).parameters) == expected, name
        assert list(inspect.signature(getattr(ingest.VectorClient, name)).parameters) == expected, name
    members = {name for name in vars(rules.Vectors) if not name.startswith("_")}
    for writer in (ingest.VectorProcess, ingest.InProcessVectors):
        assert members <= set(dir(writer)), writer
        for name in ("start", "usable", "shut"):  # what the client leaves to each way of running it
            assert getattr(writer, name) is not getattr(ingest.VectorClient, name), (writer, name)


@pytest.mark.parametrize("writer", [ingest.InProcessVectors,
                                    pytest.param(ingest.VectorProcess, marks=pytest.mark.process)])
def test_a_failed_write_is_raised_by_settle_and_by_every_later_operation(writer: type[ingest.VectorClient],
                                                                         tmp_path: Path) -> None:
    settings = rules.load_settings({"RAG_CORPUS_DIR": str(tmp_path), "RAG_STORE_DIR": str(tmp_path / "store")})
    layout = rules.StoreLayout(settings.store_dir)
    layout.index_dir("idx-0123456789ab").mkdir(parents=True)
    vectors = writer()
    try:
        vectors.open(settings, layout, "idx-0123456789ab", {"manifest_dims": 3})
        vectors.settle(vectors.upsert("active", ["a"], [[0.1, 0.2, 0.3]], ["text a"], [{"path": "a.md"}]))
        assert (vectors.ids("active"), vectors.count("active"), vectors.in_use()) == (["a"], 1, True)
        vectors.upsert("active", ["b"], [[0.1, 0.2]], ["text b"], [{"path": "b.md"}])  # other dimensions
        with pytest.raises(rules.RagError) as failed:
            vectors.settle()
        with pytest.raises(rules.RagError) as later:
            vectors.count("active")
        assert (later.value.code, later.value.message) == (failed.value.code, failed.value.message)
        assert "dimension" in failed.value.message and not vectors.usable()
    finally:
        vectors.close()
        vectors.shut()
        SharedSystemClient.clear_system_cache()


# ---------------------------------------------------------------------------
# One shared ingest of the sample corpus (read-only tests).


@dataclass
class Ingested:
    store: Path
    run: Run
    embed_calls: int


@pytest.fixture(scope="module")
def sample_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ingested]:
    store = tmp_path_factory.mktemp("sample") / "store"
    with FakeOllama() as fake, pytest.MonkeyPatch.context() as mp:
        for name in ENV_VARS:
            mp.delenv(name, raising=False)
        mp.setenv("OLLAMA_HOST", fake.host)
        run = ingest_run(SAMPLE, store)
        yield Ingested(store, run, chunk_calls(fake))


def test_first_ingest_summary_and_current(sample_store: Ingested) -> None:
    run = sample_store.run
    assert run.code == 0, run.err
    summary = run.summary
    assert set(summary) == SUMMARY_KEYS
    expected = {"exit": 0, "scanned": 7, "added": 6, "updated": 0, "unchanged": 0, "removed": 0, "excluded": 1,
                "ignored": 0, "failed": 0, "chunks_written": sample_chunk_count(), "left_for_next_run": 0,
                "rebuilt": True, "model_changed": False, "dry_run": False, "estimated_chunks": 0, "errors": [],
                "listing": []}
    assert {k: summary[k] for k in expected} == expected
    assert summary["seconds"] > 0
    assert 1 <= summary["embedding_calls"] == sample_store.embed_calls
    # Every chunk embedded once, none reused: the sample corpus has no two chunks with the same text.
    assert (summary["chunks_embedded"], summary["chunks_reused"]) == (summary["chunks_written"], 0)
    # Batched: several chunks per /api/embed call.
    assert summary["embedding_calls"] < summary["chunks_written"]
    rev = subprocess.run(["git", "-C", str(SAMPLE), "rev-parse", "HEAD"], capture_output=True, text=True)
    status = subprocess.run(["git", "-C", str(SAMPLE), "status", "--porcelain", "--", "."], capture_output=True, text=True)
    head = rev.stdout.strip() if rev.returncode == 0 else None  # a checkout without git: null stamp
    dirty = bool(status.stdout.strip()) if head else None
    assert (summary["commit"], summary["dirty"]) == (head, dirty)
    current = current_of(sample_store.store)
    assert current["index"] == summary["index"] == rules.IndexManifest.from_dict(current["manifest"]).index_name()
    assert current["generation"] == 1
    assert current["manifest"] == {
        "model": "embeddinggemma", "dims": 768, "prefix_scheme": "embeddinggemma", "chunker_version": rules.CHUNKER_VERSION,
        "chunk_max_tokens": 512, "chunk_min_tokens": 64, "tool_version": rules.TOOL_VERSION}
    stamp = dict(current["stamp"])
    assert datetime.fromisoformat(stamp.pop("ingested_at")).tzinfo is not None
    digest = hashlib.sha256(b"embeddinggemma:latest").hexdigest()  # as the fake lists the model
    fingerprint = rules.ModelFingerprint.from_dict(stamp.pop("fingerprint"))
    assert stamp == {"commit": head, "dirty": dirty, "files": 6, "chunks": summary["chunks_written"],
                     "model_digest": digest, "vectors_pending": 0}
    # The model as the fake embeds it: its vector of the fingerprint text, and the name it reported.
    expected = rules.ModelFingerprint.of(fake_embedding(rules.FINGERPRINT_TEXT, 768), "embeddinggemma")
    assert fingerprint is not None and fingerprint.agrees(expected) and fingerprint.served_model == "embeddinggemma"
    assert sorted(p.name for p in sample_store.store.iterdir()) == sorted([rules.CURRENT_FILE, rules.LOCK_FILE,
                                                                           current["index"]])
    assert "resolved configuration: corpus=" in run.err and f"store={sample_store.store}" in run.err
    assert "7 scanned, 6 added" in run.err


def test_lifecycle_key_and_file_metadata_on_every_chunk(sample_store: Ingested) -> None:
    state = chroma_state(sample_store.store)
    active, superseded = state["chunks_active"], state["chunks_superseded"]
    assert active and superseded
    for collection, lifecycle in ((active, "active"), (superseded, "superseded")):
        for document, meta, vector in collection.values():
            assert set(rules.META_KEYS) <= set(meta)
            assert meta["lifecycle"] == lifecycle
            path = SAMPLE / meta["path"]
            assert meta["content_hash"] == rules.content_hash(path.read_bytes())
            assert meta["mtime_ns"] == path.stat().st_mtime_ns
            assert len(vector) == 768 and document
    assert {m["path"] for _, m, _ in superseded.values()} == {"runbooks/deploy-2023.md"}
    assert "runbooks/deploy-2023.md" not in {m["path"] for _, m, _ in active.values()}
    con = keyword_db(sample_store.store)
    rows = {i: (lc, text) for i, lc, text in con.execute("SELECT id, lifecycle, text FROM chunks")}
    assert rows == {i: (lc, d) for lc, col in (("active", active), ("superseded", superseded)) for i, (d, _, _) in col.items()}
    assert dict(con.execute("SELECT path, lifecycle FROM documents"))["runbooks/deploy-2023.md"] == "superseded"


def test_rag_false_file_leaves_no_trace(sample_store: Ingested) -> None:
    assert SECRET in (SAMPLE / "private/offsite-backup.md").read_bytes()
    for path in sample_store.store.rglob("*"):
        if path.is_file():
            assert SECRET not in path.read_bytes(), path
    assert b"offsite-backup" not in store_bytes(sample_store.store)
    con = keyword_db(sample_store.store)
    assert con.execute("SELECT count(*) FROM documents WHERE path LIKE 'private/%'").fetchone() == (0,)


def test_chunk_line_ranges_match_the_source_files(sample_store: Ingested) -> None:
    con = keyword_db(sample_store.store)
    documents = {p: (n, c) for p, n, c in con.execute("SELECT path, line_count, chunk_count FROM documents")}
    state = chroma_state(sample_store.store)
    for path, (line_count, chunk_count) in documents.items():
        raw = (SAMPLE / path).read_bytes()
        lines = raw.decode("utf-8").split("\n")[:-1]
        doc = rules.parse_document(raw, path)
        assert line_count == len(lines) == doc.line_count
        chunks = sorted(con.execute("SELECT chunk_index, start_line, end_line, heading, text, id FROM chunks "
                                    "WHERE path = ?", (path,)))
        assert [c[0] for c in chunks] == list(range(chunk_count))
        assert chunks[0][1] == doc.body_start and chunks[-1][2] == len(lines)
        for (_, _, end, _, _, _), (_, start, _, _, _, _) in pairwise(chunks):
            assert start == end + 1
        for index, start, end, heading, text, chunk in chunks:
            assert text == "\n".join(lines[start - 1:end]).strip()
            meta = chunks_of(state, path)[chunk][1]
            assert (meta["start_line"], meta["end_line"], meta["heading"], meta["chunk_index"]) == (start, end, heading, index)
            assert meta["title"] == doc.title
    database = con.execute("SELECT start_line FROM chunks WHERE heading = 'Deploy runbook > Rollback > Database'").fetchone()
    assert (SAMPLE / "runbooks/deploy.md").read_text(encoding="utf-8").split("\n")[database[0] - 1] == "### Database"


def test_keyword_rows_use_the_shared_terms(sample_store: Ingested) -> None:
    con = keyword_db(sample_store.store)
    for expression, path in ((rules.fts_any(rules.query_terms("E4091")), "reference/api.md"),
                             (rules.fts_any(rules.query_terms("LOG_RETENTION_DAYS")), "ja/log-collection.md"),
                             (rules.fts_any(rules.query_terms("ログ収集")), "ja/log-collection.md")):
        weights = ", ".join(map(str, rules.FTS_WEIGHTS))
        hits = [p for (p,) in con.execute("SELECT c.path FROM chunks_fts f JOIN chunks c ON c.rowid = f.rowid "
                                          f"WHERE chunks_fts MATCH ? ORDER BY bm25(chunks_fts, {weights})", (expression,))]
        assert hits[0] == path
    identifier = {p for (p,) in con.execute("SELECT c.path FROM chunks_fts f JOIN chunks c ON c.rowid = f.rowid "
                                            "WHERE chunks_fts MATCH '\"log_retention_days\"'")}
    assert identifier == {"ja/log-collection.md"}


# ---------------------------------------------------------------------------
# Incremental runs.


def test_unchanged_corpus_makes_no_embed_calls_and_reads_no_file(
        tmp_path: Path, fake_ollama_env: FakeOllama, monkeypatch: pytest.MonkeyPatch) -> None:
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    assert ingest_run(corpus, store).code == 0
    current_bytes = (store / rules.CURRENT_FILE).read_bytes()
    before = snapshot(store)
    # Within the mtime tolerance with the same size counts as unchanged, without reading the file.
    glossary = corpus / "reference/glossary.md"
    st = glossary.stat()
    os.utime(glossary, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    fake_ollama_env.reset()
    read: list[str] = []
    original = rules.read_beneath

    def recording_read(root_fd: int, parts: list[str], **checks: Any) -> bytes:
        read.append("/".join(parts))
        return original(root_fd, parts, **checks)

    monkeypatch.setattr(rules, "read_beneath", recording_read)
    run = ingest_run(corpus, store)
    monkeypatch.undo()
    assert run.code == 0, run.err
    assert run.summary["embedding_calls"] == 0 and embed_requests(fake_ollama_env) == []
    assert (run.summary["unchanged"], run.summary["added"], run.summary["updated"]) == (6, 0, 0)
    # Only the excluded file is read: it has no registry row, so only reading it tells whether it
    # is still `rag: false`.
    # (Each folder's .ragignore is looked for too: scope, not content.)
    assert {p for p in read if not p.endswith(".ragignore")} == {"private/offsite-backup.md"}
    # A no-op run keeps the generation (and CURRENT.json) as it was.
    assert (store / rules.CURRENT_FILE).read_bytes() == current_bytes
    assert snapshot(store) == before


def test_a_run_reads_each_changed_file_once(tmp_path: Path, fake_ollama_env: FakeOllama,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan made before the lock (to know whether Ollama is needed) is the one carried out."""
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    assert ingest_run(corpus, store).code == 0
    edit(corpus / "reference" / "glossary.md", "# Glossary\n\nA new definition.\n")
    reads: list[list[str]] = []
    read_beneath = rules.read_beneath

    def counted(root_fd: int, parts: list[str], **kwargs: Any) -> bytes:
        reads.append(list(parts))
        return read_beneath(root_fd, parts, **kwargs)

    monkeypatch.setattr(rules, "read_beneath", counted)
    run = ingest_run(corpus, store)
    assert run.code == 0 and run.summary["updated"] == 1, run.err
    # The edited file and the rag: false one (it has no row, so it is read to learn that again), once each.
    planned = sorted(parts for parts in reads if parts[-1] != ingest.RAGIGNORE)
    assert planned == [["private", "offsite-backup.md"], ["reference", "glossary.md"]]


def test_mtime_only_change_makes_no_embed_calls(tmp_path: Path, fake_ollama_env: FakeOllama) -> None:
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    assert ingest_run(corpus, store).code == 0
    before = chroma_state(store)
    api = corpus / "reference/api.md"
    new_mtime = api.stat().st_mtime_ns + 100_000_000_000
    os.utime(api, ns=(new_mtime, new_mtime))
    fake_ollama_env.reset()
    run = ingest_run(corpus, store)
    assert run.code == 0, run.err
    assert run.summary["embedding_calls"] == 0 and chunk_calls(fake_ollama_env) == 0
    assert run.summary["unchanged"] == 6
    after = chroma_state(store)
    assert set(chunks_of(after, "reference/api.md")) == set(chunks_of(before, "reference/api.md"))
    for chunk, (document, meta, vector) in chunks_of(after, "reference/api.md").items():
        old_document, old_meta, old_vector = chunks_of(before, "reference/api.md")[chunk]
        assert meta == old_meta | {"mtime_ns": new_mtime}
        assert (document, vector) == (old_document, old_vector)
    for path in ("reference/glossary.md", "runbooks/deploy.md"):
        assert chunks_of(after, path) == chunks_of(before, path)
    assert keyword_db(store).execute("SELECT mtime_ns FROM documents WHERE path = 'reference/api.md'").fetchone() == (new_mtime,)
    assert current_of(store)["generation"] == 2
    # And the next run is a no-op again.
    again = ingest_run(corpus, store)
    assert again.summary["embedding_calls"] == 0 and current_of(store)["generation"] == 2


@pytest.mark.heavy  # about 1 s of CPU in ingest runs: in --all, to keep the fast tier's budget
def test_full_re_embeds_everything_to_the_same_state(tmp_path: Path, fake_ollama_env: FakeOllama) -> None:
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    first = ingest_run(corpus, store)
    before = snapshot(store)
    fake_ollama_env.reset()
    run = ingest_run(corpus, store, "--full")
    assert run.code == 0, run.err
    assert (run.summary["updated"], run.summary["added"], run.summary["unchanged"]) == (6, 0, 0)
    assert run.summary["chunks_written"] == first.summary["chunks_written"]
    assert len(chunk_inputs(fake_ollama_env, "embedded_inputs")) == first.summary["chunks_written"]
    assert snapshot(store) == before


def test_successors_are_recorded_and_those_not_indexed_are_warned_about(tmp_path: Path,
                                                                        fake_ollama_env: FakeOllama) -> None:
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    run = ingest_run(corpus, store)
    assert run.code == 0 and "superseded_by" not in run.err, run.err
    recorded = dict(keyword_db(store).execute("SELECT path, superseded_by FROM documents"))
    assert recorded.pop("runbooks/deploy-2023.md") == '["runbooks/deploy.md"]'
    assert set(recorded.values()) == {"[]"}
    old = corpus / "runbooks/deploy-2023.md"
    text = old.read_text(encoding="utf-8")
    # An excluded file (rag: false), a missing one, and garbage: warnings, never a failed file.
    edit(old, text.replace("superseded_by: runbooks/deploy.md",
                           "superseded_by: [runbooks/deploy.md, private/offsite-backup.md, runbooks/gone.md, ../up.md]"))
    run = ingest_run(corpus, store)
    assert run.code == 0 and (run.summary["updated"], run.summary["failed"]) == (1, 0), run.err
    assert "runbooks/deploy-2023.md: superseded_by entry ignored: path '../up.md'" in run.err
    for unindexed in ("private/offsite-backup.md", "runbooks/gone.md"):
        assert f"runbooks/deploy-2023.md: superseded_by names '{unindexed}', which is not indexed" in run.err
    assert keyword_db(store).execute("SELECT superseded_by FROM documents WHERE path = 'runbooks/deploy-2023.md'"
                                     ).fetchone() == ('["runbooks/deploy.md", "private/offsite-backup.md", '
                                                      '"runbooks/gone.md"]',)
    # Still dangling on a run that changes nothing (the successor may have been the file removed).
    again = ingest_run(corpus, store)
    assert again.code == 0 and again.summary["unchanged"] == again.summary["scanned"] - 1
    assert "'runbooks/gone.md', which is not indexed" in again.err
    assert "../up.md" not in again.err, "a file's own warnings come when it is read"


@pytest.mark.heavy  # about 1 s of CPU in ingest runs: in --all, to keep the fast tier's budget
def test_a_store_from_before_successors_records_them_without_embedding(tmp_path: Path,
                                                                       fake_ollama_env: FakeOllama) -> None:
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    assert ingest_run(corpus, store).code == 0
    con = sqlite3.connect(store / current_of(store)["index"] / rules.KEYWORD_DB)
    with con:
        con.execute("ALTER TABLE documents DROP COLUMN superseded_by")  # as an older ingest wrote it
        con.execute("PRAGMA user_version = 0")  # an older ingest recorded no schema version
    con.close()
    generation = current_of(store)["generation"]
    run = ingest_run(corpus, store)
    assert run.code == 0, run.err
    s = run.summary
    assert (s["unchanged"], s["updated"], s["embedding_calls"], s["chunks_written"], s["rebuilt"]) == (
        s["scanned"] - 1, 0, 0, 0, False)
    assert current_of(store)["generation"] == generation + 1, "the server sees the successors"
    assert snapshot(store) == clean_snapshot(corpus, tmp_path)
    assert ingest_run(corpus, store).summary["embedding_calls"] == 0


@pytest.mark.heavy  # about 1 s of CPU in ingest runs: in --all, to keep the fast tier's budget
def test_changes_deletions_rag_false_and_lifecycle_flips(tmp_path: Path, fake_ollama_env: FakeOllama) -> None:
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    assert ingest_run(corpus, store).code == 0
    api = corpus / "reference/api.md"
    edit(api, "---\nrag: false\n---\n" + api.read_text(encoding="utf-8"))
    (corpus / "oncall/escalation.md").unlink()
    glossary = corpus / "reference/glossary.md"
    edit(glossary, "---\nlifecycle: superseded\n---\n" + glossary.read_text(encoding="utf-8"))
    edit(corpus / "new/added.md", "# Added page\n\nBrand new words: zanzibar quokka.\n")
    run = ingest_run(corpus, store)
    assert run.code == 0, run.err
    s = run.summary
    assert (s["added"], s["updated"], s["removed"], s["excluded"], s["unchanged"]) == (1, 1, 2, 2, 3)
    state = chroma_state(store)
    con = keyword_db(store)
    for gone in ("reference/api.md", "oncall/escalation.md"):
        assert chunks_of(state, gone) == {}
        assert con.execute("SELECT count(*) FROM chunks WHERE path = ?", (gone,)).fetchone() == (0,)
        assert con.execute("SELECT count(*) FROM documents WHERE path = ?", (gone,)).fetchone() == (0,)
    assert con.execute("SELECT count(*) FROM chunks_fts WHERE chunks_fts MATCH ?",
                       (rules.fts_any(rules.query_terms("E4091")),)).fetchone() == (0,)
    glossary_chunks = chunks_of(state, "reference/glossary.md")
    assert glossary_chunks and set(glossary_chunks) <= set(state["chunks_superseded"])
    assert all(m["lifecycle"] == "superseded" for _, m, _ in glossary_chunks.values())
    assert chunks_of(state, "new/added.md")
    assert snapshot(store) == clean_snapshot(corpus, tmp_path)


# ---------------------------------------------------------------------------
# Failures and crashes: old chunks survive, the next run converges.


@pytest.mark.heavy  # about 1 s of CPU in ingest runs: in --all, to keep the fast tier's budget
def test_embedder_dies_mid_run_then_converges(tmp_path: Path, fake_ollama_env: FakeOllama,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ingest, "EMBED_BATCH", 4)
    monkeypatch.setattr(ingest, "COMMIT_BATCH_CHUNKS", 4)
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    assert ingest_run(corpus, store).code == 0
    old_state, old_hashes = chroma_state(store), corpus_hashes(corpus)
    for path in sorted(corpus.rglob("*.md")):
        edit(path, path.read_text(encoding="utf-8") + "\nRevision two adds this closing line.\n")
    fake_ollama_env.configure(fail_after=fake_ollama_env.embed_calls + 2)
    run = ingest_run(corpus, store)
    assert run.code == 1
    assert 0 < run.summary["chunks_written"] and run.summary["left_for_next_run"] > 0
    assert run.summary["failed"] == 0  # left for the next run, not failed
    assert "left for the next run" in run.err and "HTTP 500" in run.err
    new_hashes = corpus_hashes(corpus)
    con = keyword_db(store)
    documents = dict(con.execute("SELECT path, content_hash FROM documents"))
    assert len(documents) == 6
    kept = [p for p, h in documents.items() if h == old_hashes[p]]
    renewed = [p for p, h in documents.items() if h == new_hashes[p]]
    assert kept and renewed and len(kept) + len(renewed) == 6
    assert run.summary["left_for_next_run"] == len(kept)
    state = chroma_state(store)
    for path in kept:  # untouched: same ids, texts, metadata and vectors
        assert chunks_of(state, path) == chunks_of(old_state, path)
    assert_consistent(store, {p: {old_hashes[p], new_hashes[p]} for p in new_hashes}, set(documents))
    assert current_of(store)["generation"] == 2
    fake_ollama_env.configure(fail_after=None)
    again = ingest_run(corpus, store)
    assert again.code == 0, again.err
    assert again.summary["updated"] == len(kept)
    assert snapshot(store) == clean_snapshot(corpus, tmp_path)


@pytest.mark.process
def test_kill_9_at_many_points_then_rerun_converges(tmp_path: Path, fake_ollama_env: FakeOllama) -> None:
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    assert ingest_run(corpus, store).code == 0
    old = corpus_hashes(corpus)
    # Every kind of change at once: edits, a deletion, a new file, a lifecycle flip, an mtime-only touch.
    for rel in ("runbooks/deploy.md", "reference/api.md", "ja/log-collection.md"):
        edit(corpus / rel, (corpus / rel).read_text(encoding="utf-8").replace("the", "THE"))
    (corpus / "oncall/escalation.md").unlink()
    edit(corpus / "new/page.md", "# New page\n\n" + "\n\n".join(f"Paragraph {i} about quokkas." * 20 for i in range(8)))
    glossary = corpus / "reference/glossary.md"
    edit(glossary, "---\nlifecycle: superseded\n---\n" + glossary.read_text(encoding="utf-8"))
    deploy_2023 = corpus / "runbooks/deploy-2023.md"
    st = deploy_2023.stat()
    os.utime(deploy_2023, ns=(st.st_atime_ns, st.st_mtime_ns + 60_000_000_000))
    new = corpus_hashes(corpus)
    allowed = {p: {h for h in (old.get(p), new.get(p)) if h} for p in old.keys() | new.keys()}
    must_have = {"runbooks/deploy.md", "runbooks/deploy-2023.md", "reference/api.md", "reference/glossary.md",
                 "ja/log-collection.md"}

    # Crash points inside the write path (SIGKILL from within), then an outside kill -9 mid-run, then
    # a crash after everything is written but before CURRENT.json is replaced.
    for crash_at in ("chroma_update:1", "insert_rows:1", "chroma_delete:1", "delete_vectors:1", "", "write_current:1"):
        fake_ollama_env.configure(delay_seconds=0.0 if crash_at else 0.2)
        calls_before = fake_ollama_env.embed_calls
        proc = ingest_process(fake_ollama_env, corpus, store, crash_at=crash_at, small_batches=True)
        if not crash_at:
            wait_for(lambda before=calls_before, proc=proc: fake_ollama_env.embed_calls > before + 2 or proc.poll() is not None)
            time.sleep(0.05)
            proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == -signal.SIGKILL, (crash_at, err)
        assert_consistent(store, allowed, must_have)
        assert current_of(store)["index"]
    generation = current_of(store)["generation"]
    fake_ollama_env.configure(delay_seconds=0.0)
    final = ingest_run(corpus, store)
    assert final.code == 0, final.err
    # The interrupted run's changes were never published: this run must publish them.
    assert current_of(store)["generation"] == generation + 1
    assert snapshot(store) == clean_snapshot(corpus, tmp_path)
    assert not list(store.glob("*.tmp"))


@pytest.mark.heavy  # about 1 s of CPU in ingest runs: in --all, to keep the fast tier's budget
def test_lost_vectors_are_repaired_and_never_orphaned(tmp_path: Path, fake_ollama_env: FakeOllama) -> None:
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    assert ingest_run(corpus, store).code == 0
    index = current_of(store)["index"]
    client = chromadb.PersistentClient(path=str(store / index / rules.CHROMA_SUBDIR))
    active = client.get_collection("chunks_active")
    for path in ("reference/api.md", "reference/glossary.md"):
        active.delete(ids=active.get(where={"path": path})["ids"][:1])
    SharedSystemClient.clear_system_cache()
    (corpus / "reference/api.md").unlink()  # gone from the corpus: nothing of it may stay
    run = ingest_run(corpus, store)
    assert run.code == 0, run.err
    state = chroma_state(store)
    con = keyword_db(store)
    assert chunks_of(state, "reference/api.md") == {}
    assert con.execute("SELECT count(*) FROM chunks WHERE path = 'reference/api.md'").fetchone() == (0,)
    assert chunks_of(state, "reference/glossary.md")  # still in the corpus: embedded again
    assert snapshot(store) == clean_snapshot(corpus, tmp_path)


@pytest.mark.heavy  # about 1 s of CPU in ingest runs: in --all, to keep the fast tier's budget
def test_wrong_dimensions_mid_run_keep_old_chunks(tmp_path: Path, fake_ollama_env: FakeOllama) -> None:
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    assert ingest_run(corpus, store).code == 0
    before = chroma_state(store)
    glossary = corpus / "reference/glossary.md"
    edit(glossary, glossary.read_text(encoding="utf-8") + "\n**Zebra**: a new term.\n")
    fake_ollama_env.configure(wrong_dims=384)
    run = ingest_run(corpus, store)
    # Nothing could be embedded: exit 2, the file left for the next run (which will rebuild).
    assert run.code == 2 and "Traceback" not in run.err
    assert "384-dimensional" in run.err and "left for the next run: reference/glossary.md" in run.err
    assert chunks_of(chroma_state(store), "reference/glossary.md") == chunks_of(before, "reference/glossary.md")
    fake_ollama_env.configure(wrong_dims=None)
    assert ingest_run(corpus, store).code == 0
    assert snapshot(store) == clean_snapshot(corpus, tmp_path)


def test_only_unwritten_files_are_reported_when_the_embedder_dies(
        tmp_path: Path, fake_ollama_env: FakeOllama, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ingest, "COMMIT_BATCH_CHUNKS", 1)  # one file per commit group
    monkeypatch.setattr(ingest, "START_CHUNKS", 1)
    corpus, store = tmp_path / "corpus", tmp_path / "store"
    edit(corpus / "b.md", "tiny\n")
    edit(corpus / "c.md", "plain here\n")
    assert ingest_run(corpus, store).code == 0
    edit(corpus / "a.md", "---\ntitle: " + " ".join(["enormous"] * 30) + "\n---\nx y z\n")  # cannot fit: fails alone
    edit(corpus / "b.md", "tiny too\n")
    edit(corpus / "c.md", "FAILPOINT here\n")
    edit(corpus / "d.md", "FAILPOINT new\n")  # new: indexed for keyword search until it can be embedded
    fake_ollama_env.configure(max_input_tokens=12)
    original = rules.OllamaEmbedder.begin_embed

    def dying_call(self: rules.OllamaEmbedder, texts: list[str], then: Any = None, failed: Any = None) -> Any:
        """begin_embed, failing on the call's thread as a server that went away does."""
        if not any("FAILPOINT" in t for t in texts):
            return original(self, texts, then, failed)

        def fail() -> None:
            error = rules.RagError(rules.ErrorCode.EMBEDDER_UNAVAILABLE, "Ollama went away", "start it")
            if failed is not None:
                failed(error)
            raise error

        call = rules.on_call_thread(fail)
        return lambda: call.result(self.timeout_s)

    monkeypatch.setattr(rules.OllamaEmbedder, "begin_embed", dying_call)
    run = ingest_run(corpus, store)
    assert run.code == 1
    assert (run.summary["failed"], run.summary["left_for_next_run"]) == (1, 1)
    assert any(e.startswith("a.md:") and "cannot be split" in e for e in run.summary["errors"])
    assert any("Ollama went away" in e and "1 file(s) left for the next run: c.md (" in e for e in run.summary["errors"])
    assert not any("b.md" in e for e in run.summary["errors"])
    assert (run.summary["chunks_without_vectors"], run.summary["vectors_pending"]) == (1, 1)
    assert any(e.startswith("1 chunks without vectors") for e in run.summary["errors"])
    db = keyword_db(store)
    assert dict(db.execute("SELECT path, chunk_count FROM documents")) == {"b.md": 1, "c.md": 1, "d.md": 1}
    assert dict(db.execute("SELECT path, chunks FROM vectors_pending")) == {"d.md": 1}
    assert "plain" in db.execute("SELECT text FROM chunks WHERE path = 'c.md'").fetchone()[0]  # its old chunk stays


def test_per_file_errors_keep_that_files_chunks(tmp_path: Path, fake_ollama_env: FakeOllama) -> None:
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    assert ingest_run(corpus, store).code == 0
    before = chroma_state(store)
    broken = {
        "reference/api.md": ("---\ntitle: [oops\n---\n", "malformed YAML frontmatter"),
        "reference/glossary.md": ("---\nlifecycle: archived\n---\n", "lifecycle must be one of"),
        "runbooks/deploy.md": ("---\nrag_chunk: paragraphs\n---\n", "rag_chunk must be one of"),
    }
    for rel, (prefix, _) in broken.items():
        edit(corpus / rel, prefix + (corpus / rel).read_text(encoding="utf-8"))
    ja = corpus / "ja/log-collection.md"
    edit(ja, ja.read_bytes() + b"\n\xff\xfe broken bytes\n")
    edit(corpus / "notes/binary.md", b"# looks like markdown\n\x00\x01\x02")
    escalation = corpus / "oncall/escalation.md"
    edit(escalation, escalation.read_text(encoding="utf-8") + "\nAddendum: page XYZZY first.\n")
    run = ingest_run(corpus, store)
    assert run.code == 1
    s = run.summary
    assert (s["failed"], s["updated"], s["added"], s["removed"], s["unchanged"]) == (5, 1, 0, 0, 1)
    for rel, (_, reason) in broken.items():
        assert f"ERROR: {rel}: {reason}" in run.err
    assert "ERROR: ja/log-collection.md: not UTF-8" in run.err
    assert "ERROR: notes/binary.md: binary file" in run.err
    after = chroma_state(store)
    for rel in [*broken, "ja/log-collection.md"]:
        assert chunks_of(after, rel) == chunks_of(before, rel), rel
    assert chunks_of(after, "notes/binary.md") == {}
    assert any("XYZZY" in d for d, _, _ in chunks_of(after, "oncall/escalation.md").values())
    # Still broken on the next run: reported again, nothing embedded, nothing lost.
    fake_ollama_env.reset()
    again = ingest_run(corpus, store)
    assert again.code == 1 and again.summary["failed"] == 5 and chunk_calls(fake_ollama_env) == 0
    assert chroma_state(store) == after


def test_over_long_chunk_is_split_and_retried_never_truncated(tmp_path: Path, fake_ollama_env: FakeOllama) -> None:
    corpus, store = tmp_path / "corpus", tmp_path / "store"
    words = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima".split()
    prose = [" ".join(words[(i * 7 + j) % 12] + str(i) for j in range(18)) for i in range(6)]
    edit(corpus / "long.md", "# Long page\n\n## Section\n\n" + "\n".join(prose[:3]) + "\n\n" + "\n".join(prose[3:])
         + "\n\n" + " ".join(prose) + "\n\n```\n" + "\n".join(f"# step {i}: run tool --flag {i}" for i in range(12))
         + "\n```\n")
    edit(corpus / "ja.md", "# ログ\n\n" + (SAMPLE / "ja/log-collection.md").read_text(encoding="utf-8").split("## 設定")[0])
    limit = 40
    fake_ollama_env.configure(max_input_tokens=limit)
    run = ingest_run(corpus, store)
    assert run.code == 0, run.err
    requests = embed_requests(fake_ollama_env)
    assert requests and all(body["truncate"] is False for body in requests)
    state = chroma_state(store)
    for rel in ("long.md", "ja.md"):
        doc = rules.parse_document((corpus / rel).read_bytes(), rel)
        chunks = sorted(chunks_of(state, rel).values(), key=lambda v: v[1]["chunk_index"])
        assert len(chunks) > len(rules.chunk_document(doc, 512, 64))  # some were split
        for document, meta, vector in chunks:
            sent = rules.embedded_document_text(GEMMA, doc.title, meta["heading"], document)
            assert count_tokens(sent) <= limit
            assert sent in fake_ollama_env.embedded_inputs
            assert all(abs(a - b) < 1e-6 for a, b in zip(vector, fake_embedding(sent, 768), strict=True))
            assert document in "\n".join(doc.lines[meta["start_line"] - 1:meta["end_line"]])
        body = "\n".join(doc.lines[doc.body_start - 1:])
        assert "".join("".join(d.split()) for d, _, _ in chunks) == "".join(body.split())
        assert [m["chunk_index"] for _, m, _ in chunks] == list(range(len(chunks)))
        for (_, a, _), (_, b, _) in pairwise(chunks):
            assert b["start_line"] in (a["end_line"], a["end_line"] + 1)


# ---------------------------------------------------------------------------
# Guards: nothing done, exit 2.


@pytest.mark.heavy  # about 1 s of CPU in ingest runs: in --all, to keep the fast tier's budget
def test_empty_corpus_guard_and_allow_empty(tmp_path: Path, fake_ollama_env: FakeOllama) -> None:
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    assert ingest_run(corpus, store).code == 0
    before = snapshot(store)
    generation = current_of(store)["generation"]
    for path in list(corpus.rglob("*.md")):
        path.unlink()
    (corpus / "notes.txt").write_text("not markdown\n")
    run = ingest_run(corpus, store)
    assert run.code == 2
    # The error, and what the run did before it stopped (here: nothing).
    assert run.summary == {"exit": 2, "error": {"code": "corpus_empty", "message": run.summary["error"]["message"],
                                                "hint": run.summary["error"]["hint"]},
                           **{key: run.summary[key] for key in SUMMARY_KEYS - {"exit"}}}
    assert (run.summary["scanned"], run.summary["chunks_written"], run.summary["removed"]) == (0, 0, 0)
    assert "refusing to delete" in run.err and "--allow-empty" in run.err
    assert snapshot(store) == before and current_of(store)["generation"] == generation
    emptied = ingest_run(corpus, store, "--allow-empty")
    assert emptied.code == 0, emptied.err
    assert emptied.summary["removed"] == 6
    assert all(col == {} for col in chroma_state(store).values())
    assert keyword_db(store).execute("SELECT count(*) FROM documents").fetchone() == (0,)
    assert current_of(store)["generation"] == generation + 1
    assert current_of(store)["stamp"]["files"] == 0


def test_missing_corpus_is_refused(tmp_path: Path, fake_ollama_env: FakeOllama) -> None:
    run = ingest_run(tmp_path / "nowhere", tmp_path / "store")
    assert run.code == 2 and run.summary["error"]["code"] == "corpus_missing"
    assert "does not exist" in run.err
    assert not (tmp_path / "store").exists()


@pytest.mark.heavy  # about 1 s of CPU in ingest runs: in --all, to keep the fast tier's budget
def test_without_ollama_only_files_with_no_vectors_are_indexed_and_only_for_keywords(
        tmp_path: Path, fake_ollama_env: FakeOllama) -> None:
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    assert ingest_run(corpus, store).code == 0
    listing = file_listing(store)
    edit(corpus / "reference/glossary.md", "changed\n")
    fake_ollama_env.stop()
    run = ingest_run(corpus, store)  # only a changed file: it keeps its chunks, nothing is touched
    assert run.code == 2 and run.summary["error"]["code"] == "embedder_unavailable"
    assert "cannot reach Ollama" in run.err and "start Ollama" in run.err and "ollama pull embeddinggemma" in run.err
    assert file_listing(store) == listing
    before = chroma_state(store)
    edit(corpus / "guide/new-page.md", "# New page\n\nKEYWORDFIRST-42 is documented here.\n")
    run = ingest_run(corpus, store)  # a new file besides: it is indexed for keyword search
    assert run.code == 1, run.err
    assert (run.summary["added"], run.summary["left_for_next_run"], run.summary["vectors_pending"]) == (1, 1, 1)
    assert "left for the next run: reference/glossary.md" in run.err
    assert "1 chunks without vectors (found by keyword search only): start Ollama" in run.err
    assert chroma_state(store) == before  # no vector written, none removed
    current = current_of(store)
    assert current["stamp"]["vectors_pending"] == 1 and current["generation"] == 2
    assert "changed" not in keyword_db(store).execute(
        "SELECT group_concat(text) FROM chunks WHERE path = 'reference/glossary.md'").fetchone()[0]
    fake_ollama_env.restart()
    fake_ollama_env.reset()
    run = ingest_run(corpus, store)
    assert run.code == 0, run.err
    assert (run.summary["added"], run.summary["updated"], run.summary["vectors_pending"]) == (1, 1, 0)
    assert current_of(store)["stamp"]["vectors_pending"] == 0
    assert snapshot(store) == clean_snapshot(corpus, tmp_path)


@pytest.mark.heavy  # about 1 s of CPU in ingest runs: in --all, to keep the fast tier's budget
def test_a_first_ingest_without_ollama_publishes_keywords_and_the_next_run_embeds_them(
        tmp_path: Path, fake_ollama_env: FakeOllama) -> None:
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    fake_ollama_env.stop()
    run = ingest_run(corpus, store)
    assert run.code == 1, run.err
    chunks = run.summary["chunks_without_vectors"]
    assert chunks > 0 and run.summary["vectors_pending"] == chunks and run.summary["chunks_written"] == 0
    assert f"{chunks} chunks without vectors" in run.err and "ollama pull embeddinggemma" in run.err
    current = current_of(store)
    assert current["manifest"]["dims"] == 0  # unknown until Ollama answers
    assert current["stamp"]["vectors_pending"] == chunks
    assert sum(n for (n,) in keyword_db(store).execute("SELECT chunks FROM vectors_pending")) == chunks
    again = ingest_run(corpus, store)  # still no Ollama: nothing to do, said as such
    assert again.code == 2 and again.summary["error"]["code"] == "embedder_unavailable"
    fake_ollama_env.restart()
    fake_ollama_env.reset()
    done = ingest_run(corpus, store)
    assert done.code == 0, done.err
    assert done.summary["rebuilt"] and done.summary["vectors_pending"] == 0
    assert done.summary["chunks_embedded"] == done.summary["chunks_written"] == sample_chunk_count()
    assert current_of(store)["manifest"]["dims"] == 768
    assert snapshot(store) == clean_snapshot(corpus, tmp_path)


def test_missing_model_names_ollama_pull(tmp_path: Path, fake_ollama_env: FakeOllama,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAG_EMBED_MODEL", "nomic-embed-text")
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    run = ingest_run(corpus, store)
    assert run.code == 1 and run.summary["vectors_pending"] > 0
    assert "ollama pull nomic-embed-text" in run.err
    again = ingest_run(corpus, store)
    assert again.code == 2 and again.summary["error"]["code"] == "model_not_found"
    assert "ollama pull nomic-embed-text" in again.err


@pytest.mark.process
def test_second_concurrent_ingest_fails_fast_on_the_lock(tmp_path: Path, fake_ollama_env: FakeOllama) -> None:
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    fake_ollama_env.configure(delay_seconds=30)
    holder = ingest_process(fake_ollama_env, corpus, store)
    try:
        wait_for(lambda: fake_ollama_env.embed_calls > 0 or holder.poll() is not None)
        assert holder.poll() is None
        run = ingest_run(corpus, store)
        assert run.code == 2 and run.summary["error"]["code"] == "lock_held"
        assert f"another ingest (pid {holder.pid}) is writing {store}" in run.err
        assert "wait for it to finish" in run.err
    finally:
        holder.kill()
        holder.communicate(timeout=30)
    fake_ollama_env.configure(delay_seconds=0)
    # The lock dies with its holder: no stale lock after a kill -9.
    after = ingest_run(corpus, store)
    assert after.code == 0, after.err


# ---------------------------------------------------------------------------
# Model change: rebuild into a new index, the old one live until then.


def _query_top_path(store: Path, index: str, question: str) -> str:
    client = chromadb.PersistentClient(path=str(store / index / rules.CHROMA_SUBDIR))
    try:
        result = client.get_collection("chunks_active").query(
            query_embeddings=[fake_embedding(GEMMA.query_text(question), 768)], n_results=3)
        return result["metadatas"][0][0]["path"]
    finally:
        SharedSystemClient.clear_system_cache()


@pytest.mark.heavy  # about 1 s of CPU in ingest runs: in --all, to keep the fast tier's budget
def test_model_change_rebuilds_without_a_gap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ingest, "EMBED_BATCH", 4)
    monkeypatch.setattr(ingest, "COMMIT_BATCH_CHUNKS", 4)
    with FakeOllama(models=("embeddinggemma", "nomic-embed-text")) as fake:
        monkeypatch.setenv("OLLAMA_HOST", fake.host)
        corpus, store = copy_sample(tmp_path), tmp_path / "store"
        assert ingest_run(corpus, store).code == 0
        old_current = current_of(store)
        old_index = old_current["index"]
        old_snapshot = snapshot(store)
        assert _query_top_path(store, old_index, "Who gets paged for a sev-1?") == "oncall/escalation.md"

        monkeypatch.setenv("RAG_EMBED_MODEL", "nomic-embed-text")
        fake.configure(fail_after=fake.embed_calls + 4)
        failed = ingest_run(corpus, store)
        assert failed.code == 1
        new_index = failed.summary["index"]
        assert failed.summary["rebuilt"] and new_index != old_index
        assert f"{old_index} stays live" in failed.err
        # The old index is still the live one, complete and answering.
        assert current_of(store) == old_current
        assert snapshot(store) == old_snapshot
        assert _query_top_path(store, old_index, "Who gets paged for a sev-1?") == "oncall/escalation.md"
        partial = keyword_db(store, new_index).execute("SELECT count(*) FROM documents").fetchone()[0]
        assert 0 < partial < 6

        fake.configure(fail_after=None)
        fake.embedded_inputs.clear()
        done = ingest_run(corpus, store)
        assert done.code == 0, done.err
        assert done.summary["rebuilt"] and done.summary["index"] == new_index
        current = current_of(store)
        assert current["index"] == new_index and current["generation"] == old_current["generation"] + 1
        assert (current["manifest"]["model"], current["manifest"]["prefix_scheme"]) == ("nomic-embed-text", "nomic-embed-text")
        assert not (store / old_index).exists()
        # The new model's prefixes: documents, and the calibration's headings as queries.
        assert any(t.startswith("search_document: ") for t in fake.embedded_inputs)
        assert all(t.startswith(("search_document: ", "search_query: ")) for t in fake.embedded_inputs
                   if t != rules.FINGERPRINT_TEXT)
        assert snapshot(store) == clean_snapshot(corpus, tmp_path)
        # Back to the first model: a rebuild again, into the first index name.
        monkeypatch.delenv("RAG_EMBED_MODEL")
        back = ingest_run(corpus, store)
        assert back.code == 0 and back.summary["index"] == old_index and not (store / new_index).exists()
        assert snapshot(store) == old_snapshot


@pytest.mark.heavy  # about 1 s of CPU in ingest runs: in --all, to keep the fast tier's budget
def test_dimension_change_rebuilds(tmp_path: Path, fake_ollama_env: FakeOllama) -> None:
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    assert ingest_run(corpus, store).code == 0
    old_index = current_of(store)["index"]
    fake_ollama_env.configure(dims=384)
    run = ingest_run(corpus, store)
    assert run.code == 0 and run.summary["rebuilt"]
    assert current_of(store)["manifest"]["dims"] == 384 and not (store / old_index).exists()
    assert {len(v) for col in chroma_state(store).values() for _, _, v in col.values()} == {384}


def test_unknown_model_gets_no_prefix_and_a_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with FakeOllama(models=("mystery-embed",)) as fake:
        monkeypatch.setenv("OLLAMA_HOST", fake.host)
        monkeypatch.setenv("RAG_EMBED_MODEL", "mystery-embed")
        run = ingest_run(copy_sample(tmp_path), tmp_path / "store")
        assert run.code == 0, run.err
        assert "WARNING: unknown embedding model 'mystery-embed'" in run.err
        assert current_of(tmp_path / "store")["manifest"]["prefix_scheme"] == "none"
        assert not any(t.startswith(("title:", "search_document:", "passage:")) for t in fake.embedded_inputs)


# ---------------------------------------------------------------------------
# Names and links.


def test_nfd_file_names_are_stored_nfc(tmp_path: Path, fake_ollama_env: FakeOllama) -> None:
    corpus, store = tmp_path / "corpus", tmp_path / "store"
    nfd_names = {"cafe\u0301.md": "caf\u00e9.md", "\u304b\u3099\u3044\u3068\u3099.md": "\u304c\u3044\u3069.md"}
    for name in nfd_names:
        edit(corpus / "docs" / name, "Some words without a heading.\n")
    assert {p.name for p in (corpus / "docs").iterdir()} == set(nfd_names)  # the file system kept NFD
    run = ingest_run(corpus, store)
    assert run.code == 0, run.err
    con = keyword_db(store)
    rows = {p: (d, t) for p, d, t in con.execute("SELECT path, disk_path, title FROM documents")}
    assert rows == {f"docs/{nfc}": (f"docs/{nfd}", nfc[:-3]) for nfd, nfc in nfd_names.items()}
    assert {m["path"] for col in chroma_state(store).values() for _, m, _ in col.values()} == set(rows)
    assert ingest_run(corpus, store).summary["embedding_calls"] == 0
    # An NFC twin of an NFD name is one path twice: reported, not silently merged.
    edit(corpus / "docs" / "caf\u00e9.md", "twin\n")
    twin = ingest_run(corpus, store)
    assert twin.code == 1 and "same name after Unicode NFC normalisation" in twin.err


@pytest.mark.process
def test_symlinks_outside_the_corpus_are_skipped(tmp_path: Path, fake_ollama_env: FakeOllama) -> None:
    outside, corpus, store = tmp_path / "outside", tmp_path / "corpus", tmp_path / "store"
    edit(outside / "secret.md", "OUTSIDE-SECRET-4242\n")
    edit(outside / "dir" / "inner.md", "OUTSIDE-DIR-5353\n")
    edit(corpus / "real.md", "# Real\n\ninside words\n")
    (corpus / "sub").mkdir()
    (corpus / "link-out.md").symlink_to(outside / "secret.md")
    (corpus / "linked-dir").symlink_to(outside / "dir", target_is_directory=True)
    (corpus / "relative-out.md").symlink_to(Path("..") / "outside" / "secret.md")
    (corpus / "loop").symlink_to(".", target_is_directory=True)
    (corpus / "sub" / "up").symlink_to("..", target_is_directory=True)
    (corpus / "self.md").symlink_to("self.md")
    (corpus / "dangling.md").symlink_to("nowhere.md")
    (corpus / "inside-link.md").symlink_to("real.md")
    (corpus / ".hidden").mkdir()
    edit(corpus / ".hidden" / "skipped.md", "HIDDEN-FOLDER-6161\n")
    proc = ingest_process(fake_ollama_env, corpus, store, "--json")
    out, err = proc.communicate(timeout=60)  # a symlink loop must not hang the walk
    assert proc.returncode == 0, err
    for name in ("link-out.md", "linked-dir", "relative-out.md"):
        assert f"skipped symlink {corpus / name}: it resolves outside the corpus" in err
    assert "symlink cycle" in err
    data = store_bytes(store)
    for token in (b"OUTSIDE-SECRET-4242", b"OUTSIDE-DIR-5353", b"HIDDEN-FOLDER-6161"):
        assert token not in data
    paths = {p for (p,) in keyword_db(store).execute("SELECT path FROM documents")}
    assert paths == {"real.md", "inside-link.md"}
    assert json.loads(out)["added"] == 2


# ---------------------------------------------------------------------------
# Output, dry run, stamp, generation.


@pytest.mark.process
def test_json_is_the_only_stdout_and_progress_goes_to_stderr(tmp_path: Path, fake_ollama_env: FakeOllama) -> None:
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    proc = ingest_process(fake_ollama_env, corpus, store, "--json")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    summary = json.loads(out)
    assert set(summary) == SUMMARY_KEYS and summary["exit"] == 0
    assert isinstance(summary["seconds"], float) and summary["commit"] is None and summary["dirty"] is None
    assert f"ingest: INFO: resolved configuration: corpus={corpus} store={store} ollama={fake_ollama_env.host} " \
           "model=embeddinggemma" in err
    # A run shorter than a progress interval prints no progress line, only its summary.
    assert "files," not in err
    assert "ingest: 7 scanned, 6 added, 0 updated, 0 unchanged, 0 removed, 1 excluded, 0 ignored, 0 failed; " \
           f"{summary['chunks_written']} chunks written ({summary['chunks_embedded']} embedded, 0 reused), " \
           f"{summary['embedding_calls']} embedding calls" in err
    plain = subprocess.run([sys.executable, str(ROOT / "ingest.py"), "--corpus", str(corpus), "--store", str(store)],
                           env=child_env(fake_ollama_env), capture_output=True, text=True, timeout=60)
    assert plain.returncode == 0 and plain.stdout == ""


def test_dry_run_writes_nothing_and_embeds_nothing(tmp_path: Path, fake_ollama_env: FakeOllama) -> None:
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    dry = ingest_run(corpus, store, "--dry-run")
    assert dry.code == 0, dry.err
    assert not store.exists()
    # it asks the model its context length (chunks are cut to it) and embeds nothing
    assert [path for _, path, _ in fake_ollama_env.requests] == ["/api/show"]
    s = dry.summary
    assert (s["dry_run"], s["added"], s["excluded"], s["chunks_written"], s["embedding_calls"]) == (True, 6, 1, 0, 0)
    assert "dry run: 7 scanned, would add 6" in dry.err
    real = ingest_run(corpus, store)
    assert s["estimated_chunks"] == real.summary["chunks_written"]
    edit(corpus / "reference/glossary.md", "# Glossary\n\nRewritten.\n")
    (corpus / "oncall/escalation.md").unlink()
    edit(corpus / "new.md", "new page\n")
    # SQLite's shared-memory index (-shm) is not data: a reader of a WAL database may touch it.
    listing = {k: v for k, v in file_listing(store).items() if not k.endswith("-shm")}
    fake_ollama_env.reset()
    again = ingest_run(corpus, store, "--dry-run")
    assert (again.summary["added"], again.summary["updated"], again.summary["removed"]) == (1, 1, 1)
    assert again.summary["estimated_chunks"] == 2
    assert {k: v for k, v in file_listing(store).items() if not k.endswith("-shm")} == listing
    assert [path for _, path, _ in fake_ollama_env.requests] == ["/api/show"]


def test_files_a_changed_reader_read_are_read_again_keeping_the_vectors_of_unchanged_passages(
        tmp_path: Path, fake_ollama_env: FakeOllama) -> None:
    """An index made by an older reader (or before readers were recorded) catches up on its next
    run, without --full: those files are read again, and only passages whose text changed are
    embedded again."""
    corpus, store = tmp_path / "corpus", tmp_path / "store"
    corpus.mkdir()
    edit(corpus / "guide.md", "# Guide\n\n::: tip Caching\nKeep builds warm.\n:::\n\n## Other\n\n"
                              + "Plain words that no reader changes. " * 40 + "\n")
    edit(corpus / "notes.rst", "Notes\n=====\n\nSee :pep:`8`.\n")
    assert ingest_run(corpus, store).code == 0
    stamps = {"guide.md": rules.reader_for("guide.md").stamp, "notes.rst": rules.reader_for("notes.rst").stamp}
    recorded = "SELECT path, chunk_index, searchable, embed_key FROM chunks ORDER BY path, chunk_index"
    db = sqlite3.connect(store / current_of(store)["index"] / rules.KEYWORD_DB)
    try:
        assert dict(db.execute("SELECT path, read_with FROM documents")) == stamps
        fresh = db.execute(recorded).fetchall()
        # as an older reader left them (recorded as one, or not recorded), one passage embedded otherwise
        with db:
            db.execute("UPDATE documents SET read_with = 'markdown:1' WHERE path = 'guide.md'")
            db.execute("UPDATE documents SET read_with = NULL WHERE path = 'notes.rst'")
            db.execute("UPDATE chunks SET embed_key = 'older-' || embed_key WHERE path = 'guide.md' AND chunk_index = 0")
    finally:
        db.close()
    fake_ollama_env.reset()
    dry = ingest_run(corpus, store, "--dry-run")
    assert dry.code == 0 and (dry.summary["updated"], dry.summary["unchanged"]) == (2, 0), dry.err
    reasons = {entry["path"]: entry["reason"] for entry in dry.summary["listing"]}
    assert reasons["guide.md"].startswith("read again by a newer markdown reader")
    assert reasons["notes.rst"].startswith("read again by a newer rst reader")
    again = ingest_run(corpus, store)
    assert again.code == 0 and again.summary["updated"] == 2, again.err
    # only the passage whose embedded text the older reader made differently is embedded
    assert len(chunk_inputs(fake_ollama_env)) == 1
    db = keyword_db(store)
    try:
        assert dict(db.execute("SELECT path, read_with FROM documents")) == stamps
        assert db.execute(recorded).fetchall() == fresh
    finally:
        db.close()
    fake_ollama_env.reset()
    assert ingest_run(corpus, store).summary["unchanged"] == 2 and chunk_inputs(fake_ollama_env) == []


def test_dry_run_foresees_a_model_change_rebuild(tmp_path: Path, fake_ollama_env: FakeOllama,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    assert ingest_run(corpus, store).code == 0
    index = current_of(store)["index"]
    same = ingest_run(corpus, store, "--dry-run").summary
    assert (same["rebuilt"], same["index"], same["added"], same["unchanged"]) == (False, index, 0, 6)
    monkeypatch.setenv("RAG_EMBED_MODEL", "nomic-embed-text")
    fake_ollama_env.reset()
    run = ingest_run(corpus, store, "--dry-run")
    assert run.code == 0 and [path for _, path, _ in fake_ollama_env.requests] == ["/api/show"]
    s = run.summary
    assert (s["rebuilt"], s["added"], s["unchanged"]) == (True, 6, 0)
    assert s["index"] != index and s["estimated_chunks"] > 0
    assert "would rebuild the index" in run.err


def test_chunk_budget_comes_from_the_models_context_length(tmp_path: Path, fake_ollama_env: FakeOllama) -> None:
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    fake_ollama_env.configure(context_length=160)
    run = ingest_run(corpus, store)
    assert run.code == 0, run.err
    assert [p for _, p, _ in fake_ollama_env.requests if p == "/api/show"] == ["/api/show"]  # read once
    state = chroma_state(store)
    titles = dict(keyword_db(store).execute("SELECT path, title FROM documents"))
    for col in state.values():
        for document, meta, _ in col.values():
            sent = rules.embedded_document_text(GEMMA, titles[meta["path"]], meta["heading"], document)
            assert rules.estimate_tokens(sent) <= 160
    assert run.summary["chunks_written"] > 2 * sample_chunk_count()


def _git(repo: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(repo), "-c", "user.name=Test", "-c", "user.email=test@example.invalid",
                           "-c", "commit.gpgsign=false", *args], capture_output=True, text=True, check=True)
    return done.stdout.strip()


@pytest.mark.heavy  # about 1 s of CPU in ingest runs: in --all, to keep the fast tier's budget
def test_corpus_git_stamp_and_generation(tmp_path: Path, fake_ollama_env: FakeOllama) -> None:
    repo = tmp_path / "repo"
    corpus = copy_sample(repo, "docs")
    store = tmp_path / "store"
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "corpus")
    sha = _git(repo, "rev-parse", "HEAD")
    run = ingest_run(corpus, store)
    assert (run.summary["commit"], run.summary["dirty"]) == (sha, False)
    current = current_of(store)
    assert (current["stamp"]["commit"], current["stamp"]["dirty"], current["generation"]) == (sha, False, 1)
    client = chromadb.PersistentClient(path=str(store / current["index"] / rules.CHROMA_SUBDIR))
    assert client.get_collection("chunks_active").metadata["stamp_commit"] == sha
    SharedSystemClient.clear_system_cache()
    # Changes outside the corpus folder do not make the corpus dirty.
    (repo / "README.md").write_text("outside the corpus\n")
    assert ingest_run(corpus, store).summary["dirty"] is False
    assert current_of(store)["generation"] == 1
    # An edited file: re-embedded, dirty, generation bumped.
    edit(corpus / "reference/glossary.md", "# Glossary\n\nEdited.\n")
    run = ingest_run(corpus, store)
    assert (run.summary["commit"], run.summary["dirty"], run.summary["updated"]) == (sha, True, 1)
    assert (current_of(store)["stamp"]["dirty"], current_of(store)["generation"]) == (True, 2)
    # Committed: a new commit, clean again, nothing re-embedded but the stamp moves.
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "edit")
    sha2 = _git(repo, "rev-parse", "HEAD")
    run = ingest_run(corpus, store)
    assert (run.summary["commit"], run.summary["dirty"], run.summary["embedding_calls"]) == (sha2, False, 0)
    assert (current_of(store)["stamp"]["commit"], current_of(store)["stamp"]["dirty"]) == (sha2, False)
    generation = current_of(store)["generation"]
    assert generation == 3
    # A stray non-Markdown file dirties the corpus: the stamp says so even though no chunk changed.
    (corpus / "scratch.txt").write_text("notes\n")
    run = ingest_run(corpus, store)
    assert (run.summary["dirty"], run.summary["embedding_calls"]) == (True, 0)
    assert current_of(store)["stamp"]["dirty"] is True
    assert current_of(store)["generation"] == generation + 1
    # A no-op run after that changes nothing.
    ingest_run(corpus, store)
    assert current_of(store)["generation"] == generation + 1


# ---------------------------------------------------------------------------
# One store, one corpus; Ollama only when something needs embedding; progress that keeps talking.


@pytest.mark.heavy  # about 1 s of CPU in ingest runs: in --all, to keep the fast tier's budget
def test_indexing_another_folder_into_a_store_is_refused(tmp_path: Path, fake_ollama_env: FakeOllama) -> None:
    first, store = copy_sample(tmp_path, "first"), tmp_path / "store"
    assert ingest_run(first, store).code == 0
    listing = file_listing(store)
    second = tmp_path / "second"
    second.mkdir()
    (second / "other.md").write_text("# Other\n\nA different corpus.\n", encoding="utf-8")
    fake_ollama_env.reset()
    run = ingest_run(second, store)
    assert run.code == 2 and run.summary["error"]["code"] == "corpus_mismatch"
    message = run.summary["error"]["message"] + " " + run.summary["error"]["hint"]
    assert str(first) in message and str(second) in message
    assert "--store" in message and "RAG_STORE_DIR" in message and "--replace-corpus" in message
    assert file_listing(store) == listing
    assert fake_ollama_env.requests == []  # refused before Ollama is asked anything
    # The same folder through another spelling of its path is the same corpus.
    (tmp_path / "alias").symlink_to(first)
    assert ingest_run(tmp_path / "alias", store).code == 0
    # A second corpus gets its own store; the first store is untouched by it.
    assert ingest_run(second, tmp_path / "store2").code == 0
    assert current_of(store)["stamp"]["files"] == 6
    # An explicit switch replaces the index.
    switched = ingest_run(second, store, "--replace-corpus")
    assert switched.code == 0 and switched.summary["removed"] == 6 and switched.summary["added"] == 1
    assert current_of(store)["corpus_dir"] == str(second)


def test_a_moved_corpus_is_taken_over_without_re_embedding(tmp_path: Path, fake_ollama_env: FakeOllama) -> None:
    corpus, store = copy_sample(tmp_path, "docs"), tmp_path / "store"
    assert ingest_run(corpus, store).code == 0
    moved = tmp_path / "docs-moved"
    corpus.rename(moved)
    refused = ingest_run(moved, store)
    assert refused.code == 2 and refused.summary["error"]["code"] == "corpus_mismatch"
    fake_ollama_env.reset()
    run = ingest_run(moved, store, "--replace-corpus")
    assert run.code == 0, run.err
    assert (run.summary["unchanged"], run.summary["removed"], run.summary["embedding_calls"]) == (6, 0, 0)
    assert current_of(store)["corpus_dir"] == str(moved)
    real_paths = dict(keyword_db(store).execute("SELECT path, real_path FROM documents"))
    assert real_paths and all(p.startswith(str(moved) + os.sep) for p in real_paths.values())
    assert ingest_run(moved, store).code == 0  # and from now on it is simply this store's corpus


def test_nothing_to_embed_needs_no_ollama(tmp_path: Path, fake_ollama_env: FakeOllama) -> None:
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    assert ingest_run(corpus, store).code == 0
    generation = current_of(store)["generation"]
    fake_ollama_env.stop()
    noop = ingest_run(corpus, store)
    assert noop.code == 0, noop.err
    assert (noop.summary["unchanged"], noop.summary["embedding_calls"], noop.summary["failed"]) == (6, 0, 0)
    # Changes that need no embedding are applied too: a deletion and an mtime-only touch.
    (corpus / "oncall/escalation.md").unlink()
    os.utime(corpus / "reference/api.md", ns=(time.time_ns(), time.time_ns()))
    pruned = ingest_run(corpus, store)
    assert pruned.code == 0, pruned.err
    assert (pruned.summary["removed"], pruned.summary["unchanged"]) == (1, 5)
    assert current_of(store)["generation"] == generation + 1
    # Something to embed: Ollama is needed, and its absence is exit 2 with nothing lost.
    edit(corpus / "reference/glossary.md", "# Glossary\n\nRewritten while Ollama is down.\n")
    blocked = ingest_run(corpus, store)
    assert blocked.code == 2 and blocked.summary["error"]["code"] == "embedder_unavailable"
    assert current_of(store)["stamp"]["files"] == 5


@pytest.mark.heavy  # waits on 2 s embedding calls by design
def test_progress_keeps_talking_while_a_slow_call_runs(tmp_path: Path, fake_ollama_env: FakeOllama,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Not on a terminal, a progress line comes every PROGRESS_EVERY_S even while one embedding call
    takes much longer than that (it once printed nothing for 46 s)."""
    monkeypatch.setattr(ingest, "PROGRESS_EVERY_S", 0.3)
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    fake_ollama_env.configure(delay_seconds=2.0)
    run = ingest_run(corpus, store)
    assert run.code == 0, run.err
    lines = [line for line in run.err.splitlines() if line.startswith("ingest: 0/6 files")]
    assert len(lines) >= 3, run.err
    assert any("waiting" in line and "for the embedding server" in line for line in lines), lines
    assert "chunks/s" in lines[0] and "ETA" in lines[0]
    final = [line for line in run.err.splitlines() if line.startswith("ingest: 6/6 files")]
    assert final and f"{sample_chunk_count()}/{sample_chunk_count()} chunks embedded" in final[-1]


def rows_written_once(store: Path) -> bool:
    """Whether every chunk row of a store built from nothing was inserted once: rowids run 1..N
    with no gap, which a row deleted and written again would leave."""
    count, last = keyword_db(store).execute("SELECT count(*), max(rowid) FROM chunks").fetchone()
    return count == last


@pytest.mark.heavy  # about 1 s of CPU in ingest runs: in --all, to keep the fast tier's budget
def test_a_build_that_publishes_keywords_first_writes_each_row_once_and_ends_as_a_plain_build(
        tmp_path: Path, fake_ollama_env: FakeOllama, monkeypatch: pytest.MonkeyPatch) -> None:
    """The files indexed for keyword search first keep their rows when their vectors arrive (only
    their wait is cleared), in the same run or a later one; a file changed meanwhile is written anew."""
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    with monkeypatch.context() as patch:
        patch.setattr(ingest, "KEYWORDS_FIRST_AFTER_S", 0.0)  # after the first group, the rest first
        run = ingest_run(corpus, store)
    assert run.code == 0 and run.summary["chunks_without_vectors"] > 0, run.err
    assert run.summary["vectors_pending"] == 0 and rows_written_once(store)
    assert snapshot(store) == clean_snapshot(corpus, tmp_path)
    # Two files added while Ollama is away wait for their vectors; one is edited before it gets them.
    fake_ollama_env.stop()
    (corpus / "kept.md").write_text("# Kept\n\nIndexed for keyword search while Ollama was away.\n")
    (corpus / "edited.md").write_text("# Edited\n\nFirst words.\n")
    assert ingest_run(corpus, store).code == 1
    rows = "SELECT id, rowid FROM chunks WHERE path = ?"
    kept = keyword_db(store).execute(rows, ("kept.md",)).fetchall()
    edited = keyword_db(store).execute(rows, ("edited.md",)).fetchall()
    edit(corpus / "edited.md", "# Edited\n\nOther words, written before Ollama came back.\n")
    fake_ollama_env.restart()
    done = ingest_run(corpus, store)
    assert done.code == 0 and done.summary["vectors_pending"] == 0, done.err
    assert keyword_db(store).execute(rows, ("kept.md",)).fetchall() == kept  # only its wait cleared
    assert set(keyword_db(store).execute(rows, ("edited.md",)).fetchall()).isdisjoint(edited)
    assert snapshot(store) == clean_snapshot(corpus, tmp_path)


def test_progress_says_when_files_are_indexed_for_keyword_search_first() -> None:
    """The pass writes no vectors and waits for no call: its line says what it does and counts the
    files (it said "waiting N s for Ollama" for the minutes a million-chunk pass took), and the wait
    for Ollama is counted again from its end."""
    progress = ingest.ProgressLine(files=10, chunks=100)
    try:
        progress.call_started -= 60  # a call answered a minute ago
        with progress.keyword_pass(8) as done:
            done(3)
            assert progress.line() == ("ingest: indexing 8 files for keyword search first, their vectors after: "
                                       "3/8 files")
        assert "for the embedding server" not in progress.line() and "0/10 files" in progress.line()
    finally:
        progress.finish()


def fts_segments(store: Path) -> int:
    """How many FTS5 segments the live keyword index holds: the second varint of FTS5's structure
    record (row 10 of %_data), after its 4-byte cookie and, from SQLite 3.44, a 4-byte version mark."""
    db = keyword_db(store)
    try:
        record = bytes(db.execute("SELECT block FROM chunks_fts_data WHERE id = 10").fetchone()[0])
    finally:
        db.close()
    at = 8 if record[4:8] == b"\xff\x00\x00\x01" else 4
    values = []
    while len(values) < 2:  # SQLite varints: 7 bits a byte, big-endian, the high bit says more follow
        value = 0
        while True:
            byte, at = record[at], at + 1
            value = (value << 7) | (byte & 0x7F)
            if byte < 0x80:
                break
        values.append(value)
    return values[1]


@pytest.mark.heavy  # about 1 s of CPU in ingest runs: in --all, to keep the fast tier's budget
def test_the_keyword_index_is_one_segment_after_a_build_and_again_once_a_tenth_is_rewritten(
        tmp_path: Path, fake_ollama_env: FakeOllama, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ingest, "COMMIT_BATCH_CHUNKS", 1)  # one file per commit group: a segment each
    monkeypatch.setattr(ingest, "START_CHUNKS", 1)
    corpus, store = tmp_path / "corpus", tmp_path / "store"

    def write_note(n: int, where: str) -> None:
        edit(corpus / f"note-{n:02d}.md", f"# Note {n}\n\nThe relay{n} forwards queue item {n} to the {where}.\n")

    def matches(term: str) -> int:
        db = keyword_db(store)
        try:
            return int(db.execute("SELECT count(*) FROM chunks_fts WHERE chunks_fts MATCH ?", [term]).fetchone()[0])
        finally:
            db.close()

    for n in range(100):
        write_note(n, "archive")
    assert ingest_run(corpus, store).code == 0
    assert fts_segments(store) == 1
    # Three files rewritten (6 rows: deleted and inserted) of 100: under a tenth, the segments stay.
    for n in range(3):
        write_note(n, "vault")
    assert ingest_run(corpus, store).code == 0
    assert fts_segments(store) > 1
    # Two more: 10 rows since the rewrite, a tenth of 100: one segment again, the same matches.
    for n in range(3, 5):
        write_note(n, "vault")
    assert ingest_run(corpus, store).code == 0
    assert fts_segments(store) == 1
    assert (matches("queue"), matches("vault"), matches("archive"), matches("relay7")) == (100, 5, 95, 1)


def test_common_terms_stay_exact_through_edits_removals_and_lifecycle_flips(
        tmp_path: Path, fake_ollama_env: FakeOllama, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rules, "COMMON_TERM_PASSAGES", 3)
    corpus, store = tmp_path / "corpus", tmp_path / "store"
    for n in range(12):
        edit(corpus / f"doc-{n:02d}.md", f"# Relay {n % 3}\n\nThe relay forwards queue item {n} to the archive.\n")
    assert ingest_run(corpus, store).code == 0  # a build: compacted, common_terms counted from FTS5

    def counted() -> tuple[dict[str, int], dict[str, int]]:
        """common_terms, and FTS5's own count of each term in it."""
        db = keyword_db(store)
        try:
            db.execute("CREATE VIRTUAL TABLE temp.fts_rows USING fts5vocab(main, chunks_fts, 'row')")
            kept = dict(db.execute("SELECT term, passages FROM common_terms"))
            fts = dict(db.execute("SELECT term, doc FROM temp.fts_rows"))
            return kept, {term: fts.get(term, 0) for term in kept}
        finally:
            db.close()

    kept, fts = counted()
    assert kept == fts and {"relay", "queue", "archive", "1"} <= set(kept) and kept["relay"] == 12
    monkeypatch.setattr(ingest, "KEYWORD_OPTIMIZE_SHARE", 100.0)  # from here on, only the writes keep it exact
    edit(corpus / "doc-00.md", "# Vault\n\nThe vault keeps queue items.\n")  # relay and archive out, vault in
    (corpus / "doc-01.md").unlink()
    edit(corpus / "doc-02.md", "---\nlifecycle: superseded\n---\n# Relay 2\n\nThe relay forwards to the archive.\n")
    edit(corpus / "doc-12.md", "# Relay 0\n\nA new relay.\n")
    assert ingest_run(corpus, store).code == 0
    kept, fts = counted()
    assert kept == fts and kept["relay"] == 11 and kept["archive"] == 10 and "vault" not in kept


def test_a_misspelt_variable_is_said_by_ingest(fake_ollama_env: FakeOllama, tmp_path: Path) -> None:
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    done = ingest_in_process(fake_ollama_env, corpus, store, RAG_STORE=str(tmp_path / "meant"))
    assert done.code == 0, done.err
    assert "RAG_STORE is set but is no variable of local-rag-mcp (did you mean RAG_STORE_DIR?)" in done.err
