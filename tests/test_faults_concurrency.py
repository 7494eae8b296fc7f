"""Scenario 3: concurrency between real processes. A server answers a steady stream of tool calls
while `python ingest.py` re-indexes the corpus under it; two ingests started together take turns
through the store lock."""

from __future__ import annotations

import re
import time
from collections import Counter
from pathlib import Path

import pytest
from fake_ollama import FakeOllama
from faultlib import clean_reference, write_handbooks
from helpers import (
    assert_consistent,
    call,
    copy_sample,
    corpus_hashes,
    current_of,
    finish,
    raw_server,
    run_ingest,
    search_paths,
    snapshot,
    start_ingest,
)

pytestmark = pytest.mark.process  # real processes (servers, ingest, Chroma): only in `pytest --all` (tests/README.md)

HANDBOOKS = {f"handbooks/h{i:02d}.md": 40 for i in range(12)}
NEW_TOKEN = "FRESHPAGE7310"
REVISION = re.compile(r"revision-([AB])")


def test_server_keeps_answering_while_ingest_reindexes(fake: FakeOllama, tmp_path: Path) -> None:
    fake.reset()
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    tokens = write_handbooks(corpus, HANDBOOKS, "A")
    assert run_ingest(fake, corpus, store).code == 0
    with raw_server(store, corpus, fake.host) as server:
        assert search_paths(server, f"{tokens['handbooks/h00.md']} part 3")[0] == "handbooks/h00.md"
        # The new corpus: every handbook rewritten, one deleted, one page added.
        write_handbooks(corpus, HANDBOOKS, "B")
        (corpus / "handbooks" / "h11.md").unlink()
        (corpus / "fresh.md").write_text(f"# Fresh page\n\n{NEW_TOKEN} arrived with the re-index.\n", encoding="utf-8")
        fake.configure(delay_seconds=0.1)  # the re-index takes a few seconds of embedding calls
        ingest = start_ingest(fake, corpus, store)
        answers: Counter[str] = Counter()
        deadline = time.monotonic() + 180
        i = 0
        while ingest.poll() is None:
            assert time.monotonic() < deadline, "ingest did not finish"
            name = f"handbooks/h{i % 12:02d}.md"
            for mode in ("hybrid", "keyword", "vector"):
                is_error, payload = call(server, "search_corpus",
                                         {"query": f"{tokens[name]} part {i % 40}", "mode": mode, "k": 10}, timeout=30)
                assert not is_error, payload
                revisions: dict[str, set[str]] = {}
                for hit in payload["results"]:
                    revisions.setdefault(hit["path"], set()).update(REVISION.findall(hit["text"]))
                # One generation per file in any answer, never a mix.
                assert all(len(found) <= 1 for found in revisions.values()), revisions
                answers[mode] += 1
            assert not call(server, "list_documents", {"path_prefix": "handbooks"}, timeout=30)[0]
            assert not call(server, "get_file", {"path": name, "start_line": 1, "end_line": 5}, timeout=30)[0] \
                or name == "handbooks/h11.md"
            answers["other"] += 2
            i += 1
        done = finish(ingest)
        assert done.code == 0, done.err
        print(f"calls answered during the re-index: {dict(answers)}")
        assert sum(answers.values()) >= 20, answers  # a steady stream, not a couple of calls
        # Without a restart the server now serves the new corpus.
        for mode in ("hybrid", "keyword"):
            assert search_paths(server, NEW_TOKEN, mode=mode)[0] == "fresh.md"
        is_error, payload = call(server, "search_corpus", {"query": f"{tokens['handbooks/h03.md']} part 7", "k": 20})
        assert not is_error and {m for hit in payload["results"] for m in REVISION.findall(hit["text"])} == {"B"}
        assert "handbooks/h11.md" not in search_paths(server, f"{tokens['handbooks/h11.md']} part 1", mode="keyword")
        listed = call(server, "list_documents", {"limit": 500})[1]
        assert listed["index"]["generation"] == current_of(store)["generation"] == 2
        assert {d["path"] for d in listed["documents"]} >= {"fresh.md", "handbooks/h00.md"}
        assert "handbooks/h11.md" not in {d["path"] for d in listed["documents"]}
    fake.configure(delay_seconds=0.0)
    assert snapshot(store) == clean_reference(fake, corpus, tmp_path)


def test_two_ingests_started_together_take_turns(fake: FakeOllama, tmp_path: Path) -> None:
    fake.reset()
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    write_handbooks(corpus, HANDBOOKS, "A")
    fake.configure(delay_seconds=0.4)  # the winner holds the lock for seconds
    first, second = start_ingest(fake, corpus, store), start_ingest(fake, corpus, store)
    results = {first.pid: finish(first), second.pid: finish(second)}
    codes = sorted(done.code for done in results.values())
    assert codes == [0, 2], {pid: (done.code, done.err[-500:]) for pid, done in results.items()}
    loser_pid = next(pid for pid, done in results.items() if done.code == 2)
    winner_pid = next(pid for pid in results if pid != loser_pid)
    loser = results[loser_pid]
    assert loser.summary["error"]["code"] == "lock_held"
    assert f"another ingest (pid {winner_pid}) is writing {store}" in loser.err and "wait for it to finish" in loser.err
    fake.configure(delay_seconds=0.0)
    hashes = {path: {digest} for path, digest in corpus_hashes(corpus).items()}
    assert_consistent(store, hashes, set(hashes) - {"private/offsite-backup.md"})
    # The next ingest finds nothing to do and no stale lock.
    again = run_ingest(fake, corpus, store)
    assert again.code == 0 and again.summary["embedding_calls"] == 0, again.err


def test_search_whose_embedding_outlives_its_generation_answers_from_the_new_one(fake: FakeOllama,
                                                                                   tmp_path: Path) -> None:
    """A hybrid search reads its keyword channel (and starts its Chroma queries) while Ollama
    embeds the query. When an ingest moves the index on meanwhile, the answer must come from the
    new generation alone: nothing read from the old one is kept."""
    import threading

    from helpers import tool_payload

    import server
    from corpus_rules import load_settings

    fake.reset()
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    assert run_ingest(fake, corpus, store).code == 0
    with FakeOllama() as slow:  # the server's Ollama: same vectors, answering once released
        svc = server.RetrievalService(settings_loader=lambda: load_settings(
            {"OLLAMA_HOST": slow.host, "RAG_CORPUS_DIR": str(corpus), "RAG_STORE_DIR": str(store)}))
        slow.configure(hold=True)
        answer: dict[str, object] = {}
        query = f"{NEW_TOKEN} arrival notes"
        searching = threading.Thread(target=lambda: answer.update(result=server.mcp_result(
            server.dispatch(svc, "search_corpus", {"query": query, "k": 5}))))
        searching.start()
        deadline = time.monotonic() + 10
        while slow.calls()["embed_calls"] == 0:  # the query's embedding is in flight
            assert time.monotonic() < deadline, "the search never asked for its embedding"
            time.sleep(0.01)
        (corpus / "fresh.md").write_text(f"# Fresh page\n\n{NEW_TOKEN} arrived with the re-index.\n", encoding="utf-8")
        assert run_ingest(fake, corpus, store).code == 0  # the fast Ollama, while the query's call is held
        slow.configure(hold=False)
        searching.join(30)
        svc.close(10)
    is_error, payload = tool_payload("search_corpus", answer["result"])
    assert not is_error, payload
    assert payload["index"]["generation"] == current_of(store)["generation"] == 2
    top = payload["results"][0]
    assert top["path"] == "fresh.md" and "keyword" in top["matched"], payload["results"]
