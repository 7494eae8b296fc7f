"""Embedding throughput across call slots and hosts (issue 30 §1).

Ingest keeps several embedding calls in flight (RAG_EMBED_CONCURRENCY, or as many as each host
is measured to sustain) and spreads them over the hosts of a comma-list OLLAMA_HOST. A host that
fails or stalls leaves the rotation and its texts go to the others, no text is embedded twice,
and hosts serving other weights under the model's name are refused. The loopback fake Ollama
stands in for each host: its `slots` are Ollama's OLLAMA_NUM_PARALLEL, its per-text delay a CPU."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from budgets import examples
from fake_ollama import FakeOllama
from faultlib import write_handbooks
from helpers import (
    SERVER,
    Hosts,
    chunk_inputs,
    copy_sample,
    dispatched,
    in_process_service,
    ingest_in_process,
    sample_built,
    snapshot,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import corpus_rules as rules
import ingest
import server

# ---------------------------------------------------------------------------
# The settings.


def test_ollama_host_takes_a_comma_list_the_first_named_first() -> None:
    settings_ = rules.load_settings({"OLLAMA_HOST": " gpu-box:11434 , http://laptop:11434/ ,gpu-box:11434"})
    assert settings_.ollama_hosts == ("http://gpu-box:11434", "http://laptop:11434")
    assert settings_.ollama_host == "http://gpu-box:11434"
    with pytest.raises(rules.RagError, match="OLLAMA_HOST='gpu-box:xx'"):
        rules.load_settings({"OLLAMA_HOST": "127.0.0.1:11434,gpu-box:xx"})
    with pytest.raises(rules.RagError, match="OLLAMA_HOST"):
        rules.load_settings({"OLLAMA_HOST": ",,"})


def test_embed_concurrency_is_measured_unless_set() -> None:
    assert rules.load_settings({}).embed_concurrency is None
    assert rules.load_settings({"RAG_EMBED_CONCURRENCY": "4"}).embed_concurrency == 4
    for bad in ("0", "many", str(rules.MAX_EMBED_CONCURRENCY + 1)):
        with pytest.raises(rules.RagError, match="RAG_EMBED_CONCURRENCY"):
            rules.load_settings({"RAG_EMBED_CONCURRENCY": bad})


# ---------------------------------------------------------------------------
# How many calls a host gets at a time: a pure function of what it was measured to sustain.


def group_seconds(level: int, slots: int, per_group_s: float) -> float:
    """How long a host with `slots` parallel runners takes over a commit group sent as
    CALLS_PER_SLOT x level equal calls, `level` at a time (the runners take `slots` of them at once,
    the others wait in its queue)."""
    calls = ingest.CALLS_PER_SLOT * level
    return -(-calls // min(level, slots)) * per_group_s / calls


def settle(slots: int, per_group_s: float = 1.0, tokens: float = 1000.0) -> ingest.ConcurrencyTuner:
    """Feed a tuner the answers of such a host, group after group, until it settles."""
    tuner = ingest.ConcurrencyTuner()
    busy = 0.0
    for _ in range(200):
        if tuner.settled:
            break
        calls = ingest.CALLS_PER_SLOT * tuner.level
        group_s = group_seconds(tuner.level, slots, per_group_s)
        epochs = [tuner.sent(busy) for _ in range(calls)]
        for epoch in epochs:
            busy += group_s / calls
            tuner.measured(tokens / calls, busy, epoch)
    return tuner


@settings(max_examples=examples(100), deadline=None, derandomize=True)
@given(slots=st.integers(1, 40), per_group_s=st.floats(0.01, 30.0))
def test_the_measured_level_reaches_the_hosts_throughput_without_flooding_it(slots: int, per_group_s: float) -> None:
    tuner = settle(slots, per_group_s)
    assert tuner.settled
    level = tuner.level
    assert 1 <= level <= rules.MAX_EMBED_CONCURRENCY
    best = min(group_seconds(n, slots, per_group_s) for n in range(1, rules.MAX_EMBED_CONCURRENCY + 1))
    # Levels are powers of two: at least two thirds of what the host can do at best (a host of 7
    # runners gets 8 calls at a time, the eighth waiting its turn), and all of it for the usual
    # OLLAMA_NUM_PARALLEL values.
    assert best / group_seconds(level, slots, per_group_s) >= 2 / 3
    if slots & (slots - 1) == 0:  # Ollama's usual OLLAMA_NUM_PARALLEL: all of it
        assert level == min(slots, rules.MAX_EMBED_CONCURRENCY)
    assert level < 2 * slots or level == 1  # never twice its runners or more


def test_a_cpu_bound_host_stays_at_one_call() -> None:
    assert settle(slots=1).level == 1


def test_a_timeout_halves_the_level_and_a_fixed_level_stays() -> None:
    tuner = ingest.ConcurrencyTuner()
    tuner.level = 8
    tuner.timed_out()
    assert (tuner.level, tuner.settled) == (4, True)
    fixed = ingest.ConcurrencyTuner(fixed=3)
    fixed.timed_out()
    for busy in range(1, 20):
        fixed.measured(100, float(busy), fixed.sent(busy - 1.0))
    assert (fixed.level, fixed.settled) == (3, True)


# ---------------------------------------------------------------------------
# One host, several slots.


@pytest.mark.heavy  # about 1 s of CPU in ingest runs: in --all, to keep the fast tier's budget
def test_several_calls_in_flight_index_exactly_what_one_at_a_time_does(tmp_path: Path) -> None:
    corpus = copy_sample(tmp_path)
    write_handbooks(corpus, {"handbook.md": 60}, "A")
    with FakeOllama() as fake:
        serial = ingest_in_process(fake, corpus, tmp_path / "serial", RAG_EMBED_CONCURRENCY="1")
        assert serial.code == 0, serial.err
        assert fake.calls()["most_embeds_in_flight"] == 1
        fake.reset()
        fake.configure(slots=4, delay_per_text_seconds=0.01)
        parallel = ingest_in_process(fake, corpus, tmp_path / "parallel", RAG_EMBED_CONCURRENCY="4")
        assert parallel.code == 0, parallel.err
        assert fake.calls()["most_embeds_in_flight"] == 4
        inputs = chunk_inputs(fake)
    assert len(inputs) == len(set(inputs)) == parallel.summary["chunks_embedded"]
    assert parallel.summary["embedders"][0]["most_in_flight"] == 4
    assert snapshot(tmp_path / "parallel") == snapshot(tmp_path / "serial")


def test_the_pace_counts_the_seconds_calls_are_out_while_one_round_runs_into_the_next() -> None:
    """seconds_for, which sizes the commit groups and decides the keyword-first pass, counts every
    second a chunk's call was out, also when the next round's calls follow without a pause (the
    calls never all landed, so that time went uncounted and the pace read ~0)."""
    with FakeOllama() as fake:
        fake.configure(slots=2, delay_per_text_seconds=0.02)
        embedding = ingest.Embedding([rules.OllamaEmbedder(fake.host, "embeddinggemma", 30)],
                                     rules.PREFIX_SCHEMES["embeddinggemma"], fake.dims, reuse=lambda keys: {},
                                     concurrency=2)
        try:
            first = embedding._queue([f"first text {i}" for i in range(40)], chunks=True)
            second = embedding._queue([f"second text {i}" for i in range(40)], chunks=True)
            first.result()
            busy = embedding.seconds_for(embedding.embedded)
            second.result()
        finally:
            embedding.close()
    assert busy is not None and busy >= 40 * 0.02 / 2  # the first round's texts, two at a time, at least


def test_a_groups_slowest_call_holds_back_neither_the_next_group_nor_its_copies(tmp_path: Path) -> None:
    """The next commit group's texts take the slots this group's answered calls left, while its
    slowest call is still out (each group used to wait for its slowest call before the next began),
    and a text of the next group that this group is still embedding (a copied file) is sent once."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    letters = "abcdefghijklmnop"  # one chunk each: the first group holds a-h (START_CHUNKS), the next i-p
    assert ingest.START_CHUNKS == 8
    for letter in letters:
        (corpus / f"{letter}.md").write_text(f"# Note {letter}\n\nThe passage of note {letter}: word{letter * 2}.\n")
    (corpus / "i.md").write_text((corpus / "a.md").read_text())  # a copy, in the next group
    with FakeOllama() as fake:
        fake.configure(slots=2, hold_carrying="wordaa")
        run: list[Any] = []
        thread = threading.Thread(target=lambda: run.append(
            ingest_in_process(fake, corpus, tmp_path / "store", RAG_EMBED_CONCURRENCY="2")))
        thread.start()
        try:
            deadline = time.monotonic() + 30
            while not any(fake.calls_carrying(f"word{letter * 2}") for letter in letters[9:]):
                assert time.monotonic() < deadline, "the next group waited for the first group's held call"
                time.sleep(0.02)
            assert fake.calls_carrying("wordaa") == 1
        finally:
            fake.configure(hold_carrying=None)
            thread.join(60)
        inputs = chunk_inputs(fake)
    done = run[0]
    assert done.code == 0, done.err
    assert sum("wordaa" in text for text in inputs) == 1
    assert done.summary["chunks_embedded"] == len(letters) - 1 and done.summary["chunks_reused"] == 1


@pytest.mark.heavy  # a measurement: calls long enough that a loaded machine's overhead does not hide the gain
def test_unset_concurrency_is_raised_on_a_host_with_slots_to_spare(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    write_handbooks(corpus, {f"book{i}.md": 40 for i in range(4)}, "A")
    with FakeOllama() as fake:
        fake.configure(slots=8, delay_per_text_seconds=0.05)
        done = ingest_in_process(fake, corpus, tmp_path / "store")
        assert done.code == 0, done.err
        assert fake.calls()["most_embeds_in_flight"] >= 2
    assert done.summary["embedders"][0]["level"] >= 2


# ---------------------------------------------------------------------------
# Several hosts.


def test_two_hosts_share_the_work_and_no_text_is_embedded_twice(fakes: tuple[FakeOllama, FakeOllama],
                                                               tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    write_handbooks(corpus, {f"book{i}.md": 30 for i in range(4)}, "A")
    for fake in fakes:
        fake.configure(delay_per_text_seconds=0.01)
    done = ingest_in_process(Hosts(fakes), corpus, tmp_path / "store", RAG_EMBED_CONCURRENCY="2")
    assert done.code == 0, done.err
    first, second = (chunk_inputs(fake) for fake in fakes)
    assert first and second, "both hosts embedded"
    assert not set(first) & set(second)
    assert len(first) + len(second) == done.summary["chunks_embedded"] == done.summary["chunks_written"]
    assert [host["host"] for host in done.summary["embedders"]] == [fake.host for fake in fakes]


def test_a_host_serving_other_weights_is_left_out_by_name_and_the_run_goes_on(
        fakes: tuple[FakeOllama, FakeOllama], tmp_path: Path) -> None:
    """Issue 42 D3: a host whose vectors are another model's (here re-pulled weights) is named,
    with why, and the others embed everything."""
    corpus = copy_sample(tmp_path)
    fakes[1].configure(weights="re-pulled")
    done = ingest_in_process(Hosts(fakes), corpus, tmp_path / "store")
    assert done.code == 0, done.err
    assert f"Ollama at {fakes[1].host} embeds with another model than Ollama at {fakes[0].host}" in done.err
    assert "that host is left out of this run" in done.err and "ollama pull embeddinggemma" in done.err
    assert not chunk_inputs(fakes[1], "embedded_inputs")
    assert len(chunk_inputs(fakes[0])) == done.summary["chunks_embedded"] > 0


def test_a_host_down_at_the_start_is_left_out(fakes: tuple[FakeOllama, FakeOllama], tmp_path: Path) -> None:
    corpus = copy_sample(tmp_path)
    fakes[1].stop()
    hosts = Hosts(fakes)
    done = ingest_in_process(hosts, corpus, tmp_path / "store")
    assert done.code == 0, done.err
    assert f"cannot reach Ollama at {hosts.fakes[1].host}" in done.err and "left out of this run" in done.err
    assert done.summary["chunks_embedded"] == done.summary["chunks_written"] == len(chunk_inputs(fakes[0]))


def test_a_host_that_fails_mid_run_hands_its_texts_to_the_other(fakes: tuple[FakeOllama, FakeOllama],
                                                               tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    tokens = write_handbooks(corpus, {f"book{i}.md": 30 for i in range(4)}, "A")
    for fake in fakes:
        fake.configure(delay_per_text_seconds=0.01)
    # The second host breaks once it has seen its first text of book1 (whatever the call sizes).
    fakes[1].configure(fail_after_carrying=tokens["book0.md"])
    done = ingest_in_process(Hosts(fakes), corpus, tmp_path / "store", RAG_EMBED_CONCURRENCY="2")
    assert done.code == 0, done.err
    assert (done.summary["failed"], done.summary["left_for_next_run"]) == (0, 0)
    left = [host for host in done.summary["embedders"] if host["left_rotation"]]
    assert [host["host"] for host in left] == [fakes[1].host], done.summary["embedders"]
    assert "its texts go to the other hosts" in done.err
    answered = chunk_inputs(fakes[0]) + chunk_inputs(fakes[1])
    assert len(answered) == len(set(answered)) == done.summary["chunks_written"]


def test_a_stalled_host_leaves_the_rotation_and_the_run_finishes(fakes: tuple[FakeOllama, FakeOllama],
                                                                tmp_path: Path) -> None:
    corpus = copy_sample(tmp_path)
    fakes[1].configure(hold=True)  # accepts calls and never answers them
    try:
        done = ingest_in_process(Hosts(fakes), corpus, tmp_path / "store", RAG_EMBED_TIMEOUT="2")
    finally:
        fakes[1].configure(hold=False)
    assert done.code == 0, done.err
    assert f"Ollama at {fakes[1].host} did not answer within 2 s" in done.err
    assert done.summary["chunks_written"] == len(chunk_inputs(fakes[0])) == done.summary["chunks_embedded"]


def test_every_host_down_at_the_start_is_each_said(fakes: tuple[FakeOllama, FakeOllama], tmp_path: Path) -> None:
    corpus = copy_sample(tmp_path)
    hosts = Hosts(fakes)
    for fake in fakes:
        fake.stop()
    done = ingest_in_process(hosts, corpus, tmp_path / "store")
    assert done.code == 1, done.err  # indexed for keyword search, as with one Ollama down
    assert done.summary["chunks_without_vectors"] == done.summary["vectors_pending"] > 0
    assert all(f"cannot reach Ollama at {fake.host}" in done.err for fake in fakes), done.err


def test_every_host_gone_is_the_embedder_gone(fakes: tuple[FakeOllama, FakeOllama], tmp_path: Path) -> None:
    """With no host left, a run does what it does when its one Ollama goes away: what was
    committed stays, new files are indexed for keyword search, and it says so."""
    corpus = tmp_path / "corpus"
    tokens = write_handbooks(corpus, {f"book{i}.md": 30 for i in range(4)}, "A")
    for fake in fakes:
        fake.configure(fail_after_carrying=tokens["book2.md"])
    done = ingest_in_process(Hosts(fakes), corpus, tmp_path / "store", RAG_EMBED_CONCURRENCY="1")
    assert done.code in (0, 1), done.err
    assert done.summary["chunks_without_vectors"] > 0
    counted = collections.Counter(chunk_inputs(fakes[0]) + chunk_inputs(fakes[1]))
    assert max(counted.values()) == 1


# ---------------------------------------------------------------------------
# The server's query vectors: the first host of OLLAMA_HOST that answers.


def searched_with(svc: Any, fakes: tuple[FakeOllama, ...], **args: Any) -> tuple[dict[str, Any], list[int]]:
    """A search's payload, and how many embed calls each fake answered for it."""
    before = [fake.calls()["embed_calls"] for fake in fakes]
    is_error, payload = dispatched(svc, "search_corpus", **args)
    assert not is_error, payload
    return payload, [fake.calls()["embed_calls"] - count for fake, count in zip(fakes, before, strict=True)]


def test_the_server_embeds_queries_with_the_first_host_that_answers(
        fakes: tuple[FakeOllama, FakeOllama], indexed_sample: tuple[Path, Path], tmp_path: Path) -> None:
    first, second = fakes
    built = sample_built(indexed_sample, tmp_path, Hosts(fakes).host)
    svc = in_process_service(built, RAG_EMBED_TIMEOUT="6")
    payload, calls = searched_with(svc, fakes, query="who gets paged for a sev-1", mode="vector")
    assert calls == [1, 0] and payload["results"], payload  # the first host, while it answers
    first.stop()
    payload, calls = searched_with(svc, fakes, query="rollback the database")
    assert calls == [0, 1] and payload["degraded"] is None and payload["results"][0]["score"] is not None, payload
    assert server.HealthProbe(svc)._probe_embedder() is None  # /health: a host serves the model
    first.restart()
    first.configure(hold=True)  # stalled: the second is asked beside it after its share of the time; it rests
    try:
        started = time.monotonic()
        payload, calls = searched_with(svc, fakes, query="restore from backup")
        assert calls[1] == 1 and payload["degraded"] is None, payload
        # asked after QUERY_HEDGE_S (2.5 s), not after the 6 s timeout (the CLI paid it on every call)
        assert time.monotonic() - started < 5, "the second host is asked after a share of the timeout, not all of it"
        payload, calls = searched_with(svc, fakes, query="escalation policy for outages")
        assert calls == [0, 1] and payload["degraded"] is None, payload
        second.stop()  # the first still resting (and stalled): no host to ask, each said
        payload = searched_with(svc, fakes, query="a question no host embeds")[0]
    finally:
        first.configure(hold=False)
    assert payload["degraded"] == "embedder_unavailable" and payload["results"], payload
    assert f"{first.host} did not answer" in payload["hint"] and f"reach Ollama at {second.host}" in payload["hint"]
    first.stop()
    health = server.HealthProbe(svc)._probe_embedder()
    assert health is not None and first.host in health.message and second.host in health.message, health


@pytest.mark.process
def test_a_host_answering_another_size_passes_the_query_to_the_next(
        fakes: tuple[FakeOllama, FakeOllama], indexed_sample: tuple[Path, Path], tmp_path: Path) -> None:
    """OLLAMA_HOST=<a host serving another model under the name>,<a good one>: the real CLI's
    searches use the second (its vectors, its scores); with the good one gone, hybrid answers
    from keywords and vector search says which host answered what."""
    first, second = fakes
    first.configure(wrong_dims=384)
    built = sample_built(indexed_sample, tmp_path, Hosts(fakes).host)
    env = {**os.environ, **built.server_env(Hosts(fakes).host)}
    env.pop("RAG_EMBED_MODEL", None)

    def search(*args: str) -> tuple[int, dict[str, Any], str]:
        done = subprocess.run([sys.executable, str(SERVER), "search", "--json", *args], env=env, capture_output=True,
                              text=True, timeout=120, stdin=subprocess.DEVNULL)
        return done.returncode, json.loads(done.stdout), done.stderr

    for mode in ("hybrid", "vector"):
        code, payload, err = search("--mode", mode, "who gets paged for a sev-1")
        assert code == 0 and payload["degraded"] is None and payload["results"][0]["score"] is not None, err
        assert f"Ollama at {first.host} returns 384-dimensional vectors" in err, err
    second.stop()
    code, payload, _ = search("who gets paged for a sev-1")
    assert code == 0 and payload["degraded"] == "index_incompatible" and payload["results"], payload
    assert payload["results"][0]["score"] is None and "384-dimensional" in payload["hint"], payload
    code, payload, _ = search("--mode", "vector", "who gets paged for a sev-1")
    assert code == 2 and payload["error"]["code"] == "index_incompatible", payload
    assert first.host in payload["error"]["message"] and second.host in payload["error"]["message"], payload


def test_a_later_host_serving_other_weights_is_not_asked_to_embed(
        fakes: tuple[FakeOllama, FakeOllama], indexed_sample: tuple[Path, Path], tmp_path: Path) -> None:
    """Its vectors could not be compared with the index's: hybrid answers from keywords, saying why."""
    first, second = fakes
    second.configure(weights="re-pulled")
    svc = in_process_service(sample_built(indexed_sample, tmp_path, Hosts(fakes).host))
    assert not dispatched(svc, "search_corpus", query="warm the index", mode="vector")[0]
    first.stop()
    payload, calls = searched_with(svc, fakes, query="rollback the database")
    assert calls == [0, 0] and payload["degraded"] == "embedder_unavailable", payload
    assert "other weights" in payload["hint"] and f"cannot reach Ollama at {first.host}" in payload["hint"], payload
