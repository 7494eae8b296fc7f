"""Retrieval quality, measured end to end: the real ingest.py and the real server over stdio.

    python tools/eval.py QUERIES.jsonl [MORE.jsonl ...] --corpus DIR [--store DIR]
                         [--modes hybrid,vector,keyword] [--phrasings FILE]

Builds an index of DIR with ingest.py (in a temporary store unless --store is given) against
whatever OLLAMA_HOST points to, runs every query through `python server.py` with an MCP
client, and prints per query kind: file_hit@5, section_hit@5, MRR@10, and latency p50/p95,
for each mode; over all queries, how well the top-1 score, the response's `confidence`
(low < medium < high) and its `confidence_score` tell answerable from unanswerable queries
(AUROC), the share of each marked low, and the share of unanswerable ones scored below the
cut that flags at most 10% of the answerable ones.

A query line: {"id", "query", "kind", "gold": [{"path", "heading"}], "corpus"?, "phrasings"?}.
`gold: []` marks an unanswerable (negative) query. With --phrasings FILE (lines {"id",
"queries": [...]}), each query is sent with those extra phrasings in `queries` (a line's own
"phrasings" are used when FILE has none for it): the multi-phrasing search an agent makes.
When lines carry "corpus", only those equal to --query-corpus (default: the corpus folder's
name) are run. A gold section runs from its ATX heading line to the line before the next
heading of any level, fences and front matter excluded (the dev set's definition).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parent.parent
MODES = ("hybrid", "vector", "keyword")
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_ATX = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+|$)(.*?)(?:[ \t]+#+)?[ \t]*$")
_ANCHOR = re.compile(r"\s*\{#[^}]*\}\s*$")


@dataclass(frozen=True)
class Section:
    heading: str
    start: int  # 1-based heading line
    end: int  # inclusive


def atx_sections(text: str) -> list[Section]:
    """Sections as the dev set defines them: ATX headings outside fences and front matter."""
    lines = text.split("\n")  # the dev set counts the empty string after a final newline as a line
    start = 0
    if lines and lines[0].strip() == "---":
        closing = next((i for i in range(1, len(lines)) if lines[i].strip() == "---"), None)
        if closing is not None:
            start = closing + 1
    heads: list[tuple[int, str]] = []
    fence: str | None = None
    for i in range(start, len(lines)):
        match = _FENCE.match(lines[i])
        if fence:
            if match and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence) \
                    and not lines[i].strip()[len(match.group(1)):].strip():
                fence = None
            continue
        if match:
            fence = match.group(1)
            continue
        heading = _ATX.match(lines[i])
        if heading:
            heads.append((i + 1, _ANCHOR.sub("", heading.group(2)).strip()))
    return [Section(text_, line, (heads[n + 1][0] - 1) if n + 1 < len(heads) else len(lines))
            for n, (line, text_) in enumerate(heads)]


@dataclass
class Query:
    id: str
    text: str
    kind: str
    gold: list[tuple[str, int, int]]  # (path, start, end) of each gold section
    phrasings: list[str] = field(default_factory=list)  # extra phrasings, sent as `queries`


def load_phrasings(path: Path | None) -> dict[str, list[str]]:
    if path is None:
        return {}
    items = (json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip())
    return {item["id"]: list(item["queries"]) for item in items}


def load_queries(paths: Sequence[Path], corpus: Path, corpus_id: str,
                 phrasings: dict[str, list[str]] | None = None) -> list[Query]:
    queries = []
    cache: dict[str, list[Section]] = {}
    lines = [line for path in paths for line in path.read_text(encoding="utf-8").splitlines()]
    for line in lines:
        if not line.strip():
            continue
        item = json.loads(line)
        if item.get("corpus", corpus_id) != corpus_id:
            continue
        gold = []
        for label in item.get("gold", []):
            if label["path"] not in cache:
                cache[label["path"]] = atx_sections((corpus / label["path"]).read_text(encoding="utf-8-sig"))
            found = [s for s in cache[label["path"]] if s.heading == label["heading"]]
            if len(found) != 1:
                raise SystemExit(f"{item['id']}: gold heading {label['heading']!r} not found once in {label['path']}")
            gold.append((label["path"], found[0].start, found[0].end))
        extra = [] if phrasings is None else phrasings.get(item["id"], item.get("phrasings", []))
        queries.append(Query(item["id"], item["query"], item.get("kind", "all"), gold, list(extra)))
    return queries


CONFIDENCE_ORDER = {"low": 0, "medium": 1, "high": 2}


@dataclass
class Outcome:
    query: Query
    results: list[dict[str, Any]]
    seconds: float
    error: str | None = None
    confidence: str | None = None
    confidence_score: float | None = None

    def file_hit(self, k: int = 5) -> bool:
        paths = {g[0] for g in self.query.gold}
        return any(r["path"] in paths for r in self.results[:k])

    def section_hit(self, k: int = 5) -> bool:
        return any(r["path"] == p and r["start_line"] <= end and r["end_line"] >= start
                   for r in self.results[:k] for p, start, end in self.query.gold)

    def reciprocal_rank(self, k: int = 10) -> float:
        paths = {g[0] for g in self.query.gold}
        return next((1.0 / (i + 1) for i, r in enumerate(self.results[:k]) if r["path"] in paths), 0.0)

    def top_score(self) -> float:
        """The top-1 cosine score; keyword mode has none, so its fused rank score stands in."""
        if not self.results:
            return float("-inf")
        top = self.results[0]
        return float(top["score"] if top.get("score") is not None else top.get("rank_score", 0.0))

    def confidence_value(self) -> float:
        return float(CONFIDENCE_ORDER.get(self.confidence or "low", 0)) if self.results else -1.0

    def score_value(self) -> float:
        """The response's confidence_score (no results: below any score)."""
        return float(self.confidence_score) if self.results and self.confidence_score is not None else float("-inf")


def auroc(positives: Sequence[float], negatives: Sequence[float]) -> float | None:
    if not positives or not negatives:
        return None
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in positives for n in negatives)
    return wins / (len(positives) * len(negatives))


def flagged_at(answerable: Sequence[float], unanswerable: Sequence[float], share: float = 0.10) -> float | None:
    """The share of unanswerable queries scored below the highest cut that flags at most `share`
    of the answerable ones (the issue's "low at <= 10% of answerable" point, on the score)."""
    if not answerable or not unanswerable:
        return None
    cut = sorted(answerable)[int(share * len(answerable))]  # fewer than share*n answerable lie below it
    return sum(value < cut for value in unanswerable) / len(unanswerable)


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


@dataclass
class Row:
    kind: str
    n: int
    file_hit5: float | None
    section_hit5: float | None
    mrr10: float | None
    auroc: float | None
    p50_ms: float
    p95_ms: float
    errors: int = 0
    confidence_auroc: float | None = None
    answerable_low: float | None = None  # share of answerable queries whose confidence is low
    unanswerable_low: float | None = None  # share of unanswerable ones
    score_auroc: float | None = None  # of confidence_score
    unanswerable_flagged: float | None = None  # below the score cut that flags <= 10% of answerable


def summarise(outcomes: Sequence[Outcome]) -> list[Row]:
    by_kind: dict[str, list[Outcome]] = defaultdict(list)
    for outcome in outcomes:
        by_kind[outcome.query.kind].append(outcome)
    negatives = [o.top_score() for o in outcomes if not o.query.gold]
    negative_confidence = [o.confidence_value() for o in outcomes if not o.query.gold]
    negative_scores = [o.score_value() for o in outcomes if not o.query.gold]
    rows = []
    for kind, group in [*sorted(by_kind.items()), ("all", list(outcomes))]:
        answerable = [o for o in group if o.query.gold]
        mean = (lambda xs: sum(xs) / len(xs)) if answerable else (lambda xs: None)
        latencies = [o.seconds * 1000 for o in group]
        unanswerable = [o for o in group if not o.query.gold]
        share_low = (lambda xs: sum(o.confidence_value() <= 0 for o in xs) / len(xs) if xs else None)
        rows.append(Row(
            kind=kind, n=len(group),
            file_hit5=mean([o.file_hit() for o in answerable]),
            section_hit5=mean([o.section_hit() for o in answerable]),
            mrr10=mean([o.reciprocal_rank() for o in answerable]),
            auroc=auroc([o.top_score() for o in answerable], negatives) if kind == "all" else None,
            p50_ms=statistics.median(latencies), p95_ms=percentile(latencies, 0.95),
            errors=sum(1 for o in group if o.error),
            confidence_auroc=auroc([o.confidence_value() for o in answerable], negative_confidence)
            if kind == "all" else None,
            answerable_low=share_low(answerable), unanswerable_low=share_low(unanswerable),
            score_auroc=auroc([o.score_value() for o in answerable], negative_scores) if kind == "all" else None,
            unanswerable_flagged=flagged_at([o.score_value() for o in answerable], negative_scores)
            if kind == "all" else None))
    return rows


def markdown_table(mode: str, rows: Sequence[Row]) -> str:
    def fmt(value: float | None) -> str:
        return "" if value is None else f"{value:.3f}"

    out = [f"mode: {mode}", "",
           "| kind | n | file_hit@5 | section_hit@5 | MRR@10 | AUROC top-1 | AUROC confidence | low: answerable "
           "| low: unanswerable | AUROC confidence_score | unanswerable below the 10% cut | p50 ms | p95 ms | errors |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        out.append(f"| {r.kind} | {r.n} | {fmt(r.file_hit5)} | {fmt(r.section_hit5)} | {fmt(r.mrr10)} | "
                   f"{fmt(r.auroc)} | {fmt(r.confidence_auroc)} | {fmt(r.answerable_low)} | "
                   f"{fmt(r.unanswerable_low)} | {fmt(r.score_auroc)} | {fmt(r.unanswerable_flagged)} | "
                   f"{r.p50_ms:.0f} | {r.p95_ms:.0f} | {r.errors} |")
    return "\n".join(out)


def build_index(corpus: Path, store: Path) -> dict[str, Any]:
    done = subprocess.run([sys.executable, str(ROOT / "ingest.py"), "--corpus", str(corpus), "--store", str(store), "--json"],
                          capture_output=True, text=True)
    if done.returncode == 2:
        raise SystemExit(f"ingest failed (exit 2):\n{done.stderr}")
    sys.stderr.write(done.stderr.splitlines()[-1] + "\n" if done.stderr else "")
    return json.loads(done.stdout.strip().splitlines()[-1])


def arguments(query: Query) -> dict[str, Any]:
    return {"query": query.text, **({"queries": query.phrasings} if query.phrasings else {})}


async def run_queries(queries: Sequence[Query], modes: Sequence[str], env: dict[str, str], k: int) -> dict[str, list[Outcome]]:
    from mcp import Client, StdioServerParameters

    params = StdioServerParameters(command=sys.executable, args=[str(ROOT / "server.py")], env=env, cwd=str(ROOT))
    outcomes: dict[str, list[Outcome]] = {mode: [] for mode in modes}
    async with Client(params, read_timeout_seconds=120) as client:
        # One untimed pass embeds every query, so each mode is timed on the same footing (the
        # server caches query embeddings); the pass's own latency is reported separately.
        first: list[float] = []
        for query in queries:
            started = time.perf_counter()
            await client.call_tool("search_corpus", {**arguments(query), "k": 1, "mode": "vector"})
            first.append(time.perf_counter() - started)
        outcomes["first-call"] = [Outcome(q, [], s) for q, s in zip(queries, first)]
        for mode in modes:
            for query in queries:
                started = time.perf_counter()
                result = await client.call_tool("search_corpus", {**arguments(query), "k": k, "mode": mode})
                seconds = time.perf_counter() - started
                if result.is_error:
                    text = result.content[0].text if result.content else ""  # type: ignore[union-attr]
                    outcomes[mode].append(Outcome(query, [], seconds, text[:300]))
                else:
                    content = result.structured_content or {}
                    outcomes[mode].append(Outcome(query, list(content.get("results", [])), seconds,
                                                  confidence=content.get("confidence"),
                                                  confidence_score=content.get("confidence_score")))
    return outcomes


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("queries", type=Path, nargs="+", help="query files (JSON lines), read in order")
    parser.add_argument("--corpus", type=Path, required=True)
    parser.add_argument("--query-corpus", help="run only query lines whose 'corpus' equals this (default: folder name)")
    parser.add_argument("--store", type=Path, help="index folder to (re)use; default: a temporary one")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--runs", type=Path, help="write one run file per mode here (dev-set score.py format)")
    parser.add_argument("--json", type=Path, help="write the tables as JSON here")
    parser.add_argument("--phrasings", type=Path, help="extra phrasings per query id (JSON lines {id, queries})")
    args = parser.parse_args(argv)
    corpus = args.corpus.resolve()
    modes = [m for m in args.modes.split(",") if m]
    queries = load_queries(args.queries, corpus, args.query_corpus or corpus.name,
                           load_phrasings(args.phrasings) if args.phrasings else None)
    if not queries:
        raise SystemExit("no queries matched; check --query-corpus")
    with tempfile.TemporaryDirectory(prefix="rag-eval-") as tmp:
        store = (args.store or Path(tmp) / "store").resolve()
        summary = build_index(corpus, store)
        env = {"RAG_STORE_DIR": str(store), "RAG_CORPUS_DIR": str(corpus),
               "OLLAMA_HOST": os.environ.get("OLLAMA_HOST", "http://127.0.0.1:11434")}
        outcomes = asyncio.run(run_queries(queries, modes, env, args.k))
    report: dict[str, Any] = {"corpus": str(corpus), "queries": len(queries), "chunks": summary.get("chunks_written"),
                              "embedder": env["OLLAMA_HOST"], "phrasings": sum(1 for q in queries if q.phrasings),
                              "modes": {}}
    first_ms = [o.seconds * 1000 for o in outcomes["first-call"]]
    report["first_call_ms"] = {"p50": statistics.median(first_ms), "p95": percentile(first_ms, 0.95)}
    print(f"corpus {corpus} - {len(queries)} queries - embedder at {env['OLLAMA_HOST']}")
    print(f"first call per query (includes the query embedding): p50 {report['first_call_ms']['p50']:.0f} ms, "
          f"p95 {report['first_call_ms']['p95']:.0f} ms; the tables below reuse cached query embeddings\n")
    for mode in modes:
        rows = summarise(outcomes[mode])
        report["modes"][mode] = [vars(r) for r in rows]
        print(markdown_table(mode, rows) + "\n")
        for o in outcomes[mode]:
            if o.error:
                print(f"  {o.query.id}: error {o.error}", file=sys.stderr)
        if args.runs:
            args.runs.mkdir(parents=True, exist_ok=True)
            with open(args.runs / f"run-{corpus.name}-{mode}.jsonl", "w", encoding="utf-8") as fh:
                for o in outcomes[mode]:
                    fh.write(json.dumps({"id": o.query.id, "results": o.results}, ensure_ascii=False) + "\n")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2), encoding="utf-8")
    return 1 if any(o.error for mode in modes for o in outcomes[mode]) else 0


if __name__ == "__main__":
    sys.exit(main())
