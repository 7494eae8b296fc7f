"""The vector-store seam proven by its second backend: a real Chroma server (`chroma run` on a
loopback port, started here) holds the vectors; the keyword index and CURRENT.json stay in the
store folder. What holds for the embedded store must hold here: the same answers, embed-then-swap
and convergence after kill -9, a re-ingest seen without a restart, the lifecycle pre-filter, stores
that share one server never meeting, and a server that is down or frozen is a structured error,
never a hang."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_ollama import FakeOllama
from helpers import (
    CRASHING_CHILD,
    ROOT,
    ChromaServer,
    Done,
    StoredVector,
    call,
    child_env,
    copy_sample,
    current_of,
    edit,
    finish,
    ingest_args,
    raw_server,
    run_ingest,
)

import corpus_rules as rules

pytestmark = [pytest.mark.heavy, pytest.mark.process]  # a file over a minute of real processes: `pytest --all` only, scheduled first

QUERIES = ["who gets paged for a sev-1", "rollback the database after a bad deploy", "E4091", "ログ収集"]


@pytest.fixture(scope="module")
def chroma(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChromaServer]:
    with ChromaServer(tmp_path_factory.mktemp("chroma") / "data") as server:
        yield server


def on_server(fake: FakeOllama, corpus: Path, store: Path, url: str, *extra: str, **env: str) -> Done:
    return run_ingest(fake, corpus, store, *extra, RAG_CHROMA_URL=url, **env)


def settings_for(store: Path, url: str | None) -> rules.Settings:
    return rules.load_settings({"RAG_STORE_DIR": str(store), **({"RAG_CHROMA_URL": url} if url else {})})


def vector_snapshot(store: Path, url: str | None) -> dict[str, dict[str, Any]]:
    """lifecycle -> id -> (document, metadata, rounded embedding), whichever backend holds them."""
    layout = rules.StoreLayout(store)
    index = current_of(store)["index"]
    vectors = rules.vector_store(settings_for(store, url), layout, index).open(create=False)
    try:
        state = {}
        for lifecycle in rules.LIFECYCLES:
            collection = vectors.collection(lifecycle)
            got = rules.read_through_writes(lambda c=collection: c.get(include=["documents", "metadatas", "embeddings"]))
            state[lifecycle] = {i: (d, dict(m), StoredVector(float(x) for x in e))
                                for i, d, m, e in zip(got["ids"], got["documents"], got["metadatas"], got["embeddings"], strict=True)}
        return state
    finally:
        vectors.close()


def committed(store: Path) -> dict[str, str]:
    import sqlite3

    db = sqlite3.connect(f"file:{store / current_of(store)['index'] / rules.KEYWORD_DB}?mode=ro", uri=True)
    try:
        return {i: lc for i, lc in db.execute("SELECT id, lifecycle FROM chunks")}
    finally:
        db.close()


def server_collections(chroma: ChromaServer) -> dict[str, int]:
    import chromadb

    client = chromadb.HttpClient(host="127.0.0.1", port=chroma.port)
    return {c.name: c.count() for c in client.list_collections()}


def searches(store: Path, corpus: Path, host: str, url: str | None) -> list[Any]:
    extra = {"RAG_CHROMA_URL": url} if url else {}
    answers = []
    with raw_server(store, corpus, host, **extra) as server:
        # A vector search waits for the vector index to load (a hybrid one answers from keywords meanwhile).
        assert not call(server, "search_corpus", {"query": QUERIES[0], "mode": "vector"})[0]
        for query in QUERIES:
            for mode in ("hybrid", "vector", "keyword"):
                for superseded in (False, True):
                    is_error, payload = call(server, "search_corpus", {"query": query, "mode": mode, "k": 8,
                                                                       "include_superseded": superseded})
                    assert not is_error, payload
                    answers.append([(h["path"], h["start_line"], h["matched"], h["lifecycle"],
                                     None if h["score"] is None else round(h["score"], 4)) for h in payload["results"]])
        is_error, listed = call(server, "list_documents", {})
        assert not is_error and listed["total"] == 6
        is_error, lines = call(server, "get_file", {"path": "oncall/escalation.md", "start_line": 1, "end_line": 3})
        assert not is_error and lines["source"] == "disk"
    return answers


def test_a_chroma_server_answers_exactly_as_the_embedded_store(fake: FakeOllama, chroma: ChromaServer,
                                                               tmp_path: Path) -> None:
    corpus = copy_sample(tmp_path)
    embedded, served = tmp_path / "embedded", tmp_path / "served"
    assert run_ingest(fake, corpus, embedded).code == 0
    done = on_server(fake, corpus, served, chroma.url)
    assert done.code == 0, done.err
    index = current_of(served)["index"]
    # The vectors are on the server; the keyword index and CURRENT.json stay in the store folder.
    assert not (served / index / rules.CHROMA_SUBDIR).exists() and (served / index / rules.KEYWORD_DB).is_file()
    store_id = (served / rules.STORE_ID_FILE).read_text(encoding="ascii").strip()
    counts = server_collections(chroma)
    for lifecycle in rules.LIFECYCLES:
        name = f"lr-{store_id}-{index}-{lifecycle}"
        assert counts[name] == sum(1 for lc in committed(served).values() if lc == lifecycle) > 0
    assert vector_snapshot(served, chroma.url) == vector_snapshot(embedded, None)
    assert searches(served, corpus, fake.host, chroma.url) == searches(embedded, corpus, fake.host, None)


def test_stores_sharing_one_server_never_meet(fake: FakeOllama, chroma: ChromaServer, tmp_path: Path) -> None:
    sample, other = copy_sample(tmp_path), tmp_path / "other"
    other.mkdir()
    (other / "zebra.md").write_text("# Zebra care\n\nZEBRA-ONLY-TOKEN feeding schedule for zebras.\n", encoding="utf-8")
    assert on_server(fake, sample, tmp_path / "s1", chroma.url).code == 0
    assert on_server(fake, other, tmp_path / "s2", chroma.url).code == 0
    with raw_server(tmp_path / "s1", sample, fake.host, RAG_CHROMA_URL=chroma.url) as first, \
            raw_server(tmp_path / "s2", other, fake.host, RAG_CHROMA_URL=chroma.url) as second:
        for mode in ("vector", "hybrid"):
            one = call(first, "search_corpus", {"query": "ZEBRA-ONLY-TOKEN zebras", "mode": mode, "k": 20})[1]
            two = call(second, "search_corpus", {"query": "who gets paged for a sev-1", "mode": mode, "k": 20})[1]
            assert "zebra.md" not in {h["path"] for h in one["results"]}
            assert {h["path"] for h in two["results"]} == {"zebra.md"}


def test_a_re_ingest_is_seen_without_restart_and_a_rebuild_replaces_its_collections(
        fake: FakeOllama, chroma: ChromaServer, tmp_path: Path) -> None:
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    assert on_server(fake, corpus, store, chroma.url).code == 0
    store_id = (store / rules.STORE_ID_FILE).read_text(encoding="ascii").strip()
    old_index = current_of(store)["index"]
    with raw_server(store, corpus, fake.host, RAG_CHROMA_URL=chroma.url) as server:
        assert call(server, "search_corpus", {"query": "KUMQUAT-REVISION-2 kumquat", "mode": "vector"})[1]["results"]
        edit(corpus / "reference" / "glossary.md", "# Glossary\n\nKUMQUAT-REVISION-2 kumquat orchard notes.\n")
        assert on_server(fake, corpus, store, chroma.url).code == 0
        top = call(server, "search_corpus", {"query": "KUMQUAT-REVISION-2 kumquat", "mode": "vector"})[1]["results"][0]
        assert top["path"] == "reference/glossary.md" and "KUMQUAT" in top["text"]
        # A chunking change rebuilds into new collections, live only when complete; the old ones go.
        done = on_server(fake, corpus, store, chroma.url, RAG_CHUNK_MAX_TOKENS="256")
        assert done.code == 0 and done.summary["rebuilt"], done.err
        new_index = current_of(store)["index"]
        names = set(server_collections(chroma))
        assert {f"lr-{store_id}-{new_index}-{lc}" for lc in rules.LIFECYCLES} <= names
        assert not any(f"lr-{store_id}-{old_index}" in name for name in names)
        is_error, payload = call(server, "search_corpus", {"query": "KUMQUAT-REVISION-2 kumquat", "mode": "vector"})
        assert not is_error and payload["results"][0]["path"] == "reference/glossary.md"
        # The lifecycle pre-filter: the superseded runbook only when asked for.
        query = {"query": "kubectl-deploy push --all-at-once", "mode": "vector", "k": 20}
        assert all(h["lifecycle"] == "active" for h in call(server, "search_corpus", query)[1]["results"])
        wider = call(server, "search_corpus", {**query, "include_superseded": True})[1]["results"]
        assert "runbooks/deploy-2023.md" in {h["path"] for h in wider}


@pytest.mark.parametrize("crash_at", ["insert_rows:2", "delete_vectors:2", "write_current:1"])
def test_kill_9_of_ingest_against_a_chroma_server_converges(fake: FakeOllama, chroma: ChromaServer,
                                                            tmp_path: Path, crash_at: str) -> None:
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    assert on_server(fake, corpus, store, chroma.url).code == 0
    for path in ("oncall/escalation.md", "runbooks/deploy.md", "reference/api.md"):
        text = (corpus / path).read_text(encoding="utf-8")
        edit(corpus / path, text + "\nA new closing paragraph.\n")
    proc = subprocess.Popen([sys.executable, "-c", CRASHING_CHILD, str(ROOT), *ingest_args(corpus, store)[2:]],
                            env=child_env(fake, INGEST_CRASH_AT=crash_at, RAG_CHROMA_URL=chroma.url),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT.parent)
    killed = finish(proc)
    assert killed.code == -9, killed.err
    # Whatever the kill left: every committed chunk has its vector in the collection of its lifecycle.
    state = vector_snapshot(store, chroma.url)
    for chunk, lifecycle in committed(store).items():
        assert chunk in state[lifecycle], chunk
    again = on_server(fake, corpus, store, chroma.url)
    assert again.code == 0, again.err
    reference = tmp_path / "reference"
    assert on_server(fake, corpus, reference, chroma.url).code == 0
    assert vector_snapshot(store, chroma.url) == vector_snapshot(reference, chroma.url)
    assert committed(store) == committed(reference)


def test_stored_vectors_are_read_whole_while_another_client_deletes_and_upserts(chroma: ChromaServer,
                                                                              tmp_path: Path) -> None:
    """Chroma's get(include embeddings) is no snapshot: a write applied between its metadata read
    and its vector read fails it ("Error finding id", "Error getting embedding"), a few reads in a
    hundred under this churn. That is what a killed ingest's last request, still running on the
    server, does to the next reader; the reads retry it and answer every time."""
    import random
    import threading

    store = tmp_path / "store"
    store.mkdir()
    settings, layout = settings_for(store, chroma.url), rules.StoreLayout(store)
    lifecycle, dims = rules.LIFECYCLES[0], 64
    kept = [f"kept-{n}" for n in range(2000)]

    def rows(ids: list[str]) -> dict[str, Any]:
        return {"ids": ids, "embeddings": [[random.random() for _ in range(dims)] for _ in ids]}

    reader = rules.vector_store(settings, layout, "churn", create=True).open(create=True, metadata={"test": "churn"})
    writer = rules.vector_store(settings, layout, "churn").open(create=False)
    reader.collection(lifecycle).upsert(**rows(kept))
    stop = threading.Event()

    def churned(batch: int) -> list[str]:
        return [f"churn-{batch}-{n}" for n in range(300)]

    batch = 0

    def churn() -> None:
        nonlocal batch
        while not stop.is_set():
            writer.collection(lifecycle).upsert(**rows(churned(batch + 1)))
            writer.collection(lifecycle).delete(ids=churned(batch))
            batch += 1

    churning = threading.Thread(target=churn)
    churning.start()
    try:
        for _ in range(100):
            # The kept ids, and the churned ones being deleted or written about now.
            found, vectors = reader.embeddings(lifecycle, kept + churned(batch) + churned(batch + 1))
            assert set(kept) <= set(found) and len(vectors) == len(found)
    finally:
        stop.set()
        churning.join()
        reader.close()
        writer.close()


def test_a_chroma_server_down_frozen_or_restarted_degrades_hybrid_search(fake: FakeOllama, tmp_path: Path) -> None:
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    with ChromaServer(tmp_path / "data") as chroma:
        assert on_server(fake, corpus, store, chroma.url).code == 0
        with raw_server(store, corpus, fake.host, RAG_CHROMA_URL=chroma.url, RAG_STORE_TIMEOUT="4") as server:
            # A vector search waits for the vector index (hybrid right after the start answers from
            # keywords while it loads, degraded vector_index_loading): what follows is about a warm server.
            assert not call(server, "search_corpus", {"query": "rollback", "mode": "vector"})[0]
            chroma.stop()
            started = time.monotonic()
            # Hybrid degrades to its keyword channel, as when Ollama is down; vector mode has
            # nothing to fall back on and says what to check.
            is_error, payload = call(server, "search_corpus", {"query": "rollback"})
            assert time.monotonic() - started < 10
            assert not is_error and payload["degraded"] == "vector_store_unavailable", payload
            assert payload["results"] and all(hit["score"] is None for hit in payload["results"])
            assert "keyword results only" in payload["hint"] and "RAG_CHROMA_URL" in payload["hint"]
            is_error, payload = call(server, "search_corpus", {"query": "rollback", "mode": "vector"})
            assert is_error and payload["error"]["code"] == "store_unavailable", payload
            assert "RAG_CHROMA_URL" in payload["error"]["hint"] and chroma.url in json.dumps(payload)
            # What needs only the keyword index keeps working.
            assert not call(server, "search_corpus", {"query": "rollback", "mode": "keyword"})[0]
            assert not call(server, "list_documents", {})[0]
            chroma.start()  # the same port and data: the next search works again
            is_error, payload = call(server, "search_corpus", {"query": "rollback"})
            assert not is_error and payload["results"], payload
            chroma.freeze()
            try:
                started = time.monotonic()
                is_error, payload = call(server, "search_corpus", {"query": "a question never asked before"})
                assert time.monotonic() - started < 15, "a frozen server must not hang the search"
                assert not is_error and payload["degraded"] == "vector_store_unavailable", payload
                # Still frozen: the next search does not wait for the store again.
                is_error, payload = call(server, "search_corpus", {"query": "another question never asked"})
                assert not is_error and "still busy" in payload["hint"], payload
            finally:
                chroma.thaw()
        # Ingest against a server that is gone: exit 2, nothing lost.
        chroma.stop()
        edit(corpus / "reference" / "glossary.md", "# Glossary\n\nChanged while the server is down.\n")
        down = on_server(fake, corpus, store, chroma.url)
        assert down.code == 2 and "does not answer" in down.summary["error"]["message"], down.err
        assert "RAG_CHROMA_URL" in down.summary["error"]["hint"]


def test_health_says_degraded_while_the_chroma_server_is_down(fake: FakeOllama, tmp_path: Path) -> None:
    """/health over HTTP probes the Chroma server in the background: down is degraded (200: the
    keyword index still serves), and the answer names no host."""
    import httpx
    from helpers import server_env
    from test_http import http_server

    corpus, store = copy_sample(tmp_path), tmp_path / "store"

    def health_once_probed(base: str, wanted: str) -> httpx.Response:
        deadline = time.monotonic() + 40  # the probe runs every 10 s
        while (answer := httpx.get(f"{base}/health")).json().get("vector_store") != wanted:
            assert time.monotonic() < deadline, answer.text
            time.sleep(0.1)
        return answer

    with ChromaServer(tmp_path / "data") as chroma:
        assert on_server(fake, corpus, store, chroma.url).code == 0
        with http_server(server_env(store, corpus, fake.host, RAG_CHROMA_URL=chroma.url)) as running:
            healthy = health_once_probed(running.base, "available")
            assert healthy.status_code == 200 and healthy.json()["status"] == "ok", healthy.text
            chroma.stop()
            down = health_once_probed(running.base, "unavailable")
            body = down.json()
            assert down.status_code == 200 and body["status"] == "degraded", down.text
            assert [p["part"] for p in body["problems"]] == ["vector_store"], body
            assert str(chroma.port) not in down.text and str(tmp_path) not in down.text
