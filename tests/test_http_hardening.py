"""The HTTP door under hostile or careless clients (issue #26): slow and idle senders, a
descriptor limit, SIGTERM mid-call, lone surrogates, slow searches beside cheap calls, timed-out
calls and their threads, /health's status code, exact Host/Origin matching, and what a first-time
user reads. Always the real `python server.py --http` over loopback, with the fake Ollama; loads
are bounded (hundreds of sockets at most) and timing bounds are generous.
"""

from __future__ import annotations

import contextlib
import json
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from fake_ollama import FakeOllama
from helpers import SERVER, Built, sample_built, wait_for_logged
from test_http import TOKEN, HttpServer, bridge, bridge_failure, http_server

pytestmark = [pytest.mark.heavy, pytest.mark.process]  # a file over a minute of real processes: `pytest --all` only, scheduled first

READ_TIMEOUT_S = 2
MCP_HEADERS = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}


@pytest.fixture(scope="module")
def built(fake: FakeOllama, indexed_sample: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Built:
    return sample_built(indexed_sample, tmp_path_factory.mktemp("http-hardening"), fake.host)


@pytest.fixture(scope="module")
def server(built: Built, fake: FakeOllama) -> Iterator[HttpServer]:
    with http_server(built.server_env(fake.host, RAG_HTTP_READ_TIMEOUT=str(READ_TIMEOUT_S))) as running:
        yield running


@pytest.fixture()
def slow_fake() -> Iterator[FakeOllama]:
    with FakeOllama() as instance:
        yield instance


def address(server: HttpServer) -> tuple[str, int]:
    host, port = server.base.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def tool_call(name: str, arguments: dict[str, Any], request_id: int = 1) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": request_id, "method": "tools/call", "params": {"name": name,
                                                                                  "arguments": arguments}}


def server_threads(server: HttpServer) -> int:
    status = Path(f"/proc/{server.proc.pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("Threads:")))


def read_until_closed(sock: socket.socket, timeout: float) -> bytes:
    """What the server sent before it closed the connection (b"" if it only closed it)."""
    sock.settimeout(timeout)
    received = b""
    try:
        while piece := sock.recv(65536):
            received += piece
    except ConnectionResetError:
        pass
    return received


# ---------------------------------------------------------------------------
# Row 2: a body that trickles in holds no slot, and is dropped after the read timeout.


def test_slow_body_senders_hold_no_slot_and_are_dropped(built: Built, fake: FakeOllama) -> None:
    env = built.server_env(fake.host, RAG_HTTP_MAX_IN_FLIGHT="2", RAG_HTTP_READ_TIMEOUT=str(READ_TIMEOUT_S))
    with http_server(env) as running:
        body = json.dumps({"server": "local-rag", "toolName": "list_documents", "input": {}}).encode()
        host = f"Host: 127.0.0.1:{address(running)[1]}\r\n".encode()
        heads = [b"POST /mcp/call HTTP/1.1\r\n" + host + b"Content-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode(),
                 b"POST /mcp HTTP/1.1\r\n" + host + b"Content-Type: application/json\r\n"
                 b"Accept: application/json, text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"]
        stop = threading.Event()
        senders = [socket.create_connection(address(running)) for _ in range(8)]

        def trickle(sock: socket.socket, head: bytes) -> None:
            sock.sendall(head)
            chunked = b"chunked" in head
            for byte in body:
                if stop.wait(0.5):
                    return
                try:
                    sock.sendall(b"1\r\n" + bytes([byte]) + b"\r\n" if chunked else bytes([byte]))
                except OSError:
                    return  # dropped by the server: what this test wants

        workers = [threading.Thread(target=trickle, args=(sock, heads[n % 2]), daemon=True)
                   for n, sock in enumerate(senders)]
        for worker in workers:
            worker.start()
        try:
            time.sleep(0.5)  # the slow senders' headers are in: before the fix each held a slot from here
            answers = [bridge(running, "list_documents", {}) for _ in range(10)]
            answers.append(httpx.post(running.mcp_url, json={"jsonrpc": "2.0", "id": 7, "method": "tools/list"},
                                      headers=MCP_HEADERS))
            assert [a.status_code for a in answers] == [200] * 11, [a.text[:200] for a in answers]
            started = time.monotonic()
            dropped = [read_until_closed(sock, READ_TIMEOUT_S + 30) for sock in senders]
            assert time.monotonic() - started < READ_TIMEOUT_S + 30
            for received in dropped:
                assert received.startswith(b"HTTP/1.1 408 "), received[:200]
                assert json.loads(received.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "REQUEST_TIMEOUT"
        finally:
            stop.set()
            for sock in senders:
                sock.close()
        assert bridge(running, "list_documents", {}).status_code == 200


# ---------------------------------------------------------------------------
# Row 3: idle and slowloris connections under a descriptor limit.

DESCRIPTORS = 256  # the server's RLIMIT_NOFILE, soft and hard: it cannot raise it
IDLE_SOCKETS = 400


def low_descriptor_limit() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (DESCRIPTORS, DESCRIPTORS))


def test_idle_sockets_past_the_descriptor_limit_do_not_starve_health_or_calls(built: Built, fake: FakeOllama) -> None:
    env = built.server_env(fake.host, RAG_HTTP_TOKEN=TOKEN, RAG_HTTP_READ_TIMEOUT=str(READ_TIMEOUT_S))
    with http_server(env, preexec_fn=low_descriptor_limit) as running:
        idle: list[socket.socket] = []
        slowloris: list[socket.socket] = []
        try:
            for n in range(IDLE_SOCKETS):
                sock = socket.create_connection(address(running))
                if n % 20 == 0:  # a header line now and then, never the blank line that ends them
                    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
                    slowloris.append(sock)
                else:
                    idle.append(sock)
            for sock in slowloris[:5]:
                sock.sendall(b"X-Slow: 1\r\n")
            deadline = time.monotonic() + READ_TIMEOUT_S + 60
            while True:
                try:
                    health = httpx.get(f"{running.base}/health", timeout=5)
                    call = bridge(running, "list_documents", {}, headers={"Authorization": f"Bearer {TOKEN}"},
                                  timeout=5)
                    if health.status_code == 200 and call.status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, "neither /health nor a token-holder's call was answered"
                time.sleep(0.2)
            assert call.json()["success"] is True
            assert "at most 156 connections at once" in running.stderr, running.stderr[-2000:]
            # Every idle socket was refused at once (503), or closed: its place taken, or its headers late.
            answers = [read_until_closed(sock, READ_TIMEOUT_S + 30) for sock in idle + slowloris]
            refused = sum(answer.startswith(b"HTTP/1.1 503 ") for answer in answers)
            assert all(answer in (b"",) or answer.startswith(b"HTTP/1.1 503 ") for answer in answers)
            print(f"{IDLE_SOCKETS} idle sockets at a {DESCRIPTORS}-descriptor limit: {refused} refused with 503, "
                  f"{len(answers) - refused} closed; /health and a call answered")
        finally:
            for sock in idle + slowloris:
                sock.close()
        assert running.proc.poll() is None


def test_a_client_without_the_token_holding_and_reopening_connections_never_keeps_a_token_holder_out(
        built: Built, fake: FakeOllama) -> None:
    """Issue 42 N3: one client with no token holds more idle connections than the bound and keeps
    reopening the ones closed; each new connection takes the place of a waiting one (that client's
    own, the oldest first), so every call of a token holder, each on a new connection, is answered."""
    bound = 64
    env = built.server_env(fake.host, RAG_HTTP_TOKEN=TOKEN, RAG_HTTP_READ_TIMEOUT="30",
                           RAG_HTTP_MAX_CONNECTIONS=str(bound))
    with http_server(env) as running:
        stop, opened = threading.Event(), [0]

        def hog() -> None:  # holds 2.5x the bound, reopening one every 5 ms (issue: ~100 a second)
            held: list[socket.socket] = []
            while not stop.is_set():
                with contextlib.suppress(OSError):
                    held.append(socket.create_connection(address(running), timeout=5))
                    opened[0] += 1
                while len(held) > bound * 5 // 2:
                    held.pop(0).close()
                time.sleep(0.005)
            for sock in held:
                sock.close()

        attacker = threading.Thread(target=hog, daemon=True)
        attacker.start()
        try:
            while opened[0] < bound * 2:
                time.sleep(0.05)
            statuses = []
            for _ in range(25):
                statuses.append(httpx.get(f"{running.base}/health", timeout=10).status_code)
                statuses.append(bridge(running, "list_documents", {}, timeout=10,
                                       headers={"Authorization": f"Bearer {TOKEN}"}).status_code)
        finally:
            stop.set()
            attacker.join(30)
        assert statuses == [200] * 50, statuses
        assert opened[0] > bound * 3, "the client kept reopening while the token holder called"
        assert running.proc.poll() is None


# ---------------------------------------------------------------------------
# Row 9: SIGTERM while calls run on past the grace period.


def test_sigterm_answers_calls_in_flight_and_exits_cleanly(built: Built, slow_fake: FakeOllama) -> None:
    running = HttpServer(built.server_env(slow_fake.host, RAG_EMBED_TIMEOUT="60")).wait_listening()
    try:
        wait_for_logged(running.stderr_lines, "warm-up: done")
        slow_fake.configure(delay_seconds=40)
        with ThreadPoolExecutor(4) as pool:
            over_bridge = [pool.submit(bridge, running, "search_corpus", {"query": f"held at shutdown {n}",
                                                                          "mode": "vector"}) for n in range(2)]
            over_mcp = [pool.submit(httpx.post, running.mcp_url, timeout=60, headers=MCP_HEADERS,
                                    json=tool_call("search_corpus", {"query": f"mcp at shutdown {n}"}, 40 + n))
                        for n in range(2)]
            deadline = time.monotonic() + 30
            while slow_fake.calls()["embed_calls"] < 4:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            running.proc.send_signal(signal.SIGTERM)
            stopped = time.monotonic()
            code = running.proc.wait(timeout=60)
            exited_after = time.monotonic() - stopped
            for future in over_bridge:
                details = bridge_failure(future.result(timeout=10), 503, "SERVER_NOT_RUNNING")
                assert details == {"server": "local-rag", "status": "stopping"}
            for n, future in enumerate(over_mcp):
                answer = future.result(timeout=10)
                assert answer.status_code == 503, answer.text[:300]
                assert answer.json()["id"] == 40 + n and "shutting down" in answer.json()["error"]["message"]
    finally:
        if running.proc.poll() is None:
            running.proc.kill()
    print(f"SIGTERM with 4 calls in flight: exit {code} after {exited_after:.1f} s")
    assert code == 0 and exited_after < 5 + 5, (code, exited_after)  # uvicorn's grace, and a margin
    running._stdout_reader.join(timeout=10)
    assert "Traceback" not in running.stderr and "Internal Server Error" not in running.stderr, running.stderr


# ---------------------------------------------------------------------------
# Row 10: lone surrogates anywhere in a bridge request.


@pytest.mark.parametrize(("body", "field"), [
    ('{"server": "local-rag", "toolName": "search_corpus", "input": {"query": "a\\ud800b"}}', "input"),
    ('{"server": "local-rag", "toolName": "search_corpus", "input": {"\\udc80": "x", "query": "x"}}', "input"),
    ('{"server": "local-rag", "toolName": "get_file", "input": {"path": "runbooks/\\ud800.md"}}', "input"),
    ('{"server": "local-\\ud800", "toolName": "search_corpus", "input": {"query": "x"}}', "server"),
    ('{"server": "local-rag", "toolName": "list_documents", "input": {}, "\\ud800": 1}', "body"),
])
def test_lone_surrogates_are_a_validation_error(server: HttpServer, body: str, field: str) -> None:
    response = httpx.post(f"{server.base}/mcp/call", content=body.encode(), headers={"Content-Type":
                                                                                     "application/json"})
    details = bridge_failure(response, 400, "VALIDATION_ERROR")
    assert details["field"] == field and "surrogate" in response.json()["error"]["message"], response.text


# ---------------------------------------------------------------------------
# Row 14: cheap calls beside slow searches; timed-out calls and threads.


def test_slow_searches_fill_their_own_budget_not_the_cheap_calls(built: Built, slow_fake: FakeOllama) -> None:
    env = built.server_env(slow_fake.host, RAG_HTTP_MAX_IN_FLIGHT="2", RAG_EMBED_TIMEOUT="60")
    with http_server(env) as running:
        slow_fake.configure(delay_seconds=6)
        with ThreadPoolExecutor(2) as pool:
            slow = [pool.submit(bridge, running, "search_corpus", {"query": f"slow search {n}"}) for n in range(2)]
            deadline = time.monotonic() + 30
            while slow_fake.calls()["embed_calls"] < 2:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            cheap = [bridge(running, "search_corpus", {"query": "sev-1 escalation", "mode": "keyword"}),
                     bridge(running, "get_file", {"path": "oncall/escalation.md", "end_line": 3}),
                     bridge(running, "list_documents", {}),
                     httpx.post(running.mcp_url, json=tool_call("list_documents", {}), headers=MCP_HEADERS)]
            assert [r.status_code for r in cheap] == [200] * 4, [r.text[:200] for r in cheap]
            assert "error" not in cheap[3].json() and not cheap[3].json()["result"].get("isError"), cheap[3].text
            one_too_many = httpx.post(running.mcp_url, json=tool_call("search_corpus", {"query": "third"}),
                                      headers=MCP_HEADERS)
            assert bridge_failure(one_too_many, 503, "TOO_BUSY")["max"] == 2
            assert all(f.result(timeout=60).status_code == 200 for f in slow)


def test_timed_out_calls_do_not_pile_up_threads(built: Built, slow_fake: FakeOllama) -> None:
    env = built.server_env(slow_fake.host, RAG_TOOL_TIMEOUT="1", RAG_EMBED_TIMEOUT="60", RAG_HTTP_MAX_IN_FLIGHT="4")
    with http_server(env) as running:
        wait_for_logged(running.stderr_lines, "warm-up: done")
        assert bridge(running, "list_documents", {}).status_code == 200
        before = server_threads(running)
        slow_fake.configure(delay_seconds=8)
        peak, statuses = before, []

        def client(n: int) -> list[int]:
            if n % 2:  # over /mcp: a timed-out call is a tool error there, and the same slot rule holds
                return [httpx.post(running.mcp_url, headers=MCP_HEADERS, timeout=60, json=tool_call(
                    "search_corpus", {"query": f"mcp timed out {n} {i}", "mode": "vector"})).status_code
                        for i in range(5)]
            return [bridge(running, "search_corpus", {"query": f"timed out {n} {i}", "mode": "vector"}).status_code
                    for i in range(5)]

        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(client, n) for n in range(8)]
            while not all(f.done() for f in futures):
                peak = max(peak, server_threads(running))
                time.sleep(0.05)
            statuses = [status for f in futures for status in f.result()]
        assert set(statuses) <= {200, 503, 504} and 504 in statuses, statuses
        print(f"threads: {before} before, at most {peak} during {len(statuses)} calls "
              f"({statuses.count(504) + statuses.count(200)} timed out, {statuses.count(503)} refused)")
        # The work of timed-out calls holds their slots: at most 4 searches' threads (plus the
        # cheap budget's, unused here), whatever the number of calls.
        assert peak <= before + 4 + 2, (before, peak)
        slow_fake.configure(delay_seconds=0)


# ---------------------------------------------------------------------------
# Row 17 and the first-time user's list.


def test_host_and_origin_are_matched_exactly(built: Built, fake: FakeOllama) -> None:
    env = built.server_env(fake.host, RAG_HTTP_ALLOWED_HOSTS="rag.internal:*,api.internal:8443",
                           RAG_HTTP_ALLOWED_ORIGINS="https://portal.internal,http://localhost:*")
    with http_server(env) as running:
        port = address(running)[1]

        def status(**headers: str) -> int:
            return bridge(running, "list_documents", {}, headers=headers).status_code

        assert status(Host=f"127.0.0.1:{port}@evil.example") == 421
        assert status(Host=f"127.0.0.1:{port}.evil.example") == 421
        assert status(Host="rag.internal.evil.example") == 421
        assert status(Host="api.internal") == 421 and status(Host="api.internal:9000") == 421
        assert status(Host="127.0.0.1") == 200 and status(Host="localhost") == 200
        assert status(Host="rag.internal") == 200 and status(Host="rag.internal:443") == 200
        assert status(Host="api.internal:8443") == 200
        assert status(Origin="http://127.0.0.1:1") == 403  # another local page, another port
        assert status(Origin=f"http://127.0.0.1:{port}.evil.example") == 403
        assert status(Origin=f"http://127.0.0.1:{port}") == 200  # the server's own pages
        assert status(Origin="http://localhost:1234") == 200 and status(Origin="https://portal.internal") == 200
        assert status(Origin="https://portal.internal.evil.example") == 403 and status(Origin="null") == 403
        mcp = httpx.post(running.mcp_url, json=tool_call("list_documents", {}),
                         headers={**MCP_HEADERS, "Host": "127.0.0.1", "Origin": f"http://localhost:{port}"})
        assert mcp.status_code == 200, mcp.text


def test_missing_and_wrong_tokens_are_told_apart(built: Built, fake: FakeOllama) -> None:
    with http_server(built.server_env(fake.host, RAG_HTTP_TOKEN=TOKEN)) as guarded:
        messages = []
        for headers in ({}, {"Authorization": "Bearer wrong-token-0123456789"}, {"Authorization": f"Basic {TOKEN}"}):
            response = bridge(guarded, "list_documents", {}, headers=headers)
            messages.append(response.json()["error"]["message"])
            bridge_failure(response, 401, "UNAUTHORIZED")
        assert len(set(messages)) == 3, messages
        assert "required" in messages[0] and "not the one" in messages[1] and "Bearer scheme" in messages[2]


def test_a_short_token_is_said_once(built: Built, fake: FakeOllama) -> None:
    env = {**built.server_env(fake.host), "RAG_HTTP_TOKEN": "short", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, str(SERVER), "--http", "--port", "0"], env=env, capture_output=True,
                          text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert done.returncode == 2
    assert done.stderr.count("RAG_HTTP_TOKEN='(hidden)'") == 1, done.stderr
    assert "configuration error: configuration error" not in done.stderr


def test_wrong_routes_and_methods_answer_in_the_bridge_envelope(server: HttpServer) -> None:
    wrong_method = httpx.get(f"{server.base}/mcp/call")
    details = bridge_failure(wrong_method, 405, "METHOD_NOT_ALLOWED")
    assert details["allowed"] == "POST" and wrong_method.headers["allow"] == "POST"
    for path in ("/nope", "/mcp/tools/extra", "/"):
        missing = httpx.get(f"{server.base}{path}")
        bridge_failure(missing, 404, "NOT_FOUND")
        assert "/mcp/call" in missing.json()["error"]["message"]


def test_input_that_is_not_an_object_is_named_as_such(server: HttpServer) -> None:
    response = httpx.post(f"{server.base}/mcp/call", json={"server": "local-rag", "toolName": "search_corpus",
                                                           "input": "query"})
    assert bridge_failure(response, 400, "VALIDATION_ERROR")["field"] == "input"
    assert response.json()["error"]["message"] == "input must be a JSON object, not a string"


def test_an_allowed_host_that_could_never_match_is_a_configuration_error(built: Built, fake: FakeOllama) -> None:
    env = {**built.server_env(fake.host), "RAG_HTTP_ALLOWED_HOSTS": "https://rag.internal"}
    done = subprocess.run([sys.executable, str(SERVER), "--http", "--port", "0"], env=env, capture_output=True,
                          text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert done.returncode == 2 and "RAG_HTTP_ALLOWED_HOSTS" in done.stderr, done.stderr
    assert "listening on" not in done.stderr


def test_the_descriptor_soft_limit_is_raised_toward_the_hard_one(built: Built, fake: FakeOllama) -> None:
    def soft_limit_low() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (DESCRIPTORS, 4096))

    with http_server(built.server_env(fake.host), preexec_fn=soft_limit_low) as running:
        limits = Path(f"/proc/{running.proc.pid}/limits").read_text()
        soft, hard = next(line.split()[3:5] for line in limits.splitlines() if line.startswith("Max open files"))
        assert (int(soft), int(hard)) == (1000 + 100, 4096), limits  # RAG_HTTP_MAX_CONNECTIONS and the reserve
        assert "connections at once" not in running.stderr
