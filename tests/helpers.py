"""Helpers that several test modules share (no test module imports from another one).

Tool results: every result a test reads goes through `tool_payload`, which checks it the way the
strictest MCP clients read it (the TypeScript SDK validates `structuredContent` against the tool's
declared `outputSchema`, even when `isError` is true) and returns the payload. So the whole suite is
an output-schema conformance test: a success whose structured content does not fit the schema, or
an error that carries structured content, fails whichever test produced it.

The rest, by section: corpus copies and edits; reading a store the way a test checks it (snapshots,
the consistency a crash must leave); `python ingest.py` as a real process; indexes built for the
server tests (`Built`, `build`); `python server.py` spoken to in raw JSON-RPC (`RawServer`,
`raw_server`, `call`) or through the MCP SDK's client (`connect`, `tool`); a real `chroma run`.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import logging
import os
import queue
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager, redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TextIO

import chromadb
import jsonschema
from chromadb.api.client import SharedSystemClient
from fake_ollama import FakeOllama
from mcp import Client, StdioServerParameters
from mcp.client.stdio import stdio_client

import corpus_rules as rules
import ingest
import server
from corpus_rules import ErrorCode, StoreLayout

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "sample-corpus"
SERVER = ROOT / "server.py"
INGEST = ROOT / "ingest.py"
# Upper bound for any single wait in the suite: nothing may hang a CI run.
PROCESS_TIMEOUT_S = 240.0
# Settings a child ingest must not inherit from the test process's environment: every one.
ENV_VARS = rules.ENVIRONMENT

# Runs ingest.main in a real child process with small batches (many commit points), optionally
# SIGKILLing itself at a chosen point of the write path: INGEST_CRASH_AT=<where>:<nth call>.
CRASHING_CHILD = r"""
import os, signal, sys
sys.path.insert(0, sys.argv.pop(1))
import corpus_rules, ingest

ingest.EMBED_BATCH = 4
ingest.COMMIT_BATCH_CHUNKS = 4
where, _, nth = os.environ.get("INGEST_CRASH_AT", "").partition(":")

def crash_on(owner, name, after):
    original = getattr(owner, name)
    calls = [0]
    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == int(nth) and not after:
            os.kill(os.getpid(), signal.SIGKILL)
        result = original(*args, **kwargs)
        if calls[0] == int(nth) and after:
            os.kill(os.getpid(), signal.SIGKILL)
        return result
    setattr(owner, name, wrapper)

# Chroma runs in ingest's vector process, which dies with ingest: crashes are injected here.
points = {
    "chroma_update": (ingest.VectorProcess, "update_metadatas", True),  # mtime-only update: Chroma done, SQLite not
    "insert_rows": (ingest.Store, "_insert_rows", False),  # new vectors in, SQLite transaction open
    "chroma_delete": (ingest.VectorProcess, "delete", True),  # first vector delete sent (reconcile's strays)
    "delete_vectors": (ingest.Store, "_delete_vectors", False),  # committed, old vectors not yet out
    "write_current": (corpus_rules.StoreLayout, "write_current", False),  # all written, CURRENT not
}
if where:
    crash_on(*points[where])
sys.exit(ingest.main(sys.argv[1:]))
"""


# ---------------------------------------------------------------------------
# Tool results.

ERROR_KEYS = {"code", "message", "hint"}
ERROR_CODES = {str(code) for code in ErrorCode}


@functools.cache
def output_validators() -> dict[str, jsonschema.protocols.Validator]:
    """One validator per tool, from the outputSchema the server declares in tools/list."""
    validators = {}
    for tool in server.tool_definitions():
        schema = tool.output_schema
        jsonschema.Draft202012Validator.check_schema(schema)
        validators[tool.name] = jsonschema.Draft202012Validator(schema)
    return validators


def _as_wire_dict(result: Any) -> dict[str, Any]:
    """A tools/call result as it travels in JSON-RPC (camelCase keys), from either an SDK result
    object or a raw JSON-RPC `result` member."""
    if isinstance(result, Mapping):
        return dict(result)
    return result.model_dump(by_alias=True, mode="json", exclude_none=True)


def tool_payload(tool: str, result: Any) -> tuple[bool, dict[str, Any]]:
    """(is_error, payload) of one tools/call result, after checking that every client can read it.

    Success: structuredContent is present, valid against the tool's outputSchema, and the first text
    content carries the same JSON. Error: `isError: true`, no structuredContent (it would contradict
    the outputSchema), and the text content is `{"error": {code, message, hint}}` with a code from
    the vocabulary.
    """
    wire = _as_wire_dict(result)
    text = wire["content"][0]["text"]
    if wire.get("isError"):
        assert wire.get("structuredContent") is None, f"an error result carries structuredContent: {wire}"
        payload = json.loads(text)
        assert set(payload) == {"error"} and set(payload["error"]) == ERROR_KEYS, payload
        assert payload["error"]["code"] in ERROR_CODES, payload
        assert all(isinstance(payload["error"][key], str) for key in ERROR_KEYS), payload
        assert payload["error"]["code"] and payload["error"]["message"], payload
        return True, payload
    payload = wire.get("structuredContent")
    assert isinstance(payload, dict), f"a success result without structuredContent: {wire}"
    errors = sorted(output_validators()[tool].iter_errors(payload), key=lambda e: list(e.path))
    assert not errors, f"{tool} result does not fit its outputSchema: {errors[0].message} at {list(errors[0].path)}"
    assert json.loads(text) == payload, "the text content must carry the same JSON as the structured content"
    return False, payload


# ---------------------------------------------------------------------------
# Corpus copies and edits.


def in_process_service(built: Built, **env: str) -> Any:
    """The server's service layer in this process over a built index, with the settings a server
    given these variables would run with."""
    import server

    values = {"OLLAMA_HOST": built.host, "RAG_CORPUS_DIR": str(built.corpus), "RAG_STORE_DIR": str(built.store), **env}
    return server.RetrievalService(settings_loader=lambda: rules.load_settings(values))


def dispatched(svc: Any, tool: str, **args: Any) -> tuple[bool, dict[str, Any]]:
    """One tool call through the dispatcher and its MCP result, checked as every client reads it."""
    import server

    return tool_payload(tool, server.mcp_result(server.dispatch(svc, tool, args)))


def without_echoed_identifier(payload: dict[str, Any], token: str) -> dict[str, Any]:
    """A search payload without the caller's own identifier said back as missing from the index
    (missing_identifiers, and "no indexed passage contains it" in the reason and message): that
    is the proof it is not indexed. Anywhere else it would be a leak."""
    missing = payload.pop("missing_identifiers")
    assert missing in ([], [token]), missing
    if missing:
        for said in ("confidence_reason", "message"):
            payload[said] = (payload.get(said) or "").replace(f"contains {token}", "contains it")
    return payload


def copy_sample(tmp_path: Path, name: str = "corpus") -> Path:
    dest = tmp_path / name
    shutil.copytree(SAMPLE, dest)  # copy2 keeps mtimes
    return dest


def copy_index(corpus: Path, store: Path, dest: Path) -> tuple[Path, Path]:
    """dest/corpus and dest/store: copies of a corpus and of the store ingest built from it, the
    store pointed at the copied corpus as ingest would have written it there (CURRENT.json's
    corpus folder and identity, each document's resolved path; nothing else in a store names
    the corpus). For tests that need an index of the sample to start from and test something
    else: the real ingest of the sample runs once per test process (conftest `sample_index`)."""
    new_corpus, new_store = dest / "corpus", dest / "store"
    shutil.copytree(corpus, new_corpus, symlinks=True)  # copy2 keeps mtimes: every file looks unchanged
    shutil.copytree(store, new_store)
    layout = StoreLayout(new_store)
    current = layout.read_current()
    assert current is not None
    root = os.stat(os.path.realpath(new_corpus))
    layout.write_current(dataclasses.replace(current, corpus_dir=str(new_corpus), corpus_id=(root.st_dev, root.st_ino)))
    old_root, new_root = os.path.realpath(corpus), os.path.realpath(new_corpus)
    con = sqlite3.connect(new_store / current.index / rules.KEYWORD_DB)
    try:
        with con:
            con.execute("UPDATE documents SET real_path = ? || substr(real_path, ?)", (new_root, len(old_root) + 1))
    finally:
        con.close()
    return new_corpus, new_store


def edit(path: Path, content: str | bytes) -> None:
    """Write a file and move its mtime well past the skip tolerance (file systems round mtimes)."""
    base = path.stat().st_mtime_ns if path.exists() else time.time_ns()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    os.utime(path, ns=(base + 5_000_000_000, base + 5_000_000_000))


def corpus_hashes(corpus: Path) -> dict[str, str]:
    return {p.relative_to(corpus).as_posix(): rules.content_hash(p.read_bytes()) for p in corpus.rglob("*.md")}


# ---------------------------------------------------------------------------
# Reading a store: what a reader can see, and what a crash must leave.


def current_of(store: Path) -> dict[str, Any]:
    return json.loads((store / rules.CURRENT_FILE).read_text(encoding="utf-8"))


def keyword_db(store: Path, index: str | None = None) -> sqlite3.Connection:
    index = index or current_of(store)["index"]
    return sqlite3.connect(f"file:{store / index / rules.KEYWORD_DB}?mode=ro", uri=True)


class StoredVector(tuple):  # type: ignore[type-arg]  # floats, compared within 1e-6
    """An embedding as read back from Chroma, equal to another when every component is within one
    float32 step (1e-6): a cosine collection hands back a vector's normalised form once its HNSW
    segment is compacted, which can move a component by one float32 ulp. A vector reused by ingest
    (read back, written under a new id) is the same vector as a freshly embedded one in every way a
    search can tell; the ids, texts, metadata and every other field are still compared exactly."""

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, tuple) or len(other) != len(self):
            return False
        return all(abs(a - b) <= 1e-6 for a, b in zip(self, other, strict=True))

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = tuple.__hash__


def chroma_state(store: Path, index: str | None = None) -> dict[str, dict[str, tuple[str, dict[str, Any], StoredVector]]]:
    """collection name -> id -> (document, metadata, embedding)."""
    index = index or current_of(store)["index"]
    client = chromadb.PersistentClient(path=str(store / index / rules.CHROMA_SUBDIR))
    try:
        state = {}
        for name in rules.COLLECTION_BY_LIFECYCLE.values():
            got = client.get_collection(name).get(include=["documents", "metadatas", "embeddings"])
            state[name] = {i: (d, dict(m), StoredVector(float(x) for x in e))
                           for i, d, m, e in zip(got["ids"], got["documents"], got["metadatas"], got["embeddings"], strict=True)}
        return state
    finally:
        SharedSystemClient.clear_system_cache()


def snapshot(store: Path) -> dict[str, Any]:
    """Everything a reader can see, minus the run's wall-clock time and the generation counter."""
    current = current_of(store)
    index = current["index"]
    client = chromadb.PersistentClient(path=str(store / index / rules.CHROMA_SUBDIR))
    try:
        collection_meta = {}
        for name in rules.COLLECTION_BY_LIFECYCLE.values():
            meta = dict(client.get_collection(name).metadata or {})
            meta.pop("stamp_ingested_at", None)
            collection_meta[name] = meta
    finally:
        SharedSystemClient.clear_system_cache()
    con = keyword_db(store)
    try:
        stamp = json.loads(con.execute("SELECT value FROM meta WHERE key = 'stamp'").fetchone()[0])
        stamp.pop("ingested_at")
        keywords = {
            # By name: a column an older store lacked is added last by its migration.
            "documents": sorted(con.execute(f"SELECT {rules.document_columns()}, cjk_share FROM documents")),
            "chunks": sorted(con.execute("SELECT id, path, chunk_index, start_line, end_line, heading, lifecycle, text, "
                                         "embed_key, searchable FROM chunks")),
            "fts": sorted(con.execute("SELECT c.id, f.title, f.heading, f.body FROM chunks c "
                                      "JOIN chunks_fts f ON f.rowid = c.rowid")),
            "fts_rows": con.execute("SELECT count(*) FROM chunks_fts").fetchone()[0],
            "manifest": con.execute("SELECT value FROM meta WHERE key = 'manifest'").fetchone(),
            "meta_keys": sorted(key for (key,) in con.execute("SELECT key FROM meta")),
            "stamp": stamp,
        }
    finally:
        con.close()
    current.pop("generation")
    current["stamp"].pop("ingested_at")
    return {"current": current, "chroma": chroma_state(store), "collection_meta": collection_meta,
            "keywords": keywords}


def file_listing(root: Path) -> dict[str, tuple[int, bytes]]:
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, p.read_bytes())
            for p in sorted(root.rglob("*")) if p.is_file()}


def store_bytes(store: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(store.rglob("*")) if p.is_file())


def assert_consistent(store: Path, corpus_hashes: dict[str, set[str]], must_have: set[str]) -> None:
    """What a crash must leave: every file served by one complete set of chunks, old or new,
    every committed chunk findable in the collection of its lifecycle."""
    state = chroma_state(store)
    con = keyword_db(store)
    try:
        assert con.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        documents = list(con.execute("SELECT path, content_hash, chunk_count, lifecycle FROM documents"))
        for path, digest, count, lifecycle in documents:
            assert digest in corpus_hashes.get(path, set()), path
            rows = list(con.execute("SELECT id, chunk_index, text, lifecycle FROM chunks WHERE path = ? "
                                    "ORDER BY chunk_index", (path,)))
            assert [r[0] for r in rows] == [rules.chunk_id(path, digest, i) for i in range(count)], path
            collection = state[rules.COLLECTION_BY_LIFECYCLE[lifecycle]]
            for chunk, _, text, chunk_lifecycle in rows:
                assert chunk_lifecycle == lifecycle
                assert collection[chunk][0] == text
                assert collection[chunk][1]["content_hash"] == digest
        orphans = con.execute("SELECT count(*) FROM chunks WHERE path NOT IN (SELECT path FROM documents)").fetchone()
        assert orphans == (0,)
        fts = con.execute("SELECT count(*) FROM chunks_fts").fetchone()[0]
        assert fts == con.execute("SELECT count(*) FROM chunks").fetchone()[0]
        # Files indexed before the change and still in the corpus never vanish from the store.
        assert must_have <= {d[0] for d in documents}
    finally:
        con.close()


# ---------------------------------------------------------------------------
# Ingest as a real process (`python ingest.py --json`), in a clean environment.


@dataclass
class Run:
    """Exit code, stdout, stderr and the --json summary of one ingest."""

    code: int
    out: str
    err: str

    @property
    def summary(self) -> dict[str, Any]:
        return json.loads(self.out.strip().splitlines()[-1])


Done = Run  # the fault suite's name for it (test_faults_kill has a Run of its own)


class HasHost(Protocol):
    """Where an Ollama listens: the in-process FakeOllama, or faultlib.OllamaProcess."""

    @property
    def host(self) -> str: ...


@dataclass(frozen=True)
class OllamaAt:
    """An Ollama known only by where it listens."""

    host: str


def child_env(fake: HasHost, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    env.update(OLLAMA_HOST=fake.host, ANONYMIZED_TELEMETRY="False", PYTHONUNBUFFERED="1", **extra)
    return env


def ingest_args(corpus: Path, store: Path, *extra: str) -> list[str]:
    return [sys.executable, str(INGEST), "--corpus", str(corpus), "--store", str(store), "--json", *extra]


def start_ingest(fake: HasHost, corpus: Path, store: Path, *extra: str, **env: str) -> subprocess.Popen[str]:
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
    """`python ingest.py --json` as a real process (and its vector process)."""
    return finish(start_ingest(fake, corpus, store, *extra, **env))


# ---------------------------------------------------------------------------
# Ingest in this process: ingest.run_once with its vector store here too (InProcessVectors), for
# tests of what a run indexes, skips, reuses or plans. Same summary, exit status and log lines as
# the real process, without two interpreters importing Chroma per run.


@contextmanager
def environment(fake: HasHost | None, **env: str) -> Iterator[None]:
    """os.environ as child_env(fake, **env) would make it, for the block's length (fake None:
    the environment as it is)."""
    saved = dict(os.environ)
    if fake is not None:
        os.environ.clear()
        os.environ.update(child_env(fake, **env))
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextmanager
def ingest_log_captured(err: io.StringIO) -> Iterator[None]:
    """The ingest log into `err`, formatted as `python ingest.py` prints it on stderr."""
    logger = logging.getLogger("ingest")
    handler = logging.StreamHandler(err)
    handler.setFormatter(logging.Formatter("%(name)s: %(levelname)s: %(message)s"))
    saved = (logger.level, logger.propagate)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]


# Several fake Ollamas as one OLLAMA_HOST, and what they embedded besides calibration.
CALIBRATION = "task: search result"  # the prefix of the similarity calibration's query texts


@dataclass(frozen=True)
class Hosts:
    """Several fakes as one OLLAMA_HOST value."""

    fakes: tuple[FakeOllama, ...]

    @property
    def host(self) -> str:
        return ",".join(fake.host for fake in self.fakes)


def chunk_inputs(fake: FakeOllama, key: str = "answered_inputs") -> list[str]:
    """The texts a fake embedded (or `key`'s other list) that are chunks, not calibration queries
    or the model fingerprint's probe."""
    return [text for text in fake.calls()[key]
            if not text.startswith(CALIBRATION) and text != rules.FINGERPRINT_TEXT]


def chunk_calls(fake: FakeOllama) -> int:
    """The embed calls a fake answered or refused that carried more than the model fingerprint's
    probe (which ingest sends once per host and run, alone)."""
    return sum(1 for inputs in fake.calls()["call_inputs"] if inputs != [rules.FINGERPRINT_TEXT])


def ingest_in_process(fake: HasHost | None, corpus: Path, store: Path, *extra: str, as_json: bool = True,
                      **env: str) -> Done:
    """What run_ingest returns, from a run in this process (fake None: in the environment as it is;
    as_json False: without --json, stdout as a person reads it)."""
    out, err = io.StringIO(), io.StringIO()
    vectors = ingest.InProcessVectors()
    args = ingest.parse_args(["--corpus", str(corpus), "--store", str(store), *(["--json"] if as_json else []), *extra])
    try:
        with environment(fake, **env), ingest_log_captured(err), redirect_stdout(out), redirect_stderr(err):
            code, _ = ingest.run_once(args, vectors=vectors)
    finally:
        vectors.shut()
        # A cached Chroma client would not see later writes by other processes.
        SharedSystemClient.clear_system_cache()
    return Done(code, out.getvalue(), err.getvalue())


# ---------------------------------------------------------------------------
# Indexes for the server tests: a copy of a corpus, indexed by the real `python ingest.py`.


@dataclass(frozen=True)
class Built:
    """A corpus, the store ingest built from it, and the Ollama it embedded with."""

    corpus: Path
    store: Path
    host: str

    @property
    def index_dir(self) -> Path:
        current = StoreLayout(self.store).read_current()
        assert current is not None
        return self.store / current.index

    def server_env(self, host: str, **extra: str) -> dict[str, str]:
        """The environment of a server over this corpus and store, embedding with `host`."""
        return server_env(self.store, self.corpus, host, **extra)


def ingest_index(corpus: Path, store: Path, host: str, *extra: str) -> subprocess.CompletedProcess[str]:
    """`python ingest.py` (no --json) in the test process's environment, minus RAG_EMBED_MODEL."""
    env = {**os.environ, "OLLAMA_HOST": host}
    env.pop("RAG_EMBED_MODEL", None)
    return subprocess.run([sys.executable, str(INGEST), "--corpus", str(corpus), "--store", str(store),
                           *extra], env=env, capture_output=True, text=True, timeout=120)


def sample_built(indexed_sample: tuple[Path, Path], dest: Path, host: str) -> Built:
    """A copy of the indexed sample (conftest `indexed_sample`) in dest, served with `host`."""
    return Built(*copy_index(*indexed_sample, dest), host)


def build(tmp: Path, host: str, source: Path = SAMPLE, *, symlinks: bool = True) -> Built:
    """Copy `source` to tmp/corpus and index it into tmp/store. The copy keeps symlinks as links
    (symlinks=False copies what they point at instead)."""
    corpus = tmp / "corpus"
    shutil.copytree(source, corpus, symlinks=symlinks)
    store = tmp / "store"
    done = ingest_in_process(OllamaAt(host), corpus, store)
    assert done.code == 0, done.err
    return Built(corpus, store, host)


# ---------------------------------------------------------------------------
# The server as a real process, spoken to in raw JSON-RPC.


class RawServer:
    """`python server.py` spoken to line by line; every stdout and stderr line is kept."""

    def __init__(self, env: dict[str, str], python_flags: tuple[str, ...] = (), args: tuple[str, ...] = ()) -> None:
        full_env = {**os.environ, **env}
        full_env.pop("RAG_EMBED_MODEL", None)
        self.proc = subprocess.Popen([sys.executable, *python_flags, str(SERVER), *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=full_env, cwd=str(ROOT.parent))
        self.stdout_lines: list[bytes] = []
        self.stderr_lines: list[str] = []
        self._messages: queue.Queue[dict[str, Any]] = queue.Queue()
        self._next_id = 0
        self._threads = [threading.Thread(target=self._read_stdout, daemon=True),
                         threading.Thread(target=self._read_stderr, daemon=True)]
        for thread in self._threads:
            thread.start()

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.stdout_lines.append(line)
            try:
                self._messages.put(json.loads(line))
            except ValueError:
                pass  # recorded; the test fails on it when it checks stdout_lines

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr_lines.append(line.decode("utf-8", "replace"))

    def send(self, raw: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(raw)
        self.proc.stdin.flush()

    def notify(self, method: str, params: dict[str, Any] | None = None) -> None:
        self.send(json.dumps({"jsonrpc": "2.0", "method": method, **({"params": params} if params else {})}).encode()
                  + b"\n")

    def request(self, method: str, params: dict[str, Any] | None = None, timeout: float = 60) -> dict[str, Any]:
        self._next_id += 1
        wanted = self._next_id
        self.send(json.dumps({"jsonrpc": "2.0", "id": wanted, "method": method, "params": params or {}}).encode()
                  + b"\n")
        deadline = time.monotonic() + timeout
        while True:
            message = self._messages.get(timeout=max(0.1, deadline - time.monotonic()))
            if message.get("id") == wanted:
                return message

    def handshake(self) -> list[str]:
        init = self.request("initialize", {"protocolVersion": "2025-06-18", "capabilities": {},
                                           "clientInfo": {"name": "e2e", "version": "0"}})
        assert init["result"]["serverInfo"]["name"] == "local-rag"
        self.notify("notifications/initialized")
        tools = self.request("tools/list")
        return [t["name"] for t in tools["result"]["tools"]]

    def call(self, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
        return self.request("tools/call", {"name": name, "arguments": arguments})["result"]

    def wait_for_stderr(self, text: str, timeout: float = 60) -> None:
        wait_for_logged(self.stderr_lines, text, timeout)

    def close(self) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            code = self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        for thread in self._threads:
            thread.join(timeout=10)
        return code


def wait_for_logged(lines: list[str], text: str, timeout: float = 60) -> None:
    """Until one of `lines` (a process's stderr, appended by a reader thread) contains `text`."""
    deadline = time.monotonic() + timeout
    while not any(text in line for line in lines):
        assert time.monotonic() < deadline, f"{text!r} never logged"
        time.sleep(0.05)


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
# The server as a real process, through the MCP SDK's own client.


@asynccontextmanager
async def connect(env: dict[str, str], errlog: TextIO | None = None, mode: str = "auto") -> AsyncIterator[Client]:
    params = StdioServerParameters(command=sys.executable, args=[str(SERVER)], env=env, cwd=str(ROOT.parent))
    target: Any = stdio_client(params, errlog=errlog) if errlog is not None else params
    async with Client(target, mode=mode, read_timeout_seconds=60) as client:  # type: ignore[arg-type]  # SDK's union
        yield client


async def tool(client: Client, name: str, **args: Any) -> tuple[bool, dict[str, Any]]:
    return tool_payload(name, await client.call_tool(name, args))


async def vectors_loaded(client: Client) -> None:
    """Once the server's vector index is loaded, for a test about what a warm server answers: a
    vector search waits for the load, where a hybrid search answers from its keyword channel
    meanwhile (degraded vector_index_loading: tests/test_cold_start.py)."""
    is_error, payload = await tool(client, "search_corpus", query="the vector index is loaded", mode="vector")
    assert not is_error, payload


# ---------------------------------------------------------------------------
# A real Chroma server.


class ChromaServer:
    """A real `chroma run` (the CLI that ships with chromadb) on a free loopback port, for the
    Chroma-server backend: started, stopped, killed, frozen and restarted by the tests."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = path.parent / f"chroma-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ChromaServer:
        chroma = Path(sys.executable).with_name("chroma")
        env = {**os.environ, "ANONYMIZED_TELEMETRY": "False", "RUST_LOG": "warn"}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([str(chroma), "run", "--path", str(self.path), "--host", "127.0.0.1",
                                          "--port", str(self.port)], stdout=log, stderr=subprocess.STDOUT, env=env,
                                         stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text(errors="replace")[-2000:]
            try:
                with urllib.request.urlopen(f"{self.url}/api/v2/heartbeat", timeout=0.5):
                    return self
            except OSError:
                time.sleep(0.05)
        raise AssertionError(f"chroma run did not answer within 60 s:\n{self.log.read_text(errors='replace')[-2000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
        self.proc = None

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(timeout=15)
        self.proc = None

    def freeze(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def __enter__(self) -> ChromaServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.thaw()
        self.stop()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
