"""The real MCP Inspector CLI (the protocol's reference TypeScript client) against the real
`python server.py`, when node and npm are on the machine.

TypeScript-SDK clients check a result's structuredContent against the tool's outputSchema even
when isError is true; the Python SDK does not, so only a TypeScript client can show that every
error is readable. Two Inspector generations are driven: 0.15 (the newest that declares no
engine requirement; 0.16+ want node 22 but run on 20) and 2.x. npx fetches each once from the
npm registry into its cache; without node/npm, or without registry access, the test skips and
says why.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from fake_ollama import FakeOllama
from helpers import copy_sample, run_ingest

import corpus_rules as rules

pytestmark = [pytest.mark.heavy, pytest.mark.process]  # a file over a minute of real processes: `pytest --all` only, scheduled first

ROOT = Path(__file__).resolve().parent.parent
SERVER = ROOT / "server.py"
INSPECTORS = ("0.15.0", "2.12.0")
NETWORK_FAILURES = ("ENOTFOUND", "ENOTCACHED", "EAI_AGAIN", "ETIMEDOUT", "ECONNREFUSED", "ECONNRESET",
                    "network", "Could not resolve")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path, str]]:
    if shutil.which("npx") is None or shutil.which("node") is None:
        pytest.skip("node/npx are not installed: the MCP Inspector cannot run here")
    tmp = tmp_path_factory.mktemp("inspector")
    with FakeOllama() as fake:
        corpus, store = copy_sample(tmp), tmp / "store"
        done = run_ingest(fake, corpus, store)
        assert done.code == 0, done.err
        yield corpus, store, fake.host


def inspector(version: str, env: dict[str, str], method: str, *extra: str, url: str | None = None) -> dict[str, Any]:
    """One request through `npx @modelcontextprotocol/inspector@VERSION --cli --method METHOD`, to
    a `python server.py` it starts over stdio, or to the HTTP server at `url`; the parsed result it
    prints. Tool errors exit 0 (0.x) or 5 (2.x) with the result on stdout; a protocol or schema
    failure exits 1 with the message on stderr (that is the bug this guards against)."""
    command = ["npx", "--prefer-offline", "-y", f"@modelcontextprotocol/inspector@{version}", "--cli"]
    if url is None:
        for key, value in env.items():  # 2.x does not pass its own environment on to the server
            command += ["-e", f"{key}={value}"]
        command += [sys.executable, str(SERVER)]
    else:
        command += [url, "--transport", "http"]
    command += ["--method", method, *extra]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
                          env={**os.environ, **env, "npm_config_update_notifier": "false"})
    if done.returncode not in (0, 5) and any(word in done.stderr for word in NETWORK_FAILURES):
        pytest.skip(f"the npm registry is out of reach, so Inspector {version} cannot be fetched: "
                    f"{done.stderr.strip()[-300:]}")
    assert done.returncode in (0, 5), f"Inspector {version} failed (exit {done.returncode}):\n{done.stderr[-2000:]}"
    return json.loads(done.stdout)


def call(version: str, env: dict[str, str], tool: str, **args: Any) -> dict[str, Any]:
    """One tools/call; the parsed CallToolResult."""
    extra = ["--tool-name", tool]
    for key, value in args.items():
        extra += ["--tool-arg", f"{key}={value}"]
    return inspector(version, env, "tools/call", *extra)


def error_of(result: dict[str, Any]) -> dict[str, str]:
    assert result.get("isError") is True, result
    assert "structuredContent" not in result, result
    return json.loads(result["content"][0]["text"])["error"]


@pytest.mark.parametrize("version", INSPECTORS)
def test_results_and_errors_are_readable_in_the_inspector(built: tuple[Path, Path, str], version: str,
                                                           tmp_path: Path) -> None:
    corpus, store, host = built
    env = {"RAG_CORPUS_DIR": str(corpus), "RAG_STORE_DIR": str(store), "OLLAMA_HOST": host,
           "ANONYMIZED_TELEMETRY": "False", "RAG_SERVER_WARMUP": "0"}
    found = call(version, env, "search_corpus", query="who gets paged for a sev-1", mode="keyword")
    assert not found.get("isError") and found["structuredContent"]["results"][0]["path"] == "oncall/escalation.md"
    lines = call(version, env, "get_file", path="runbooks/deploy.md", start_line=1, end_line=3)
    assert lines["structuredContent"]["end_line"] == 3
    # Inspector 0.16+ sends any value that parses as JSON as that JSON value: a number for a query.
    numeric = call(version, env, "search_corpus", query="2048", mode="keyword")
    assert not numeric.get("isError") and numeric["structuredContent"]["query"] == "2048"
    listed = call(version, env, "list_documents")
    assert listed["structuredContent"]["total"] == 6
    for tool, args, code in [
        ("search_corpus", {"query": "rollback", "k": 0}, "invalid_argument"),
        ("search_corpus", {"query": " "}, "invalid_argument"),
        ("get_file", {"path": "../../etc/passwd"}, "path_rejected"),
        ("get_file", {"path": "private/offsite-backup.md"}, "not_indexed"),
    ]:
        error = error_of(call(version, env, tool, **args))
        assert error["code"] == code and error["message"] and error["hint"], (tool, args, error)
    missing = {**env, "RAG_STORE_DIR": str(tmp_path / "no-store")}
    error = error_of(call(version, missing, "search_corpus", query="rollback"))
    assert error["code"] == "index_missing" and rules.INGEST_COMMAND in error["hint"]
    # Inspector 0.15 sends an array argument as its JSON text, 2.x as the array: both are read alike.
    phrased = call(version, env, "search_corpus", query="rollback", mode="keyword",
                   queries='["roll back a release"]')
    assert not phrased.get("isError") and phrased["structuredContent"]["results"], phrased


@contextmanager
def http_server(env: dict[str, str]) -> Iterator[str]:
    """`python server.py --http` on a free loopback port; its /mcp URL."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen([sys.executable, str(SERVER), "--http", "--port", str(port)], env={**os.environ, **env},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while socket.socket().connect_ex(("127.0.0.1", port)) != 0:
            assert proc.poll() is None and time.monotonic() < deadline, "the HTTP server did not start"
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.parametrize("version", INSPECTORS)
@pytest.mark.parametrize("transport", ["stdio", "http"])
def test_documents_are_resources_in_the_inspector(built: tuple[Path, Path, str], version: str, transport: str) -> None:
    corpus, store, host = built
    env = {"RAG_CORPUS_DIR": str(corpus), "RAG_STORE_DIR": str(store), "OLLAMA_HOST": host,
           "ANONYMIZED_TELEMETRY": "False", "RAG_SERVER_WARMUP": "0"}
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(http_server(env)) if transport == "http" else None
        check_resources(version, env, corpus, url)


def check_resources(version: str, env: dict[str, str], corpus: Path, url: str | None) -> None:
    def ask(method: str, *extra: str) -> dict[str, Any]:
        return inspector(version, env, method, *extra, url=url)

    listed = ask("resources/list")
    by_name = {r["name"]: r for r in listed["resources"]}
    assert len(by_name) == 6 and "private/offsite-backup.md" not in by_name
    deploy = by_name["runbooks/deploy.md"]
    assert deploy["mimeType"] == "text/markdown" and deploy["annotations"]["lastModified"]
    read = ask("resources/read", "--uri", deploy["uri"] + "?start_line=1&end_line=3")
    (contents,) = read["contents"]
    assert contents["text"].splitlines() == (corpus / "runbooks/deploy.md").read_text().splitlines()[:3]
    templates = ask("resources/templates/list")
    assert [t["uriTemplate"] for t in templates["resourceTemplates"]] == [
        "local-rag://doc/{+path}{?start_line,end_line,start_page,end_page}"]
