"""get_file's max_chars and the response budgets the tools declare (issue 29, section 7), in process.

The pure parts directly (the line cut and its notes, hypothesis where inputs vary); the rest
through the real service over a real index of (a copy of) sample-corpus built by the real ingest,
every result checked against the tool's outputSchema. tests/test_progress_e2e.py drives the same
through the real `python server.py` over stdio, with progress.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from budgets import examples
from fake_ollama import FakeOllama
from helpers import Built, build, dispatched, in_process_service
from hypothesis import given, settings
from hypothesis import strategies as st

import corpus_rules as rules
import server


@pytest.fixture
def fresh(fake: FakeOllama, sample_index: tuple[Path, Path]) -> Built:
    return Built(*sample_index, fake.host)


def json_cost(text: str) -> int:
    """What a text costs inside a JSON string (what the budgets count)."""
    return len(json.dumps(text, ensure_ascii=False)) - 2


# ---------------------------------------------------------------------------
# The cut (pure).

# Lines with what JSON escapes (quotes, backslashes, tabs, control characters) and wide characters.
escapable_lines = st.lists(st.text(alphabet=st.sampled_from(['a', 'b', ' ', '"', '\\', '\t', '\x01', 'é', '日', '😀']),
                                   max_size=80), max_size=40)


@settings(max_examples=examples(300))
@given(escapable_lines, st.integers(min_value=1, max_value=400), st.integers(min_value=1, max_value=45))
def test_a_cut_plus_its_continuations_reassemble_the_file(lines: list[str], cap: int, first: int) -> None:
    """Read from any start line, page after page from next_start_line: every page costs at most
    max_chars as JSON, keeps whole lines unless one line alone is longer (then it says so), and the
    pages put together are the file from that line on, exactly, when every line fits."""
    if not lines:
        return
    start: int | None = min(first, len(lines))
    begin = start
    got: list[str] = []
    pages = 0
    while start is not None:
        part = server.slice_lines(lines, start, None, max_chars=cap)
        assert json_cost(part.text) <= cap and part.start_line == start
        note = server.cut_note(part, len(lines), cap)
        assert (note is not None) == part.truncated
        if part.cut_inside:
            assert part.end_line == start and lines[start - 1].startswith(part.text) and part.text != lines[start - 1]
            assert note is not None and f"line {start} is longer than max_chars={cap}" in note
        else:
            assert part.text.split("\n") == lines[start - 1:part.end_line]
            got.extend(lines[start - 1:part.end_line])
        if part.next_start_line is not None:
            assert note is not None and f"start_line={part.next_start_line}" in note
        assert part.truncated == (part.next_start_line is not None or part.cut_inside)
        start = part.next_start_line
        pages += 1
        assert pages <= len(lines)
    if all(json_cost(line) <= cap for line in lines):
        assert got == lines[begin - 1:]


def test_the_cut_counts_what_json_escapes() -> None:
    lines = ['say "hi"', "plain"]
    # 'say "hi"' costs 10 in JSON (two quotes escaped): with 9, only a cut inside fits.
    part = server.slice_lines(lines, 1, None, max_chars=9)
    assert part.cut_inside and part.text == 'say "hi' and part.next_start_line == 2
    whole = server.slice_lines(lines, 1, None, max_chars=17)  # 10 + 2 for the line break + 5
    assert not whole.truncated and whole.text == 'say "hi"\nplain'
    assert server.slice_lines(lines, 1, None, max_chars=16).next_start_line == 2


# ---------------------------------------------------------------------------
# get_file's max_chars.


def test_max_chars_is_validated_at_the_boundary(fresh: Built) -> None:
    svc = in_process_service(fresh)
    for bad in (0, -1, server.FILE_TEXT_MAX_CHARS + 1, 2.5, True, "many"):
        is_error, payload = dispatched(svc, "get_file", path="oncall/escalation.md", max_chars=bad)
        assert is_error and payload["error"]["code"] == "invalid_argument", bad
        assert "max_chars" in payload["error"]["message"] and "max_chars: integer 1..50000" in payload["error"]["hint"]
    default = server.GetFileInput(path="x.md").max_chars
    assert default == server.FILE_TEXT_MAX_CHARS and not dispatched(svc, "get_file", path="oncall/escalation.md",
                                                              max_chars="300")[0]


def test_get_file_cuts_at_max_chars_and_says_where_to_continue(fresh: Built) -> None:
    svc = in_process_service(fresh)
    on_disk = (fresh.corpus / "oncall" / "escalation.md").read_text(encoding="utf-8").split("\n")[:-1]
    got: list[str] = []
    start: int | None = 1
    while start is not None:
        is_error, page = dispatched(svc, "get_file", path="oncall/escalation.md", start_line=start, max_chars=700)
        assert not is_error and json_cost(page["text"]) <= 700 and page["source"] == "disk"
        if page["truncated"]:
            assert page["message"] == (f"text cut at max_chars=700: lines {start}-{page['end_line']} of "
                                       f"{page['total_lines']}; continue with start_line={page['next_start_line']}")
        else:
            assert page["message"] is None and page["next_start_line"] is None
        got.extend(page["text"].split("\n"))
        start = page["next_start_line"]
    assert got == on_disk


def test_get_file_within_max_chars_from_the_index_when_the_file_is_gone(fresh: Built) -> None:
    svc = in_process_service(fresh)
    (fresh.corpus / "oncall" / "escalation.md").unlink()
    _, whole = dispatched(svc, "get_file", path="oncall/escalation.md")
    _, part = dispatched(svc, "get_file", path="oncall/escalation.md", max_chars=800)
    assert part["source"] == "index" and part["truncated"] and json_cost(part["text"]) <= 800
    assert whole["text"].startswith(part["text"]) and len(part["text"]) < len(whole["text"])
    assert f"cut at max_chars=800: continue with start_line={part['next_start_line']}" in part["message"]
    _, rest = dispatched(svc, "get_file", path="oncall/escalation.md", start_line=part["next_start_line"])
    assert rest["source"] == "index" and rest["text"] in whole["text"]


def test_a_whole_get_file_response_fits_its_declared_budget(fake: FakeOllama, tmp_path: Path) -> None:
    """The worst a file can do to the budget: every character escaped, under a long path."""
    src = tmp_path / "src" / ("deep-folder-name-" * 12) / ("another-long-folder-" * 10)
    src.mkdir(parents=True)
    name = "notes-" + "x" * 200 + ".md"
    lines = ['"quoted" \\ back\tslash ' * 8] * 600
    (src / name).write_text("# A title \"quoted\"\n\n" + "\n".join(lines) + "\n", encoding="utf-8")
    built = build(tmp_path, fake.host, tmp_path / "src")
    svc = in_process_service(built)
    path = next(d["path"] for d in dispatched(svc, "list_documents")[1]["documents"])
    is_error, page = dispatched(svc, "get_file", path=path)
    assert not is_error and page["truncated"] and json_cost(page["text"]) <= server.FILE_TEXT_MAX_CHARS
    text = server.mcp_result(server.dispatch(svc, "get_file", {"path": path})).content[0].text
    assert len(text) <= server.FILE_RESPONSE_MAX_CHARS and json.loads(text) == page


def test_the_budgets_are_declared_on_the_tools() -> None:
    declared = {tool.name: (tool.meta or {}).get("anthropic/maxResultSizeChars") for tool in server.tool_definitions()}
    assert declared == {"search_corpus": server.SEARCH_RESPONSE_MAX_CHARS, "get_file": server.FILE_RESPONSE_MAX_CHARS,
                        "list_documents": None}
    wire = {tool.name: tool.model_dump(by_alias=True, mode="json", exclude_none=True)
            for tool in server.tool_definitions()}
    assert wire["get_file"]["_meta"] == {"anthropic/maxResultSizeChars": server.FILE_RESPONSE_MAX_CHARS}
    assert wire["get_file"]["inputSchema"]["properties"]["max_chars"]["maximum"] == server.FILE_TEXT_MAX_CHARS


@st.composite
def passages(draw: st.DrawFn) -> list[rules.ChunkRow]:
    """A gone file's passages as the index holds them: in line order, some sharing their lines
    (the parts of one long line), of any length."""
    rows, line = [], 1
    for index in range(draw(st.integers(1, 8))):
        shared = bool(rows) and draw(st.booleans())
        start = rows[-1].start_line if shared else line
        end = rows[-1].end_line if shared else start + draw(st.integers(0, 5))
        text = draw(st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=300))
        rows.append(rules.ChunkRow(f"c{index}", "gone.md", index, start, end, "H", "active", text, "Gone"))
        line = end + 1
    return rows


@given(passages(), st.integers(1, 400))
def test_paging_a_gone_file_moves_forward_and_stays_within_max_chars(rows: list[rules.ChunkRow], max_chars: int) -> None:
    doc = rules.DocumentRow("gone.md", "Gone", "active", "markdown", "h", 1, 1, "gone.md", "/gone.md",
                            rows[-1].end_line, len(rows), rules.successors_column(()))
    start: int | None = None
    for _ in range(len(rows) + rows[-1].end_line + 1):
        page = server.file_from_chunks(doc, rows, start, None, max_chars)
        assert json_cost(page.text) <= max_chars
        if page.next_start_line is None:
            break
        assert page.truncated and page.next_start_line > (start or 1) and f"start_line={page.next_start_line}" in page.message
        start = page.next_start_line
    else:
        raise AssertionError("paging never ended")


def test_a_line_longer_than_the_ceiling_says_get_file_cannot_return_more() -> None:
    part = server.slice_lines(["x" * (server.FILE_TEXT_MAX_CHARS + 10), "next"], None, None, server.FILE_TEXT_MAX_CHARS)
    note = server.cut_note(part, 2, server.FILE_TEXT_MAX_CHARS)
    assert part.cut_inside and "larger max_chars" not in note and "start_line=2" in note
