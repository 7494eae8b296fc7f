"""Documents as MCP resources, the line-range template, path completion, and the protocol errors
the spec puts outside tool results (issue 29 §1-§3).

The URI rules are pure functions, tested directly (hypothesis for the round trip). The MCP layer
is the real `build_server` over a real index built by the real ingest from the sample corpus,
spoken to by the SDK's own `Client` in-process, in both protocol eras; tests/test_server_e2e.py
and tests/test_http.py do the same through `python server.py` over stdio and HTTP.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import anyio
import pytest
from fake_ollama import FakeOllama
from helpers import Built, dispatched, in_process_service, sample_built, tool_payload
from hypothesis import given
from hypothesis import strategies as st
from mcp import Client
from mcp.shared.exceptions import MCPError
from mcp.types import INVALID_PARAMS, ResourceTemplateReference

import server
from corpus_rules import ErrorCode, RagError

T = TypeVar("T")
MODES = ("legacy", "2026-07-28")


@pytest.fixture(scope="module")
def base(fake: FakeOllama, indexed_sample: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Built:
    return sample_built(indexed_sample, tmp_path_factory.mktemp("resources"), fake.host)


def talk(built: Built, mode: str, scenario: Callable[[Client], Awaitable[T]]) -> T:
    svc = in_process_service(built)
    mcp_server = server.build_server(svc, "instructions", server.WarmUp(svc))

    async def main() -> T:
        async with Client(mcp_server, mode=mode) as client:  # type: ignore[arg-type]  # SDK's union
            return await scenario(client)

    try:
        return anyio.run(main)
    finally:
        svc.close(5)


def tool_call(built: Built, name: str, **args: Any) -> dict[str, Any]:
    svc = in_process_service(built)
    try:
        is_error, payload = dispatched(svc, name, **args)
    finally:
        svc.close(5)
    assert not is_error, payload
    return payload


def indexed_paths(built: Built) -> list[str]:
    return [doc["path"] for doc in tool_call(built, "list_documents")["documents"]]


# ---------------------------------------------------------------------------
# The URI rules.

paths = st.lists(st.text(st.characters(exclude_categories=("Cc", "Cs"), exclude_characters="/\\"), min_size=1,
                         max_size=12).filter(lambda p: p.strip() not in ("", ".", "..") and p == p.strip()
                                             and not p.startswith("~")), min_size=1, max_size=4).map("/".join).filter(
    lambda p: not re.match(r"[A-Za-z]:", p))  # a drive letter: refused as absolute (corpus_rules._path_problems)


@given(paths, st.none() | st.integers(1, 10**6), st.none() | st.integers(0, 50))
def test_a_document_uri_reads_back_as_its_path_and_lines(path: str, start: int | None, span: int | None) -> None:
    path = server.GetFileInput(path=path).path  # the form the index holds (NFC)
    query = [] if start is None else [f"start_line={start}"]
    if start is not None and span is not None:
        query.append(f"end_line={start + span}")
    uri = server.document_uri(path) + ("?" + "&".join(query) if query else "")
    assert "?" not in server.document_uri(path) and "#" not in server.document_uri(path)
    args = server.file_arguments(uri)
    assert (args.path, args.start_line) == (path, start)
    assert args.end_line == (start + span if start is not None and span is not None else None)


@pytest.mark.parametrize("uri, code", [
    ("file:///etc/passwd", ErrorCode.INVALID_ARGUMENT),
    ("local-rag://other/runbooks/deploy.md", ErrorCode.INVALID_ARGUMENT),
    ("local-rag://doc/..%2F..%2Fetc%2Fpasswd", ErrorCode.PATH_REJECTED),
    ("local-rag://doc/%2Fetc%2Fpasswd", ErrorCode.PATH_REJECTED),
    ("local-rag://doc/a%00.md", ErrorCode.PATH_REJECTED),
    ("local-rag://doc/%ff.md", ErrorCode.INVALID_ARGUMENT),
    ("local-rag://doc/", ErrorCode.INVALID_ARGUMENT),
    ("local-rag://doc/a.md?start_line=0", ErrorCode.INVALID_ARGUMENT),
    ("local-rag://doc/a.md?start_line=9&end_line=3", ErrorCode.INVALID_ARGUMENT),
    ("local-rag://doc/a.md?start_line=1&start_line=2", ErrorCode.INVALID_ARGUMENT),
    ("local-rag://doc/a.md?lines=1-3", ErrorCode.INVALID_ARGUMENT),
    ("local-rag://doc/a.md?path=b.md", ErrorCode.INVALID_ARGUMENT),  # the path is the URI's own
    ("local-rag://doc/a.md?max_chars=5", ErrorCode.INVALID_ARGUMENT),
    ("local-rag://doc/a.md?start_line=x", ErrorCode.INVALID_ARGUMENT),
    ("local-rag://doc/a.md?start_line=%D9%A3", ErrorCode.INVALID_ARGUMENT),
    ("local-rag://doc/a.md?start_line=3_0", ErrorCode.INVALID_ARGUMENT),
    ("local-rag://doc/a.md?start_page=%EF%BC%93", ErrorCode.INVALID_ARGUMENT),
])
def test_a_uri_that_names_no_readable_document_is_refused_with_what_to_do(uri: str, code: ErrorCode) -> None:
    with pytest.raises(RagError) as refused:
        server.file_arguments(uri)
    assert refused.value.code == code and refused.value.hint


def test_redaction_keeps_document_uris_whole_and_still_hides_paths() -> None:
    told = server.redact("'file:///home/me/x.md' is not a document URI; use local-rag://doc/runbooks/a.md?start_line=2 "
                         "or local-rag://doc/<path>, not /home/me/x.md")
    assert told == ("'<host>' is not a document URI; use local-rag://doc/runbooks/a.md?start_line=2 or "
                    "local-rag://doc/<path>, not <path>")


@given(st.text(st.characters(exclude_categories=("Cs",)), max_size=40))  # no index path holds a lone surrogate
def test_a_cursor_continues_after_the_path_it_was_made_from(path: str) -> None:
    assert server.decoded_cursor(server.encoded_cursor(path)) == path


@pytest.mark.parametrize("cursor", ["%%%", "bm90IHV0Zi04\x00", "/w==", "ü"])
def test_a_cursor_this_server_did_not_give_is_refused(cursor: str) -> None:
    with pytest.raises(RagError) as refused:
        server.decoded_cursor(cursor)
    assert refused.value.code == ErrorCode.INVALID_ARGUMENT


# ---------------------------------------------------------------------------
# The service: pages and completions over a real index.


def test_pages_cover_every_indexed_document_once_in_path_order(base: Built, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server, "RESOURCES_PAGE", 2)
    svc = in_process_service(base)
    try:
        seen, after, pages = [], "", 0
        while True:
            docs, after_next = svc.resource_page(after)
            assert len(docs) <= 2
            seen += [doc.path for doc, _ in docs]
            pages += 1
            if after_next is None:
                break
            after = after_next
    finally:
        svc.close(5)
    assert seen == indexed_paths(base) and pages == -(-len(seen) // 2)


def test_completion_offers_paths_that_start_with_what_was_typed_then_file_names(base: Built) -> None:
    svc = in_process_service(base)
    try:
        assert svc.complete_path("run") == ([p for p in indexed_paths(base) if p.startswith("run")], False)
        by_name, _ = svc.complete_path("deploy")
        assert by_name and all(p.rsplit("/", 1)[-1].startswith("deploy") for p in by_name)
        assert svc.complete_path("") == (indexed_paths(base), False)
        assert svc.complete_path("nothing-is-called-this") == ([], False)
        assert svc.complete_path("%") == ([], False) and svc.complete_path("_") == ([], False)  # LIKE escaped
        assert "private/offsite-backup.md" not in svc.complete_path("private")[0]  # rag: false
    finally:
        svc.close(5)


def test_completion_is_bounded(base: Built, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server, "COMPLETIONS_MAX", 2)
    svc = in_process_service(base)
    try:
        values, more = svc.complete_path("")
    finally:
        svc.close(5)
    assert values == indexed_paths(base)[:2] and more


# ---------------------------------------------------------------------------
# Over MCP (in-process, both eras).


@pytest.mark.parametrize("mode", MODES)
def test_every_indexed_document_is_a_resource_that_reads_as_get_file_does(base: Built, mode: str) -> None:
    async def scenario(client: Client) -> tuple[Any, dict[str, Any]]:
        listed = await client.list_resources()
        reads = {}
        for resource in listed.resources:
            reads[resource.name] = await client.read_resource(resource.uri)
        return listed, reads

    listed, reads = talk(base, mode, scenario)
    assert listed.next_cursor is None
    assert [r.name for r in listed.resources] == indexed_paths(base)
    assert "private/offsite-backup.md" not in reads  # rag: false: not indexed, not a resource
    for resource in listed.resources:
        assert resource.uri == server.document_uri(resource.name) and resource.mime_type == "text/markdown"
        assert resource.size == (base.corpus / resource.name).stat().st_size and resource.title
        assert resource.annotations and resource.annotations.last_modified
        superseded = resource.meta["lifecycle"] == "superseded"
        assert bool(resource.description and "superseded" in resource.description) == superseded
        (contents,) = reads[resource.name].contents
        as_get_file = tool_call(base, "get_file", path=resource.name)
        assert contents.uri == resource.uri and contents.mime_type == "text/markdown"
        assert contents.text == as_get_file.pop("text") and contents.text
        assert contents.meta == {key: value for key, value in as_get_file.items() if value is not None}
        assert contents.meta["source"] == "disk" and contents.meta["path"] == resource.name
    superseded = {r.name: r for r in listed.resources if r.meta["lifecycle"] == "superseded"}
    # The sample's superseded runbook names its successor, as list_documents does.
    assert "runbooks/deploy.md" in superseded["runbooks/deploy-2023.md"].description
    assert superseded["runbooks/deploy-2023.md"].meta["superseded_by"] == ["runbooks/deploy.md"]


@pytest.mark.parametrize("mode", MODES)
def test_the_template_reads_the_lines_a_search_hit_cites(base: Built, mode: str) -> None:
    async def scenario(client: Client) -> tuple[Any, dict[str, Any], Any]:
        templates = await client.list_resource_templates()
        result = await client.call_tool("search_corpus", {"query": "how do I roll back a deploy"})
        _, payload = tool_payload("search_corpus", result)
        hit = payload["results"][0]
        lines = await client.read_resource(f"{hit['uri']}?start_line={hit['start_line']}&end_line={hit['end_line']}")
        return templates, hit, lines

    templates, hit, lines = talk(base, mode, scenario)
    (template,) = templates.resource_templates
    assert template.uri_template == server.LINES_TEMPLATE
    assert hit["uri"] == server.document_uri(hit["path"])
    (contents,) = lines.contents
    as_get_file = tool_call(base, "get_file", path=hit["path"], start_line=hit["start_line"], end_line=hit["end_line"])
    assert contents.text == as_get_file["text"] and hit["text"].split("\n")[0] in contents.text
    assert (contents.meta["start_line"], contents.meta["end_line"]) == (hit["start_line"], hit["end_line"])


@pytest.mark.parametrize("mode", MODES)
def test_unreadable_uris_answer_invalid_params_with_the_structured_error(base: Built, mode: str) -> None:
    uris = {"local-rag://doc/private/offsite-backup.md": "not_indexed",  # rag: false
            "local-rag://doc/nowhere.md": "not_indexed",
            "local-rag://doc/..%2F..%2Fetc%2Fpasswd": "path_rejected",
            "https://example.com/x.md": "invalid_argument",
            # Arabic-Indic and fullwidth 3: int() reads them, a URI's numbers are ASCII
            "local-rag://doc/runbooks/deploy.md?start_line=%D9%A3": "invalid_argument",
            "local-rag://doc/runbooks/deploy.md?start_line=1&end_line=%EF%BC%93": "invalid_argument"}

    async def scenario(client: Client) -> dict[str, MCPError]:
        errors = {}
        for uri in uris:
            with pytest.raises(MCPError) as refused:
                await client.read_resource(uri)
            errors[uri] = refused.value
        with pytest.raises(MCPError) as bad_cursor:
            await client.list_resources(cursor="%%%")
        errors["cursor"] = bad_cursor.value
        return errors

    expected = {**uris, "cursor": "invalid_argument"}
    for uri, error in talk(base, mode, scenario).items():
        assert error.code == INVALID_PARAMS, (uri, error)
        assert error.data["error"]["code"] == expected[uri] and error.data["error"]["hint"] in error.message
        assert "offsite" not in json.dumps(error.data).replace("offsite-backup.md", "")  # echoes the path only


@pytest.mark.parametrize("mode", MODES)
def test_completion_of_the_template_path_over_mcp(base: Built, mode: str) -> None:
    template = ResourceTemplateReference(uri=server.LINES_TEMPLATE)

    async def scenario(client: Client) -> tuple[Any, Any, Any]:
        return (await client.complete(template, {"name": "path", "value": "runbooks/"}),
                await client.complete(template, {"name": "start_line", "value": "1"}),
                await client.complete(ResourceTemplateReference(uri="local-rag://other/{x}"),
                                      {"name": "path", "value": ""}))

    paths, other_argument, other_template = talk(base, mode, scenario)
    assert paths.completion.values == [p for p in indexed_paths(base) if p.startswith("runbooks/")]
    assert paths.completion.has_more is False
    assert other_argument.completion.values == [] and other_template.completion.values == []


@pytest.mark.parametrize("mode", MODES)
def test_an_unknown_tool_is_a_protocol_error(base: Built, mode: str) -> None:
    async def scenario(client: Client) -> MCPError:
        with pytest.raises(MCPError) as refused:
            await client.call_tool("delete_everything", {})
        return refused.value

    error = talk(base, mode, scenario)
    assert error.code == INVALID_PARAMS and "delete_everything" in error.message
    assert all(name in error.message for name in server.TOOLS)


@pytest.mark.parametrize("mode", MODES)
def test_an_array_sent_as_its_json_text_is_read_as_the_array(base: Built, mode: str) -> None:
    async def scenario(client: Client) -> list[tuple[bool, dict[str, Any]]]:
        calls = [{"query": "rollback", "queries": '["roll back a release", "revert a deploy"]'},
                 {"query": "rollback", "queries": "roll back a release"},  # a bare string: which list?
                 {"query": "rollback", "queries": '[1, 2]'}]
        return [tool_payload("search_corpus", await client.call_tool("search_corpus", args)) for args in calls]

    (ok, as_array), (bare, _), (numbers, _) = talk(base, mode, scenario)
    assert not ok and as_array["results"] and "queries" not in (as_array["message"] or "")
    assert bare and numbers


def test_list_results_carry_cache_hints_in_the_2026_era(base: Built) -> None:
    async def scenario(client: Client) -> list[Any]:
        return [await client.list_tools(), await client.list_resources(), await client.list_resource_templates(),
                await client.read_resource(server.document_uri("runbooks/deploy.md"))]

    tools, resources, templates, read = talk(base, "2026-07-28", scenario)
    assert tools.ttl_ms > 0 and templates.ttl_ms > 0 and resources.ttl_ms > 0 and read.ttl_ms == 0
    assert resources.ttl_ms < tools.ttl_ms  # an ingest changes the documents, not the tool table


def test_no_index_lists_no_resources_and_reading_says_what_to_do(tmp_path: Path, fake: FakeOllama) -> None:
    empty = Built(tmp_path / "corpus", tmp_path / "no-store", fake.host)
    empty.corpus.mkdir()

    async def scenario(client: Client) -> tuple[Any, MCPError]:
        listed = await client.list_resources()
        with pytest.raises(MCPError) as refused:
            await client.read_resource(server.document_uri("a.md"))
        return listed, refused.value

    listed, error = talk(empty, "legacy", scenario)
    assert listed.resources == [] and error.data["error"]["code"] == "index_missing"
    assert not empty.store.exists()  # the server never creates a store
