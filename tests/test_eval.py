"""tools/eval.py: its metric helpers, and one real end-to-end run on sample-corpus."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fake_ollama import FakeOllama

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("rag_eval", ROOT / "tools" / "eval.py")
assert _spec and _spec.loader
rag_eval = importlib.util.module_from_spec(_spec)
sys.modules["rag_eval"] = rag_eval
_spec.loader.exec_module(rag_eval)


def test_atx_sections_skip_fences_and_front_matter() -> None:
    text = "---\ntitle: x\n---\n# One\ntext\n```sh\n# not a heading\n```\n## Two {#two}\nmore\n"
    sections = rag_eval.atx_sections(text)
    assert [(s.heading, s.start, s.end) for s in sections] == [("One", 4, 8), ("Two", 9, 11)]


def test_metrics_on_hand_made_outcomes() -> None:
    gold = rag_eval.Query("q1", "x", "identifier", [("a.md", 10, 20)])
    hit = rag_eval.Outcome(gold, [{"path": "b.md", "start_line": 1, "end_line": 5, "score": 0.9},
                                  {"path": "a.md", "start_line": 18, "end_line": 30, "score": 0.8}], 0.01)
    assert hit.file_hit() and hit.section_hit() and hit.reciprocal_rank() == 0.5
    miss = rag_eval.Outcome(gold, [{"path": "a.md", "start_line": 21, "end_line": 30, "score": 0.2}], 0.01)
    assert miss.file_hit() and not miss.section_hit()
    assert rag_eval.auroc([0.9, 0.8], [0.5]) == 1.0
    assert rag_eval.auroc([0.5], [0.5]) == 0.5
    assert rag_eval.auroc([0.1], []) is None


def outcome(query_id: str, kind: str, gold: list[tuple[str, int, int]], paths: list[str],
            confidence: str = "high", confidence_score: float = 0.6) -> object:
    """An outcome whose results are one ten-line passage at the top of each of `paths`, in order."""
    results = [{"path": path, "start_line": 1, "end_line": 10, "heading": "H", "score": 0.5, "rank_score": 0.1,
                "text": "not saved"} for path in paths]
    return rag_eval.Outcome(rag_eval.Query(query_id, f"question {query_id}", kind, gold), results, 0.01,
                            confidence=confidence, confidence_score=confidence_score)


def saved(corpus: str, phrasings: bool, outcomes: list, commit: str = "abc1234") -> dict:
    settings = {"corpus": corpus, "phrasings": phrasings, "commit": commit, "dirty": False, "k": 10,
                "embedder_model": "embeddinggemma"}
    return json.loads(json.dumps(rag_eval.saved_run(settings, {"hybrid": outcomes})))  # as read back from a file


A = [("a.md", 1, 20)]


def test_saved_record_keeps_what_compare_and_loco_need() -> None:
    run = saved("P1", False, [outcome("q1", "paraphrase", A, ["b.md", "a.md"]), outcome("n1", "negative", [], ["b.md"])])
    first, negative = run["outcomes"]["hybrid"]
    assert first["results"][1] == {"path": "a.md", "start_line": 1, "end_line": 10, "heading": "H", "score": 0.5,
                                   "rank_score": 0.1}
    assert (first["file_hit5"], first["section_hit5"], first["rr10"]) == (True, True, 0.5)
    assert first["gold"] == [{"path": "a.md", "start_line": 1, "end_line": 20}]
    assert negative["rr10"] is None
    back = rag_eval.outcome_from_record(first)
    assert back.reciprocal_rank() == 0.5 and back.score_value() == 0.6 and back.confidence_value() == 2.0


def test_compare_lists_each_query_that_moved_by_kind() -> None:
    old = saved("P1", False, [outcome("q1", "paraphrase", A, ["b.md", "a.md"]),
                              outcome("q2", "paraphrase", A, ["a.md"]),
                              outcome("q3", "identifier", A, ["a.md"]),
                              outcome("n1", "negative", [], ["b.md"])], commit="old1234")
    new = saved("P1", False, [outcome("q1", "paraphrase", A, ["a.md"]),
                              outcome("q2", "paraphrase", A, ["b.md", "c.md", "a.md"]),
                              outcome("q3", "identifier", A, ["a.md"]),
                              outcome("n1", "negative", [], ["c.md"])], commit="new5678")
    text = rag_eval.compare_runs(old, new)
    assert text.splitlines()[0] == "P1 single @ old1234 -> P1 single @ new5678"
    assert "| paraphrase | 2 | 1.000 | 1.000 | 0.750 -> 0.667 |" in text
    assert "| identifier | 1 | 1.000 | 1.000 | 1.000 |" in text
    assert "| all | 3 | 1.000 | 1.000 | 0.833 -> 0.778 |" in text
    assert "- better: q1 (paraphrase): RR@10 0.500 -> 1.000" in text
    assert "- worse: q2 (paraphrase): RR@10 1.000 -> 0.333" in text
    assert "1 better, 1 worse, 0 mixed (queries)" in text
    assert "q3" not in text and "n1" not in text  # unchanged, and unanswerable (no hit metrics)


def test_compare_calls_a_trade_of_metrics_mixed_and_says_how_runs_differ() -> None:
    old = saved("P1", False, [outcome("q1", "paraphrase", [("a.md", 15, 30)], ["a.md", "b.md"])])
    new = saved("P1", True, [outcome("q1", "paraphrase", [("a.md", 15, 30)], ["b.md", "a.md"])])
    new["outcomes"]["hybrid"][0]["section_hit5"] = True  # a section hit won while the first right file dropped
    text = rag_eval.compare_runs(old, new)
    assert "(the runs differ in phrasings: False -> True)" in text
    assert "- mixed: q1 (paraphrase): section miss -> hit, RR@10 1.000 -> 0.500" in text


def test_readme_tables_put_single_and_phrasings_side_by_side() -> None:
    single = saved("P1", False, [outcome("q1", "paraphrase", A, ["b.md", "a.md"]), outcome("n1", "negative", [], ["b.md"])])
    phrasings = saved("P1", True, [outcome("q1", "paraphrase", A, ["a.md"]), outcome("n1", "negative", [], ["b.md"])])
    other = saved("P2", False, [outcome("r1", "ja-identifier", A, ["c.md"])])
    text = rag_eval.readme_tables([phrasings, other, single])
    assert "| P1 | paraphrase | 1 | 1.000 / 1.000 / 0.500 | 1.000 / 1.000 / 1.000 |" in text
    assert "|  | **all (1)** | | **1.000 / 1.000 / 0.500** | **1.000 / 1.000 / 1.000** |" in text
    assert "| P2 | ja-identifier | 1 | 0.000 / 0.000 / 0.000 |  |" in text
    assert "negative" not in text
    assert "| P1 | phrasings | 1.000 / 1.000 / 1.000 |" in text  # the by-mode table
    assert "| P1 | single | 0.500 | 0.500 | 0.500 | 0% | 0% | 0% |" in text  # confidence: a tie everywhere


_section_spec = importlib.util.spec_from_file_location("readme_section", ROOT / "tools" / "readme_section.py")
assert _section_spec and _section_spec.loader
readme_section = importlib.util.module_from_spec(_section_spec)
_section_spec.loader.exec_module(readme_section)


def test_a_section_is_rewritten_between_its_markers_and_nothing_else() -> None:
    text = ("# t\nkept\n<!-- eval:begin -->\nold table\n<!-- eval:end -->\nafter\n"
            "<!-- bench:begin -->\nbench\n<!-- bench:end -->\n")
    new = readme_section.replace_section(text, "eval", "\nnew table\n| a |\n\n")
    assert new == text.replace("old table\n", "new table\n| a |\n")
    assert readme_section.replace_section(new, "eval", "") == text.replace("old table\n", "")
    assert readme_section.replace_section(text, "eval", "old table") == text  # idempotent


@pytest.mark.parametrize("text", ["# no markers\n", "<!-- eval:begin -->\nx\n",
                                  "<!-- eval:end -->\n<!-- eval:begin -->\n",
                                  "<!-- eval:begin -->\n<!-- eval:end -->\n<!-- eval:begin -->\n<!-- eval:end -->\n"])
def test_missing_duplicated_or_swapped_markers_are_a_clear_error(text: str) -> None:
    with pytest.raises(readme_section.SectionError, match=r"eval.*<!-- eval:(begin|end) -->"):
        readme_section.replace_section(text, "eval", "new")


def test_tools_readme_has_every_section_the_tools_write() -> None:
    text = readme_section.README.read_text(encoding="utf-8")
    for name in ("bench", "bench-scale", "eval", "eval-loco"):
        readme_section.replace_section(text, name, "x")  # raises when a marker is missing or doubled


def test_table_write_readme_writes_the_tables_and_the_runs_they_come_from(tmp_path: Path) -> None:
    single = saved("P1", False, [outcome("q1", "paraphrase", A, ["b.md", "a.md"])], commit="abc1234")
    runs = tmp_path / "P1-single.json"
    runs.write_text(json.dumps(single), encoding="utf-8")
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- eval:begin -->\nold\n<!-- eval:end -->\nend\n", encoding="utf-8")
    assert rag_eval.main(["--table", str(runs), "--write-readme", str(readme)]) == 0
    written = readme.read_text(encoding="utf-8")
    assert written.startswith("intro\n<!-- eval:begin -->\nFrom the saved runs P1 single @ abc1234")
    assert "| P1 | paraphrase | 1 | 1.000 / 1.000 / 0.500 |" in written and "old" not in written
    assert written.endswith("<!-- eval:end -->\nend\n")
    readme.write_text("no markers\n", encoding="utf-8")
    assert rag_eval.main(["--table", str(runs), "--write-readme", str(readme)]) == 2
    assert readme.read_text(encoding="utf-8") == "no markers\n"


def scored_run(corpus: str, answerable: list[float], unanswerable: list[float], phrasings: bool = False) -> dict:
    """A run whose queries carry these confidence scores, the level read as the server does."""
    def level(score: float) -> str:
        return "high" if score >= 0.5 else "medium" if score >= 0.1 else "low"

    outcomes = [outcome(f"{corpus}-{i}", "paraphrase", A, ["a.md"], level(s), s) for i, s in enumerate(answerable)]
    outcomes += [outcome(f"{corpus}-N{i}", "negative", [], ["b.md"], level(s), s) for i, s in enumerate(unanswerable)]
    return saved(corpus, phrasings, outcomes)


def test_leave_one_corpus_out_applies_each_corpus_cut_to_the_other() -> None:
    p1 = scored_run("P1", [0.2, 0.6, 0.7], [0.05])
    p2 = scored_run("P2", [0.08, 0.4, 0.8], [0.15, 0.3])
    lonely = scored_run("P1", [0.9], [0.1], phrasings=True)  # no P2 run with phrasings to pair it with
    rows = {h.corpus: h for h in rag_eval.leave_one_corpus_out([p1, p2, lonely])}
    assert len(rows) == 2
    on_p2 = rows["P2"]
    assert (on_p2.fitted_on, on_p2.mode, on_p2.cut) == ("P1", "hybrid", 0.2)  # the lowest of three: none flagged on P1
    assert on_p2.answerable_below_cut == 1 / 3 and on_p2.unanswerable_below_cut == 0.5
    assert on_p2.score_auroc == 4 / 6 and on_p2.answerable_low == 1 / 3 and on_p2.unanswerable_low == 0.0
    assert on_p2.missed() == ["AUROC", "cut"]  # `low` is a goal with phrasings only
    assert dataclasses.replace(on_p2, phrasings=True).missed() == ["AUROC", "cut", "low"]
    on_p1 = rows["P1"]
    assert on_p1.cut == 0.08 and on_p1.answerable_below_cut == 0.0 and on_p1.unanswerable_below_cut == 1.0
    assert on_p1.score_auroc == 1.0 and on_p1.missed() == []
    table = rag_eval.loco_table(list(rows.values()))
    assert "| P1 | P2 | single | hybrid | 0.080 | 1.000 | 1.000 | 0% | 0% | 100% | 100% | met |" in table


def hits(*spans: tuple[str, int]) -> list[dict]:
    return [{"path": path, "start_line": start, "end_line": start + 9, "score": 0.5} for path, start in spans]


def test_k_violations_are_the_k_whose_results_are_not_a_prefix_of_the_longest() -> None:
    longest = hits(("a.md", 1), ("b.md", 1), ("c.md", 1))
    assert rag_eval.k_violations({1: longest[:1], 2: longest[:2], 3: longest}) == []
    assert rag_eval.k_violations({1: longest[:1], 2: longest[:2], 3: longest[:2]}) == []  # fewer than k: no more to give
    swapped = [longest[1], longest[0]]
    assert rag_eval.k_violations({1: hits(("b.md", 1)), 2: swapped, 3: longest}) == [1, 2]
    other_lines = hits(("a.md", 5))
    assert rag_eval.k_violations({1: other_lines, 2: longest[:2], 3: longest}) == [1]
    assert rag_eval.number_ranges([1, 2, 3, 7, 9, 10]) == "1-3, 7, 9-10"


def test_k_variants_filter_by_the_gold_folder_and_the_median_score() -> None:
    longest = [{**hit, "score": score} for hit, score in zip(hits(("x/y/a.md", 1), ("top.md", 1), ("x/b.md", 1)),
                                                             [0.9, 0.5, 0.2], strict=True)]
    gold = rag_eval.Query("q", "x", "paraphrase", [("guide/api/c.md", 1, 9)])
    assert rag_eval.k_variants(gold, "hybrid", longest) == [
        ("path_prefix=guide/api", {"path_prefix": "guide/api"}), ("min_score=0.5000", {"min_score": 0.5})]
    negative = rag_eval.Query("n", "x", "negative", [])
    assert rag_eval.k_variants(negative, "keyword", longest) == [("path_prefix=x/y", {"path_prefix": "x/y"})]
    assert rag_eval.folder_of("top.md") == "top.md"
    assert rag_eval.k_variants(negative, "vector", []) == []


def test_fragments_are_small_chunks_of_split_documents_and_pieces_of_cut_lines() -> None:
    long_text = "word " * 200
    chunks = [("one.md", 1, 3, "tiny"),  # alone in its document: not a fragment however small
              ("two.md", 1, 40, long_text), ("two.md", 41, 42, "tiny tail"),
              ("three.md", 1, 10, long_text), ("three.md", 10, 10, long_text), ("three.md", 10, 20, "x"),
              ("link.md", 1, 5, "[a](https://x.test/p#" + "A1b2C3d4" * 40 + ")"),  # small once its payload is cut
              ("link.md", 6, 30, long_text)]
    found = rag_eval.count_fragments(chunks, min_tokens=64)
    assert (found.chunks, found.under_min, found.shared_line, found.fragments) == (8, 3, 3, 5)  # "x" is both


@pytest.mark.process
def test_eval_runs_end_to_end_on_sample_corpus(tmp_path: Path) -> None:
    queries = [
        {"id": "s1", "query": "who gets paged for a sev-1?", "kind": "paraphrase",
         "gold": [{"path": "oncall/escalation.md", "heading": "Who gets paged for a sev-1"}]},
        {"id": "s2", "query": "What does error E4091 mean?", "kind": "identifier",
         "gold": [{"path": "reference/api.md", "heading": "Error codes"}]},
        {"id": "s3", "query": "LOG_SHIPPER_ENDPOINT の設定", "kind": "ja-identifier",
         "gold": [{"path": "ja/log-collection.md", "heading": "設定"}]},
        {"id": "s4", "query": "how do I bake sourdough bread", "kind": "negative", "gold": []},
    ]
    qfile = tmp_path / "queries.jsonl"
    qfile.write_text("".join(json.dumps(q, ensure_ascii=False) + "\n" for q in queries), encoding="utf-8")
    with FakeOllama() as fake:
        env = {**os.environ, "OLLAMA_HOST": fake.host}
        env.pop("RAG_EMBED_MODEL", None)
        done = subprocess.run(
            [sys.executable, str(ROOT / "tools" / "eval.py"), str(qfile), "--corpus", str(ROOT / "sample-corpus"),
             "--json", str(tmp_path / "report.json"), "--runs", str(tmp_path / "runs"), "--save", str(tmp_path / "run.json"),
             "--check-k"],
            check=False, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for mode in ("hybrid", "vector", "keyword"):
        assert f"mode: {mode}" in done.stdout
        assert f"  {mode}: 0 of " in done.stdout  # the k check found nothing
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["queries"] == 4
    assert report["fragments"]["chunks"] == report["chunks"] and report["fragments"]["min_tokens"] == 64
    assert "fragment chunks: " in done.stdout
    for mode in ("hybrid", "keyword"):
        rows = {row["kind"]: row for row in report["modes"][mode]}
        assert rows["identifier"]["file_hit5"] == 1.0
        assert rows["ja-identifier"]["file_hit5"] == 1.0
        assert rows["all"]["errors"] == 0
    hybrid = {row["kind"]: row for row in report["modes"]["hybrid"]}
    assert hybrid["paraphrase"]["section_hit5"] == 1.0
    run = [json.loads(line) for line in (tmp_path / "runs" / "run-sample-corpus-hybrid.jsonl").read_text().splitlines()]
    assert [r["id"] for r in run] == ["s1", "s2", "s3", "s4"]
    assert run[0]["results"][0]["path"] == "oncall/escalation.md"
    saved_run = json.loads((tmp_path / "run.json").read_text())
    assert saved_run["settings"]["corpus"] == "sample-corpus" and saved_run["settings"]["phrasings"] is False
    assert saved_run["settings"]["commit"] and saved_run["settings"]["embedder_model"]
    assert [r["id"] for r in saved_run["outcomes"]["hybrid"]] == ["s1", "s2", "s3", "s4"]
    same = subprocess.run([sys.executable, str(ROOT / "tools" / "eval.py"), "--compare", str(tmp_path / "run.json"),
                           str(tmp_path / "run.json")], check=False, capture_output=True, text=True, timeout=60)
    assert same.returncode == 0 and "0 better, 0 worse, 0 mixed (queries)" in same.stdout, same.stderr


def test_a_thinned_copy_is_a_store_whose_ingest_stopped_while_embedding(sample_index: tuple[Path, Path],
                                                                         tmp_path: Path) -> None:
    from helpers import chroma_state, keyword_db

    from corpus_rules import StoreLayout

    store, thin = sample_index[1], tmp_path / "thin"  # the sample as ingest indexed it (conftest)
    before = {lc: set(col) for lc, col in chroma_state(store).items()}
    rag_eval.thinned_copy(store, 0.5, thin)
    assert {lc: set(col) for lc, col in chroma_state(store).items()} == before, "the original is untouched"
    chunks = dict(keyword_db(thin).execute("SELECT path, chunk_count FROM documents"))
    waiting = dict(keyword_db(thin).execute("SELECT path, chunks FROM vectors_pending"))
    assert waiting and set(waiting) < set(chunks) and all(waiting[p] == chunks[p] for p in waiting)
    ids = {i for col in chroma_state(thin).values() for i in col}
    by_path = dict(keyword_db(thin).execute("SELECT id, path FROM chunks"))
    assert {by_path[i] for i in ids} == set(chunks) - set(waiting), "exactly the waiting documents lost their vectors"
    current = StoreLayout(thin).read_current()
    assert current.stamp.vectors_pending == sum(waiting.values())
    assert abs((current.stamp.chunks - current.stamp.vectors_pending) / current.stamp.chunks - 0.5) < 0.3


def test_while_vectors_wait_hybrid_ranks_the_waiting_passages_and_judges_them_by_their_terms(
        sample_index: tuple[Path, Path], tmp_path: Path) -> None:
    from helpers import Built, in_process_service, keyword_db

    import server

    (corpus, store), thin = sample_index, tmp_path / "thin"  # the sample as ingest indexed it (conftest)
    rag_eval.thinned_copy(store, 0.5, thin)
    with FakeOllama() as fake:
        svc = in_process_service(Built(corpus, thin, fake.host))
        hybrid = svc.search(server.SearchCorpusInput(query="how do I roll back a deploy"))
        svc.close(timeout=10)
    waiting = {p for (p,) in keyword_db(thin).execute("SELECT path FROM vectors_pending")}
    assert "runbooks/deploy.md" in waiting and "oncall/escalation.md" not in waiting
    assert hybrid["degraded"] == "vectors_pending" and 0 < hybrid["index"]["vectors_pending"] < hybrid["index"]["chunks"]
    # The answer has no vector yet: it is first all the same, found and judged by its terms.
    top = hybrid["results"][0]
    assert top["path"] == "runbooks/deploy.md" and top["matched"] == ["keyword"]
    assert "stands out" not in hybrid["confidence_reason"] and "holds" in hybrid["confidence_reason"]
    assert any("vector" in hit["matched"] for hit in hybrid["results"]), "the embedded passages are searched by vector"
