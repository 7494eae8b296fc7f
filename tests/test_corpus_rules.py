"""The shared contract in corpus_rules.py, tested directly: chunker, frontmatter rules, token
estimate, keyword terms, path validation, prefix registry, manifest and settings."""

from __future__ import annotations

import dataclasses
import re
import shlex
import sqlite3
import sys
import unicodedata
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import pytest
from budgets import examples
from fake_ollama import FakeOllama, count_tokens
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import corpus_rules as rules
from corpus_rules import Chunk, ErrorCode, RagError, SourceDocument

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "sample-corpus"
CJK_RE = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff]")

HYPOTHESIS = settings(max_examples=examples(120), deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _doc(text: str | bytes, path: str = "doc.md") -> SourceDocument:
    return rules.parse_document(text.encode() if isinstance(text, str) else text, path)


def _sample(rel: str) -> tuple[SourceDocument, list[str]]:
    raw = (CORPUS / rel).read_bytes()
    return rules.parse_document(raw, rel), raw.decode("utf-8").split("\n")


def _squash(text: str) -> str:
    return "".join(text.split())


# ---------------------------------------------------------------------------
# The chunker's invariants, for any document.


def assert_chunk_invariants(doc: SourceDocument, chunks: list[Chunk], max_tokens: int, min_tokens: int = 0,
                            context_tokens: int | None = None) -> None:
    context = max(max_tokens, context_tokens or max_tokens)
    body = doc.lines[doc.body_start - 1:]
    if not any(line.strip() for line in body):
        assert chunks == []
        return
    assert [c.index for c in chunks] == list(range(len(chunks)))
    assert chunks[0].start_line == doc.body_start
    assert chunks[-1].end_line == doc.line_count
    for chunk in chunks:
        assert doc.body_start <= chunk.start_line <= chunk.end_line <= doc.line_count
        assert chunk.text and chunk.text == chunk.text.strip()
        assert rules.searchable_tokens(chunk.text) <= context, chunk
        source = "\n".join(doc.lines[chunk.start_line - 1:chunk.end_line])
        assert chunk.text in source
    for prev, nxt in pairwise(chunks):
        if nxt.start_line == prev.end_line + 1:
            continue
        # The documented exception: one line too long for the context, shared by its pieces.
        assert nxt.start_line == prev.end_line, (prev, nxt)
        shared = doc.lines[nxt.start_line - 1]
        assert rules.searchable_tokens(shared) + rules.searchable_tokens(nxt.heading) + 3 > context
        assert rules.searchable_tokens(prev.text) <= max_tokens and rules.searchable_tokens(nxt.text) <= max_tokens
    for at, chunk in enumerate(chunks):
        if len(chunks) > 1 and rules.searchable_tokens(chunk.text) < min_tokens:
            # Under the minimum only where joining either neighbour would not fit the context.
            for other in chunks[max(0, at - 1):at] + chunks[at + 1:at + 2]:
                first, last = sorted((chunk, other), key=lambda c: c.start_line)
                lines = sum(rules.searchable_tokens(line) + 1 for line in doc.lines[first.start_line - 1:last.end_line])
                headings = rules.searchable_tokens(first.heading) + rules.searchable_tokens(last.heading)
                assert lines + headings + 3 > context, (chunk, other)
    shared = {nxt.start_line for prev, nxt in pairwise(chunks) if nxt.start_line == prev.end_line}
    for chunk in chunks:
        if chunk.start_line not in shared and chunk.end_line not in shared:
            # A chunk that shares no line with a neighbour is exactly its lines.
            assert chunk.text == "\n".join(doc.lines[chunk.start_line - 1:chunk.end_line]).strip()
    # Nothing lost, nothing duplicated, in order (whitespace aside: long lines split at spaces).
    concatenation = _squash("".join(c.text for c in chunks))
    assert concatenation == _squash("\n".join(body))
    cursor = 0
    for line in body:
        if line.strip():
            at = concatenation.find(_squash(line), cursor)
            assert at >= 0, line
            cursor = at + len(_squash(line))


@dataclass
class Generated:
    text: str
    headings: list[tuple[int, str]]  # (level, text) of every real heading, in order
    has_frontmatter: bool


_WORDS = st.text(alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ", min_size=1, max_size=12)
_CJK_WORDS = st.text(alphabet="ログ収集設定概要日本語漢字かなカナ東京運用仕組送信", min_size=1, max_size=20)


def _phrase(draw: st.DrawFn, lo: int = 1, hi: int = 8) -> str:
    words = draw(st.lists(st.one_of(_WORDS, _CJK_WORDS), min_size=lo, max_size=hi))
    return " ".join(words)


@st.composite
def markdown_documents(draw: st.DrawFn) -> Generated:
    headings: list[tuple[int, str]] = []
    blocks: list[str] = []
    counter = 0
    n_blocks = draw(st.integers(0, 14))
    for position in range(n_blocks):
        counter += 1
        kind = draw(st.sampled_from(
            ["atx", "atx", "setext", "para", "para", "fence", "table", "long", "cjk", "list", "quote", "token"]))
        if kind == "atx":
            level = draw(st.integers(1, 6))
            text = f"head{counter} {_phrase(draw, 0, 3)}".strip()
            closing = draw(st.sampled_from(["", " #", " ###"]))
            blocks.append("#" * level + " " + text + closing)
            headings.append((level, text))
        elif kind == "setext":
            level = draw(st.integers(1, 2))
            text = f"setext{counter} {_phrase(draw, 0, 3)}".strip()
            blocks.append(text + "\n" + ("=" if level == 1 else "-") * draw(st.integers(1, 12)))
            headings.append((level, text))
        elif kind in ("para", "cjk"):
            lines = [(_phrase(draw) if kind == "para" else "".join(draw(st.lists(_CJK_WORDS, min_size=1, max_size=6))))
                     for _ in range(draw(st.integers(1, 4)))]
            blocks.append("\n".join(lines))
        elif kind == "fence":
            marker = draw(st.sampled_from(["```", "~~~", "````"]))
            other = "~~~" if marker.startswith("`") else "```"
            inner = draw(st.lists(st.sampled_from(
                [f"# fencecomment{counter}", f"## fencecomment{counter} deeper", other, "plain code = 1",
                 f"Fenced{counter}\n=====", "", "    indented", "#!/bin/sh"]), max_size=6))
            info = draw(st.sampled_from(["", "bash", "python"]))
            unclosed = position == n_blocks - 1 and draw(st.booleans())
            blocks.append("\n".join([marker + info, *inner] + ([] if unclosed else [marker])))
        elif kind == "table":
            rows = draw(st.integers(1, 4))
            blocks.append("\n".join(["| key | value |", "| --- | --- |"]
                                    + [f"| `k{i}` | {_phrase(draw, 1, 3)} # not a heading |" for i in range(rows)]))
        elif kind == "long":
            blocks.append(" ".join(draw(st.lists(_WORDS, min_size=40, max_size=300))))
        elif kind == "token":
            piece = draw(st.sampled_from(["1", "a", "1a", "aa1", "_", "漢"]))
            blocks.append(piece * draw(st.integers(30, 900)))
        elif kind == "list":
            blocks.append("\n".join(f"- {_phrase(draw, 1, 5)}" for _ in range(draw(st.integers(1, 4)))))
        elif kind == "quote":
            blocks.append(f"> # quoted{counter} heading\n> {_phrase(draw)}")
    separators = [draw(st.sampled_from(["\n\n", "\n\n\n", "\n\n  \n"])) for _ in blocks]
    body = "".join(b + s for b, s in zip(blocks, separators, strict=True))
    body = draw(st.sampled_from(["", "\n", "\n\n"])) + body
    has_frontmatter = draw(st.booleans())
    if has_frontmatter:
        mode = draw(st.sampled_from(["", "rag_chunk: headings\n", "rag_chunk: whole\n"]))
        body = f"---\ntitle: Generated\n{mode}---\n" + body
    return Generated(body, headings, has_frontmatter)


@HYPOTHESIS
@given(generated=markdown_documents(), mode=st.sampled_from(["whole", "headings"]),
       max_tokens=st.sampled_from([16, 40, 128, 512, 2048]), min_tokens=st.sampled_from([0, 8, 64]),
       context_factor=st.sampled_from([1, 2, 4]))
# Found by hypothesis: a heading-only section too big to join its neighbour until that neighbour
# was reshared with the next one, then left small beside it.
@example(generated=Generated("# head1\n\n##### head2 A\n\nA A AAAAAAAAAA かかかかかかかかかか かかかかかかかかかかか\n\n"
                             "かかかかかかかかかかかかかかかかかかかかかかかかかかかか\n"
                             "かかかかかかかかかかかかかかかかかかかかかかかかかかかかかかかかかかか\n\n> # quoted5 heading\n> A\n\n"
                             "setext6\n====\n\n###### head7 ###\n\n",
                             [(1, "head1"), (5, "head2 A"), (1, "setext6"), (6, "head7")], False),
         mode="whole", max_tokens=128, min_tokens=64, context_factor=1)
def test_chunker_invariants_on_generated_markdown(generated: Generated, mode: str, max_tokens: int,
                                                  min_tokens: int, context_factor: int) -> None:
    doc = dataclasses.replace(_doc(generated.text), chunk_mode=mode)
    context = max_tokens * context_factor
    chunks = rules.chunk_document(doc, max_tokens, min(min_tokens, max_tokens), context)
    assert_chunk_invariants(doc, chunks, max_tokens, min(min_tokens, max_tokens), context)
    body = list(doc.lines[doc.body_start - 1:])
    found = [(h.level, h.text) for h in rules.body_structure(body).headings]
    # Fence contents (`# ...`, setext-looking lines) and quoted headings are never section headings.
    assert found == generated.headings
    for chunk in chunks:
        assert "fencecomment" not in chunk.heading and "Fenced" not in chunk.heading
        assert "quoted" not in chunk.heading
        if chunk.heading:
            # Text before the first heading is headed by the title; a merged chunk names them all.
            parts = re.split(f"{rules.HEADING_SEPARATOR}|{rules.MERGED_HEADING_SEPARATOR}", chunk.heading)
            assert all(part in {text for _, text in generated.headings} | {doc.title} for part in parts)


@HYPOTHESIS
@given(generated=markdown_documents())
def test_headings_mode_starts_sections_at_headings(generated: Generated) -> None:
    doc = dataclasses.replace(_doc(generated.text), chunk_mode="headings")
    chunks = rules.chunk_document(doc, 512, 0)
    assert_chunk_invariants(doc, chunks, 512)
    # With no merging, no chunk has text before a heading it contains: headings open chunks.
    heading_lines = {h.line + doc.body_start for h in rules.body_structure(doc.lines[doc.body_start - 1:]).headings}
    for chunk in chunks:
        for line in heading_lines:
            if chunk.start_line < line <= chunk.end_line:
                assert not any(doc.lines[i - 1].strip() for i in range(chunk.start_line, line)), (chunk, line)


def test_setext_and_fenced_hash_lines() -> None:
    text = "\n".join([
        "Top title", "=========", "", "intro", "",
        "```bash", "# not a heading", "Not setext", "---", "```", "",
        "~~~", "## still code", "```", "# also code", "~~~", "",
        "Second", "------", "", "text", "",
        "    # indented code, not a heading", "",
        "> # quoted, not top level", "",
        "### Third {#third-anchor}", "", "body", ""])
    doc = _doc(text)
    found = [(h.level, h.text, h.line) for h in rules.body_structure(doc.lines).headings]
    assert found == [(1, "Top title", 0), (2, "Second", 17), (3, "Third", 26)]
    chunks = rules.chunk_document(dataclasses.replace(doc, chunk_mode="headings"), 512, 0)
    assert [c.heading for c in chunks] == ["Top title", "Top title > Second", "Top title > Second > Third"]
    assert [c.start_line for c in chunks] == [1, 18, 27]
    assert doc.title == "Top title"


def test_stray_carriage_return_does_not_shift_headings() -> None:
    # A lone CR is not a line break for the chunker's line numbers; the parser must agree.
    doc = _doc(b"# A\n\nfoo\rbar\r\n## B\n\ntext\n## C\n\nmore\n")
    assert [(h.line, h.text) for h in rules.body_structure(doc.lines).headings] == [(0, "A"), (3, "B"), (6, "C")]
    chunks = rules.chunk_document(dataclasses.replace(doc, chunk_mode="headings"), 512, 0)
    assert [(c.start_line, c.end_line, c.heading) for c in chunks] == [(1, 3, "A"), (4, 6, "A > B"), (7, 9, "A > C")]
    assert_chunk_invariants(doc, chunks, 512)


@pytest.mark.parametrize("line", ["1" * 12 + "a" * 12, "x " * 5 + "1" * 40, "a" * 30 + "1" * 30,
                                  "word " * 10 + "1" * 100, "漢" * 50, "_" * 70, "aa1" * 40])
def test_over_long_line_is_split_within_budget(line: str) -> None:
    doc = _doc(f"# T\n\n{line}\n\nafter\n")
    for max_tokens in (8, 16, 32):
        chunks = rules.chunk_document(dataclasses.replace(doc, chunk_mode="headings"), max_tokens, 0)
        assert_chunk_invariants(doc, chunks, max_tokens)
        if rules.searchable_tokens(line) > max_tokens:
            pieces = [c for c in chunks if c.start_line == 3]
            assert len(pieces) >= 2
            assert _squash("".join(c.text for c in pieces)) == _squash(line)


def test_deploy_runbook_heading_paths_and_rollout_split() -> None:
    doc, raw_lines = _sample("runbooks/deploy.md")
    assert doc.chunk_mode == "headings" and doc.body_start == 5
    chunks = rules.chunk_document(doc, rules.DEFAULT_CHUNK_MAX_TOKENS, rules.DEFAULT_CHUNK_MIN_TOKENS)
    assert_chunk_invariants(doc, chunks, rules.DEFAULT_CHUNK_MAX_TOKENS)
    headings = [c.heading for c in chunks]
    for expected in ("Deploy runbook", "Deploy runbook > Preconditions", "Deploy runbook > Preconditions > Change freezes",
                     "Deploy runbook > Rollout", "Deploy runbook > Rollback", "Deploy runbook > Rollback > Database",
                     "Deploy runbook > Rollback > Feature flags", "Deploy runbook > Troubleshooting",
                     "Deploy runbook > Troubleshooting > When deployctl itself is unavailable"):
        assert expected in headings, expected
    assert not any("#" in h or "deployctl migrations" in h or "Switch every region" in h for h in headings)
    # Line numbers are those of the raw file, frontmatter included.
    database = next(c for c in chunks if c.heading == "Deploy runbook > Rollback > Database")
    assert raw_lines[database.start_line - 1] == "### Database"
    troubleshooting = next(c for c in chunks if c.heading == "Deploy runbook > Troubleshooting")
    assert raw_lines[troubleshooting.start_line - 1:troubleshooting.start_line + 1] == ["Troubleshooting", "-" * 15]
    # The over-long Rollout section is split at paragraph boundaries, never inside a fence.
    rollout = [c for c in chunks if c.heading == "Deploy runbook > Rollout"]
    assert len(rollout) >= 5
    assert raw_lines[rollout[0].start_line - 1] == "## Rollout"
    fences = _fence_ranges(raw_lines)
    for chunk in rollout[1:]:
        assert raw_lines[chunk.start_line - 2] == "" and raw_lines[chunk.start_line - 1] != ""
    for chunk in chunks:
        for start, end in fences:
            assert not start < chunk.start_line <= end, (chunk.start_line, start, end)
    assert all(rules.estimate_tokens(c.text) <= rules.DEFAULT_CHUNK_MAX_TOKENS for c in rollout)


def _fence_ranges(lines: list[str]) -> list[tuple[int, int]]:
    """1-based (open, close) line numbers of fenced blocks, by a simple independent scan."""
    ranges, opened, marker = [], 0, ""
    for number, line in enumerate(lines, 1):
        m = re.match(r"^(`{3,}|~{3,})", line)
        if m and not opened:
            opened, marker = number, m.group(1)
        elif m and opened and line.strip() == marker:
            ranges.append((opened, number))
            opened = 0
    assert not opened
    return ranges


def test_small_sections_merge_with_a_neighbour() -> None:
    text = "# Guide\n\nshort intro\n\n## A\n\none line\n\n## B\n\nanother line\n\n## C\n\n" + \
        "\n\n".join(f"paragraph {i} " + "filler words here " * 12 for i in range(6)) + "\n"
    doc = dataclasses.replace(_doc(text), chunk_mode="headings")
    separate = rules.chunk_document(doc, 512, 0)
    merged = rules.chunk_document(doc, 512, 64)
    assert [c.heading for c in separate][:4] == ["Guide", "Guide > A", "Guide > B", "Guide > C"]
    assert len(merged) < len(separate)
    first = merged[0]
    assert "short intro" in first.text and "## A" in first.text and "## B" in first.text
    assert first.heading == "Guide > A; B; C"  # a merged chunk names every heading it covers
    assert_chunk_invariants(doc, merged, 512)


def test_merged_heading_names_the_first_path_then_each_covered_heading() -> None:
    assert rules.merged_heading([]) == ""
    assert rules.merged_heading(["Guide > Testing"]) == "Guide > Testing"
    assert rules.merged_heading(["Guide > Testing", "Guide > Setup", "Guide > Setup > Linux"]) == \
        "Guide > Testing; Setup; Linux"
    assert rules.merged_heading(["Guide", "Guide > Testing", "Guide > Testing > Unit", "Guide > Setup"]) == \
        "Guide > Testing > Unit; Setup"


def test_text_before_the_first_heading_carries_the_title() -> None:
    doc = _doc("---\ntitle: 用語集\n---\nintro " + "words " * 80 + "\n\n## A\n\n" + "more words " * 60 + "\n")
    chunks = rules.chunk_document(dataclasses.replace(doc, chunk_mode="headings"), 512, 8)
    assert [c.heading for c in chunks] == ["用語集", "A"]
    blank_intro = rules.chunk_document(_doc("\n\n# Title\n\ntext\n"), 512, 0)
    assert blank_intro[0].heading == "Title"  # blank lines before the first heading name nothing


def test_a_line_within_the_context_stays_whole_and_small_spans_join_over_the_budget() -> None:
    line = "word " * 150  # ~300 estimated tokens: over the budget, within the context
    doc = dataclasses.replace(_doc(f"# T\n\n{line}\n\n## Small\n\ntiny\n"), chunk_mode="headings")
    [whole] = rules.chunk_document(doc, 128, 64, 512)
    assert whole.heading == "T > Small" and line.strip() in whole.text
    pieces = rules.chunk_document(doc, 128, 64)  # the context is the budget: the line is cut
    assert len([c for c in pieces if c.start_line == 3]) >= 3


def test_a_cut_line_leaves_no_small_last_piece() -> None:
    line = "word " * 140  # 280 tokens: two full pieces of 128 and a 24-token tail, shared out instead
    chunks = rules.chunk_document(dataclasses.replace(_doc(f"{line}\n"), chunk_mode="headings"), 128, 64)
    assert len(chunks) == 3 and all(rules.searchable_tokens(c.text) >= 64 for c in chunks)


def test_whole_mode_is_one_chunk_when_it_fits_else_split_like_headings() -> None:
    doc, raw_lines = _sample("oncall/escalation.md")
    assert doc.chunk_mode == "whole"
    [only] = rules.chunk_document(doc, 2048, 64)
    assert (only.start_line, only.end_line) == (4, len(raw_lines) - 1) == (doc.body_start, doc.line_count)
    assert only.heading == "On-call escalation policy" and only.index == 0
    assert only.text == "\n".join(raw_lines[3:]).strip()
    small = rules.chunk_document(doc, 512, 64)
    assert len(small) > 1
    assert small == rules.chunk_document(dataclasses.replace(doc, chunk_mode="headings"), 512, 64)


def test_chunk_lines_match_the_raw_file_for_every_sample() -> None:
    for path in sorted(CORPUS.rglob("*.md")):
        rel = path.relative_to(CORPUS).as_posix()
        doc, raw_lines = _sample(rel)
        for max_tokens in (128, 512):
            chunks = rules.chunk_document(doc, max_tokens, 64)
            assert_chunk_invariants(doc, chunks, max_tokens)
            shared = {b.start_line for a, b in pairwise(chunks) if b.start_line == a.end_line}
            for chunk in chunks:
                source = "\n".join(raw_lines[chunk.start_line - 1:chunk.end_line])
                if shared & {chunk.start_line, chunk.end_line}:
                    assert chunk.text in source  # a piece of an over-long line
                else:
                    assert chunk.text == source.strip()


def test_empty_and_blank_bodies_make_no_chunks() -> None:
    for text in ("", "\n\n", "---\ntitle: x\n---\n", "---\ntitle: x\n---\n\n   \n"):
        assert rules.chunk_document(_doc(text), 512, 64) == []


# ---------------------------------------------------------------------------
# parse_document: frontmatter conventions and their errors.


def test_frontmatter_keys_and_defaults() -> None:
    plain = _doc("# Hello\n\ntext\n")
    assert (plain.rag, plain.chunk_mode, plain.lifecycle, plain.body_start) == (True, "whole", "active", 1)
    doc = _doc("---\nrag: false\nrag_chunk: headings\nlifecycle: superseded\n---\n# H\n")
    assert (doc.rag, doc.chunk_mode, doc.lifecycle, doc.body_start) == (False, "headings", "superseded", 6)
    assert _doc("---\nrag: true\nlifecycle: active\nrag_chunk: whole\n---\nx\n").rag is True
    assert _doc("---\n---\nbody\n").body_start == 3
    # An unclosed opening line is not frontmatter: the file is all body.
    unclosed = _doc("---\ntitle: nope\n")
    assert unclosed.body_start == 1 and unclosed.title == "doc"


@pytest.mark.parametrize(("raw", "reason"), [
    (b"---\nrag: maybe\n---\nx\n", "rag must be true or false"),
    (b"---\nrag: 'false'\n---\nx\n", "rag must be true or false"),
    (b"---\nrag: 0\n---\nx\n", "rag must be true or false"),
    (b"---\nrag: 1\n---\nx\n", "rag must be true or false"),
    (b"---\nrag: null\n---\nx\n", "rag must be true or false"),
    (b"---\nrag_chunk: paragraphs\n---\nx\n", "rag_chunk must be one of"),
    (b"---\nrag_chunk: Headings\n---\nx\n", "rag_chunk must be one of"),
    (b"---\nrag_chunk: [headings]\n---\nx\n", "rag_chunk must be one of"),
    (b"---\nlifecycle: archived\n---\nx\n", "lifecycle must be one of"),
    (b"---\nlifecycle: true\n---\nx\n", "lifecycle must be one of"),
    (b"---\ntitle: [unclosed\n---\nx\n", "malformed YAML"),
    (b"---\ntitle: a: b: c\n---\nx\n", "malformed YAML"),
    (b"---\n\tkey: tab\n---\nx\n", "malformed YAML"),
    (b"---\n- a\n- b\n---\nx\n", "frontmatter is not a mapping"),
    (b"---\njust a string\n---\nx\n", "frontmatter is not a mapping"),
    (b"# caf\xe9\n", "not UTF-8"),
    (b"\xff\xfe#\x00 \x00T\x00", "binary file"),
    (b"# ok\n\x00\n", "binary file"),
])
def test_invalid_documents_are_document_invalid_with_the_path(raw: bytes, reason: str) -> None:
    with pytest.raises(RagError) as caught:
        rules.parse_document(raw, "notes/bad file.md")
    assert caught.value.code is ErrorCode.DOCUMENT_INVALID
    assert caught.value.message.startswith("notes/bad file.md: ")
    assert reason in caught.value.message
    assert caught.value.hint


def test_toml_and_json_frontmatter_keep_exact_line_numbers() -> None:
    toml = _doc('+++\ntitle = "Hugo page"\nrag_chunk = "headings"\nlifecycle = "superseded"\n+++\n# Body\n\n## A\ntext\n')
    assert (toml.title, toml.chunk_mode, toml.lifecycle, toml.body_start) == ("Hugo page", "headings", "superseded", 6)
    assert toml.lines[toml.body_start - 1] == "# Body"
    json_fm = _doc('{\n  "title": "JSON page",\n  "rag": false\n}\n\n# Body\n')
    assert (json_fm.title, json_fm.rag, json_fm.body_start) == ("JSON page", False, 5)
    # Trailing white space on a boundary line, and blank lines after it, stay body lines.
    spaced = _doc("---   \ntitle: Spaced\n---  \n\n\n# Body\n")
    assert (spaced.title, spaced.body_start, spaced.lines[5]) == ("Spaced", 4, "# Body")
    chunks = rules.chunk_document(toml, 512, 0)
    assert chunks[0].start_line == 6 and chunks[-1].end_line == toml.line_count


@pytest.mark.parametrize(("raw", "reason"), [
    (b'+++\ntitle = "unclosed\n+++\nx\n', "malformed TOML frontmatter"),
    (b'+++\nrag = "no"\n+++\nx\n', "rag must be true or false"),
    (b'{\n"title": [1,\n}\nx\n', "malformed JSON frontmatter"),
    (b'{\n"rag": 1\n}\nx\n', "rag must be true or false"),
    (b"---\nx: &a [1]\ny: *a\n---\nx\n", "alias"),
    (b"---\ntitle: " + b"[" * 5000 + b"]" * 5000 + b"\n---\nx\n", "frontmatter"),
    (b"---\nlifecycle: " + b"x" * 100_000 + b"\n---\nx\n", "lifecycle must be one of"),
])
def test_invalid_toml_json_and_hostile_yaml_frontmatter(raw: bytes, reason: str) -> None:
    with pytest.raises(RagError) as caught:
        rules.parse_document(raw, "notes/bad.md")
    assert caught.value.code is ErrorCode.DOCUMENT_INVALID and reason in caught.value.message
    assert len(caught.value.message) < 600  # a value from the file is never quoted whole


def test_bom_and_crlf_before_frontmatter() -> None:
    doc = _doc(b"\xef\xbb\xbf---\r\ntitle: With BOM\r\nlifecycle: superseded\r\n---\r\n# Other\r\nline\r\n")
    assert (doc.title, doc.lifecycle, doc.body_start, doc.line_count) == ("With BOM", "superseded", 5, 6)
    assert doc.lines[4] == "# Other"


def test_title_rules() -> None:
    assert _doc("---\ntitle: From frontmatter\n---\n# H1 title\n").title == "From frontmatter"
    assert _doc("---\ntitle: '   '\n---\n# H1 title\n").title == "H1 title"
    assert _doc("intro\n\n## Second level\n\n# First H1\n\n# Later H1\n").title == "First H1"
    assert _doc("Setext one\n===\n").title == "Setext one"
    assert _doc("```\n# in code\n```\n\nplain\n", "dir/my-notes.md").title == "my-notes"
    assert _doc("no heading\n", "ja/ログ.md").title == "ログ"
    assert _doc("---\ntitle: \"  spaced\\n  out\\ttitle \"\n---\n").title == "spaced out title"
    nfd = "Cafe\u0301 notes"
    assert _doc(f"---\ntitle: {nfd}\n---\n").title == "Café notes"
    assert _doc(f"# {nfd}\n").title == "Café notes"
    assert _doc("x\n", unicodedata.normalize("NFC", "dir/cafe\u0301.md")).title == "café"
    assert _sample("reference/glossary.md")[0].title == "glossary"
    assert _sample("reference/api.md")[0].title == "Records API reference"
    assert _sample("ja/log-collection.md")[0].title == "ログ収集ガイド"
    assert _sample("runbooks/deploy-2023.md")[0].title == "Deploy runbook (2023, superseded)"


def test_sample_corpus_conventions() -> None:
    private, _ = _sample("private/offsite-backup.md")
    old, _ = _sample("runbooks/deploy-2023.md")
    assert private.rag is False
    assert (old.lifecycle, old.chunk_mode, old.superseded_by) == ("superseded", "headings", ("runbooks/deploy.md",))


def test_superseded_by_takes_a_path_or_a_list_normalised_like_a_clients() -> None:
    one = _doc("---\nlifecycle: superseded\nsuperseded_by: ./runbooks//deploy.md\n---\n# Old\n", "old.md")
    assert (one.superseded_by, one.warnings) == (("runbooks/deploy.md",), ())
    many = _doc('+++\nlifecycle = "superseded"\nsuperseded_by = ["a.md", "b/c.md", "a.md"]\n+++\n# Old\n', "old.md")
    assert (many.superseded_by, many.warnings) == (("a.md", "b/c.md"), ())
    composed = _doc("---\nlifecycle: superseded\nsuperseded_by: \"cafe\u0301.md\"\n---\n", "old.md")
    assert composed.superseded_by == ("caf\u00e9.md",)  # NFC, as the index spells paths
    assert _doc("# No frontmatter\n").superseded_by == ()


@pytest.mark.parametrize(("value", "why"), [
    ("../outside.md", "..'"), ("/etc/passwd.md", "absolute"), ("a\\\\b.md", "backslash"), ("''", "empty"),
    ("old.md", "itself"), ("./.", "not a path"), ("{a: 1}", "a dict"), ("12", "a corpus-relative path or a list"), ("[7]", "not a path"),
])
def test_bad_successors_are_left_out_with_a_warning_and_the_file_is_indexed(value: str, why: str) -> None:
    doc = _doc(f"---\nlifecycle: superseded\nsuperseded_by: {value}\n---\n# Old\n", "old.md")
    assert doc.rag and doc.lifecycle == "superseded" and doc.superseded_by == ()
    assert len(doc.warnings) == 1 and doc.warnings[0].startswith("old.md: superseded_by"), doc.warnings
    assert why in doc.warnings[0], doc.warnings


def test_superseded_by_counts_only_on_a_superseded_document() -> None:
    doc = _doc("---\nsuperseded_by: new.md\n---\n# Still active\n", "old.md")
    assert (doc.lifecycle, doc.superseded_by) == ("active", ())
    assert doc.warnings == ("old.md: superseded_by is ignored: the document is not `lifecycle: superseded`",)


def test_a_long_successor_list_is_cut_with_a_warning() -> None:
    names = [f"n{i}.md" for i in range(rules.SUCCESSORS_MAX + 5)]
    doc = _doc(f"---\nlifecycle: superseded\nsuperseded_by: {names}\n---\n", "old.md")
    assert doc.superseded_by == tuple(names[:rules.SUCCESSORS_MAX])
    assert len(doc.warnings) == 1 and "more than" in doc.warnings[0]
    garbage = _doc(f"---\nlifecycle: superseded\nsuperseded_by: {['../x.md'] * 50 + ['late.md']}\n---\n", "old.md")
    assert garbage.superseded_by == () and len(garbage.warnings) == 2 * rules.SUCCESSORS_MAX + 1
    assert "more than" in garbage.warnings[-1], "what was not looked at is said"


@HYPOTHESIS
@example(["."])
@given(st.one_of(st.none(), st.text(max_size=60), st.lists(st.one_of(st.text(max_size=30), st.integers()), max_size=15),
                 st.integers(), st.booleans(), st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3)))
def test_successors_are_valid_corpus_paths_whatever_the_value(value: object) -> None:
    successors, warnings = rules.successors_of(value, "old.md", "superseded")
    assert len(successors) <= rules.SUCCESSORS_MAX and len(set(successors)) == len(successors)
    assert all(rules.normalize_relative_path(s) == s != "old.md" for s in successors)
    assert rules.successors_from_column(rules.successors_column(successors)) == successors
    assert all(isinstance(w, str) and w.startswith("old.md: ") for w in warnings)
    assert value in (None, []) or successors or warnings, "what is left out is said"


# ---------------------------------------------------------------------------
# Token estimate: conservative for English and CJK.


@HYPOTHESIS
@given(st.text(max_size=400))
def test_estimate_never_below_the_fakes_count(text: str) -> None:
    assert rules.estimate_tokens(text) >= count_tokens(text)


def _estimate_piece_by_piece(text: str) -> int:
    """The token estimate as specified: each CJK character, digit and symbol one token, each run
    of Latin letters one per three letters (rounded up)."""
    cjk = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff66-\uff9f\uac00-\ud7af"
    pieces = re.findall(rf"[{cjk}]|[A-Za-z]+|\d|[^\sA-Za-z\d{cjk}]", text)
    return sum(-(-len(p) // 3) if p[0].isascii() and p[0].isalpha() else 1 for p in pieces)


@HYPOTHESIS
@given(st.text(max_size=400) | st.text(alphabet="日本語のログ abcXYZé0123`_\t\n\u3000\u00a0\x1c-", max_size=300))
def test_estimate_counts_what_it_specifies(text: str) -> None:
    assert rules.estimate_tokens(text) == _estimate_piece_by_piece(text)


_ENGLISH = st.lists(
    st.tuples(st.text("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ", min_size=1, max_size=14),
              st.sampled_from([" ", " ", " ", ", ", ". ", "; ", "-", "\n", "'s "])),
    min_size=1, max_size=80).map(lambda pairs: "".join(w + s for w, s in pairs))


@HYPOTHESIS
@given(_ENGLISH)
def test_estimate_is_at_least_a_quarter_of_english_characters(text: str) -> None:
    assert rules.estimate_tokens(text) >= len(text) / 4


@HYPOTHESIS
@given(st.text(alphabet="日本語のログ収集ガイドですシッパー設定。、「」 abcXYZ0123`_", max_size=300))
def test_estimate_counts_every_cjk_character(text: str) -> None:
    assert rules.estimate_tokens(text) >= len(CJK_RE.findall(text))


def test_estimate_on_the_sample_corpus() -> None:
    for path in sorted(CORPUS.rglob("*.md")):
        text = path.read_text(encoding="utf-8")
        assert rules.estimate_tokens(text) >= count_tokens(text)
        assert rules.estimate_tokens(text) >= len(CJK_RE.findall(text))
        if not CJK_RE.search(text):
            assert rules.estimate_tokens(text) >= len(text) / 4


# ---------------------------------------------------------------------------
# Searchable text: URL payloads shortened for embedding and keywords.

PLAYGROUND = "https://play.vuejs.org/#eNp9kMFqwzAMhl9F+NSypjj0lqWFMXaaNjZ3tHYcAqxZhhSrmjGE2cEyvtZwUj1dSgRvOqRdIo56ZIJFWvmgMLbIXYW1K7cHtt0m"
SHA256 = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"


@pytest.mark.parametrize(("text", "expected"), [
    (f"[Playground で試す]({PLAYGROUND})", "[Playground で試す](https://play.vuejs.org/#\u2026)"),
    ("see https://vite.dev/guide/api-plugin?raw=1&x=2#hooks.", "see https://vite.dev/guide/api-plugin?\u2026"),
    # ASCII only: Japanese prose that follows a URL unspaced is not part of it.
    ("https://vite.dev/config/#server-host を参照", "https://vite.dev/config/#\u2026 を参照"),
    ("https://vite.dev/config/#hostを参照", "https://vite.dev/config/#\u2026を参照"),
    ("![x](data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAAB==)", "![x](data:image/png;base64,\u2026)"),
    ("url(data:,Hello%2C%20World)", "url(data:,\u2026)"),
    ("[features](./features#npm-dependency-resolving)", "[features](./features#\u2026)"),
    ("[api](/guide/api?tab=1)", "[api](/guide/api?\u2026)"),
    ("blob " + "aGVsbG8gd29ybGQgdGhpcyBpcyBhIGxvbmcgYmFzZTY0IHN0cmluZyB3aXRoIGRpZ2l0cw==" + " end", "blob \u2026 end"),
    ("digest " + "0123456789abcdef" * 5, "digest \u2026"),
])
def test_searchable_text_shortens_payloads(text: str, expected: str) -> None:
    assert rules.searchable_text(text) == expected


@pytest.mark.parametrize("text", [
    f"sha256 {SHA256} and git sha 1f6a3c9e0b7d2a4c5e8f9a0b1c2d3e4f5a6b7c8d",
    "https://vite.dev/guide/features.html and https://github.com/vitejs/vite/tree/main/packages/vite",
    "packages/vite/src/node/plugins/importAnalysisBuild/some_long_file_name_with_parts_2.ts",
    "VITE_" + "_".join(["SOME_LONG_ENVIRONMENT_VARIABLE"] * 3),
    "a" * 100, "1" * 100, "import svg from './icon.svg?raw'", "{ data: value }", "color: #fff;",
])
def test_searchable_text_keeps_what_people_search_for(text: str) -> None:
    assert rules.searchable_text(text) == text


def test_searchable_text_keeps_link_text_host_and_path_as_terms() -> None:
    terms = set(rules.keyword_terms(rules.searchable_text(f"[Playground で試す]({PLAYGROUND})")))
    assert {"playground", "https://play.vuejs.org", "vuejs", "で試", "試す"} <= terms
    assert not any(len(term) > 30 for term in terms)


_URLISH = st.text(alphabet="ab9Z=_-+/.:?#&%()[]!data ,;\n\u3042" + rules.PAYLOAD_MARK, max_size=80)


@HYPOTHESIS
@given(text=st.one_of(_URLISH, st.text(max_size=80),
                      st.builds("".join, st.lists(st.sampled_from([
                          "https://", "data:", "image/png;base64,", "](", ")", "?", "#", "/", " ", "\n", "x",
                          "aB3" * 25, "f0" * 40, "あ", "=", rules.PAYLOAD_MARK]), max_size=12))))
def test_searchable_text_is_idempotent_shorter_and_line_local(text: str) -> None:
    once = rules.searchable_text(text)
    assert rules.searchable_text(once) == once
    assert len(once) <= len(text)
    assert once.count("\n") == text.count("\n")
    assert "\n".join(rules.searchable_text(line) for line in text.split("\n")) == once


# ---------------------------------------------------------------------------
# Keyword terms and FTS5 expressions.


@pytest.mark.parametrize(("text", "expected"), [
    ("set OLLAMA_KEEP_ALIVE=5m", {"ollama_keep_alive", "ollama", "keep", "alive"}),
    ("POST /api/v1/records", {"post", "api/v1/records", "api", "v1", "records"}),
    ("raise num_ctx", {"num_ctx", "num", "ctx"}),
    ("error E1234 again", {"e1234"}),
    ("the v-model directive", {"v-model", "model", "directive"}),
    ("call defineProps()", {"defineprops", "define", "props"}),
    ("retry.max_attempts", {"retry.max_attempts", "retry", "max", "attempts"}),
])
def test_identifiers_keep_their_shape(text: str, expected: set[str]) -> None:
    terms = rules.keyword_terms(text)
    assert expected <= set(terms)
    assert "the" not in terms


def test_cjk_bigrams() -> None:
    terms = rules.keyword_terms("ログ収集の設定 LOG_RETENTION_DAYS")
    assert {"ログ", "グ収", "収集", "集の", "の設", "設定", "log_retention_days"} <= set(terms)
    assert rules.keyword_terms("東") == ["東"]


def _fts_db() -> sqlite3.Connection:
    con = sqlite3.connect(":memory:", isolation_level=None)
    rules.migrate_keyword_index(con, rules.PREFIX_SCHEMES["none"])
    return con


def _search(con: sqlite3.Connection, expression: str) -> list[int]:
    weights = ", ".join(str(w) for w in rules.FTS_WEIGHTS)
    return [row[0] for row in con.execute(
        f"SELECT rowid FROM chunks_fts WHERE chunks_fts MATCH ? ORDER BY bm25(chunks_fts, {weights})", (expression,))]


_NASTY = st.text(alphabet=st.characters(codec="utf-8"), max_size=120) | st.sampled_from([
    '"', '""', "*", "a*", "NEAR(a b)", "a AND b", "NOT x", "-x", "title:foo", "^start", "(", ")", "{a b}:c",
    "a OR", "OR", "AND", "'", "\\", "'; DROP TABLE chunks; --", "\x00", "col : \"x", "+", "a:b:c", "$@", "_._",
])


@HYPOTHESIS
@given(_NASTY)
@example("NEAR(\"x\" y, 3)")
@example("日本語" * 30)
def test_fts_expression_is_always_valid_fts5(text: str) -> None:
    con = _fts_db()
    con.execute("INSERT INTO chunks_fts(rowid, title, heading, body) VALUES (1, 'a', 'b', ?)",
                (" ".join(rules.keyword_terms(text)),))
    expression = rules.fts_any(rules.query_terms(text))
    if expression is None:
        assert rules.keyword_terms(text) == []
        return
    found = _search(con, expression)  # must not raise: user text is never FTS5 syntax
    # The same tokenizer on both sides: a text finds its own row.
    assert found == [1]


def test_fts_expression_none_for_stop_words_and_punctuation() -> None:
    assert rules.fts_any(rules.query_terms("the of and")) is None
    assert rules.fts_any(rules.query_terms("  ... ---  ")) is None
    assert rules.fts_any(rules.query_terms("")) is None


# ---------------------------------------------------------------------------
# Relative paths from clients.


@pytest.mark.parametrize("raw", [
    "..", "../x.md", "a/../b.md", "a/..", "./..", "a/./../../etc/passwd", "a//..//b", "../", "x/../../",
    "/etc/passwd", "/", "~", "~/x.md", "~root/x.md", "C:/x.md", "c:x.md",
    "a\x00b.md", "a\\b.md", "..\\x.md", "a\nb.md", "a\tb.md", "a\x1bb.md", "a\x7fb.md", "a\x85b.md",
])
def test_rejected_paths(raw: str) -> None:
    with pytest.raises(RagError) as caught:
        rules.normalize_relative_path(raw)
    assert caught.value.code is ErrorCode.PATH_REJECTED


def test_accepted_paths_are_normalised() -> None:
    assert rules.normalize_relative_path("runbooks/deploy.md") == "runbooks/deploy.md"
    assert rules.normalize_relative_path("./runbooks//deploy.md/") == "runbooks/deploy.md"
    assert rules.normalize_relative_path("cafe\u0301.md") == "caf\u00e9.md"
    assert rules.normalize_relative_path("\u304b\u3099.md") == "\u304c.md"
    assert rules.normalize_relative_path("%2e%2e/x.md") == "%2e%2e/x.md"
    assert rules.normalize_relative_path("...md") == "...md"
    assert rules.normalize_relative_path("", allow_empty=True) == ""
    with pytest.raises(RagError) as caught:
        rules.normalize_relative_path("")
    assert caught.value.code is ErrorCode.INVALID_ARGUMENT


@HYPOTHESIS
@given(st.lists(st.sampled_from(["..", ".", "", "a", "b.md", "~", "/", "\\", "é", "e\u0301", " ", "x..y", "\x00"]),
                max_size=8).map("/".join) | st.text(max_size=60))
def test_normalised_paths_never_escape(raw: str) -> None:
    try:
        out = rules.normalize_relative_path(raw, allow_empty=True)
    except RagError as exc:
        assert exc.code in (ErrorCode.PATH_REJECTED, ErrorCode.INVALID_ARGUMENT)
        return
    assert ".." not in out.split("/")
    assert not out.startswith(("/", "~"))
    assert "\\" not in out and "\x00" not in out
    assert not any(unicodedata.category(ch) == "Cc" for ch in out)
    assert out == unicodedata.normalize("NFC", out)
    assert "" not in out.split("/") or out == ""


# ---------------------------------------------------------------------------
# Prefix registry, model names, manifest.


@pytest.mark.parametrize(("model", "scheme"), [
    ("embeddinggemma", "embeddinggemma"),
    ("embeddinggemma:300m", "embeddinggemma"),
    ("library/EmbeddingGemma:latest", "embeddinggemma"),
    ("nomic-embed-text", "nomic-embed-text"),
    ("nomic-embed-text:v1.5", "nomic-embed-text"),
    ("multilingual-e5-small", "e5"),
    ("jeffh/intfloat-multilingual-e5-large:f16", "e5"),
    ("e5-base-v2", "e5"),
    ("mxbai-embed-large", "mxbai-embed-large"),
    ("snowflake-arctic-embed", "snowflake-arctic-embed"),
    ("snowflake-arctic-embed:335m", "snowflake-arctic-embed"),
    ("snowflake-arctic-embed2", "snowflake-arctic-embed2"),
    ("snowflake-arctic-embed2:568m", "snowflake-arctic-embed2"),
    ("bge-m3", "bge-m3"),
    ("bge-m3:567m", "bge-m3"),
])
def test_prefix_scheme_registry(model: str, scheme: str) -> None:
    found = rules.prefix_scheme_for(model)
    assert found is not None and found.name == scheme


@pytest.mark.parametrize("model", ["all-minilm", "granite-embedding", "some5-model", "bge-large", "mystery"])
def test_unknown_models_get_no_scheme(model: str) -> None:
    assert rules.prefix_scheme_for(model) is None


def test_prefix_texts() -> None:
    gemma = rules.PREFIX_SCHEMES["embeddinggemma"]
    assert gemma.document_text("Deploy", "body") == "title: Deploy | text: body"
    assert gemma.document_text("", "body") == "title: none | text: body"
    assert gemma.query_text("how to roll back") == "task: search result | query: how to roll back"
    nomic = rules.PREFIX_SCHEMES["nomic-embed-text"]
    assert (nomic.document_text("t", "x"), nomic.query_text("q")) == ("search_document: x", "search_query: q")
    e5 = rules.PREFIX_SCHEMES["e5"]
    assert (e5.document_text("t", "x"), e5.query_text("q")) == ("passage: x", "query: q")
    for name in ("mxbai-embed-large", "snowflake-arctic-embed"):
        scheme = rules.PREFIX_SCHEMES[name]
        assert scheme.document_text("t", "x") == "x"
        assert scheme.query_text("q") == "Represent this sentence for searching relevant passages: q"
    arctic2 = rules.PREFIX_SCHEMES["snowflake-arctic-embed2"]
    assert (arctic2.document_text("t", "x"), arctic2.query_text("q")) == ("x", "query: q")
    bge = rules.PREFIX_SCHEMES["bge-m3"]
    assert (bge.document_text("t", "x"), bge.query_text("q")) == ("x", "q")
    # Braces in user text are not format fields.
    assert gemma.query_text("{title} {0}") == "task: search result | query: {title} {0}"
    assert gemma.document_text("{x}", "GET /api/v1/records/{id}") == "title: {x} | text: GET /api/v1/records/{id}"


def test_embedded_document_text_leads_with_the_heading_path() -> None:
    gemma = rules.PREFIX_SCHEMES["embeddinggemma"]
    assert rules.embedded_document_text(gemma, "Deploy runbook", "Deploy runbook > Rollback", "text") == \
        "title: Deploy runbook | text: Deploy runbook > Rollback\n\ntext"
    assert rules.embedded_document_text(gemma, "T", "T", "text") == "title: T | text: text"
    assert rules.embedded_document_text(gemma, "T", "", "text") == "title: T | text: text"


def test_same_model() -> None:
    assert rules.same_model("embeddinggemma", "embeddinggemma:latest")
    assert rules.same_model("EmbeddingGemma:latest", "embeddinggemma")
    assert rules.same_model(" embeddinggemma ", "embeddinggemma")
    assert not rules.same_model("embeddinggemma", "embeddinggemma:300m")
    assert not rules.same_model("embeddinggemma", "nomic-embed-text")
    assert rules.model_base_name("library/EmbeddingGemma:latest") == "embeddinggemma"


def _manifest(**changes: object) -> rules.IndexManifest:
    base = rules.IndexManifest(model="embeddinggemma", dims=768, prefix_scheme="embeddinggemma",
                               chunker_version=rules.CHUNKER_VERSION, chunk_max_tokens=512, chunk_min_tokens=64)
    return dataclasses.replace(base, **changes)


def test_manifest_fingerprint() -> None:
    base = _manifest()
    assert base.fingerprint() == _manifest().fingerprint()
    assert base.index_name() == f"idx-{base.fingerprint()}"
    assert re.fullmatch(r"idx-[0-9a-f]{12}", base.index_name())
    assert _manifest(tool_version="9.9.9").fingerprint() == base.fingerprint()
    assert _manifest(model="embeddinggemma:latest").fingerprint() == base.fingerprint()
    changed = [_manifest(model="nomic-embed-text"), _manifest(model="embeddinggemma:300m"), _manifest(dims=256),
               _manifest(prefix_scheme="none"), _manifest(chunker_version="999"), _manifest(chunk_max_tokens=256),
               _manifest(chunk_min_tokens=0), _manifest(model="someone/embeddinggemma")]
    prints = {m.fingerprint() for m in changed}
    assert base.fingerprint() not in prints and len(prints) == len(changed)
    # Two different users' builds of a model are two models.
    assert _manifest(model="a/bge-m3").fingerprint() != _manifest(model="b/bge-m3").fingerprint()
    assert rules.IndexManifest.from_dict(base.to_dict()) == base
    assert rules.IndexManifest.from_dict({**base.to_dict(), "future_field": 1}) == base


def test_current_index_round_trip(tmp_path: Path) -> None:
    layout = rules.StoreLayout(tmp_path)
    assert layout.read_current() is None
    current = rules.CurrentIndex(index=_manifest().index_name(), generation=3, manifest=_manifest(),
                                 stamp=rules.IndexStamp(commit=None, dirty=None, ingested_at="t", files=2, chunks=5))
    layout.write_current(current)
    assert layout.read_current() == current
    assert not (tmp_path / "CURRENT.tmp").exists()
    layout.current_file.write_text("{not json", encoding="utf-8")
    with pytest.raises(RagError) as caught:
        layout.read_current()
    assert caught.value.code is ErrorCode.INDEX_INCOMPATIBLE


def test_chunk_ids_depend_on_content() -> None:
    a = rules.chunk_id("x.md", rules.content_hash(b"one"), 0)
    assert a == rules.chunk_id("x.md", rules.content_hash(b"one"), 0)
    assert len({a, rules.chunk_id("x.md", rules.content_hash(b"two"), 0), rules.chunk_id("y.md", rules.content_hash(b"one"), 0),
                rules.chunk_id("x.md", rules.content_hash(b"one"), 1)}) == 4


# ---------------------------------------------------------------------------
# Settings.

def test_settings_defaults_do_not_depend_on_the_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    s = rules.load_settings({})
    assert (s.corpus_dir, s.corpus_dir_explicit) == (ROOT / "sample-corpus", False)
    assert s.store_dir == tmp_path / "home" / ".local-rag-mcp" / "store"
    assert (s.ollama_host, s.embed_model, s.embed_model_explicit) == ("http://127.0.0.1:11434", "embeddinggemma", False)
    assert (s.chunk_max_tokens, s.chunk_min_tokens, s.embed_timeout_s) == (512, 64, 60.0)
    assert rules.load_settings({name: "  " for name in rules.ENVIRONMENT}) == s


def test_settings_precedence_and_expansion(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    env = {"RAG_CORPUS_DIR": "~/docs", "RAG_STORE_DIR": "rel/store", "OLLAMA_HOST": "127.0.0.1:9999",
           "RAG_EMBED_MODEL": "nomic-embed-text", "RAG_EMBED_TIMEOUT": "2.5", "RAG_CHUNK_MAX_TOKENS": "100",
           "RAG_CHUNK_MIN_TOKENS": "50"}
    s = rules.load_settings(env)
    assert (s.corpus_dir, s.corpus_dir_explicit) == (tmp_path / "docs", True)
    assert s.store_dir == tmp_path / "rel" / "store"
    assert (s.ollama_host, s.embed_model, s.embed_model_explicit) == ("http://127.0.0.1:9999", "nomic-embed-text", True)
    assert (s.embed_timeout_s, s.chunk_max_tokens, s.chunk_min_tokens) == (2.5, 100, 50)
    over = rules.load_settings(env, corpus_dir="~/other", store_dir=str(tmp_path / "abs"))
    assert (over.corpus_dir, over.store_dir) == (tmp_path / "other", tmp_path / "abs")
    assert over.corpus_dir.is_absolute()
    assert "corpus=" in over.describe() and "model=nomic-embed-text" in over.describe()


@pytest.mark.parametrize("env", [{"RAG_EMBED_TIMEOUT": "soon"}, {"RAG_EMBED_TIMEOUT": "0"},
                                 {"RAG_EMBED_TIMEOUT": "nan"}, {"RAG_EMBED_TIMEOUT": "inf"},
                                 {"RAG_CHUNK_MAX_TOKENS": "big"}, {"RAG_CHUNK_MAX_TOKENS": "8"},
                                 {"RAG_CHUNK_MIN_TOKENS": "-1"}, {"RAG_STORE_TIMEOUT": "-5"},
                                 {"RAG_STORE_TIMEOUT": "forever"}, {"RAG_LOG_LEVEL": "chatty"},
                                 {"RAG_SERVER_WARMUP": "maybe"},
                                 {"RAG_CHUNK_MIN_TOKENS": "600", "RAG_CHUNK_MAX_TOKENS": "512"},
                                 {"OLLAMA_HOST": "127.0.0.1:xx"}, {"OLLAMA_HOST": ":99999"},
                                 {"OLLAMA_HOST": "127.0.0.1:99999"}, {"OLLAMA_HOST": "ftp://127.0.0.1:11434"},
                                 {"OLLAMA_HOST": "http://"}, {"OLLAMA_HOST": "127.0.0.1 :11434"},
                                 {"OLLAMA_HOST": "127.0.0.1:11434?x=1"}])
def test_invalid_settings(env: dict[str, str]) -> None:
    with pytest.raises(RagError) as caught:
        rules.load_settings(env)
    assert caught.value.code is ErrorCode.INVALID_ARGUMENT
    assert caught.value.message.startswith("configuration error: ") and next(iter(env)) in caught.value.message
    assert next(iter(env)) in caught.value.hint


@pytest.mark.parametrize(("raw", "host"), [("127.0.0.1:11434 ", "http://127.0.0.1:11434"),
                                           ("\tgpu-box", "http://gpu-box"),
                                           ("https://ollama.internal/base/", "https://ollama.internal/base"),
                                           ("[::1]:11434", "http://[::1]:11434")])
def test_ollama_host_in_the_forms_ollama_reads(raw: str, host: str) -> None:
    assert rules.load_settings({"OLLAMA_HOST": raw}).ollama_host == host


def test_server_knobs_are_settings_too() -> None:
    defaults = rules.load_settings({})
    assert (defaults.store_timeout_s, defaults.log_level, defaults.server_warmup) == (20.0, "INFO", True)
    tuned = rules.load_settings({"RAG_STORE_TIMEOUT": "2.5", "RAG_LOG_LEVEL": "debug", "RAG_SERVER_WARMUP": "0"})
    assert (tuned.store_timeout_s, tuned.log_level, tuned.server_warmup) == (2.5, "DEBUG", False)


# ---------------------------------------------------------------------------
# OllamaEmbedder against the fake over HTTP.


def test_embedder_model_info_and_embed(fake_ollama: FakeOllama) -> None:
    fake_ollama.configure(context_length=1024, dims=384)
    embedder = rules.OllamaEmbedder(fake_ollama.host, "embeddinggemma", 5)
    assert embedder.model_info() == rules.ModelInfo(context_length=1024, dims=384)
    vectors = embedder.embed(["one", "two"])
    assert len(vectors) == 2 and all(len(v) == 384 for v in vectors)
    body = [b for m, p, b in fake_ollama.requests if p == "/api/embed"][-1]
    assert body["truncate"] is False


def test_embedder_errors(fake_ollama: FakeOllama) -> None:
    missing = rules.OllamaEmbedder(fake_ollama.host, "nomic-embed-text", 5)
    with pytest.raises(RagError) as caught:
        missing.model_info()
    assert caught.value.code is ErrorCode.MODEL_NOT_FOUND and "ollama pull nomic-embed-text" in caught.value.hint
    embedder = rules.OllamaEmbedder(fake_ollama.host, "embeddinggemma", 0.5)
    fake_ollama.configure(max_input_tokens=3)
    with pytest.raises(rules.InputTooLong):
        embedder.embed(["one two three four five"])
    fake_ollama.configure(max_input_tokens=None, fail_after=0)
    with pytest.raises(RagError) as caught:
        embedder.embed(["x"])
    assert caught.value.code is ErrorCode.EMBEDDER_UNAVAILABLE and "500" in caught.value.message
    fake_ollama.configure(fail_after=None, delay_seconds=2)
    with pytest.raises(RagError) as caught:
        embedder.embed(["x"])
    assert caught.value.code is ErrorCode.EMBEDDER_UNAVAILABLE and "did not answer" in caught.value.message
    fake_ollama.configure(delay_seconds=0)
    fake_ollama.stop()
    with pytest.raises(RagError) as caught:
        rules.OllamaEmbedder(fake_ollama.host, "embeddinggemma", 2).model_info()
    assert caught.value.code is ErrorCode.EMBEDDER_UNAVAILABLE
    assert "start Ollama" in caught.value.hint and "ollama pull embeddinggemma" in caught.value.hint


# ---------------------------------------------------------------------------
# Identifiers in queries, language shares, corpus facts, calibration.


@pytest.mark.parametrize(("query", "identifiers"), [
    ("OLLAMA_KEEP_ALIVE", ["OLLAMA_KEEP_ALIVE"]),
    ("what is num_ctx in a Modelfile?", ["num_ctx"]),
    ("v-model と defineProps の違い", ["v-model", "defineProps"]),
    ("server.fs.allow を設定すると", ["server.fs.allow"]),
    ("ENOSPC エラーが出る", ["ENOSPC"]),
    ("error E4291 on /api/v1/records", ["E4291", "/api/v1/records"]),
    ("uv sync --no-install-project vs --no-install-workspace", ["--no-install-project", "--no-install-workspace"]),
    ("how do I declare a sev-1?", ["sev-1"]),
    ("use `uv run --frozen` and `pyproject.toml`", ["--frozen", "pyproject.toml"]),
    ("the ReplicaSet of the deploy", ["ReplicaSet"]),
    # Japanese written straight against the code: the script change ends the identifier.
    ("v-modelを使うとき", ["v-model"]),
    ("item.idをキーにする", ["item.id"]),
    # Calls are code whatever the name; a sentence's punctuation is not part of a name.
    ("ref()とreactive()の違いは？", ["ref()", "reactive()"]),
    ("Linux で `Error: ENOSPC: System limit` が出る", ["ENOSPC"]),
    ("update the file(s) and the item(s)", []),
    ("0B( is no call", []),
    ("what does error QZX-7781 mean? see PROJ-1234", ["QZX-7781", "PROJ-1234"]),
    ("READ-ONLY and ON-CALL are shouted words", []),
    # Ordinary English: hyphenated words, abbreviations, sentence ends, plain capitals.
    ("who is on-call for read-only replicas, e.g. at night? The API and HTTP are fine.", []),
    ("", []),
])
def test_query_identifiers(query: str, identifiers: list[str]) -> None:
    assert rules.query_identifiers(query) == identifiers


@given(st.text(max_size=200))
@HYPOTHESIS
def test_query_identifiers_are_whole_terms_of_the_query(query: str) -> None:
    found = rules.query_identifiers(query)
    assert len(found) <= rules.IDENTIFIERS_MAX
    terms = set(rules.keyword_terms(query))
    for identifier in found:
        term = rules.identifier_term(identifier)
        assert term is not None and term in terms, (identifier, term)


def test_cjk_share() -> None:
    assert rules.cjk_share("Deploy runbook: roll back") == 0.0
    assert rules.cjk_share("ログ収集ガイド") == 1.0
    assert rules.cjk_share("1234 !!") == 0.0


def test_a_text_reads_as_cjk_from_a_tenth_of_its_letters() -> None:
    """Latin words count several letters each: a Japanese question naming identifiers and a
    Japanese section that is mostly code are mostly Latin letters, and still Japanese; an English
    sentence quoting one Japanese word is not."""
    question = rules.cjk_share("v-model と defineProps の違い")
    assert question < 0.3 and rules.reads_as_cjk(question)
    code = rules.cjk_share("## 条件付きの適用\n\n```js\nexport default defineConfig({\n"
                           "  plugins: [{ ...typescript(), apply: 'build' }],\n})\n```")
    assert rules.reads_as_cjk(code)
    assert not rules.reads_as_cjk(rules.cjk_share("The Japanese guide calls the build settings 設定 in its reference."))
    assert not rules.reads_as_cjk(0.0)


def test_corpus_facts_count_languages_and_top_level_folders() -> None:
    rows = [("docs/a.md", "active", 0.0), ("docs/b.md", "superseded", 0.01), ("guide/c.md", "active", 0.9),
            ("guide/code-heavy.md", "active", 0.29), ("README.md", "active", None)]
    facts = rules.corpus_facts(rows)
    assert (facts.documents, facts.superseded, facts.cjk_documents) == (5, 1, 2)
    assert facts.folders == 2, "docs/ and guide/: counted, never named"
    assert rules.CorpusFacts.from_json(facts.to_json()) == facts
    # Facts an older ingest wrote named the biggest folders: no count is made of them.
    legacy = '{"documents": 5, "superseded": 1, "cjk_documents": 2, "folders": [["docs/", 2]]}'
    assert rules.CorpusFacts.from_json(legacy).folders is None


def test_calibration_sample_is_spread_and_stable() -> None:
    rows = [(f"id{i:03d}", f"doc{i % 5}.md", f"Title > Section number {i}") for i in range(100)]
    picked = rules.calibration_queries(rows, limit=12)
    assert len(picked) == 12 and picked == rules.calibration_queries(list(reversed(rows)), limit=12)
    per_doc = {path: sum(1 for p, _ in picked if p == path) for path, _ in picked}
    assert max(per_doc.values()) <= rules.CALIBRATION_PER_DOCUMENT
    assert rules.calibration_queries([("a", "x.md", "Intro")]) == []  # one word is not a question


def test_margin_and_calibration() -> None:
    assert rules.margin([0.9, 0.8, 0.8, 0.7]) == pytest.approx(0.9 - 0.7666666, abs=1e-6)
    assert rules.margin([0.8, 0.9, 0.7], best=0.75) == pytest.approx(0.75 - 0.75)
    assert rules.margin([0.9, 0.8]) is None
    # Each heading's own document first, then the crowd: answered margin 0.1 above 0.7s, while
    # among the other documents alone the best stands 0.02 above the rest.
    neighbours = [(f"d{i}.md", [(f"d{i}.md", 0.8), ("o1.md", 0.72), ("o2.md", 0.70), ("o3.md", 0.70)])
                  for i in range(5)]
    calibration = rules.calibrate(neighbours, chunks=50)
    assert calibration is not None and calibration.queries == 5
    assert calibration.related == pytest.approx(0.8 - 0.70666666, abs=1e-5)
    assert calibration.unrelated == pytest.approx(0.02, abs=1e-6)
    assert calibration.position(calibration.unrelated) == pytest.approx(0.0)
    assert calibration.position(calibration.related) == pytest.approx(1.0)
    assert rules.calibrate(neighbours[:3], chunks=50) is None
    missed = [(own, [found[1], found[0], *found[2:]]) for own, found in neighbours]  # own doc not first
    assert rules.calibrate(missed, chunks=50) is None
    with pytest.raises(ValueError):
        rules.Calibration.from_json('{"unrelated": NaN, "related": 0.9, "queries": 5, "chunks": 1}')


# ---------------------------------------------------------------------------
# A VitePress page: playground links, <script setup>, a wide table, minified JSON, ::: tip.

VITEPRESS = Path(__file__).resolve().parent / "data" / "vitepress-list.md"


def _fragments(chunks: list[Chunk], min_tokens: int) -> list[Chunk]:
    """Chunks under the minimum in a document of several chunks, and chunks sharing a line."""
    return [c for c in chunks if (len(chunks) > 1 and rules.searchable_tokens(c.text) < min_tokens)
            or any(o is not c and o.start_line <= c.end_line and c.start_line <= o.end_line for o in chunks)]


def test_vitepress_page_has_no_fragments_within_the_models_context() -> None:
    doc = rules.parse_document(VITEPRESS.read_bytes(), "guide/list.md")
    chunks = rules.chunk_document(doc, 436, 64, 2036)  # embeddinggemma: 2048 tokens of context
    assert_chunk_invariants(doc, chunks, 436, 64, 2036)
    assert _fragments(chunks, 64) == []
    for chunk in chunks:
        assert chunk.text == "\n".join(doc.lines[chunk.start_line - 1:chunk.end_line]).strip()
    assert chunks[0].heading.startswith("リストレンダリング")  # the intro carries the title
    playground = [c for c in chunks if "[Playground で試す](https://play.vuejs.org/#" in c.text]
    assert len(playground) == 3 and all("## " in c.text or "```" in c.text for c in playground)


def test_vitepress_line_over_the_context_is_cut_outside_urls_into_real_pieces() -> None:
    doc = rules.parse_document(VITEPRESS.read_bytes(), "guide/list.md")
    chunks = rules.chunk_document(doc, 436, 64, 497)  # a 512-token model
    assert_chunk_invariants(doc, chunks, 436, 64, 497)
    json_line = next(i for i, line in enumerate(doc.lines, 1) if line.startswith('{"name"'))
    pieces = [c for c in chunks if c.start_line == c.end_line == json_line]
    assert len(pieces) >= 2
    assert all(64 <= rules.searchable_tokens(p.text) <= 436 for p in pieces)
    assert {c.start_line for c in _fragments(chunks, 64) if c.start_line == c.end_line} == {json_line}
    assert sum("https://vuejs.org/guide/essentials/list.html#maintaining-state-with-key" in p.text for p in pieces) == 1
    # The playground lines (1.5 KB of base64 each) cost a few tokens and stay whole.
    for number, line in enumerate(doc.lines, 1):
        if line.startswith("[Playground"):
            assert any(c.start_line <= number <= c.end_line and line in c.text for c in chunks)


@settings(max_examples=examples(60), deadline=None)
@given(st.integers(min_value=0, max_value=200_000), st.integers(min_value=1, max_value=4),
       st.text(alphabet=st.sampled_from("ab \u202e\u2028\x1b"), max_size=50))
def test_titles_and_headings_are_capped_whatever_their_length(length: int, depth: int, noise: str) -> None:
    """Every chunk carries its heading path: a heading's length must not multiply by the chunk count."""
    heading = ("word " * (length // 5)) + noise
    body = "".join(f"{'#' * level} {heading}\n\ntext of section {level}.\n\n" for level in range(1, depth + 1))
    doc = rules.parse_document(f"---\ntitle: {heading!r}\n---\n{body}".encode(), "deep.md")
    chunks = rules.chunk_document(doc, 512, 64, 2048)
    assert len(doc.title) <= rules.METADATA_MAX_CHARS
    for chunk in chunks:
        assert len(chunk.heading) <= rules.METADATA_MAX_CHARS
        assert not set(chunk.heading + doc.title) & set("\u202e\u2028\x1b")
    assert len(chunks) <= 2 + depth * (length * 3 // 512 + 2), "chunks bounded by the text's size"


@pytest.mark.parametrize(("free", "code"), [(1 << 20, "store_unwritable"), (10 << 30, "internal")])
def test_a_compaction_failure_on_a_full_disk_is_store_unwritable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 free: int, code: str) -> None:
    """What Chroma 1.5 raises when the disk fills during compaction (reproduced on a 40 MB tmpfs)."""
    vectors = rules.EmbeddedVectors(tmp_path / "chroma", "idx-000000000000")
    monkeypatch.setattr(rules.shutil, "disk_usage", lambda _path: type("Usage", (), {"free": free})())
    failure = vectors._failure(Exception("Error in compaction: Failed to apply logs to the metadata segment"))
    assert failure.code == code
    assert (code == "internal") == ("--full" in failure.hint)


def test_the_version_is_pyprojects_own() -> None:
    """One source: what the server reports in its handshake and `--version` is pyproject.toml's."""
    import tomllib

    declared = tomllib.loads((Path(rules.__file__).parent / "pyproject.toml").read_text(encoding="utf-8"))
    assert rules.TOOL_VERSION == declared["project"]["version"]


def test_the_console_scripts_are_pyprojects_own() -> None:
    import tomllib

    declared = tomllib.loads((Path(rules.__file__).parent / "pyproject.toml").read_text(encoding="utf-8"))
    assert declared["project"]["scripts"] == {rules.SERVER_SCRIPT: "server:main", rules.INGEST_SCRIPT: "ingest:main"}
    assert set(declared["tool"]["setuptools"]["py-modules"]) == {"corpus_rules", "ingest", "server"}


def test_hints_name_this_interpreter_and_the_clones_ingest_by_absolute_path() -> None:
    """Run from a clone (pytest is not a console script): the command works from any folder, with
    the Python that has the project, never a bare `python ingest.py`."""
    assert rules.IN_CHECKOUT
    assert rules.INGEST_COMMAND == shlex.join([sys.executable, str(Path(rules.__file__).parent / "ingest.py")])
    assert rules.ingest_command("--full") == f"`{rules.INGEST_COMMAND} --full`"
    assert rules.INGEST_COMMAND_SHOWN_REMOTELY == "<path>/python <path>/ingest.py"


def test_hints_survive_the_http_redaction_readably() -> None:
    import server

    told = server.redact(f"{rules.INGEST_HINT}, or {rules.ingest_command('--full')} from /srv/x", server.local_places())
    assert told == ("run `<path>/python <path>/ingest.py` (with the same RAG_STORE_DIR and RAG_CORPUS_DIR as this "
                    "server), or `<path>/python <path>/ingest.py --full` from <path>")


def test_an_installed_copy_without_a_corpus_is_a_configuration_error(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    monkeypatch.setattr(rules, "PROJECT_DIR", tmp_path)  # what pip installs: no sample corpus beside the code
    settings = rules.load_settings({})
    unset = rules.no_corpus_configured(settings)
    assert unset is not None and unset.code == "invalid_argument"
    assert unset.message.startswith("configuration error: RAG_CORPUS_DIR is not set") and "RAG_CORPUS_DIR" in unset.hint
    assert rules.ingest_hint(settings) == f"{unset.hint}; then {rules.INGEST_HINT}"
    assert rules.no_corpus_configured(rules.load_settings({"RAG_CORPUS_DIR": str(tmp_path / "docs")})) is None
    assert rules.ingest_hint(rules.load_settings({"RAG_CORPUS_DIR": str(tmp_path)})) == rules.INGEST_HINT


def test_a_missing_library_names_the_python_that_has_the_project() -> None:
    error = rules.missing_dependency(ModuleNotFoundError("No module named 'pathspec'", name="pathspec"), "ingest.py")
    assert error.message == (f"configuration error: the Python running ingest.py ({sys.executable}) cannot import "
                             "'pathspec', which local-rag-mcp needs")
    assert "report it" not in error.hint
    if rules.CLONE_PYTHON.is_file() and Path(sys.executable).absolute() != rules.CLONE_PYTHON:
        assert shlex.join([str(rules.CLONE_PYTHON), str(rules.PROJECT_DIR / "ingest.py")]) in error.hint
    else:
        assert error.hint.startswith("install the project into this Python: ") and "-m pip install" in error.hint


def test_the_environment_list_is_what_load_settings_reads_and_the_readme_documents() -> None:
    read: list[str] = []

    class Recording(dict[str, str]):
        def get(self, key: str, default: object = None) -> object:  # type: ignore[override]  # dict.get's overloads
            read.append(key)
            return super().get(key, default)

    rules.load_settings(Recording())
    readme = (Path(rules.__file__).parent / "README.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| `[A-Z_]+` \|.*$", readme.split("## Configuration", 1)[1], flags=re.M)
    assert set(read) == set(rules.ENVIRONMENT)
    # Each variable is declared once (rules.VARIABLES): the README's rows are its rows, verbatim
    # (print them with: python -c "import corpus_rules; print(*(v.row() for v in corpus_rules.VARIABLES), sep='\n')").
    assert rows == [variable.row() for variable in rules.VARIABLES]


def test_a_default_the_readme_shows_as_a_value_is_the_settings_default() -> None:
    """A variable whose README default is a plain value (`8765`, `INFO`, `1`) shows the Settings
    field's own default: the one default load_settings uses."""
    shown_plain = [v for v in rules.VARIABLES if re.fullmatch(r"`[^`]*`", v.shown) and v.field]
    assert len(shown_plain) >= 15
    for variable in shown_plain:
        default = rules.field_default(variable.field)
        rendered = {True: "1", False: "0"}.get(default, default) if isinstance(default, bool) else default
        if isinstance(rendered, float) and rendered.is_integer():
            rendered = int(rendered)
        assert variable.shown in (f"`{rendered}`", f"`{str(rendered).replace(str(Path.home()), '~')}`"), variable.name


def test_the_readme_error_table_lists_every_error_code() -> None:
    readme = (Path(rules.__file__).parent / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Errors", 1)[1].split("\n## ", 1)[0]
    table = re.findall(r"^\| `([a-z_]+)` \|", section, flags=re.M)
    assert sorted(table) == sorted(code.value for code in rules.ErrorCode)


_ROW_TEXT = st.text(alphabet=st.sampled_from(list("abcXYZ019 _.-/:$@()`'\"\n\tÉéßİıﬁ日本語ログ収集のをカタカナ①Ⅻ")),
                    max_size=40)


@settings(max_examples=examples(300), deadline=None)
@given(title=_ROW_TEXT, heading=_ROW_TEXT, body=_ROW_TEXT)
@example(title="Ärger İstanbul", heading="ﬁle STRASSE", body="ログ収集 `OLLAMA_KEEP_ALIVE` defineProps()")
def test_row_terms_are_the_tokens_fts5_indexes_for_the_row(title: str, heading: str, body: str) -> None:
    """common_terms is kept exact from the rows ingest writes: its idea of a row's tokens must be
    FTS5's own, case folding included."""
    db = sqlite3.connect(":memory:", isolation_level=None)
    rules.migrate_keyword_index(db, rules.PREFIX_SCHEMES["none"])
    columns = rules.keyword_row(title, heading, body)
    db.execute("INSERT INTO chunks_fts(rowid, title, heading, body) VALUES (1, ?, ?, ?)", columns)
    db.execute("CREATE VIRTUAL TABLE temp.rows USING fts5vocab(main, chunks_fts, 'row')")
    assert {term for (term,) in db.execute("SELECT term FROM temp.rows")} == rules.row_terms(*columns)


# ---------------------------------------------------------------------------
# URLs found in one pass: the expressions they replace, as the reference on short text.

_URL_START = r"\b[A-Za-z][A-Za-z0-9+.-]*://"
_PATH = r"A-Za-z0-9_\-.~:/@!$&*+,;=%"
REFERENCE_URL_PAYLOAD = re.compile(rf"({_URL_START}[{_PATH}]*[?#])[{_PATH}?#]+")
REFERENCE_WORD_PIECES = re.compile(rf"{rules._DATA_URI.pattern}|{_URL_START}[{_PATH}?#]+|[A-Za-z0-9_]+|.", re.DOTALL)
URL_SOUP = st.lists(st.sampled_from(list("ahtps:/.?#+-_,;=1é x") + ["://", "http://", "data:,", "a.b", "?q=1"]),
                    max_size=30).map("".join)


@settings(max_examples=examples(1500), deadline=None)
@given(URL_SOUP)
def test_url_payloads_are_what_the_expression_finds(text: str) -> None:
    expected = rules._DATA_URI.sub(rf"\g<1>{rules.PAYLOAD_MARK}", text)
    expected = REFERENCE_URL_PAYLOAD.sub(rf"\g<1>{rules.PAYLOAD_MARK}", expected)
    got = rules._DATA_URI.sub(rf"\g<1>{rules.PAYLOAD_MARK}", text)
    got = "".join(got[a:b] if keep else rules.PAYLOAD_MARK for a, b, keep in rules._url_payload_parts(got))
    assert got == expected


@settings(max_examples=examples(1500), deadline=None)
@given(URL_SOUP)
def test_word_pieces_are_what_the_expression_finds(word: str) -> None:
    assert list(rules._word_pieces(word)) == [m.group(0) for m in REFERENCE_WORD_PIECES.finditer(word)]


@pytest.mark.heavy  # hostile input whose size is the point: `pytest --all` only (tests/README.md)
@pytest.mark.parametrize("unit", ["https://", "a.", "ab+c.", "http://x?", "x.https://a/b"])
def test_a_megabyte_line_of_url_starts_is_made_searchable_and_cut_whole(unit: str) -> None:
    """Each of these took minutes before URLs were found in one pass (the expression scanned the
    rest of a run of scheme characters from each of its letters)."""
    line = unit * (1_000_000 // len(unit))
    assert len(rules.searchable_text(line)) <= len(line)
    assert "".join(rules._cut_units(line, 512)) == line


_STEP = st.from_regex(r"[a-z][a-z0-9]{0,5}(?:_[a-z0-9]{1,5}){0,2}|[A-Z][a-z]{1,5}[A-Z][a-z]{1,4}", fullmatch=True)


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(_STEP, min_size=2, max_size=6), st.lists(st.sampled_from([".", "::", "/"]), min_size=5, max_size=5))
def test_an_identifier_inside_a_path_is_one_of_its_terms(steps: list[str], separators: list[str]) -> None:
    """Each step of a dotted, :: or / path, and each two steps that follow one another, is a keyword
    term of the passage (its body's or its steps' column: identifier_term of the step): a query's
    identifier held inside a longer path is present (issue 41)."""
    path = steps[0] + "".join(sep + step for sep, step in zip(separators, steps[1:], strict=False))
    terms = set(rules.indexed_terms(f"see {path} here")) | set(rules.path_terms(f"see {path} here"))
    for step in steps:
        term = rules.identifier_term(step)
        assert term is None or term in terms or term in rules._STOP_WORDS, (path, step)
    for left, sep, right in zip(steps, separators, steps[1:], strict=False):
        assert rules.identifier_term(f"{left}{sep}{right}") in terms, (path, left, right)


@pytest.mark.parametrize(("heading", "shown"), [
    ("CORS (Cross-Origin Resource Sharing) { #cors-cross-origin-resource-sharing }",
     "CORS (Cross-Origin Resource Sharing)"),  # MkDocs attr_list, as FastAPI's docs write it
    ("Vite の設定 {#configuring-vite}", "Vite の設定"),
    ("Tabs {: #tabs .wide data-x=1 }", "Tabs"),
    ("Sets {x, y} and {a}", "Sets {x, y} and {a}"),  # braces that are text stay
])
def test_a_headings_attribute_list_is_not_its_text(heading: str, shown: str) -> None:
    doc = _doc(f"# {heading}\n\nBody text.\n")
    assert [h.text for h in doc.text.headings] == [shown] and doc.title == shown
    mdx = rules.parse_document(f"# {heading}\n\nBody text.\n".encode(), "page.mdx")
    assert [h.text for h in mdx.text.headings] == [shown]


def test_a_misspelt_variable_is_named_with_the_one_meant() -> None:
    """RAG_STORE= used to be ignored without a word: the default store was used (issue 41)."""
    warnings = rules.unknown_variables({"RAG_STORE": "/x", "RAG_STORE_DIR": "/y", "RAG_NOTHING_LIKE_IT": "1", "PATH": "/"})
    assert warnings == ["RAG_NOTHING_LIKE_IT is set but is no variable of local-rag-mcp; see the README's Configuration",
                        "RAG_STORE is set but is no variable of local-rag-mcp (did you mean RAG_STORE_DIR?)"]
    assert rules.unknown_variables({name: "1" for name in rules.ENVIRONMENT}) == []


CREDENTIAL_SAMPLES = {
    "a private key": "-----BEGIN RSA PRIVATE KEY----- MIIEowIBAAKCAQEAq8p3rWm2n0Yb7cXk4JtLs9VfQeZ1hGdU",
    "an AWS access key ID": "aws_access_key_id = AKIAQ3EGUTZ2Y7NBR4KD",
    "an AWS secret access key": "aws_secret_access_key = 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",
    "a GitHub token": "token: ghp_" + "Zq8" * 12,
    "a GitLab token": "glpat-" + "x7Y_" * 5,
    "a Slack token": "xoxb-2048-" + "a1B2c3D4e5",
    "a Google API key": "key=AIza" + "Sy0_-" * 7,
    "a Stripe live key": "sk_live_" + "4eC39HqLyjWDarjtT1zdp7dc",
    "an OpenAI or Anthropic API key": "sk-ant-api03-" + "Qw9" * 15,
}


@pytest.mark.parametrize(("kind", "line"), list(CREDENTIAL_SAMPLES.items()))
def test_a_credential_is_found_with_its_kind_and_line(kind: str, line: str) -> None:
    text = rules.DocumentText(lines=("# Notes", "", f"Use {line} here."), searchable=(), body_start=1, headings=(),
                              block_starts=())
    assert rules.credential_in(text) == rules.CredentialFound(kind, "line 3")
    keyed = rules.DocumentText(lines=("x",), searchable=(), body_start=1, headings=(), block_starts=(),
                               metadata={"description": line})
    assert rules.credential_in(keyed) == rules.CredentialFound(kind, "the 'description' key")


def test_a_private_key_is_its_marker_with_key_material_not_the_marker_named_in_prose() -> None:
    """Spring Boot's docs explain PEM files with `-----BEGIN PRIVATE KEY-----` in a sentence: the
    page was refused whole. A key has its base64 body on the lines below the marker (an encrypted
    one after its Proc-Type and DEK-Info headers)."""
    def found(*lines: str) -> rules.CredentialFound | None:
        return rules.credential_in(rules.DocumentText(lines=lines, searchable=(), body_start=1, headings=(),
                                                      block_starts=()))

    assert found("The file starts with `-----BEGIN PRIVATE KEY-----` and ends", "with its END line.") is None
    body = "MIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcwggSjAgEAAoIBAQC7VJTUt9Us8cKj"
    assert found("Example:", "", "-----BEGIN PRIVATE KEY-----", body, "-----END PRIVATE KEY-----") == \
        rules.CredentialFound("a private key", "line 3")
    assert found("-----BEGIN RSA PRIVATE KEY-----", "Proc-Type: 4,ENCRYPTED", "DEK-Info: AES-128-CBC,5A1F",
                  "", body) == rules.CredentialFound("a private key", "line 1")


@given(st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=300))
def test_documented_placeholders_and_ordinary_prose_are_not_credentials(prose: str) -> None:
    placeholders = ("aws_access_key_id = AKIAIOSFODNN7EXAMPLE",
                    "aws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
                    "password: hunter2", "export GITHUB_TOKEN=github_pat_asdf", "sk-...", "-----BEGIN PUBLIC KEY-----")
    text = rules.DocumentText(lines=(*placeholders, prose.replace("\n", " ")), searchable=(), body_start=1,
                              headings=(), block_starts=())
    found = rules.credential_in(text)
    assert found is None or found.where == f"line {len(placeholders) + 1}"


# ---------------------------------------------------------------------------
# The watcher's files in the store (issue 46): its lock and its status.

_WATCH_RUNS = st.builds(rules.WatchRun, finished_at=st.text(max_size=30), outcome=st.sampled_from(rules.WATCH_OUTCOMES),
                        added=st.integers(0, 10**6), updated=st.integers(0, 10**6), removed=st.integers(0, 10**6),
                        failed=st.integers(0, 10**6), seconds=st.floats(0, 1e6),
                        error=st.none() | st.text(max_size=500))


@settings(max_examples=examples(200), deadline=None)
@given(status=st.builds(rules.WatchStatus, pid=st.integers(1, 2**31), running=st.booleans(), since=st.text(max_size=30),
                        files_waiting=st.integers(0, 10**6), last_run=st.none() | _WATCH_RUNS))
@example(status=rules.WatchStatus(pid=1, running=False, since="",
                                  last_run=rules.WatchRun("", "some_files_failed", error="caf\udce9.md: not UTF-8")))
def test_a_watch_status_reads_back_as_written(status: rules.WatchStatus, tmp_path_factory: pytest.TempPathFactory) -> None:
    layout = rules.StoreLayout(tmp_path_factory.mktemp("store"))
    layout.write_watch_status(status)  # any text, lone surrogates of a non-UTF-8 file name included
    assert layout.read_watch_status() == status


def test_a_damaged_watch_status_is_no_status_and_the_lock_says_who_watches(tmp_path: Path) -> None:
    import fcntl
    import os

    layout = rules.StoreLayout(tmp_path)
    assert layout.read_watch_status() is None and layout.watcher_pid() is None  # nothing there yet
    for damaged in ('{"pid": -1, "running": true, "since": ""}', '{"pid": 1, "running": "yes", "since": ""}',
                    '{"pid": 1, "running": true, "since": "", "last_run": {"outcome": "fine"}}', "[]", "{", ""):
        layout.watch_status_file.write_text(damaged, encoding="utf-8")
        assert layout.read_watch_status() is None, damaged
    status = rules.WatchStatus(pid=7, running=False, since="2026-12-07T00:00:00+00:00")
    layout.write_watch_status(status)
    assert layout.read_watch_status() == status and not list(tmp_path.glob("*.tmp"))
    # The lock, not the pid written in it, says whether a watcher lives.
    layout.watch_lock_file.write_text("4242", encoding="ascii")
    assert layout.watcher_pid() is None
    fd = os.open(layout.watch_lock_file, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert layout.watcher_pid() == 4242
    finally:
        os.close(fd)
    assert layout.watcher_pid() is None
