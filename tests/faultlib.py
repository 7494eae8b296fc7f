"""Shared pieces of the fault and abuse suite (tests/test_faults_*.py).

Every scenario runs real processes (`python ingest.py`, `python server.py`) against a real store;
the loopback fake Ollama runs in the test process. What other test modules use too (store
snapshots, consistency checks, corpus edits, ingest as a process, a raw JSON-RPC client over a
server's pipes) lives in helpers.py; this module holds what only the fault suite needs.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from fake_ollama import FakeOllama, calls_carrying
from helpers import ROOT, current_of, edit, run_ingest, snapshot

import corpus_rules as rules

# ---------------------------------------------------------------------------
# A fake Ollama that can die for real, a clean reference ingest, bounded waits.


class OllamaProcess:
    """The fake Ollama as a process of its own (`python tests/fake_ollama.py`), so that it can die
    for real: SIGKILL drops its connections mid-answer, and later ones are refused. Configured and
    watched over its control endpoints."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "fake_ollama.py"), "--port", "0"],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert self.proc.stdout is not None
        ready = self.proc.stdout.readline()  # EOF (bounded) if it cannot start
        assert ready.startswith("FAKE_OLLAMA_READY "), ready
        self.host = ready.split()[1]

    def _call(self, path: str, body: dict[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.host + path, data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())

    def configure(self, **fields: Any) -> None:
        self._call("/_fake/config", fields)

    def calls_carrying(self, text: str) -> int:
        return calls_carrying(self._call("/_fake/calls")["call_inputs"], text)

    def answered_carrying(self, text: str) -> int:
        """How many inputs containing `text` were answered with vectors so far."""
        return sum(text in item for item in self._call("/_fake/calls")["answered_inputs"])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


def clean_reference(fake: FakeOllama, corpus: Path, tmp: Path, **env: str) -> dict[str, Any]:
    """The snapshot a clean ingest of `corpus` into a fresh store produces."""
    fresh = tmp / f"reference-{time.monotonic_ns()}"
    done = run_ingest(fake, corpus, fresh, **env)
    assert done.code == 0, done.err
    return snapshot(fresh)


def poll(condition: Callable[[], Any], timeout: float = 60.0, interval: float = 0.002) -> Any:
    """Wait for a truthy value of condition(); bounded."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, "timed out waiting for a condition"
        time.sleep(interval)


# ---------------------------------------------------------------------------
# Reading the store the way the server does (read-only SQLite), for observing a running ingest.


def vector_processes(parent: int) -> list[int]:
    """The vector process(es) an ingest or a watcher started: its children running
    ingest._serve_vectors (Linux /proc; none elsewhere)."""
    found = []
    for entry in Path("/proc").iterdir() if Path("/proc/self/stat").exists() else ():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent and "_serve_vectors" in cmdline:
            found.append(int(entry.name))
    return found


def gone(pid: int) -> bool:
    """Exited (a zombie left for its parent to reap counts: its cmdline is empty)."""
    try:
        return not Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True


def index_dir(store: Path) -> Path:
    return store / current_of(store)["index"]


def ro_query(db: Path, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
    try:
        return con.execute(sql, params).fetchall()
    finally:
        con.close()


def vector_count(index: Path) -> int:
    """Rows in Chroma's embeddings table (both collections): grows when ingest writes vectors.

    Read with a connection that may write: a writer killed mid-transaction leaves a hot journal,
    which a read-only connection cannot roll back ("attempt to write a readonly database"); any
    opener (Chroma, the server) rolls it back, and so does this one."""
    con = sqlite3.connect(f"file:{index / rules.CHROMA_SUBDIR / 'chroma.sqlite3'}?mode=rw", uri=True, timeout=30)
    try:
        return int(con.execute("SELECT count(*) FROM embeddings").fetchone()[0])
    finally:
        con.close()


def committed_hashes(index: Path) -> dict[str, str]:
    return dict(ro_query(index / rules.KEYWORD_DB, "SELECT path, content_hash FROM documents"))


@contextmanager
def write_lock(db: Path, kind: str = "IMMEDIATE") -> Iterator[sqlite3.Connection]:
    """Hold SQLite's write lock on a database: other processes' writers wait for it (EXCLUSIVE:
    readers too, in a rollback-journal database such as Chroma's)."""
    con = sqlite3.connect(db, timeout=30, isolation_level=None)
    try:
        con.execute(f"BEGIN {kind}")
        yield con
        con.execute("ROLLBACK")
    finally:
        con.close()


# ---------------------------------------------------------------------------
# Generated corpora whose every chunk says which file and which revision it comes from.

FILLER = ("harbor lantern copper meadow signal orchard pebble rocket velvet timber beacon canyon "
          "fossil glacier harvest island jungle kettle marble nectar").split()
FIXED_MTIME_NS = 1_700_000_000 * 10**9


def handbook(token: str, sections: int, revision: str) -> str:
    """`rag_chunk: headings` Markdown with one chunk per section (each ~100 estimated tokens, above
    the merge minimum and under the budget); every paragraph names the file's token and the
    revision, so a search hit tells which generation it came from."""
    parts = [f"---\nrag_chunk: headings\ntitle: Handbook {token}\n---\n"]
    for i in range(sections):
        filler = " ".join(FILLER[(i + j) % len(FILLER)] for j in range(36))
        parts.append(f"## {token} part {i}\n\n{token} revision-{revision} part {i}: {filler}.\n")
    return "\n".join(parts)


def write_handbooks(root: Path, sizes: dict[str, int], revision: str) -> dict[str, str]:
    """Write (or rewrite) one handbook per name; returns name -> token. Mtimes are fixed for the
    first revision and moved past the skip tolerance on every rewrite (helpers.edit)."""
    tokens = {}
    for name, sections in sizes.items():
        token = "tok" + "".join(ch for ch in name if ch.isalnum())
        path = root / name
        if path.exists():
            edit(path, handbook(token, sections, revision))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(handbook(token, sections, revision), encoding="utf-8")
            os.utime(path, ns=(FIXED_MTIME_NS, FIXED_MTIME_NS))
        tokens[name] = token
    return tokens


def chunk_counts(corpus: Path) -> dict[str, int]:
    """What ingest will make of each file of `corpus` with the default settings (2048 context)."""
    import ingest

    budget = ingest.ChunkBudget(2048, rules.DEFAULT_CHUNK_MAX_TOKENS, rules.DEFAULT_CHUNK_MIN_TOKENS,
                           rules.PREFIX_SCHEMES["embeddinggemma"])
    counts = {}
    for path in sorted(corpus.rglob("*.md")):
        rel = path.relative_to(corpus).as_posix()
        doc = rules.parse_document(path.read_bytes(), rel)
        if doc.rag:
            counts[rel] = len(rules.chunk_document(doc, budget(doc.title), budget.min_tokens))
    return counts


def commit_groups(counts: dict[str, int]) -> list[list[str]]:
    """The first commit groups of a run that re-embeds all of `counts`: those ingest makes of them
    (ingest._groups with ingest._group_chunks's bounds) at any pace. A group's size follows the
    embedder's measured pace (one call's worth while none is measured yet), so only the groups
    that come out the same at the slowest and the fastest pace, and with none measured, are certain
    (a group that does not change between the two bounds is the same at any pace between them);
    the rest, which a loaded machine would change, are left off."""
    import ingest

    class Pace:  # what _group_chunks asks of the run's Embedding
        def __init__(self, per_chunk_s: float | None, pending: bool = False) -> None:
            self.per_chunk_s, self.pending = per_chunk_s, pending

        def seconds_for(self, chunks: int) -> float | None:
            return None if self.per_chunk_s is None else chunks * self.per_chunk_s

        def pace_pending(self) -> bool:  # the next group is queued before the first one's answers
            return self.pending

    total = sum(counts.values())
    files = [SimpleNamespace(path=path, chunks=range(count)) for path, count in sorted(counts.items())]

    def grouped(pace: Pace) -> list[list[str]]:
        first = iter([True])
        groups = ingest._groups(files, lambda: ingest._group_chunks(pace, total, first=next(first, False)))
        return [[pf.path for pf in group] for group in groups]

    certain = []
    for slowest, fastest, unknown in zip(grouped(Pace(float("inf"))), grouped(Pace(None)),
                                         grouped(Pace(None, pending=True)), strict=False):
        if not slowest == fastest == unknown:
            break
        certain.append(fastest)
    return certain
