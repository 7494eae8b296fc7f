#!/usr/bin/env python3
"""Speed and scale of local-rag-mcp, each figure measured next to its limit in the same run.

    python tools/bench.py                 # full run: 1k, 10k and 100k chunks (about 10-11 min on 2 cores)
    python tools/bench.py --quick         # 1k chunks only, fewer repetitions (CI smoke, < 2 min)
    python tools/bench.py --scale         # growth: 1k -> 10k -> 100k -> 1M chunks, within --scale-budget
    python tools/bench.py --out FILE      # JSON results somewhere else (default: ./bench-results.json)

Prints a markdown table (figure, value, limit, ratio, goal, pass/fail) on stdout and writes the
same figures, the machine and the raw samples as JSON. Progress goes to stderr.

Besides speed at rest, it measures the ingest of real corpora: a slow embedder (a second fake
that takes 20 ms per text, one call at a time, like a CPU-only Ollama), `ingest.py --watch`
(edit to searchable through a live server), a no-op re-ingest with .ragignore rules and a
node_modules/ folder in play, and how many chunks an edit, a folder rename and `--full` send
to the embedder (counted by the fake, cross-checked with ingest's summary), and (full runs) each
text reader on hostile input next to the Markdown reader on the same kind of input.

What it runs, all on 127.0.0.1:
- a synthetic Markdown corpus written here (deterministic; 10 chunks per file, 10% of the
  documents `lifecycle: superseded`), indexed by the real `ingest.py` over real HTTP against the
  loopback fake Ollama from tests/fake_ollama.py. The fake runs in its own process and, for the
  benchmark, computes its hashed bag-of-words vectors with numpy and serialises them with orjson
  (TCP_NODELAY on, as in real Ollama's Go net/http), so a query embeds in well under a
  millisecond and a 64-text batch in a few: the figures are this project's own cost (the fake's
  busy time is reported next to every ingest figure);
- the real `python server.py` over stdio, spoken to with raw JSON-RPC lines (one request, wait
  for its response), and a bare MCPServer hello-world spawned and timed the same way;
- `python server.py --http` (issue 12), searched through the bridge (POST /mcp/call, httpx) and
  through MCP streamable HTTP (/mcp, the SDK's Client), its /health, 8 clients at once against a
  second fake that takes 20 ms per text on 8 calls at a time, and a bare Starlette endpoint on the
  same uvicorn setup for the limit; `python server.py search --json`, a fresh process per search;
- raw Chroma (`PersistentClient` on the same index folder, in this process) for the limits.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import platform
import queue
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/readme_section.py, whichever folder it runs from
import readme_section  # noqa: E402

PROJECT_DIR = Path(__file__).resolve().parent.parent
TESTS_DIR = PROJECT_DIR / "tests"
DIMS = 768
MODEL = "embeddinggemma"
CHUNKS_PER_FILE = 10
SUPERSEDED_EVERY = 10  # one document in ten is superseded
PROTOCOL_VERSION = "2025-11-25"
RPC_TIMEOUT_S = 120.0
SPAWN_TIMEOUT_S = 60.0
# Issue 11: a CPU-only embedder. 20 ms per text, one call at a time; RAG_EMBED_TIMEOUT as a user sets it.
SLOW_EMBED_PER_TEXT_S = 0.020
SLOW_EMBED_TIMEOUT_S = 60
# Issue 11: --watch. Edits measured, the poll interval of the searches that look for each, and the
# pause before the next edit once the watcher reported its run (each edit meets an idle watcher).
WATCH_POLL_S = 0.05
FIRST_ANSWER_POLL_S = 0.25
WATCH_QUIET_S = 0.3
WATCH_FIND_TIMEOUT_S = 30.0
# Issue 14: files for the scope and reuse figures (the synthetic documents from this index up).
EXTRA_DOCS_FROM = 500_000
# Issue 12: concurrent clients of the HTTP throughput figure. Their embedder takes
# SLOW_EMBED_PER_TEXT_S per text and works on this many calls at a time, so the embedding waits of
# the clients can overlap (a GPU embedding server, or Ollamas behind a proxy: one Ollama runs one
# call at a time per embedding model, whatever OLLAMA_NUM_PARALLEL says).
HTTP_CLIENTS = 8
# Issue 30: the corpus of the embedding-slots figures (at SLOW_EMBED_PER_TEXT_S, 200 s for one slot).
SLOTS_CHUNKS = 10000


def log(message: str) -> None:
    print(f"bench: {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------
# The machine.


def machine_info() -> dict[str, Any]:
    cpu = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    ram_gb = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                ram_gb = round(int(line.split()[1]) / 1024 / 1024, 1)
    versions = {}
    from importlib import metadata

    for dist in ("mcp", "chromadb", "ollama", "numpy"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[dist] = metadata.version(dist)
    commit = None
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        done = subprocess.run(["git", "-C", str(PROJECT_DIR), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10)
        commit = done.stdout.strip() or None
    return {
        "loadavg_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "nproc": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu_model": cpu,
        "ram_gb": ram_gb,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": versions,
        "project_commit": commit,
    }


# ---------------------------------------------------------------------------
# The synthetic corpus: deterministic, realistic Markdown, CHUNKS_PER_FILE sections per file.

# Term statistics matter for the keyword channel (bm25 scores every matching chunk), so the text is
# not drawn from a few hundred words: 480 system names, a few hundred domain words, and a Zipfian
# tail of ~4,000 made-up words, like the long tail of a real documentation corpus.
_DOMAINS = ["records", "billing", "deploy", "search", "auth", "message", "cache", "backup", "metrics", "feature",
            "object", "dns", "edge", "job", "payments", "email", "image", "audit", "config", "session", "rate",
            "cdn", "ci", "ledger", "inventory", "catalog", "pricing", "shipping", "invoice", "identity", "profile",
            "notification", "analytics", "export", "import", "sync", "upload", "thumbnail", "geo", "fraud"]
_COMPONENTS = ["api", "worker", "gateway", "queue", "store", "scheduler", "proxy", "pipeline", "exporter", "cluster",
               "relay", "service"]
_TEAMS = ["platform", "payments", "identity", "storage", "observability", "growth", "data", "mobile",
          "security", "infra"]
_KINDS = ["runbooks", "design", "reference", "howto", "postmortems", "onboarding", "decisions", "api"]
_VERBS = ["restart", "drain", "rotate", "promote", "roll back", "scale", "throttle", "re-index", "pause", "replay",
          "verify", "snapshot", "migrate", "purge", "rebalance", "fail over", "backfill", "pin", "tune", "audit",
          "cordon", "evict", "resize", "compact", "vacuum", "reseed", "quarantine", "revoke", "renew", "bump",
          "freeze", "thaw", "warm up", "shed", "requeue", "reshard", "truncate", "archive", "restore", "clone"]
_NOUNS = ["replica", "shard", "certificate", "canary", "queue consumer", "worker pool", "read path", "write path",
          "connection pool", "retention policy", "index", "schema", "token", "bucket", "partition", "lease",
          "health check", "alert rule", "dashboard", "quota", "deployment", "cron job", "webhook", "secret",
          "sidecar", "load balancer", "tenant", "namespace", "volume", "snapshot", "topic", "offset", "cursor",
          "manifest", "runner", "artifact", "keyring", "allowlist", "circuit breaker", "backlog", "heartbeat",
          "watermark", "checkpoint", "migration", "feature flag", "service account", "ingress rule", "dead letter"]
_ADJ = ["stale", "primary", "secondary", "regional", "degraded", "hot", "cold", "pending", "orphaned", "noisy",
        "slow", "idle", "blocked", "partial", "duplicate", "expired", "throttled", "warm", "cross-region",
        "leaked", "corrupt", "lagging", "paused", "flapping", "unbounded", "misrouted", "oversized", "unsigned",
        "detached", "zombie", "half-open", "read-only", "drifting", "unhealthy", "evicted", "frozen"]
_WHEN = ["during a sev-1", "after a failed deploy", "before the quarterly audit", "when latency p99 climbs",
         "when the disk fills up", "after rotating credentials", "during the nightly batch", "on a cold start",
         "when the on-call is paged", "before a schema change", "after a region evacuation", "under load",
         "during a traffic spike", "after a certificate expires", "while a migration runs", "at month end",
         "when replication lags", "after a dependency upgrade", "during a freeze window", "on failover"]
_COMMON = ("the of and to in is for that on with as by at from this it be are was an or which we can all not "
           "team service request response latency error budget owner ticket change window rollout traffic host "
           "cluster node pod region zone backup restore incident review metric threshold timeout retry limit "
           "version release patch upgrade config flag default value setting path file folder log line event "
           "message batch record field table column query cache key store disk memory cpu network packet").split()
_SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "sa", "te", "vo", "zi", "pe", "dri", "sto", "fle", "gra", "bu", "wen"]
_TAIL = [a + b for a in _SYLLABLES for b in _SYLLABLES] + [a + b + c for a in _SYLLABLES for b in _SYLLABLES
                                                            for c in _SYLLABLES[:15]]
_FILLER = _COMMON + _TAIL
_FILLER_CUM = list(__import__("itertools").accumulate(1.0 / (rank + 1) for rank in range(len(_FILLER))))


def _system(index: int) -> str:
    return f"{_DOMAINS[index % len(_DOMAINS)]} {_COMPONENTS[(index // len(_DOMAINS)) % len(_COMPONENTS)]}"


def _ident(rng: random.Random) -> str:
    a, b = rng.choice(_NOUNS).split()[0], rng.choice(_VERBS).split()[0]
    style = rng.randrange(5)
    if style == 0:
        return f"{a}_{b}_{rng.choice(_ADJ).split('-')[0]}"
    if style == 1:
        return f"{b}{a.capitalize()}{rng.choice(['Count', 'Ms', 'Total', 'Id', 'Ref'])}"
    if style == 2:
        return f"{a.upper()}_{b.upper()}_{rng.choice(['TTL', 'MAX', 'URL', 'ENABLED', 'TIMEOUT'])}"
    if style == 3:
        return f"--{b}-{a}"
    return f"v{rng.randrange(1, 9)}.{rng.randrange(0, 30)}.{rng.randrange(0, 10)}"


def _sentence(rng: random.Random, system: str) -> str:
    templates = [
        "To {verb} the {adj} {noun} of the {system}, run `{ident}` and wait for the {noun2} to report healthy.",
        "If the {noun} is {adj} {when}, {verb} it before touching the {noun2}; `{ident}` shows its state.",
        "The {system} keeps one {noun} per {noun2}, so a {adj} {noun} usually means the {noun2} was not drained.",
        "Never {verb} a {noun} {when}: the {system} will retry `{ident}` and the {noun2} fills up.",
        "Owners of the {system} review every {adj} {noun} weekly and {verb} the ones older than {n} days.",
        "Set `{ident}` to {n} when the {noun} is {adj}; the default works for most {noun2}s.",
        "{when_cap}, the {system} pages the on-call, who checks the {noun} dashboard and the `{ident}` metric.",
        "We chose to {verb} the {noun} instead of the {noun2} because the {system} treats it as {adj}.",
    ]
    text = rng.choice(templates).format(
        verb=rng.choice(_VERBS), adj=rng.choice(_ADJ), noun=rng.choice(_NOUNS), noun2=rng.choice(_NOUNS),
        system=system, ident=_ident(rng), when=rng.choice(_WHEN), when_cap=rng.choice(_WHEN).capitalize(),
        n=rng.randrange(2, 90))
    filler = " ".join(rng.choices(_FILLER, cum_weights=_FILLER_CUM, k=rng.randrange(0, 8)))
    return text if not filler else f"{text[:-1]}, {filler}."


def _paragraph(rng: random.Random, system: str, sentences: int) -> str:
    return "\n".join(textwrap.wrap(" ".join(_sentence(rng, system) for _ in range(sentences)), 100))


def _section_body(rng: random.Random, system: str) -> list[str]:
    out = [_paragraph(rng, system, rng.randrange(2, 4)), ""]
    shape = rng.randrange(4)
    if shape == 0:
        out += [f"- {_sentence(rng, system)}" for _ in range(rng.randrange(2, 4))] + [""]
    elif shape == 1:
        lang = rng.choice(["bash", "yaml", "python"])
        fence = ["```" + lang]
        for _ in range(rng.randrange(2, 5)):
            ident = _ident(rng)
            if lang == "bash":
                fence.append(f"# {rng.choice(_VERBS)} the {rng.choice(_NOUNS)}")
                fence.append(f"nimbusctl {rng.choice(_VERBS).split()[0]} {ident} --region eu-{rng.randrange(1, 4)}")
            elif lang == "yaml":
                fence.append(f"{ident.strip('-').replace('.', '_').lower()}: {rng.randrange(1, 500)}")
            else:
                fence.append(f"client.{rng.choice(_VERBS).split()[0]}(\"{ident}\", retries={rng.randrange(1, 9)})")
        out += fence + ["```", ""]
    elif shape == 2:
        out += ["| Setting | Default | Meaning |", "| --- | --- | --- |"]
        for _ in range(rng.randrange(2, 5)):
            out.append(f"| `{_ident(rng)}` | {rng.randrange(1, 600)} | {rng.choice(_ADJ)} {rng.choice(_NOUNS)} "
                       f"{rng.choice(_WHEN)} |")
        out.append("")
    out += [_paragraph(rng, system, rng.randrange(1, 3)), ""]
    return out


def synthetic_document(index: int) -> tuple[str, str]:
    """(relative path, content) of document `index`; a pure function of the index."""
    rng = random.Random(f"local-rag-mcp-bench:{index}")
    system = _system(index)
    team = _TEAMS[(index // 7) % len(_TEAMS)]
    kind = _KINDS[(index // 3) % len(_KINDS)]
    title = f"{system.title()}: {rng.choice(_VERBS)} the {rng.choice(_ADJ)} {rng.choice(_NOUNS)} ({index})"
    superseded = index % SUPERSEDED_EVERY == SUPERSEDED_EVERY - 3
    lines: list[str] = []
    if index % 5 != 4:  # most files carry frontmatter; the rest take their title from the H1
        lines += ["---", f"title: \"{title}\"", "rag_chunk: headings"]
        if superseded:
            lines.append("lifecycle: superseded")
        lines += ["---", ""]
    elif superseded:
        lines += ["---", "lifecycle: superseded", "---", ""]
    lines += [f"# {title}", "", _paragraph(rng, system, 3), ""]
    level = 2
    for section in range(CHUNKS_PER_FILE - 1):
        level = 3 if level == 2 and section % 3 == 2 else 2
        heading = f"{rng.choice(_VERBS).capitalize()} the {rng.choice(_ADJ)} {rng.choice(_NOUNS)}"
        lines += [f"{'#' * level} {heading}", ""] + _section_body(rng, system)
    path = f"{team}/{kind}/{system.replace(' ', '-')}-{index:06d}.md"
    return path, "\n".join(lines).rstrip("\n") + "\n"


def write_corpus(dest: Path, files: int) -> dict[str, Any]:
    """Write (or top up) `files` synthetic documents into dest; returns counts."""
    dest.mkdir(parents=True, exist_ok=True)
    superseded = 0
    total_bytes = 0
    for i in range(files):
        path, content = synthetic_document(i)
        target = dest / path
        data = content.encode("utf-8")
        total_bytes += len(data)
        superseded += "lifecycle: superseded" in content
        if target.exists() and target.stat().st_size == len(data):
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    return {"files": files, "superseded_files": superseded, "bytes": total_bytes}


def sectioned_document(sections: int, edited: int | None = None) -> str:
    """A `rag_chunk: headings` document of `sections` H2 sections, each about 150-250 estimated
    tokens (over the 64-token minimum, so no two merge, and under the 512 maximum, so none splits):
    one chunk per section. With `edited`, that section's paragraph is rewritten, nothing else."""
    system = _system(7)
    lines = ["---", "title: \"Nimbus operations handbook\"", "rag_chunk: headings", "---", "",
             "# Nimbus operations handbook", ""]
    for section in range(sections):
        rng = random.Random(f"local-rag-mcp-bench-sections:{section}")
        heading = f"Step {section + 1}: {rng.choice(_VERBS)} the {rng.choice(_ADJ)} {rng.choice(_NOUNS)}"
        if section == edited:
            rng = random.Random(f"local-rag-mcp-bench-sections:{section}:edited")
        lines += [f"## {heading}", "", _paragraph(rng, system, 5), ""]
    return "\n".join(lines)


def synthetic_queries(count: int, seed: str) -> list[str]:
    """Distinct, realistic agent queries (no two alike, so the server's query cache never hits)."""
    rng = random.Random(f"local-rag-mcp-bench-queries:{seed}")
    shapes = [
        "how do I {verb} the {adj} {noun} in the {system}",
        "what happens {when} to the {system} {noun}",
        "{system} {noun} {verb}",
        "who owns the {noun} of the {system} and when is it {adj}",
        "`{ident}` {system}",
        "why is the {noun} {adj} {when}",
    ]
    seen: set[str] = set()
    out: list[str] = []
    for _ in range(count * 50):
        if len(out) >= count:
            break
        q = rng.choice(shapes).format(verb=rng.choice(_VERBS), adj=rng.choice(_ADJ), noun=rng.choice(_NOUNS),
                                      system=_system(rng.randrange(len(_DOMAINS) * len(_COMPONENTS))),
                                      when=rng.choice(_WHEN), ident=_ident(rng))
        q = f"{q} {rng.randrange(1000)}" if q in seen else q
        if q not in seen:
            seen.add(q)
            out.append(q)
    return out


# ---------------------------------------------------------------------------
# The embedder: tests/fake_ollama.py's FakeOllama in its own process, with fast vectors.

_TOKEN = re.compile(r"[^\W_]+", re.UNICODE)


def _strip_prefix(text: str) -> str:
    if str(TESTS_DIR) not in sys.path:
        sys.path.insert(0, str(TESTS_DIR))
    from fake_ollama import strip_task_prefix

    return strip_task_prefix(text)


class FastVectors:
    """Hashed bag-of-words unit vectors (lexically meaningful like the fake's own), via numpy."""

    def __init__(self, dims: int) -> None:
        import numpy as np

        self.np = np
        self.dims = dims
        self._slots: dict[str, tuple[int, float]] = {}

    def _slot(self, word: str) -> tuple[int, float]:
        slot = self._slots.get(word)
        if slot is None:
            import hashlib

            digest = int.from_bytes(hashlib.blake2b(word.encode(), digest_size=8).digest(), "big")
            slot = self._slots[word] = (digest >> 1) % self.dims, 1.0 if digest & 1 else -1.0
        return slot

    def vector(self, text: str) -> Any:
        np = self.np
        words = _TOKEN.findall(_strip_prefix(text).lower())
        vec = np.zeros(self.dims, dtype=np.float32)
        if words:
            slots = [self._slot(w) for w in words]
            np.add.at(vec, [s[0] for s in slots], [s[1] for s in slots])
        norm = float(np.linalg.norm(vec))
        if norm == 0.0:
            vec[0] = 1.0
            return vec
        return vec / norm

    def matrix(self, texts: Sequence[str], dimensions: Any = None) -> Any:
        """The texts' vectors; with `dimensions` (an /api/embed request's) fewer than DIMS, cut to
        that many and renormalised, as Ollama does."""
        np = self.np
        matrix = np.stack([self.vector(t) for t in texts]) if texts else np.zeros((0, self.dims))
        if isinstance(dimensions, int) and 0 < dimensions < self.dims:
            matrix = matrix[:, :dimensions].copy()
            matrix[np.linalg.norm(matrix, axis=1) == 0.0, 0] = 1.0  # as vector() does for a text of no words
            matrix = matrix / np.linalg.norm(matrix, axis=1, keepdims=True)
        return matrix


def serve_fake(port: int, delay_per_text_s: float = 0.0, slots: int = 1) -> int:
    """`bench.py --serve-fake [PORT [SECONDS_PER_TEXT [SLOTS]]]`: FakeOllama with numpy vectors and
    orjson bodies, plus busy-time stats and the size of every embed call. With SECONDS_PER_TEXT it is
    a slow CPU embedder (tests/fake_ollama.py's delay_per_text_seconds: time proportional to the
    texts, one call at a time, the work dropped when the client disconnects); with SLOTS, that many
    calls at a time."""
    sys.path[:0] = [str(TESTS_DIR), str(PROJECT_DIR)]
    import fake_ollama

    from corpus_rules import FINGERPRINT_TEXT

    try:  # orjson and numpy come with chromadb; plain json is the fallback
        import orjson

        def dumps(payload: dict[str, Any]) -> bytes:
            return orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY)
    except ImportError:
        def dumps(payload: dict[str, Any]) -> bytes:
            return json.dumps({**payload, "embeddings": payload["embeddings"].tolist()}).encode()

    vectors = FastVectors(DIMS)
    # The model fingerprint's probe (one text alone, once per host and run) is counted apart: the
    # figures count what ingest sends for the chunks.
    stats: dict[str, Any] = {"embed_calls": 0, "inputs": 0, "busy_s": 0.0, "delay_s": 0.0, "dropped_calls": 0,
                             "fingerprint_probes": 0}
    call_sizes: list[int] = []  # texts per answered embed call, in order (a 1M-chunk build: ~20k ints)
    lock = threading.Lock()

    class BenchFake(fake_ollama.FakeOllama):
        def _embed(self, body: Any) -> tuple[int, Any]:
            started = time.perf_counter()
            body = body if isinstance(body, dict) else {}
            raw = body.get("input", "")
            inputs = [raw] if isinstance(raw, str) and raw else list(raw or [])
            with self._lock:
                self.embed_calls += 1
                if not self._available(str(body.get("model") or "")):
                    return self._not_found(str(body.get("model") or ""))
            matrix = vectors.matrix(inputs, body.get("dimensions"))
            payload = dumps({"model": body.get("model"), "embeddings": matrix,
                             "total_duration": 0, "load_duration": 0, "prompt_eval_count": 0})
            with lock:
                if inputs == [FINGERPRINT_TEXT]:
                    stats["fingerprint_probes"] += 1
                    return 200, payload
                stats["embed_calls"] += 1
                stats["inputs"] += len(inputs)
                stats["busy_s"] += time.perf_counter() - started
                call_sizes.append(len(inputs))
            return 200, payload

        def _handle(self, method: str, path: str, body: Any) -> tuple[int, Any]:
            if path == "/_bench/stats":
                with lock:
                    return 200, dict(stats)
            if path == "/_bench/calls":  # POST {"from": n}: the sizes of calls n, n+1, ...
                with lock:
                    return 200, {"sizes": call_sizes[int((body or {}).get("from", 0)):]}
            return super()._handle(method, path, body)

    def dispatch(self: Any, method: str, body: Any) -> None:
        # The fake's own dispatch sends str payloads as text/plain: send our bytes as JSON.
        if method == "POST" and self.path.split("?", 1)[0] == "/api/embed":
            started = time.perf_counter()
            worked = self.server.fake._work_per_text(body, self.connection)
            with lock:
                stats["delay_s"] += time.perf_counter() - started
                stats["dropped_calls"] += not worked
            if not worked:
                return  # the client gave up (its timeout): no answer, as Ollama cancels the request
            status, payload = self.server.fake._handle(method, "/api/embed", body)
            if isinstance(payload, bytes):
                self._send(status, payload, "application/json; charset=utf-8")
            else:
                self._send_json(status, payload)
            return
        original_dispatch(self, method, body)

    original_dispatch = fake_ollama._Handler._dispatch
    fake_ollama._Handler._dispatch = dispatch  # this process only
    fake = BenchFake(models=(MODEL,), dims=DIMS, port=port)
    fake.configure(delay_per_text_seconds=delay_per_text_s, slots=slots)
    fake._record = lambda *a, **k: None  # no per-request record: 100k chunks would pile up in memory
    return fake_ollama.serve_until_signalled(fake)


class FakeProcess:
    """The benchmark's fake Ollama in its own process (so its work does not share this process's
    GIL); `delay_per_text_s` makes it a slow embedder, `slots` the calls it works on at a time."""

    def __init__(self, python: str, workdir: Path, delay_per_text_s: float = 0.0, tag: str = "fake",
                 slots: int = 1) -> None:
        self.python = python
        self.workdir = workdir
        self.delay_per_text_s = delay_per_text_s
        self.slots = slots
        self.tag = tag
        self.proc: subprocess.Popen[str] | None = None
        self.host = ""

    def __enter__(self) -> FakeProcess:
        stderr = self.workdir / f"{self.tag}.stderr"
        self.proc = subprocess.Popen([self.python, str(Path(__file__).resolve()), "--serve-fake", "0",
                                      str(self.delay_per_text_s), str(self.slots)],
                                     stdout=subprocess.PIPE, stderr=open(stderr, "w"), text=True)
        line = _readline_with_timeout(self.proc.stdout, 30.0)
        if not line or not line.startswith("FAKE_OLLAMA_READY "):
            self.close()
            raise RuntimeError(f"fake Ollama did not start: {line!r} (see {stderr})")
        self.host = line.split()[1]
        return self

    def _ask(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        import urllib.request

        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"{self.host}{path}", data=data,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as resp:
            return json.loads(resp.read())

    def stats(self) -> dict[str, Any]:
        return self._ask("/_bench/stats")

    def call_sizes(self, since: int) -> list[int]:
        """Texts per embed call, for the calls answered since the `since`-th one."""
        return list(self._ask("/_bench/calls", {"from": since})["sizes"])

    def close(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def __exit__(self, *exc: Any) -> None:
        self.close()


class FakeHosts:
    """Several FakeProcesses as one comma-list OLLAMA_HOST, their stats summed (run_ingest reads
    a fake's host, stats and call sizes)."""

    def __init__(self, fakes: Sequence[FakeProcess]) -> None:
        self.fakes = list(fakes)
        self.host = ",".join(fake.host for fake in self.fakes)

    def stats(self) -> dict[str, Any]:
        each = [fake.stats() for fake in self.fakes]
        return {key: sum(stats[key] for stats in each) for key in each[0]}

    def call_sizes(self, since: int) -> list[int]:
        # Every host's calls from the first: embed_slots starts fresh hosts for each run, so all
        # of their calls are the run's (`since`, a count over all hosts, names no host's own).
        return [size for fake in self.fakes for size in fake.call_sizes(0)]


def _readline_with_timeout(stream: Any, timeout: float) -> str | None:
    box: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: box.put(stream.readline()), daemon=True).start()
    try:
        return box.get(timeout=timeout).strip()
    except queue.Empty:
        return None


# ---------------------------------------------------------------------------
# Ingest runs.


def read_through(folder: Path) -> None:
    """Read every file under `folder` once, so the OS caches its pages."""
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            with path.open("rb") as f:
                while f.read(1 << 24):
                    pass


def disk_usage_mb(path: Path) -> float:
    """Space the folder takes on disk (allocated blocks, so sparse and preallocated files count as
    they cost)."""
    total = 0
    for folder, _, names in os.walk(path):
        for name in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(folder, name)).st_blocks * 512
    return total / 1024 / 1024


def _default_sigint() -> None:
    """In the child before exec: a benchmark started in the background (`bench.py &`, some CI
    runners) has SIGINT ignored, which Python would then keep ignoring; --watch must get Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _json_lines(stream: Any, box: queue.Queue[dict[str, Any]]) -> None:
    """Put every JSON object line of `stream` into `box` until it ends (other lines are skipped)."""
    for line in stream:
        with contextlib.suppress(ValueError):
            message = json.loads(line)
            if isinstance(message, dict):
                box.put(message)


def _next_report(proc: subprocess.Popen[str], box: queue.Queue[dict[str, Any]], timeout_s: float,
                 what: str) -> dict[str, Any]:
    """The next JSON line of a running `ingest.py --watch --json` (one per run)."""
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        with contextlib.suppress(queue.Empty):
            return box.get(timeout=0.5)
        if proc.poll() is not None:
            raise RuntimeError(f"the watcher exited {proc.returncode} before reporting {what}")
    raise RuntimeError(f"the watcher did not report {what} within {timeout_s:.0f} s")


@dataclass
class IngestRun:
    wall_s: float
    exit: int
    summary: dict[str, Any]
    peak_rss_mb: float
    fake_calls: int
    fake_busy_s: float
    cpu_s: float = 0.0
    fake_inputs: int = 0  # texts the fake embedded for this run: the ground truth for "embedded"
    fake_delay_s: float = 0.0  # time the fake spent being slow (delay_per_text_s), this run
    largest_call: int = 0  # most texts in one embed call

    @property
    def embedded(self) -> int:
        """Chunks sent to the embedder: the larger of ingest's own count and the fake's record."""
        return max(int(self.summary.get("chunks_embedded", -1)), self.fake_inputs)


def run_ingest(python: str, corpus: Path, store: Path, fake: FakeProcess, log_file: Path,
               timeout_s: float, ingest: Path = PROJECT_DIR / "ingest.py", chroma_url: str | None = None,
               extra_args: Sequence[str] = (), extra_env: dict[str, str] | None = None,
               check: bool = True) -> IngestRun:
    """One `ingest.py --json` run; with check=False a run that exits non-zero is returned, not raised
    (for figures whose goal is that it does not)."""
    env = {**os.environ, "OLLAMA_HOST": fake.host, "ANONYMIZED_TELEMETRY": "False"}
    for name in ("RAG_EMBED_MODEL", "RAG_EMBED_TIMEOUT", "RAG_CHUNK_MAX_TOKENS", "RAG_CHUNK_MIN_TOKENS",
                 "RAG_CHROMA_URL"):
        env.pop(name, None)
    if chroma_url:
        env["RAG_CHROMA_URL"] = chroma_url
    env.update(extra_env or {})
    before = fake.stats()
    with open(log_file, "a") as err, tempfile.TemporaryFile("w+") as out:
        started = time.perf_counter()
        proc = subprocess.Popen([python, str(ingest), "--corpus", str(corpus), "--store", str(store),
                                 "--json", *extra_args], stdout=out, stderr=err, env=env, text=True)
        with TreeSampler(proc.pid) as tree:
            status, rusage = _wait4(proc, timeout_s)
        wall = time.perf_counter() - started
        out.seek(0)
        lines = [ln for ln in out.read().splitlines() if ln.strip()]
    after = fake.stats()
    try:
        summary = json.loads(lines[-1]) if lines else {}
    except ValueError:
        summary = {}
    if status != 0 and check:
        raise RuntimeError(f"ingest exited {status} (see {log_file}): {str(summary)[:500]}")
    return IngestRun(wall_s=wall, exit=status, summary=summary,
                     peak_rss_mb=max(rusage.ru_maxrss / 1024, tree.peak_rss_mb),
                     fake_calls=after["embed_calls"] - before["embed_calls"],
                     fake_busy_s=after["busy_s"] - before["busy_s"],
                     cpu_s=rusage.ru_utime + rusage.ru_stime + tree.descendants_cpu_s,
                     fake_inputs=after["inputs"] - before["inputs"], fake_delay_s=after["delay_s"] - before["delay_s"],
                     largest_call=max(fake.call_sizes(before["embed_calls"]), default=0))


class FirstAnswer:
    """Searches (hybrid, what an agent sends) every FIRST_ANSWER_POLL_S on a thread from now
    until one returns hits: how long a first ingest keeps an agent waiting for any answer."""

    def __init__(self, peer: StdioPeer, query: str) -> None:
        self.peer, self.query = peer, query
        self.started = time.perf_counter()
        self.seconds = math.inf
        self.degraded: str | None = None
        self.polls = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="first-answer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            result, _ = self.peer.call("search_corpus", {"query": self.query})
            self.polls += 1
            payload = tool_payload(result)
            if payload.get("results"):
                self.seconds, self.degraded = time.perf_counter() - self.started, payload.get("degraded")
                return
            self._stop.wait(FIRST_ANSWER_POLL_S)

    def stop(self) -> None:
        """After the ingest: the poller's answer awaited (at most RPC_TIMEOUT_S), then it stops."""
        self._thread.join(RPC_TIMEOUT_S)
        self._stop.set()

    def report(self) -> dict[str, Any]:
        return {"query": self.query, "seconds": self.seconds, "degraded": self.degraded, "polls": self.polls}


class TreeSampler:
    """Peak resident memory of a process and its descendants together, and the descendants' CPU
    time, sampled from /proc every 50 ms (Linux; elsewhere both stay 0). Ingest writes its vectors
    from a child process that it does not wait for, so the run's own rusage misses that child."""

    INTERVAL_S = 0.05

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak_rss_mb = 0.0
        self._cpu_ticks: dict[int, int] = {}  # descendant pid -> utime + stime, last seen
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._ticks_per_s = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    @property
    def descendants_cpu_s(self) -> float:
        return sum(self._cpu_ticks.values()) / self._ticks_per_s

    def __enter__(self) -> TreeSampler:
        if Path(f"/proc/{self.pid}").exists():
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.is_set():
            total_kb = 0
            for pid in self._tree():
                try:
                    status = Path(f"/proc/{pid}/status").read_text()
                    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                total_kb += next((int(line.split()[1]) for line in status.splitlines()
                                  if line.startswith("VmRSS:")), 0)
                if pid != self.pid:
                    self._cpu_ticks[pid] = int(fields[11]) + int(fields[12])  # utime, stime
            self.peak_rss_mb = max(self.peak_rss_mb, total_kb / 1024)
            self._stop.wait(self.INTERVAL_S)

    def _tree(self) -> list[int]:
        found, todo = [], [self.pid]
        while todo:
            pid = todo.pop()
            found.append(pid)
            try:
                tasks = list(Path(f"/proc/{pid}/task").iterdir())
            except OSError:
                continue
            for task in tasks:
                with contextlib.suppress(OSError, ValueError):
                    todo.extend(int(child) for child in (task / "children").read_text().split())
        return found


def _wait4(proc: subprocess.Popen[Any], timeout_s: float) -> tuple[int, Any]:
    """Wait for the child with a deadline; return its exit status and its own rusage (peak RSS)."""
    box: list[tuple[int, int, Any]] = []
    waiter = threading.Thread(target=lambda: box.append(os.wait4(proc.pid, 0)), daemon=True)
    waiter.start()
    waiter.join(timeout_s)
    if not box:
        proc.kill()
        waiter.join(30)
        proc.returncode = -9
        raise RuntimeError(f"{proc.args[1]} did not finish within {timeout_s:.0f} s")
    _, status, rusage = box[0]
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, rusage


# ---------------------------------------------------------------------------
# MCP over stdio: raw JSON-RPC lines, one request at a time, timed at the client.

# The cold start (issue 30 §4): spawn to the first search answer, whatever channels answered it.
COLD_ANSWER_GOAL_S = 1.5

HYBRID_FLOOR = '''\
import json, os, sys, time
started = time.perf_counter()
import numpy
import chromadb
imported = time.perf_counter()
client = chromadb.PersistentClient(path=sys.argv[1])
collection = client.get_collection("chunks_active")
opened = time.perf_counter()
collection.query(query_embeddings=[numpy.ones(int(sys.argv[2]), dtype=numpy.float32)], n_results=1, include=["distances"])
loaded = time.perf_counter()
print(json.dumps({"import_s": imported - started, "open_s": opened - imported, "load_s": loaded - opened}))
'''


def cold_degraded(result: dict[str, Any]) -> bool:
    """Whether a search answered keyword-only because the vector index was still loading; any
    other failure or degradation is not a cold start the bench can measure."""
    payload = tool_payload(result)
    if result.get("isError") or payload.get("degraded") not in (None, "vector_index_loading"):
        raise RuntimeError(f"cold search failed: {payload}")
    return payload.get("degraded") == "vector_index_loading"


HELLO_SERVER = '''\
"""Bare MCPServer hello-world with one tool: the limit for handshake and stdio round trips."""
from mcp.server.mcpserver import MCPServer

mcp = MCPServer("hello")


@mcp.tool()
def echo(text: str) -> str:
    """Echo the text back."""
    return text


if __name__ == "__main__":
    mcp.run()
'''


class BetweenSearches:
    """The limit of a search figure, measured between the searches it is compared with: before
    each search, one raw Chroma query (this process, the same index, distances only) and one
    round trip of a bare server (the hello-world MCP server over stdio, or a bare Starlette
    endpoint). Measured back to back instead, each repeats with its caches hot, which a search
    never has: it embeds its query before it queries Chroma, and its server sits idle between
    calls while other processes run. On a 2-core VM the back-to-back limit was 1.3-1.6x lower
    than this one, and wandered from run to run with the machine's neighbours; the ratios
    against this one moved by 0.03x across three runs. Both are reported."""

    def __init__(self, collection: Any, vectors: Sequence[list[float]], round_trip: Callable[[], float],
                 n_results: int) -> None:
        self.collection, self.vectors, self.round_trip, self.n_results = collection, vectors, round_trip, n_results
        self.raw: list[float] = []
        self.round_trips: list[float] = []

    def sample(self) -> None:
        vector = self.vectors[len(self.raw) % len(self.vectors)]
        started = time.perf_counter()
        self.collection.query(query_embeddings=[vector], n_results=self.n_results, include=["distances"])
        self.raw.append(time.perf_counter() - started)
        self.round_trips.append(self.round_trip())

    def restart(self) -> None:
        self.raw.clear()
        self.round_trips.clear()

    def stats(self) -> dict[str, Any]:
        raw, trips = summarize_ms(self.raw), summarize_ms(self.round_trips)
        return {"raw_chroma_query": raw, "round_trip": trips, "limit_p50_ms": raw["p50_ms"] + trips["p50_ms"],
                "limit_p95_ms": raw["p95_ms"] + trips["p50_ms"]}


class RpcError(RuntimeError):
    pass


class StdioPeer:
    """A spawned MCP server spoken to with newline-delimited JSON-RPC over its pipes."""

    def __init__(self, argv: Sequence[str], env: dict[str, str], stderr_path: Path, cwd: Path | None = None) -> None:
        import selectors

        self.stderr_file = open(stderr_path, "ab")
        self.spawned_at = time.perf_counter()
        self.proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.stderr_file, env=env, cwd=cwd, bufsize=0)
        self.fd = self.proc.stdout.fileno()  # type: ignore[union-attr]  # PIPE: never None
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.fd, selectors.EVENT_READ)
        self.buffer = b""
        self.next_id = 0
        self.non_json_lines: list[str] = []
        self.stderr_path = stderr_path

    def _send(self, message: dict[str, Any]) -> None:
        self.proc.stdin.write((json.dumps(message) + "\n").encode())  # type: ignore[union-attr]  # PIPE

    def _read_message(self, deadline: float) -> dict[str, Any]:
        while True:
            newline = self.buffer.find(b"\n")
            if newline >= 0:
                line, self.buffer = self.buffer[:newline], self.buffer[newline + 1:]
                if not line.strip():
                    continue
                try:
                    return json.loads(line)
                except ValueError:
                    self.non_json_lines.append(line[:200].decode(errors="replace"))
                    continue
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                raise RpcError(f"no answer within the deadline (stderr: {self.stderr_path})")
            if self.selector.select(remaining):
                block = os.read(self.fd, 1 << 20)
                if not block:
                    raise RpcError(f"the server closed stdout (exit {self.proc.poll()}; stderr: {self.stderr_path})")
                self.buffer += block

    def request(self, method: str, params: dict[str, Any],
                timeout: float = RPC_TIMEOUT_S) -> tuple[dict[str, Any], float]:
        """Send one request and wait for its response; returns (result, seconds)."""
        self.next_id += 1
        wanted = self.next_id
        started = time.perf_counter()
        self._send({"jsonrpc": "2.0", "id": wanted, "method": method, "params": params})
        deadline = started + timeout
        while True:
            message = self._read_message(deadline)
            if message.get("id") == wanted and ("result" in message or "error" in message):
                elapsed = time.perf_counter() - started
                if "error" in message:
                    raise RpcError(f"{method} failed: {message['error']}")
                return message["result"], elapsed
            # Notifications (logging, progress) and server requests are not expected; skip them.

    def notify(self, method: str, params: dict[str, Any] | None = None) -> None:
        message: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
        if params is not None:
            message["params"] = params
        self._send(message)

    def handshake(self) -> dict[str, float]:
        """initialize + notifications/initialized + tools/list; seconds from spawn for each step."""
        init, _ = self.request("initialize", {"protocolVersion": PROTOCOL_VERSION, "capabilities": {},
                                              "clientInfo": {"name": "local-rag-bench", "version": "1"}},
                               timeout=SPAWN_TIMEOUT_S)
        initialized_at = time.perf_counter() - self.spawned_at
        self.notify("notifications/initialized")
        tools, _ = self.request("tools/list", {}, timeout=SPAWN_TIMEOUT_S)
        self.tools = {t["name"]: t for t in tools.get("tools", [])}
        return {"initialize_s": initialized_at, "tools_list_s": time.perf_counter() - self.spawned_at}

    def call(self, name: str, arguments: dict[str, Any],
             timeout: float = RPC_TIMEOUT_S) -> tuple[dict[str, Any], float]:
        return self.request("tools/call", {"name": name, "arguments": arguments}, timeout=timeout)

    def vm_hwm_mb(self) -> float | None:
        """Peak resident set size of the server process so far (Linux: VmHWM)."""
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
        except (OSError, ValueError):
            pass
        return None

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.close()  # type: ignore[union-attr]  # PIPE
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self.selector.close()
        with contextlib.suppress(OSError):
            self.proc.stdout.close()  # type: ignore[union-attr]  # PIPE
        self.stderr_file.close()

    def __enter__(self) -> StdioPeer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def tool_payload(result: dict[str, Any]) -> dict[str, Any]:
    structured = result.get("structuredContent")
    if isinstance(structured, dict):
        return structured
    for block in result.get("content") or []:
        if block.get("type") == "text":
            with contextlib.suppress(ValueError):
                return json.loads(block["text"])
    return {}


# ---------------------------------------------------------------------------
# HTTP: `server.py --http` and a bare Starlette endpoint, each in its own process, timed at the client.

BARE_HTTP_SERVER = '''\
"""Bare Starlette JSON endpoint on uvicorn, set up as server.py --http sets up its own (a bound
loopback socket, the same uvicorn.Config): the limit for HTTP round trips."""
import socket
import sys

import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route


async def call(request):
    await request.json()
    return JSONResponse({"success": True, "result": {"results": []}})


app = Starlette(routes=[Route("/bare", call, methods=["POST"])])
sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
sock.bind(("127.0.0.1", 0))
sock.listen(2048)
print(f"bare listening on http://127.0.0.1:{sock.getsockname()[1]}/bare", file=sys.stderr, flush=True)
uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                              timeout_graceful_shutdown=5)).run(sockets=[sock])
'''
_LISTENING = re.compile(r"listening on (http://127\.0\.0\.1:\d+)/")


class HttpPeer:
    """A spawned HTTP server: ready once its stderr says `listening on http://127.0.0.1:PORT/...`
    (both servers log it when the socket already accepts), stopped with SIGTERM."""

    def __init__(self, argv: Sequence[str], env: dict[str, str], stderr_path: Path, cwd: Path) -> None:
        self.stderr_path = stderr_path
        self.stderr_file = open(stderr_path, "wb")
        self.proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=self.stderr_file, env=env, cwd=cwd)
        try:
            self.url = self._listening()
        except RuntimeError:
            self.close()
            raise

    def _listening(self) -> str:
        deadline = time.perf_counter() + SPAWN_TIMEOUT_S
        while time.perf_counter() < deadline:
            found = _LISTENING.search(self.stderr_path.read_text(encoding="utf-8", errors="replace"))
            if found:
                return found.group(1)
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.proc.args} exited {self.proc.returncode} before listening "
                                   f"(see {self.stderr_path})")
            time.sleep(0.02)
        raise RuntimeError(f"{self.proc.args} did not listen within {SPAWN_TIMEOUT_S:.0f} s (see {self.stderr_path})")

    def close(self) -> None:
        """SIGTERM; proc.returncode is then its exit status (-9: killed after 10 s without exiting)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.stderr_file.close()

    def __enter__(self) -> HttpPeer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def bridge_call(query: str) -> dict[str, Any]:
    """The body of a search through the bridge (POST /mcp/call); the bare endpoint gets the same."""
    return {"server": "local-rag", "toolName": "search_corpus", "input": {"query": query}}


def timed_requests(http: Any, method: str, url: str, bodies: Sequence[dict[str, Any] | None]) -> list[float]:
    """Seconds of each request of an httpx.Client, one at a time, the JSON answer parsed (as the
    stdio timings parse theirs); RuntimeError unless each answers 200 with a JSON object and, for
    a body sent, `"success": true`."""
    import httpx

    samples = []
    for body in bodies:
        started = time.perf_counter()
        try:
            response = http.request(method, url, json=body)
        except httpx.HTTPError as exc:
            raise RuntimeError(f"{method} {url} failed: {exc!r}") from exc
        try:
            payload = response.json()
        except ValueError:
            payload = None
        samples.append(time.perf_counter() - started)
        if (response.status_code != 200 or not isinstance(payload, dict)
                or (body is not None and payload.get("success") is not True)):
            raise RuntimeError(f"{method} {url} answered {response.status_code}: {response.text[:300]}")
    return samples


# The request envelope of each protocol era a stateless server serves: 2025-era requests carry the
# version in a header (no initialize is needed); 2026-07-28 requests name the method in headers
# too and carry the client's envelope in params._meta.
ERA_2026 = "2026-07-28"
ERA_HEADERS = {"2025-06-18": {"MCP-Protocol-Version": "2025-06-18"},
               ERA_2026: {"MCP-Protocol-Version": ERA_2026, "Mcp-Method": "tools/call", "Mcp-Name": "search_corpus"}}
ERA_META = {"2025-06-18": None,
            ERA_2026: {"io.modelcontextprotocol/protocolVersion": ERA_2026,
                       "io.modelcontextprotocol/clientInfo": {"name": "bench", "version": "0"},
                       "io.modelcontextprotocol/clientCapabilities": {}}}


def jsonrpc_search_samples(http: Any, url: str, queries: Sequence[str], era: str = "2025-06-18") -> list[float]:
    """Seconds of each search_corpus call posted to /mcp as one JSON-RPC request of a protocol era
    (a stateless server needs no initialize), with the same httpx client as the limit's bare
    endpoint, the answer parsed; RuntimeError unless each is a tool result without isError."""
    headers = {"Accept": "application/json, text/event-stream", **ERA_HEADERS[era]}
    meta = ERA_META[era]
    samples = []
    for i, query in enumerate(queries):
        params: dict[str, Any] = {"name": "search_corpus", "arguments": {"query": query}}
        if meta is not None:
            params["_meta"] = meta
        body = {"jsonrpc": "2.0", "id": i, "method": "tools/call", "params": params}
        started = time.perf_counter()
        response = http.post(url, json=body, headers=headers)
        payload = response.json() if response.status_code == 200 else None
        samples.append(time.perf_counter() - started)
        if not (isinstance(payload, dict) and isinstance(payload.get("result"), dict)
                and not payload["result"].get("isError")):
            raise RuntimeError(f"POST {url} answered {response.status_code}: {response.text[:300]}")
    return samples


def search_rate(url: str, per_client: Sequence[Sequence[str]]) -> float:
    """Searches per second through POST /mcp/call: one thread per list of queries, each with its own
    httpx.Client (connected beforehand with GET /health), all released together; the wall time runs
    until the last one is done."""
    import httpx

    barrier = threading.Barrier(len(per_client) + 1)
    errors: list[BaseException] = []

    def client(queries: Sequence[str]) -> None:
        try:
            with httpx.Client(timeout=RPC_TIMEOUT_S) as http:
                timed_requests(http, "GET", f"{url}/health", [None])
                barrier.wait()
                timed_requests(http, "POST", f"{url}/mcp/call", [bridge_call(q) for q in queries])
        except (RuntimeError, threading.BrokenBarrierError) as exc:
            errors.append(exc)
            barrier.abort()  # a client that cannot start must not leave the others waiting

    threads = [threading.Thread(target=client, args=(queries,), daemon=True) for queries in per_client]
    for thread in threads:
        thread.start()
    with contextlib.suppress(threading.BrokenBarrierError):  # a client failed: raised below
        barrier.wait(timeout=SPAWN_TIMEOUT_S)
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - started
    if errors:
        raise RuntimeError(f"{len(errors)} of {len(per_client)} clients failed, e.g. {errors[0]}")
    return sum(len(queries) for queries in per_client) / seconds


async def mcp_search_samples(url: str, queries: Sequence[str]) -> list[float]:
    """Seconds of each search_corpus call through the MCP SDK's Client over streamable HTTP (one
    session, one call at a time)."""
    from mcp import Client

    samples = []
    try:
        async with Client(url) as client:
            for query in queries:
                started = time.perf_counter()
                result = await client.call_tool("search_corpus", {"query": query})
                samples.append(time.perf_counter() - started)
                if result.is_error:
                    raise RuntimeError(f"search_corpus over /mcp failed: {result.content}")
    except Exception as exc:  # the SDK's errors (and task-group wrappers) as the bench's own
        raise RuntimeError(f"MCP over {url}: {exc!r}") from exc
    return samples


# ---------------------------------------------------------------------------
# Statistics and figures.


def percentile(samples: Sequence[float], q: float) -> float:
    """Nearest-rank-interpolated percentile (q in 0..100)."""
    ordered = sorted(samples)
    if not ordered:
        return math.nan
    if len(ordered) == 1:
        return ordered[0]
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize_ms(samples_s: Sequence[float]) -> dict[str, float]:
    ms = [s * 1000 for s in samples_s]
    return {"n": len(ms), "p50_ms": percentile(ms, 50), "p95_ms": percentile(ms, 95), "mean_ms": statistics.fmean(ms),
            "min_ms": min(ms), "max_ms": max(ms)}


def size_label(chunks: int) -> str:
    if chunks % 1_000_000 == 0:
        return f"{chunks // 1_000_000}M"
    return f"{chunks // 1000}k" if chunks % 1000 == 0 else str(chunks)


@dataclass
class Figure:
    id: str
    figure: str
    value: float
    unit: str
    goal: str
    limit: float | None = None
    limit_what: str | None = None
    ratio: float | None = None
    passed: bool | None = None  # None: reported, no goal
    size: int | None = None
    note: str | None = None

    def as_json(self) -> dict[str, Any]:
        return {"id": self.id, "figure": self.figure, "value": _num(self.value), "unit": self.unit,
                "limit": _num(self.limit), "limit_what": self.limit_what, "ratio": _num(self.ratio),
                "goal": self.goal, "pass": self.passed, "size_chunks": self.size, "note": self.note}


def _num(value: float | None) -> float | None:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return None
    return round(float(value), 4)


def _fmt(value: float | None, unit: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if unit in ("answers", "calls", "chunks", "files"):
        return f"{value:.0f} {unit}"
    if unit == "exit":
        return f"exit {value:.0f}"
    if abs(value) >= 100:
        return f"{value:,.0f} {unit}"
    if abs(value) >= 10:
        return f"{value:.1f} {unit}"
    return f"{value:.2f} {unit}" if abs(value) >= 1 else f"{value:.3f} {unit}"


def markdown_table(figures: Sequence[Figure]) -> str:
    rows = ["| Figure | Value | Limit | Ratio | Goal | Result |", "| --- | ---: | ---: | ---: | --- | --- |"]
    for f in figures:
        limit = "-" if f.limit is None else _fmt(f.limit, f.unit)
        ratio = "-" if f.ratio is None else f"{f.ratio:.2f}x"
        result = {True: "pass", False: "**FAIL**", None: "-"}[f.passed]
        rows.append(f"| {f.figure} | {_fmt(f.value, f.unit)} | {limit} | {ratio} | {f.goal} | {result} |")
    return "\n".join(rows)


SCALE_COLUMNS = (("build_s", "Build s"), ("chunks_per_s", "Chunks/s"), ("ingest_peak_rss_mb", "Ingest peak RSS MB"),
                 ("server_rss_mb", "Server RSS after 100 searches MB"), ("hybrid_p50_ms", "Hybrid p50 ms"),
                 ("hybrid_p95_ms", "Hybrid p95 ms"), ("vector_p50_ms", "Vector p50 ms"),
                 ("vector_p95_ms", "Vector p95 ms"), ("keyword_p50_ms", "Keyword p50 ms"),
                 ("keyword_p95_ms", "Keyword p95 ms"), ("limit_p50_ms", "Search limit p50 ms"),
                 ("noop_s", "No-op re-ingest s"), ("store_mb", "Store MB"))


def scale_table(rows: Sequence[dict[str, Any]]) -> str:
    """One row per size, then the growth factor of every column from each size to the next
    ("10k/1k": the value at 10k over the value at 1k)."""
    def cell(value: Any) -> str:
        return _fmt(value, "").strip() if isinstance(value, (int, float)) else "-"

    lines = ["| Chunks | " + " | ".join(title for _, title in SCALE_COLUMNS) + " |",
             "| --- |" + " ---: |" * len(SCALE_COLUMNS)]
    for row in rows:
        lines.append(f"| {size_label(row['chunks'])} | " + " | ".join(cell(row.get(k)) for k, _ in SCALE_COLUMNS) + " |")
    for low, high in pairwise(rows):
        factors = [high[k] / low[k] if isinstance(high.get(k), (int, float)) and low.get(k) else None
                   for k, _ in SCALE_COLUMNS]
        lines.append(f"| {size_label(high['chunks'])}/{size_label(low['chunks'])} | "
                     + " | ".join("-" if f is None else f"x{f:.2f}" for f in factors) + " |")
    return "\n".join(lines)


# Issue 30's goals for the largest size, each next to its limit from the same run.
SCALE_GOAL_CHUNKS = 1_000_000
SCALE_P95_GOALS_MS = {"hybrid": 40.0, "keyword": 30.0}
SCALE_FLAT_FROM = 100_000  # p50 at the largest size within SCALE_FLAT_RATIO of this size's
SCALE_FLAT_RATIO = 1.25
SCALE_RSS_GOAL_MB = 1500.0  # with reduced dimensions (--dims)


def scale_goals(rows: Sequence[dict[str, Any]], dims: int | None) -> list[tuple[str, bool]]:
    """(what, met) for each goal the largest row can be judged on: only a row of at least
    SCALE_GOAL_CHUNKS, and the flat-p50 goals only with a SCALE_FLAT_FROM row in the same run."""
    top = max(rows, key=lambda r: r["chunks"], default=None)
    if top is None or top["chunks"] < SCALE_GOAL_CHUNKS:
        return []
    label = size_label(top["chunks"])
    goals = [(f"{mode} p95 at {label}: {top[f'{mode}_p95_ms']:.1f} ms (goal <= {limit:g} ms)",
              top[f"{mode}_p95_ms"] <= limit) for mode, limit in SCALE_P95_GOALS_MS.items()]
    base = next((r for r in rows if r["chunks"] == SCALE_FLAT_FROM), None)
    if base is not None:
        # The limit (a raw Chroma query and a bare round trip, between the searches) grows too:
        # said beside each verdict, which is on the search's own time as the goal states it.
        grown = (top["limit_p50_ms"] / base["limit_p50_ms"] if top.get("limit_p50_ms") and base.get("limit_p50_ms")
                 else None)
        for mode in SCALE_P95_GOALS_MS:
            ratio = top[f"{mode}_p50_ms"] / base[f"{mode}_p50_ms"]
            limit_said = "" if grown is None else f"; the limit grew x{grown:.2f}"
            goals.append((f"{mode} p50 at {label}: {top[f'{mode}_p50_ms']:.1f} ms, x{ratio:.2f} of "
                          f"{size_label(SCALE_FLAT_FROM)}'s {base[f'{mode}_p50_ms']:.1f} ms "
                          f"(goal: flat, <= x{SCALE_FLAT_RATIO:g}{limit_said})", ratio <= SCALE_FLAT_RATIO))
    if dims:
        goals.append((f"server RSS at {label} with {dims} dimensions: {top['server_rss_mb']:,.0f} MB "
                      f"(goal <= {SCALE_RSS_GOAL_MB:,.0f} MB)", top["server_rss_mb"] <= SCALE_RSS_GOAL_MB))
    return goals


def projected_seconds(steps: Sequence[tuple[int, float]], size: int) -> tuple[float, float]:
    """(seconds, k): the time of the next size if time grows as size^k, k measured between the last
    two sizes (at least 1: a build cannot grow slower than the chunks it embeds and writes; at small
    sizes fixed costs make the measured k smaller), 1 after a single size."""
    last_size, last_s = steps[-1]
    exponent = 1.0
    if len(steps) > 1:
        prev_size, prev_s = steps[-2]
        exponent = max(1.0, math.log(last_s / prev_s) / math.log(last_size / prev_size))
    return last_s * (size / last_size) ** exponent, exponent


def machine_line(machine: dict[str, Any]) -> str:
    load = machine.get("loadavg_at_start")
    line = (f"Machine: {machine['nproc']} CPUs ({machine['usable_cpus']} usable), {machine['cpu_model']}, "
            f"{machine['ram_gb']} GB RAM, Python {machine['python']}, {machine['platform']}; "
            + ", ".join(f"{k} {v}" for k, v in machine["packages"].items()))
    if load:
        line += f"; load average at start {load[0]:.2f}"
        if machine.get("loadavg_at_end"):
            line += f", at end {machine['loadavg_at_end'][0]:.2f}"
    return line


# ---------------------------------------------------------------------------
# Measurements.


def server_channel_candidates(python: str, server_path: Path) -> int:
    """n_results the measured server asks Chroma for (its CHANNEL_CANDIDATES), so the raw limit asks
    the same. Asked of that server in its own process: --server may be another checkout, whose
    modules must not mix with this one's."""
    done = subprocess.run([python, "-c", "import server; print(server.CHANNEL_CANDIDATES)"], cwd=server_path.parent,
                          capture_output=True, text=True, timeout=120, check=True,
                          env={**os.environ, "ANONYMIZED_TELEMETRY": "False"})
    return int(done.stdout)


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.quick = args.quick
        self.python = args.python
        self.server = Path(args.server).resolve()
        self.ingest = Path(args.ingest).resolve()
        self.work = Path(args.workdir)
        self.figures: list[Figure] = []
        self.details: dict[str, Any] = {}
        self.fake: FakeProcess | None = None
        self.hello = self.work / "hello_server.py"
        self.hello.write_text(HELLO_SERVER, encoding="utf-8")
        self.bare_http = self.work / "bare_http_server.py"
        self.bare_http.write_text(BARE_HTTP_SERVER, encoding="utf-8")
        sizes = args.scale_sizes if args.scale else args.sizes
        self.sizes = [1000] if self.quick else [int(s) for s in sizes.split(",")]
        # --quick is the test suite's smoke run: every figure once, as few repetitions as give one.
        self.reps = {"handshake": 3 if self.quick else 5, "cold": 1 if self.quick else 3, "roundtrip": 100 if self.quick else 300,
                     "warmup": 5 if self.quick else 10, "hybrid": 40 if self.quick else 120,
                     "other_modes": 30 if self.quick else 60, "raw": 100 if self.quick else 300,
                     "http_single": 40 if self.quick else 80, "http_each": 10 if self.quick else 20,
                     "cli": 3 if self.quick else 5, "watch": 5 if self.quick else 20}
        self.vectors = FastVectors(DIMS)
        self.n_results = server_channel_candidates(self.python, self.server)
        self.stores: dict[int, Path] = {}
        self.corpora: dict[int, Path] = {}
        self.deadline: float | None = None  # --scale: when the budget runs out (perf_counter)

    # helpers --------------------------------------------------------------------------------------
    def add(self, figure: Figure) -> None:
        self.figures.append(figure)
        value = _fmt(figure.value, figure.unit)
        extra = f" (limit {_fmt(figure.limit, figure.unit)}, {figure.ratio:.2f}x)" if figure.ratio is not None else ""
        log(f"{figure.figure}: {value}{extra}")

    def server_env(self, corpus: Path, store: Path, chroma_url: str | None = None,
                   fake: FakeProcess | None = None) -> dict[str, str]:
        env = {**os.environ, "RAG_STORE_DIR": str(store), "RAG_CORPUS_DIR": str(corpus),
               "OLLAMA_HOST": (fake or self.fake).host, "ANONYMIZED_TELEMETRY": "False", "PYTHONUNBUFFERED": "1"}
        for name in ("RAG_EMBED_MODEL", "RAG_EMBED_TIMEOUT", "RAG_CHUNK_MAX_TOKENS", "RAG_CHUNK_MIN_TOKENS",
                     "RAG_SERVER_WARMUP", "RAG_LOG_LEVEL", "RAG_CHROMA_URL"):
            env.pop(name, None)
        if chroma_url:
            env["RAG_CHROMA_URL"] = chroma_url
        return env

    def spawn_server(self, size: int, tag: str, store: Path | None = None, corpus: Path | None = None,
                     chroma_url: str | None = None) -> StdioPeer:
        env = self.server_env(corpus or self.corpora[size], store or self.stores[size], chroma_url)
        return StdioPeer([self.python, str(self.server)], env, self.work / f"server-{tag}.stderr", cwd=self.work)

    def spawn_http(self, size: int, tag: str, fake: FakeProcess | None = None) -> HttpPeer:
        env = self.server_env(self.corpora[size], self.stores[size], fake=fake)
        for name in ("RAG_HTTP_HOST", "RAG_HTTP_TOKEN", "RAG_HTTP_MAX_IN_FLIGHT", "RAG_TOOL_TIMEOUT"):
            env.pop(name, None)
        return HttpPeer([self.python, str(self.server), "--http", "--port", "0"], env,
                        self.work / f"server-{tag}.stderr", cwd=self.work)

    def spawn_bare_http(self) -> HttpPeer:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAG_")}
        return HttpPeer([self.python, str(self.bare_http)], env, self.work / "bare-http.stderr", cwd=self.work)

    def reference_size(self) -> int:
        """The size of the figures measured at one size: 10k chunks, where the issues set their
        goals, when it is built (else the first size, 1k with --quick)."""
        return 10000 if 10000 in self.sizes else self.sizes[0]

    def ingest_once(self, corpus: Path, store: Path, **options: Any) -> IngestRun:
        options.setdefault("timeout_s", self.args.ingest_timeout)
        options.setdefault("fake", self.fake)
        return run_ingest(self.python, corpus, store, log_file=self.work / "ingest.stderr", ingest=self.ingest,
                          **options)

    def spawn_hello(self, tag: str) -> StdioPeer:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAG_")}
        return StdioPeer([self.python, str(self.hello)], env, self.work / f"hello-{tag}.stderr", cwd=self.work)

    def query_vector(self, query: str) -> list[float]:
        sys.path.insert(0, str(PROJECT_DIR))
        import corpus_rules

        text = corpus_rules.PREFIX_SCHEMES["embeddinggemma"].query_text(query)
        return [float(x) for x in self.vectors.matrix([text], self.args.dims)[0]]

    # 1. indexes ---------------------------------------------------------------------------------
    def build_indexes(self) -> None:
        for size in self.sizes:
            self.build_index(size)

    def corpus_dir(self, size: int) -> Path:
        return self.work / f"corpus-{size_label(size)}"

    def store_dir(self, size: int) -> Path:
        return self.work / f"store-{size_label(size)}"

    def corpus_of(self, size: int) -> tuple[Path, dict[str, Any]]:
        """The synthetic corpus of `size` chunks (written, or topped up), and its counts."""
        corpus = self.corpus_dir(size)
        started = time.perf_counter()
        info = write_corpus(corpus, max(1, size // CHUNKS_PER_FILE))
        info["write_s"] = time.perf_counter() - started
        return corpus, info

    def build_index(self, size: int) -> IngestRun:
        files = max(1, size // CHUNKS_PER_FILE)
        corpus, info = self.corpus_of(size)
        store = self.store_dir(size)
        shutil.rmtree(store, ignore_errors=True)
        log(f"ingesting {files} files ({size_label(size)} chunks) ...")
        run = self.ingest_once(corpus, store, timeout_s=max(self.args.ingest_timeout, self.ingest_budget_s()))
        self.corpora[size], self.stores[size] = corpus, store
        chunks = int(run.summary.get("chunks_written", 0))
        seconds = float(run.summary.get("seconds", run.wall_s))
        self.details.setdefault("ingest", {})[size_label(size)] = {
            "corpus": info, "chunks_written": chunks, "files": files, "wall_s": run.wall_s, "run_s": seconds,
            "cpu_s": run.cpu_s, "peak_rss_mb": run.peak_rss_mb,
            "embedding_calls": run.summary.get("embedding_calls"),
            "fake_embed_calls": run.fake_calls, "fake_busy_s": run.fake_busy_s,
            "chunks_per_s_run": chunks / seconds if seconds else None,
            "chunks_per_s_wall": chunks / run.wall_s if run.wall_s else None}
        self.add(Figure(f"ingest.build_s@{size_label(size)}", f"Ingest build time, {size_label(size)} chunks "
                        f"({files} files, process wall)", run.wall_s, "s", "report", size=size,
                        note=f"{chunks} chunks written; embedder busy {run.fake_busy_s:.2f} s"))
        return run

    # 4. ingest throughput vs batched Chroma upserts --------------------------------------------------
    def throughput(self) -> None:
        size = self.reference_size()
        detail = self.details["ingest"][size_label(size)]
        chunks, seconds = detail["chunks_written"], detail["run_s"]
        limit = self.upsert_limit(self.stores[size], self.work / f"limit-upserts-{size_label(size)}")
        value = chunks / seconds
        ratio = value / limit["chunks_per_s"]
        self.details["upsert_limit"] = limit
        # CPU seconds are less sensitive to other load on a shared machine than wall time.
        detail["cpu_ratio"] = limit["cpu_s"] / detail["cpu_s"] if detail.get("cpu_s") else None
        self.add(Figure(f"ingest.throughput@{size_label(size)}", f"Ingest throughput, {size_label(size)} chunks",
                        value, "chunks/s", ">= 0.8x", limit=limit["chunks_per_s"],
                        limit_what="batched Chroma upserts of the same records, fresh collections", ratio=ratio,
                        passed=ratio >= 0.8, size=size,
                        note=f"ingest run() time {seconds:.2f} s (process wall {detail['wall_s']:.2f} s); "
                             f"embedder busy {detail['fake_busy_s']:.2f} s"))

    def upsert_limit(self, store: Path, dest: Path) -> dict[str, Any]:
        """Upsert the records ingest wrote (ids, vectors, texts, metadata) into fresh collections,
        grouped and batched exactly as ingest does (files in path order, >= 256 chunks per group,
        one upsert per lifecycle collection per group, at most 1000 rows each)."""
        os.environ.setdefault("ANONYMIZED_TELEMETRY", "False")
        import chromadb

        import corpus_rules

        current = json.loads((store / "CURRENT.json").read_text())
        client = chromadb.PersistentClient(path=str(store / current["index"] / "chroma"))
        records = []
        metadata = {}
        for name in ("chunks_active", "chunks_superseded"):
            col = client.get_collection(name)
            metadata[name] = {k: v for k, v in (col.metadata or {}).items() if not k.startswith("stamp_")}
            got = col.get(include=["embeddings", "documents", "metadatas"])
            for cid, emb, doc, meta in zip(got["ids"], got["embeddings"], got["documents"], got["metadatas"], strict=True):
                records.append((meta["path"], int(meta["chunk_index"]), cid, [float(x) for x in emb], doc, meta))
        records.sort(key=lambda r: (r[0], r[1]))
        groups: list[list[tuple[Any, ...]]] = []
        group: list[tuple[Any, ...]] = []
        for i, record in enumerate(records):
            group.append(record)
            last_of_file = i + 1 == len(records) or records[i + 1][0] != record[0]
            if last_of_file and len(group) >= 256:
                groups.append(group)
                group = []
        if group:
            groups.append(group)
        shutil.rmtree(dest, ignore_errors=True)
        fresh = chromadb.PersistentClient(path=str(dest))
        cols = {lc: fresh.get_or_create_collection(name, metadata=metadata[name] or None,
                                                   configuration=corpus_rules.VECTOR_CONFIGURATION)
                for lc, name in (("active", "chunks_active"), ("superseded", "chunks_superseded"))}
        upserts = 0
        cpu_started = time.process_time()
        started = time.perf_counter()
        for group in groups:
            for lifecycle, col in cols.items():
                rows = [r for r in group if r[5]["lifecycle"] == lifecycle]
                for at in range(0, len(rows), 1000):
                    batch = rows[at:at + 1000]
                    col.upsert(ids=[r[2] for r in batch], embeddings=[r[3] for r in batch],
                               documents=[r[4] for r in batch], metadatas=[r[5] for r in batch])
                    upserts += 1
        seconds = time.perf_counter() - started
        cpu_s = time.process_time() - cpu_started
        with contextlib.suppress(Exception):
            fresh.close()
        with contextlib.suppress(Exception):
            client.close()
        shutil.rmtree(dest, ignore_errors=True)
        return {"records": len(records), "groups": len(groups), "upsert_calls": upserts, "seconds": seconds,
                "cpu_s": cpu_s, "chunks_per_s": len(records) / seconds}

    # 5. no-op re-ingest --------------------------------------------------------------------------
    def noop_reingest(self) -> None:
        size = max(self.sizes)
        files = size // CHUNKS_PER_FILE
        run = self.ingest_once(self.corpora[size], self.stores[size])
        calls_summary = int(run.summary.get("embedding_calls", -1))
        calls = max(calls_summary, run.fake_calls)
        self.details["noop_reingest"] = {"files": files, "wall_s": run.wall_s, "run_s": run.summary.get("seconds"),
                                         "embedding_calls_summary": calls_summary, "fake_embed_calls": run.fake_calls,
                                         "unchanged": run.summary.get("unchanged"), "peak_rss_mb": run.peak_rss_mb}
        label = f"{files // 1000}k" if files % 1000 == 0 else str(files)
        self.add(Figure(f"reingest.noop_s@{label}files", f"No-op re-ingest, {files} unchanged files (process wall)",
                        run.wall_s, "s", "<= 3 s", passed=run.wall_s <= 3.0, size=size,
                        note=f"ingest run() {float(run.summary.get('seconds', 0)):.2f} s"))
        self.add(Figure(f"reingest.noop_calls@{label}files", f"No-op re-ingest, embedding calls ({files} files)",
                        float(calls), "calls", "0 calls", passed=calls == 0, size=size,
                        note=f"ingest summary {calls_summary}, fake's record {run.fake_calls}"))

    # 1. handshake -----------------------------------------------------------------------------
    def handshakes(self) -> None:
        size = self.sizes[0]
        server_s, hello_s = [], []
        for rep in range(self.reps["handshake"]):
            for which in ("hello", "server"):
                peer = self.spawn_server(size, f"handshake{rep}") if which == "server" else self.spawn_hello(f"hs{rep}")
                with peer:
                    steps = peer.handshake()
                    if which == "server" and "search_corpus" not in peer.tools:
                        raise RuntimeError(f"server.py lists no search_corpus tool: {sorted(peer.tools)}")
                (server_s if which == "server" else hello_s).append(steps["tools_list_s"])
        value, limit = statistics.median(server_s), statistics.median(hello_s)
        self.details["handshake"] = {"server_s": server_s, "hello_s": hello_s}
        self.add(Figure("handshake.median_s", "Handshake: spawn + initialize + tools/list (median of "
                        f"{len(server_s)})", value * 1000, "ms", "<= 1.2x", limit=limit * 1000,
                        limit_what="bare MCPServer hello-world, same run", ratio=value / limit,
                        passed=value / limit <= 1.2))

    # bare stdio round trip ------------------------------------------------------------------------
    def roundtrip(self) -> None:
        with self.spawn_hello("roundtrip") as peer:
            peer.handshake()
            for i in range(20):
                peer.call("echo", {"text": f"warm {i}"})
            samples = []
            for i in range(self.reps["roundtrip"]):
                result, seconds = peer.call("echo", {"text": f"how do I drain the stale replica {i}"})
                samples.append(seconds)
        self.roundtrip_stats = summarize_ms(samples)
        self.details["roundtrip"] = self.roundtrip_stats
        self.add(Figure("stdio.roundtrip_p50_ms", "Bare stdio round trip: hello-world tools/call (p50)",
                        self.roundtrip_stats["p50_ms"], "ms", "report (part of the search limit)"))

    def query_embedding(self) -> None:
        """Issue 46: one query vector through the embedder seam (corpus_rules.Embedder), Ollama's
        API against OpenAI's, each against its loopback fake in this process (the fake's own time
        included: the two are compared with each other, not with a real server)."""
        sys.path[:0] = [str(PROJECT_DIR), str(TESTS_DIR)]
        from fake_ollama import FakeOllama
        from fake_openai import FakeOpenAI

        import corpus_rules

        queries = synthetic_queries(self.reps["roundtrip"] + 20, "query-embedding")
        for api, fake_class, name in (("ollama", FakeOllama, "Ollama API"), ("openai", FakeOpenAI, "OpenAI-compatible API")):
            with fake_class(dims=DIMS) as fake:
                settings = corpus_rules.load_settings({"RAG_EMBED_API": api, "RAG_EMBED_URL": fake.host})
                embedder = settings.embedder(settings.ollama_host)
                samples = []
                for i, query in enumerate(queries):
                    started = time.perf_counter()
                    embedder.embed([f"task: search result | query: {query}"])
                    if i >= 20:  # the first calls pay the imports and the connection
                        samples.append(time.perf_counter() - started)
            stats = summarize_ms(samples)
            self.details[f"query_embedding_{api}"] = stats
            self.add(Figure(f"embed.query_{api}_p50_ms", f"Query embedding through the seam, {name}, loopback fake (p50)",
                            stats["p50_ms"], "ms", "report (compare the two APIs)"))

    # 3. raw Chroma query -------------------------------------------------------------------------
    @contextlib.contextmanager
    def raw_collection(self, size: int) -> Any:
        """The active collection of a size's index, opened with Chroma's own client in this process."""
        os.environ.setdefault("ANONYMIZED_TELEMETRY", "False")
        import chromadb

        current = json.loads((self.stores[size] / "CURRENT.json").read_text())
        client = chromadb.PersistentClient(path=str(self.stores[size] / current["index"] / "chroma"))
        try:
            yield client.get_collection("chunks_active")
        finally:
            with contextlib.suppress(Exception):
                client.close()

    def raw_queries(self, size: int, queries: Sequence[str]) -> dict[str, float]:
        """Raw Chroma queries back to back (reported; the limits are measured between searches,
        see BetweenSearches)."""
        with self.raw_collection(size) as col:
            vectors = [self.query_vector(q) for q in queries]
            for vector in vectors[:self.reps["warmup"]]:
                col.query(query_embeddings=[vector], n_results=self.n_results, include=["distances"])
            samples = []
            for vector in vectors[self.reps["warmup"]:]:
                started = time.perf_counter()
                col.query(query_embeddings=[vector], n_results=self.n_results, include=["distances"])
                samples.append(time.perf_counter() - started)
        return summarize_ms(samples)

    def between_searches(self, col: Any, queries: Sequence[str], round_trip: Callable[[], float]) -> BetweenSearches:
        return BetweenSearches(col, [self.query_vector(q) for q in queries], round_trip, self.n_results)

    # 2. cold first search ------------------------------------------------------------------------
    def cold_search(self, size: int, queries: Sequence[str]) -> None:
        """A client that searches right after the handshake: spawn to the first answer (the goal),
        its parts, whether it was keyword-only because the vector index was still loading, and
        spawn to the first hybrid answer, next to that answer's floor: a fresh interpreter
        importing chromadb and loading the HNSW index. After a keyword-only answer one vector
        search waits for the load (searching hybrid again and again would compete with it for the
        CPU), then the same hybrid search runs again."""
        label = size_label(size)
        runs = []
        for rep in range(self.reps["cold"]):
            with self.spawn_server(size, f"cold-{label}-{rep}") as peer:
                steps = peer.handshake()
                result, seconds = peer.call("search_corpus", {"query": queries[rep]})
                first = time.perf_counter() - peer.spawned_at
                loading = cold_degraded(result)
                if loading:
                    peer.call("search_corpus", {"query": queries[rep], "mode": "vector"})
                hybrid = first
                while cold_degraded(result):
                    result, _ = peer.call("search_corpus", {"query": queries[rep]})
                    hybrid = time.perf_counter() - peer.spawned_at
            runs.append({"handshake_s": steps["tools_list_s"], "first_call_s": seconds, "spawn_to_first_answer_s": first,
                         "keyword_only_while_loading": loading, "spawn_to_hybrid_s": hybrid})
        floor = [self.hybrid_floor(size) for _ in range(self.reps["cold"])]
        self.details.setdefault("cold", {})[label] = {"runs": runs, "hybrid_floor": floor}
        n = len(runs)
        reps = f"median of {n}" if n > 1 else "1 run"

        def median(key: str, rows: Sequence[dict[str, Any]] = runs) -> float:
            return statistics.median(row[key] for row in rows)

        value = median("spawn_to_first_answer_s")
        self.add(Figure(f"cold.first_search_s@{label}", f"Cold start, {label} chunks: spawn to first search answer "
                        f"({reps})", value, "s", f"<= {COLD_ANSWER_GOAL_S:g} s", passed=value <= COLD_ANSWER_GOAL_S,
                        size=size))
        self.add(Figure(f"cold.handshake_s@{label}", f"Cold start, {label} chunks: of which the handshake "
                        "(spawn + initialize + tools/list)", median("handshake_s"), "s", "report", size=size))
        self.add(Figure(f"cold.first_call_s@{label}", f"Cold start, {label} chunks: of which the first search "
                        "call, after the handshake", median("first_call_s"), "s", "report", size=size))
        self.add(Figure(f"cold.keyword_only@{label}", f"Cold start, {label} chunks: first answers keyword-only, "
                        f"the vector index still loading (of {n})", sum(r["keyword_only_while_loading"] for r in runs),
                        "answers", "report", size=size))
        limit = median("spawn_s", floor)
        hybrid = median("spawn_to_hybrid_s")
        self.add(Figure(f"cold.hybrid_s@{label}", f"Cold start, {label} chunks: spawn to the first hybrid answer",
                        hybrid, "s", "report", limit=limit,
                        limit_what="a fresh interpreter: import chromadb, open the index, one query (the HNSW load)",
                        ratio=hybrid / limit, size=size))
        self.add(Figure(f"cold.hnsw_load_s@{label}", f"Cold start, {label} chunks: the HNSW load alone (a fresh "
                        "Chroma client's first query)", median("load_s", floor), "s", "report (the floor)", size=size,
                        note=f"in that fresh interpreter: import chromadb {median('import_s', floor):.2f} s, open "
                             f"{median('open_s', floor):.2f} s"))

    def hybrid_floor(self, size: int) -> dict[str, float]:
        """The least a hybrid answer costs from spawn: a fresh interpreter that imports chromadb,
        opens the size's index and runs one query (loading the HNSW index), nothing else."""
        current = json.loads((self.stores[size] / "CURRENT.json").read_text())
        chroma = self.stores[size] / current["index"] / "chroma"
        started = time.perf_counter()
        done = subprocess.run([self.python, "-c", HYBRID_FLOOR, str(chroma), str(DIMS)], capture_output=True,
                              text=True, timeout=SPAWN_TIMEOUT_S, check=True,
                              env={**os.environ, "ANONYMIZED_TELEMETRY": "False"})
        return {**json.loads(done.stdout), "spawn_s": time.perf_counter() - started}

    def resource_listing(self, size: int) -> None:
        """resources/list through every page (what a client's @-mention menu asks for) right after
        the handshake, while the warm-up imports chromadb and loads the vector index beside it
        (reported), and again on the warm server (judged); then one resources/read of a hit's lines
        through the template."""
        label = size_label(size)

        def every_page(peer: StdioPeer) -> tuple[list[float], int]:
            pages, cursor, documents = [], None, 0
            while True:
                result, seconds = peer.request("resources/list", {"cursor": cursor} if cursor else {})
                pages.append(seconds)
                documents += len(result["resources"])
                cursor = result.get("nextCursor")
                if not cursor:
                    return pages, documents

        with self.spawn_server(size, f"resources-{label}") as peer:
            peer.handshake()
            cold_pages, _ = every_page(peer)
            queries = synthetic_queries(2, f"resources-{label}")
            peer.call("search_corpus", {"query": queries[0], "mode": "vector"})  # waits for the vector index
            pages, documents = every_page(peer)
            found, _ = peer.call("search_corpus", {"query": queries[1]})
            hit = tool_payload(found)["results"][0]
            _, read_s = peer.request("resources/read", {"uri": f"{hit['uri']}?start_line={hit['start_line']}"
                                                               f"&end_line={hit['end_line']}"})
        self.details.setdefault("resources", {})[label] = {"documents": documents, "page_s": pages,
                                                           "cold_page_s": cold_pages, "read_s": read_s}
        page, cold = summarize_ms(pages), summarize_ms(cold_pages)
        self.add(Figure(f"resources.list_page_ms@{label}", f"resources/list, {documents} documents ({label} chunks): "
                        f"one page, p95 of {len(pages)}, warm server", page["p95_ms"], "ms", "<= 100 ms",
                        passed=page["p95_ms"] <= 100, size=size,
                        note=f"every page: {sum(pages):.2f} s; a hit's lines by resources/read: {read_s * 1000:.1f} ms"))
        self.add(Figure(f"resources.cold_list_page_ms@{label}", f"resources/list, {documents} documents ({label} "
                        f"chunks): one page, p95 of {len(cold_pages)}, right after the handshake (the warm-up "
                        "beside it)", cold["p95_ms"], "ms", "report", size=size,
                        note=f"every page: {sum(cold_pages):.2f} s; p50 {cold['p50_ms']:.1f} ms"))

    # 3 + 6. warm searches, server memory --------------------------------------------------------
    def warm_searches(self, size: int, queries: dict[str, list[str]], raw: dict[str, float]) -> None:
        samples: dict[str, list[float]] = {"hybrid": [], "vector": [], "keyword": []}
        errors: list[Any] = []
        count = 0
        hwm_after_100: float | None = None
        response_chars: list[int] = []
        hits: dict[str, list[int]] = {"hybrid": [], "vector": [], "keyword": []}
        label = size_label(size)
        with (self.spawn_server(size, f"warm-{label}") as peer, self.spawn_hello(f"between-{label}") as hello,
              self.raw_collection(size) as col):
            peer.handshake()
            hello.handshake()
            between = self.between_searches(col, queries["raw"],
                                            lambda: hello.call("echo", {"text": "between two searches"})[1])
            for mode in ("hybrid", "vector", "keyword"):
                for q in queries[f"warm-{mode}"]:
                    between.sample()
                    result, _ = peer.call("search_corpus", {"query": q, "mode": mode})
                    count += 1
                    if result.get("isError"):
                        errors.append(tool_payload(result))
            between.restart()  # the warm-up's samples paid first-call costs on both sides
            plan: list[tuple[str, str]] = []
            for i in range(max(len(queries["hybrid"]), len(queries["vector"]))):
                plan += [("hybrid", q) for q in queries["hybrid"][i:i + 1]]
                plan += [("vector", q) for q in queries["vector"][i:i + 1]]
                plan += [("keyword", q) for q in queries["keyword"][i:i + 1]]
            for mode, q in plan:
                arguments = {"query": q} if mode == "hybrid" else {"query": q, "mode": mode}
                between.sample()
                result, seconds = peer.call("search_corpus", arguments)
                count += 1
                samples[mode].append(seconds)
                if result.get("isError"):
                    errors.append(tool_payload(result))
                else:
                    hits[mode].append(len(tool_payload(result).get("results") or []))
                    if mode == "hybrid" and len(response_chars) < 50:
                        response_chars.append(len(json.dumps(result)))
                if count == 100:
                    hwm_after_100 = peer.vm_hwm_mb()
            hwm_end = peer.vm_hwm_mb()
            non_json = list(peer.non_json_lines)
        if errors:
            raise RuntimeError(f"{len(errors)} search_corpus calls failed at {size_label(size)}, e.g. {errors[0]}")
        stats = {mode: summarize_ms(s) for mode, s in samples.items()}
        limits = between.stats()
        limit = limits["limit_p50_ms"]
        rt = self.roundtrip_stats["p50_ms"]
        hot_limit = raw["p50_ms"] + rt
        self.details.setdefault("search", {})[size_label(size)] = {
            "modes": stats, "between_searches": limits, "limit_p50_ms": limit, "raw_chroma_query_back_to_back": raw,
            "roundtrip_p50_ms_back_to_back": rt, "limit_p50_ms_back_to_back": hot_limit,
            "n_results": self.n_results, "searches": count, "server_vm_hwm_mb_after_100": hwm_after_100,
            "server_vm_hwm_mb_end": hwm_end, "non_json_stdout_lines": non_json,
            "hybrid_response_bytes_median": statistics.median(response_chars) if response_chars else None,
            "mean_results": {m: statistics.fmean(v) if v else None for m, v in hits.items()}}
        limit_what = (f"measured between the searches (BetweenSearches): raw unfiltered Chroma query of chunks_active "
                      f"(n_results={self.n_results}) p50 {limits['raw_chroma_query']['p50_ms']:.2f} ms + bare stdio "
                      f"round trip p50 {limits['round_trip']['p50_ms']:.2f} ms")
        h = stats["hybrid"]
        mean_hits = {m: statistics.fmean(v) if v else 0.0 for m, v in hits.items()}

        def hot(p50: float) -> str:
            return f"; {p50 / hot_limit:.2f}x the limit measured back to back ({hot_limit:.2f} ms)"

        self.add(Figure(f"search.hybrid.p50_ms@{label}", f"search_corpus hybrid p50, {label} chunks", h["p50_ms"], "ms",
                        "<= 2.5x", limit=limit, limit_what=limit_what, ratio=h["p50_ms"] / limit,
                        passed=h["p50_ms"] / limit <= 2.5, size=size,
                        note=f"{mean_hits['hybrid']:.1f} results per search on average (k=5){hot(h['p50_ms'])}"))
        self.add(Figure(f"search.hybrid.p95_ms@{label}", f"search_corpus hybrid p95, {label} chunks", h["p95_ms"], "ms",
                        "report", limit=limits["limit_p95_ms"], limit_what="raw query p95 + round trip p50, between "
                        "the searches", ratio=h["p95_ms"] / limits["limit_p95_ms"], size=size))
        for mode, goal in (("vector", 2.0), ("keyword", None)):
            m = stats[mode]
            self.add(Figure(f"search.{mode}.p50_ms@{label}", f"search_corpus {mode}-only p50, {label} chunks",
                            m["p50_ms"], "ms", f"<= {goal:g}x" if goal else "report", limit=limit,
                            limit_what=limit_what, ratio=m["p50_ms"] / limit, size=size,
                            passed=None if goal is None else m["p50_ms"] / limit <= goal,
                            note=f"{mean_hits[mode]:.1f} results per search on average (k=5){hot(m['p50_ms'])}"))
            self.add(Figure(f"search.{mode}.p95_ms@{label}", f"search_corpus {mode}-only p95, {label} chunks",
                            m["p95_ms"], "ms", "report", size=size))
        self.add(Figure(f"search.limit_p50_ms@{label}", f"Search limit p50, {label} chunks: raw Chroma query + bare "
                        "stdio round trip, measured between the searches", limit, "ms", "report (limit)", size=size,
                        note=f"raw query {limits['raw_chroma_query']['p50_ms']:.2f} ms + round trip "
                             f"{limits['round_trip']['p50_ms']:.2f} ms"))
        self.add(Figure(f"search.raw_chroma_p50_ms@{label}", f"Raw Chroma query p50, {label} chunks "
                        f"(n_results={self.n_results}, in process, back to back)", raw["p50_ms"], "ms", "report",
                        size=size))
        if size == max(self.sizes):
            value = hwm_after_100 if hwm_after_100 is not None else hwm_end
            self.add(Figure(f"memory.server_peak_rss_mb@{label}", f"Server peak RSS after 100 searches, {label} chunks "
                            "(VmHWM)", value if value is not None else math.nan, "MB", "report", size=size,
                            note=f"after {count} searches: {_fmt(hwm_end, 'MB')}"))

    # 12. the HTTP doors and the CLI (issue 12) ---------------------------------------------------
    def http_doors(self, size: int, raw: dict[str, float]) -> None:
        exits = [self.http_searches(size, raw), *self.http_throughput(size)]
        failed = next((status for status in exits if status != 0), 0)
        self.details["http"]["sigterm_exits"] = exits
        self.add(Figure("http.sigterm_exit", f"HTTP servers stopped with SIGTERM: exit status ({len(exits)} servers)",
                        float(failed), "exit", "exit 0", passed=failed == 0))
        self.cli_search(size)

    def http_searches(self, size: int, raw: dict[str, float]) -> int:
        """Search p50 through the bridge (POST /mcp/call, httpx), through MCP streamable HTTP as a
        JSON-RPC POST to /mcp (httpx, like the limit) and through the SDK's Client (one session,
        its own cost included) on one `server.py --http`, against a bare Starlette endpoint on the
        same uvicorn setup plus a raw Chroma query, both measured between the searches of the first
        two (BetweenSearches); then /health p50 on the same server. Returns the server's exit
        status after SIGTERM."""
        import anyio
        import httpx

        label = size_label(size)
        n_w, n = self.reps["warmup"], self.reps["hybrid"]
        queries = synthetic_queries(5 * (n_w + n), f"http-{label}")
        bridge_queries, mcp_queries, jsonrpc_queries, modern_queries, limit_queries = (
            queries[i * (n_w + n):(i + 1) * (n_w + n)] for i in range(5))
        log(f"searching the {label} index over HTTP ...")
        with (self.spawn_bare_http() as bare, self.spawn_http(size, f"http-{label}") as server,
              httpx.Client(timeout=RPC_TIMEOUT_S) as http, self.raw_collection(size) as col):
            body = [bridge_call(queries[0])]
            timed_requests(http, "POST", f"{bare.url}/bare", body * n_w)
            bare_s = timed_requests(http, "POST", f"{bare.url}/bare", body * self.reps["roundtrip"])
            between = self.between_searches(col, limit_queries,
                                            lambda: timed_requests(http, "POST", f"{bare.url}/bare", body)[0])
            bridge_s: list[float] = []
            mcp_raw_s: list[float] = []
            modern_s: list[float] = []
            for i, (bridge_query, jsonrpc_query, modern_query) in enumerate(
                    zip(bridge_queries, jsonrpc_queries, modern_queries, strict=True)):
                if i == n_w:
                    between.restart()  # the warm-up's samples paid first-call costs on both sides
                between.sample()
                bridge_s += timed_requests(http, "POST", f"{server.url}/mcp/call", [bridge_call(bridge_query)])
                between.sample()
                mcp_raw_s += jsonrpc_search_samples(http, f"{server.url}/mcp", [jsonrpc_query])
                between.sample()
                modern_s += jsonrpc_search_samples(http, f"{server.url}/mcp", [modern_query], era=ERA_2026)
            mcp_s = anyio.run(mcp_search_samples, f"{server.url}/mcp", mcp_queries)
            health_s = timed_requests(http, "GET", f"{server.url}/health", [None] * self.reps["roundtrip"])
        # The first searches of each door pay the warm-up (imports, the store opened, a session).
        stats = {"bridge": summarize_ms(bridge_s[n_w:]), "mcp_jsonrpc": summarize_ms(mcp_raw_s[n_w:]),
                 "mcp_jsonrpc_2026": summarize_ms(modern_s[n_w:]), "mcp": summarize_ms(mcp_s[n_w:]),
                 "bare": summarize_ms(bare_s), "health": summarize_ms(health_s)}
        limits = between.stats()
        limit = limits["limit_p50_ms"]
        hot_limit = stats["bare"]["p50_ms"] + raw["p50_ms"]
        self.details["http"] = {"size": size, **stats, "between_searches": limits, "limit_p50_ms": limit,
                                "raw_chroma_query_back_to_back": raw, "limit_p50_ms_back_to_back": hot_limit}
        self.add(Figure("http.bare_roundtrip_p50_ms", "Bare Starlette JSON endpoint on uvicorn: POST round trip (p50, "
                        "back to back)", stats["bare"]["p50_ms"], "ms", "report"))
        limit_what = (f"measured between the searches (BetweenSearches): bare Starlette endpoint round trip p50 "
                      f"{limits['round_trip']['p50_ms']:.2f} ms + raw unfiltered Chroma query "
                      f"(n_results={self.n_results}) p50 {limits['raw_chroma_query']['p50_ms']:.2f} ms")
        # The SDK's Client adds its own work (a session, result models) that the limit's plain
        # httpx POST does not have: reported; the server's doors are compared like for like.
        for door, what, goal in (("bridge", "POST /mcp/call", 3.0),
                                 ("mcp_jsonrpc", "MCP streamable HTTP /mcp (JSON-RPC POST, protocol 2025-06-18)", 3.0),
                                 ("mcp_jsonrpc_2026", f"MCP streamable HTTP /mcp (JSON-RPC POST, protocol {ERA_2026})",
                                  3.0),
                                 ("mcp", "MCP streamable HTTP /mcp (the SDK's Client)", None)):
            p50 = stats[door]["p50_ms"]
            self.add(Figure(f"http.{door}.p50_ms@{label}", f"search_corpus hybrid p50 over {what}, {label} chunks",
                            p50, "ms", f"<= {goal:g}x" if goal else "report", limit=limit, limit_what=limit_what,
                            ratio=p50 / limit, passed=None if goal is None else p50 / limit <= goal, size=size,
                            note=f"p95 {stats[door]['p95_ms']:.2f} ms; {p50 / hot_limit:.2f}x the limit measured "
                                 f"back to back ({hot_limit:.2f} ms)"))
        health = stats["health"]["p50_ms"]
        self.add(Figure("http.health_p50_ms", "GET /health p50", health, "ms", "<= 5 ms (absolute)",
                        passed=health <= 5.0, note=f"p95 {stats['health']['p95_ms']:.2f} ms"))
        return server.proc.returncode

    def http_throughput(self, size: int) -> list[int]:
        """Searches per second through POST /mcp/call: HTTP_CLIENTS clients at once against one
        alone, on a `server.py --http` whose embedder takes SLOW_EMBED_PER_TEXT_S per text and works
        on HTTP_CLIENTS calls at a time (the goal), then on one call at a time (reported: an Ollama
        that serves one request at a time bounds the rate whatever the server does). Every query is
        distinct (the server's query cache does not answer), so each search waits for the embedder,
        and those waits can overlap. Returns the servers' exit statuses after SIGTERM."""
        label = size_label(size)
        n_w, single, each = self.reps["warmup"], self.reps["http_single"], self.reps["http_each"]
        per_text_ms = SLOW_EMBED_PER_TEXT_S * 1000
        exits = []
        for slots in (HTTP_CLIENTS, 1):
            queries = synthetic_queries(n_w + single + HTTP_CLIENTS * each, f"http-rate-{label}-{slots}")
            per_client = [queries[n_w + single + i * each:n_w + single + (i + 1) * each] for i in range(HTTP_CLIENTS)]
            log(f"searching the {label} index over HTTP with {HTTP_CLIENTS} clients at once ({per_text_ms:.0f} ms per "
                f"text embedder, {slots} call(s) at a time) ...")
            with FakeProcess(self.python, self.work, delay_per_text_s=SLOW_EMBED_PER_TEXT_S, tag=f"fake-slots{slots}",
                             slots=slots) as embedder, \
                    self.spawn_http(size, f"http-rate-{label}-{slots}", fake=embedder) as server:
                search_rate(server.url, [queries[:n_w]])  # the warm-up: imports, the store opened
                alone = search_rate(server.url, [queries[n_w:n_w + single]])
                together = search_rate(server.url, per_client)
                embedded = embedder.stats()["inputs"]
            exits.append(server.proc.returncode)
            ratio = together / alone
            # A search that did not wait for the embedder (answered from keywords alone) would inflate the rate.
            all_embedded = embedded >= len(queries)
            key = "throughput" if slots == HTTP_CLIENTS else "throughput_serial_embedder"
            self.details["http"][key] = {"clients": HTTP_CLIENTS, "embed_per_text_s": SLOW_EMBED_PER_TEXT_S,
                                         "embed_slots": slots, "single_searches": single, "searches_per_client": each,
                                         "single_per_s": alone, "concurrent_per_s": together, "searches": len(queries),
                                         "texts_embedded": embedded}
            self.add(Figure(f"http.{key}@{label}", f"Searches/s, {HTTP_CLIENTS} concurrent HTTP clients (POST "
                            f"/mcp/call; embedder {per_text_ms:.0f} ms per text, {slots} call(s) at a time), {label} "
                            "chunks", together, "searches/s", ">= 2x" if slots > 1 else "report", limit=alone,
                            limit_what="one client, one search at a time, same server and embedder", ratio=ratio,
                            passed=(ratio >= 2.0 and all_embedded) if slots > 1 else None, size=size,
                            note=f"{HTTP_CLIENTS} x {each} searches; one client: {single} searches; the embedder "
                                 f"embedded {embedded} texts for {len(queries)} searches (warm-up included)"))
        return exits

    def cli_search(self, size: int) -> None:
        """`python server.py search QUERY --json` in a fresh process each time (imports, the store
        opened, one search, the store let go): the process wall a shell or a CI script waits for."""
        label = size_label(size)
        env = self.server_env(self.corpora[size], self.stores[size])
        walls = []
        for query in synthetic_queries(self.reps["cli"], f"cli-{label}"):
            started = time.perf_counter()
            done = subprocess.run([self.python, str(self.server), "search", query, "--json"], env=env,
                                  cwd=self.work, capture_output=True, text=True, timeout=RPC_TIMEOUT_S)
            walls.append(time.perf_counter() - started)
            try:
                results = json.loads(done.stdout).get("results")
            except (ValueError, AttributeError):
                results = None
            if done.returncode != 0 or not results:
                raise RuntimeError(f"`server.py search` exited {done.returncode} with {len(results or [])} results: "
                                   f"{done.stderr[-500:]}")
        value = statistics.median(walls)
        self.details["cli"] = {"size": size, "walls_s": walls}
        self.add(Figure(f"cli.search_cold_s@{label}", f"CLI `server.py search --json`, fresh process, {label} chunks: "
                        f"wall (median of {len(walls)})", value, "s", "<= 2.5 s (absolute)", passed=value <= 2.5,
                        size=size))

    # 7. the vectors on a Chroma server (--chroma-url) -------------------------------------------------
    def chroma_server(self, queries: Sequence[str]) -> None:
        """The same corpus ingested into a Chroma server, and searched through it: ingest throughput
        and search p50 next to the embedded store's figures from this run."""
        size = self.reference_size()
        label = size_label(size)
        store = self.work / f"store-server-{label}"
        shutil.rmtree(store, ignore_errors=True)
        log(f"ingesting the {label} corpus into the Chroma server at {self.args.chroma_url} ...")
        run = self.ingest_once(self.corpora[size], store, chroma_url=self.args.chroma_url)
        chunks = int(run.summary.get("chunks_written", 0))
        value = chunks / float(run.summary.get("seconds", run.wall_s))
        embedded = self.details["ingest"][label]
        self.add(Figure(f"chroma_server.ingest_chunks_per_s@{label}", f"Ingest throughput into a Chroma server, "
                        f"{label} chunks", value, "chunks/s", "report", limit=embedded["chunks_per_s_run"],
                        limit_what="the same ingest into the embedded store, this run",
                        ratio=value / embedded["chunks_per_s_run"], size=size))
        samples = []
        with self.spawn_server(size, f"chroma-server-{label}", store=store, chroma_url=self.args.chroma_url) as peer:
            peer.handshake()
            for q in queries[:self.reps["warmup"]]:
                peer.call("search_corpus", {"query": q})
            for q in queries[self.reps["warmup"]:]:
                result, seconds = peer.call("search_corpus", {"query": q})
                if result.get("isError"):
                    raise RuntimeError(f"search through the Chroma server failed: {tool_payload(result)}")
                samples.append(seconds)
        stats = summarize_ms(samples)
        embedded_p50 = self.details["search"][label]["modes"]["hybrid"]["p50_ms"]
        self.details["chroma_server"] = {"url": self.args.chroma_url, "ingest": run.summary, "search": stats,
                                         "embedded_hybrid_p50_ms": embedded_p50}
        self.add(Figure(f"chroma_server.hybrid.p50_ms@{label}", f"search_corpus hybrid p50 through a Chroma server, "
                        f"{label} chunks", stats["p50_ms"], "ms", "report", limit=embedded_p50,
                        limit_what="the same searches on the embedded store, this run",
                        ratio=stats["p50_ms"] / embedded_p50, size=size))

    def memory_ingest(self) -> None:
        size = max(self.sizes)
        detail = self.details["ingest"][size_label(size)]
        self.add(Figure(f"memory.ingest_peak_rss_mb@{size_label(size)}", f"Ingest peak RSS, {size_label(size)} chunks "
                        "(ingest and its vector process together, sampled)", detail["peak_rss_mb"], "MB", "report",
                        size=size))

    # 8. a slow embedder (issue 11), and embedders that serve several calls at once (issue 30) --------
    def embed_slots(self) -> None:
        """Fresh builds against embedders that take SLOW_EMBED_PER_TEXT_S per text and serve S calls
        at once (Ollama's OLLAMA_NUM_PARALLEL: S = 1, 2, 4, 8 on one host), and against two one-slot
        hosts, with RAG_EMBED_CONCURRENCY unset (ingest measures what each host sustains). Goal: at
        least 0.8 x S x the one-slot rate of this run, until the machine is the bound (the instant
        embedder's ingest rate of this run, reported beside it)."""
        size = 200 if self.quick else SLOTS_CHUNKS
        label = size_label(size)
        corpus, _ = self.corpus_of(size)
        per_text_ms = SLOW_EMBED_PER_TEXT_S * 1000
        rates: dict[str, float] = {}
        instant = self.details.get("ingest", {}).get(label, {})
        cpu_bound = size / instant["wall_s"] if instant.get("wall_s") else None
        self.details["embed_slots"] = {"chunks": size, "per_text_s": SLOW_EMBED_PER_TEXT_S, "runs": {}}
        for name, slots, hosts in (("1", 1, 1), ("2", 2, 1), ("4", 4, 1), ("8", 8, 1), ("2 hosts", 1, 2)):
            store = self.work / f"store-slots-{label}"
            shutil.rmtree(store, ignore_errors=True)
            log(f"ingesting the {label} corpus against {hosts} host(s) of {slots} slot(s), {per_text_ms:.0f} ms per "
                "text ...")
            with contextlib.ExitStack() as stack:
                fakes = [stack.enter_context(FakeProcess(self.python, self.work, delay_per_text_s=SLOW_EMBED_PER_TEXT_S,
                                                         tag=f"fake-slots{slots}-{i}", slots=slots))
                         for i in range(hosts)]
                run = self.ingest_once(corpus, store, fake=fakes[0] if hosts == 1 else FakeHosts(fakes), check=False,
                                       extra_env={"RAG_EMBED_TIMEOUT": str(SLOW_EMBED_TIMEOUT_S)},
                                       timeout_s=max(self.args.ingest_timeout, 3 * size * SLOW_EMBED_PER_TEXT_S))
            shutil.rmtree(store, ignore_errors=True)
            chunks = int(run.summary.get("chunks_written", 0))
            rates[name] = chunks / run.wall_s if run.exit == 0 and run.wall_s else 0.0
            embedders = run.summary.get("embedders", [])
            self.details["embed_slots"]["runs"][name] = {
                "slots": slots, "hosts": hosts, "exit": run.exit, "wall_s": run.wall_s, "chunks": chunks,
                "calls": run.fake_calls, "cpu_s": run.cpu_s, "embedders": embedders}
            parallel = slots * hosts
            one = rates["1"]
            goal = 0.8 * parallel * one
            levels = ", ".join(f"{e.get('most_in_flight')} at a time" for e in embedders) or "no report"
            self.add(Figure(f"slots.chunks_per_s_{name.replace(' ', '_')}@{label}",
                            f"Ingest, {label} chunks, embedder {per_text_ms:.0f} ms per text: {hosts} host(s) serving "
                            f"{slots} call(s) at once, RAG_EMBED_CONCURRENCY unset", rates[name], "chunks/s",
                            ">= 0.8 x S x the one-slot rate" if parallel > 1 else "report",
                            limit=parallel * one if parallel > 1 else 1 / SLOW_EMBED_PER_TEXT_S,
                            limit_what=f"{parallel} x the one-slot rate, this run" if parallel > 1
                            else "the embedder's pace",
                            ratio=rates[name] / (parallel * one) if one else None,
                            passed=(rates[name] >= goal) if parallel > 1 else run.exit == 0, size=size,
                            note=f"exit {run.exit}; {run.fake_calls} calls, {levels}; ingest CPU {run.cpu_s:.0f} s "
                                 f"of {run.wall_s:.0f} s wall; the instant embedder's ingest rate this run: "
                                 + (f"{cpu_bound:.0f} chunks/s" if cpu_bound else "not measured")))

    # a slow embedder (issue 11) --------------------------------------------------------------------
    def slow_embedder(self) -> None:
        """A fresh build against a second fake that takes 20 ms per text, one call at a time, with
        RAG_EMBED_TIMEOUT=60: every chunk must arrive (no call near the timeout, nothing left for the
        next run). The limit is the embedder's own time for the texts, so the ratio is ingest's
        overhead on top of a slow embedder. The 10k corpus takes ~200 s; --quick uses 200 chunks."""
        size = 200 if self.quick else 10000
        label = size_label(size)
        corpus, _ = self.corpus_of(size)
        store = self.work / f"store-slow-{label}"
        shutil.rmtree(store, ignore_errors=True)
        per_text_ms = SLOW_EMBED_PER_TEXT_S * 1000
        log(f"ingesting the {label} corpus against a slow embedder ({per_text_ms:.0f} ms per text) ...")
        with (FakeProcess(self.python, self.work, delay_per_text_s=SLOW_EMBED_PER_TEXT_S, tag="fake-slow") as slow,
              StdioPeer([self.python, str(self.server)], self.server_env(corpus, store, fake=slow),
                        self.work / "server-slow.stderr", cwd=self.work) as peer):
            peer.handshake()
            first_answer = FirstAnswer(peer, synthetic_queries(1, "first-answer")[0])
            run = self.ingest_once(corpus, store, fake=slow, check=False,
                                   extra_env={"RAG_EMBED_TIMEOUT": str(SLOW_EMBED_TIMEOUT_S)},
                                   timeout_s=max(self.args.ingest_timeout, 3 * size * SLOW_EMBED_PER_TEXT_S))
            first_answer.stop()
            fake_stats = slow.stats()
        shutil.rmtree(store, ignore_errors=True)
        summary = run.summary
        chunks = int(summary.get("chunks_written", 0))
        failed, left = int(summary.get("failed", -1)), int(summary.get("left_for_next_run", -1))
        calls = int(summary.get("embedding_calls", -1))
        embedder_s = run.fake_delay_s + run.fake_busy_s
        self.details["slow_embedder"] = {
            "chunks": size, "per_text_s": SLOW_EMBED_PER_TEXT_S, "embed_timeout_s": SLOW_EMBED_TIMEOUT_S,
            "exit": run.exit, "summary": {k: v for k, v in summary.items() if k != "listing"}, "wall_s": run.wall_s,
            "peak_rss_mb": run.peak_rss_mb, "fake_calls": run.fake_calls, "fake_inputs": run.fake_inputs,
            "fake_delay_s": run.fake_delay_s, "fake_busy_s": run.fake_busy_s, "largest_call": run.largest_call,
            "fake_dropped_calls": fake_stats["dropped_calls"], "first_answer": first_answer.report()}
        self.add(Figure(f"slow.first_answer_s@{label}", f"First ingest with a slow embedder ({per_text_ms:.0f} ms "
                        f"per text), {label} chunks: its start to the first search that returns hits (hybrid, a "
                        "stdio server started before it)", first_answer.seconds, "s", "<= 30 s",
                        limit=run.wall_s, limit_what="the whole ingest, this run",
                        ratio=first_answer.seconds / run.wall_s if run.wall_s else None,
                        passed=first_answer.seconds <= 30.0, size=size,
                        note=f"answered with degraded={first_answer.degraded!r} after {first_answer.polls} "
                             "searches"))
        what = f"slow embedder ({per_text_ms:.0f} ms per text, RAG_EMBED_TIMEOUT={SLOW_EMBED_TIMEOUT_S}), {label} chunks"
        self.add(Figure(f"slow.failures@{label}", f"Ingest with a {what}: files failed or left for the next run",
                        float(max(failed, 0) + max(left, 0)), "files", "0 failures",
                        passed=run.exit == 0 and failed == 0 and left == 0, size=size,
                        note=f"exit {run.exit}; failed {failed}, left_for_next_run {left}; {chunks} chunks written"))
        self.add(Figure(f"slow.build_s@{label}", f"Ingest with a {what}: build time (process wall)", run.wall_s, "s",
                        "report", limit=embedder_s, limit_what="the slow embedder's own time for these texts, this run",
                        ratio=run.wall_s / embedder_s if embedder_s else None, size=size))
        self.add(Figure(f"slow.chunks_per_s@{label}", f"Ingest with a {what}: throughput", chunks / run.wall_s,
                        "chunks/s", "report", limit=1 / SLOW_EMBED_PER_TEXT_S,
                        limit_what="the embedder's pace", ratio=chunks / run.wall_s * SLOW_EMBED_PER_TEXT_S, size=size))
        self.add(Figure(f"slow.embed_calls@{label}", f"Ingest with a {what}: embedding calls", float(calls), "calls",
                        "report", size=size,
                        note=f"the fake answered {run.fake_calls} calls with {run.fake_inputs} texts and dropped "
                             f"{fake_stats['dropped_calls']} (client gone); largest call {run.largest_call} chunks"))
        self.add(Figure(f"slow.largest_call@{label}", f"Ingest with a {what}: largest embedding call",
                        float(run.largest_call), "chunks", "report", size=size))

    # 9. --watch: edit to searchable (issue 11) ---------------------------------------------------
    def watch_latency(self) -> None:
        """`ingest.py --watch` on its own 1k-chunk corpus and store, and a live server on that store:
        append a token only that edit contains to one file, then search for it (keyword mode, every
        50 ms) until the file comes back. The next edit waits for the watcher's report of the run and
        WATCH_QUIET_S more, so each edit is measured from an idle watcher (an edit made during a run
        would also count the rest of that run)."""
        size = 1000
        label = size_label(size)
        corpus, store = self.work / f"corpus-watch-{label}", self.work / f"store-watch-{label}"
        for folder in (corpus, store):
            shutil.rmtree(folder, ignore_errors=True)
        write_corpus(corpus, size // CHUNKS_PER_FILE)
        # Active documents only: a search leaves superseded ones out.
        files = [f for f in sorted(corpus.rglob("*.md")) if "lifecycle: superseded" not in f.read_text("utf-8")]
        settle = self.args.settle
        log(f"watching the {label} corpus (--settle {settle:g}) and searching for {self.reps['watch']} edits ...")
        stderr = open(self.work / "watch.stderr", "ab")
        watcher = subprocess.Popen([self.python, str(self.ingest), "--corpus", str(corpus), "--store", str(store),
                                    "--json", "--watch", "--settle", str(settle)],
                                   stdout=subprocess.PIPE, stderr=stderr, env=self.server_env(corpus, store),
                                   text=True, preexec_fn=_default_sigint)
        reports: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=_json_lines, args=(watcher.stdout, reports), daemon=True).start()
        latencies: list[float] = []
        runs: list[dict[str, Any]] = []
        misses = 0
        try:
            first = _next_report(watcher, reports, self.args.ingest_timeout, "its first run")
            if first.get("exit") != 0:
                raise RuntimeError(f"the watcher's first run failed: {str(first)[:300]}")
            rng = random.Random("local-rag-mcp-bench-watch")
            with self.spawn_server(size, "watch", store=store, corpus=corpus) as peer:
                peer.handshake()
                peer.call("search_corpus", {"query": "warm up the keyword channel", "mode": "keyword"})
                for probe in range(self.reps["watch"]):
                    path = files[(probe * 37) % len(files)]
                    token = f"benchwatch{probe:02d}{rng.randrange(36 ** 6):06x}"
                    with open(path, "a", encoding="utf-8") as handle:
                        handle.write(f"\nThe {token} marker was appended by the benchmark.\n")
                    seconds = self._until_found(peer, token, path.relative_to(corpus).as_posix(), time.perf_counter())
                    if seconds is None:
                        misses += 1
                        latencies.append(math.inf)
                    else:
                        latencies.append(seconds)
                    report = _next_report(watcher, reports, WATCH_FIND_TIMEOUT_S, f"a run for edit {probe}")
                    runs.append({k: report.get(k) for k in ("exit", "updated", "chunks_embedded", "seconds")})
                    time.sleep(WATCH_QUIET_S)
        finally:
            watcher.send_signal(signal.SIGINT)
            try:
                exit_status = watcher.wait(timeout=30)
            except subprocess.TimeoutExpired:
                watcher.kill()
                exit_status = watcher.wait(timeout=10)
            stderr.close()
        run_s = [r["seconds"] for r in runs if isinstance(r.get("seconds"), (int, float))]
        p50, p95 = percentile(latencies, 50), percentile(latencies, 95)
        self.details["watch"] = {"settle_s": settle, "latencies_s": latencies, "misses": misses, "runs": runs,
                                 "poll_s": WATCH_POLL_S, "sigint_exit": exit_status}
        run_note = f"watcher run median {statistics.median(run_s):.2f} s" if run_s else "no watcher runs"
        what = f"--watch --settle {settle:g}, {label} chunks, {self.reps['watch']} edits"
        self.add(Figure(f"watch.latency_p50_s@{label}", f"Edit to searchable ({what}) p50", p50, "s", "<= 3 s",
                        limit=settle, limit_what="--settle: how long changes must be quiet before a run",
                        ratio=p50 / settle if settle else None, passed=p50 <= 3.0, size=size,
                        note=f"{run_note}; {misses} edit(s) not found within {WATCH_FIND_TIMEOUT_S:.0f} s"))
        self.add(Figure(f"watch.latency_p95_s@{label}", f"Edit to searchable ({what}) p95", p95, "s", "report",
                        size=size))
        self.add(Figure(f"watch.sigint_exit@{label}", "Watcher stopped with SIGINT: exit status", float(exit_status),
                        "exit", "exit 0", passed=exit_status == 0, size=size))

    def _until_found(self, peer: StdioPeer, token: str, path: str, since: float) -> float | None:
        """Seconds from `since` until a keyword search for `token` returns `path`, polling every
        WATCH_POLL_S; None when it does not within WATCH_FIND_TIMEOUT_S."""
        polls = 0
        while time.perf_counter() - since < WATCH_FIND_TIMEOUT_S:
            result, _ = peer.call("search_corpus", {"query": token, "mode": "keyword"})
            if any(hit.get("path") == path for hit in tool_payload(result).get("results") or []):
                return time.perf_counter() - since
            polls += 1
            time.sleep(max(0.0, since + polls * WATCH_POLL_S - time.perf_counter()))
        return None

    # 10. no-op re-ingest with scope rules (issue 11) ---------------------------------------------
    def noop_with_rules(self) -> None:
        """The no-op re-ingest of the largest corpus again, with the scope in play: a root .ragignore
        (a pattern matching nothing, a folder of extra files left out, *.draft.md left out and one
        brought back by a negation) and a node_modules/ folder of 300 Markdown files (a built-in
        exclude). One run takes the rules in (it indexes keep.draft.md); the next is timed. Runs
        after the searches: it changes the largest corpus."""
        size = max(self.sizes)
        corpus, store = self.corpora[size], self.stores[size]
        files = size // CHUNKS_PER_FILE
        (corpus / ".ragignore").write_text("# bench: scope rules in play\nno-such-folder/\nscratch/\n*.draft.md\n"
                                           "!keep.draft.md\n", encoding="utf-8")
        extras = [f"scratch/note-{i:03d}.md" for i in range(200)]
        extras += [f"node_modules/pkg-{i // 10:02d}/docs/page-{i % 10}.md" for i in range(300)]
        extras += [f"drafts/idea-{i}.draft.md" for i in range(5)] + ["drafts/keep.draft.md"]
        for i, rel in enumerate(extras):
            (corpus / rel).parent.mkdir(parents=True, exist_ok=True)
            (corpus / rel).write_text(synthetic_document(EXTRA_DOCS_FROM + i)[1], encoding="utf-8")
        setup = self.ingest_once(corpus, store)
        run = self.ingest_once(corpus, store)
        expected_ignored = 2 + 5  # scratch/, node_modules/, the five drafts
        calls = max(int(run.summary.get("embedding_calls", -1)), run.fake_calls)
        scoped = (int(setup.summary.get("added", -1)) == 1 and int(run.summary.get("ignored", -1)) == expected_ignored
                  and int(run.summary.get("unchanged", -1)) == files + 1)
        self.details["noop_with_rules"] = {
            "files": files, "extra_files": len(extras), "wall_s": run.wall_s, "run_s": run.summary.get("seconds"),
            "setup": {k: setup.summary.get(k) for k in ("added", "ignored", "unchanged", "chunks_written")},
            "noop": {k: run.summary.get(k) for k in ("ignored", "unchanged", "embedding_calls")},
            "expected_ignored": expected_ignored, "scope_as_written": scoped}
        label = f"{files // 1000}k" if files % 1000 == 0 else str(files)
        limit = self.details["noop_reingest"]["wall_s"]
        self.add(Figure(f"reingest.noop_rules_s@{label}files", f"No-op re-ingest with .ragignore rules and "
                        f"node_modules/, {files + 1} unchanged files (process wall)", run.wall_s, "s",
                        "<= 3 s, scope as written", limit=limit, limit_what="the no-op re-ingest without rules, this run",
                        ratio=run.wall_s / limit, passed=run.wall_s <= 3.0 and scoped and calls == 0, size=size,
                        note=f"{run.summary.get('ignored')} ignored (expected {expected_ignored}: scratch/, "
                             f"node_modules/, 5 drafts), {run.summary.get('unchanged')} unchanged, {calls} embedding "
                             f"calls; the run taking the rules in added {setup.summary.get('added')} (keep.draft.md)"))

    # 11. each distinct text embedded once (issue 14) ---------------------------------------------
    def reuse(self) -> None:
        """What reaches the embedder, counted by the fake and cross-checked with ingest's summary, on
        a 1k-chunk corpus of its own: `--full` (everything, nothing reused), one paragraph edited in
        a 40-section file (that section only), a folder of 100 files renamed (nothing)."""
        size = 1000
        label = size_label(size)
        corpus, store = self.work / f"corpus-reuse-{label}", self.work / f"store-reuse-{label}"
        for folder in (corpus, store):
            shutil.rmtree(folder, ignore_errors=True)
        write_corpus(corpus, size // CHUNKS_PER_FILE)
        log(f"counting what reaches the embedder: --full, an edit, a rename ({label} chunks) ...")
        self.ingest_once(corpus, store)
        full = self.ingest_once(corpus, store, extra_args=["--full"])
        written = int(full.summary.get("chunks_written", 0))
        self.add(Figure(f"reuse.full_embedded@{label}", f"--full re-ingest, {label} chunks: chunks embedded",
                        float(full.embedded), "chunks", "all (= chunks written)", limit=written,
                        limit_what="chunks written by the same run", ratio=full.embedded / written if written else None,
                        passed=written > 0 and int(full.summary.get("chunks_embedded", -1)) == full.fake_inputs == written,
                        size=size, note=self._counted(full)))

        sectioned = corpus / "handbook" / "operations.md"
        sectioned.parent.mkdir(parents=True, exist_ok=True)
        sectioned.write_text(sectioned_document(40), encoding="utf-8")
        moving = corpus / "moving" / "batch-a"
        moving.mkdir(parents=True)
        for i in range(100):
            path, content = synthetic_document(EXTRA_DOCS_FROM + 1000 + i)
            (moving / Path(path).name).write_text(content, encoding="utf-8")
        self.ingest_once(corpus, store)

        sectioned.write_text(sectioned_document(40, edited=20), encoding="utf-8")
        edit = self.ingest_once(corpus, store)
        self.add(Figure(f"reuse.edit_embedded@{label}", "One paragraph edited in a 40-section file: chunks embedded",
                        float(edit.embedded), "chunks", "<= 2 chunks", passed=edit.embedded <= 2, size=size,
                        note=f"{edit.summary.get('chunks_written')} chunks of the file written; " + self._counted(edit)))

        moving.rename(moving.parent / "batch-b")
        renamed = self.ingest_once(corpus, store)
        self.add(Figure(f"reuse.rename_embedded@{label}", "A folder of 100 files renamed: chunks embedded",
                        float(renamed.embedded), "chunks", "0 chunks", passed=renamed.embedded == 0, size=size,
                        note=f"{renamed.summary.get('added')} added, {renamed.summary.get('removed')} removed, "
                             f"{renamed.summary.get('chunks_written')} chunks written; " + self._counted(renamed)))
        self.add(Figure(f"reuse.rename_s@{label}", "A folder of 100 files renamed: re-ingest (process wall)", renamed.wall_s,
                        "s", "report", size=size))
        self.details["reuse"] = {name: {"wall_s": r.wall_s, "fake_inputs": r.fake_inputs, "fake_calls": r.fake_calls,
                                        **{k: r.summary.get(k) for k in ("added", "updated", "removed", "chunks_written",
                                                                         "chunks_embedded", "chunks_reused")}}
                                 for name, r in (("full", full), ("edit", edit), ("rename", renamed))}
        for folder in (corpus, store):
            shutil.rmtree(folder, ignore_errors=True)

    @staticmethod
    def _counted(run: IngestRun) -> str:
        return (f"summary: {run.summary.get('chunks_embedded')} embedded, {run.summary.get('chunks_reused')} reused; "
                f"the fake embedded {run.fake_inputs} texts in {run.fake_calls} calls")

    # --scale (issue 14) --------------------------------------------------------------------------
    def ingest_budget_s(self) -> float:
        """What is left of --scale-budget (0 outside --scale): a big build may take that long."""
        return max(0.0, self.deadline - time.perf_counter()) if self.deadline is not None else 0.0

    def run_scale(self) -> None:
        """Build, re-ingest and search each size in turn; before the next size, project its time from
        the last two (time ~ size^k) and stop when it would not fit in what is left of the budget."""
        self.deadline = time.perf_counter() + self.args.scale_budget
        rows: list[dict[str, Any]] = []
        self.details["scale"] = {"budget_s": self.args.scale_budget, "rows": rows, "stopped": None}
        steps: list[tuple[int, float]] = []
        with FakeProcess(self.python, self.work) as fake:
            self.fake = fake
            self.roundtrip()
            self.query_embedding()
            for size in self.sizes:
                if steps:
                    projected, exponent = projected_seconds(steps, size)
                    if projected > self.ingest_budget_s():
                        how = "from the last two sizes, at least 1" if len(steps) > 1 else "assumed after one size"
                        stopped = (f"stopped before {size_label(size)} chunks: projected {projected:,.0f} s for it "
                                   f"(time ~ size^{exponent:.2f}, the exponent {how}), more than the "
                                   f"{self.ingest_budget_s():,.0f} s left of --scale-budget {self.args.scale_budget:g}")
                        self.details["scale"]["stopped"] = stopped
                        log(stopped)
                        break
                started = time.perf_counter()
                rows.append(self.scale_row(size))
                rows[-1]["step_s"] = time.perf_counter() - started
                steps.append((size, rows[-1]["step_s"]))
            self.details["fake_total"] = fake.stats()

    def scale_row(self, size: int) -> dict[str, Any]:
        label = size_label(size)
        row: dict[str, Any] = {"chunks": size}
        if self.args.reuse_stores and self.reused_store(size):
            log(f"searching the {label} index already in {self.work} (--reuse-stores: not built again)")
            read_through(self.stores[size])  # its pages in the OS cache, as right after a build
        else:
            build = self.build_index(size)
            chunks = int(build.summary.get("chunks_written", 0))
            row.update(chunks_written=chunks, build_s=build.wall_s, chunks_per_s=chunks / build.wall_s,
                       ingest_peak_rss_mb=build.peak_rss_mb)
        row["noop_s"] = self.ingest_once(self.corpora[size], self.stores[size]).wall_s
        queries = self.search_queries(size)
        log(f"searching the {label} index ...")
        self.warm_searches(size, queries, self.raw_queries(size, queries["raw"]))
        search = self.details["search"][label]
        row.update(server_rss_mb=search["server_vm_hwm_mb_after_100"], store_mb=disk_usage_mb(self.stores[size]),
                   limit_p50_ms=search["limit_p50_ms"])
        for mode, stats in search["modes"].items():
            row[f"{mode}_p50_ms"], row[f"{mode}_p95_ms"] = stats["p50_ms"], stats["p95_ms"]
        log(f"{label}: " + ", ".join(f"{k} {v:.4g}" for k, v in row.items() if isinstance(v, float)))
        return row

    def reused_store(self, size: int) -> bool:
        """Whether --workdir holds this size's corpus and index from an earlier run, built at the
        dimensions asked for now (a million chunks take an hour to build; their searches, a minute)."""
        corpus, store = self.corpus_dir(size), self.store_dir(size)
        if not (store / "CURRENT.json").is_file() or not corpus.is_dir():
            return False
        built = json.loads((store / "CURRENT.json").read_text())["manifest"].get("embed_dimensions")
        if built != self.args.dims:
            raise SystemExit(f"bench: {store} was built with --dims {built}, not {self.args.dims}: pass the same "
                             "--dims, or another --workdir")
        self.corpora[size], self.stores[size] = corpus, store
        return True

    # the run ---------------------------------------------------------------------------------
    def search_queries(self, size: int) -> dict[str, list[str]]:
        """Distinct queries for one size's searches, by purpose."""
        n_h, n_o, n_w = self.reps["hybrid"], self.reps["other_modes"], self.reps["warmup"]
        qs = synthetic_queries(self.reps["cold"] + 3 * n_w + n_h + 2 * n_o + self.reps["raw"] + n_w, size_label(size))
        queries: dict[str, list[str]] = {}
        at = 0
        for name, n in (("cold", self.reps["cold"]), ("warm-hybrid", n_w), ("warm-vector", n_w),
                        ("warm-keyword", n_w), ("hybrid", n_h), ("vector", n_o), ("keyword", n_o),
                        ("raw", self.reps["raw"] + n_w)):
            queries[name] = qs[at:at + n]
            at += n
        return queries

    def run(self) -> None:
        with FakeProcess(self.python, self.work) as fake:
            self.fake = fake
            self.build_indexes()
            self.throughput()
            self.noop_reingest()
            self.memory_ingest()
            self.handshakes()
            self.roundtrip()
            self.query_embedding()
            for size in self.sizes:
                queries = self.search_queries(size)
                log(f"searching the {size_label(size)} index ...")
                raw = self.raw_queries(size, queries["raw"])
                self.cold_search(size, queries["cold"])
                self.warm_searches(size, queries, raw)
                self.resource_listing(size)
                if size == self.reference_size():
                    self.http_doors(size, raw)
                if self.args.chroma_url and size == self.reference_size():
                    self.chroma_server(queries["warm-hybrid"] + queries["hybrid"])
            self.reuse()
            self.watch_latency()
            self.slow_embedder()
            self.embed_slots()
            self.noop_with_rules()  # last: it adds files to the largest corpus
            self.details["fake_total"] = fake.stats()
        if not self.quick:  # a minute of reading: not the test suite's smoke run
            self.hostile_reads()
            self.code_repository()

    def hostile_reads(self) -> None:
        """Each text reader on hostile input, against the Markdown reader on the same kind of input:
        time to read and chunk, and the process's peak memory (issue 40: within Markdown's bounds)."""
        log("reading hostile input in every format ...")
        rows = []
        for name, (markdown, forms) in HOSTILE_READS.items():
            limit = read_cost(self.python, self.work, markdown(), EXTENSIONS["markdown"])
            for fmt, make in forms.items():
                cost = read_cost(self.python, self.work, make(), EXTENSIONS[fmt])
                rows.append({"input": name, "format": fmt, **cost, "markdown": limit})
                for measure, unit, what in (("s", "s", "time"), ("rss_mb", "MB", "peak memory")):
                    ratio = cost[measure] / max(limit[measure], 1e-3)
                    self.add(Figure(f"readers.{fmt}.{what.replace(' ', '_')}", f"Reading {name} as {fmt}: {what} "
                                    "(read and chunk, fresh process)", cost[measure], unit, "<= 2x Markdown's",
                                    limit=limit[measure], limit_what="the same kind of input read as Markdown",
                                    ratio=ratio, passed=ratio <= 2.0, note=f"{cost['chunks']:.0f} chunks"))
        self.details["hostile_reads"] = rows


    def code_repository(self, files: int | None = None) -> None:
        """A generated repository of `files` source files (Python, Go, TypeScript, Rust, Java) with
        its docs, ingested with --code (issue 44): build time and peak memory, the code readers'
        chunks per second against reading the same files as plain text, and search latency on it."""
        files = files or CODE_REPOSITORY_FILES
        log(f"writing and ingesting a repository of {files} source files (--code) ...")
        corpus, store = self.work / "code-repository", self.work / "store-code-repository"
        write_repository(corpus, files)
        shutil.rmtree(store, ignore_errors=True)
        with FakeProcess(self.python, self.work, tag="fake-code") as fake:
            run = self.ingest_once(corpus, store, fake=fake, extra_args=("--code",))
            chunks = int(run.summary.get("chunks_written", 0))
            self.add(Figure("code.build_s", f"Ingest --code of a generated repository ({files} source files, process "
                            "wall)", run.wall_s, "s", "report", note=f"{chunks} chunks written"))
            self.add(Figure("code.peak_rss_mb", f"Ingest --code peak RSS ({files} source files, ingest and its vector "
                            "process together, sampled)", run.peak_rss_mb, "MB", "report"))
            done = subprocess.run([self.python, "-c", READ_REPOSITORY, str(PROJECT_DIR), str(corpus)], capture_output=True,
                                  text=True, timeout=1800, check=True)
            reading = json.loads(done.stdout)
            self.add(Figure("code.parse_chunks_per_s", "Reading and chunking the repository's source files by syntax "
                            "tree (symbol chunks), in one process", reading["code_chunks"] / reading["code_s"],
                            "chunks/s", "report", limit=reading["plain_chunks"] / reading["plain_s"],
                            limit_what="the same files read and chunked as plain text",
                            ratio=(reading["code_chunks"] / reading["code_s"]) / (reading["plain_chunks"] / reading["plain_s"]),
                            note=f"{reading['code_chunks']} symbol chunks in {reading['code_s']:.1f} s; as plain text "
                                 f"{reading['plain_chunks']} chunks in {reading['plain_s']:.1f} s"))
            env = self.server_env(corpus, store, fake=fake)
            queries = [f"where does the {w} handler retry a failed {v}" for w, v in
                       zip(CODE_WORDS, reversed(CODE_WORDS), strict=True)]
            with StdioPeer([self.python, str(self.server)], env, self.work / "server-code.stderr", cwd=self.work) as peer:
                peer.handshake()
                samples: dict[str, list[float]] = {"all": [], "code": []}
                for scope in ("all", "code"):
                    for query in queries[:5]:  # warm-up
                        peer.call("search_corpus", {"query": query, "scope": scope})
                    for query in queries * 3:
                        result, seconds = peer.call("search_corpus", {"query": query, "scope": scope})
                        if result.get("isError"):
                            raise RuntimeError(f"search_corpus failed on the code repository: {tool_payload(result)}")
                        samples[scope].append(seconds)
        for scope, values in samples.items():
            stats = summarize_ms(values)
            self.add(Figure(f"code.search_{scope}.p50_ms", f"search_corpus hybrid p50, scope {scope}, on the generated "
                            f"repository ({chunks} chunks)", stats["p50_ms"], "ms", "report",
                            note=f"p95 {stats['p95_ms']:.1f} ms over {stats['n']} searches"))
        self.details["code_repository"] = {"files": files, "chunks": chunks, "wall_s": run.wall_s,
                                           "peak_rss_mb": run.peak_rss_mb, "reading": reading,
                                           "search_ms": {scope: summarize_ms(v) for scope, v in samples.items()}}


# Hostile input for each text reader next to the same kind of input in Markdown, the format whose
# reader the others must not exceed (issue 40): by name, (Markdown's form, each format's form).
HOSTILE_READS: dict[str, tuple[Callable[[], str], dict[str, Callable[[], str]]]] = {
    "a 1 MB line of prose": (lambda: "word " * 200_000, {
        "mdx": lambda: "word " * 200_000, "rst": lambda: "word " * 200_000, "asciidoc": lambda: "word " * 200_000}),
    "a 1 MB line of markup": (lambda: "*a* `b` [c](d) " * 66_000, {
        "mdx": lambda: '<Tab title="x">a</Tab> ' * 43_000, "rst": lambda: ":func:`a` ``b`` *c* " * 50_000,
        "asciidoc": lambda: "*a* `b` xref:c[d] " * 55_000}),
    # 20,000 headings of 4-5 lines each: as many as a text file may hold (TEXT_FILE_MAX_LINES).
    "20,000 headings": (lambda: "".join(f"# Title {k}\n\ntext\n\n" for k in range(20_000)), {
        "mdx": lambda: "".join(f"# Title {k}\n\ntext\n\n" for k in range(20_000)),
        "rst": lambda: "".join(f"Title {k}\n{'=' * 12}\n\ntext\n\n" for k in range(20_000)),
        "asciidoc": lambda: "".join(f"== Title {k}\n\ntext\n\n" for k in range(20_000))}),
    # Nesting by indentation or by ever longer delimiters grows the file with the square of the depth:
    # deep enough to be past any recursion limit (1,000), about a megabyte each.
    "1,000 nested blocks": (lambda: "".join("> " * k + "x\n" for k in range(1, 1_000)), {
        "mdx": lambda: "\n".join([*(f"<Box{k}>" for k in range(1_000)), *(f"</Box{k}>" for k in range(1_000))]),
        "rst": lambda: "\n".join(" " * (2 * k) + ".. note:: level" for k in range(1_000)),
        "asciidoc": lambda: "\n".join([c * (4 + k // 4) for k, c in zip(range(1_000), "=*_." * 250, strict=True)]
                                      + ["x"] + [c * (4 + k // 4) for k, c in reversed(list(zip(
                                          range(1_000), "=*_." * 250, strict=True)))])}),
}
EXTENSIONS = {"markdown": ".md", "mdx": ".mdx", "rst": ".rst", "asciidoc": ".adoc"}
READ_ONE = """import json, resource, sys, time
sys.path.insert(0, sys.argv[1]); import corpus_rules as rules
raw = open(sys.argv[2], "rb").read(); started = time.perf_counter()
doc = rules.parse_document(raw, sys.argv[3]); chunks = rules.chunk_document(doc, 512, 64, 1900)
print(json.dumps({"s": time.perf_counter() - started, "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "chunks": len(chunks)}))"""


CODE_REPOSITORY_FILES = 5000
CODE_WORDS = ("upload", "invoice", "session", "payment", "report", "cache", "token", "queue", "mailer", "backup",
              "search", "profile", "billing", "export", "import", "webhook", "schedule", "audit", "ledger", "thumbnail")
CODE_FILES = {  # extension -> the text of one generated file, from its index and its topic words
    ".py": lambda n, a, b: (f'"""The {a} module ({n})."""\n\nimport time\n\nMAX_{a.upper()}_RETRIES = 3\n\n\n'
                            + "".join(f"def {a}_{b}_{k}(item, attempt=0):\n    \"\"\"Handle one {b} for {a} {k}.\"\"\"\n"
                                      + "".join(f"    item = item + {j}  # step {j} of {b}\n" for j in range(6))
                                      + "    return item\n\n\n" for k in range(6))
                            + f"class {a.title()}{b.title()}Service:\n    \"\"\"Keeps {a} and {b} in step.\"\"\"\n\n"
                            + "".join(f"    def step_{k}(self, value):\n        return value * {k}\n\n" for k in range(4))),
    ".go": lambda n, a, b: (f"// Package {a} handles {b} ({n}).\npackage {a}\n\nimport \"time\"\n\n"
                            f"// {a.title()}Client sends {b} requests.\ntype {a.title()}Client struct {{\n\tn int\n}}\n\n"
                            + "".join(f"// Do{k} retries a failed {b}.\nfunc (c *{a.title()}Client) Do{k}(x int) error {{\n"
                                      + "".join(f"\tx += {j} // {b} step\n" for j in range(6))
                                      + "\ttime.Sleep(1)\n\treturn nil\n}\n\n" for k in range(8))),
    ".ts": lambda n, a, b: (f'import {{ log }} from "./log";\n\n/** {a} {b} service ({n}). */\n'
                            f"export class {a.title()}Service {{\n"
                            + "".join(f"  /** Get {b} {k}. */\n  async get{b.title()}{k}(id: string): Promise<number> {{\n"
                                      + "".join(f"    log(id, {j});\n" for j in range(5)) + "    return 1;\n  }\n\n"
                                      for k in range(6)) + "}\n"),
    ".rs": lambda n, a, b: (f"use std::io;\n\n/// A {a} {b} record ({n}).\npub struct {a.title()}{b.title()} {{ x: i32 }}\n\n"
                            f"impl {a.title()}{b.title()} {{\n"
                            + "".join(f"    /// Retry {b} {k}.\n    pub fn retry_{k}(&self) -> i32 {{\n"
                                      + "".join(f"        let v{j} = self.x + {j};\n" for j in range(5))
                                      + "        self.x\n    }\n\n" for k in range(6)) + "}\n"),
    ".java": lambda n, a, b: (f"package {a};\n\nimport java.util.List;\n\n/** {a} {b} ({n}). */\n"
                              f"public class {a.title()}{b.title()} {{\n  private int n;\n\n"
                              + "".join(f"  /** Handle {b} {k}. */\n  public int handle{k}(int x) {{\n"
                                        + "".join(f"    x += {j};\n" for j in range(5)) + "    return x;\n  }\n\n"
                                        for k in range(6)) + "}\n"),
}
READ_REPOSITORY = """import json, os, sys, time
sys.path.insert(0, sys.argv[1]); import corpus_rules as rules
paths = [os.path.join(d, f) for d, _, fs in os.walk(sys.argv[2]) for f in fs if rules.code_language(f)]
raws = [(p, open(p, "rb").read()) for p in paths]
out = {}
for how, name_of in (("code", lambda p: p), ("plain", lambda p: p + ".txt")):
    started = time.perf_counter()
    chunks = sum(len(rules.chunk_document(rules.parse_document(raw, name_of(p)), 512, 64, 1900)) for p, raw in raws)
    out[how + "_s"], out[how + "_chunks"] = time.perf_counter() - started, chunks
print(json.dumps(out))"""


def write_repository(dest: Path, files: int) -> None:
    """A generated repository: `files` source files in five languages under src/, and a docs folder."""
    dest.mkdir(parents=True, exist_ok=True)
    extensions = list(CODE_FILES)
    for n in range(files):
        a, b = CODE_WORDS[n % len(CODE_WORDS)], CODE_WORDS[(n // len(CODE_WORDS) + 3) % len(CODE_WORDS)]
        extension = extensions[n % len(extensions)]
        path = dest / "src" / f"pkg{n // 100:03d}" / f"{a}_{b}_{n}{extension}"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(CODE_FILES[extension](n, a, b), encoding="utf-8")
    for word in CODE_WORDS:
        doc = dest / "docs" / f"{word}.md"
        if not doc.exists():
            doc.parent.mkdir(parents=True, exist_ok=True)
            doc.write_text(f"# {word.title()}\n\nHow the {word} service retries failed requests.\n", encoding="utf-8")


def read_cost(python: str, work: Path, text: str, extension: str) -> dict[str, float]:
    """Reading and chunking `text` as a file of `extension`, in a fresh process: seconds and peak RSS."""
    path = work / f"hostile{extension}"
    path.write_text(text, encoding="utf-8")
    done = subprocess.run([python, "-c", READ_ONE, str(PROJECT_DIR), str(path), path.name], capture_output=True,
                          text=True, timeout=900, check=True)
    return json.loads(done.stdout)


def order_figures(figures: Sequence[Figure]) -> list[Figure]:
    order = ["handshake", "stdio", "cold", "search", "resources", "http", "cli", "ingest", "reingest", "reuse", "watch", "slow",
             "slots", "chroma_server", "memory", "readers", "code"]
    return sorted(figures, key=lambda f: (order.index(f.id.split(".")[0]) if f.id.split(".")[0] in order else 99,
                                          f.size or 0))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Benchmark local-rag-mcp against its physical limits.")
    parser.add_argument("--quick", action="store_true", help="1k chunks only, fewer repetitions (CI smoke)")
    parser.add_argument("--out", default="bench-results.json", help="JSON results file (default: %(default)s)")
    parser.add_argument("--sizes", default="1000,10000,100000",
                        help="chunk counts for the full run, comma-separated (default: %(default)s)")
    parser.add_argument("--workdir", help="keep corpora, stores and logs here (default: a temporary folder, removed)")
    parser.add_argument("--server", default=str(PROJECT_DIR / "server.py"), help="server to measure")
    parser.add_argument("--python", default=sys.executable, help="interpreter for ingest and the servers")
    parser.add_argument("--ingest", default=str(PROJECT_DIR / "ingest.py"),
                        help="ingest script to measure (to try a change side by side)")
    parser.add_argument("--ingest-timeout", type=float, default=1500.0, help="seconds before an ingest run is killed")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a goal fails")
    parser.add_argument("--chroma-url", help="also ingest and search with the vectors on this Chroma server "
                                             "(e.g. a local `chroma run --path DIR --port 8000`)")
    parser.add_argument("--settle", type=float, default=1.0,
                        help="--settle of the `ingest.py --watch` measured (default: %(default)s, ingest's own)")
    parser.add_argument("--code-only", action="store_true",
                        help="only the code repository figures (ingest --code of a generated repository of "
                             f"{CODE_REPOSITORY_FILES} source files, reading speed, search latency on it)")
    parser.add_argument("--scale", action="store_true",
                        help="growth instead of the figures: build, re-ingest and search each of --scale-sizes")
    parser.add_argument("--scale-sizes", default="1000,10000,100000,1000000",
                        help="chunk counts for --scale, comma-separated (default: %(default)s)")
    parser.add_argument("--scale-budget", type=float, default=3600.0, metavar="SECONDS",
                        help="--scale stops growing when the next size's projected time exceeds what is left of "
                             "this (default: %(default)s)")
    parser.add_argument("--reuse-stores", action="store_true",
                        help="--scale with --workdir: search a size's index left there by an earlier run (built "
                             "with the same --dims, its files read once so their pages are cached as after a "
                             "build) instead of building it again; its build columns stay empty")
    parser.add_argument("--dims", type=int, metavar="N",
                        help=f"build the indexes at N of the fake's {DIMS} dimensions (RAG_EMBED_DIMENSIONS=N for "
                             "every ingest): the store size and search cost of smaller vectors")
    parser.add_argument("--write-readme", nargs="?", const=str(readme_section.README), metavar="PATH",
                        help="also write the report into the bench (--scale: bench-scale) section of tools/README.md "
                             "(or PATH), between its <!-- NAME:begin --> and <!-- NAME:end --> markers")
    return parser.parse_args(argv)


def print_scale(scale: dict[str, Any], out: str, error: str | None, dims: int | None) -> int:
    rows = scale.get("rows") or []
    print(scale_table(rows))
    print()
    for what, met in scale_goals(rows, dims):
        print(f"- {'met' if met else 'MISSED'}: {what}")
    if scale.get("stopped"):
        print(f"Not measured: {scale['stopped']}.")
    print("One row per size measured; a row named like 10k/1k is the growth factor of each column (the value at "
          f"10k over the value at 1k). Build and no-op re-ingest: process wall. JSON: {out}")
    if error:
        print(f"\nThe run stopped early: {error}")
        return 2
    return 0


def print_report(args: argparse.Namespace, bench: Bench, figures: Sequence[Figure], machine: dict[str, Any],
                 duration: float, error: str | None) -> int:
    """The run's report on stdout (also what --write-readme writes); the exit status."""
    mode = "scale" if args.scale else "quick: 1k chunks" if args.quick else "full"
    commit = f", commit {machine['project_commit']}" if machine.get("project_commit") else ""
    print(f"local-rag-mcp benchmark ({mode}), {duration:.0f} s{commit}")
    print()
    print(machine_line(machine))
    print()
    if args.scale:
        return print_scale(bench.details.get("scale") or {}, args.out, error, args.dims)
    print(markdown_table(figures))
    noted = [f for f in figures if f.note and (f.passed is not None or f.id.startswith(("search.", "memory.")))]
    if noted:
        print()
        for f in noted:
            print(f"- {f.figure}: {f.note}")
    failed = [f.id for f in figures if f.passed is False]
    print()
    print(f"{sum(f.passed is True for f in figures)} goals met, {len(failed)} missed"
          + (f": {', '.join(failed)}" if failed else "") + f". JSON: {args.out}")
    if error:
        print(f"\nThe run stopped early: {error}")
        return 2
    return 1 if args.strict and failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--serve-fake"]:
        return serve_fake(int(argv[1]) if len(argv) > 1 else 0, float(argv[2]) if len(argv) > 2 else 0.0,
                          int(argv[3]) if len(argv) > 3 else 1)
    args = parse_args(argv)
    # Every ingest inherits it (its range is ingest's to check); the servers follow the index.
    if args.dims:
        os.environ["RAG_EMBED_DIMENSIONS"] = str(args.dims)
    else:
        os.environ.pop("RAG_EMBED_DIMENSIONS", None)
    if not Path(args.server).is_file():
        print(f"bench: {args.server} does not exist", file=sys.stderr)
        return 2
    if args.write_readme:  # before the run, not after minutes of it
        section = "bench-scale" if args.scale else "bench"
        try:
            readme_section.replace_section(Path(args.write_readme).read_text(encoding="utf-8"), section, "")
        except (readme_section.SectionError, OSError) as exc:
            print(f"bench: --write-readme: {exc}", file=sys.stderr)
            return 2
    started = time.perf_counter()
    machine = machine_info()
    log(machine_line(machine))
    keep = args.workdir is not None
    if keep:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    else:
        args.workdir = tempfile.mkdtemp(prefix="local-rag-bench-")
    bench = Bench(args)
    error = None
    try:
        if args.scale:
            bench.run_scale()
        elif args.code_only:
            bench.code_repository()
        else:
            bench.run()
    except (RuntimeError, RpcError, OSError) as exc:
        error = f"{type(exc).__name__}: {exc}"
        log(f"failed: {error}")
    finally:
        if not keep:
            shutil.rmtree(args.workdir, ignore_errors=True)
    figures = order_figures(bench.figures)
    duration = time.perf_counter() - started
    if hasattr(os, "getloadavg"):
        machine["loadavg_at_end"] = list(os.getloadavg())
    results = {
        "format": 1, "quick": args.quick, "scale": args.scale, "sizes_chunks": bench.sizes, "duration_s": round(duration, 1),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine, "error": error,
        "config": {"chunks_per_file": CHUNKS_PER_FILE, "superseded_share": 1 / SUPERSEDED_EVERY, "dims": args.dims or DIMS,
                   "model": MODEL, "protocol_version": PROTOCOL_VERSION, "n_results": bench.n_results,
                   "repetitions": bench.reps, "server": str(bench.server), "ingest": str(bench.ingest)},
        "figures": [f.as_json() for f in figures],
        "details": bench.details,
    }
    Path(args.out).write_text(json.dumps(results, indent=2, default=str) + "\n", encoding="utf-8")
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown):
        status = print_report(args, bench, figures, machine, duration, error)
    sys.stdout.write(shown.getvalue())
    if args.write_readme and error is None:
        section = "bench-scale" if args.scale else "bench"
        try:
            readme_section.write_section(Path(args.write_readme), section, shown.getvalue())
        except (readme_section.SectionError, OSError) as exc:
            print(f"bench: could not write the {section} section of {args.write_readme}: {exc}", file=sys.stderr)
            return 2
        print(f"\nWrote the {section} section of {args.write_readme}.")
    return status


if __name__ == "__main__":
    sys.exit(main())
