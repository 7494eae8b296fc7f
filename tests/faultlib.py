"""Shared pieces of the fault and abuse suite (tests/test_faults_*.py).

Every scenario runs real processes (`python ingest.py`, `python server.py`) against a real store;
the loopback fake Ollama runs in the test process. Helpers that already exist in test_ingest.py
(store snapshots, consistency checks, corpus edits) and test_server_e2e.py (a raw JSON-RPC
client over a server's pipes) are reused from there, not copied.
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
from typing import Any

import corpus_rules as rules
from fake_ollama import FakeOllama
from helpers import tool_payload
from test_ingest import (  # noqa: F401 - re-exported for the fault modules
    ROOT,
    Run as Done,  # exit code, stdout, stderr and the --json summary of one ingest
    assert_consistent,
    child_env,
    chroma_state,
    copy_sample,
    corpus_hashes,
    current_of,
    edit,
    file_listing,
    keyword_db,
    snapshot,
    store_bytes,
)
from test_server_e2e import RawServer

INGEST = ROOT / "ingest.py"
# Upper bound for any single wait in the suite: nothing may hang a CI run.
PROCESS_TIMEOUT_S = 240.0


# ---------------------------------------------------------------------------
# Ingest as a real process.


def ingest_args(corpus: Path, store: Path, *extra: str) -> list[str]:
    return [sys.executable, str(INGEST), "--corpus", str(corpus), "--store", str(store), "--json", *extra]


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

    def embed_calls(self) -> int:
        return int(self._call("/_fake/calls")["embed_calls"])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


def start_ingest(fake: FakeOllama | OllamaProcess, corpus: Path, store: Path, *extra: str,
                 **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(ingest_args(corpus, store, *extra), env=child_env(fake, **env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT.parent)


def finish(proc: subprocess.Popen[str], timeout: float = PROCESS_TIMEOUT_S) -> Done:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate(timeout=30)
        raise AssertionError(f"ingest did not finish within {timeout} s:\n{err[-3000:]}") from None
    return Done(proc.returncode, out, err)


def run_ingest(fake: FakeOllama, corpus: Path, store: Path, *extra: str, **env: str) -> Done:
    return finish(start_ingest(fake, corpus, store, *extra, **env))


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


def index_dir(store: Path) -> Path:
    return store / current_of(store)["index"]


def ro_query(db: Path, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
    try:
        return con.execute(sql, params).fetchall()
    finally:
        con.close()


def vector_count(index: Path) -> int:
    """Rows in Chroma's embeddings table (both collections): grows when ingest writes vectors."""
    return int(ro_query(index / rules.CHROMA_SUBDIR / "chroma.sqlite3", "SELECT count(*) FROM embeddings")[0][0])


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
# The server as a real process, spoken to in raw JSON-RPC.


def server_env(store: Path, corpus: Path | None, host: str, **extra: str) -> dict[str, str]:
    env = {"OLLAMA_HOST": host, "RAG_STORE_DIR": str(store), "PYTHONUNBUFFERED": "1", **extra}
    if corpus is not None:
        env["RAG_CORPUS_DIR"] = str(corpus)
    return env


@contextmanager
def raw_server(store: Path, corpus: Path | None, host: str, **extra: str) -> Iterator[RawServer]:
    """A handshaken `python server.py`; on exit stdin is closed and it must exit 0 with every
    stdout line a JSON-RPC message."""
    server = RawServer(server_env(store, corpus, host, **extra))
    try:
        server.handshake()
        yield server
    finally:
        if server.proc.poll() is None:
            code = server.close()
        else:
            code = server.proc.returncode
    assert code == 0, f"exit {code}: " + "".join(server.stderr_lines)[-3000:]
    assert_pure_jsonrpc(server)


def assert_pure_jsonrpc(server: RawServer) -> None:
    for line in server.stdout_lines:
        message = json.loads(line)
        assert isinstance(message, dict) and message.get("jsonrpc") == "2.0", line[:300]


def call(server: RawServer, name: str, arguments: Any, timeout: float = 60.0) -> tuple[bool, dict[str, Any]]:
    """One tools/call; asserts the answer is a tool result with a structured payload, and for
    errors the {"error": {code, message, hint}} shape."""
    response = server.request("tools/call", {"name": name, "arguments": arguments}, timeout=timeout)
    assert "result" in response, response
    return tool_payload(name, response["result"])


def search_paths(server: RawServer, query: str, **args: Any) -> list[str]:
    is_error, payload = call(server, "search_corpus", {"query": query, **args})
    assert not is_error, payload
    return [hit["path"] for hit in payload["results"]]


def stderr_text(server: RawServer) -> str:
    return "".join(server.stderr_lines)


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
    first revision and moved past the skip tolerance on every rewrite (test_ingest.edit)."""
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

    budget = ingest.Budget(2048, rules.DEFAULT_CHUNK_MAX_TOKENS, rules.DEFAULT_CHUNK_MIN_TOKENS,
                           rules.PREFIX_SCHEMES["embeddinggemma"])
    counts = {}
    for path in sorted(corpus.rglob("*.md")):
        rel = path.relative_to(corpus).as_posix()
        doc = rules.parse_document(path.read_bytes(), rel)
        if doc.rag:
            counts[rel] = len(rules.chunk_document(doc, budget(doc.title), budget.min_tokens))
    return counts


def commit_groups(counts: dict[str, int]) -> list[list[str]]:
    """The files of a run that re-embeds all of `counts`, in commit groups as ingest._groups
    closes them (path order, a group ends once it holds COMMIT_BATCH_CHUNKS chunks)."""
    import ingest

    groups: list[list[str]] = [[]]
    size = 0
    for path, count in sorted(counts.items()):
        groups[-1].append(path)
        size += count
        if size >= ingest.COMMIT_BATCH_CHUNKS:
            groups.append([])
            size = 0
    return [group for group in groups if group]


def embed_calls_by_file(counts: dict[str, int]) -> dict[str, list[int]]:
    """Which embedding calls (1-based, in one run that re-embeds all of `counts`) carry each
    file's chunks: EMBED_BATCH chunks per call within a commit group."""
    import ingest

    calls: dict[str, list[int]] = {}
    done = 0
    for group in commit_groups(counts):
        position = 0
        for path in group:
            first, last = position // ingest.EMBED_BATCH, (position + counts[path] - 1) // ingest.EMBED_BATCH
            calls[path] = [done + c + 1 for c in range(first, last + 1)]
            position += counts[path]
        done += -(-position // ingest.EMBED_BATCH)
    return calls
