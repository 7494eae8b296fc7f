"""Retrieval quality, measured end to end: the real ingest.py and the real server over stdio.

    python tools/eval.py QUERIES.jsonl [MORE.jsonl ...] --corpus DIR [--store DIR]
                         [--modes hybrid,vector,keyword] [--phrasings FILE] [--evidence FILE]
                         [--json FILE] [--runs DIR] [--save RUN.json] [--compare OLD.json] [--check-k]
                         [--vectors-share X]
    python tools/eval.py --compare OLD.json NEW.json
    python tools/eval.py --table RUN.json [RUN.json ...]
    python tools/eval.py --loco RUN.json RUN.json [...]

Builds an index of DIR with ingest.py (in a temporary store unless --store is given) against
whatever OLLAMA_HOST points to, counts its fragment chunks (under the index's chunk minimum in a
document of several chunks, or sharing a line with another chunk: a piece of a cut line), runs
every query through `python server.py` with an MCP client, and prints per query kind:
file_hit@5, section_hit@5, MRR@10, and latency p50/p95, for each mode; over all queries, how well the top-1 score, the response's `confidence`
(low < medium < high) and its `confidence_score` tell answerable from unanswerable queries
(AUROC), the share of each marked low, and the share of unanswerable ones scored below the
cut that flags at most 10% of the answerable ones.

A query line: {"id", "query", "kind", "gold": [{"path", "heading"} or {"path", "symbol", "lines"}], "corpus"?,
"phrasings"?}. --evidence FILE (the dev set's evidence.jsonl) takes each gold section's lines from it,
as the dev set defines sections in every format (MDX, reStructuredText); without it a gold heading is
looked up among the file's ATX headings (Markdown).
`gold: []` marks an unanswerable (negative) query. With --phrasings FILE (lines {"id",
"queries": [...]}), each query is sent with those extra phrasings in `queries` (a line's own
"phrasings" are used when FILE has none for it): the multi-phrasing search an agent makes.
When lines carry "corpus", only those equal to --query-corpus (default: the corpus folder's
name) are run. A gold section runs from its ATX heading line to the line before the next
heading of any level, fences and front matter excluded (the dev set's definition).

--save RUN.json writes the tables and everything a later comparison needs: the settings (corpus,
modes, phrasings or not, k, embedder host and the index's model, the checkout's commit and
whether it was dirty) and, per mode and query, its gold, ranked results, confidence and metrics.
--compare OLD.json compares this run with a saved one, --compare OLD.json NEW.json two saved
runs without running anything: per mode and kind the metrics before -> after, and every query
whose file hit, section hit or reciprocal rank moved (better, worse, or mixed), in Markdown for
a commit message, so a change that trades one query for another shows. --table prints the
dev-set tables of tools/README.md from saved runs (one single-query and one phrasings run per corpus).
--loco reports confidence leave one corpus out from saved runs of two corpora: the
confidence_score cut that flags at most 10% of one corpus's answerable queries, applied to the
other's, with each held-out corpus's AUROC of confidence_score and of the level, and the shares
flagged by the cut and marked low; single-query and phrasings runs are paired among themselves.
--check-k also asks every query in every mode (with its phrasings under --phrasings) for each k
from 1 to 20 on the same session, unfiltered, under the folder of its first gold file (of its
first result when unanswerable) and, in hybrid and vector mode, with min_score at the median
score of its k=20 results, and checks that the results for k are exactly the first k of those
for k=20 by (path, start_line, end_line); it prints the searches that depend on k, and exits 1
if any does.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the checkout's own modules, whichever folder the script runs from
sys.path.insert(0, str(ROOT / "tools"))  # tools/readme_section.py

import readme_section

from corpus_rules import CurrentIndex, EmbeddedVectors, StoreLayout, number_ranges, searchable_tokens

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
    quotes: list[str] = field(default_factory=list)  # verbatim sentences of the answer (evidence.jsonl)


def load_phrasings(path: Path | None) -> dict[str, list[str]]:
    if path is None:
        return {}
    items = (json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip())
    return {item["id"]: list(item["queries"]) for item in items}


def load_evidence(path: Path | None) -> dict[tuple[str, str, str], tuple[int, int]]:
    """The gold sections' line ranges a dev set's evidence file records, by (query id, path, heading
    or symbol): the dev set's own section definition, whatever the format."""
    if path is None:
        return {}
    out = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        item = json.loads(line) if line.strip() else {"gold": []}
        for label in item["gold"]:
            lines = label.get("section_lines") or label.get("lines")
            if lines:
                out[(item["id"], label["path"], label.get("heading") or label.get("symbol"))] = (lines[0], lines[1])
    return out


def load_quotes(path: Path | None) -> dict[str, list[str]]:
    """The verbatim answer quotes a dev set's evidence file records, by query id (evidence@5)."""
    if path is None:
        return {}
    out: dict[str, list[str]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            item = json.loads(line)
            out[item["id"]] = [label["quote"] for label in item["gold"] if label.get("quote")]
    return out


def load_queries(paths: Sequence[Path], corpus: Path, corpus_id: str,
                 phrasings: dict[str, list[str]] | None = None,
                 evidence: Mapping[tuple[str, str, str], tuple[int, int]] | None = None,
                 quotes: Mapping[str, list[str]] | None = None) -> list[Query]:
    """The queries of `corpus_id`, each gold label with its section's lines: from the dev set's
    evidence file where given, else from the gold's own lines (a code symbol's), else the file's ATX
    sections (Markdown and MDX)."""
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
            known = (evidence or {}).get((item["id"], label["path"], label.get("heading") or label.get("symbol")))
            if known is None and "lines" in label:
                known = (label["lines"][0], label["lines"][1])
            if known is not None:
                gold.append((label["path"], *known))
                continue
            if label["path"] not in cache:
                cache[label["path"]] = atx_sections((corpus / label["path"]).read_text(encoding="utf-8-sig"))
            found = [s for s in cache[label["path"]] if s.heading == label["heading"]]
            if len(found) != 1:
                raise SystemExit(f"{item['id']}: gold heading {label['heading']!r} not found once in {label['path']} "
                                 "(for a format other than Markdown, pass the dev set's --evidence file)")
            gold.append((label["path"], found[0].start, found[0].end))
        extra = [] if phrasings is None else phrasings.get(item["id"], item.get("phrasings", []))
        queries.append(Query(item["id"], item["query"], item.get("kind", "all"), gold, list(extra),
                             list((quotes or {}).get(item["id"], []))))
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
    chars: int = 0  # the response's structured content, as compact JSON
    evidence: bool | None = None  # a saved run's evidence_hit (its results keep no text)

    def evidence_hit(self, k: int = 5) -> bool | None:
        """A verbatim answer quote inside the text of a top-k hit: the answer in hand after one
        call (None without quotes)."""
        if self.evidence is not None or not self.query.quotes:
            return self.evidence
        return any(quote in hit.get("text", "") for hit in self.results[:k] for quote in self.query.quotes)

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


def score_cut(answerable: Sequence[float], share: float = 0.10) -> float:
    """The highest cut that flags (scores below) at most `share` of the answerable queries."""
    return sorted(answerable)[int(share * len(answerable))]  # fewer than share*n answerable lie below it


def share_below(values: Sequence[float], cut: float) -> float | None:
    return sum(value < cut for value in values) / len(values) if values else None


def flagged_at(answerable: Sequence[float], unanswerable: Sequence[float], share: float = 0.10) -> float | None:
    """The share of unanswerable queries scored below the highest cut that flags at most `share`
    of the answerable ones (the issue's "low at <= 10% of answerable" point, on the score)."""
    if not answerable or not unanswerable:
        return None
    return share_below(unanswerable, score_cut(answerable, share))


def low_share(outcomes: Sequence[Outcome]) -> float | None:
    """The share marked `low` (no results count as low too)."""
    return sum(o.confidence_value() <= 0 for o in outcomes) / len(outcomes) if outcomes else None


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


@dataclass
class Row:
    kind: str
    n: int
    answerable: int
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
    evidence5: float | None = None  # of the answerable queries with quotes
    chars_p50: float | None = None
    chars_max: int | None = None


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
        rows.append(Row(
            kind=kind, n=len(group), answerable=len(answerable),
            file_hit5=mean([o.file_hit() for o in answerable]),
            section_hit5=mean([o.section_hit() for o in answerable]),
            mrr10=mean([o.reciprocal_rank() for o in answerable]),
            auroc=auroc([o.top_score() for o in answerable], negatives) if kind == "all" else None,
            p50_ms=statistics.median(latencies), p95_ms=percentile(latencies, 0.95),
            errors=sum(1 for o in group if o.error),
            confidence_auroc=auroc([o.confidence_value() for o in answerable], negative_confidence)
            if kind == "all" else None,
            answerable_low=low_share(answerable), unanswerable_low=low_share(unanswerable),
            score_auroc=auroc([o.score_value() for o in answerable], negative_scores) if kind == "all" else None,
            unanswerable_flagged=flagged_at([o.score_value() for o in answerable], negative_scores)
            if kind == "all" else None,
            evidence5=(lambda found: sum(found) / len(found) if found else None)(
                [hit for o in answerable if (hit := o.evidence_hit()) is not None]),
            chars_p50=statistics.median([o.chars for o in group]) if group else None,
            chars_max=max((o.chars for o in group), default=None)))
    return rows


def fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}"


def share(value: float | None) -> str:
    return "" if value is None else f"{value:.0%}"


def markdown_table(mode: str, rows: Sequence[Row]) -> str:
    out = [f"mode: {mode}", "",
           ("| kind | n | file_hit@5 | section_hit@5 | MRR@10 | AUROC top-1 | AUROC confidence | low: answerable "
            "| low: unanswerable | AUROC confidence_score | unanswerable below the 10% cut | evidence@5 | chars p50 "
            "| chars max | p50 ms | p95 ms | errors |"),
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        out.append(f"| {r.kind} | {r.n} | {fmt(r.file_hit5)} | {fmt(r.section_hit5)} | {fmt(r.mrr10)} | "
                   f"{fmt(r.auroc)} | {fmt(r.confidence_auroc)} | {fmt(r.answerable_low)} | "
                   f"{fmt(r.unanswerable_low)} | {fmt(r.score_auroc)} | {fmt(r.unanswerable_flagged)} | "
                   f"{fmt(r.evidence5)} | {r.chars_p50 or 0:.0f} | {r.chars_max or 0} | "
                   f"{r.p50_ms:.0f} | {r.p95_ms:.0f} | {r.errors} |")
    return "\n".join(out)


# ---------------------------------------------------------------------------
# Saved runs (--save): what --compare, --table and --loco read later without running anything.

RESULT_KEYS = ("path", "start_line", "end_line", "heading", "score", "rank_score")


def outcome_record(outcome: Outcome) -> dict[str, Any]:
    """One query of one mode as --save writes it: the query, its gold, the ranked results, the
    confidence, and its metrics (null for an unanswerable query, which has none)."""
    answerable = bool(outcome.query.gold)
    return {"id": outcome.query.id, "kind": outcome.query.kind, "query": outcome.query.text,
            "phrasings": outcome.query.phrasings,
            "gold": [{"path": path, "start_line": start, "end_line": end} for path, start, end in outcome.query.gold],
            "results": [{key: hit.get(key) for key in RESULT_KEYS} for hit in outcome.results],
            "confidence": outcome.confidence, "confidence_score": outcome.confidence_score,
            "error": outcome.error, "ms": round(outcome.seconds * 1000, 1),
            "file_hit5": outcome.file_hit() if answerable else None,
            "section_hit5": outcome.section_hit() if answerable else None,
            "rr10": outcome.reciprocal_rank() if answerable else None,
            "evidence5": outcome.evidence_hit() if answerable else None, "chars": outcome.chars}


def outcome_from_record(record: Mapping[str, Any]) -> Outcome:
    gold = [(g["path"], g["start_line"], g["end_line"]) for g in record["gold"]]
    query = Query(record["id"], record["query"], record["kind"], gold, list(record["phrasings"]))
    return Outcome(query, list(record["results"]), record["ms"] / 1000, record["error"],
                   record["confidence"], record["confidence_score"], record.get("chars", 0), record.get("evidence5"))


def saved_run(settings: Mapping[str, Any], outcomes: Mapping[str, Sequence[Outcome]]) -> dict[str, Any]:
    """What --save writes, and --compare, --table and --loco read: the settings, each mode's
    summary rows (the --json tables) and every query's record."""
    return {"settings": dict(settings), "modes": {mode: [vars(r) for r in summarise(group)] for mode, group in outcomes.items()},
            "outcomes": {mode: [outcome_record(o) for o in group] for mode, group in outcomes.items()}}


def checkout_state(root: Path) -> tuple[str | None, bool | None]:
    """The checkout's short commit, and whether tracked files differ from it (None outside git)."""
    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", "-C", str(root), *args], check=False, capture_output=True, text=True)

    head = git("rev-parse", "--short", "HEAD")
    if head.returncode != 0:
        return None, None
    return head.stdout.strip(), bool(git("status", "--porcelain", "--untracked-files=no").stdout.strip())


def run_setting(report: Mapping[str, Any]) -> tuple[str, bool]:
    """(corpus name, with phrasings?) of a saved run; --json reports from before `settings` say it too."""
    settings = report.get("settings")
    if settings:
        return settings["corpus"], settings["phrasings"]
    return Path(report["corpus"]).name, report["phrasings"] > 0


def run_label(report: Mapping[str, Any]) -> str:
    corpus, phrasings = run_setting(report)
    settings = report.get("settings", {})
    commit = (settings.get("commit") or "?") + ("+dirty" if settings.get("dirty") else "")
    return f"{corpus} {'phrasings' if phrasings else 'single'} @ {commit}"


def shown_value(value: bool | float | None) -> str:
    return "hit" if value is True else "miss" if value is False else fmt(value)


def change(before: float | None, after: float | None) -> str:
    return fmt(after) if before == after else f"{fmt(before)} -> {fmt(after)}"


@dataclass(frozen=True)
class QueryChange:
    id: str
    kind: str
    moves: tuple[tuple[str, Any, Any], ...]  # (metric, before, after) of each metric that changed

    @property
    def verdict(self) -> str:
        if all(after > before for _metric, before, after in self.moves):
            return "better"
        return "worse" if all(after < before for _metric, before, after in self.moves) else "mixed"


QUERY_METRICS = (("file_hit5", "file"), ("section_hit5", "section"), ("rr10", "RR@10"), ("evidence5", "evidence"))


def query_changes(old: Sequence[Mapping[str, Any]], new: Sequence[Mapping[str, Any]]) -> list[QueryChange]:
    """Every query of both runs whose file hit, section hit or reciprocal rank changed, in the new run's order."""
    before = {record["id"]: record for record in old}
    changes = []
    for record in new:
        prior = before.get(record["id"])
        if prior is None or not record["gold"]:
            continue
        moves = tuple((label, prior.get(key), record.get(key)) for key, label in QUERY_METRICS
                      if prior.get(key) != record.get(key) and None not in (prior.get(key), record.get(key)))
        if moves:
            changes.append(QueryChange(record["id"], record["kind"], moves))
    return changes


def compare_runs(old: Mapping[str, Any], new: Mapping[str, Any]) -> str:
    """Markdown for a commit message: per mode and kind the metrics before -> after, then every
    query that got better, worse, or both (one metric up, another down)."""
    if "outcomes" not in old or "outcomes" not in new:
        raise SystemExit("--compare needs runs written by --save (per-query results)")
    out = [f"{run_label(old)} -> {run_label(new)}"]
    for key in ("corpus", "phrasings", "embedder_model", "k", "context"):
        if old["settings"].get(key) != new["settings"].get(key):
            out.append(f"(the runs differ in {key}: {old['settings'].get(key)} -> {new['settings'].get(key)})")
    for mode in [m for m in new["outcomes"] if m in old["outcomes"]]:
        out += ["", f"{mode}:", "", "| kind | n | file_hit@5 | section_hit@5 | MRR@10 | evidence@5 |",
                "| --- | --- | --- | --- | --- | --- |"]
        before = {row["kind"]: row for row in old["modes"][mode]}
        for row in new["modes"][mode]:
            prior = before.get(row["kind"])
            if prior is not None and row["file_hit5"] is not None:
                out.append(f"| {row['kind']} | {answerable_n(row)} | " + " | ".join(
                    change(prior.get(key), row.get(key)) for key in ("file_hit5", "section_hit5", "mrr10", "evidence5"))
                    + " |")
        changes = query_changes(old["outcomes"][mode], new["outcomes"][mode])
        verdicts = [c.verdict for c in changes]
        out += ["", ", ".join(f"{verdicts.count(v)} {v}" for v in ("better", "worse", "mixed")) + " (queries)"]
        out += [f"- {c.verdict}: {c.id} ({c.kind}): " + ", ".join(
                f"{metric} {shown_value(before_)} -> {shown_value(after)}" for metric, before_, after in c.moves)
                for verdict in ("better", "worse", "mixed") for c in changes if c.verdict == verdict]
        only = sorted({r["id"] for r in old["outcomes"][mode]} ^ {r["id"] for r in new["outcomes"][mode]})
        out += [f"in one run only: {', '.join(only)}"] if only else []
    return "\n".join(out)


def answerable_n(row: Mapping[str, Any]) -> int:
    """Answerable queries of a summary row (reports from before that count was saved: a kind with
    metrics is taken as answerable throughout, as every dev-set kind is)."""
    return row.get("answerable", row["n"] if row["file_hit5"] is not None else 0)


def triple(row: Mapping[str, Any]) -> str:
    return " / ".join(fmt(row[key]) for key in ("file_hit5", "section_hit5", "mrr10"))


def readme_tables(reports: Sequence[Mapping[str, Any]], mode: str = "hybrid") -> str:
    """The dev-set tables of tools/README.md from saved runs, one single-query and one phrasings run per
    corpus: file_hit@5 / section_hit@5 / MRR@10 per corpus and kind (in `mode`), every mode's
    totals, and how well confidence tells answerable from unanswerable queries (in `mode`)."""
    runs: dict[str, dict[str, Mapping[str, Any]]] = {}
    for report in reports:
        corpus, phrasings = run_setting(report)
        runs.setdefault(corpus, {})["phrasings" if phrasings else "single"] = report
    columns = ("single", "phrasings")

    def rows(corpus: str, column: str, mode_: str = mode) -> dict[str, Mapping[str, Any]]:
        report = runs[corpus].get(column)
        return {row["kind"]: row for row in report["modes"].get(mode_, [])} if report else {}

    out = [f"file_hit@5 / section_hit@5 / MRR@10, {mode} mode:", "", "| corpus | kind | n | single | phrasings |",
           "| --- | --- | --- | --- | --- |"]
    for corpus in sorted(runs):
        by_column = {column: rows(corpus, column) for column in columns}
        kinds = list(dict.fromkeys(kind for column in columns for kind in by_column[column] if kind != "all"))
        label = corpus
        for kind in [*kinds, "all"]:
            reference = next((by_column[c] for c in columns if kind in by_column[c]), None)
            if reference is None or reference[kind]["file_hit5"] is None:
                continue  # unanswerable queries have no hit metrics
            cells = [triple(by_column[c][kind]) if kind in by_column[c] else "" for c in columns]
            if kind == "all":
                n = sum(answerable_n(row) for k, row in reference.items() if k != "all")
                out.append(f"| {label} | **all ({n})** | | " + " | ".join(f"**{c}**" if c else "" for c in cells) + " |")
            else:
                out.append(f"| {label} | {kind} | {answerable_n(reference[kind])} | " + " | ".join(cells) + " |")
            label = ""
    modes = [m for m in MODES if any(m in r["modes"] for r in reports)]
    out += ["", "By mode, over each corpus's answerable queries:", "",
            "| corpus | | " + " | ".join(modes) + " |", "| --- | --- | " + " | ".join("---" for _ in modes) + " |"]
    for corpus in sorted(runs):
        for column in columns:
            if column in runs[corpus]:
                cells = [triple(rows(corpus, column, m)["all"]) if "all" in rows(corpus, column, m) else ""
                         for m in modes]
                out.append(f"| {corpus} | {column} | " + " | ".join(cells) + " |")

    out += ["", f"Telling answerable from unanswerable ({mode}):", "",
            ("| corpus | | AUROC top-1 score | AUROC confidence | AUROC `confidence_score` | `low`: answerable "
             "| `low`: unanswerable | unanswerable below the 10% cut |"), "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for corpus in sorted(runs):
        for column in columns:
            total = rows(corpus, column).get("all")
            if total:
                out.append(f"| {corpus} | {column} | {fmt(total['auroc'])} | {fmt(total['confidence_auroc'])} | "
                           f"{fmt(total['score_auroc'])} | {share(total['answerable_low'])} | "
                           f"{share(total['unanswerable_low'])} | {share(total['unanswerable_flagged'])} |")
    return "\n".join(out)


@dataclass(frozen=True)
class Fragments:
    """Chunks that are fragments (issue 25 §2): under the index's chunk minimum in a document of
    more than one chunk, or a piece of a cut line (sharing a line with another chunk of its
    document). `fragments` counts a chunk that is both once."""

    chunks: int
    fragments: int
    under_min: int
    shared_line: int
    min_tokens: int


def count_fragments(chunks: Iterable[tuple[str, int, int, str]], min_tokens: int) -> Fragments:
    """From (path, start_line, end_line, text) of every chunk; tokens are counted as the chunker
    counts them (searchable_tokens)."""
    by_path: dict[str, list[tuple[str, int, int, str]]] = defaultdict(list)
    for chunk in chunks:
        by_path[chunk[0]].append(chunk)
    total = under = shared = either = 0
    for group in by_path.values():
        group.sort(key=lambda chunk: (chunk[1], chunk[2]))
        reached = 0  # the last line any earlier chunk of the document covers
        for i, (_path, start, end, text) in enumerate(group):
            small = len(group) > 1 and searchable_tokens(text) < min_tokens
            cut = reached >= start or (i + 1 < len(group) and group[i + 1][1] <= end)
            reached = max(reached, end)
            total += 1
            under += small
            shared += cut
            either += small or cut
    return Fragments(total, either, under, shared, min_tokens)


def store_fragments(layout: StoreLayout, current: CurrentIndex) -> Fragments:
    """Fragments among the live index's chunks, read from its keyword database (read-only)."""
    database = layout.keyword_db(current.index)
    with contextlib.closing(sqlite3.connect(f"{database.as_uri()}?mode=ro", uri=True)) as connection:
        rows = connection.execute("SELECT path, start_line, end_line, text FROM chunks").fetchall()
    return count_fragments(rows, current.manifest.chunk_min_tokens)


def build_index(corpus: Path, store: Path, code: bool = False) -> dict[str, Any]:
    done = subprocess.run([sys.executable, str(ROOT / "ingest.py"), "--corpus", str(corpus), "--store", str(store), "--json",
                           *(["--code"] if code else [])], check=False, capture_output=True, text=True)
    if done.returncode == 2:
        raise SystemExit(f"ingest failed (exit 2):\n{done.stderr}")
    sys.stderr.write(done.stderr.splitlines()[-1] + "\n" if done.stderr else "")
    return json.loads(done.stdout.strip().splitlines()[-1])


def thinned_copy(store: Path, share: float, into: Path) -> None:
    """A copy of an embedded store (at `into`) as an ingest leaves it that embedded documents
    holding about `share` of the chunks and was then stopped: the others' vectors deleted, the
    documents waiting (vectors_pending), the stamp saying how many. Documents are taken in an
    order drawn from their paths, so every run and every change is measured on the same ones.
    """
    shutil.copytree(store, into)
    layout = StoreLayout(into)
    current = layout.read_current()
    if current is None:
        raise SystemExit(f"{store} holds no index")
    with contextlib.closing(sqlite3.connect(layout.keyword_db(current.index))) as db, db:
        documents = sorted(db.execute("SELECT path, lifecycle, chunk_count FROM documents"),
                           key=lambda row: hashlib.sha256(row[0].encode()).hexdigest())
        total, kept, waiting = sum(n for _, _, n in documents), 0, []
        for path, lifecycle, chunks in documents:
            if kept + chunks / 2 <= share * total:
                kept += chunks
            else:
                waiting.append((path, lifecycle, chunks))
        vectors = EmbeddedVectors(layout.chroma_dir(current.index), current.index)
        for path, lifecycle, chunks in waiting:
            ids = [i for (i,) in db.execute("SELECT id FROM chunks WHERE path = ?", (path,))]
            vectors.delete(lifecycle, ids)
            db.execute("INSERT OR REPLACE INTO vectors_pending(path, chunks) VALUES (?, ?)", (path, chunks))
        vectors.close()
    stamp = dataclasses.replace(current.stamp, vectors_pending=total - kept)
    layout.write_current(dataclasses.replace(current, stamp=stamp))


SEARCH_SCOPE: str | None = None  # --scope: search_corpus's scope for every query (None: the server's default)


def arguments(query: Query) -> dict[str, Any]:
    return {"query": query.text, **({"queries": query.phrasings} if query.phrasings else {}),
            **({"scope": SEARCH_SCOPE} if SEARCH_SCOPE else {})}


def error_text(result: Any) -> str:
    return (result.content[0].text if result.content else "")[:300]


async def run_queries(client: Any, queries: Sequence[Query], modes: Sequence[str], k: int,
                      context: str | None = None) -> dict[str, list[Outcome]]:
    outcomes: dict[str, list[Outcome]] = {mode: [] for mode in modes}
    # One untimed pass embeds every query, so each mode is timed on the same footing (the
    # server caches query embeddings); the pass's own latency is reported separately.
    first: list[float] = []
    for query in queries:
        started = time.perf_counter()
        await client.call_tool("search_corpus", {**arguments(query), "k": 1, "mode": "vector"})
        first.append(time.perf_counter() - started)
    outcomes["first-call"] = [Outcome(q, [], s) for q, s in zip(queries, first, strict=True)]
    for mode in modes:
        for query in queries:
            started = time.perf_counter()
            result = await client.call_tool("search_corpus", {**arguments(query), "k": k, "mode": mode,
                                                              **({"context": context} if context else {})})
            seconds = time.perf_counter() - started
            if result.is_error:
                outcomes[mode].append(Outcome(query, [], seconds, error_text(result)))
            else:
                content = result.structured_content or {}
                outcomes[mode].append(Outcome(query, list(content.get("results", [])), seconds,
                                              confidence=content.get("confidence"),
                                              confidence_score=content.get("confidence_score"),
                                              chars=len(json.dumps(content, ensure_ascii=False, separators=(",", ":")))))
    return outcomes


# ---------------------------------------------------------------------------
# The k check (--check-k, issue 25 §1): the first result never depends on k, and the results for
# k are exactly the first k results for k+1, in every mode, with path_prefix, queries, min_score.

K_SWEEP = 20  # the server's K_MAX: every k from 1 to it is asked
K_SHOWN = 5  # violations listed per mode


def k_violations(by_k: Mapping[int, Sequence[Mapping[str, Any]]]) -> list[int]:
    """The k whose results are not, by (path, start_line, end_line), the first k of the largest k's."""
    def spans(hits: Sequence[Mapping[str, Any]]) -> list[tuple[str, int, int]]:
        return [(hit["path"], hit["start_line"], hit["end_line"]) for hit in hits]

    longest = spans(by_k[max(by_k)])
    return [k for k in sorted(by_k) if spans(by_k[k]) != longest[:k]]


def folder_of(path: str) -> str:
    """A path's folder; a top-level file stands for itself (path_prefix matches files too)."""
    return path.rsplit("/", 1)[0] if "/" in path else path


def k_variants(query: Query, mode: str, longest: Sequence[Mapping[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """The filtered searches the k check repeats, from the unfiltered k=K_SWEEP results: under the
    folder of the first gold file (of the first result for an unanswerable query; the folder, not
    the top one, which on P1 is docs/ for every file and would filter nothing), and, where there
    are similarity scores, with min_score at their median."""
    variants: list[tuple[str, dict[str, Any]]] = []
    anchor = query.gold[0][0] if query.gold else (longest[0]["path"] if longest else None)
    if anchor:
        variants.append((f"path_prefix={folder_of(anchor)}", {"path_prefix": folder_of(anchor)}))
    scores = [hit["score"] for hit in longest if hit.get("score") is not None]
    if mode != "keyword" and scores:
        median = statistics.median(scores)
        variants.append((f"min_score={median:.4f}", {"min_score": median}))
    return variants


@dataclass(frozen=True)
class KViolation:
    mode: str
    query: str
    variant: str  # "" for the unfiltered search, else the filter added
    ks: tuple[int, ...]
    error: str | None = None


async def sweep_k(client: Any, search: Mapping[str, Any]) -> tuple[dict[int, list[dict[str, Any]]], str | None]:
    """The results of one search for every k from 1 to K_SWEEP (up to the first error, and it)."""
    found: dict[int, list[dict[str, Any]]] = {}
    for k in range(1, K_SWEEP + 1):
        result = await client.call_tool("search_corpus", {**search, "k": k})
        if result.is_error:
            return found, error_text(result)
        found[k] = list((result.structured_content or {}).get("results", []))
    return found, None


async def check_k(client: Any, queries: Sequence[Query], modes: Sequence[str]) -> tuple[dict[str, int], list[KViolation]]:
    """Searches swept per mode, and every sweep whose results depend on k (or that failed)."""
    sweeps = dict.fromkeys(modes, 0)
    violations = []
    for mode in modes:
        for query in queries:
            search = {**arguments(query), "mode": mode}
            plain = await sweep_k(client, search)
            for variant, extra in [("", {}), *k_variants(query, mode, plain[0].get(K_SWEEP, []))]:
                found, error = await sweep_k(client, {**search, **extra}) if extra else plain
                sweeps[mode] += 1
                ks = k_violations(found) if found else []
                if ks or error:
                    violations.append(KViolation(mode, query.id, variant, tuple(ks), error))
    return sweeps, violations




def k_report(sweeps: Mapping[str, int], violations: Sequence[KViolation]) -> str:
    out = [f"k check: results for k = the first k of k={K_SWEEP}, k = 1..{K_SWEEP}, by (path, start_line, end_line)"]
    for mode, swept in sweeps.items():
        found = [v for v in violations if v.mode == mode]
        first = sum(1 in v.ks for v in found)
        out.append(f"  {mode}: {len(found)} of {swept} searches depend on k ({first} in their first result)")
        out += [f"    {v.query}{' ' + v.variant if v.variant else ''}: "
                + (f"error {v.error}" if v.error else f"k {number_ranges(v.ks)}") for v in found[:K_SHOWN]]
    return "\n".join(out)


async def in_session(env: Mapping[str, str], queries: Sequence[Query], modes: Sequence[str], k: int,
                     k_check: bool, context: str | None = None,
                     ) -> tuple[dict[str, list[Outcome]], tuple[dict[str, int], list[KViolation]] | None]:
    """The evaluation run, then the k check if asked for, on one MCP client session of `python server.py`."""
    from mcp import Client, StdioServerParameters

    params = StdioServerParameters(command=sys.executable, args=[str(ROOT / "server.py")], env=dict(env), cwd=str(ROOT))
    async with Client(params, read_timeout_seconds=120) as client:
        outcomes = await run_queries(client, queries, modes, k, context)
        return outcomes, (await check_k(client, queries, modes) if k_check else None)


# ---------------------------------------------------------------------------
# Leave one corpus out (--loco): a confidence rule fitted on one corpus's answerable queries,
# measured on another's, so nothing is tuned to a single corpus's negatives.

AUROC_GOAL = {False: 0.80, True: 0.85}  # on each held-out corpus, single query / with phrasings (issue 41 §3)
FLAG_GOAL = 0.10  # at most this share of the answerable queries below the cut, and `low` with phrasings


@dataclass(frozen=True)
class HeldOut:
    """One direction: the confidence_score cut that flags at most FLAG_GOAL of `fitted_on`'s
    answerable queries, applied to `corpus`."""

    corpus: str
    fitted_on: str
    phrasings: bool
    mode: str
    cut: float
    score_auroc: float | None
    confidence_auroc: float | None
    answerable_below_cut: float | None
    answerable_low: float | None
    unanswerable_below_cut: float | None
    unanswerable_low: float | None

    def missed(self) -> list[str]:
        """The goals this held-out corpus misses."""
        checks = (("AUROC", self.score_auroc, AUROC_GOAL[self.phrasings], 1),
                  ("cut", self.answerable_below_cut, FLAG_GOAL, -1),
                  *((("low", self.answerable_low, FLAG_GOAL, -1),) if self.phrasings else ()))
        return [name for name, value, goal, sign in checks if value is None or sign * (value - goal) < 0]


def split_answerable(report: Mapping[str, Any], mode: str) -> tuple[list[Outcome], list[Outcome]]:
    if "outcomes" not in report:
        raise SystemExit("--loco needs runs written by --save (per-query confidence)")
    outcomes = [outcome_from_record(record) for record in report["outcomes"][mode]]
    return [o for o in outcomes if o.query.gold], [o for o in outcomes if not o.query.gold]


def held_out(fitted: Mapping[str, Any], tested: Mapping[str, Any], mode: str) -> HeldOut:
    cut = score_cut([o.score_value() for o in split_answerable(fitted, mode)[0]], FLAG_GOAL)
    answerable, unanswerable = split_answerable(tested, mode)
    (corpus, phrasings), (fitted_on, _) = run_setting(tested), run_setting(fitted)
    scores, negative_scores = [o.score_value() for o in answerable], [o.score_value() for o in unanswerable]
    return HeldOut(corpus=corpus, fitted_on=fitted_on, phrasings=phrasings, mode=mode, cut=cut,
                   score_auroc=auroc(scores, negative_scores),
                   confidence_auroc=auroc([o.confidence_value() for o in answerable],
                                          [o.confidence_value() for o in unanswerable]),
                   answerable_below_cut=share_below(scores, cut), answerable_low=low_share(answerable),
                   unanswerable_below_cut=share_below(negative_scores, cut), unanswerable_low=low_share(unanswerable))


def leave_one_corpus_out(reports: Sequence[Mapping[str, Any]]) -> list[HeldOut]:
    """Every ordered pair of runs of different corpora with the same phrasing setting, per mode both ran."""
    found = [held_out(fitted, tested, mode) for fitted in reports for tested in reports
             if run_setting(fitted)[0] != run_setting(tested)[0] and run_setting(fitted)[1] == run_setting(tested)[1]
             for mode in fitted["outcomes"] if mode in tested["outcomes"]]
    return sorted(found, key=lambda h: (h.phrasings, MODES.index(h.mode) if h.mode in MODES else len(MODES), h.corpus))


def loco_table(rows: Sequence[HeldOut]) -> str:
    out = [(f"Confidence, leave one corpus out: the confidence_score cut that flags at most {FLAG_GOAL:.0%} of one "
            f"corpus's answerable queries, applied to the other. Goals: AUROC >= {AUROC_GOAL[False]} single, "
            f">= {AUROC_GOAL[True]} with phrasings; at most {FLAG_GOAL:.0%} of answerable below the cut, and `low` "
            "with phrasings."), "",
           ("| held out | cut from | queries | mode | cut | AUROC `confidence_score` | AUROC confidence "
            "| answerable below cut | answerable `low` | unanswerable below cut | unanswerable `low` | goals |"),
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for h in rows:
        missed = h.missed()
        out.append(f"| {h.corpus} | {h.fitted_on} | {'phrasings' if h.phrasings else 'single'} | {h.mode} | "
                   f"{fmt(h.cut)} | {fmt(h.score_auroc)} | {fmt(h.confidence_auroc)} | {share(h.answerable_below_cut)} | "
                   f"{share(h.answerable_low)} | {share(h.unanswerable_below_cut)} | {share(h.unanswerable_low)} | "
                   f"{'met' if not missed else 'missed: ' + ', '.join(missed)} |")
    return "\n".join(out)


def read_runs(paths: Sequence[Path]) -> list[dict[str, Any]]:
    return [json.loads(path.read_text(encoding="utf-8")) for path in paths]


def runs_line(reports: Sequence[Mapping[str, Any]]) -> str:
    """Which saved runs a written section comes from: corpus, queries, commit, the index's model."""
    return "From the saved runs " + "; ".join(
        f"{run_label(r)} (embedder {r.get('settings', {}).get('embedder_model') or '?'})" for r in reports) + "."


def write_readme(path: str | None, section: str, text: str) -> int:
    """--write-readme: `text` into `section` of the file at `path` (nothing when None); the exit status."""
    if path is None:
        return 0
    try:
        readme_section.write_section(Path(path), section, text)
    except (readme_section.SectionError, OSError) as exc:
        print(f"eval: could not write the {section} section of {path}: {exc}", file=sys.stderr)
        return 2
    print(f"\nWrote the {section} section of {path}.", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("queries", type=Path, nargs="*", help="query files (JSON lines), read in order")
    parser.add_argument("--corpus", type=Path, help="the folder to index and search (needed to run queries)")
    parser.add_argument("--query-corpus", help="run only query lines whose 'corpus' equals this (default: folder name)")
    parser.add_argument("--store", type=Path, help="index folder to (re)use; default: a temporary one")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--runs", type=Path, help="write one run file per mode here (dev-set score.py format)")
    parser.add_argument("--json", type=Path, help="write the tables as JSON here")
    parser.add_argument("--save", type=Path, help="write the tables, settings and every query's results here")
    parser.add_argument("--compare", type=Path, nargs="+", metavar="RUN.json",
                        help="OLD: compare this run with OLD; OLD NEW: compare two saved runs, running nothing")
    parser.add_argument("--table", type=Path, nargs="+", metavar="RUN.json",
                        help="print the dev-set tables of tools/README.md from saved runs (single and phrasings per corpus)")
    parser.add_argument("--loco", type=Path, nargs="+", metavar="RUN.json",
                        help="confidence leave one corpus out, from saved runs of two or more corpora")
    parser.add_argument("--check-k", action="store_true",
                        help=f"also check that the results for every k in 1..{K_SWEEP} are the first k of k={K_SWEEP}")
    parser.add_argument("--vectors-share", type=float, metavar="X",
                        help="search a copy of the index in which only documents holding about X (0-1) of the "
                             "chunks have vectors, as an ingest stopped while embedding leaves it")
    parser.add_argument("--code", action="store_true", help="index source code too (ingest --code): P5")
    parser.add_argument("--scope", choices=("all", "docs", "code"),
                        help="search_corpus's scope for every query (default: the server's, all)")
    parser.add_argument("--phrasings", type=Path, help="extra phrasings per query id (JSON lines {id, queries})")
    parser.add_argument("--context", choices=("passage", "section", "neighbours"),
                        help="search_corpus's context for every search (default: none sent, the server's "
                             "own default; evidence@5 needs --evidence's quotes)")
    parser.add_argument("--evidence", type=Path, help="the dev set's evidence.jsonl: gold sections' line ranges as "
                                                      "it defines them (needed for formats other than Markdown)")
    parser.add_argument("--write-readme", nargs="?", const=str(readme_section.README), metavar="PATH",
                        help="with --table / --loco: also write the tables into the eval / eval-loco section of "
                             "tools/README.md (or PATH), between its <!-- NAME:begin --> and <!-- NAME:end --> markers")
    args = parser.parse_args(argv)
    if args.write_readme and not (args.table or args.loco):
        parser.error("--write-readme goes with --table or --loco (the tables of saved runs)")
    if args.table:
        reports = read_runs(args.table)
        text = readme_tables(reports)
        print(text)
        return write_readme(args.write_readme, "eval", f"{runs_line(reports)}\n\n{text}")
    if args.loco:
        reports = read_runs(args.loco)
        text = loco_table(leave_one_corpus_out(reports))
        print(text)
        return write_readme(args.write_readme, "eval-loco", f"{runs_line(reports)}\n\n{text}")
    if args.compare and len(args.compare) > 2:
        parser.error("--compare takes OLD.json, or OLD.json NEW.json")
    if args.compare and len(args.compare) == 2:
        print(compare_runs(*read_runs(args.compare)))
        return 0
    if not args.queries or not args.corpus:
        parser.error("running queries needs query files and --corpus")
    corpus = args.corpus.resolve()
    global SEARCH_SCOPE
    SEARCH_SCOPE = args.scope
    modes = [m for m in args.modes.split(",") if m]
    queries = load_queries(args.queries, corpus, args.query_corpus or corpus.name,
                           load_phrasings(args.phrasings) if args.phrasings else None, load_evidence(args.evidence),
                           load_quotes(args.evidence))
    if not queries:
        raise SystemExit("no queries matched; check --query-corpus")
    commit, dirty = checkout_state(ROOT)  # before the run: the code it ran, whatever changes meanwhile
    with tempfile.TemporaryDirectory(prefix="rag-eval-") as tmp:
        store = (args.store or Path(tmp) / "store").resolve()
        summary = build_index(corpus, store, args.code)
        if args.vectors_share is not None:
            store, built = Path(tmp) / "thinned", store
            thinned_copy(built, args.vectors_share, store)
        layout = StoreLayout(store)
        current = layout.read_current()
        if current and current.stamp.vectors_pending:
            print(f"vectors for {current.stamp.chunks - current.stamp.vectors_pending} of {current.stamp.chunks} "
                  "chunks", file=sys.stderr)
        fragments = store_fragments(layout, current) if current else None
        env = {"RAG_STORE_DIR": str(store), "RAG_CORPUS_DIR": str(corpus),
               "OLLAMA_HOST": os.environ.get("OLLAMA_HOST", "http://127.0.0.1:11434")}
        outcomes, k_checked = asyncio.run(in_session(env, queries, modes, args.k, args.check_k, args.context))
    settings = {"corpus": args.query_corpus or corpus.name, "corpus_dir": str(corpus), "modes": modes,
                "phrasings": any(q.phrasings for q in queries), "k": args.k, "code": args.code, "scope": args.scope,
                "context": args.context,  # None: the server's default
                "embedder_host": env["OLLAMA_HOST"],
                "embedder_model": current.manifest.model if current else None, "commit": commit, "dirty": dirty,
                "vectors_pending": current.stamp.vectors_pending if current else None}
    saved = saved_run(settings, {mode: outcomes[mode] for mode in modes})
    report: dict[str, Any] = {"corpus": str(corpus), "queries": len(queries), "chunks": summary.get("chunks_written"),
                              "embedder": env["OLLAMA_HOST"], "phrasings": sum(1 for q in queries if q.phrasings),
                              "settings": settings, "fragments": vars(fragments) if fragments else None,
                              "modes": saved["modes"]}
    first_ms = [o.seconds * 1000 for o in outcomes["first-call"]]
    report["first_call_ms"] = {"p50": statistics.median(first_ms), "p95": percentile(first_ms, 0.95)}
    print(f"corpus {corpus} - {len(queries)} queries - embedder at {env['OLLAMA_HOST']}")
    if fragments:
        print(f"fragment chunks: {fragments.fragments} of {fragments.chunks} ({fragments.under_min} under the "
              f"{fragments.min_tokens}-token minimum in a document of several chunks, {fragments.shared_line} "
              "sharing a line with another chunk)")
    print(f"first call per query (includes the query embedding): p50 {report['first_call_ms']['p50']:.0f} ms, "
          f"p95 {report['first_call_ms']['p95']:.0f} ms; the tables below reuse cached query embeddings\n")
    for mode in modes:
        print(markdown_table(mode, summarise(outcomes[mode])) + "\n")
        for o in outcomes[mode]:
            if o.error:
                print(f"  {o.query.id}: error {o.error}", file=sys.stderr)
        if args.runs:
            args.runs.mkdir(parents=True, exist_ok=True)
            with open(args.runs / f"run-{corpus.name}-{mode}.jsonl", "w", encoding="utf-8") as fh:
                for o in outcomes[mode]:
                    fh.write(json.dumps({"id": o.query.id, "results": o.results}, ensure_ascii=False) + "\n")
    if k_checked:
        print(k_report(*k_checked))
        report["k_check"] = {"sweeps": k_checked[0], "violations": [vars(v) for v in k_checked[1]]}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2), encoding="utf-8")
    if args.save:
        args.save.write_text(json.dumps({**report, **saved}, indent=1, ensure_ascii=False), encoding="utf-8")
    if args.compare:
        print(compare_runs(read_runs(args.compare)[0], saved))
    return 1 if any(o.error for mode in modes for o in outcomes[mode]) or (k_checked and k_checked[1]) else 0


if __name__ == "__main__":
    sys.exit(main())
