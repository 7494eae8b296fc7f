"""End-to-end: the real `python server.py` over stdio, against indexes built by the real
`python ingest.py` from sample-corpus through the loopback fake Ollama (running in this process).

Most tests talk through the MCP SDK's own client (`mcp.Client` with `StdioServerParameters`);
the stdout-purity and import tests speak raw JSON-RPC lines to a process they spawn themselves.
No timing assertions anywhere.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import anyio
import pytest
from fake_ollama import FakeOllama
from helpers import (
    SERVER,
    Built,
    RawServer,
    build,
    connect,
    ingest_index,
    sample_built,
    server_env,
    tool,
    tool_payload,
    vectors_loaded,
    without_echoed_identifier,
)
from mcp import Client
from mcp.shared.exceptions import MCPError
from mcp.types import INVALID_PARAMS, ResourceTemplateReference

import corpus_rules as rules
import server
from corpus_rules import StoreLayout

pytestmark = [pytest.mark.heavy, pytest.mark.process]  # a file over a minute of real processes: `pytest --all` only, scheduled first

TOKEN = "SECRET-OFFSITE-TOKEN-7731"
T = TypeVar("T")


# ---------------------------------------------------------------------------
# Building indexes and starting servers.


@pytest.fixture(scope="module")
def built(fake: FakeOllama, indexed_sample: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Built:
    return sample_built(indexed_sample, tmp_path_factory.mktemp("e2e"), fake.host)


def run(fn: Callable[[], Awaitable[T]]) -> T:
    return anyio.run(fn)


async def error_code(client: Client, name: str, **args: Any) -> str:
    is_error, payload = await tool(client, name, **args)
    assert is_error, payload
    return str(payload["error"]["code"])


# ---------------------------------------------------------------------------
# Retrieval over stdio.


def test_sev1_question_finds_the_on_call_doc_first(built: Built, fake: FakeOllama) -> None:
    async def scenario() -> None:
        async with connect(built.server_env(fake.host), mode="legacy") as client:
            assert client.instructions and "search_corpus" in client.instructions[:512]
            listed = {t.name: t for t in (await client.list_tools()).tools}
            assert set(listed) == {"search_corpus", "get_file", "list_documents"}
            for definition in listed.values():
                assert definition.annotations and definition.annotations.read_only_hint is True
                assert definition.output_schema is not None
            await vectors_loaded(client)  # a search right after the handshake answers from keywords
            is_error, payload = await tool(client, "search_corpus", query="who gets paged for a sev-1")
            assert not is_error
            top = payload["results"][0]
            assert top["path"] == "oncall/escalation.md"
            assert top["heading"] == "On-call escalation policy > Who gets paged for a sev-1"
            assert 1 <= top["start_line"] <= top["end_line"]
            assert top["lifecycle"] == "active" and 0 < top["score"] <= 1
            assert payload["index"]["model"] == "embeddinggemma" and payload["index"]["generation"] == 1
            assert payload["staleness"]["changed_files"] == 0
            is_error, lines = await tool(client, "get_file", path=top["path"], start_line=top["start_line"],
                                         end_line=top["end_line"])
            assert not is_error and lines["text"].startswith("## Who gets paged for a sev-1")
            assert "Platform Primary rotation" in lines["text"]

    run(scenario)


def test_superseded_runbook_only_with_include_superseded(built: Built, fake: FakeOllama) -> None:
    async def scenario() -> None:
        async with connect(built.server_env(fake.host)) as client:
            query = "kubectl-deploy push --all-at-once"
            for mode in ("hybrid", "vector", "keyword"):
                _, default = await tool(client, "search_corpus", query=query, k=20, mode=mode)
                assert all(hit["path"] != "runbooks/deploy-2023.md" for hit in default["results"]), mode
                _, included = await tool(client, "search_corpus", query=query, k=20, mode=mode,
                                         include_superseded=True)
                old = [hit for hit in included["results"] if hit["path"] == "runbooks/deploy-2023.md"]
                assert old and all(hit["lifecycle"] == "superseded" for hit in old), mode
                assert all(hit["superseded_by"] == ["runbooks/deploy.md"] for hit in old), mode
            _, listed = await tool(client, "list_documents")
            entry = {d["path"]: d for d in listed["documents"]}["runbooks/deploy-2023.md"]
            assert (entry["lifecycle"], entry["superseded_by"]) == ("superseded", ["runbooks/deploy.md"])

    run(scenario)


def test_a_thin_search_says_why_over_stdio(built: Built, fake: FakeOllama) -> None:
    """What the model is shown (structured content only, in Claude Code) says why a search is thin."""
    async def scenario() -> None:
        async with connect(built.server_env(fake.host)) as client:
            await vectors_loaded(client)  # the confidence of a hybrid search, not of its keyword channel
            _, hidden = await tool(client, "search_corpus", query="kubectl-deploy push --all-at-once")
            assert hidden["confidence"] == "low" and "pass include_superseded=true" in hidden["message"]
            assert hidden["message"].endswith("replaced by 'runbooks/deploy.md'")
            _, typo = await tool(client, "search_corpus", query="rollback", path_prefix="runbook")
            assert typo["results"] == [] and "nearest indexed folders: 'runbooks'" in typo["message"]
            _, private = await tool(client, "search_corpus", query="offsite backup", path_prefix="privat")
            assert "rivate" not in private["message"].split("nearest indexed folders: ")[1]

    run(scenario)


def test_rag_false_token_is_never_returned_by_any_tool(built: Built, fake: FakeOllama) -> None:
    async def scenario() -> None:
        async with connect(built.server_env(fake.host)) as client:
            outputs: list[Any] = []
            for mode in ("hybrid", "vector", "keyword"):
                for query in (TOKEN, "offsite backup restore credentials escrow", "SECRET OFFSITE TOKEN 7731"):
                    _, payload = await tool(client, "search_corpus", query=query, mode=mode, k=20,
                                            include_superseded=True)
                    payload.pop("query")  # the caller's own words echoed back
                    outputs.append(without_echoed_identifier(payload, TOKEN))
            _, listed = await tool(client, "list_documents", limit=500)
            outputs.append(listed)
            for document in listed["documents"]:
                outputs.append((await tool(client, "get_file", path=document["path"]))[1])
            assert await error_code(client, "get_file", path="private/offsite-backup.md") == "not_indexed"
            dumped = json.dumps(outputs, ensure_ascii=False)
            assert TOKEN not in dumped and "offsite-backup" not in dumped

    run(scenario)


def test_identifier_in_one_chunk_is_found_by_hybrid_though_vectors_miss_it(fake: FakeOllama, tmp_path: Path) -> None:
    """60 distractor pages share the query's words; one page mentions the error code once, among
    unrelated words. The vector channel ranks it outside its candidates; keywords rank it first."""
    source = tmp_path / "source"
    (source / "noise").mkdir(parents=True)
    for i in range(60):
        (source / "noise" / f"page-{i:02d}.md").write_text(
            f"# Deploy pipeline failure {i}\n\nWhen the deploy pipeline rollout fails with an error, check "
            f"what the error means, retry the rollout, and read the pipeline logs. Step {i} of the guide.\n",
            encoding="utf-8")
    (source / "codes.md").write_text(
        "# Kitchen inventory\n\nApples, pears and a teapot. Code QZX-7781 marks the blue teapot shelf.\n",
        encoding="utf-8")
    index = build(tmp_path, fake.host, source, symlinks=False)
    query = "what does error QZX-7781 mean when the deploy pipeline rollout fails"

    async def scenario() -> None:
        async with connect(index.server_env(fake.host)) as client:
            _, vector = await tool(client, "search_corpus", query=query, k=20, mode="vector")
            assert "codes.md" not in [hit["path"] for hit in vector["results"]]
            _, hybrid = await tool(client, "search_corpus", query=query, k=5)
            hits = {hit["path"]: hit for hit in hybrid["results"]}
            assert "codes.md" in hits and hits["codes.md"]["matched"] == ["keyword"]
            assert isinstance(hits["codes.md"]["score"], float)  # cosine from the stored embedding
            _, keyword = await tool(client, "search_corpus", query="QZX-7781", mode="keyword")
            assert keyword["results"][0]["path"] == "codes.md"

    run(scenario)


def test_japanese_keyword_query_finds_the_japanese_doc(built: Built, fake: FakeOllama) -> None:
    async def scenario() -> None:
        async with connect(built.server_env(fake.host)) as client:
            for query in ("ログの保持期間", "送信先", "シッパー"):
                for mode in ("keyword", "hybrid"):
                    is_error, payload = await tool(client, "search_corpus", query=query, mode=mode)
                    assert not is_error and payload["results"][0]["path"] == "ja/log-collection.md", (query, mode)
            _, payload = await tool(client, "search_corpus", query="LOG_SHIPPER_ENDPOINT", mode="keyword")
            assert payload["results"][0]["path"] == "ja/log-collection.md"

    run(scenario)


def test_fts5_syntax_in_queries_is_plain_text(built: Built, fake: FakeOllama) -> None:
    async def scenario() -> None:
        async with connect(built.server_env(fake.host)) as client:
            for query in ('"deployctl', "deploy*", "NEAR(rollback deploy", "-rollback", "title:Deploy",
                          "body:x heading:y", 'rollback" OR "x', "AND", "(((", "E4091 NOT E4010"):
                for mode in ("keyword", "hybrid"):
                    is_error, payload = await tool(client, "search_corpus", query=query, mode=mode)
                    assert not is_error, (query, mode, payload)
            _, payload = await tool(client, "search_corpus", query='"E4091"*', mode="keyword")
            assert payload["results"][0]["path"] == "reference/api.md"

    run(scenario)


def test_reingest_is_seen_without_restarting_the_server(fake: FakeOllama, sample_index: tuple[Path, Path]) -> None:
    index = Built(*sample_index, fake.host)
    query = "ZEBRA-QUOKKA-4411 failover drill schedule"

    async def scenario() -> None:
        async with connect(index.server_env(fake.host)) as client:
            _, before = await tool(client, "search_corpus", query=query)
            assert "oncall/drill.md" not in [hit["path"] for hit in before["results"]]
            (index.corpus / "oncall" / "drill.md").write_text(
                "# Failover drill\n\nThe ZEBRA-QUOKKA-4411 failover drill schedule: every quarter, first Tuesday.\n",
                encoding="utf-8")
            done = await anyio.to_thread.run_sync(ingest_index, index.corpus, index.store, fake.host)
            assert done.returncode == 0, done.stderr
            for mode in ("hybrid", "vector", "keyword"):
                _, after = await tool(client, "search_corpus", query=query, mode=mode)
                assert after["results"][0]["path"] == "oncall/drill.md", mode
            assert after["index"]["generation"] == 2
            _, listed = await tool(client, "list_documents")
            assert "oncall/drill.md" in [d["path"] for d in listed["documents"]]

    run(scenario)


# ---------------------------------------------------------------------------
# Every error code from a real situation.


def test_embedder_down_is_embedder_unavailable(built: Built) -> None:
    down = FakeOllama().start()
    host = down.host
    down.stop()

    async def scenario() -> None:
        async with connect(built.server_env(host)) as client:
            is_error, payload = await tool(client, "search_corpus", query="who gets paged for a sev-1", mode="vector")
            assert is_error and payload["error"]["code"] == "embedder_unavailable"
            assert host in payload["error"]["message"] and "ollama" in payload["error"]["hint"].lower()
            is_error, payload = await tool(client, "search_corpus", query="who gets paged for a sev-1")
            assert not is_error and payload["degraded"] == "embedder_unavailable"
            assert payload["results"][0]["path"] == "oncall/escalation.md" and "start Ollama" in payload["hint"]
            is_error, payload = await tool(client, "search_corpus", query="sev-1 page", mode="keyword")
            assert not is_error and payload["results"][0]["path"] == "oncall/escalation.md"

    run(scenario)


def test_missing_model_is_model_not_found(built: Built) -> None:
    with FakeOllama() as other:
        other.configure(missing_models=["embeddinggemma"])

        async def scenario() -> None:
            async with connect(built.server_env(other.host)) as client:
                is_error, payload = await tool(client, "search_corpus", query="rollback", mode="vector")
                assert is_error and payload["error"]["code"] == "model_not_found"
                assert "ollama pull embeddinggemma" in payload["error"]["hint"]
                is_error, payload = await tool(client, "search_corpus", query="rollback")
                assert not is_error and payload["degraded"] == "model_not_found" and payload["results"]

        run(scenario)


def test_model_mismatch_and_wrong_dims_are_index_incompatible(built: Built, fake: FakeOllama) -> None:
    async def mismatch() -> None:
        async with connect(built.server_env(fake.host, RAG_EMBED_MODEL="nomic-embed-text")) as client:
            assert await error_code(client, "search_corpus", query="rollback") == "index_incompatible"

    run(mismatch)
    with FakeOllama() as other:
        other.configure(wrong_dims=256)

        async def dims() -> None:
            async with connect(built.server_env(other.host)) as client:
                is_error, payload = await tool(client, "search_corpus", query="rollback", mode="vector")
                assert is_error and payload["error"]["code"] == "index_incompatible"
                assert "256" in payload["error"]["message"]
                is_error, payload = await tool(client, "search_corpus", query="rollback")  # hybrid: keywords
                assert not is_error and payload["degraded"] == "index_incompatible" and payload["results"]

        run(dims)


def test_missing_store_is_index_missing_and_never_created(built: Built, fake: FakeOllama, tmp_path: Path) -> None:
    store = tmp_path / "nowhere" / "store"
    env = server_env(store, built.corpus, fake.host)

    async def scenario() -> None:
        async with connect(env) as client:
            for mode in ("hybrid", "vector", "keyword"):
                assert await error_code(client, "search_corpus", query="rollback", mode=mode) == "index_missing"
            assert await error_code(client, "get_file", path="oncall/escalation.md") == "index_missing"
            is_error, payload = await tool(client, "list_documents")
            assert is_error and payload["error"]["code"] == "index_missing"
            assert str(store) in payload["error"]["message"] and rules.INGEST_COMMAND in payload["error"]["hint"]

    run(scenario)
    assert not store.exists() and not store.parent.exists()


def test_symlink_swap_is_path_rejected(fake: FakeOllama, sample_index: tuple[Path, Path]) -> None:
    index = Built(*sample_index, fake.host)
    target = index.corpus / "oncall" / "escalation.md"
    target.unlink()
    target.symlink_to("/etc/passwd")
    (index.corpus / "runbooks" / "deploy.md").unlink()
    (index.corpus / "runbooks" / "deploy.md").symlink_to(index.corpus / "reference" / "api.md")

    async def scenario() -> None:
        async with connect(index.server_env(fake.host)) as client:
            for path in ("oncall/escalation.md", "runbooks/deploy.md"):
                is_error, payload = await tool(client, "get_file", path=path)
                assert is_error and payload["error"]["code"] == "path_rejected", payload
                assert "root:" not in json.dumps(payload)
            assert not (await tool(client, "get_file", path="reference/api.md"))[0]

    run(scenario)


def test_bad_arguments_unknown_paths_and_a_corrupt_index(built: Built, fake: FakeOllama, tmp_path: Path) -> None:
    async def scenario() -> None:
        async with connect(built.server_env(fake.host)) as client:
            assert await error_code(client, "search_corpus", query="") == "invalid_argument"
            assert await error_code(client, "search_corpus", query="q", k=99) == "invalid_argument"
            assert await error_code(client, "search_corpus", query="q", unknown_key=1) == "invalid_argument"
            assert await error_code(client, "list_documents", limit="many") == "invalid_argument"
            assert await error_code(client, "get_file", path="../../etc/passwd") == "path_rejected"
            assert await error_code(client, "get_file", path="oncall/missing.md") == "not_indexed"
            assert not (await tool(client, "list_documents"))[0], "the server is still up"

    run(scenario)
    corrupt = Built(built.corpus, tmp_path / "store", built.host)
    shutil.copytree(built.store, corrupt.store)
    (corrupt.index_dir / "keywords.sqlite3").write_bytes(b"garbage" * 1000)

    async def broken() -> None:
        async with connect(corrupt.server_env(fake.host)) as client:
            is_error, payload = await tool(client, "list_documents")
            assert is_error and payload["error"]["code"] == "internal" and "ingest.py" in payload["error"]["hint"]

    run(broken)


# ---------------------------------------------------------------------------
# Raw JSON-RPC: stdout purity and a handshake without the heavy imports.


def test_stdout_is_pure_jsonrpc_including_error_paths(built: Built, fake: FakeOllama) -> None:
    down = FakeOllama().start()
    down_host = down.host
    down.stop()
    raw = RawServer(built.server_env(fake.host))
    try:
        assert raw.handshake() == ["search_corpus", "get_file", "list_documents"]
        is_error, ok = tool_payload("search_corpus", raw.call("search_corpus", {"query": "who gets paged for a sev-1"}))
        assert not is_error and ok["results"][0]["path"] == "oncall/escalation.md"
        for name, arguments, code in [
            ("search_corpus", {"query": "q", "k": 0}, "invalid_argument"),
            ("search_corpus", {"query": "q", "surprise": True}, "invalid_argument"),
            ("get_file", {"path": "../../etc/passwd"}, "path_rejected"),
            ("get_file", {"path": "private/offsite-backup.md"}, "not_indexed"),
        ]:
            is_error, payload = tool_payload(name, raw.call(name, arguments))
            assert is_error and payload["error"]["code"] == code
        unknown = raw.request("tools/call", {"name": "nope", "arguments": {}})["error"]  # a protocol error
        assert unknown["code"] == -32602 and unknown["data"]["error"]["code"] == "invalid_argument"
        assert not raw.call("get_file", {"path": "reference/api.md"})["isError"]
        assert not raw.call("list_documents", {})["isError"]
        raw.send(b"this is not json\n")
        assert raw.request("tools/list")["result"]["tools"], "still serving after a malformed line"
    finally:
        assert raw.close() == 0
    # A second server whose embedder is down: the failure path through Ollama's client.
    raw_down = RawServer(built.server_env(down_host))
    try:
        raw_down.handshake()
        is_error, payload = tool_payload("search_corpus", raw_down.call("search_corpus", {"query": "rollback",
                                                                                      "mode": "vector"}))
        assert is_error and payload["error"]["code"] == "embedder_unavailable"
    finally:
        raw_down.close()
    for spoken in (raw, raw_down):
        assert spoken.stdout_lines
        for line in spoken.stdout_lines:
            message = json.loads(line)
            assert isinstance(message, dict) and message.get("jsonrpc") == "2.0", line


def test_only_pipes_and_sockets_are_served_on_the_event_loop(tmp_path: Path) -> None:
    """The pipe transport polls stdin and stdout: a pipe or a socket. A regular file cannot be
    polled, and a terminal is shared with the shell (the loop would make it non-blocking)."""
    import pty
    import socket

    import server

    read_end, write_end = os.pipe()
    left, right = socket.socketpair()
    main, secondary = pty.openpty()
    regular = os.open(tmp_path / "requests.jsonl", os.O_CREAT | os.O_RDWR)
    try:
        assert server._pollable(read_end) and server._pollable(write_end) and server._pollable(left.fileno())
        assert not server._pollable(regular) and not server._pollable(secondary)
    finally:
        for fd in (read_end, write_end, main, secondary, regular):
            os.close(fd)
        left.close()
        right.close()


def test_a_regular_file_as_stdin_is_served_by_the_sdks_transport(built: Built, fake: FakeOllama,
                                                                  tmp_path: Path) -> None:
    requests = tmp_path / "requests.jsonl"
    requests.write_text(json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "file", "version": "0"}}}) + "\n",
        encoding="utf-8")
    with requests.open("rb") as stdin:
        done = subprocess.run([sys.executable, str(SERVER)], stdin=stdin, capture_output=True, timeout=120,
                              env={**os.environ, **built.server_env(fake.host)})
    assert done.returncode == 0, done.stderr[-2000:]
    (line,) = done.stdout.splitlines()
    assert json.loads(line)["result"]["serverInfo"]["name"] == "local-rag"


def _imports_of(lines: list[str], package: str) -> list[int]:
    return [i for i, line in enumerate(lines) if line.startswith("import time:")
            and line.rsplit("|", 1)[-1].strip().split(".")[0] == package]


def test_handshake_imports_neither_chromadb_nor_ollama(built: Built, fake: FakeOllama) -> None:
    # Warm-up off: what the handshake itself imports, then what a store-only call imports.
    raw = RawServer(built.server_env(fake.host, RAG_SERVER_WARMUP="0"), python_flags=("-X", "importtime"))
    try:
        raw.handshake()
        assert not raw.call("list_documents", {})["isError"]
        raw.wait_for_stderr("list_documents -> ok")
        assert not raw.call("search_corpus", {"query": "rollback"})["isError"]
        raw.wait_for_stderr("search_corpus -> ok")
    finally:
        raw.close()
    lines = raw.stderr_lines
    listed = next(i for i, line in enumerate(lines) if "list_documents -> ok" in line)
    for package in ("chromadb", "ollama", "numpy", "httpx"):
        found = _imports_of(lines, package)
        assert found, f"{package} is imported by a search (the check can see it)"
        assert min(found) > listed, f"{package} was imported before the first search"
    # Warm-up on (the default): the heavy imports start only once the warm-up has begun, which
    # is after tools/list was answered.
    warm = RawServer(built.server_env(fake.host), python_flags=("-X", "importtime"))
    try:
        warm.handshake()
        warm.wait_for_stderr("warm-up: done")
    finally:
        warm.close()
    started = next(i for i, line in enumerate(warm.stderr_lines) if "warm-up: start" in line)
    for package in ("chromadb", "ollama"):
        found = _imports_of(warm.stderr_lines, package)
        assert found and min(found) > started


def test_server_without_corpus_variable_reads_the_folder_the_index_records(built: Built, fake: FakeOllama) -> None:
    """A server registered without RAG_CORPUS_DIR must not fall back to sample-corpus when the
    index was built from another folder with `ingest.py --corpus`."""
    env = built.server_env(fake.host)
    del env["RAG_CORPUS_DIR"]

    async def scenario() -> dict[str, Any]:
        async with connect(env) as client:
            is_error, payload = await tool(client, "get_file", path="oncall/escalation.md", start_line=1, end_line=3)
            assert not is_error, payload
            return payload

    payload = run(scenario)
    assert payload["source"] == "disk"
    expected = (built.corpus / "oncall" / "escalation.md").read_text(encoding="utf-8").split("\n")[:3]
    assert payload["text"].split("\n") == expected
    assert StoreLayout(built.store).read_current().corpus_dir == str(built.corpus)  # type: ignore[union-attr]  # built


# ---------------------------------------------------------------------------
# First-time users and every client.


def test_a_missing_store_is_said_at_start_on_stderr_and_in_the_instructions(built: Built, fake: FakeOllama,
                                                                           tmp_path: Path) -> None:
    store = tmp_path / "not-built"
    raw = RawServer(server_env(store, built.corpus, fake.host))
    try:
        init = raw.request("initialize", {"protocolVersion": "2025-06-18", "capabilities": {},
                                           "clientInfo": {"name": "e2e", "version": "0"}})
        instructions = init["result"]["instructions"]
        assert "Not ready" in instructions and str(store) in instructions and rules.INGEST_COMMAND in instructions
        raw.wait_for_stderr(f"there is no index in RAG_STORE_DIR ({store})")
    finally:
        assert raw.close() == 0
    warnings = [line for line in raw.stderr_lines if "WARNING" in line]
    assert len(warnings) == 1 and rules.INGEST_COMMAND in warnings[0]
    # A ready store: no warning, and the plain instructions.
    ready = RawServer(built.server_env(fake.host))
    try:
        init = ready.request("initialize", {"protocolVersion": "2025-06-18", "capabilities": {},
                                             "clientInfo": {"name": "e2e", "version": "0"}})
        assert "Not ready" not in init["result"]["instructions"]
    finally:
        assert ready.close() == 0
    assert not any("WARNING" in line for line in ready.stderr_lines)


def test_a_corpus_variable_that_disagrees_with_the_index_is_warned_about(built: Built, fake: FakeOllama,
                                                                        tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    raw = RawServer(server_env(built.store, elsewhere, fake.host))
    try:
        raw.handshake()
        raw.wait_for_stderr("but the index in")
    finally:
        assert raw.close() == 0
    line = next(line for line in raw.stderr_lines if "but the index in" in line)
    assert str(elsewhere) in line and str(built.corpus) in line


def test_help_prints_usage_and_exits() -> None:
    done = subprocess.run([sys.executable, str(SERVER), "--help"], capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0 and done.stdout.startswith("usage: server.py")
    assert "RAG_STORE_DIR" in done.stdout and "stdio" in done.stdout
    bad = subprocess.run([sys.executable, str(SERVER), "--no-such-flag"], capture_output=True, text=True, timeout=60,
                         stdin=subprocess.DEVNULL)
    assert bad.returncode == 2 and "usage" in bad.stderr and bad.stdout == ""


def test_numbers_sent_as_strings_are_read_as_numbers(built: Built, fake: FakeOllama) -> None:
    async def scenario() -> None:
        async with connect(built.server_env(fake.host)) as client:
            is_error, lines = await tool(client, "get_file", path="oncall/escalation.md", start_line="2", end_line="4")
            assert not is_error and (lines["start_line"], lines["end_line"]) == (2, 4)
            is_error, found = await tool(client, "search_corpus", query="rollback", k="2", min_score="-1")
            assert not is_error and len(found["results"]) == 2
            is_error, listed = await tool(client, "list_documents", offset="1", limit="2")
            assert not is_error and (listed["offset"], len(listed["documents"])) == (1, 2)
            is_error, numeric = await tool(client, "search_corpus", query=2048, mode="keyword")
            assert not is_error and numeric["query"] == "2048"
            assert await error_code(client, "search_corpus", query=True) == "invalid_argument"
            assert await error_code(client, "get_file", path=1.5) == "invalid_argument"
            for args in ({"k": "2.5"}, {"k": "two"}, {"k": True}, {"k": 2.0}, {"min_score": "nan"}):
                assert await error_code(client, "search_corpus", query="rollback", **args) == "invalid_argument"

    run(scenario)


def test_every_tool_result_fits_the_declared_output_schema(built: Built, fake: FakeOllama, tmp_path: Path) -> None:
    """Conformance, through the real server and the SDK client: successes and errors of every tool
    (tool_payload validates each against the outputSchema from tools/list, the way TypeScript-SDK
    clients do, and checks that errors carry no structured content)."""
    down = FakeOllama().start()
    down_host = down.host
    down.stop()
    cases: list[tuple[str, dict[str, Any], str | None]] = [
        ("search_corpus", {"query": "who gets paged for a sev-1"}, None),
        ("search_corpus", {"query": "rollback", "mode": "keyword", "path_prefix": "runbooks"}, None),
        ("search_corpus", {"query": "deploy", "include_superseded": True, "k": 20, "min_score": 0.0}, None),
        ("search_corpus", {"query": "zzzz-nothing-matches", "mode": "keyword"}, None),
        ("search_corpus", {"query": "q", "k": 0}, "invalid_argument"),
        ("search_corpus", {"query": ""}, "invalid_argument"),
        ("search_corpus", {"query": "q", "path_prefix": "../x"}, "path_rejected"),
        ("get_file", {"path": "runbooks/deploy.md", "start_line": 3, "end_line": 9}, None),
        ("get_file", {"path": "private/offsite-backup.md"}, "not_indexed"),
        ("get_file", {"path": "../../etc/passwd"}, "path_rejected"),
        ("get_file", {"path": "runbooks/deploy.md", "start_line": 100000}, "invalid_argument"),
        ("list_documents", {}, None),
        ("list_documents", {"path_prefix": "nowhere"}, None),
        ("list_documents", {"limit": 0}, "invalid_argument"),
    ]

    async def scenario(env: dict[str, str], cases: list[tuple[str, dict[str, Any], str | None]]) -> None:
        async with connect(env) as client:
            declared = {t.name: t.output_schema for t in (await client.list_tools()).tools}
            assert all(declared.values())
            for name, args, code in cases:
                is_error, payload = await tool(client, name, **args)
                assert is_error == (code is not None), (name, args, payload)
                if code is not None:
                    assert payload["error"]["code"] == code, (name, args, payload)

    run(lambda: scenario(built.server_env(fake.host), cases))
    missing = Built(built.corpus, tmp_path / "no-store", built.host)
    run(lambda: scenario(missing.server_env(fake.host), [
        ("search_corpus", {"query": "q"}, "index_missing"), ("get_file", {"path": "a.md"}, "index_missing"),
        ("list_documents", {}, "index_missing")]))
    run(lambda: scenario(built.server_env(down_host), [
        ("search_corpus", {"query": "rollback"}, None), ("search_corpus", {"query": "rollback", "mode": "vector"},
                                                          "embedder_unavailable")]))


@pytest.mark.parametrize("mode", ["legacy", "2026-07-28"])
def test_documents_are_resources_over_stdio(built: Built, fake: FakeOllama, mode: str) -> None:
    """The real server over stdio: every indexed document listed and readable as a resource, a hit's
    lines through the template, path completion, and the JSON-RPC errors the spec puts outside
    tool results (an unknown tool, an unreadable URI)."""
    template = ResourceTemplateReference(uri=server.LINES_TEMPLATE)

    async def scenario() -> None:
        async with connect(built.server_env(fake.host), mode=mode) as client:
            listed = await client.list_resources()
            names = [r.name for r in listed.resources]
            assert "runbooks/deploy.md" in names and "private/offsite-backup.md" not in names
            whole = await client.read_resource(server.document_uri("runbooks/deploy.md"))
            assert whole.contents[0].text.splitlines() == (built.corpus / "runbooks/deploy.md").read_text().splitlines()
            is_error, found = await tool(client, "search_corpus", query="who gets paged for a sev-1")
            hit = found["results"][0]
            read = await client.read_resource(f"{hit['uri']}?start_line={hit['start_line']}&end_line={hit['end_line']}")
            expected = (built.corpus / hit["path"]).read_text().splitlines()[hit["start_line"] - 1:hit["end_line"]]
            assert read.contents[0].text == "\n".join(expected)
            assert (await client.complete(template, {"name": "path", "value": "runbooks/dep"})).completion.values \
                == sorted(n for n in names if n.startswith("runbooks/dep"))
            with pytest.raises(MCPError) as unreadable:
                await client.read_resource(server.document_uri("private/offsite-backup.md"))
            assert unreadable.value.code == INVALID_PARAMS and unreadable.value.data["error"]["code"] == "not_indexed"
            with pytest.raises(MCPError) as unknown:
                await client.call_tool("no_such_tool", {})
            assert unknown.value.code == INVALID_PARAMS and "search_corpus" in unknown.value.message

    run(scenario)
