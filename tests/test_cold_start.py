"""A search that meets the vector index still loading (issue 30 §4, cold start), in process: the
load is held on an event (Chroma's first query waits for the test), so what is checked is what
the answer says, never how long it took. Hybrid search answers from the keyword channel after
its loading wait (RetrievalService.loading_wait_s), marked degraded with the honest reason, and the next search after the load is
hybrid; mode='vector' waits for the load; the warm-up holds the store lock only to open the index.
Every result is checked against the tool's outputSchema (helpers.dispatched).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_ollama import FakeOllama
from helpers import ROOT, Built, dispatched, edit, in_process_service, ingest_index, sample_built

import corpus_rules as rules
import server

QUERY = "who gets paged for a sev-1"
ESCALATION = "oncall/escalation.md"


@pytest.fixture(scope="module")
def base(fake: FakeOllama, indexed_sample: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Built:
    return sample_built(indexed_sample, tmp_path_factory.mktemp("cold-start"), fake.host)


class HeldLoad:
    """Chroma's queries wait until release(): the first one is the load of the vector index."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.released = threading.Event()

    def release(self) -> None:
        self.released.set()


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> Iterator[HeldLoad]:
    hold = HeldLoad()
    query = rules.VectorStore.query

    def held_query(store: rules.VectorStore, *args: Any, **kwargs: Any) -> Any:
        hold.entered.set()
        assert hold.released.wait(60), "the test never released the load"
        return query(store, *args, **kwargs)

    monkeypatch.setattr(rules.VectorStore, "query", held_query)
    try:
        yield hold
    finally:
        hold.release()  # never leave the shared Chroma thread blocked for the next test
        assert server.CHROMA_WORKER.wait_idle(30)


# The servers wait COLD_VECTOR_WAIT_S; shorter here only so the suite does not sit through it.
LOADING_WAIT_S = 0.05


@pytest.fixture
def svc(base: Built) -> Iterator[Any]:
    service = in_process_service(base)
    service.loading_wait_s = LOADING_WAIT_S  # as main() sets it for the servers
    try:
        yield service
    finally:
        service.close(5)


def assert_keyword_only_while_loading(payload: dict[str, Any]) -> None:
    assert payload["degraded"] == "vector_index_loading", payload
    assert payload["results"] and payload["results"][0]["path"] == ESCALATION, payload
    assert all(hit["matched"] == ["keyword"] and hit["score"] is None for hit in payload["results"])
    hint = payload["hint"]
    assert "still loading" in hint and "keyword results only" in hint and "retry in a few seconds" in hint, hint
    assert "mode='vector' waits" in hint, hint


def assert_hybrid(payload: dict[str, Any]) -> None:
    assert payload["degraded"] is None and payload["hint"] is None, payload
    assert payload["results"][0]["path"] == ESCALATION, payload
    assert any("vector" in hit["matched"] for hit in payload["results"]), payload


def test_a_search_during_the_warm_up_load_answers_from_keywords_and_the_next_after_it_is_hybrid(
        svc: Any, held: HeldLoad) -> None:
    warmup = server.WarmUp(svc)
    warmup.start(delay=0.0)
    assert held.entered.wait(60)  # the warm-up's probe is loading the index
    # The store lock is free meanwhile: the tools that need no vectors answer, and so does hybrid.
    assert not dispatched(svc, "list_documents")[0]
    is_error, payload = dispatched(svc, "search_corpus", query=QUERY)
    assert not is_error, payload
    assert_keyword_only_while_loading(payload)
    is_error, keyword = dispatched(svc, "search_corpus", query=QUERY, mode="keyword")
    assert not is_error and keyword["degraded"] is None, keyword
    held.release()
    warmup.join(30)
    is_error, payload = dispatched(svc, "search_corpus", query=QUERY)
    assert not is_error, payload
    assert_hybrid(payload)


def test_a_first_search_that_starts_the_load_itself_degrades_and_the_load_goes_on(svc: Any, held: HeldLoad) -> None:
    """No warm-up (RAG_SERVER_WARMUP=0): the search's own query is the load; it keeps running
    after the search answered, and the next search uses it."""
    is_error, payload = dispatched(svc, "search_corpus", query=QUERY, min_score=0.1)
    assert not is_error, payload
    assert_keyword_only_while_loading(payload)
    assert "min_score was not applied" in payload["hint"]
    assert held.entered.wait(60)  # the search's own query, left to run: it is the load
    held.release()
    assert server.CHROMA_WORKER.wait_idle(30)
    assert svc.manager.open().vectors_loaded  # the abandoned search's query finished the load
    assert_hybrid(dispatched(svc, "search_corpus", query=QUERY)[1])


def answered_once_released(held: HeldLoad, search: Callable[[], tuple[bool, dict[str, Any]]]) -> dict[str, Any]:
    """`search` on a thread: still waiting well past the hybrid wait while the load is held, then
    answered (not an error) once it is released. Its payload."""
    answers: list[tuple[bool, dict[str, Any]]] = []
    searching = threading.Thread(target=lambda: answers.append(search()))
    searching.start()
    assert held.entered.wait(60)
    searching.join(10 * LOADING_WAIT_S)
    assert searching.is_alive() and not answers
    held.release()
    searching.join(60)
    ((is_error, payload),) = answers
    assert not is_error, payload
    return payload


def test_vector_mode_waits_for_the_load(svc: Any, held: HeldLoad) -> None:
    payload = answered_once_released(held, lambda: dispatched(svc, "search_corpus", query=QUERY, mode="vector"))
    assert payload["degraded"] is None, payload
    assert payload["results"][0]["path"] == ESCALATION and payload["results"][0]["matched"] == ["vector"]


def test_a_query_no_keyword_matches_waits_for_the_load(svc: Any, held: HeldLoad) -> None:
    """An empty keyword answer is no answer to give while loading: the search waits for vectors."""
    payload = answered_once_released(held, lambda: dispatched(svc, "search_corpus", query="qqzxv wwkrj"))
    assert payload["degraded"] is None and payload["results"], payload
    assert all(hit["matched"] == ["vector"] for hit in payload["results"])


def test_a_query_of_common_words_answers_from_the_passages_holding_them_together_while_loading(
        svc: Any, held: HeldLoad, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hybrid leaves common words to the vector channel; while it loads, the keyword channel
    ranks them as keyword mode does (see keyword_plan) instead of the search waiting for the load."""
    monkeypatch.setattr(server, "KEYWORD_MATCH_BUDGET", 11)  # canary and rollout together: 11 passages
    warmup = server.WarmUp(svc)
    warmup.start(delay=0.0)
    assert held.entered.wait(60)
    is_error, payload = dispatched(svc, "search_corpus", query="deploy rollout canary")
    assert not is_error and payload["degraded"] == "vector_index_loading", payload
    assert payload["results"] and all(hit["matched"] == ["keyword"] for hit in payload["results"])
    assert all({"canary", "rollout"} <= set(rules.indexed_terms(f"{hit['heading']} {hit['text']}"))
               for hit in payload["results"]), payload
    held.release()
    warmup.join(30)


def test_a_loaded_index_is_never_called_loading(svc: Any, held: HeldLoad) -> None:
    """Once the vectors answered, a search waits for them as for any store (no cold wait)."""
    held.release()
    assert not dispatched(svc, "search_corpus", query=QUERY, mode="vector")[0]  # loads the index
    assert_hybrid(dispatched(svc, "search_corpus", query=QUERY)[1])
    held.released.clear()  # the next query waits again, as a slow store would
    payload = answered_once_released(held, lambda: dispatched(svc, "search_corpus", query="rollback the database"))
    assert payload["degraded"] is None, payload


def test_without_a_loading_wait_hybrid_waits_for_the_load(base: Built, held: HeldLoad) -> None:
    """The CLI's service (loading_wait_s=None): one search per process, so it waits for the load."""
    service = in_process_service(base)
    try:
        assert_hybrid(answered_once_released(held, lambda: dispatched(service, "search_corpus", query=QUERY)))
    finally:
        service.close(5)


def test_the_staleness_count_the_warm_up_began_is_the_one_the_first_search_reports(
        fake: FakeOllama, sample_index: tuple[Path, Path]) -> None:
    built = Built(*sample_index, fake.host)
    target = built.corpus / ESCALATION
    edit(target, target.read_text(encoding="utf-8") + "\nA line added after ingest.\n")
    service = in_process_service(built)
    try:
        warmup = server.WarmUp(service)
        warmup.start(delay=0.0)
        warmup.join(60)
        is_error, payload = dispatched(service, "search_corpus", query=QUERY)
        assert not is_error and payload["staleness"]["changed_files"] == 1, payload
        assert "1 indexed file(s) changed on disk" in payload["staleness"]["hint"]
    finally:
        service.close(5)


FROZEN_WARM_UP = """
import gc, json, sys, weakref
import server
svc = server.RetrievalService()
warmup = server.WarmUp(svc, freeze_imports=True)
warmup.start(delay=0.0)
warmup.join(120)
frozen = gc.get_freeze_count()
outcome = server.dispatch(svc, "search_corpus", {"query": sys.argv[1]})
first = weakref.ref(svc.manager.open())
print(json.dumps({"frozen": frozen, "generation": outcome.payload["index"]["generation"]}), flush=True)
sys.stdin.readline()  # the test has published the next generation
outcome = server.dispatch(svc, "search_corpus", {"query": sys.argv[1]})
gc.collect()
print(json.dumps({"generation": outcome.payload["index"]["generation"], "first_collected": first() is None}))
"""


@pytest.mark.process
def test_the_server_warm_up_freezes_what_its_imports_built_and_a_closed_generation_is_still_collected(
        fake: FakeOllama, indexed_sample: tuple[Path, Path], tmp_path: Path) -> None:
    """The server process's warm-up leaves what its imports built (chromadb's) out of the cyclic
    collector, which walked it on every full pass; the generation it opens (frozen with them),
    closed when ingest publishes the next, is still freed. In a process of its own: freezing
    reaches every object alive in the process."""
    base = sample_built(indexed_sample, tmp_path, fake.host)
    proc = subprocess.Popen([sys.executable, "-c", FROZEN_WARM_UP, QUERY], cwd=ROOT, env=base.server_env(fake.host),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        line = proc.stdout.readline()
        assert line, proc.stderr.read() if proc.stderr else ""
        before = json.loads(line)
        assert before["frozen"] > 10_000, before
        edit(base.corpus / ESCALATION, "Escalation drills run every quarter.")
        done = ingest_index(base.corpus, base.store, fake.host)
        assert done.returncode == 0, done.stderr
        out, err = proc.communicate("go\n", timeout=120)
    finally:
        proc.kill()
    after = json.loads(out.strip().splitlines()[-1])
    assert after == {"generation": before["generation"] + 1, "first_collected": True}, err[-3000:]
