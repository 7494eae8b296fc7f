"""The HTTP doors: the real `python server.py --http` (uvicorn on a free loopback port) spoken to
by the MCP SDK's streamable-HTTP client (both protocol eras), by a plain HTTP client on the bridge
API (every case of ../shared/specs/mcp-http-bridge-api.md's test list), and by the real Claude
Code CLI when it can be installed. Indexes are built by the real `python ingest.py` through the
loopback fake Ollama. No timing assertions: "does not block" is shown by order of completion.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from fake_ollama import FakeOllama
from faultlib import write_lock
from helpers import (
    ROOT,
    SERVER,
    Built,
    connect,
    free_port,
    output_validators,
    sample_built,
    tool,
    vectors_loaded,
    wait_for_logged,
)
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client
from mcp.shared.exceptions import MCPError
from mcp.types import INVALID_PARAMS, ResourceTemplateReference

pytestmark = [pytest.mark.heavy, pytest.mark.process]  # a file over a minute of real processes: `pytest --all` only, scheduled first

TOKEN = "team-secret-token-0123456789"
LISTENING = re.compile(r"listening on (http://[^ ]+)/mcp")


class HttpServer:
    """`python server.py --http --port 0 ...` until stop(); its URL read from the line it logs
    once the socket listens. stdout must stay empty (nothing but logs, on stderr)."""

    def __init__(self, env: dict[str, str], *args: str, preexec_fn: Callable[[], None] | None = None) -> None:
        full_env = {**os.environ, **env, "PYTHONUNBUFFERED": "1"}
        full_env.pop("RAG_EMBED_MODEL", None)
        self.proc = subprocess.Popen([sys.executable, str(SERVER), "--http", "--port", "0", *args], env=full_env,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, cwd=str(ROOT.parent), preexec_fn=preexec_fn)
        self.stderr_lines: list[str] = []
        self.stdout = ""
        self._listening = threading.Event()
        self.base = ""
        threading.Thread(target=self._read_stderr, daemon=True).start()
        self._stdout_reader = threading.Thread(target=self._read_stdout, daemon=True)
        self._stdout_reader.start()

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr_lines.append(line)
            if (found := LISTENING.search(line)) and not self.base:
                self.base = found.group(1)
                self._listening.set()
        self._listening.set()

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        self.stdout = self.proc.stdout.read()

    def wait_listening(self) -> HttpServer:
        assert self._listening.wait(120), "never said it was listening"
        assert self.base, f"exited {self.proc.poll()} before listening:\n{self.stderr}"
        return self

    @property
    def stderr(self) -> str:
        return "".join(self.stderr_lines)

    @property
    def mcp_url(self) -> str:
        return f"{self.base}/mcp"

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        self._stdout_reader.join(timeout=10)
        return code


@contextmanager
def http_server(env: dict[str, str], *args: str,
                preexec_fn: Callable[[], None] | None = None) -> Iterator[HttpServer]:
    """A listening server; on exit SIGTERM must stop it with exit 0 and nothing on stdout."""
    server = HttpServer(env, *args, preexec_fn=preexec_fn)
    try:
        yield server.wait_listening()
    finally:
        code = server.stop()
    assert code == 0, f"exit {code}:\n{server.stderr[-3000:]}"
    assert server.stdout == "", server.stdout[:500]


@pytest.fixture(scope="module")
def built(fake: FakeOllama, indexed_sample: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Built:
    return sample_built(indexed_sample, tmp_path_factory.mktemp("http"), fake.host)


@pytest.fixture(scope="module")
def server(built: Built, fake: FakeOllama) -> Iterator[HttpServer]:
    with http_server(built.server_env(fake.host)) as running:
        yield running


def dead_ollama() -> str:
    return f"http://127.0.0.1:{free_port()}"


def bridge(server: HttpServer, tool_name: str, arguments: Any, *, server_name: str = "local-rag",
           headers: dict[str, str] | None = None, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{server.base}/mcp/call", json={"server": server_name, "toolName": tool_name,
                                                       "input": arguments},
                      headers=headers, timeout=timeout)


def bridge_failure(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    """Asserts the bridge's failure shape; returns error.details."""
    assert response.status_code == status, (response.status_code, response.text[:500])
    body = response.json()
    assert body["success"] is False and set(body["error"]) == {"code", "message", "details"}, body
    assert body["error"]["code"] == code, body
    assert isinstance(body["error"]["details"], dict)
    return body["error"]["details"]


def no_paths_or_hosts(text: str, *secrets: str) -> None:
    for secret in secrets:
        assert secret not in text, f"{secret!r} leaked: {text[:500]}"
    assert "Traceback" not in text and "File \"" not in text, text[:500]


async def mcp_http_client(url: str, mode: str, token: str | None = None) -> Any:
    if token is None:
        return Client(url, mode=mode, read_timeout_seconds=60)
    transport = streamable_http_client(url, http_client=create_mcp_http_client(
        headers={"Authorization": f"Bearer {token}"}))
    return Client(transport, mode=mode, read_timeout_seconds=60)  # type: ignore[arg-type]  # a transport is a target


# ---------------------------------------------------------------------------
# MCP over streamable HTTP, through the SDK's own client, in both protocol eras.


@pytest.mark.parametrize("mode", ["legacy", "2026-07-28"])
def test_mcp_client_uses_all_three_tools_over_http(server: HttpServer, built: Built, mode: str) -> None:
    async def session() -> None:
        async with await mcp_http_client(server.mcp_url, mode) as client:
            listed = await client.list_tools()
            by_name = {t.name: t for t in listed.tools}
            assert set(by_name) == {"search_corpus", "get_file", "list_documents"}
            assert all(t.output_schema and t.annotations and t.annotations.read_only_hint for t in listed.tools)

            is_error, found = await tool(client, "search_corpus", query="declaring a sev-1 incident")
            assert not is_error and found["results"][0]["path"] == "oncall/escalation.md", found
            hit = found["results"][0]
            is_error, lines = await tool(client, "get_file", path=hit["path"], start_line=hit["start_line"],
                                         end_line=hit["end_line"])
            assert not is_error and lines["start_line"] == hit["start_line"], lines
            expected = (built.corpus / hit["path"]).read_text().splitlines()[hit["start_line"] - 1:hit["end_line"]]
            assert lines["text"] == "\n".join(expected)
            is_error, listing = await tool(client, "list_documents")
            assert not is_error and hit["path"] in [d["path"] for d in listing["documents"]]

            # Errors: structured, readable, and over HTTP without the server's filesystem paths.
            is_error, refused = await tool(client, "get_file", path="../../etc/passwd")
            assert is_error and refused["error"]["code"] == "path_rejected", refused
            is_error, missing = await tool(client, "get_file", path="no/such/file.md")
            assert is_error and missing["error"]["code"] == "not_indexed", missing
            is_error, invalid = await tool(client, "search_corpus", query="x", k=0)
            assert is_error and invalid["error"]["code"] == "invalid_argument", invalid
            for payload in (refused, missing, invalid):
                no_paths_or_hosts(json.dumps(payload), str(built.corpus), str(built.store))

    anyio.run(session)


@pytest.mark.parametrize("mode", ["legacy", "2026-07-28"])
def test_documents_are_resources_over_http(server: HttpServer, built: Built, mode: str) -> None:
    """resources/list, a template read of a hit's lines, completion, and the unknown tool as a
    JSON-RPC error, through /mcp; errors carry no filesystem path of the server."""
    import server as server_module

    template = ResourceTemplateReference(uri=server_module.LINES_TEMPLATE)

    async def session() -> None:
        async with await mcp_http_client(server.mcp_url, mode) as client:
            listed = await client.list_resources()
            assert "oncall/escalation.md" in [r.name for r in listed.resources]
            is_error, found = await tool(client, "search_corpus", query="declaring a sev-1 incident")
            hit = found["results"][0]
            read = await client.read_resource(f"{hit['uri']}?start_line={hit['start_line']}&end_line={hit['end_line']}")
            expected = (built.corpus / hit["path"]).read_text().splitlines()[hit["start_line"] - 1:hit["end_line"]]
            assert read.contents[0].text == "\n".join(expected)
            completed = await client.complete(template, {"name": "path", "value": "oncall/"})
            assert completed.completion.values == ["oncall/escalation.md"]
            for uri in ("local-rag://doc/no/such/file.md", "local-rag://doc/..%2F..%2Fetc%2Fpasswd"):
                with pytest.raises(MCPError) as refused:
                    await client.read_resource(uri)
                assert refused.value.code == INVALID_PARAMS
                no_paths_or_hosts(json.dumps(refused.value.data) + refused.value.message, str(built.corpus),
                                  str(built.store))
            with pytest.raises(MCPError) as foreign:
                await client.read_resource(f"file://{built.corpus}/runbooks/deploy.md")
            assert str(built.corpus) not in foreign.value.message
            assert f"{server_module.DOCUMENT_URI_PREFIX}<path>" in foreign.value.message  # redaction keeps our URIs
            with pytest.raises(MCPError) as unknown:
                await client.call_tool("delete_everything", {})
            assert unknown.value.code == INVALID_PARAMS

    anyio.run(session)


def test_one_search_answers_identically_through_every_door(server: HttpServer, built: Built,
                                                          fake: FakeOllama) -> None:
    """stdio MCP, HTTP MCP, the bridge and the CLI run the same dispatcher over the same index."""
    arguments = {"query": "rotate the signing keys", "k": 4}

    async def over_mcp() -> tuple[dict[str, Any], dict[str, Any]]:
        async with connect(built.server_env(fake.host)) as client:
            await vectors_loaded(client)  # as the CLI's search, which waits for the load
            stdio = (await tool(client, "search_corpus", **arguments))[1]
        async with await mcp_http_client(server.mcp_url, "legacy") as client:
            await vectors_loaded(client)
            http = (await tool(client, "search_corpus", **arguments))[1]
        return stdio, http

    stdio, http = anyio.run(over_mcp)
    response = bridge(server, "search_corpus", arguments)
    assert response.status_code == 200, response.text
    assert response.json()["success"] is True
    env = {**os.environ, **built.server_env(fake.host)}
    done = subprocess.run([sys.executable, str(SERVER), "search", arguments["query"], "--k", "4", "--json"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert stdio["results"], stdio
    assert stdio == http == response.json()["result"] == json.loads(done.stdout)


def test_token_is_required_on_every_route_but_health(built: Built, fake: FakeOllama) -> None:
    with http_server(built.server_env(fake.host, RAG_HTTP_TOKEN=TOKEN)) as guarded:
        call = {"server": "local-rag", "toolName": "list_documents", "input": {}}
        initialize = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
                      "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                                 "clientInfo": {"name": "t", "version": "0"}}}
        mcp_headers = {"Accept": "application/json, text/event-stream"}
        for headers in ({}, {"Authorization": "Bearer wrong-token-0123456789"}, {"Authorization": TOKEN},
                        {"Authorization": f"Basic {TOKEN}"}):
            for response in (httpx.post(f"{guarded.base}/mcp/call", json=call, headers=headers),
                             httpx.get(f"{guarded.base}/mcp/tools", headers=headers),
                             httpx.post(guarded.mcp_url, json=initialize, headers={**mcp_headers, **headers})):
                bridge_failure(response, 401, "UNAUTHORIZED")
                assert response.headers["www-authenticate"] == "Bearer"
        assert httpx.get(f"{guarded.base}/health").json()["status"] == "ok"

        good = {"Authorization": f"Bearer {TOKEN}"}
        assert httpx.post(f"{guarded.base}/mcp/call", json=call, headers=good).json()["success"] is True
        assert httpx.get(f"{guarded.base}/mcp/tools", headers=good).status_code == 200

        async def session() -> None:
            async with await mcp_http_client(guarded.mcp_url, "legacy", token=TOKEN) as client:
                is_error, listing = await tool(client, "list_documents")
                assert not is_error and listing["total"] > 0

        anyio.run(session)


def test_dns_rebinding_is_refused_and_a_real_host_name_can_be_allowed(built: Built, fake: FakeOllama) -> None:
    with http_server(built.server_env(fake.host, RAG_HTTP_ALLOWED_HOSTS="rag.team.internal:*",
                                      RAG_HTTP_ALLOWED_ORIGINS="https://portal.team.internal")) as running:
        call = {"server": "local-rag", "toolName": "list_documents", "input": {}}
        port = running.base.rsplit(":", 1)[1]
        evil_origin = httpx.post(f"{running.base}/mcp/call", json=call, headers={"Origin": "http://evil.example"})
        bridge_failure(evil_origin, 403, "FORBIDDEN")
        evil_host = httpx.post(f"{running.base}/mcp/call", json=call, headers={"Host": "evil.example"})
        bridge_failure(evil_host, 421, "FORBIDDEN")
        evil_mcp = httpx.post(running.mcp_url, json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
                              headers={"Origin": "http://evil.example",
                                       "Accept": "application/json, text/event-stream"})
        assert evil_mcp.status_code == 403
        allowed = httpx.post(f"{running.base}/mcp/call", json=call,
                             headers={"Host": f"rag.team.internal:{port}", "Origin": "https://portal.team.internal"})
        assert allowed.status_code == 200 and allowed.json()["success"] is True, allowed.text
        # /health too (it needs no token, not any Host): a load balancer's probe sends the configured host
        bridge_failure(httpx.get(f"{running.base}/health", headers={"Host": "evil.example"}), 421, "FORBIDDEN")
        bridge_failure(httpx.get(f"{running.base}/health", headers={"Origin": "http://evil.example"}), 403,
                       "FORBIDDEN")
        probe = httpx.get(f"{running.base}/health", headers={"Host": f"rag.team.internal:{port}"})
        assert probe.status_code == 200 and probe.json()["status"] == "ok", probe.text


def test_non_loopback_address_without_a_token_refuses_to_start(built: Built, fake: FakeOllama) -> None:
    env = {**os.environ, **built.server_env(fake.host)}
    env.pop("RAG_HTTP_TOKEN", None)
    done = subprocess.run([sys.executable, str(SERVER), "--http", "--host", "0.0.0.0", "--port", "0"], env=env,
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert done.returncode == 2, done.stderr
    assert "RAG_HTTP_TOKEN" in done.stderr and "listening on" not in done.stderr
    short = subprocess.run([sys.executable, str(SERVER), "--http", "--host", "0.0.0.0", "--port", "0"],
                           env={**env, "RAG_HTTP_TOKEN": "short"}, capture_output=True, text=True, timeout=60,
                           stdin=subprocess.DEVNULL)
    assert short.returncode == 2 and "RAG_HTTP_TOKEN" in short.stderr, short.stderr
    assert "listening on" not in short.stderr


def test_get_on_mcp_is_refused_rather_than_left_hanging(server: HttpServer) -> None:
    response = httpx.get(server.mcp_url, headers={"Accept": "text/event-stream"}, timeout=10)
    bridge_failure(response, 405, "METHOD_NOT_ALLOWED")


# ---------------------------------------------------------------------------
# The bridge API, case by case as its specification lists them.


def test_bridge_success_returns_the_tools_structured_content(server: HttpServer, built: Built) -> None:
    response = bridge(server, "search_corpus", {"query": "declaring a sev-1 incident", "k": 3})
    assert response.status_code == 200 and response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"success", "result"} and body["success"] is True
    payload = body["result"]
    output_validators()["search_corpus"].validate(payload)
    assert payload["results"][0]["path"] == "oncall/escalation.md"
    assert len(payload["results"]) <= 3


def test_every_door_lists_exactly_the_tool_table(server: HttpServer) -> None:
    """A tool is declared once (server.TOOLS): MCP, the bridge, the CLI and the README list the same."""
    import server as server_module

    declared = set(server_module.TOOLS)

    async def listed_over_mcp() -> set[str]:
        async with await mcp_http_client(server.mcp_url, "legacy") as client:
            return {t.name for t in (await client.list_tools()).tools}

    assert anyio.run(listed_over_mcp) == declared
    assert {t["name"] for t in httpx.get(f"{server.base}/mcp/tools").json()["tools"]} == declared
    usage = subprocess.run([sys.executable, str(SERVER), "--help"], capture_output=True, text=True, timeout=60,
                           check=True).stdout
    commands = re.search(r"\{([a-z,]+)\}", usage)
    assert commands and {server_module.CLI_COMMANDS[c].name for c in commands.group(1).split(",")} == declared
    readme = (SERVER.parent / "README.md").read_text(encoding="utf-8")
    tools_section = readme.split("\n## Tools\n", 1)[1].split("\n## ", 1)[0]
    assert set(re.findall(r"^\*\*`([a-z_]+)\(", tools_section, flags=re.MULTILINE)) == declared


def test_bridge_lists_tools_with_schemas_and_the_configured_timeout(built: Built, fake: FakeOllama,
                                                                    server: HttpServer) -> None:
    body = httpx.get(f"{server.base}/mcp/tools").json()
    assert body["success"] is True
    tools = {t["name"]: t for t in body["tools"]}
    assert set(tools) == {"search_corpus", "get_file", "list_documents"}
    for entry in tools.values():
        assert set(entry) == {"name", "description", "server", "inputSchema", "outputSchema", "timeout"}
        assert entry["server"] == "local-rag" and entry["timeout"] == 30000 and entry["description"]
    assert "query" in tools["search_corpus"]["inputSchema"]["required"]
    with http_server(built.server_env(fake.host, RAG_TOOL_TIMEOUT="7.5")) as configured:
        timeouts = {t["timeout"] for t in httpx.get(f"{configured.base}/mcp/tools").json()["tools"]}
        assert timeouts == {7500}


def test_health_is_ok_on_a_good_index(server: HttpServer) -> None:
    deadline = time.monotonic() + 30
    while (body := httpx.get(f"{server.base}/health").json())["embedder"] == "not probed yet":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert body["status"] == "ok" and body["servers"] == {"local-rag": "available"}, body
    assert body["embedder"] == "available" and body["problems"] == []
    assert isinstance(body["uptime"], (int, float)) and body["uptime"] >= 0


def test_complex_input_with_every_argument(server: HttpServer) -> None:
    response = bridge(server, "search_corpus", {"query": "rollback the database migration", "k": "5",
                                                "path_prefix": "runbooks/", "mode": "hybrid",
                                                "include_superseded": True, "min_score": 0.0})
    assert response.status_code == 200, response.text
    results = response.json()["result"]["results"]
    assert results and all(hit["path"].startswith("runbooks/") for hit in results) and len(results) <= 5
    lines = bridge(server, "get_file", {"path": results[0]["path"], "start_line": results[0]["start_line"],
                                        "end_line": results[0]["start_line"]})
    assert lines.status_code == 200 and lines.json()["result"]["end_line"] == results[0]["start_line"]


LONG = "x" * 101


@pytest.mark.parametrize(("body", "field"), [
    ({"toolName": "search_corpus", "input": {}}, "server"),
    ({"server": "", "toolName": "search_corpus", "input": {}}, "server"),
    ({"server": "s" * 51, "toolName": "search_corpus", "input": {}}, "server"),
    ({"server": "local-rag", "input": {}}, "toolName"),
    ({"server": "local-rag", "toolName": "", "input": {}}, "toolName"),
    ({"server": "local-rag", "toolName": "search corpus", "input": {}}, "toolName"),
    ({"server": "local-rag", "toolName": "search_corpus;rm", "input": {}}, "toolName"),
    ({"server": "local-rag", "toolName": "../get_file", "input": {}}, "toolName"),
    ({"server": "local-rag", "toolName": LONG, "input": {}}, "toolName"),
    ({"server": "local-rag", "toolName": 42, "input": {}}, "toolName"),
    ({"server": "local-rag", "toolName": "search_corpus"}, "input"),
    ({"server": "local-rag", "toolName": "search_corpus", "input": ["query"]}, "input"),
    ({"server": "local-rag", "toolName": "search_corpus", "input": "query"}, "input"),
    ({"server": "local-rag", "toolName": "search_corpus", "input": {"query": "q" * 102_400}}, "input"),
    ([1, 2], "body"),
])
def test_bridge_refuses_malformed_calls(server: HttpServer, body: Any, field: str) -> None:
    response = httpx.post(f"{server.base}/mcp/call", json=body)
    details = bridge_failure(response, 400, "VALIDATION_ERROR")
    assert details["field"] == field, details


def test_deep_nesting_is_refused_past_ten_levels(server: HttpServer) -> None:
    def nested(levels: int) -> dict[str, Any]:
        value: Any = "leaf"
        for _ in range(levels - 1):
            value = {"a": value}
        return {"query": "x", "extra": value}

    too_deep = bridge(server, "search_corpus", nested(11))
    assert bridge_failure(too_deep, 400, "VALIDATION_ERROR")["field"] == "input"
    # Ten levels pass the bridge and reach the tool, which refuses the unknown argument itself.
    ten = bridge(server, "search_corpus", nested(10))
    assert bridge_failure(ten, 400, "TOOL_EXECUTION_ERROR")["code"] == "invalid_argument"


def test_bridge_refuses_bad_bodies(server: HttpServer) -> None:
    url = f"{server.base}/mcp/call"
    not_json = httpx.post(url, content=b'{"server": "local-rag", "toolName": ', headers={"Content-Type":
                                                                                        "application/json"})
    assert bridge_failure(not_json, 400, "VALIDATION_ERROR")["field"] == "body"
    text_plain = httpx.post(url, content=b"{}", headers={"Content-Type": "text/plain"})
    assert bridge_failure(text_plain, 400, "VALIDATION_ERROR")["field"] == "Content-Type"
    huge = json.dumps({"server": "local-rag", "toolName": "search_corpus", "input": {"query": "x"},
                       "padding": "p" * 1_100_000}).encode()
    too_big = httpx.post(url, content=huge, headers={"Content-Type": "application/json"})
    assert bridge_failure(too_big, 400, "VALIDATION_ERROR")["field"] == "body"
    assert bridge(server, "list_documents", {}).status_code == 200  # still serving


def test_unknown_server_and_tool_are_not_found(server: HttpServer) -> None:
    unknown_server = bridge(server, "search_corpus", {"query": "x"}, server_name="other-server")
    assert bridge_failure(unknown_server, 404, "SERVER_NOT_FOUND")["server"] == "other-server"
    unknown_tool = bridge(server, "delete_everything", {})
    assert bridge_failure(unknown_tool, 404, "TOOL_NOT_FOUND")["toolName"] == "delete_everything"


def test_tool_errors_keep_our_code_and_hint_and_hide_paths(server: HttpServer, built: Built) -> None:
    cases = [("get_file", {"path": "../../etc/passwd"}, 400, "path_rejected"),
             ("get_file", {"path": str(built.corpus / "oncall" / "escalation.md")}, 400, "path_rejected"),
             ("get_file", {"path": "no/such/page.md"}, 400, "not_indexed"),
             ("search_corpus", {"query": "x", "k": 0}, 400, "invalid_argument"),
             ("search_corpus", {"query": "x", "surprise": 1}, 400, "invalid_argument")]
    for tool_name, arguments, status, code in cases:
        response = bridge(server, tool_name, arguments)
        details = bridge_failure(response, status, "TOOL_EXECUTION_ERROR")
        assert details["code"] == code and details["hint"] and details["toolName"] == tool_name, details
        no_paths_or_hosts(response.text, str(built.corpus), str(built.store), str(ROOT))


def test_a_locked_vector_store_is_503_store_unavailable_with_retry_after(built: Built, fake: FakeOllama,
                                                                        tmp_path: Path) -> None:
    """A store another process holds locked is not a bug: 503 with Retry-After, code
    store_unavailable, and hybrid search still answers from its keyword channel."""
    store = tmp_path / "store"
    shutil.copytree(built.store, store)
    locked = dataclasses.replace(built, store=store)
    with http_server(locked.server_env(fake.host, RAG_STORE_TIMEOUT="2")) as running:
        wait_for_logged(running.stderr_lines, "warm-up: done")
        with write_lock(locked.index_dir / "chroma" / "chroma.sqlite3", "EXCLUSIVE"):
            response = bridge(running, "search_corpus", {"query": "who gets paged for a sev-1", "mode": "vector"})
            details = bridge_failure(response, 503, "TOOL_EXECUTION_ERROR")
            assert details["code"] == "store_unavailable" and response.headers["Retry-After"] == "1", details
            assert "retry" in details["hint"] and "keyword" in details["hint"], details
            hybrid = bridge(running, "search_corpus", {"query": "who gets paged for a sev-1"})
            assert hybrid.status_code == 200 and hybrid.json()["result"]["degraded"] == "vector_store_unavailable"
        no_paths_or_hosts(response.text, str(store), str(ROOT))


def test_special_characters_reach_the_tool_intact(server: HttpServer) -> None:
    for query in ['"quoted" AND (NEAR OR NOT) * ^', "'; DROP TABLE chunks; --", "<script>alert(1)</script>",
                  "障害対応の手順", "emoji 🚨 sev-1", "tab\tand\nnewline", "back\\slash %s {0} $HOME"]:
        response = bridge(server, "search_corpus", {"query": query})
        assert response.status_code == 200, (query, response.text[:300])
        assert response.json()["result"]["query"] == query


def test_empty_input(server: HttpServer) -> None:
    listing = bridge(server, "list_documents", {})
    assert listing.status_code == 200 and listing.json()["result"]["total"] > 0
    no_query = bridge(server, "search_corpus", {})
    details = bridge_failure(no_query, 400, "TOOL_EXECUTION_ERROR")
    assert details["code"] == "invalid_argument" and "query" in no_query.json()["error"]["message"]


def test_concurrent_searches_from_eight_clients_are_all_answered(server: HttpServer) -> None:
    """100 searches from 8 clients at once (distinct queries, so nothing is answered from a
    cache): every one answered 200 with its own query, none lost or mixed up."""
    queries = [f"incident review number {n} escalation" for n in range(100)]

    def client_run(share: list[str]) -> list[tuple[str, int, str]]:
        answers = []
        with httpx.Client(base_url=server.base, timeout=120) as client:
            for query in share:
                response = client.post("/mcp/call", json={"server": "local-rag", "toolName": "search_corpus",
                                                          "input": {"query": query}})
                answers.append((query, response.status_code, response.json().get("result", {}).get("query")))
        return answers

    with ThreadPoolExecutor(8) as pool:
        answers = [a for share in pool.map(client_run, [queries[i::8] for i in range(8)]) for a in share]
    assert len(answers) == 100
    assert all(status == 200 and echoed == sent for sent, status, echoed in answers), answers[:5]


# ---------------------------------------------------------------------------
# Slow, stuck and absent dependencies.


@pytest.fixture()
def slow_fake() -> Iterator[FakeOllama]:
    with FakeOllama() as instance:
        yield instance


def test_timeout_is_504_and_the_next_call_is_served(built: Built, slow_fake: FakeOllama) -> None:
    with http_server(built.server_env(slow_fake.host, RAG_TOOL_TIMEOUT="1", RAG_EMBED_TIMEOUT="30")) as running:
        # The warm-up opens the store meanwhile (seconds on a loaded machine): the 1 s budget is
        # for the calls, not for the server's start.
        wait_for_logged(running.stderr_lines, "warm-up: done")
        slow_fake.configure(delay_seconds=4)
        timed_out = bridge(running, "search_corpus", {"query": "a query nobody asked before", "mode": "vector"})
        details = bridge_failure(timed_out, 504, "TIMEOUT_ERROR")
        assert details == {"toolName": "search_corpus", "server": "local-rag", "timeout": 1000}
        served = bridge(running, "search_corpus", {"query": "sev-1", "mode": "keyword"})
        assert served.status_code == 200 and served.json()["result"]["results"]
        assert httpx.get(f"{running.base}/health").status_code == 200


def test_a_slow_embedder_blocks_neither_health_nor_keyword_search_nor_get_file(built: Built,
                                                                                slow_fake: FakeOllama) -> None:
    with http_server(built.server_env(slow_fake.host, RAG_EMBED_TIMEOUT="60")) as running:
        slow_fake.configure(delay_seconds=8)
        finished: list[str] = []

        def slow_search() -> None:
            response = bridge(running, "search_corpus", {"query": "an embedding that takes ages", "mode": "vector"})
            assert response.status_code == 200, response.text
            finished.append("vector search")

        worker = threading.Thread(target=slow_search)
        worker.start()
        deadline = time.monotonic() + 30
        while slow_fake.calls()["embed_calls"] == 0:  # the vector search is waiting on the embedder
            assert time.monotonic() < deadline
            time.sleep(0.02)
        quick = [httpx.get(f"{running.base}/health", timeout=60),
                 bridge(running, "search_corpus", {"query": "sev-1 escalation", "mode": "keyword"}),
                 bridge(running, "get_file", {"path": "oncall/escalation.md", "end_line": 5}),
                 bridge(running, "list_documents", {})]
        finished.append("quick calls")
        worker.join(timeout=60)
        assert all(r.status_code == 200 for r in quick), [r.text[:200] for r in quick]
        assert finished == ["quick calls", "vector search"]


def test_embedder_down_degrades_health_and_hybrid_but_keyword_works(built: Built) -> None:
    host = dead_ollama()
    with http_server(built.server_env(host)) as running:
        deadline = time.monotonic() + 30
        while (health := httpx.get(f"{running.base}/health")).json()["embedder"] == "not probed yet":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        body = health.json()
        assert health.status_code == 200 and body["status"] == "degraded", body
        assert body["servers"] == {"local-rag": "available"} and body["embedder"] == "unavailable"
        assert [p["part"] for p in body["problems"]] == ["embedder"]
        assert body["problems"][0]["code"] == "embedder_unavailable"

        hybrid = bridge(running, "search_corpus", {"query": "sev-1 escalation"})
        assert hybrid.status_code == 200, hybrid.text
        assert hybrid.json()["result"]["degraded"] == "embedder_unavailable" and hybrid.json()["result"]["results"]
        vector = bridge(running, "search_corpus", {"query": "sev-1 escalation", "mode": "vector"})
        details = bridge_failure(vector, 503, "TOOL_EXECUTION_ERROR")
        assert details["code"] == "embedder_unavailable" and vector.headers["retry-after"]
        for response in (health, hybrid, vector):
            no_paths_or_hosts(response.text, host, host.split("//")[1], str(built.store))


def test_missing_index_is_unavailable_in_health_and_503_on_calls(tmp_path: Path, fake: FakeOllama) -> None:
    with http_server({"RAG_STORE_DIR": str(tmp_path / "never-built"), "OLLAMA_HOST": fake.host,
                      "RAG_CORPUS_DIR": str(tmp_path)}) as running:
        health = httpx.get(f"{running.base}/health")
        body = health.json()
        assert health.status_code == 503, health.status_code
        assert body["status"] == "degraded" and body["servers"] == {"local-rag": "unavailable"}, body
        assert "index" in [p["part"] for p in body["problems"]]
        response = bridge(running, "search_corpus", {"query": "anything"})
        assert bridge_failure(response, 503, "TOOL_EXECUTION_ERROR")["code"] == "index_missing"
        no_paths_or_hosts(response.text + json.dumps(body), str(tmp_path))
    assert not (tmp_path / "never-built").exists()


def test_calls_in_flight_are_bounded_with_retry_after(built: Built, slow_fake: FakeOllama) -> None:
    with http_server(built.server_env(slow_fake.host, RAG_HTTP_MAX_IN_FLIGHT="2", RAG_EMBED_TIMEOUT="60")) as running:
        slow_fake.configure(delay_seconds=5)
        with ThreadPoolExecutor(2) as pool:
            slow = [pool.submit(bridge, running, "search_corpus", {"query": f"slow query {n}", "mode": "vector"})
                    for n in range(2)]
            deadline = time.monotonic() + 30
            while slow_fake.calls()["embed_calls"] < 2:  # both calls are in flight, waiting on the embedder
                assert time.monotonic() < deadline and not any(f.done() for f in slow), [f.done() for f in slow]
                time.sleep(0.02)
            refused = bridge(running, "search_corpus", {"query": "one slow query too many", "mode": "vector"})
            assert bridge_failure(refused, 503, "TOO_BUSY")["max"] == 2
            assert refused.headers["retry-after"] == "1"
            assert httpx.get(f"{running.base}/health").status_code == 200  # never counted, never refused
            assert all(f.result(timeout=60).status_code == 200 for f in slow)
        assert bridge(running, "list_documents", {}).status_code == 200


def test_a_client_that_disconnects_mid_call_does_not_wedge_the_server(built: Built, slow_fake: FakeOllama) -> None:
    with http_server(built.server_env(slow_fake.host, RAG_HTTP_MAX_IN_FLIGHT="1", RAG_EMBED_TIMEOUT="60")) as running:
        slow_fake.configure(delay_seconds=3)
        host, port = running.base.removeprefix("http://").rsplit(":", 1)
        body = json.dumps({"server": "local-rag", "toolName": "search_corpus",
                           "input": {"query": "walked away", "mode": "vector"}}).encode()
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(b"POST /mcp/call HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            time.sleep(0.5)  # the call is in flight; now hang up
        deadline = time.monotonic() + 60
        while (after := bridge(running, "search_corpus", {"query": "sev-1", "mode": "vector"})).status_code == 503:
            assert time.monotonic() < deadline, "the abandoned call's slot was never freed"
            time.sleep(0.1)
        assert after.status_code == 200
        slow_fake.configure(delay_seconds=0)
        assert bridge(running, "search_corpus", {"query": "sev-1", "mode": "vector"}).status_code == 200


# ---------------------------------------------------------------------------
# The real Claude Code CLI, when npm can install it.

CLAUDE_CODE = "@anthropic-ai/claude-code@2.1.197"


@pytest.fixture(scope="module")
def claude(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("npm") is None or shutil.which("node") is None:
        pytest.skip("node/npm are not installed: the Claude Code CLI cannot run here")
    prefix = tmp_path_factory.mktemp("claude-code")
    done = subprocess.run(["npm", "install", "--prefix", str(prefix), "--no-audit", "--no-fund", "--prefer-offline",
                           CLAUDE_CODE], capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    binary = prefix / "node_modules" / ".bin" / "claude"
    if done.returncode != 0 or not binary.exists():
        pytest.skip(f"npm could not install {CLAUDE_CODE}: {done.stderr.strip()[-300:]}")
    return binary


def test_claude_code_registers_and_connects_over_http(claude: Path, built: Built, fake: FakeOllama,
                                                      tmp_path: Path) -> None:
    env = {**os.environ, "HOME": str(tmp_path), "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
           "DISABLE_AUTOUPDATER": "1", "MCP_TIMEOUT": "20000"}
    env.pop("ANTHROPIC_API_KEY", None)

    def run_claude(*args: str) -> subprocess.CompletedProcess[str]:
        proc = subprocess.Popen([str(claude), *args], cwd=tmp_path, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    with http_server(built.server_env(fake.host)) as running:
        added = run_claude("mcp", "add", "--transport", "http", "-s", "user", "local-rag", running.mcp_url)
        assert added.returncode == 0, added.stderr
        listed = run_claude("mcp", "list")
        assert f"local-rag: {running.mcp_url} (HTTP) - ✔ Connected" in listed.stdout, (listed.stdout, listed.stderr)
    with http_server(built.server_env(fake.host, RAG_HTTP_TOKEN=TOKEN)) as guarded:
        run_claude("mcp", "remove", "-s", "user", "local-rag")
        refused = run_claude("mcp", "add", "--transport", "http", "-s", "user", "local-rag", guarded.mcp_url)
        assert refused.returncode == 0, refused.stderr
        assert "Connected" not in run_claude("mcp", "list").stdout.replace("Not connected", "")
        run_claude("mcp", "remove", "-s", "user", "local-rag")
        added = run_claude("mcp", "add", "--transport", "http", "-s", "user", "local-rag", guarded.mcp_url,
                           "--header", f"Authorization: Bearer {TOKEN}")
        assert added.returncode == 0, added.stderr
        listed = run_claude("mcp", "list")
        assert f"local-rag: {guarded.mcp_url} (HTTP) - ✔ Connected" in listed.stdout, (listed.stdout, listed.stderr)


def test_a_crash_is_internal_error_without_a_stack_trace(built: Built, fake: FakeOllama,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug cannot be provoked from outside a hardened server, so this one is planted in-process:
    the app that `server.py --http` serves, with a search that raises, over httpx's ASGI transport."""
    import server as server_module
    from corpus_rules import load_settings

    for key, value in built.server_env(fake.host).items():
        monkeypatch.setenv(key, value)
    service = server_module.RetrievalService()

    def broken_search(self: Any, args: Any) -> Any:
        raise ZeroDivisionError(f"planted bug near {built.store}")

    monkeypatch.setattr(server_module.RetrievalService, "search", broken_search)
    settings = load_settings()
    app = server_module.http_app(service, settings, "", server_module.WarmUp(service),
                                 server_module.HealthProbe(service))

    async def ask() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8765") as client:
            return await client.post("/mcp/call", json={"server": "local-rag", "toolName": "search_corpus",
                                                        "input": {"query": "anything"}})

    try:
        response = anyio.run(ask)
    finally:
        service.close(timeout=10)
    details = bridge_failure(response, 500, "INTERNAL_ERROR")
    assert details == {"toolName": "search_corpus", "server": "local-rag"}
    no_paths_or_hosts(response.text, str(built.store), "ZeroDivisionError", "planted")
