"""`server.py --watch` (issue 46 §2): the server a client starts keeps its own index fresh, with
ingest still the only writer. Real processes throughout: the server over stdio, its `ingest.py
--watch` child, the fake Ollama over loopback. An edit, an addition and a deletion show up in
search within the settle time plus a run; the responses say what the watcher does; a watcher
killed with -9 is started again; no watcher outlives its server (stdin closed, SIGTERM, kill -9);
a watcher already running on the store is left alone."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from fake_ollama import FakeOllama
from faultlib import gone, poll
from helpers import ROOT, RawServer, call, child_env, copy_sample, free_port, run_ingest, server_env, stderr_text

import corpus_rules as rules

pytestmark = pytest.mark.process  # real processes: only in `pytest --all` (tests/README.md)

SETTLE_S = 0.2
VISIBLE_WITHIN_S = 30.0  # generous for a loaded CI machine: the bench measures the real latency


@contextmanager
def watching_server(fake: FakeOllama, corpus: Path, store: Path, *flags: str, **env: str) -> Iterator[RawServer]:
    """A handshaken `python server.py --watch --settle SETTLE_S` (or with RAG_WATCH=1 in env when
    no flag is given); closed by stdin at the end unless the test ended it."""
    server = RawServer(server_env(store, corpus, fake.host, **env), args=(*flags,) if flags or env else
                       ("--watch", "--settle", str(SETTLE_S)))
    try:
        server.handshake()
        yield server
    finally:
        if server.proc.poll() is None:
            server.close()


def watch_of(server: RawServer) -> dict[str, Any] | None:
    is_error, payload = call(server, "list_documents", {"limit": 1})
    assert not is_error, payload
    return payload["index"]["watch"]


def child_pid(server: RawServer, other_than: int | None = None) -> int:
    """The pid of the server's watcher once its first run is done and it waits for changes."""
    def running() -> int | None:
        watch = watch_of(server)
        ok = watch is not None and watch["by"] == "this server" and watch["state"] == "waiting"
        return watch["pid"] if ok and watch["pid"] != other_than else None

    return poll(running, timeout=120, interval=0.1)


def paths_found(server: RawServer, query: str) -> set[str]:
    is_error, payload = call(server, "search_corpus", {"query": query, "mode": "keyword", "k": 20})
    assert not is_error, payload
    return {hit["path"] for hit in payload["results"]}


def visible(server: RawServer, query: str, path: str | None) -> None:
    """Until a search finds `query` in `path` (None: nowhere)."""
    deadline = time.monotonic() + VISIBLE_WITHIN_S
    while True:
        found = paths_found(server, query)
        if (path in found) if path else not found:
            return
        assert time.monotonic() < deadline, (query, path, found, stderr_text(server)[-3000:])
        time.sleep(0.1)


@pytest.fixture
def indexed(tmp_path: Path) -> Iterator[tuple[FakeOllama, Path, Path]]:
    with FakeOllama() as fake:
        corpus, store = copy_sample(tmp_path), tmp_path / "store"
        done = run_ingest(fake, corpus, store)
        assert done.code == 0, done.err
        yield fake, corpus, store


def test_edits_additions_and_deletions_show_up_and_the_responses_say_what_the_watcher_does(indexed: tuple) -> None:
    fake, corpus, store = indexed
    with watching_server(fake, corpus, store) as server:
        pid = child_pid(server)
        glossary = corpus / "reference" / "glossary.md"
        glossary.write_text(glossary.read_text(encoding="utf-8") + "\nZEBRAEDITED: a new term.\n", encoding="utf-8")
        visible(server, "ZEBRAEDITED", "reference/glossary.md")
        (corpus / "kumquat.md").write_text("# Kumquat\n\nKUMQUATADDED orchard notes.\n", encoding="utf-8")
        visible(server, "KUMQUATADDED", "kumquat.md")
        (corpus / "kumquat.md").unlink()
        visible(server, "KUMQUATADDED", None)
        # The last run is told: when, and how it went.
        watch = poll(lambda: (w := watch_of(server)) and w["state"] == "waiting" and w, timeout=30, interval=0.1)
        assert watch["by"] == "this server" and watch["pid"] == pid, watch
        assert watch["last_run_outcome"] == "ok" and watch["last_run_at"], watch
        assert watch["files_waiting"] == 0 and watch["last_run_error"] is None, watch
        # The watcher's lines reach the server's stderr, prefixed, never its stdout.
        assert f"watch[{pid}] ingest: watch " in stderr_text(server)
    assert server.proc.returncode == 0, stderr_text(server)[-3000:]
    poll(lambda: gone(pid), timeout=30, interval=0.05)
    for line in server.stdout_lines:
        assert json.loads(line).get("jsonrpc") == "2.0", line[:300]


def test_a_run_in_progress_is_said_and_new_text_is_found_with_the_embedder_down(indexed: tuple) -> None:
    """While a run waits on the embedder, `index.refreshing` is true and the watcher is `running`;
    with the embedder down, ingest's keyword-first pass publishes the new text all the same, and
    the watcher says the run could not finish (it retries by itself)."""
    fake, corpus, store = indexed
    with watching_server(fake, corpus, store) as server:
        child_pid(server)
        fake.configure(hold=True)
        try:
            (corpus / "slow.md").write_text("# Slow\n\nSLOWPOKETOKEN arrives late.\n", encoding="utf-8")

            def refreshing() -> dict[str, Any] | None:
                is_error, payload = call(server, "search_corpus", {"query": "SLOWPOKETOKEN", "mode": "keyword"})
                assert not is_error, payload
                return payload["index"] if payload["index"]["refreshing"] else None

            index = poll(refreshing, timeout=VISIBLE_WITHIN_S, interval=0.05)
            assert index["watch"]["state"] == "running" and index["watch"]["files_waiting"] == 1, index
        finally:
            fake.configure(hold=False)
        visible(server, "SLOWPOKETOKEN", "slow.md")
        fake.stop()
        try:
            (corpus / "offline.md").write_text("# Offline\n\nOFFLINETOKEN written while Ollama is down.\n",
                                               encoding="utf-8")
            visible(server, "OFFLINETOKEN", "offline.md")
            watch = poll(lambda: (w := watch_of(server)) and w["last_run_outcome"] == "unfinished" and w,
                         timeout=30, interval=0.1)
            assert watch["state"] == "waiting" and watch["last_run_error"], watch
            assert "without vectors" in watch["last_run_error"], watch
        finally:
            fake.restart()


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the processes in /proc (Linux)")
def test_a_watcher_killed_with_minus_9_is_started_again(indexed: tuple) -> None:
    fake, corpus, store = indexed
    with watching_server(fake, corpus, store) as server:
        first = child_pid(server)
        os.kill(first, signal.SIGKILL)
        second = child_pid(server, other_than=first)
        assert "the index watcher stopped (killed by SIGKILL); starting it again in 1 s" in stderr_text(server)
        (corpus / "phoenix.md").write_text("# Phoenix\n\nPHOENIXTOKEN rises again.\n", encoding="utf-8")
        visible(server, "PHOENIXTOKEN", "phoenix.md")
        assert not gone(second)
    poll(lambda: gone(second), timeout=30, interval=0.05)


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_no_watcher_outlives_its_server(indexed: tuple, how: str) -> None:
    """SIGTERM: the server stops its watcher and exits 0. kill -9: the watcher sees its parent gone
    and stops by itself, within about a second."""
    fake, corpus, store = indexed
    with watching_server(fake, corpus, store) as server:
        pid = child_pid(server)
        server.proc.send_signal(getattr(signal, how))
        code = server.proc.wait(timeout=60)
        poll(lambda: gone(pid), timeout=30, interval=0.05)
    if how == "SIGTERM":
        assert code == 0, stderr_text(server)[-3000:]
    # The store's watch lock is free again: a manual watcher gets it at once.
    assert rules.StoreLayout(store).watcher_pid() is None


def test_a_watcher_already_running_on_the_store_is_left_alone(indexed: tuple, tmp_path: Path) -> None:
    """A systemd watcher (here a plain `ingest.py --watch`) already keeps the store fresh: the
    server starts none, says whose it is, and answers from what that one publishes; a second
    server with --watch beside the first starts none either."""
    fake, corpus, store = indexed
    outside = subprocess.Popen([sys.executable, str(ROOT / "ingest.py"), "--corpus", str(corpus), "--store",
                                str(store), "--watch", "--settle", str(SETTLE_S)], env=child_env(fake),
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT.parent)
    try:
        poll(lambda: rules.StoreLayout(store).watcher_pid() == outside.pid, timeout=60, interval=0.05)
        with watching_server(fake, corpus, store) as first, watching_server(fake, corpus, store, "--watch") as second:
            for server in (first, second):
                watch = poll(lambda s=server: watch_of(s), timeout=30, interval=0.1)
                assert watch["by"] == "another process" and watch["pid"] == outside.pid, watch
                server.wait_for_stderr(f"another watcher (pid {outside.pid}) keeps")
            (corpus / "elsewhere.md").write_text("# Elsewhere\n\nELSEWHERETOKEN kept fresh.\n", encoding="utf-8")
            visible(first, "ELSEWHERETOKEN", "elsewhere.md")
            assert "index watcher started" not in stderr_text(first) + stderr_text(second)
            # The outside watcher stops: one of the servers takes over, the other tells of it.
            outside.send_signal(signal.SIGINT)
            assert outside.wait(timeout=60) == 0

            def one_took_over() -> tuple[dict[str, Any], dict[str, Any]] | None:
                watches = sorted((watch_of(first), watch_of(second)), key=lambda w: (w or {}).get("by", ""))
                other, ours = watches
                if not (ours and other and ours["by"] == "this server" and ours["state"] == "waiting"):
                    return None
                return (ours, other) if other["by"] == "another process" and other["pid"] == ours["pid"] else None

            poll(one_took_over, timeout=60, interval=0.1)
            (corpus / "takeover.md").write_text("# Takeover\n\nTAKEOVERTOKEN kept fresh.\n", encoding="utf-8")
            visible(second, "TAKEOVERTOKEN", "takeover.md")
    finally:
        if outside.poll() is None:
            outside.send_signal(signal.SIGINT)
        outside.wait(timeout=60)


def test_rag_watch_in_the_clients_env_and_a_store_with_no_index_yet(tmp_path: Path) -> None:
    """RAG_WATCH=1 in the env an MCP client passes: the server's watcher builds the first index
    (keyword-first, then vectors), and the server picks it up without a restart."""
    with FakeOllama() as fake:
        corpus, store = copy_sample(tmp_path), tmp_path / "store"
        with watching_server(fake, corpus, store, RAG_WATCH="1") as server:
            is_error, payload = call(server, "search_corpus", {"query": "rollback", "mode": "keyword"})
            if is_error:  # the first run has not published yet
                assert payload["error"]["code"] == "index_missing", payload
                assert "index watcher builds it now" in payload["error"]["hint"], payload
            poll(lambda: not call(server, "search_corpus", {"query": "rollback", "mode": "keyword"})[0],
                 timeout=120, interval=0.1)
            visible(server, "rollback", "runbooks/deploy.md")
            watch = watch_of(server)
            assert watch is not None and watch["by"] == "this server", watch


def test_health_says_what_the_watcher_does(indexed: tuple) -> None:
    import urllib.request

    fake, corpus, store = indexed
    port = free_port()
    env = {**os.environ, **server_env(store, corpus, fake.host)}
    env.pop("RAG_EMBED_MODEL", None)
    proc = subprocess.Popen([sys.executable, str(ROOT / "server.py"), "--http", "--port", str(port), "--watch",
                             "--settle", str(SETTLE_S)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=ROOT.parent)
    try:
        def health() -> dict[str, Any] | None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as answer:
                    body = json.load(answer)
            except OSError:
                return None
            watch = body["watch"]
            return body if watch and watch["state"] == "waiting" and watch["last_run_at"] else None

        body = poll(health, timeout=120, interval=0.1)
        assert body["refreshing"] is False and body["watch"]["by"] == "this server", body
        pid = body["watch"]["pid"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        poll(lambda: gone(pid), timeout=30, interval=0.05)
        assert not proc.stdout.read()  # type: ignore[union-attr]  # stdout carries nothing but the protocol
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def test_the_watcher_starts_without_tools_list(indexed: tuple) -> None:
    """A client that reuses a cached tools/list sends only initialize: the watcher starts all the
    same, a few seconds after start-up."""
    fake, corpus, store = indexed
    server = RawServer(server_env(store, corpus, fake.host), args=("--watch", "--settle", str(SETTLE_S)))
    try:
        init = server.request("initialize", {"protocolVersion": "2025-06-18", "capabilities": {},
                                             "clientInfo": {"name": "cached", "version": "0"}})
        assert "This server keeps its index fresh itself" in init["result"]["instructions"]
        server.notify("notifications/initialized")
        pid = poll(lambda: rules.StoreLayout(store).watcher_pid(), timeout=60, interval=0.1)
        assert f"index watcher started (pid {pid})" in stderr_text(server)
    finally:
        assert server.close() == 0
    poll(lambda: gone(pid), timeout=30, interval=0.05)
