"""Contract tests for server.py: pure functions, argument validation, pre-filters, store handling.

Pure functions are tested directly (hypothesis where inputs vary). Everything touching a store
uses a real index built by the real `python ingest.py` from (a copy of) sample-corpus through the
loopback fake Ollama, and the server's service layer in-process; tests/test_server_e2e.py drives
the same through the real `python server.py` over stdio.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import unicodedata
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from budgets import examples
from fake_ollama import FakeOllama, fake_embedding
from helpers import (
    SAMPLE,
    Built,
    build,
    chunk_inputs,
    copy_sample,
    current_of,
    ingest_in_process,
    ingest_index,
    sample_built,
    tool_payload,
    without_echoed_identifier,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import corpus_rules as rules
import server
from corpus_rules import (
    COLLECTION_BY_LIFECYCLE,
    PREFIX_SCHEMES,
    ErrorCode,
    RagError,
    load_settings,
    path_matches_prefix,
)

# ---------------------------------------------------------------------------
# Fixtures: a real index built by the real ingest, a service over it.


@pytest.fixture(scope="module")
def base(fake: FakeOllama, indexed_sample: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Built:
    """Shared, never modified: tests that change the corpus or store use `fresh`."""
    return sample_built(indexed_sample, tmp_path_factory.mktemp("base"), fake.host)


@pytest.fixture
def fresh(fake: FakeOllama, sample_index: tuple[Path, Path]) -> Built:
    return Built(*sample_index, fake.host)


@pytest.fixture(scope="module")
def _swappable(fake: FakeOllama, indexed_sample: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Built:
    return sample_built(indexed_sample, tmp_path_factory.mktemp("swappable"), fake.host)


@pytest.fixture
def swappable(_swappable: Built) -> Iterator[Built]:
    """An index whose corpus a test may vandalise; the corpus is put back afterwards (the same
    folder, so the recorded real paths and the root's identity still hold). The store must not be
    changed."""
    yield _swappable
    for child in _swappable.corpus.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()
    shutil.copytree(SAMPLE, _swappable.corpus, dirs_exist_ok=True)


def service(built: Built, host: str | None = None, **env: str) -> server.RetrievalService:
    values = {"OLLAMA_HOST": host or built.host, "RAG_CORPUS_DIR": str(built.corpus),
              "RAG_STORE_DIR": str(built.store), **env}
    return server.RetrievalService(settings_loader=lambda: load_settings(values))


def call(svc: server.RetrievalService, tool: str, **args: Any) -> tuple[bool, dict[str, Any]]:
    is_error, payload = tool_payload(tool, server.mcp_result(server.dispatch(svc, tool, args)))
    if not is_error:
        server.TOOLS[tool].output_model.model_validate(payload)
    return is_error, payload


def error_code(svc: server.RetrievalService, tool: str, **args: Any) -> str:
    is_error, payload = call(svc, tool, **args)
    assert is_error, payload
    return payload["error"]["code"]


def query_vector(query: str, dims: int = 768) -> list[float]:
    return fake_embedding(PREFIX_SCHEMES["embeddinggemma"].query_text(query), dims)


# ---------------------------------------------------------------------------
# Fusion.

ids = st.lists(st.sampled_from([f"c{i}" for i in range(30)]), max_size=40)
weights = st.floats(min_value=0.05, max_value=1.0)


def two_channels(vector: list[str], keyword: list[str], keyword_weight: float = 1.0) -> list[server.RankedList]:
    return [server.RankedList("vector", 0, tuple(vector)), server.RankedList("keyword", 0, tuple(keyword), keyword_weight)]


@given(ids, ids, weights, ids, weights)
def test_fuse_rankings_is_weighted_reciprocal_rank_fusion_over_the_union(
        vector: list[str], keyword: list[str], keyword_weight: float, extra: list[str], extra_weight: float) -> None:
    lists = [*two_channels(vector, keyword, keyword_weight), server.RankedList("vector", 1, tuple(extra), extra_weight)]
    fused = server.fuse_rankings(lists, k_rrf=60)
    got = dict(fused)
    assert len(got) == len(fused) == len(set(vector) | set(keyword) | set(extra))
    for item, value in fused:
        expected = sum(weight / (60 + ranking.index(item) + 1)
                       for ranking, weight in ((list(dict.fromkeys(vector)), 1.0),
                                               (list(dict.fromkeys(keyword)), keyword_weight),
                                               (list(dict.fromkeys(extra)), extra_weight)) if item in ranking)
        assert value == pytest.approx(expected)
    values = [v for _, v in fused]
    assert values == sorted(values, reverse=True)


def test_fuse_rankings_rewards_agreement() -> None:
    fused = server.fuse_rankings(two_channels(["a", "b", "c"], ["b", "a", "d"]))
    assert [i for i, _ in fused][:2] in (["a", "b"], ["b", "a"])
    assert fused[-1][0] in ("c", "d")


def test_a_weak_keyword_channel_cannot_push_the_vector_channels_pick_down() -> None:
    """Cross-language: the keyword channel matched an incidental English word of a Japanese
    question. At full weight its picks outrank the vector channel's second; weighed by its
    evidence they do not."""
    vector = ["near-miss", "right-section", "v3"]
    keyword = ["wrong-a", "wrong-b", "wrong-c"]
    even = [i for i, _ in server.fuse_rankings(two_channels(vector, keyword))]
    assert even.index("wrong-a") < even.index("right-section")
    weighed = [i for i, _ in server.fuse_rankings(two_channels(vector, keyword, server.keyword_weight(0.05)))]
    assert weighed[:3] == vector


def test_term_weights_and_coverage() -> None:
    weights = server.term_weights(["ollama_keep_alive", "keep", "alive"], {"keep": 40, "alive": 30}, 100)
    assert weights["ollama_keep_alive"] > weights["alive"] > weights["keep"] > 0
    assert server.coverage(weights, {"keep", "alive"}) < 0.5 < server.coverage(weights, {"ollama_keep_alive"})
    assert server.coverage(weights, set()) == 0.0 and server.coverage({}, {"x"}) == 0.0
    everything = {"ollama_keep_alive", "keep", "alive"}
    assert server.coverage(weights, everything) == pytest.approx(1.0)
    assert server.coverage(weights, everything, {"ollama_keep_alive"}) == server.coverage(weights, {"ollama_keep_alive"})
    assert server.coverage(weights, everything, frozenset()) == 0.0
    assert server.keyword_weight(0.001) == server.KEYWORD_WEIGHT_FLOOR and server.keyword_weight(3.0) == 1.0
    assert server.keyword_weight(0.0) == 0.0, "a channel with no evidence weighs nothing, not the floor"


def test_shared_terms_are_what_a_passage_in_another_language_can_hold_for_a_reason() -> None:
    assert server.shared_terms("How do I make a Vite plugin apply only during production builds?") == frozenset()
    assert server.shared_terms("uv でベータ版や RC などのプレリリース版も候補に入れるには？") == {"uv", "rc"}
    named = server.shared_terms("What should `base` be for GitHub Pages, and is UV_INDEX_URL read?")
    assert {"base", "github", "uv_index_url"} <= named and "pages" not in named
    english = "Which example does the Japanese guide call 設定例 for the log shipper configuration?"
    assert server.shared_terms(english) == {"設定", "定例"}


@given(st.lists(st.sampled_from(["make", "apply", "only", "vite", "uv", "rc", "server.fs.allow", "v-model", "本番",
                                 "ビルド", "設定を", "OLLAMA_KEEP_ALIVE", "--frozen", "E4091"]), max_size=12))
def test_shared_terms_are_query_terms(words: list[str]) -> None:
    query = " ".join(words)
    shared = server.shared_terms(query)
    assert shared <= set(rules.query_terms(query))
    identifiers = {rules.identifier_term(i) for i in rules.query_identifiers(query)} - {None}
    assert identifiers <= shared


def test_a_keyword_channel_without_evidence_leaves_the_vector_ranking_alone() -> None:
    """RRF is flat over ranks: even at the floor weight, passages the keyword channel ranks deep
    (its incidental matches) and the vector channel ranks 5th outrank the vector channel's first.
    At the weight of no evidence they do not."""
    vector = [f"v{i}" for i in range(50)]
    keyword = [f"k{i}" for i in range(10)] + vector[4:40]
    at_floor = [i for i, _ in server.fuse_rankings(two_channels(vector, keyword, server.KEYWORD_WEIGHT_FLOOR))]
    assert at_floor.index("v4") < at_floor.index("v0")
    unweighed = [i for i, _ in server.fuse_rankings(two_channels(vector, keyword, server.keyword_weight(0.0)))]
    assert unweighed[:50] == vector


def test_a_passage_is_in_its_documents_language() -> None:
    """A code block of a Japanese document reads as English on its own; it is Japanese."""
    code = rules.cjk_share("```js\nexport default defineConfig({ plugins: [legacy()] })\n```")
    japanese, english = "本番ビルドだけでプラグインを使うには？", "How do I use a plugin in production builds only?"
    assert code == 0.0
    assert server.same_language(japanese, 0.37, code) and not server.same_language(english, 0.37, code)
    assert server.same_language(english, 0.0, 0.8), "an English document's Japanese quote stays English"
    # A store written before ingest measured documents: the passage stands for itself.
    assert server.same_language(english, None, code) and not server.same_language(japanese, None, code)


@given(st.text(max_size=80), st.floats(min_value=0.0, max_value=1.0), st.floats(min_value=0.0, max_value=1.0),
       st.floats(min_value=0.0, max_value=1.0))
def test_the_document_decides_a_passages_language(query: str, document: float, passage: float, other: float) -> None:
    assert server.same_language(query, document, passage) == server.same_language(query, document, other)
    assert server.same_language(query, None, passage) == server.same_language(query, passage, other)


@given(ranked=st.lists(st.sampled_from([f"d{d}-c-{i:05d}" for d in range(6) for i in range(3)]), unique=True,
                       min_size=1, max_size=12),
       waiting=st.sets(st.sampled_from([f"d{d}" for d in range(6)])), weight=st.floats(0.1, 1.0))
def test_a_passage_whose_vector_waits_counts_as_a_vector_hit_at_its_keyword_rank(
        ranked: list[str], waiting: set[str], weight: float) -> None:
    keyword = server.RankedList("keyword", 0, tuple(ranked), 0.5)
    stand_ins = server.stand_ins(keyword, waiting, weight)
    held = [item for item in ranked if item.split("-")[0] in waiting]
    assert (stand_ins is None) == (not held)
    if stand_ins is None:
        return
    assert list(stand_ins.positions()) == [(ranked.index(item) + 1, item) for item in held]
    assert stand_ins.channel == "keyword", "a hit that only stands in was matched by keywords alone"
    # Nothing embedded: hybrid search is keyword search.
    if len(held) == len(ranked):
        assert [i for i, _ in server.fuse_rankings([keyword, stand_ins])] == ranked
    # Dropped (min_score) passages leave the others at their own ranks.
    dropped = stand_ins.without({held[0]})
    assert list(dropped.positions()) == list(stand_ins.positions())[1:]


CALIBRATION = rules.Calibration(unrelated=0.01, related=0.03, queries=20, chunks=100)


def evidence(**fields: Any) -> server.Evidence:
    base: dict[str, Any] = {"similarity": 0.88, "margin": 0.03, "calibration": CALIBRATION, "coverage": 0.7}
    return server.Evidence(**{**base, **fields})


def test_confidence_levels_follow_the_evidence() -> None:
    assert server.judge_confidence(evidence()).level == "high"
    assert server.judge_confidence(evidence(margin=0.015, coverage=0.3)).level == "medium"
    assert server.judge_confidence(evidence(margin=0.0, coverage=0.1)).level == "low"
    # Without a calibration the margin means nothing on its own; term evidence still counts.
    assert server.judge_confidence(evidence(calibration=None, coverage=0.9)).level == "high"
    absent = server.judge_confidence(evidence(identifiers=("UV_NO_TELEMETRY",), missing=("UV_NO_TELEMETRY",)))
    assert absent.level == "low" and "UV_NO_TELEMETRY" in absent.reason
    # Holding the identifiers whole is said, and weighs through the terms' share only: an
    # unanswerable question naming a real identifier (`uv.lock`) is not made high by it.
    whole = server.judge_confidence(evidence(margin=0.0, coverage=0.1, identifiers=("E4091",), exact=("E4091",)))
    assert whole.level == "low" and "contains E4091" in whole.reason
    assert whole.score == server.judge_confidence(evidence(margin=0.0, coverage=0.1)).score
    # An extra phrasing's missing guess scales the value by the factor and no more.
    guess = server.judge_confidence(evidence(identifiers=(), missing=("UV_NATIVE_TLS",)))
    assert guess.score == round(server.judge_confidence(evidence()).score * server.CONFIDENCE_MISSING_FACTOR, 4)
    assert "UV_NATIVE_TLS" in guess.reason and guess.level != "low"
    partly = server.judge_confidence(evidence(identifiers=("E4091", "E9999"), exact=("E4091",), missing=("E9999",),
                                   margin=0.015, coverage=0.3))
    assert partly.level == "low" and "E9999" in partly.reason


@given(margin=st.floats(-1.0, 1.0), coverage=st.none() | st.floats(0.0, 1.0),
       unrelated=st.floats(-0.5, 0.5), span=st.floats(0.0, 0.5), calibrated=st.booleans(),
       missing=st.sampled_from([(), ("X_Y",), ("A_B", "X_Y")]), own=st.sampled_from([(), ("X_Y",)]))
def test_the_confidence_score_is_bounded_and_the_level_is_read_from_it(
        margin: float, coverage: float | None, unrelated: float, span: float, calibrated: bool,
        missing: tuple[str, ...], own: tuple[str, ...]) -> None:
    """In every state (a calibrated vector margin or none; terms or none; identifiers missing or
    not) the score is in [0, 1] and the level is the score's band."""
    calibration = rules.Calibration(unrelated, unrelated + span, 20, 100) if calibrated else None
    judged = server.judge_confidence(evidence(margin=margin, coverage=coverage, calibration=calibration,
                                   identifiers=own, missing=missing))
    assert 0.0 <= judged.score <= 1.0
    assert judged.level == ("high" if judged.score >= server.CONFIDENCE_HIGH else
                            "medium" if judged.score >= server.CONFIDENCE_MEDIUM else "low")


def test_a_keyword_only_passage_can_be_low_and_high() -> None:
    """Without a vector the terms alone decide, on the levels a passage with one is read on."""
    assert server.judge_confidence(evidence(margin=None, coverage=0.15)).level == "low"
    assert server.judge_confidence(evidence(margin=None, coverage=0.9)).level == "high"


def test_the_confidence_score_orders_within_a_level_and_the_levels_follow_it() -> None:
    """The score is the value the level is read from: within one level a stronger passage scores
    higher, and every level's scores sit above the next lower level's."""
    ladder = [server.judge_confidence(evidence(margin=m, coverage=c))
              for m, c in ((0.0, 0.0), (0.0, 0.1), (0.01, 0.2), (0.015, 0.3), (0.02, 0.5), (0.03, 0.7), (0.05, 1.0))]
    assert all(0.0 <= j.score <= 1.0 for j in ladder)
    scores = [j.score for j in ladder]
    assert scores == sorted(scores) and len(set(scores)) == len(scores), scores
    order = ["low", "medium", "high"]
    assert [order.index(j.level) for j in ladder] == sorted(order.index(j.level) for j in ladder)
    assert {j.level for j in ladder} == set(order)
    for j in ladder:
        assert (j.score >= server.CONFIDENCE_HIGH) == (j.level == "high")
        assert (j.score < server.CONFIDENCE_MEDIUM) == (j.level == "low")
    absent = server.judge_confidence(evidence(identifiers=("UV_NO_TELEMETRY",), missing=("UV_NO_TELEMETRY",)))
    assert absent.score < min(j.score for j in ladder if j.level != "low")


def test_a_passage_stands_out_by_its_own_similarity_to_each_phrasing() -> None:
    """Two phrasings at different levels of similarity to the whole corpus: the passage's
    similarity to the higher one measured against the lower one's crowd stands out by the gap
    between the levels, whatever the passage."""
    question = {"hit": 0.862, **{f"q{i}": 0.860 - 0.001 * i for i in range(30)}}
    terse = {"hit": 0.802, **{f"t{i}": 0.800 - 0.001 * i for i in range(30)}}
    mixed = rules.margin(list(terse.values()), max(question["hit"], terse["hit"]))
    assert mixed is not None and mixed > 0.06
    stands_out = server.best_margin({0: question, 1: terse}, "hit")
    assert stands_out == pytest.approx(max(rules.margin(list(question.values())), rules.margin(list(terse.values()))))
    assert stands_out is not None and stands_out < 0.02
    # A passage only one phrasing found is, for the other, at most as similar as its last candidate.
    assert server.best_margin({0: question, 1: terse}, "q0") == pytest.approx(
        rules.margin(list(question.values()), question["q0"]))
    assert server.best_margin({0: {"a": 0.9, "b": 0.8}}, "a") is None and server.best_margin({}, "a") is None


similarity_maps = st.dictionaries(st.sampled_from([f"c{i}" for i in range(25)]),
                                  st.floats(min_value=-1.0, max_value=1.0), min_size=3)


@given(st.lists(similarity_maps, min_size=1, max_size=5), st.sampled_from([f"c{i}" for i in range(25)]))
def test_no_passage_stands_out_more_than_a_phrasings_own_best(maps: list[dict[str, float]], item: str) -> None:
    by_phrasing = dict(enumerate(maps))
    own_best = max(m for found in maps if (m := rules.margin(list(found.values()))) is not None)
    got = server.best_margin(by_phrasing, item)
    assert got is not None and got <= own_best + 1e-12
    for found in maps:
        if item in found:
            assert got >= rules.margin(list(found.values()), found[item]) - 1e-12


# ---------------------------------------------------------------------------
# Response capping and line slicing.

hit_texts = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=4000)


@settings(max_examples=examples(200), suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(hit_texts, max_size=20), st.integers(min_value=3000, max_value=30000))
def test_fit_hits_keeps_the_response_under_budget(texts: list[str], budget: int) -> None:
    payload = {"query": "q", "results": [{"path": f"p{i}.md", "text": t, "truncated": False} for i, t in enumerate(texts)]}
    fitted = server.fit_hits(payload, budget=budget, per_hit=2000)
    assert server.json_len(fitted) <= budget
    for hit, original in zip(fitted["results"], texts, strict=True):
        assert original.startswith(hit["text"])
        assert len(hit["text"]) <= 2000
        assert hit["truncated"] == (hit["text"] != original)
    assert payload["results"][0:1] == [] or payload["results"][0]["text"] == texts[0], "input left untouched"


def test_hits_whose_fields_alone_do_not_fit_are_dropped_from_the_end() -> None:
    """Step 2 of fit_hits, where it used to fail: the hits' texts were paired with one original
    text per hit given, and a dropped hit left one over (a ValueError instead of a response)."""
    hits = [{"path": letter * 300, "text": letter * 100, "truncated": False} for letter in "abc"]
    fitted = server.fit_hits({"query": "q", "results": hits}, budget=500)
    assert [hit["path"][0] for hit in fitted["results"]] == ["a"]
    assert server.json_len(fitted) <= 500


@given(st.one_of(st.text(), st.lists(st.text(max_size=20), max_size=5), st.dictionaries(st.text(max_size=5), st.integers())))
def test_json_len_is_the_length_of_the_compact_json_written(value: object) -> None:
    """fit_hits' measure, with its string shortcut: what json.dumps writes, escapes included."""
    assert server.json_len(value) == len(json.dumps(value, ensure_ascii=False, separators=(",", ":")))


def test_fit_hits_shrinks_the_longest_texts_first() -> None:
    payload = {"results": [{"text": "short", "truncated": False}, {"text": "x" * 2000, "truncated": False}]}
    fitted = server.fit_hits(payload, budget=1000)
    assert fitted["results"][0] == {"text": "short", "truncated": False}
    assert fitted["results"][1]["truncated"] is True


# The most one character costs in compact JSON (\\uXXXX): shares can differ by this much.
JSON_CHAR_MAX = 6


@settings(max_examples=examples(200), suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(hit_texts, st.integers(min_value=0, max_value=40_000)), min_size=1, max_size=20),
       st.integers(min_value=15_000, max_value=30_000))
def test_fit_hits_spends_the_budget_per_hit(hits: list[tuple[str, int]], budget: int) -> None:
    """One hit's oversized title never costs the others their place or their text: titles are
    capped, every hit keeps its place, and the texts cut are cut to equal shares."""
    payload = {"query": "q", "results": [{"path": f"p{i}.md", "title": "T" * title, "heading": "H", "text": text,
                                          "truncated": False} for i, (text, title) in enumerate(hits)]}
    fitted = server.fit_hits(payload, budget=budget, per_hit=2000)
    assert server.json_len(fitted) <= budget
    assert len(fitted["results"]) == len(hits), "the capped fields of 20 hits fit"
    costs = [server.json_len(hit["text"]) - 2 for hit in fitted["results"]]
    cut = [cost for cost, hit in zip(costs, fitted["results"], strict=True) if hit["truncated"]]
    for cost, hit in zip(costs, fitted["results"], strict=True):
        assert len(hit["title"]) <= rules.METADATA_MAX_CHARS
        if cut and not hit["truncated"]:
            assert cost <= max(cut) + JSON_CHAR_MAX, "a whole text is never longer than a cut one's share"
    if cut:
        assert max(cut) - min(cut) <= JSON_CHAR_MAX or min(cut) == min(2000, min(costs)), "equal shares"


file_lines = st.lists(st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",),
                                                     exclude_characters="\n\r"), max_size=400), min_size=1, max_size=80)


@st.composite
def hits_with_contexts(draw: st.DrawFn) -> tuple[list[dict[str, Any]], list[server.HitContext | None]]:
    """Hits of one file's lines, each a passage inside a context (a run of the file's lines)."""
    lines = draw(file_lines)
    hits, contexts = [], []
    for n in range(draw(st.integers(1, 8))):
        lo = draw(st.integers(1, len(lines)))
        hi = draw(st.integers(lo, len(lines)))
        first = draw(st.integers(lo, hi))
        last = draw(st.integers(first, hi))
        hits.append({"path": f"p{n}.md", "text": "\n".join(lines[first - 1:last]), "truncated": False,
                     "start_line": first, "end_line": last, "context": "passage", "text_start_line": first,
                     "text_end_line": last})
        members = tuple((a, draw(st.integers(a, hi))) for a in draw(st.lists(st.integers(lo, hi), max_size=3)))
        contexts.append(draw(st.none() | st.just(server.HitContext(
            draw(st.sampled_from(["section", "neighbours"])), tuple(lines[lo - 1:hi]), lo, (first, last), members))))
    return hits, contexts


@settings(max_examples=examples(200), suppress_health_check=[HealthCheck.too_slow])
@given(hits_with_contexts(), st.integers(min_value=2000, max_value=30_000))
def test_a_context_stays_in_its_file_holds_its_passage_and_the_budget(
        drawn: tuple[list[dict[str, Any]], list[server.HitContext | None]], budget: int) -> None:
    hits, contexts = drawn
    fitted = server.fit_hits({"query": "q", "results": hits}, budget=budget, per_hit=2000, contexts=contexts)
    assert server.json_len(fitted) <= budget
    grown = 0
    for hit, context, original in zip(fitted["results"], contexts, hits, strict=False):
        if hit["context"] == "passage":
            assert original["text"].startswith(hit["text"])
            continue
        grown += 1
        assert context is not None and hit["context"] == context.kind
        lo, hi = hit["text_start_line"], hit["text_end_line"]
        assert context.start_line <= lo <= hit["start_line"] <= hit["end_line"] <= hi, "the passage inside"
        assert hi < context.start_line + len(context.lines), "never a line outside the context (or the file)"
        assert hit["text"] == "\n".join(context.lines[lo - context.start_line:hi - context.start_line + 1]), \
            "whole lines, as in the file"
        assert hit["truncated"] == ((lo, hi) != (context.start_line, context.start_line + len(context.lines) - 1))
    if all(c is None for c in contexts):
        assert grown == 0


@settings(max_examples=examples(200), suppress_health_check=[HealthCheck.too_slow])
@given(hits_with_contexts(), st.integers(min_value=0, max_value=12))
def test_a_context_that_barely_fits_keeps_the_budget_whatever_its_fields_add(
        drawn: tuple[list[dict[str, Any]], list[server.HitContext | None]], slack: int) -> None:
    """Budgets a few characters under what the contexts take whole: where a window's lines just
    fit, `truncated` turning false, "neighbours" for "passage" or a line number's extra digit
    must not carry the response over (the dev set met one such response: 20,001 of 20,000)."""
    hits, contexts = drawn
    whole = server.json_len(server.fit_hits({"query": "q", "results": [dict(h) for h in hits]}, budget=10**7,
                                            per_hit=2000, contexts=contexts))
    budget = whole - slack
    fitted = server.fit_hits({"query": "q", "results": [dict(h) for h in hits]}, budget=budget, per_hit=2000,
                             contexts=contexts)
    assert server.json_len(fitted) <= budget


def test_a_long_sections_window_takes_in_its_other_matched_passages_first() -> None:
    """A section too long for the room left: the window holds the hit's passage and the section's
    other matched passage (more_passages) rather than only the lines around the passage."""
    lines = tuple(f"line {n:03d} " + "x" * 60 for n in range(1, 201))
    passage, member = (150, 155), (20, 24)
    hit = {"path": "a.md", "text": "\n".join(lines[149:155]), "truncated": False, "start_line": 150,
           "end_line": 155, "context": "passage", "text_start_line": 150, "text_end_line": 155}
    budget = 12_000  # far less than the section's 200 lines, more than lines 20-155
    with_members = server.fit_hits({"query": "q", "results": [dict(hit)]}, budget=budget, contexts=[
        server.HitContext("section", lines, 1, passage, (member,))])["results"][0]
    alone = server.fit_hits({"query": "q", "results": [dict(hit)]}, budget=budget, contexts=[
        server.HitContext("section", lines, 1, passage)])["results"][0]
    assert with_members["text_start_line"] <= 20 and with_members["text_end_line"] >= 155
    assert with_members["truncated"] and alone["text_start_line"] > 20


@settings(max_examples=examples(200))
@given(st.lists(st.tuples(st.integers(1, 4), st.sampled_from("ABC")), min_size=1, max_size=20), st.data())
def test_a_section_runs_from_its_heading_to_the_next_of_its_level_or_higher(
        outline: list[tuple[int, str]], data: st.DataObject) -> None:
    headings = [rules.Heading(line=3 * n + 1, level=level, text=text) for n, (level, text) in enumerate(outline)]
    at = data.draw(st.integers(0, len(headings) - 1))
    start = headings[at].line + data.draw(st.integers(0, 2))
    row = rules.ChunkRow(id="c", path="p.md", chunk_index=0, start_line=start, end_line=start,
                         heading="Doc > " + headings[at].text, lifecycle="active", text="x", title="T")
    found = rules.section_lines(headings, row)
    assert found is not None
    first, last = found
    opening = next(h for h in headings if h.line == first)
    assert opening.text == headings[at].text and opening.line <= row.end_line
    assert not any(h.text == opening.text and opening.line < h.line <= row.end_line for h in headings), "the nearest"
    assert all(h.level > opening.level for h in headings if first < h.line <= last), "no heading of its level inside"
    following = [h for h in headings if h.line == last + 1]
    assert last == sys.maxsize or (following and following[0].level <= opening.level)


def test_a_section_context_puts_an_answer_far_below_its_heading_in_hand(fake: FakeOllama, tmp_path: Path) -> None:
    """The passage found opens a long section; the answer is passages further down it. With
    context="section" it comes back in the same hit, with the lines it spans; neighbours too
    when it is in the next passage; passage (the default) stays as it was."""
    source = tmp_path / "source"
    source.mkdir()
    filler = [f"Paragraph {n} says how the archive tier stores its {n}th batch of segments in cold storage "
              f"and compacts them overnight, which nobody needs to tune." for n in range(24)]
    body = "\n\n".join([*filler[:12], "The audit log retention window is exactly 400 days.", *filler[12:]])
    (source / "guide.md").write_text("# Operations guide\n\n## Audit log retention\n\nHow long audit logs are "
                                     f"kept, and where.\n\n{body}\n\n## Backups\n\nNightly.\n", encoding="utf-8")
    built = build(tmp_path / "built", fake.host, source)
    svc = service(built)
    found = {}
    for context in ("passage", "section", "neighbours"):
        is_error, payload = call(svc, "search_corpus", query="how long are audit logs kept", k=3, mode="keyword",
                                 context=context)
        assert not is_error and payload["results"], payload
        found[context] = payload["results"][0]
        if context == "section":  # one hit per section: its other passages are listed, not repeated
            assert len({(hit["path"], hit["heading"]) for hit in payload["results"]}) == len(payload["results"])
            assert all(found[context]["text_start_line"] <= first <= last <= found[context]["text_end_line"]
                       for first, last in found[context]["more_passages"])
    passage, section = found["passage"], found["section"]
    assert passage["heading"] == "Operations guide > Audit log retention" and passage["context"] == "passage"
    assert "400 days" not in passage["text"], "the answer is in another passage of the section"
    assert section["context"] == "section" and "400 days" in section["text"] and not section["truncated"]
    lines = (source / "guide.md").read_text(encoding="utf-8").splitlines()
    # from its heading (the passage holding it also holds the empty title section above it)
    assert "## Audit log retention" in section["text"].splitlines()[:3]
    assert section["text_end_line"] < lines.index("## Backups") + 1, "to the next heading of the same level"
    assert section["text"] == "\n".join(lines[section["text_start_line"] - 1:section["text_end_line"]])
    assert (section["start_line"], section["end_line"]) == (passage["start_line"], passage["end_line"])
    neighbours = found["neighbours"]
    assert neighbours["context"] == "neighbours" and neighbours["text_end_line"] > passage["end_line"]
    # A store written before chunks recorded their sections (NULL): the server works the section out
    # from the file, to the same lines; the next ingest reads the file again (embedding nothing) and
    # records them as a fresh index holds them.
    keyword_db = built.store / current_of(built.store)["index"] / rules.KEYWORD_DB
    recorded = "SELECT id, section_start, section_end FROM chunks ORDER BY id"
    con = sqlite3.connect(keyword_db, isolation_level=None)
    try:
        fresh = con.execute(recorded).fetchall()
        assert fresh and all(start is not None and end is not None for _, start, end in fresh)
        con.execute("UPDATE chunks SET section_start = NULL, section_end = NULL")
        con.execute("UPDATE documents SET sections_recorded = NULL")
    finally:
        con.close()
    for run in ("before", "after"):
        is_error, payload = call(service(built), "search_corpus", query="how long are audit logs kept", k=3,
                                 mode="keyword", context="section")
        assert not is_error and payload["results"][0] == section, run
        if run == "before":
            embedded = chunk_inputs(fake)
            done = ingest_in_process(fake, built.corpus, built.store)
            assert done.code == 0 and chunk_inputs(fake) == embedded, done.err
    con = sqlite3.connect(keyword_db)
    try:
        assert con.execute(recorded).fetchall() == fresh
    finally:
        con.close()


@given(st.frozensets(st.sampled_from([f"w{n}" for n in range(40)])), st.frozensets(st.sampled_from([f"w{n}" for n in range(40)])))
def test_near_duplicate_is_jaccard_of_the_shingles_at_the_threshold(a: frozenset[str], b: frozenset[str]) -> None:
    jaccard = len(a & b) / len(a | b) if a and b else 0.0
    assert server.near_duplicate(a, b) == (bool(a and b) and len(a & b) >= server.DUPLICATE_SIMILARITY * len(a | b))
    assert server.near_duplicate(a, b) == server.near_duplicate(b, a)
    if jaccard >= 0.81:
        assert server.near_duplicate(a, b)


@settings(max_examples=examples(200))
@given(st.lists(st.tuples(st.sampled_from(["a.md", "b.md", "c.md"]), st.sampled_from(["A", "A > B", "C"])),
                min_size=1, max_size=30), st.integers(1, 20))
def test_one_hit_per_section_keeps_every_passage_and_the_first_k_of_k_plus_one(
        keys: list[tuple[str, str]], k: int) -> None:
    rows = {f"c{n}": rules.ChunkRow(id=f"c{n}", path=path, chunk_index=n, start_line=n + 1, end_line=n + 1,
                                    heading=heading, lifecycle="active", text="x", title="T")
            for n, (path, heading) in enumerate(keys)}
    ranked = [(f"c{n}", 1.0 / (n + 1)) for n in range(len(keys))]
    groups = [(g.item, g.value, g.members) for g in server.group_hits(ranked, rows, k, by_section=True)]
    more = [(g.item, g.value) for g in server.group_hits(ranked, rows, k + 1, by_section=True)]
    assert [g[:2] for g in groups] == more[:k], "the first k whatever k"
    assert len(groups) == min(k, len(set(keys)))
    sections = [(rows[leader].path, rows[leader].heading) for leader, _, _ in groups]
    assert len(set(sections)) == len(sections), "a section once"
    order = [item for item, _ in ranked]
    for leader, _, members in groups:
        key = (rows[leader].path, rows[leader].heading)
        assert all((rows[m].path, rows[m].heading) == key and order.index(m) > order.index(leader) for m in members)
    if len(groups) == len(set(keys)):
        assert sum(1 + len(g[2]) for g in groups) == len(keys), "every passage of every section listed"


@pytest.mark.parametrize("context", ["passage", "section"])
def test_five_versions_of_a_section_take_one_place(fake: FakeOllama, tmp_path: Path, context: str) -> None:
    """A docs site keeping every released version of its specification: the section once, the
    other versions in its also_in, the other places for other answers."""
    source = tmp_path / "source"
    page = ("# Transports\n\n## Session resumption\n\nA client that lost its connection resumes the session by "
            "sending the Last-Event-ID header with the id of the last event it received; the server replays "
            "the events after it on the new stream, in order, and then continues with new events.{}\n")
    for n in range(1, 6):
        (source / f"v{n}").mkdir(parents=True)
        (source / f"v{n}" / "transports.md").write_text(page.format(" Since version 1." if n > 3 else ""))
    (source / "guide.md").write_text("# Guide\n\n## Reconnecting\n\nWhen a connection drops, resume the session "
                                     "with the last event id so that no event is lost.\n")
    built = build(tmp_path, fake.host, source)
    is_error, payload = call(service(built), "search_corpus", query="resume a session after the connection dropped",
                             context=context, k=5)
    assert not is_error
    paths = [hit["path"] for hit in payload["results"]]
    assert "guide.md" in paths
    versions = [hit for hit in payload["results"] if hit["path"].startswith("v")]
    assert len(versions) == 1
    assert sorted([versions[0]["path"], *versions[0]["also_in"]]) == [f"v{n}/transports.md" for n in range(1, 6)]


COPIES = [" ".join(f"w{(seed * 7 + n) % 97}" for n in range(40)) for seed in range(4)]


@settings(max_examples=examples(200))
@given(st.lists(st.tuples(st.sampled_from(["v1/a.md", "v2/a.md", "v3/a.md", "b.md"]), st.integers(0, 3),
                          st.booleans()), min_size=1, max_size=30), st.integers(1, 10), st.booleans())
def test_copies_of_a_passage_are_one_hit_listing_the_other_documents(
        found: list[tuple[str, int, bool]], k: int, by_section: bool) -> None:
    """Versioned pages: the same passage (or nearly: a word changed) in several documents is the
    best-ranked one's hit, the others in its also_in; the first k whatever k; nothing is lost."""
    rows = {}
    for n, (path, text, edited) in enumerate(found):
        words = COPIES[text].split()
        if edited:
            words[5] = "changed"
        rows[f"c{n}"] = rules.ChunkRow(id=f"c{n}", path=path, chunk_index=n, start_line=n + 1, end_line=n + 1,
                                       heading=f"H{n}", lifecycle="active", text=" ".join(words), title="T")
    ranked = [(f"c{n}", 1.0 / (n + 1)) for n in range(len(found))]
    groups = server.group_hits(ranked, rows, k, by_section)
    more = server.group_hits(ranked, rows, k + 1, by_section)
    assert [(g.item, g.value) for g in groups] == [(g.item, g.value) for g in more[:k]], "the first k whatever k"
    for group in groups:
        assert rows[group.item].path not in group.also_in
    held = {text for g in groups for text in [found[int(g.item[1:])][1]]}
    listed = {rows[g.item].path for g in groups} | {p for g in groups for p in g.also_in}
    for path, text, _ in found:
        if text in held:
            assert path in listed, "a copy is a hit or in a hit's also_in"
    # Two hits never hold the same text from different documents.
    texts = [(found[int(g.item[1:])][1], rows[g.item].path) for g in groups]
    assert all(a[0] != b[0] or a[1] == b[1] for a, b in itertools.combinations(texts, 2))


@settings(max_examples=examples(200))
@given(st.lists(st.integers(0, 500), min_size=1, max_size=60), st.data())
def test_a_grown_window_is_the_widest_alternating_one_that_fits(costs: list[int], data: st.DataObject) -> None:
    first = data.draw(st.integers(0, len(costs) - 1))
    last = data.draw(st.integers(first, len(costs) - 1))
    room = data.draw(st.integers(0, sum(costs) + 2 * len(costs)))
    lo, hi = server.grown_window(costs, first, last, room)
    used = sum(costs[lo:hi + 1]) + 2 * (hi - lo)
    assert lo <= first <= last <= hi
    assert (lo, hi) == (first, last) or used <= room
    for line in (lo - 1, hi + 1):  # no neighbouring line would still have fitted
        if 0 <= line < len(costs) and used <= room:
            assert used + costs[line] + 2 > room


lines_strategy = st.lists(st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",),
                                                         exclude_characters="\n\r"), max_size=300), max_size=60)


@settings(max_examples=examples(200))
@given(lines_strategy, st.integers(min_value=50, max_value=2000))
def test_slice_lines_pages_reassemble_the_file(lines: list[str], cap: int) -> None:
    got: list[str] = []
    start: int | None = 1
    pages = 0
    while start is not None and lines:
        part = server.slice_lines(lines, start, None, max_chars=cap)
        assert len(part.text) <= cap
        assert part.start_line == start
        page = part.text.split("\n")
        expected = lines[part.start_line - 1:part.end_line]
        if part.cut_inside:
            assert page == [server.prefix_within(lines[start - 1], cap)]  # one enormous line, cut inside
        else:
            assert page == expected
            got.extend(page)
        start = part.next_start_line
        pages += 1
        assert pages <= len(lines) + 1
    if lines and all(server.json_len(line) - 2 <= cap for line in lines):  # the cap counts JSON's escapes
        assert got == lines


def test_slice_lines_ranges_and_errors() -> None:
    lines = [f"line {i}" for i in range(1, 11)]
    part = server.slice_lines(lines, 3, 5)
    assert (part.text, part.start_line, part.end_line, part.truncated, part.next_start_line) == (
        "line 3\nline 4\nline 5", 3, 5, False, None)
    assert server.slice_lines(lines, 8, 500).end_line == 10
    with pytest.raises(RagError) as err:
        server.slice_lines(lines, 11, None)
    assert err.value.code is ErrorCode.INVALID_ARGUMENT
    # An end before the start never reaches slicing: the tool's input model refuses it.
    with pytest.raises(ValueError, match="end_line 4 is before start_line 5"):
        server.GetFileInput(path="x.md", start_line=5, end_line=4)
    capped = server.slice_lines(lines, 1, None, max_chars=19)
    assert capped.truncated and capped.text == "line 1\nline 2" and capped.next_start_line == 3


def test_split_lines_numbers_lines_like_ingest() -> None:
    text = "a\r\nb\n\nc"
    assert rules.split_lines(text) == ["a", "b", "", "c"]


segments = st.sampled_from(["a", "ab", "a-b", "b", "runbooks", "runbooks-old", "x.md", "日本"])
rel_paths = st.lists(segments, min_size=1, max_size=4).map("/".join)


@settings(max_examples=examples(200))
@given(st.lists(rel_paths, max_size=20), st.one_of(st.just(""), rel_paths))
def test_prefix_sql_is_path_matches_prefix(paths: list[str], prefix: str) -> None:
    db = sqlite3.connect(":memory:")
    db.execute("CREATE TABLE t(path TEXT)")
    db.executemany("INSERT INTO t VALUES (?)", [(p,) for p in paths])
    where, params = server.prefix_sql("path", prefix or None)
    got = sorted(r[0] for r in db.execute(f"SELECT path FROM t WHERE {where}", params))
    assert got == sorted(p for p in paths if path_matches_prefix(p, prefix))


# ---------------------------------------------------------------------------
# Argument validation at the boundary (no store needed: arguments are checked first).


@pytest.fixture
def no_store(tmp_path: Path) -> tuple[server.RetrievalService, Path]:
    store = tmp_path / "no-such-store"
    built = Built(SAMPLE, store, "http://127.0.0.1:9")
    return service(built), store


@pytest.mark.parametrize(("tool", "args", "code"), [
    ("search_corpus", {}, "invalid_argument"),
    ("search_corpus", {"query": ""}, "invalid_argument"),
    ("search_corpus", {"query": "   \n\t"}, "invalid_argument"),
    ("search_corpus", {"query": "x" * 2001}, "invalid_argument"),
    ("search_corpus", {"query": "a\x00b"}, "invalid_argument"),
    ("search_corpus", {"query": "bad \ud800 surrogate"}, "invalid_argument"),
    ("search_corpus", {"query": 4.2}, "invalid_argument"),
    ("search_corpus", {"query": True}, "invalid_argument"),
    ("search_corpus", {"query": ["rollback"]}, "invalid_argument"),
    ("search_corpus", {"query": "q", "k": 0}, "invalid_argument"),
    ("search_corpus", {"query": "q", "k": 21}, "invalid_argument"),
    ("search_corpus", {"query": "q", "k": True}, "invalid_argument"),
    ("search_corpus", {"query": "q", "k": "five"}, "invalid_argument"),
    ("search_corpus", {"query": "q", "k": "2.5"}, "invalid_argument"),
    ("search_corpus", {"query": "q", "k": "\u0663"}, "invalid_argument"),  # Arabic-Indic 3: digits are ASCII
    ("get_file", {"path": "x.md", "start_line": "\uff13"}, "invalid_argument"),  # fullwidth 3
    ("search_corpus", {"query": "q", "min_score": "0.\u0665"}, "invalid_argument"),
    ("search_corpus", {"query": "q", "min_score": "nan"}, "invalid_argument"),
    ("get_file", {"path": "x.md", "start_line": "0"}, "invalid_argument"),
    ("search_corpus", {"query": "q", "k": 2.5}, "invalid_argument"),
    ("search_corpus", {"query": "q", "mode": "fuzzy"}, "invalid_argument"),
    ("search_corpus", {"query": "q", "min_score": 1.5}, "invalid_argument"),
    ("search_corpus", {"query": "q", "min_score": 0.5, "mode": "keyword"}, "invalid_argument"),
    ("search_corpus", {"query": "q", "include_superseded": "yes"}, "invalid_argument"),
    ("search_corpus", {"query": "q", "limit": 3}, "invalid_argument"),
    ("search_corpus", {"query": "q", "path_prefix": "../etc"}, "path_rejected"),
    ("search_corpus", {"query": "q", "path_prefix": "/etc"}, "path_rejected"),
    ("search_corpus", {"query": "q", "path_prefix": "a\\b"}, "path_rejected"),
    ("get_file", {}, "invalid_argument"),
    ("get_file", {"path": ""}, "invalid_argument"),
    ("get_file", {"path": "a/../../etc/passwd"}, "path_rejected"),
    ("get_file", {"path": "/etc/passwd"}, "path_rejected"),
    ("get_file", {"path": "~/x.md"}, "path_rejected"),
    ("get_file", {"path": "..\\x.md"}, "path_rejected"),
    ("get_file", {"path": "a\x00.md"}, "path_rejected"),
    ("get_file", {"path": "x.md", "start_line": 0}, "invalid_argument"),
    ("get_file", {"path": "x.md", "end_line": -3}, "invalid_argument"),
    ("get_file", {"path": "x.md", "extra": 1}, "invalid_argument"),
    ("list_documents", {"limit": 0}, "invalid_argument"),
    ("list_documents", {"limit": 501}, "invalid_argument"),
    ("list_documents", {"offset": -1}, "invalid_argument"),
    ("list_documents", {"path_prefix": "../x"}, "path_rejected"),
    ("no_such_tool", {}, "invalid_argument"),
])
def test_bad_arguments_get_structured_errors(no_store: tuple[server.RetrievalService, Path], tool: str,
                                             args: dict[str, Any], code: str) -> None:
    svc, store = no_store
    assert error_code(svc, tool, **args) == code
    assert not store.exists()


def test_arguments_are_normalised() -> None:
    nfd = unicodedata.normalize("NFD", "résumé café")
    parsed = server.SearchCorpusInput(query=f"  {nfd}  ", path_prefix="./runbooks/")
    assert parsed.query == "résumé café" and parsed.path_prefix == "runbooks"
    assert server.SearchCorpusInput(query="q", path_prefix="  ").path_prefix is None
    assert server.GetFileInput(path=unicodedata.normalize("NFD", "ja/é.md")).path == "ja/é.md"


def test_tool_schemas_are_typed_and_closed() -> None:
    tools = {t.name: t for t in server.tool_definitions()}
    assert set(tools) == {"search_corpus", "get_file", "list_documents"}
    for tool in tools.values():
        assert tool.input_schema["additionalProperties"] is False
        assert tool.output_schema and tool.output_schema["type"] == "object"
        ann = tool.annotations
        assert (ann.read_only_hint, ann.idempotent_hint, ann.open_world_hint, ann.destructive_hint) == (
            True, True, False, False)
    search = tools["search_corpus"].input_schema["properties"]
    assert (search["k"]["minimum"], search["k"]["maximum"]) == (1, 20)
    assert search["mode"]["enum"] == ["hybrid", "vector", "keyword"]
    assert len(server.INSTRUCTIONS) > 512 and "search_corpus" in server.INSTRUCTIONS[:512]
    assert "get_file" in server.INSTRUCTIONS[:512]


def test_the_instructions_fit_2048_bytes_whatever_the_index_holds() -> None:
    """Clients cut a server's instructions at 2 KB: the longest facts (a code index, a watching
    server, every count at its widest) still fit."""
    facts = ("This index: 9999999 documents (9999999 in Japanese/CJK, 9999999 in other languages (mostly English)); "
             "9999999 superseded, in 9999999 top-level folders (list_documents names them); 99999999 passages, "
             "built 2026-12-07T15:02:51.123456+00:00 from commit 0123456789ab. " + server.CODE_NOTE)
    assert len(server.instructions_with([], facts, watching=True).encode()) <= 2048


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | st.floats(allow_nan=True)
    | st.text(max_size=50),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3),
    max_leaves=6)
arg_keys = st.sampled_from(["query", "k", "path_prefix", "include_superseded", "min_score", "mode", "path",
                            "start_line", "end_line", "offset", "limit", "bogus"])
weird_text = st.text(alphabet=st.characters(), max_size=60) | st.sampled_from(
    ["", " ", "../x", "/abs", "a\\b", "a\x00b", "\ud800", "%2e%2e/x", "~", "runbooks", "x" * 3000])


@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(["search_corpus", "get_file", "list_documents"]),
       st.dictionaries(arg_keys, json_values | weird_text, max_size=5))
def test_any_arguments_get_a_structured_answer(no_store: tuple[server.RetrievalService, Path], tool: str,
                                               args: dict[str, Any]) -> None:
    svc, store = no_store
    is_error, payload = call(svc, tool, **args)
    assert is_error, "no store: nothing can succeed"
    assert payload["error"]["code"] in {"invalid_argument", "path_rejected", "index_missing"}
    assert not store.exists()


# ---------------------------------------------------------------------------
# The store: never created, every missing piece reported.


def test_missing_store_is_reported_and_never_created(no_store: tuple[server.RetrievalService, Path]) -> None:
    svc, store = no_store
    for mode in ("hybrid", "vector", "keyword"):
        assert error_code(svc, "search_corpus", query="who gets paged", mode=mode) == "index_missing"
    assert error_code(svc, "get_file", path="oncall/escalation.md") == "index_missing"
    assert error_code(svc, "list_documents") == "index_missing"
    _, payload = call(svc, "list_documents")
    assert str(store) in payload["error"]["message"] and rules.INGEST_COMMAND in payload["error"]["hint"]
    assert not store.exists()


def _drop_collection(built: Built) -> None:
    # A separate process, so this test's Chroma system cache is not involved.
    code = ("import sys, chromadb; c = chromadb.PersistentClient(path=sys.argv[1]); "
            "c.delete_collection(sys.argv[2])")
    subprocess.run([sys.executable, "-c", code, str(built.index_dir / "chroma"), COLLECTION_BY_LIFECYCLE["active"]],
                   check=True, env={**os.environ, "ANONYMIZED_TELEMETRY": "False"}, capture_output=True)


@pytest.mark.parametrize("missing", ["CURRENT.json", "index folder", "keywords.sqlite3", "chroma.sqlite3",
                                     "collection"])
def test_each_missing_piece_is_index_missing_and_stays_missing(base: Built, tmp_path: Path, missing: str) -> None:
    copy = Built(base.corpus, tmp_path / "store", base.host)
    shutil.copytree(base.store, copy.store)
    index_dir = copy.index_dir
    gone = {"CURRENT.json": copy.store / "CURRENT.json", "index folder": index_dir,
            "keywords.sqlite3": index_dir / "keywords.sqlite3", "chroma.sqlite3": index_dir / "chroma" / "chroma.sqlite3",
            "collection": None}[missing]
    if gone is None:
        _drop_collection(copy)
    elif gone.is_dir():
        shutil.rmtree(gone)
    else:
        gone.unlink()
    svc = service(copy)
    assert error_code(svc, "search_corpus", query="who gets paged for a sev-1") == "index_missing"
    assert error_code(svc, "search_corpus", query="who gets paged", mode="vector") == "index_missing"
    if missing in ("chroma.sqlite3", "collection"):
        # The keyword channel and the documents table do not need the vectors.
        assert not call(svc, "search_corpus", query="sev-1", mode="keyword")[0]
        assert not call(svc, "list_documents")[0]
    else:
        assert error_code(svc, "list_documents") == "index_missing"
        assert error_code(svc, "get_file", path="oncall/escalation.md") == "index_missing"
    if gone is not None:
        assert not gone.exists(), "the server must not recreate what is missing"


def test_unreadable_current_json_and_corrupt_keyword_db(base: Built, tmp_path: Path) -> None:
    copy = Built(base.corpus, tmp_path / "store", base.host)
    shutil.copytree(base.store, copy.store)
    keywords = copy.index_dir / "keywords.sqlite3"
    keywords.write_bytes(b"this is not a database" * 100)
    is_error, payload = call(service(copy), "list_documents")
    assert is_error and payload["error"]["code"] == "internal"
    assert "ingest.py" in payload["error"]["hint"]
    (copy.store / "CURRENT.json").write_text("{not json", encoding="utf-8")
    assert error_code(service(copy), "search_corpus", query="q") == "index_incompatible"


# ---------------------------------------------------------------------------
# Model, dimensions, embedder faults.


def test_configured_model_must_match_the_index(base: Built) -> None:
    svc = service(base, RAG_EMBED_MODEL="nomic-embed-text")
    is_error, payload = call(svc, "search_corpus", query="who gets paged for a sev-1")
    assert is_error and payload["error"]["code"] == "index_incompatible"
    assert "RAG_EMBED_MODEL" in payload["error"]["hint"]
    # The same name spelled with its tag is the same model; keyword mode needs no model at all.
    assert not call(service(base, RAG_EMBED_MODEL="embeddinggemma:latest"), "search_corpus", query="sev-1")[0]
    assert not call(svc, "search_corpus", query="sev-1", mode="keyword")[0]


def test_vectors_of_another_dimension_are_index_incompatible(base: Built) -> None:
    """Vector search cannot compare them; hybrid answers from keywords and says why."""
    with FakeOllama(dims=768) as other:
        other.configure(wrong_dims=384)
        svc = service(base, host=other.host)
        is_error, payload = call(svc, "search_corpus", query="who gets paged for a sev-1", mode="vector")
        assert is_error and payload["error"]["code"] == "index_incompatible"
        assert "384" in payload["error"]["message"] and "768" in payload["error"]["message"]
        assert other.host in payload["error"]["message"] and "OLLAMA_HOST" in payload["error"]["hint"]
        is_error, payload = call(svc, "search_corpus", query="who gets paged for a sev-1")
        assert not is_error and payload["degraded"] == "index_incompatible" and payload["results"], payload
        assert payload["results"][0]["path"] == "oncall/escalation.md"


def test_embedder_faults_degrade_hybrid_and_fail_vector_mode(base: Built) -> None:
    other = FakeOllama().start()
    svc = service(base, host=other.host)
    try:
        other.configure(missing_models=["embeddinggemma"])
        is_error, payload = call(svc, "search_corpus", query="who gets paged for a sev-1", mode="vector")
        assert is_error and payload["error"]["code"] == "model_not_found"
        assert "ollama pull embeddinggemma" in payload["error"]["hint"]
        is_error, payload = call(svc, "search_corpus", query="who gets paged for a sev-1")
        assert not is_error and payload["degraded"] == "model_not_found"
        assert "ollama pull embeddinggemma" in payload["hint"]
        assert payload["results"][0]["path"] == "oncall/escalation.md"
    finally:
        other.stop()
    is_error, payload = call(svc, "search_corpus", query="rollback steps", mode="vector")
    assert is_error and payload["error"]["code"] == "embedder_unavailable"
    assert other.host in payload["error"]["message"]
    # Hybrid (the default) answers from the keyword channel and says so.
    is_error, payload = call(svc, "search_corpus", query="rollback steps", min_score=0.2)
    assert not is_error and payload["degraded"] == "embedder_unavailable" and payload["results"]
    assert "start Ollama" in payload["hint"] and "min_score was not applied" in payload["hint"]
    assert all(hit["matched"] == ["keyword"] and hit["score"] is None for hit in payload["results"])
    assert payload["results"][0]["path"] == "runbooks/deploy.md"
    is_error, payload = call(svc, "search_corpus", query="rollback steps", mode="keyword")
    assert not is_error and payload["results"] and payload["degraded"] is None
    # Healthy again: no degradation.
    is_error, payload = call(service(base), "search_corpus", query="rollback steps")
    assert not is_error and payload["degraded"] is None and payload["hint"] is None


def test_explain_says_how_each_hit_was_ranked_and_changes_nothing_else(base: Built) -> None:
    """explain adds a trace per hit (votes that sum to rank_score with the bonus, the lists that
    match `matched` and `phrasings`) and leaves the ranking as it was without it (the traces take
    their room in the response budget: the texts may be shorter)."""
    svc = service(base)
    asked = {"query": "how do I roll back a deploy with KEEP_ALIVE", "queries": ["rollback steps"], "k": 4}
    is_error, plain = call(svc, "search_corpus", **asked)
    assert not is_error and plain["results"] and all("explain" not in hit for hit in plain["results"])
    is_error, explained = call(svc, "search_corpus", **asked, explain=True)
    assert not is_error
    ranked = ("path", "start_line", "end_line", "score", "rank_score", "matched", "phrasings", "exact_matches")
    assert [[hit[key] for key in ranked] for hit in explained["results"]] == [[hit[key] for key in ranked]
                                                                             for hit in plain["results"]]
    for hit in explained["results"]:
        trace = hit["explain"]
        assert trace["fused"] + trace["identifier_bonus"] == pytest.approx(hit["rank_score"], abs=1e-5)
        assert {vote["channel"] for vote in trace["votes"]} == set(hit["matched"])
        assert sorted({vote["phrasing"] for vote in trace["votes"]}) == hit["phrasings"]
    is_error, keyword = call(svc, "search_corpus", **asked, mode="keyword", explain=True)
    assert not is_error and all(vote["channel"] == "keyword" and trace["identifier_bonus"] == 0
                                for trace in (hit["explain"] for hit in keyword["results"]) for vote in trace["votes"])


def test_an_index_built_without_ollama_answers_from_keywords_and_says_so(tmp_path: Path) -> None:
    """#28 §2: ingest without Ollama publishes keywords; search answers from them at once (no
    embedding call, though Ollama is up again), says so, and vector mode says why it cannot."""
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    with FakeOllama() as ollama:
        ollama.stop()
        assert ingest_in_process(ollama, corpus, store).code == 1
        ollama.restart()
        svc = service(Built(corpus, store, ollama.host))
        is_error, payload = call(svc, "search_corpus", query="rollback steps", min_score=0.2)
        assert not is_error and payload["degraded"] == "vectors_pending", payload
        chunks = payload["index"]["chunks"]
        assert payload["index"]["vectors_pending"] == chunks > 0
        assert f"none of the index's {chunks} passages has a vector yet" in payload["hint"]
        assert "ollama pull embeddinggemma" in payload["hint"] and "min_score was not applied" in payload["hint"]
        assert payload["results"][0]["path"] == "runbooks/deploy.md"
        assert all(hit["matched"] == ["keyword"] and hit["score"] is None for hit in payload["results"])
        assert "has a vector yet" in server.search_view(payload)  # the CLI says it too
        is_error, payload = call(svc, "search_corpus", query="rollback steps", mode="vector")
        assert is_error and payload["error"]["code"] == "vectors_pending"
        assert "embeds only the waiting passages" in payload["error"]["hint"]
        is_error, payload = call(svc, "search_corpus", query="rollback steps", mode="keyword")
        assert not is_error and payload["degraded"] is None and payload["results"]
        assert ollama.embed_calls == 0
        is_error, listing = call(svc, "list_documents")
        assert not is_error and listing["index"]["vectors_pending"] == chunks
        assert f"{chunks} of {chunks} passages are found by keyword search only" in server.documents_view(listing)
        status, health = server.HealthProbe(svc).answer()
        assert status == 200 and health["status"] == "degraded" and health["vectors_pending"] == chunks
        assert [p["code"] for p in health["problems"]] == ["vectors_pending"]


@pytest.mark.heavy  # about 1 s of CPU in ingest runs: in --all, to keep the fast tier's budget
def test_passages_waiting_for_vectors_are_found_by_keywords_and_counted(tmp_path: Path) -> None:
    """Files added while Ollama is away wait for vectors; the others keep theirs. Hybrid finds
    both and says how many wait; once embedded, nothing is said."""
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    with FakeOllama() as ollama:
        assert ingest_in_process(ollama, corpus, store).code == 0
        (corpus / "runbooks" / "zebra-crossing.md").write_text(
            "# Zebra crossing drill\n\nThe quarterly zebra crossing drill rehearses the ZEBRA-7 failover.\n")
        ollama.stop()
        down = ingest_in_process(ollama, corpus, store)
        assert down.code == 1 and "start Ollama" in down.err and f"--corpus {corpus} --store {store}" in down.err
        ollama.restart()
        svc = service(Built(corpus, store, ollama.host))
        is_error, payload = call(svc, "search_corpus", query="ZEBRA-7 failover drill")
        assert not is_error and payload["degraded"] == "vectors_pending", payload
        waiting = payload["index"]["vectors_pending"]
        assert 0 < waiting < payload["index"]["chunks"]
        assert payload["hint"].startswith(f"{waiting} of the index's {payload['index']['chunks']} passages have")
        # The query was embedded: Ollama answers, so the hint does not say to start it, and its command
        # names this corpus and store (typed as shown, it must not index the sample into the default store).
        assert "Ollama answers" in payload["hint"] and "start Ollama" not in payload["hint"]
        assert f"--corpus {corpus} --store {store}" in payload["hint"]
        assert payload["results"][0]["path"] == "runbooks/zebra-crossing.md"
        assert payload["results"][0]["matched"] == ["keyword"]
        assert any("vector" in hit["matched"] for hit in payload["results"])  # the others still have vectors
        is_error, payload = call(svc, "search_corpus", query="ZEBRA-7 failover drill", mode="keyword")
        assert not is_error and payload["degraded"] is None
        assert ingest_in_process(ollama, corpus, store).code == 0
        is_error, payload = call(svc, "search_corpus", query="ZEBRA-7 failover drill")
        assert not is_error and payload["degraded"] is None and payload["index"]["vectors_pending"] == 0
        assert "vector" in payload["results"][0]["matched"]


def test_repeated_queries_reuse_the_query_embedding(base: Built) -> None:
    with FakeOllama() as other:
        svc = service(base, host=other.host)
        for _ in range(3):
            assert not call(svc, "search_corpus", query="escalation timings for the secondary")[0]
        assert other.embed_calls == 1
        assert not call(svc, "search_corpus", query="a different question")[0]
        assert other.embed_calls == 2


# ---------------------------------------------------------------------------
# Pre-filters: lifecycle and path_prefix reach the store; nothing is dropped afterwards.


class RecordingCollection:
    """Wraps a real Chroma collection and records what reaches it."""

    def __init__(self, inner: Any, calls: list[tuple[str, str, dict[str, Any]]]) -> None:
        self._inner = inner
        self._calls = calls

    def query(self, **kwargs: Any) -> Any:
        self._calls.append(("query", self._inner.name, kwargs))
        return self._inner.query(**kwargs)

    def get(self, **kwargs: Any) -> Any:
        self._calls.append(("get", self._inner.name, kwargs))
        return self._inner.get(**kwargs)


def recorded(svc: server.RetrievalService) -> list[tuple[str, str, dict[str, Any]]]:
    calls: list[tuple[str, str, dict[str, Any]]] = []
    index = svc.manager.open()
    index.vectors.open(create=False)
    index.vectors._collections = {lc: RecordingCollection(col, calls) for lc, col in index.vectors._collections.items()}
    return calls


def test_default_search_ranks_the_active_collection_and_asks_the_superseded_one_only_for_its_note(base: Built) -> None:
    svc = service(base)
    calls = recorded(svc)
    is_error, payload = call(svc, "search_corpus", query="kubectl-deploy push --all-at-once", k=5)
    assert not is_error and len(payload["results"]) == 5
    queries = [(name, kw) for op, name, kw in calls if op == "query"]
    # the results: the active collection, unfiltered, asked first; the superseded one beside it, once,
    # to say whether one of its passages would have come first (the active answer serves both rankings)
    assert [name for name, _ in queries] == ["chunks_active", "chunks_superseded"]
    assert queries[0][1]["where"] is None
    assert {hit["lifecycle"] for hit in payload["results"]} == {"active"}
    calls.clear()
    assert not call(svc, "search_corpus", query="kubectl-deploy push --all-at-once", path_prefix="oncall/")[0]
    assert all(name == "chunks_active" for _, name, _ in calls), "no superseded document is under oncall/"


@pytest.mark.parametrize(("query", "note"), [("deploy preconditions announce in #deploys", True),
                                             ("how do I deploy a service", False)])
def test_a_confident_search_names_the_superseded_document_that_would_come_first(
        base: Built, query: str, note: bool) -> None:
    svc = service(base)
    _, payload = call(svc, "search_corpus", query=query, mode="keyword")
    _, wide = call(svc, "search_corpus", query=query, mode="keyword", include_superseded=True)
    assert payload["confidence"] == "high" and payload["results"][0]["lifecycle"] == "active"
    assert (wide["results"][0]["lifecycle"] == "superseded") is note
    expected = ("a passage of the superseded (outdated) document 'runbooks/deploy-2023.md' would come first: pass "
                "include_superseded=true to see it, replaced by 'runbooks/deploy.md'")
    assert payload["message"] == (expected if note else None)
    assert wide["message"] is None


def test_include_superseded_queries_both_collections(base: Built) -> None:
    svc = service(base)
    calls = recorded(svc)
    is_error, payload = call(svc, "search_corpus", query="kubectl-deploy push --all-at-once", include_superseded=True)
    assert not is_error
    assert sorted(name for op, name, _ in calls if op == "query") == ["chunks_active", "chunks_superseded"]
    assert payload["results"][0]["path"] == "runbooks/deploy-2023.md"
    assert payload["results"][0]["lifecycle"] == "superseded"


def test_superseded_hits_and_listing_name_their_successor(base: Built) -> None:
    svc = service(base)
    is_error, payload = call(svc, "search_corpus", query="kubectl-deploy push --all-at-once", include_superseded=True)
    assert not is_error
    by_lifecycle = {hit["lifecycle"]: hit for hit in payload["results"]}
    assert by_lifecycle["superseded"]["superseded_by"] == ["runbooks/deploy.md"]
    assert by_lifecycle["active"]["superseded_by"] == []
    _, listing = call(svc, "list_documents")
    named = {doc["path"]: doc["superseded_by"] for doc in listing["documents"]}
    assert named.pop("runbooks/deploy-2023.md") == ["runbooks/deploy.md"]
    assert set(map(tuple, named.values())) == {()}


def test_a_successor_that_is_not_indexed_is_never_named(fresh: Built, fake: FakeOllama) -> None:
    old = fresh.corpus / "runbooks/deploy-2023.md"
    old.write_text(old.read_text(encoding="utf-8").replace(
        "superseded_by: runbooks/deploy.md", "superseded_by: [private/offsite-backup.md, runbooks/deploy.md, gone.md]"),
        encoding="utf-8")
    assert ingest_in_process(fake, fresh.corpus, fresh.store).code == 0
    svc = service(fresh)
    _, listing = call(svc, "list_documents", path_prefix="runbooks")
    hits = call(svc, "search_corpus", query="kubectl-deploy push --all-at-once", include_superseded=True)[1]["results"]
    for named in ([d["superseded_by"] for d in listing["documents"]] + [h["superseded_by"] for h in hits]):
        assert named in ([], ["runbooks/deploy.md"])
    _, hidden = call(svc, "search_corpus", query="kubectl-deploy push --all-at-once")
    assert "replaced by 'runbooks/deploy.md'" in hidden["message"] and "offsite" not in hidden["message"]
    assert "gone.md" not in json.dumps([listing, hits, hidden])


def test_a_store_from_before_successors_is_served_without_them(fresh: Built) -> None:
    con = sqlite3.connect(fresh.index_dir / rules.KEYWORD_DB)
    with con:
        con.execute("ALTER TABLE documents DROP COLUMN superseded_by")
        con.execute("PRAGMA user_version = 0")  # an older ingest recorded no schema version
    con.close()
    svc = service(fresh)
    assert not call(svc, "get_file", path="runbooks/deploy-2023.md")[0]
    _, listing = call(svc, "list_documents")
    assert listing["documents"] and all(doc["superseded_by"] == [] for doc in listing["documents"])
    _, payload = call(svc, "search_corpus", query="kubectl-deploy push --all-at-once", include_superseded=True)
    assert payload["results"][0]["lifecycle"] == "superseded" and payload["results"][0]["superseded_by"] == []


# Commands only the superseded runbook holds, each a low-confidence search of the active documents.
@pytest.mark.parametrize(("mode", "query"), [("hybrid", "kubectl-deploy push --all-at-once"),
                                             ("vector", "kubectl-deploy push --all-at-once"),
                                             ("keyword", "kubectl-deploy revert")])
def test_a_thin_search_says_passages_of_superseded_documents_are_hidden_and_what_replaces_them(
        base: Built, mode: str, query: str) -> None:
    svc = service(base)
    _, payload = call(svc, "search_corpus", query=query, mode=mode)
    assert payload["confidence"] == "low" and {h["lifecycle"] for h in payload["results"]} == {"active"}
    # how many are hidden, or, when one of them would come first, which document it is
    assert ("superseded (outdated) documents match the query's words and are hidden: pass include_superseded=true"
            in payload["message"] or "superseded (outdated) document 'runbooks/deploy-2023.md' would come first: "
            "pass include_superseded=true" in payload["message"]), payload["message"]
    assert payload["message"].endswith("replaced by 'runbooks/deploy.md'"), payload["message"]
    _, shown = call(svc, "search_corpus", query=query, mode=mode, include_superseded=True)
    assert "hidden" not in (shown["message"] or "")
    _, confident = call(svc, "search_corpus", query="who gets paged for a sev-1", mode=mode)
    assert confident["confidence"] != "low" and confident["message"] is None


def test_a_thin_search_says_which_case_it_is(base: Built) -> None:
    svc = service(base)
    _, off_topic = call(svc, "search_corpus", query="how long should sourdough bread proof overnight")
    assert off_topic["message"] == "no passage matches closely (confidence low): the documents may not cover this"
    _, absent = call(svc, "search_corpus", query="OLLAMA_KEEP_ALIVE")
    assert absent["message"].endswith("; no indexed passage contains OLLAMA_KEEP_ALIVE")
    _, nothing = call(svc, "search_corpus", query="qqqzzzxxy", mode="keyword")
    assert nothing["message"] == "no matching passages"
    _, typo = call(svc, "search_corpus", query="rollback", path_prefix="runbook/deploy.md")
    assert typo["message"].startswith("no indexed document under path_prefix 'runbook/deploy.md'; nearest indexed "
                                      "folders: 'runbooks', ")
    _, old = call(svc, "search_corpus", query="rollback", path_prefix="runbooks/deploy-2023.md")
    assert "pass include_superseded=true, replaced by 'runbooks/deploy.md')" in old["message"]
    _, listed = call(svc, "list_documents", path_prefix="oncal")
    assert listed["message"].startswith("no indexed document under path_prefix 'oncal'; nearest indexed folders: "
                                        "'oncall'")


def test_a_thin_search_says_files_changed_since_ingest(swappable: Built) -> None:
    page = swappable.corpus / "oncall/escalation.md"
    page.write_text(page.read_text(encoding="utf-8") + "\nA line added after ingest.\n", encoding="utf-8")
    _, payload = call(service(swappable), "search_corpus", query="how long should sourdough bread proof overnight")
    assert payload["staleness"]["changed_files"] == 1
    assert payload["message"].endswith("; " + payload["staleness"]["hint"])
    assert "1 indexed file(s) changed on disk since the last ingest" in payload["message"]


def _thin(**fields: Any) -> server.ThinEvidence:
    return server.ThinEvidence(**{"hits": 0, "low": False, **fields})


def test_thin_result_message_names_each_case() -> None:
    assert server.thin_result_message(_thin(hits=3)) is None
    assert server.thin_result_message(_thin(hits=3, missing=("X_Y",), hidden=2, stale="4 changed")) is None, \
        "a confident search needs no explanation: its fields say the rest"
    assert server.thin_result_message(_thin(dropped=2, min_score=0.9)) == \
        "nothing scored at least min_score=0.9; 2 hit(s) dropped"
    assert "too common" in server.thin_result_message(_thin(plan_kind="too_common"))
    assert "no searchable keywords" in server.thin_result_message(_thin(plan_kind="no_terms"))
    assert server.thin_result_message(_thin(empty="no indexed document under path_prefix 'x'")) == \
        "no indexed document under path_prefix 'x'"
    many = server.thin_result_message(_thin(hits=5, low=True, hidden=server.HIDDEN_COUNT_MAX + 1,
                                            successors=tuple(f"new/{i}.md" for i in range(7))))
    assert f"more than {server.HIDDEN_COUNT_MAX} passage(s) of superseded" in many
    assert many.endswith("replaced by 'new/0.md', 'new/1.md', 'new/2.md', 'new/3.md', 'new/4.md' and 2 more")


@settings(max_examples=examples(200), deadline=None)
@given(hits=st.integers(0, 20), low=st.booleans(), empty=st.none() | st.just("no indexed document under x"),
       dropped=st.integers(0, 5), plan_kind=st.sampled_from([None, "rare", "no_terms", "too_common"]),
       missing=st.lists(st.from_regex(r"[A-Z]{2,8}_[A-Z]{2,8}", fullmatch=True), max_size=3).map(tuple),
       hidden=st.integers(0, 40), successors=st.lists(st.from_regex(r"[a-z]{1,8}\.md", fullmatch=True),
                                                      max_size=8, unique=True).map(tuple),
       changed=st.integers(0, 3), ahead=st.none() | st.just("old/guide.md"))
def test_a_thin_search_always_says_why_and_a_confident_one_only_what_it_hides_first(
        hits: int, low: bool, empty: str | None, dropped: int, plan_kind: str | None, missing: tuple[str, ...],
        hidden: int, successors: tuple[str, ...], changed: int, ahead: str | None) -> None:
    evidence = server.ThinEvidence(hits=hits, low=low, empty=empty, dropped=dropped, min_score=0.5,
                                   plan_kind=plan_kind, missing=missing, hidden=hidden,
                                   successors=successors if hidden else (),
                                   stale=f"{changed} indexed file(s) changed on disk since the last ingest" if changed else None,
                                   ahead=ahead, ahead_successors=successors if ahead else ())
    message = server.thin_result_message(evidence)
    if hits and not low and not empty and not ahead:
        assert message is None
        return
    assert message
    assert ("'old/guide.md' would come first: pass include_superseded=true" in message) == bool(ahead)
    if hits and not low and not empty:
        return
    assert all(name in message for name in missing)
    assert ("include_superseded=true" in message) == bool(hidden or ahead)
    assert all(f"'{path}'" in message for path in successors[:server.SUCCESSORS_SHOWN] if hidden or ahead)
    assert ("since the last ingest" in message) == bool(changed)


@settings(max_examples=examples(200), deadline=None)
@given(prefix=st.from_regex(r"[a-z]{1,6}(/[a-z]{1,6}){0,2}", fullmatch=True),
       folders=st.lists(st.from_regex(r"[a-z]{1,6}(/[a-z]{1,6}){0,2}", fullmatch=True), max_size=12))
def test_nearest_folders_are_indexed_folders_the_deepest_ancestor_first(prefix: str, folders: list[str]) -> None:
    nearest = server.nearest_folders(prefix, folders)
    assert len(nearest) == len(set(nearest)) == min(server.NEAREST_FOLDERS, len(set(folders)))
    assert set(nearest) <= set(folders)
    parts = prefix.split("/")
    ancestors = [a for i in range(len(parts) - 1, 0, -1) if (a := "/".join(parts[:i])) in folders]
    if ancestors:
        assert nearest[0] == ancestors[0]


def test_path_prefix_is_a_where_clause_on_the_store(base: Built) -> None:
    svc = service(base)
    calls = recorded(svc)
    is_error, payload = call(svc, "search_corpus", query="who gets paged for a sev-1", path_prefix="runbooks",
                             include_superseded=True, k=10)
    assert not is_error and payload["results"]
    wheres = {name: kw["where"] for op, name, kw in calls if op == "query"}
    # The one superseded document is under the prefix: a prefix covering a whole collection
    # needs no where clause (the unfiltered fast path).
    assert wheres == {"chunks_active": {"path": {"$in": ["runbooks/deploy.md"]}}, "chunks_superseded": None}
    assert all(hit["path"].startswith("runbooks/") for hit in payload["results"])
    # No superseded document under the prefix: that collection is not queried at all.
    calls.clear()
    is_error, payload = call(svc, "search_corpus", query="kubectl-deploy push", path_prefix="oncall",
                             include_superseded=True)
    assert not is_error and all(hit["path"].startswith("oncall/") for hit in payload["results"])
    wheres = {name: kw["where"] for op, name, kw in calls if op == "query"}
    assert wheres == {"chunks_active": {"path": {"$in": ["oncall/escalation.md"]}}}
    # Segment-wise: 'run' is not a prefix of 'runbooks/...'.
    is_error, payload = call(svc, "search_corpus", query="rollback", path_prefix="run")
    assert not is_error and payload["results"] == [] and "list_documents" in payload["message"]


def test_prefix_holding_only_superseded_documents_says_so(base: Built) -> None:
    svc = service(base)
    is_error, payload = call(svc, "search_corpus", query="deploy", path_prefix="runbooks/deploy-2023.md")
    assert not is_error and payload["results"] == [] and "include_superseded" in payload["message"]


def test_keyword_channel_filters_in_sql_before_the_limit(base: Built) -> None:
    index = service(base).manager.open()
    query = "kubectl-deploy push --all-at-once"
    def ids(query: str, lifecycles: list[str], prefix: str | None, n: int) -> list[str]:
        return [item for item, _ in index.keyword_ranking(query, lifecycles, server.Within(prefix), n)[0]]

    assert ids(query, ["active", "superseded"], None, 1) == ids(
        query, ["superseded"], None, 1), "the superseded runbook is the best keyword match overall"
    (best_active,) = ids(query, ["active"], None, 1)
    assert index.chunks_by_id([best_active])[best_active].lifecycle == "active"
    in_oncall = ids("sev-1 rollback", ["active"], "oncall", 50)
    assert in_oncall and all(r.path.startswith("oncall/") for r in index.chunks_by_id(in_oncall).values())
    # A document filter's paths, inside the query as well.
    chosen = server.Within(None, ("oncall/escalation.md", "runbooks/deploy.md"))
    only = [item for item, _ in index.keyword_ranking("sev-1 rollback deploy", ["active"], chosen, 50)[0]]
    assert {r.path for r in index.chunks_by_id(only).values()} == set(chosen.paths)


def test_what_a_search_keeps_of_the_keyword_index_is_read_again_after_a_commit(fresh: Built) -> None:
    """Ingest commits into the live generation (keyword rows first, vectors after): term counts,
    documents' languages and rankings kept by the server follow each commit."""
    index = service(fresh).manager.open()
    assert index.passages_with(["zyzzyva"]) == {}
    assert index.keyword_ranking("zyzzyva", ["active"], server.Within(), 5)[0] == []
    db = sqlite3.connect(fresh.index_dir / rules.KEYWORD_DB)
    (rowid,) = db.execute("SELECT rowid FROM chunks WHERE lifecycle = 'active' LIMIT 1").fetchone()
    db.execute("UPDATE chunks_fts SET body = body || ' zyzzyva' WHERE rowid = ?", (rowid,))
    db.commit()
    db.close()
    assert index.passages_with(["zyzzyva"]) == {"zyzzyva": 1}
    assert len(index.keyword_ranking("zyzzyva", ["active"], server.Within(), 5)[0]) == 1


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(term=st.sampled_from(["deploy", "rollback", "push", "kubectl", "service", "the"]), n=st.integers(1, 60),
       order=st.permutations([("active",), ("active", "superseded"), ("superseded",)]))
def test_a_ranking_shared_with_the_superseded_check_is_the_one_asked_alone(
        base: Built, term: str, n: int, order: list[tuple[str, ...]]) -> None:
    # ranked_ids ranks active and superseded passages in one query where the index holds both and
    # keeps it for the search's superseded check: what it returns must be what each filter ranks alone
    index = service(base).manager.open()
    expression = rules.fts_any([term])
    for lifecycles in order:
        assert index.ranked_ids(expression, lifecycles, server.Within(), n) == list(
            index._ranked_rows(expression, lifecycles, server.Within(), n))


@pytest.mark.parametrize("mode", ["hybrid", "vector", "keyword"])
def test_superseded_text_never_takes_a_default_slot(base: Built, mode: str) -> None:
    svc = service(base)
    old = (base.corpus / "runbooks" / "deploy-2023.md").read_text(encoding="utf-8").splitlines()
    probes = [line for line in old if len(line) > 40][:6]
    for probe in probes:
        is_error, payload = call(svc, "search_corpus", query=probe[:300], k=5, mode=mode)
        assert not is_error
        assert all(hit["lifecycle"] == "active" for hit in payload["results"])
        if mode != "keyword":
            assert len(payload["results"]) == 5, "slots are filled from active documents"


def test_orphaned_vectors_never_cost_a_slot(fresh: Built) -> None:
    """Vectors whose chunk rows were never committed (an interrupted ingest) are skipped, and the
    server fetches past them, even when they crowd the whole first candidate page."""
    query = "who gets paged for a sev-1"
    vector = query_vector(query)
    code = ("import json, sys, chromadb; c = chromadb.PersistentClient(path=sys.argv[1]); "
            "col = c.get_collection('chunks_active'); v = json.loads(sys.stdin.read()); "
            "col.add(ids=[f'orphan-{i:03d}' for i in range(80)], embeddings=[v] * 80, "
            "metadatas=[{'path': 'oncall/escalation.md', 'lifecycle': 'active'}] * 80, documents=['orphan'] * 80)")
    subprocess.run([sys.executable, "-c", code, str(fresh.index_dir / "chroma")], input=json.dumps(vector),
                   text=True, check=True, env={**os.environ, "ANONYMIZED_TELEMETRY": "False"}, capture_output=True)
    for mode in ("vector", "hybrid"):
        is_error, payload = call(service(fresh), "search_corpus", query=query, k=5, mode=mode)
        assert not is_error and len(payload["results"]) == 5
        assert all(hit["text"] != "orphan" for hit in payload["results"])
        assert payload["results"][0]["heading"].endswith("Who gets paged for a sev-1")


def test_min_score_drops_before_taking_slots(base: Built) -> None:
    svc = service(base)
    _, plain = call(svc, "search_corpus", query="who gets paged for a sev-1", k=20)
    scores = sorted(hit["score"] for hit in plain["results"])
    floor = scores[len(scores) // 2]
    is_error, payload = call(svc, "search_corpus", query="who gets paged for a sev-1", k=20, min_score=floor)
    assert not is_error and payload["results"]
    assert all(hit["score"] >= floor for hit in payload["results"])
    assert payload["dropped_below_min_score"] > 0
    is_error, payload = call(svc, "search_corpus", query="who gets paged for a sev-1", min_score=1.0)
    assert not is_error and payload["results"] == [] and payload["dropped_below_min_score"] > 0
    assert "min_score" in payload["message"]


def test_scores_are_cosine_similarity_in_every_channel(base: Built, monkeypatch: pytest.MonkeyPatch) -> None:
    # Few candidates per channel, so hybrid has keyword-only hits whose score comes from the
    # stored embedding rather than from the vector query.
    monkeypatch.setattr(server, "CHANNEL_CANDIDATES", 3)
    svc = service(base)
    query = "E4091 conflict version"
    is_error, hybrid = call(svc, "search_corpus", query=query, k=10, include_superseded=True)
    assert not is_error
    assert any(hit["matched"] == ["keyword"] for hit in hybrid["results"])
    assert any("vector" in hit["matched"] for hit in hybrid["results"])
    index = svc.manager.open()
    wanted = query_vector(query)
    for hit in hybrid["results"]:
        (chunk_id,) = [r[0] for r in index.db.execute(
            "SELECT id FROM chunks WHERE path = ? AND start_line = ?", (hit["path"], hit["start_line"]))]
        found, matrix = index.embeddings(hit["lifecycle"], [chunk_id])
        assert found == [chunk_id]
        stored = [float(x) for x in matrix[0]]
        assert hit["score"] == pytest.approx(server.cosine_many(wanted, [stored])[0], abs=1e-5)
        assert hit["rank_score"] > 0
    _, keyword = call(svc, "search_corpus", query="NIMBUS_API_TOKEN", mode="keyword")
    assert keyword["results"] and all(h["score"] is None and h["matched"] == ["keyword"] for h in keyword["results"])


def test_response_stays_under_the_size_budget(base: Built) -> None:
    _, payload = call(service(base), "search_corpus", query="deploy rollout canary wave bake promote", k=20,
                      include_superseded=True)
    assert len(payload["results"]) == 20
    assert server.json_len(payload) <= server.SEARCH_RESPONSE_MAX_CHARS
    assert all(len(hit["text"]) <= server.HIT_TEXT_MAX_CHARS for hit in payload["results"])
    assert any(hit["truncated"] for hit in payload["results"])


def test_fts_syntax_in_a_query_is_text(base: Built) -> None:
    svc = service(base)
    for query in ['"unbalanced', "deploy*", "NEAR(deploy rollback", "-rollback", "title:deploy", "AND OR NOT",
                  "^deploy", "a:b:c", "{curly} [square] (paren)", "'single'", "\"\"\"\"", "*"]:
        for mode in ("hybrid", "keyword"):
            is_error, payload = call(svc, "search_corpus", query=query, mode=mode)
            assert not is_error, (query, payload)


def test_staleness_counts_changed_and_vanished_files(swappable: Built) -> None:
    fresh = swappable
    (fresh.corpus / "reference" / "glossary.md").write_text("changed\n", encoding="utf-8")
    (fresh.corpus / "ja" / "log-collection.md").unlink()
    _, payload = call(service(fresh), "list_documents")
    assert payload["staleness"]["changed_files"] == 2
    assert rules.INGEST_COMMAND in payload["staleness"]["hint"]
    _, clean = call(service(Built(SAMPLE, fresh.store, fresh.host)), "list_documents")
    assert clean["index"]["generation"] == 1 and clean["index"]["model"] == "embeddinggemma"


def test_new_generation_is_seen_without_a_new_service(fresh: Built) -> None:
    svc = service(fresh)
    query = "ZEBRA-QUOKKA-4411 failover drill"
    _, before = call(svc, "search_corpus", query=query, mode="keyword")
    assert all("drill" not in hit["path"] for hit in before["results"])
    (fresh.corpus / "oncall" / "drill.md").write_text(
        "# Failover drill\n\nThe ZEBRA-QUOKKA-4411 failover drill runs every quarter.\n", encoding="utf-8")
    done = ingest_index(fresh.corpus, fresh.store, fresh.host)
    assert done.returncode == 0, done.stderr
    for mode in ("hybrid", "vector", "keyword"):
        is_error, after = call(svc, "search_corpus", query=query, mode=mode)
        assert not is_error and after["results"][0]["path"] == "oncall/drill.md", mode
    assert after["index"]["generation"] == 2


# ---------------------------------------------------------------------------
# get_file and list_documents.


def test_get_file_returns_exact_lines_matching_search_hits(base: Built) -> None:
    svc = service(base)
    _, found = call(svc, "search_corpus", query="who gets paged for a sev-1")
    hit = found["results"][0]
    assert hit["path"] == "oncall/escalation.md" and hit["heading"].endswith("Who gets paged for a sev-1")
    is_error, payload = call(svc, "get_file", path=hit["path"], start_line=hit["start_line"], end_line=hit["end_line"])
    assert not is_error and payload["source"] == "disk" and payload["changed_since_ingest"] is False
    disk_lines = (base.corpus / hit["path"]).read_text(encoding="utf-8").split("\n")
    assert payload["text"] == "\n".join(disk_lines[hit["start_line"] - 1:hit["end_line"]])
    assert hit["text"].strip() in payload["text"]
    _, whole = call(svc, "get_file", path="oncall/escalation.md")
    assert whole["start_line"] == 1 and whole["end_line"] == whole["total_lines"] and not whole["truncated"]
    assert error_code(svc, "get_file", path="oncall/escalation.md", start_line=10_000) == "invalid_argument"
    assert error_code(svc, "get_file", path="oncall/escalation.md", start_line=9, end_line=3) == "invalid_argument"


def test_get_file_reads_only_indexed_paths(base: Built) -> None:
    svc = service(base)
    for path in ("private/offsite-backup.md", "oncall/nope.md", "ONCALL/escalation.md", "%2e%2e/etc/passwd",
                 "oncall", "README.md"):
        is_error, payload = call(svc, "get_file", path=path)
        assert is_error and payload["error"]["code"] == "not_indexed", path
        assert "list_documents" in payload["error"]["hint"]


@pytest.mark.parametrize("swap", ["file to /etc/passwd", "file to another corpus file", "folder to outside",
                                  "folder to another corpus folder", "file to a fifo", "corpus moved"])
def test_get_file_refuses_swapped_paths(swappable: Built, tmp_path: Path, swap: str) -> None:
    fresh = swappable
    svc = service(fresh)
    target = fresh.corpus / "runbooks" / "deploy.md"
    if swap == "file to /etc/passwd":
        target.unlink()
        target.symlink_to("/etc/passwd")
    elif swap == "file to another corpus file":
        target.unlink()
        target.symlink_to(fresh.corpus / "reference" / "api.md")
    elif swap == "folder to outside":
        outside = tmp_path / "outside"
        shutil.move(str(fresh.corpus / "runbooks"), outside)
        (fresh.corpus / "runbooks").symlink_to(outside, target_is_directory=True)
    elif swap == "folder to another corpus folder":
        shutil.rmtree(fresh.corpus / "runbooks")
        (fresh.corpus / "reference" / "deploy.md").write_text("# Decoy\n", encoding="utf-8")
        (fresh.corpus / "runbooks").symlink_to(fresh.corpus / "reference", target_is_directory=True)
    elif swap == "file to a fifo":
        target.unlink()
        os.mkfifo(target)
    else:  # the server pointed at a copy of the corpus the index was not built from
        moved = tmp_path / "moved"
        shutil.copytree(fresh.corpus, moved)
        svc = service(Built(moved, fresh.store, fresh.host))
    is_error, payload = call(svc, "get_file", path="runbooks/deploy.md")
    assert is_error and payload["error"]["code"] == "path_rejected", payload
    assert "root:" not in json.dumps(payload)
    # Other files are still served.
    assert not call(svc, "get_file", path="oncall/escalation.md")[0] or swap == "corpus moved"


def test_get_file_falls_back_to_indexed_passages_when_the_file_is_gone(swappable: Built) -> None:
    fresh = swappable
    svc = service(fresh)
    (fresh.corpus / "oncall" / "escalation.md").unlink()
    is_error, payload = call(svc, "get_file", path="oncall/escalation.md")
    assert not is_error and payload["source"] == "index"
    assert "Who gets paged for a sev-1" in payload["text"] and "Platform Primary rotation" in payload["text"]
    part = call(svc, "get_file", path="oncall/escalation.md", start_line=17, end_line=20)[1]
    assert part["source"] == "index" and part["start_line"] <= 17 and "Severity levels" in part["text"]


def test_get_file_pages_a_long_file(fake: FakeOllama, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    lines = [f"Line {i:05d} " + "lorem ipsum dolor sit amet " * 3 for i in range(1, 1501)]
    (src / "long.md").write_text("# Long\n\n" + "\n".join(lines) + "\n", encoding="utf-8")
    built = build(tmp_path, fake.host, src)
    svc = service(built)
    got: list[str] = []
    start: int | None = 1
    while start is not None:
        is_error, page = call(svc, "get_file", path="long.md", start_line=start)
        assert not is_error and len(page["text"]) <= server.FILE_TEXT_MAX_CHARS
        got.extend(page["text"].split("\n"))
        assert page["truncated"] == (page["next_start_line"] is not None)
        start = page["next_start_line"]
    assert got == (built.corpus / "long.md").read_text(encoding="utf-8").split("\n")[:-1]


def test_list_documents_paginates_and_carries_the_stamp(base: Built) -> None:
    svc = service(base)
    _, first = call(svc, "list_documents", limit=4)
    assert first["total"] == 6 and len(first["documents"]) == 4 and first["next_offset"] == 4
    _, rest = call(svc, "list_documents", offset=4, limit=4)
    assert rest["next_offset"] is None and len(rest["documents"]) == 2
    docs = {d["path"]: d for d in first["documents"] + rest["documents"]}
    assert "private/offsite-backup.md" not in docs
    assert docs["runbooks/deploy-2023.md"]["lifecycle"] == "superseded"
    assert docs["oncall/escalation.md"]["title"] == "On-call escalation policy"
    assert docs["oncall/escalation.md"]["chunks"] >= 1 and docs["oncall/escalation.md"]["lines"] > 40
    assert docs["oncall/escalation.md"]["mtime"].endswith("+00:00")
    assert first["index"]["files"] == 6 and first["index"]["commit"] is None or isinstance(first["index"]["commit"], str)
    _, runbooks = call(svc, "list_documents", path_prefix="runbooks")
    assert [d["path"] for d in runbooks["documents"]] == ["runbooks/deploy-2023.md", "runbooks/deploy.md"]
    _, none = call(svc, "list_documents", path_prefix="nothing-here")
    assert none["total"] == 0 and none["documents"] == [] and "nothing-here" in none["message"]
    _, past = call(svc, "list_documents", offset=100)
    assert past["documents"] == [] and past["next_offset"] is None and "past the end" in past["message"]


def test_the_rag_false_token_is_never_served(base: Built) -> None:
    svc = service(base)
    token = "SECRET-OFFSITE-TOKEN-7731"
    outputs = [call(svc, "list_documents", limit=500)[1], call(svc, "get_file", path="private/offsite-backup.md")[1]]
    for mode in ("hybrid", "vector", "keyword"):
        for query in (token, "offsite backup restore escrow reference", "SECRET OFFSITE TOKEN"):
            for superseded in (True, False):  # without: the thin-result message speaks of hidden passages
                answer = call(svc, "search_corpus", query=query, mode=mode, k=20, include_superseded=superseded)[1]
                assert answer.pop("query") == query  # the echo of the caller's own query is not a leak
                outputs.append(without_echoed_identifier(answer, token))
    for path in [d["path"] for d in outputs[0]["documents"]]:
        outputs.append(call(svc, "get_file", path=path)[1])
    assert token not in json.dumps(outputs, ensure_ascii=False)
    assert not any("offsite-backup" in json.dumps(o) for o in outputs[2:])
    # private/ holds only the excluded file: no nearest-folder suggestion names it.
    for prefix in ("privat", "private/offsite", "Private"):
        said = [call(svc, "search_corpus", query="offsite backup", path_prefix=prefix)[1]["message"],
                call(svc, "list_documents", path_prefix=prefix)[1]["message"]]
        for message in said:
            nearest = message.split("nearest indexed folders: ", 1)[1]
            assert "rivate" not in nearest and "offsite" not in nearest, message


# ---------------------------------------------------------------------------
# Keyword channel cost control: BM25 only over a bounded number of matches.


def test_keyword_plan_keeps_rare_terms_when_common_ones_would_blow_the_budget(base: Built) -> None:
    index = service(base).manager.open()
    chunks = index.current.stamp.chunks
    assert index.keyword_plan("deploy rollback E4091", budget=chunks).kind == "all"
    plan = index.keyword_plan("deploy rollback E4091", budget=5)
    assert plan.kind == "rare" and "e4091" in plan.terms and "deploy" not in plan.terms
    ranked, plan = index.keyword_ranking("deploy rollback E4091", ["active"], server.Within(), 10, budget=5)
    assert ranked and "E4091" in index.chunks_by_id([ranked[0][0]])[ranked[0][0]].text
    # Only common words: nothing; the vector channel carries such a query.
    assert index.keyword_plan("deploy rollout canary", budget=5).kind == "too_common"
    assert index.keyword_plan("the of and", budget=5).kind == "no_terms"
    assert index.keyword_plan("zzqqxx-unknown", budget=0).kind == "too_common"


def test_keyword_mode_ranks_the_passages_holding_the_rarest_common_words_together(
        base: Built, monkeypatch: pytest.MonkeyPatch) -> None:
    index = service(base).manager.open()
    # In the sample corpus of 50 passages: canary 12, rollout 26, deploy 32; canary and rollout
    # together 11, all three 11.
    query = "deploy rollout canary"
    plan = index.keyword_plan(query, budget=11, together=True)
    assert (plan.kind, plan.terms) == ("together", ["canary", "rollout"])
    ranked, _ = index.keyword_ranking(query, ["active"], server.Within(), 20, budget=11, together=True)
    rows = index.chunks_by_id([i for i, _ in ranked]).values()
    assert rows and all(word in f"{row.title} {row.heading} {row.text}".lower() for row in rows
                        for word in ("canary", "rollout"))
    # Hybrid leaves such a query to the vector channel; more such passages than the budget, or
    # posting lists longer than their budget: too common.
    assert index.keyword_plan(query, budget=11).kind == "too_common"
    assert index.keyword_plan(query, budget=10, together=True).kind == "too_common"
    monkeypatch.setattr(server, "KEYWORD_POSTINGS_BUDGET", 37)  # canary and rollout hold 38
    assert index.keyword_plan(query, budget=11, together=True).kind == "too_common"


def test_keyword_mode_explains_when_every_word_is_too_common(base: Built, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server, "KEYWORD_MATCH_BUDGET", 1)
    svc = service(base)
    is_error, payload = call(svc, "search_corpus", query="deploy rollout canary promote wave", mode="keyword")
    assert not is_error
    if not payload["results"]:
        assert "too common" in payload["message"]
    # Hybrid still answers from the vector channel.
    is_error, payload = call(svc, "search_corpus", query="deploy rollout canary promote wave")
    assert not is_error and payload["results"]


def test_hybrid_degraded_to_keywords_ranks_common_words_together_as_keyword_mode_does(
        base: Built, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the embedder down no vector channel carries a query of common words, so hybrid
    search answers what keyword mode would: the passages holding the rarest of them together."""
    monkeypatch.setattr(server, "KEYWORD_MATCH_BUDGET", 11)  # canary and rollout together: 11 passages
    query = "deploy rollout canary"
    keyword = call(service(base), "search_corpus", query=query, mode="keyword", k=20)[1]
    with FakeOllama() as other:
        other.stop()
        is_error, payload = call(service(base, host=other.host), "search_corpus", query=query, k=20)
    assert not is_error and payload["degraded"] == "embedder_unavailable", payload
    assert payload["results"] and all(hit["matched"] == ["keyword"] for hit in payload["results"])
    assert [(hit["path"], hit["start_line"]) for hit in payload["results"]] == [
        (hit["path"], hit["start_line"]) for hit in keyword["results"]]


def test_embedder_timeout_is_embedder_unavailable_not_a_hang(base: Built) -> None:
    with FakeOllama() as slow:
        slow.configure(delay_seconds=5)
        svc = service(base, host=slow.host, RAG_EMBED_TIMEOUT="0.5")
        is_error, payload = call(svc, "search_corpus", query="who gets paged for a sev-1", mode="vector")
        assert is_error and payload["error"]["code"] == "embedder_unavailable"
        assert "did not answer" in payload["error"]["message"]
        is_error, payload = call(svc, "search_corpus", query="who gets paged for a sev-1")
        assert not is_error and payload["degraded"] == "embedder_unavailable" and payload["results"]


def test_an_index_from_another_chunker_version_is_served_with_a_hint(base: Built, tmp_path: Path) -> None:
    copy = Built(base.corpus, tmp_path / "store", base.host)
    shutil.copytree(base.store, copy.store)
    current = json.loads((copy.store / "CURRENT.json").read_text(encoding="utf-8"))
    current["manifest"]["chunker_version"] = "0"
    (copy.store / "CURRENT.json").write_text(json.dumps(current), encoding="utf-8")
    is_error, payload = call(service(copy), "search_corpus", query="who gets paged for a sev-1")
    assert not is_error and payload["results"]
    assert "chunker version 0" in payload["staleness"]["hint"] and "ingest.py" in payload["staleness"]["hint"]




RANKING_QUERIES = ("rate limit headers", "OLLAMA_KEEP_ALIVE", "E4091", "how do I roll back a deploy")


# The sweep over every k through the whole service: hybrid and vector (which embed each query) run
# in `pytest --all`; the fast tier keeps keyword here and the property on the ranking itself
# (test_ranking.py::test_the_results_for_k_are_the_first_k_for_k_plus_one).
@pytest.mark.parametrize("mode", [pytest.param("hybrid", marks=pytest.mark.heavy),
                                  pytest.param("vector", marks=pytest.mark.heavy), "keyword"])
def test_the_results_for_k_are_the_first_k_of_the_results_for_20(base: Built, mode: str) -> None:
    """The issue-25 reproduction: `--k 1` showed reference/api.md:50, `--k 2` two other hits.
    For every k the results are the first k of one order, with path_prefix, queries, min_score."""
    svc = service(base)
    variants: list[dict[str, Any]] = [{}, {"path_prefix": "reference/"},
                                      {"queries": ["OLLAMA_KEEP_ALIVE", "roll back a release"]}]
    if mode != "keyword":
        variants.append({"min_score": 0.0})

    def places(query: str, k: int, extra: dict[str, Any]) -> list[tuple[str, int, int]]:
        is_error, payload = call(svc, "search_corpus", query=query, mode=mode, k=k, **extra)
        assert not is_error, payload
        return [(hit["path"], hit["start_line"], hit["end_line"]) for hit in payload["results"]]

    for query in RANKING_QUERIES:
        for extra in variants:
            everything = places(query, server.K_MAX, extra)
            assert everything, (query, extra)
            for k in range(1, server.K_MAX):
                assert places(query, k, extra) == everything[:k], (query, extra, k)


def test_warm_up_can_be_joined_while_it_is_being_started(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """main() joins the warm-up at shutdown while the server's thread may be starting it (a SIGTERM
    right after the handshake): join must wait for a started thread, never meet one not yet running."""
    import threading
    import time

    monkeypatch.setenv("RAG_STORE_DIR", str(tmp_path / "no-store"))
    warmup = server.WarmUp(server.RetrievalService())
    real_start = threading.Thread.start
    starting = threading.Event()

    def slow_start(thread: threading.Thread) -> None:
        starting.set()
        time.sleep(0.2)  # the window in which a join used to raise
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", slow_start)
    starter = threading.Thread(target=warmup.start, args=(0.0,))
    real_start(starter)
    assert starting.wait(5)
    warmup.join(5)  # raised "cannot join thread before it is started"
    starter.join(5)


def test_a_context_of_a_passage_replaced_meanwhile_is_the_passage() -> None:
    """An ingest may replace a file's passages between the hit's row and its context: the passage stands."""
    def row(n: int, start: int, end: int, heading: str = "Doc > A") -> rules.ChunkRow:
        return rules.ChunkRow(id=f"c{n}", path="p.md", chunk_index=n, start_line=start, end_line=end,
                              heading=heading, lifecycle="active", text="x", title="T")

    hit, others = row(9, 10, 14), [row(0, 1, 9), row(1, 15, 30)]
    for kind in ("section", "neighbours"):
        assert server.context_range(others, hit, kind) == (10, 14)
    assert server.context_range([*others, hit], hit, "neighbours") == (1, 30)
