"""Progress, response budgets and freshness through the real `python server.py` over stdio (issue
29, sections 6 and 7): the MCP SDK's own client (its progress_callback sends the progress token),
and raw JSON-RPC where what must be seen is that nothing is sent. Every result is checked against
the tool's outputSchema (helpers.tool_payload). tests/test_freshness_budgets.py has the same in process.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest
from fake_ollama import FakeOllama
from helpers import Built, build, connect, copy_sample, edit, raw_server, sample_built, tool_payload

import server

pytestmark = pytest.mark.process  # real processes (servers, ingest, Chroma): only in `pytest --all` (tests/README.md)

LOADING = "loading the vector index"


@pytest.fixture(scope="module")
def built(fake: FakeOllama, tmp_path_factory: pytest.TempPathFactory) -> Built:
    """The sample corpus plus a file too long for one get_file answer."""
    src = copy_sample(tmp_path_factory.mktemp("src"))
    lines = [f"Line {i:05d} " + "lorem ipsum dolor sit amet " * 3 for i in range(1, 1501)]
    (src / "long.md").write_text("# Long\n\n" + "\n".join(lines) + "\n", encoding="utf-8")
    assert (src / "long.md").stat().st_size >= server.FILE_PROGRESS_MIN_BYTES
    return build(tmp_path_factory.mktemp("progress"), fake.host, src)


class Progress:
    """What the SDK client's progress_callback receives for one call."""

    def __init__(self) -> None:
        self.messages: list[tuple[float, float | None, str | None]] = []

    async def __call__(self, progress: float, total: float | None, message: str | None) -> None:
        self.messages.append((progress, total, message))


async def call_with_progress(client: Any, name: str, **args: Any) -> tuple[dict[str, Any], list[str | None]]:
    progress = Progress()
    result = await client.call_tool(name, args, progress_callback=progress)
    is_error, payload = tool_payload(name, result)
    assert not is_error, payload
    # The notifications precede the answer on the wire (see below); the client hands them to the
    # callback from a task of its own, which has run after this pause.
    await anyio.sleep(0.2)
    return payload, [message for _, _, message in progress.messages]


def test_the_first_search_after_a_cold_start_reports_progress_and_the_next_does_not(built: Built,
                                                                                   fake: FakeOllama) -> None:
    async def scenario() -> None:
        async with connect(built.server_env(fake.host, RAG_SERVER_WARMUP="0")) as client:
            first, said = await call_with_progress(client, "search_corpus", query="who gets paged for a sev-1")
            assert first["results"] and len(said) == 1 and said[0] and said[0].startswith(LOADING), said
            # Hybrid may have answered from keywords while the load went on (vector_index_loading);
            # a vector search waits for it.
            await call_with_progress(client, "search_corpus", query="who gets paged", mode="vector")
            again, said = await call_with_progress(client, "search_corpus", query="rollback the database")
            assert again["results"] and again["degraded"] is None and said == []
            short, said = await call_with_progress(client, "get_file", path="oncall/escalation.md")
            assert not short["truncated"] and said == []
            long, said = await call_with_progress(client, "get_file", path="long.md", max_chars=2000)
            assert long["truncated"] and long["next_start_line"] and len(said) == 1, said
            assert said[0] == f"reading 'long.md': 1502 lines, {(built.corpus / 'long.md').stat().st_size // 1024} KB, " \
                              "at most 2000 characters of it"

    anyio.run(scenario)


def test_a_keyword_search_loads_no_vectors_and_says_nothing(built: Built, fake: FakeOllama) -> None:
    async def scenario() -> None:
        async with connect(built.server_env(fake.host, RAG_SERVER_WARMUP="0")) as client:
            found, said = await call_with_progress(client, "search_corpus", query="sev-1", mode="keyword")
            assert found["results"] and said == []
            _, said = await call_with_progress(client, "search_corpus", query="sev-1", mode="vector")
            assert len(said) == 1 and said[0] and said[0].startswith(LOADING)

    anyio.run(scenario)


def progress_lines(stdout: list[bytes]) -> list[dict[str, Any]]:
    return [m for m in map(json.loads, stdout) if m.get("method") == "notifications/progress"]


def test_no_progress_without_a_token_nor_after_the_warm_up(built: Built, fake: FakeOllama) -> None:
    with raw_server(built.store, built.corpus, fake.host, RAG_SERVER_WARMUP="0") as cold:
        for arguments in ({"name": "search_corpus", "arguments": {"query": "who gets paged for a sev-1"}},
                          {"name": "get_file", "arguments": {"path": "long.md"}}):
            answer = cold.request("tools/call", arguments)
            assert not tool_payload(arguments["name"], answer["result"])[0]
        assert progress_lines(cold.stdout_lines) == []
    with raw_server(built.store, built.corpus, fake.host) as warm:
        warm.wait_for_stderr("warm-up: done")
        answer = warm.request("tools/call", {"name": "search_corpus", "arguments": {"query": "sev-1"},
                                             "_meta": {"progressToken": "after-warm-up"}})
        assert not tool_payload("search_corpus", answer["result"])[0]
        assert progress_lines(warm.stdout_lines) == []
        answer = warm.request("tools/call", {"name": "get_file", "arguments": {"path": "long.md"},
                                             "_meta": {"progressToken": 7}})
        notes = progress_lines(warm.stdout_lines)
        assert [(n["params"]["progressToken"], n["params"]["progress"]) for n in notes] == [(7, 1)], notes
        assert notes[0]["params"]["message"].startswith("reading 'long.md': 1502 lines")
        # The notification comes before the call's answer.
        order = [m.get("id", m.get("method")) for m in map(json.loads, warm.stdout_lines)]
        assert order.index("notifications/progress") < order.index(answer["id"])


def test_budgets_max_chars_and_freshness_over_stdio(fake: FakeOllama, indexed_sample: tuple[Path, Path],
                                                    tmp_path: Path) -> None:
    fresh = sample_built(indexed_sample, tmp_path, fake.host)
    target = fresh.corpus / "oncall" / "escalation.md"
    edit(target, target.read_text(encoding="utf-8").replace("sev-1", "SEV-1 (renamed)") + "\nAdded later.\n")

    async def scenario() -> None:
        async with connect(fresh.server_env(fake.host)) as client:
            tools = {t.name: t for t in (await client.list_tools()).tools}
            assert tools["search_corpus"].meta == {"anthropic/maxResultSizeChars": server.SEARCH_RESPONSE_MAX_CHARS}
            assert tools["get_file"].meta == {"anthropic/maxResultSizeChars": server.FILE_RESPONSE_MAX_CHARS}
            result = await client.call_tool("search_corpus", {"query": "who gets paged for a sev-1 deploy", "k": 10})
            _, found = tool_payload("search_corpus", result)
            assert len(result.content[0].text) <= server.SEARCH_RESPONSE_MAX_CHARS
            by_path: dict[str, set[tuple[bool, str]]] = {}
            for hit in found["results"]:
                by_path.setdefault(hit["path"], set()).add((hit["changed_on_disk"], hit["freshness"]))
            assert by_path.pop("oncall/escalation.md") == {(True, "modified")}
            assert by_path and all(states == {(False, "unchanged")} for states in by_path.values()), by_path
            result = await client.call_tool("get_file", {"path": "oncall/escalation.md", "max_chars": "400"})
            _, part = tool_payload("get_file", result)
            assert part["truncated"] and part["changed_since_ingest"] and "continue with start_line=" in part["message"]
            result = await client.call_tool("get_file", {"path": "oncall/escalation.md", "max_chars": 0})
            is_error, refused = tool_payload("get_file", result)
            assert is_error and refused["error"]["code"] == "invalid_argument"

    anyio.run(scenario)
