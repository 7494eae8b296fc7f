"""The ranking stage (server.rank and its steps), tested directly: pure functions, no store.

The invariant an agent relies on: a search returns the first k of one order of its candidates,
so the first result never depends on k and the results for k are the first k for k + 1. rank()
returns that whole order; these properties hold it to it over arbitrary channel rankings,
weights, ties, duplicate ids and documents. tests/test_server_contract.py checks the same end to
end over a real index for every k.
"""

from __future__ import annotations

import random

import pytest
from budgets import examples
from hypothesis import given, settings
from hypothesis import strategies as st

import server
from corpus_rules import chunk_document_key, chunk_id

DOCUMENTS = [f"docs/{name}.md" for name in ("a", "b", "c", "d", "e")]
CHUNKS = [chunk_id(path, f"{n:016x}", i) for n, path in enumerate(DOCUMENTS) for i in range(6)]
chunk_lists = st.lists(st.sampled_from(CHUNKS), max_size=40)  # repeats allowed: a list may name an id twice
ranked_lists = st.lists(
    st.builds(server.RankedList, channel=st.sampled_from(["vector", "keyword"]),
              phrasing=st.integers(min_value=0, max_value=3), ids=chunk_lists.map(tuple),
              weight=st.sampled_from([0.0, 0.2, 0.5, 0.7, 1.0])),  # few values: ties are common
    max_size=8)
stand_in_lists = st.lists(
    st.lists(st.tuples(st.integers(min_value=1, max_value=60), st.sampled_from(CHUNKS)), max_size=12,
             unique_by=lambda entry: entry[1]).map(
        lambda entries: server.RankedList("keyword", 0, tuple(item for _, item in sorted(entries)), 1.0,
                                          tuple(rank for rank, _ in sorted(entries)))),
    max_size=2)  # a waiting passage stands in the vector list at its keyword rank
holders = st.dictionaries(st.sampled_from(["OLLAMA_KEEP_ALIVE", "E4091", "v-model"]),
                          st.sets(st.sampled_from(CHUNKS)), max_size=3)


def candidates(lists: list[server.RankedList], whole: dict[str, set[str]]) -> server.ChannelCandidates:
    return server.ChannelCandidates(lists=tuple(lists), whole=whole)


def order_of(entries: list[tuple[str, float]]) -> list[str]:
    return [item for item, _ in entries]


modes = st.sampled_from(["hybrid", "vector", "keyword"])


@settings(max_examples=examples(300))
@given(ranked_lists, holders, modes, st.randoms(use_true_random=False))
def test_rank_orders_every_candidate_once_whichever_channel_answered_first(
        lists: list[server.RankedList], whole: dict[str, set[str]], mode: str, shuffler: random.Random) -> None:
    ranked = order_of(server.rank(candidates(lists, whole), mode))
    assert sorted(ranked) == sorted({item for r in lists for item in r.ids})
    shuffled = list(lists)
    shuffler.shuffle(shuffled)
    assert order_of(server.rank(candidates(shuffled, whole), mode)) == ranked


@settings(max_examples=examples(300))
@given(ranked_lists, holders, modes, st.integers(min_value=1, max_value=20))
def test_the_results_for_k_are_the_first_k_for_k_plus_one(
        lists: list[server.RankedList], whole: dict[str, set[str]], mode: str, k: int) -> None:
    """What a search returns for k, as Search.answer takes it: rank(...)[:k] of one deterministic
    order, from candidates that do not depend on k (each channel takes CHANNEL_CANDIDATES)."""
    assert server.CHANNEL_CANDIDATES >= server.K_MAX
    assert server.rank(candidates(lists, whole), mode)[:k] == server.rank(candidates(lists, whole), mode)[:k + 1][:k]


@given(st.permutations(CHUNKS[:12]), st.sets(st.sampled_from(CHUNKS[:12])))
def test_a_passage_holding_the_identifier_whole_gains_and_no_other_moves_down(
        order: list[str], whole: set[str]) -> None:
    fused = [(item, 1.0 / (60 + rank)) for rank, item in enumerate(order, start=1)]
    out = server.with_identifier_bonus(fused, {"OLLAMA_KEEP_ALIVE": whole}, server.IDENTIFIER_BONUS)
    ranked = order_of(out)
    assert sorted(ranked) == sorted(order)
    for item, value in out:
        assert value == dict(fused)[item] + (server.IDENTIFIER_BONUS if item in whole else 0.0)
    assert [i for i in ranked if i in whole] == [i for i in order if i in whole]
    assert [i for i in ranked if i not in whole] == [i for i in order if i not in whole]
    for holder in whole:
        assert ranked.index(holder) <= order.index(holder)


def test_a_passage_writing_the_identifier_another_way_keeps_its_own_rank() -> None:
    """The held-out regression: a Japanese question naming `v-on:submit.prevent`; its answer
    writes `@submit.prevent`, four passages of another file hold the identifier whole. Before, it
    was demoted below all four; now it only misses their bonus, and passages that no channel
    ranks above it stay below it."""
    fused = [("answer", 2 / 61), ("other-1", 1 / 62 + 1 / 70), ("other-2", 1 / 63 + 1 / 75),
             ("unrelated", 1 / 64), ("other-3", 1 / 90), ("other-4", 1 / 95)]
    whole = {"v-on:submit.prevent": {"other-1", "other-2", "other-3", "other-4"}}
    ranked = order_of(server.with_identifier_bonus(fused, whole, server.IDENTIFIER_BONUS))
    assert ranked.index("answer") < ranked.index("unrelated")
    assert ranked.index("answer") < ranked.index("other-3")


def above_in_every_list(lists: list[server.RankedList], a: str, b: str) -> bool:
    """The definition, restated: at least as high in every list with a weight, higher in one;
    a list that did not rank a passage ranks it below all it did."""
    def place(ranked: server.RankedList, item: str) -> float:
        return dict((i, p) for p, i in reversed(list(ranked.positions()))).get(item, float("inf"))
    if any(ranked.ranks is not None and (a in ranked.ids or b in ranked.ids) for ranked in lists):
        return False  # a stand-in: only the keyword channel ranked it
    counted = [ranked for ranked in lists if ranked.weight > 0 and ranked.ranks is None]
    return (all(place(r, a) <= place(r, b) for r in counted) and any(place(r, a) < place(r, b) for r in counted))


@settings(max_examples=examples(300))
@given(ranked_lists, stand_in_lists, holders)
def test_the_bonus_never_lifts_a_passage_over_one_every_list_ranks_above_it(
        ranked: list[server.RankedList], stand_ins: list[server.RankedList], whole: dict[str, set[str]]) -> None:
    lists = [*ranked, *stand_ins]
    fused = server.fuse_rankings(lists)
    boosted = server.with_identifier_bonus(fused, whole, server.IDENTIFIER_BONUS)
    kept = server.unanimous_order(boosted, fused, lists)
    assert sorted(kept) == sorted(boosted), "every entry once, with its value"
    order = order_of(kept)
    for i, a in enumerate(order):
        for b in order[:i]:
            assert not above_in_every_list(lists, a, b), f"{a} is above {b} in every list, yet follows it"
    # Each place goes to the first passage in the bonus's order that no passage still waiting is above in every list.
    for i, (item, _) in enumerate(kept):
        waiting = order[i:]
        first_free = next(b for b in order_of(boosted) if b in waiting
                          and not any(above_in_every_list(lists, a, b) for a in waiting))
        assert item == first_free
    if not whole:
        assert kept == boosted == fused, "without a bonus, fused values already keep every such pair"


def test_the_answer_both_channels_rank_first_stays_first_among_passages_naming_the_identifier() -> None:
    """The dev-set case: a question names `x-mcp-header`; its answer, a subsection whose parent
    section names it, is first in both channels; a dozen passages naming it are each ranked below
    it by both. With the bonus alone all twelve passed it, and the answer left the first ten."""
    answer = chunk_id("spec/http.mdx", "0" * 16, 9)
    naming = [chunk_id(f"spec/{i}.mdx", "1" * 16, i) for i in range(12)]
    lists = [server.RankedList("vector", 0, (answer, *naming)), server.RankedList("keyword", 0, (answer, *naming[::-1]))]
    found = candidates(lists, {"x-mcp-header": set(naming)})
    assert order_of(server.rank(found, "hybrid"))[0] == answer
    fused = server.fuse_rankings(lists)
    assert order_of(server.with_identifier_bonus(fused, found.whole, server.IDENTIFIER_BONUS)).index(answer) == 12


def test_two_identifiers_a_passage_holding_both_leads_one_holding_one() -> None:
    fused = [("one", 1 / 61 + 1 / 65), ("both", 1 / 62 + 1 / 66), ("none", 1 / 63)]
    whole = {"--fork-strategy": {"one", "both"}, "uv.lock": {"both"}}
    assert order_of(server.with_identifier_bonus(fused, whole, server.IDENTIFIER_BONUS)) == ["both", "one", "none"]


def test_a_keyword_only_identifier_comes_first() -> None:
    """The identifier chunk is ranked nowhere by the vector channel and first by keywords;
    chunks both channels rank mediocrely push it out of plain RRF's top 5, not out of hybrid's."""
    vector = [chunk_id(f"doc-{i}.md", "0" * 16, 0) for i in range(50)]
    ident = chunk_id("b.md", "1" * 16, 0)
    keyword = [ident, *vector[:10]]
    lists = [server.RankedList("vector", 0, tuple(vector)), server.RankedList("keyword", 0, tuple(keyword))]
    assert ident not in order_of(server.fuse_rankings(lists)[:5])
    found = candidates(lists, {"OLLAMA_KEEP_ALIVE": {ident}})
    assert order_of(server.rank(found, "hybrid"))[0] == ident
    assert ident not in order_of(server.rank(found, "keyword")[:5]), "keyword mode: BM25's own order"


@given(st.dictionaries(st.text("abcdef_", min_size=1, max_size=6), st.text("ABC_", min_size=1, max_size=6), max_size=6),
       st.dictionaries(st.text("abcdef_", min_size=1, max_size=6), st.integers(min_value=0, max_value=2000)),
       st.integers(min_value=0, max_value=10_000))
def test_an_identifier_held_by_a_tenth_of_a_large_corpus_is_a_word(
        identifiers: dict[str, str], held: dict[str, int], passages: int) -> None:
    kept = server.distinctive_identifiers(identifiers, held, passages)
    common = max(0.1 * max(passages, 1), server.CHANNEL_CANDIDATES)
    assert [term for _, term in kept] == [t for t in identifiers if held.get(t, 0) <= common]
    assert all(identifiers[term] == typed for typed, term in kept)


@given(st.lists(st.sampled_from(CHUNKS), unique=True, max_size=30), st.integers(min_value=1, max_value=4))
def test_at_most_lead_passages_of_a_document_precede_another_documents_next(chunks: list[str], lead: int) -> None:
    fused = [(item, 1.0 / (60 + rank)) for rank, item in enumerate(chunks, start=1)]
    ranked = order_of(server.spread_documents(fused, chunk_document_key, lead))
    assert sorted(ranked) == sorted(chunks)
    for document in {chunk_document_key(c) for c in chunks}:
        mine = [c for c in chunks if chunk_document_key(c) == document]
        assert [c for c in ranked if c in mine] == mine, "a document's passages keep their order"
    tier = {}
    for document in {chunk_document_key(c) for c in chunks}:
        for n, c in enumerate(c for c in chunks if chunk_document_key(c) == document):
            tier[c] = n // lead  # how many groups of `lead` passages of its document rank above it
    for position, item in enumerate(ranked):
        assert all(tier[c] >= tier[item] for c in ranked[position:]), "no passage of a lower tier follows"


def test_four_passages_of_one_file_no_longer_hide_the_others() -> None:
    a = [chunk_id("guide/a.md", "0" * 16, i) for i in range(4)]
    b = chunk_id("guide/b.md", "1" * 16, 0)
    fused = [(item, 1.0 / (60 + rank)) for rank, item in enumerate([*a, b], start=1)]
    ranked = order_of(server.spread_documents(fused, chunk_document_key, 2))
    assert ranked == [a[0], a[1], b, a[2], a[3]]


# ---------------------------------------------------------------------------
# The search path's shared mechanisms: one LRU, one bounded call.

_OPS = st.lists(st.tuples(st.sampled_from(["get", "put", "get_many", "put_many"]),
                          st.lists(st.integers(0, 6), min_size=1, max_size=3), st.integers()), max_size=60)


@settings(max_examples=examples(200), deadline=None)
@given(size=st.integers(1, 4), ops=_OPS)
def test_the_lru_keeps_the_most_recently_used_entries(size: int, ops: list[tuple[str, list[int], int]]) -> None:
    """Against a plain model: a list of keys, most recent last, at most `size` of them."""
    lru: server.LRU[int, int] = server.LRU(size)
    order: list[int] = []
    values: dict[int, int] = {}

    def touch(key: int) -> None:
        order.remove(key)
        order.append(key)

    for op, keys, value in ops:
        if op == "get":
            assert lru.get(keys[0]) == values.get(keys[0])
            if keys[0] in values:
                touch(keys[0])
        elif op == "get_many":
            wanted = [key for key in keys if key in values]
            assert lru.get_many(keys) == {key: values[key] for key in wanted}
            for key in dict.fromkeys(wanted):
                touch(key)
        else:
            items = {key: value + i for i, key in enumerate(keys)} if op == "put_many" else {keys[0]: value}
            if op == "put_many":
                lru.put_many(items)
            else:
                lru.put(keys[0], value)
            for key, item in items.items():
                values[key] = item
                if key in order:
                    order.remove(key)
                order.append(key)
            while len(order) > size:
                del values[order.pop(0)]
    assert lru.get_many(range(7)) == values


def test_a_bounded_call_answers_within_its_bound_and_an_abandoned_one_never_runs() -> None:
    import threading

    from corpus_rules import BoundedCall

    release = threading.Event()
    slow = BoundedCall(lambda: release.wait(10) and "late")
    worker = threading.Thread(target=slow.run)
    worker.start()
    with pytest.raises(TimeoutError):
        slow.result(0.05)
    release.set()
    assert slow.result(5) == "late"
    worker.join(5)
    failing = BoundedCall(lambda: 1 / 0)
    failing.run()
    with pytest.raises(ZeroDivisionError):
        failing.result(0)
    ran: list[bool] = []
    skipped = BoundedCall(lambda: ran.append(True))
    assert skipped.cancel()
    skipped.run()
    assert ran == [] and skipped.cancelled() and not skipped.running()


@settings(max_examples=examples(300))
@given(ranked_lists, holders, modes)
def test_explain_adds_up_to_each_rank_score(lists: list[server.RankedList], whole: dict[str, set[str]],
                                             mode: str) -> None:
    """search_corpus's explain: a hit's votes sum to its fused value, plus the bonus to its
    rank_score; one vote per list that holds it, at its first place there."""
    steps = server.ranking(candidates(lists, whole), mode)
    traces = server.explain_ranking(steps, order_of(steps.order))
    for item, value in steps.order:
        trace = traces[item]
        assert trace.fused + trace.identifier_bonus == pytest.approx(value, abs=1e-5)
        assert sum(vote.vote for vote in trace.votes) == pytest.approx(trace.fused, abs=1e-5)
        assert len(trace.votes) == sum(item in ranked.ids for ranked in lists)
        assert all(vote.rank == list(dict.fromkeys(ranked.ids)).index(item) + 1
                   for vote, ranked in zip(trace.votes, [r for r in steps.lists if item in r.ids], strict=True))
        assert mode == "hybrid" or trace.identifier_bonus == 0
    assert sorted(trace.place_before_spread for trace in traces.values()) == list(range(1, len(steps.order) + 1))
