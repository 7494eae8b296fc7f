"""tools/eval.py: its metric helpers, and one real end-to-end run on sample-corpus."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

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
             "--json", str(tmp_path / "report.json"), "--runs", str(tmp_path / "runs")],
            capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for mode in ("hybrid", "vector", "keyword"):
        assert f"mode: {mode}" in done.stdout
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["queries"] == 4
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
