"""Scenario 7: a damaged, missing, foreign or locked store. Every tool answers with a structured
result or error, within a bound, the server stays up, and it never creates or repairs the store."""

from __future__ import annotations

import json
import re
import shutil
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
from fake_ollama import FakeOllama
from faultlib import index_dir, write_lock
from helpers import (
    RawServer,
    call,
    connect,
    copy_index,
    file_listing,
    raw_server,
    run_ingest,
    search_paths,
    server_env,
    stderr_text,
    tool,
)

import corpus_rules as rules

pytestmark = pytest.mark.process  # real processes (servers, ingest, Chroma): only in `pytest --all` (tests/README.md)

QUERY = "who gets paged for a sev-1"
ESCALATION = "oncall/escalation.md"


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeOllama]:
    with FakeOllama(models=("embeddinggemma", "nomic-embed-text")) as instance:
        yield instance


@dataclass
class Built:
    corpus: Path
    store: Path


@pytest.fixture(scope="module")
def built(indexed_sample: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Built:
    return Built(*copy_index(*indexed_sample, tmp_path_factory.mktemp("index-faults")))


def copy_store(built: Built, tmp_path: Path) -> Path:
    store = tmp_path / "store"
    shutil.copytree(built.store, store)
    return store


def store_files(store: Path) -> dict[str, tuple[int, bytes]]:
    """The store's files and bytes, without the -wal/-shm files any SQLite reader of a WAL
    database creates beside it."""
    return {name: value for name, value in file_listing(store).items() if not name.endswith(("-wal", "-shm"))}


def every_tool(server: Any) -> dict[str, tuple[bool, dict[str, Any]]]:
    """One call of each tool and search mode; each answer checked for its structured shape.
    Vector first: it waits for the vector index to load (or fail to), where a hybrid search
    right after the start answers from keywords while it loads (vector_index_loading)."""
    return {
        "vector": call(server, "search_corpus", {"query": QUERY, "mode": "vector"}),
        "hybrid": call(server, "search_corpus", {"query": QUERY}),
        "keyword": call(server, "search_corpus", {"query": QUERY, "mode": "keyword"}),
        "get_file": call(server, "get_file", {"path": ESCALATION, "end_line": 3}),
        "list_documents": call(server, "list_documents", {}),
    }


def codes(answers: dict[str, tuple[bool, dict[str, Any]]]) -> dict[str, str]:
    return {name: payload["error"]["code"] if is_error else "ok" for name, (is_error, payload) in answers.items()}


def test_missing_store_is_index_missing_and_never_created(built: Built, fake: FakeOllama, tmp_path: Path) -> None:
    store = tmp_path / "absent" / "store"
    with raw_server(store, built.corpus, fake.host) as server:
        answers = every_tool(server)
        assert set(codes(answers).values()) == {"index_missing"}
        for _, payload in answers.values():
            assert str(store) in payload["error"]["message"] and rules.INGEST_COMMAND in payload["error"]["hint"]
    assert not store.exists() and not store.parent.exists()


def test_store_built_with_another_model_is_index_incompatible(built: Built, fake: FakeOllama, tmp_path: Path) -> None:
    store = tmp_path / "store"
    done = run_ingest(fake, built.corpus, store, RAG_EMBED_MODEL="nomic-embed-text")
    assert done.code == 0, done.err

    async def scenario() -> None:
        # Through the SDK client: RawServer deliberately drops RAG_EMBED_MODEL from the environment.
        env = server_env(store, built.corpus, fake.host, RAG_EMBED_MODEL="embeddinggemma")
        async with connect(env) as client:
            for mode in ("hybrid", "vector"):
                is_error, payload = await tool(client, "search_corpus", query=QUERY, mode=mode)
                assert is_error and payload["error"]["code"] == "index_incompatible", payload
                assert "embeddinggemma" in payload["error"]["message"]
                assert "nomic-embed-text" in payload["error"]["message"]
            for name, args in (("search_corpus", {"query": QUERY, "mode": "keyword"}), ("list_documents", {}),
                               ("get_file", {"path": ESCALATION, "end_line": 2})):
                assert not (await tool(client, name, **args))[0], name

    anyio.run(scenario)
    # Without RAG_EMBED_MODEL the server follows the index's manifest.
    with raw_server(store, built.corpus, fake.host) as server:
        assert set(codes(every_tool(server)).values()) == {"ok"}


def test_unreadable_current_json_is_index_incompatible(built: Built, fake: FakeOllama, tmp_path: Path) -> None:
    store = copy_store(built, tmp_path)
    current = json.loads((store / "CURRENT.json").read_text(encoding="utf-8"))
    variants = {
        "garbage": "{ not json",
        "unknown prefix scheme": json.dumps({**current, "manifest": {**current["manifest"], "prefix_scheme": "x9"}}),
        "missing index folder": json.dumps({**current, "index": "idx-000000000000"}),
    }
    expected = {"garbage": "index_incompatible", "unknown prefix scheme": "index_incompatible",
                "missing index folder": "index_missing"}
    with raw_server(store, built.corpus, fake.host) as server:
        for name, text in variants.items():
            (store / "CURRENT.json").write_text(text, encoding="utf-8")
            assert set(codes(every_tool(server)).values()) == {expected[name]}, name
        (store / "CURRENT.json").write_text(json.dumps(current), encoding="utf-8")
        assert set(codes(every_tool(server)).values()) == {"ok"}


def test_a_current_json_nested_too_deeply_is_index_incompatible_at_start_and_in_ingest(
        built: Built, fake: FakeOllama, tmp_path: Path) -> None:
    store = copy_store(built, tmp_path)
    depth = 100_000  # 200 KB, within CURRENT_MAX_BYTES, far beyond the JSON parser's recursion
    (store / "CURRENT.json").write_text("[" * depth + "]" * depth, encoding="utf-8")
    server = RawServer(server_env(store, built.corpus, fake.host))
    try:
        init = server.request("initialize", {"protocolVersion": "2025-06-18", "capabilities": {},
                                             "clientInfo": {"name": "deep", "version": "0"}})
        assert "Not ready" in init["result"]["instructions"] and "nested too deeply" in init["result"]["instructions"]
        server.notify("notifications/initialized")
        assert set(codes(every_tool(server)).values()) == {"index_incompatible"}
    finally:
        assert server.close() == 0
    done = run_ingest(fake, built.corpus, store)
    assert done.code == 2 and done.summary["error"]["code"] == "index_incompatible", done.err[-2000:]
    assert "Traceback" not in done.err


@pytest.mark.parametrize("damage", ["garbage", "truncated to half"])
def test_the_command_a_damaged_keyword_index_names_repairs_it(built: Built, fake: FakeOllama, tmp_path: Path,
                                                              damage: str) -> None:
    store = copy_store(built, tmp_path)
    db = index_dir(store) / "keywords.sqlite3"
    db.write_bytes(b"garbage" * 1000) if damage == "garbage" else _truncate(db, 0.5)
    done = run_ingest(fake, built.corpus, store)
    assert done.code == 2 and f"{rules.INGEST_COMMAND} --full" in done.summary["error"]["hint"], done.err[-2000:]
    repaired = run_ingest(fake, built.corpus, store, "--full")
    assert repaired.code == 0, repaired.err[-2000:]
    assert "set aside" in repaired.err and (db.parent / "keywords.sqlite3.damaged").exists()
    with raw_server(store, built.corpus, fake.host) as server:
        assert set(codes(every_tool(server)).values()) == {"ok"}
        assert search_paths(server, QUERY)[0] == ESCALATION


def _truncate(path: Path, fraction: float) -> None:
    with open(path, "r+b") as fh:
        fh.truncate(int(path.stat().st_size * fraction))


KEYWORD_FAULTS = {
    "missing": (lambda db: db.unlink(), "index_missing"),
    "garbage": (lambda db: db.write_bytes(b"garbage" * 1000), "internal"),
    "truncated to half": (lambda db: _truncate(db, 0.5), "internal"),
    "emptied": (lambda db: _truncate(db, 0.0), "internal"),
}


@pytest.mark.parametrize("fault", sorted(KEYWORD_FAULTS))
def test_keyword_index_missing_or_corrupt(built: Built, fake: FakeOllama, tmp_path: Path, fault: str) -> None:
    store = copy_store(built, tmp_path)
    db = index_dir(store) / "keywords.sqlite3"
    original = db.read_bytes()
    damage, expected = KEYWORD_FAULTS[fault]
    damage(db)
    with raw_server(store, built.corpus, fake.host) as server:
        answers = every_tool(server)
        assert set(codes(answers).values()) == {expected}
        hint = answers["list_documents"][1]["error"]["hint"]
        assert "ingest.py" in hint
        # Repaired on disk: the same server process serves again.
        db.write_bytes(original)
        assert search_paths(server, QUERY)[0] == ESCALATION
    if fault == "missing":
        return
    assert db.read_bytes() == original  # and it never wrote to it


def test_keyword_table_dropped_fails_the_search_not_the_server(built: Built, fake: FakeOllama, tmp_path: Path) -> None:
    store = copy_store(built, tmp_path)
    with sqlite3.connect(index_dir(store) / "keywords.sqlite3") as con:
        con.execute("DROP TABLE chunks_fts")
    with raw_server(store, built.corpus, fake.host) as server:
        assert codes(every_tool(server)) == {"hybrid": "internal", "vector": "ok", "keyword": "internal",
                                             "get_file": "ok", "list_documents": "ok"}


CHROMA_FAULTS = {
    "truncated to half": (lambda db: _truncate(db, 0.5), "internal"),
    "emptied": (lambda db: _truncate(db, 0.0), "index_missing"),
    "garbage": (lambda db: db.write_bytes(b"garbage" * 1000), "internal"),
    "missing": (lambda db: db.unlink(), "index_missing"),
}


@pytest.mark.parametrize("fault", sorted(CHROMA_FAULTS))
def test_chroma_database_truncated_or_missing(built: Built, fake: FakeOllama, tmp_path: Path, fault: str) -> None:
    store = copy_store(built, tmp_path)
    db = index_dir(store) / "chroma" / "chroma.sqlite3"
    damage, expected = CHROMA_FAULTS[fault]
    damage(db)
    before = store_files(store)
    with raw_server(store, built.corpus, fake.host) as server:
        answers = every_tool(server)
        # A damaged vector store degrades hybrid search to its keyword channel; a missing one is
        # index_missing everywhere it is needed.
        hybrid = "ok" if expected == "internal" else expected
        assert codes(answers) == {"hybrid": hybrid, "vector": expected, "keyword": "ok", "get_file": "ok",
                                  "list_documents": "ok"}
        told = answers["hybrid"][1]
        assert "ingest.py" in (told["hint"] if hybrid == "ok" else told["error"]["hint"])
        assert hybrid != "ok" or told["degraded"] == "vector_store_unavailable"
    # The reader wrote nothing: no fresh Chroma schema in an emptied file, no file created.
    assert store_files(store) == before


# Whichever call meets the lock first (the warm-up or this search) the message names the 2 s timeout.
LOCKED_FOR_2_S = re.compile(r"did not answer within 2 s|has run past the store timeout \(2 s\)")


def assert_locked_search_fails_fast(server: Any, mode: str) -> None:
    """Vector mode fails after the store timeout; hybrid answers from its keyword channel then, or
    sooner while the vectors were never loaded (a load stuck on the lock is a load still under way,
    until it has run past the store timeout)."""
    is_error, payload = call(server, "search_corpus", {"query": QUERY, "mode": mode}, timeout=30)
    if mode == "hybrid":
        assert not is_error and payload["results"][0]["path"] == ESCALATION, payload
        if payload["degraded"] == "vector_index_loading":
            assert "still loading" in payload["hint"], payload["hint"]
            return
        assert payload["degraded"] == "vector_store_unavailable" and LOCKED_FOR_2_S.search(payload["hint"]), payload
        return
    assert is_error and payload["error"]["code"] == "store_unavailable", payload
    assert LOCKED_FOR_2_S.search(payload["error"]["message"]), payload["error"]["message"]
    assert "keyword" in payload["error"]["hint"]


def test_chroma_database_locked_is_a_bounded_error(built: Built, fake: FakeOllama, tmp_path: Path) -> None:
    store = copy_store(built, tmp_path)
    chroma = index_dir(store) / "chroma" / "chroma.sqlite3"
    with raw_server(store, built.corpus, fake.host, RAG_STORE_TIMEOUT="2") as server:
        # Locked before the server ever opened Chroma (its warm-up is stuck behind the lock too):
        # a search waits at most the store timeout, the tools that need no vectors keep answering.
        with write_lock(chroma, "EXCLUSIVE"):
            assert_locked_search_fails_fast(server, "hybrid")
            assert search_paths(server, QUERY, mode="keyword")[0] == ESCALATION
            assert not call(server, "list_documents", {})[0]
            assert not call(server, "get_file", {"path": ESCALATION, "end_line": 2})[0]
        # Once the lock is gone, hybrid search reads the vectors again (the call stuck on the
        # lock finishes first; a search meanwhile may still be degraded).
        deadline = time.monotonic() + 30
        while (payload := call(server, "search_corpus", {"query": QUERY})[1])["degraded"] is not None:
            assert time.monotonic() < deadline, payload
        assert payload["results"][0]["path"] == ESCALATION, payload
        # Locked while Chroma is open (and loaded: no longer a load under way).
        with write_lock(chroma, "EXCLUSIVE"):
            assert_locked_search_fails_fast(server, "vector")
            is_error, payload = call(server, "search_corpus", {"query": QUERY}, timeout=30)
            assert not is_error and payload["degraded"] == "vector_store_unavailable", payload
            assert LOCKED_FOR_2_S.search(payload["hint"]), payload["hint"]
        assert search_paths(server, QUERY, mode="vector")[0] == ESCALATION
    # Stdin closes while a search is stuck on the lock: the server still exits, promptly.
    with write_lock(chroma, "EXCLUSIVE"), raw_server(store, built.corpus, fake.host, RAG_STORE_TIMEOUT="2",
                                            RAG_SERVER_WARMUP="0") as server:
        assert_locked_search_fails_fast(server, "hybrid")
    assert "exiting without waiting" in stderr_text(server)
