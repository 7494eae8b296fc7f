"""A docs folder of every format, through the real ingest and the real server (issue 40): what is
indexed and what is not (and why), citations to the line or the page, get_file and resources in
each format, and RAG_FORMATS."""

from __future__ import annotations

import itertools
import json
import shutil
import sqlite3
from pathlib import Path
from typing import Any

import pdf_fixtures
import pytest
from fake_ollama import FakeOllama
from helpers import Built, call, dispatched, in_process_service, ingest_in_process, raw_server

import corpus_rules as rules
import server

MDX = """---
title: Mooring guide
---
import { Tabs } from "/snippets/tabs.mdx";

{/* internal: do not publish */}

## Zeppelin moorings

<Tabs>
<Tab title="Summer">
The zeppelin mooring protocol needs two ground crews.
</Tab>
</Tabs>
"""
RST = """:lifecycle: active

Harbour configuration
=====================

Timeouts
--------

.. py:data:: HARBOUR_TIMEOUT

   Seconds a pilot waits at the buoy, see :func:`pilot.wait`.
"""
MARKDOWN = "# Intro\n\nThe lighthouse keeper logs every passing vessel.\n"
TEXT = "Tide table notes\n\nSpring tides flood the lower quay twice a month.\n"


@pytest.fixture(scope="module")
def docs_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    corpus = tmp_path_factory.mktemp("formats") / "corpus"
    files = {"guide/intro.md": MARKDOWN, "docs/mooring.mdx": MDX, "api/config.rst": RST, "notes/tides.txt": TEXT,
             "site/index.html": "<html><body>not read</body></html>", "site/old.html": "<p>no</p>"}
    for rel, text in files.items():
        (corpus / rel).parent.mkdir(parents=True, exist_ok=True)
        (corpus / rel).write_text(text, encoding="utf-8")
    (corpus / "manual").mkdir()
    (corpus / "manual/handbook.pdf").write_bytes(pdf_fixtures.book_pdf())
    (corpus / "scans").mkdir()
    (corpus / "scans/scan.pdf").write_bytes(pdf_fixtures.scan_pdf())
    (corpus / "assets").mkdir()
    (corpus / "assets/logo.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    return corpus


@pytest.fixture(scope="module")
def built(fake: FakeOllama, docs_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Built, Any]:
    corpus = tmp_path_factory.mktemp("formats-built") / "corpus"
    shutil.copytree(docs_folder, corpus)
    store = corpus.parent / "store"
    # No minimum chunk size: the test book's pages hold a sentence each, and each page is to be a chunk.
    done = ingest_in_process(fake, corpus, store, RAG_FORMATS="markdown,mdx,rst,pdf,text", RAG_CHUNK_MIN_TOKENS="0")
    return Built(corpus, store, fake.host), done


def search(built: Built, query: str, **args: Any) -> dict[str, Any]:
    svc = in_process_service(built)
    try:
        is_error, payload = dispatched(svc, "search_corpus", query=query, mode="keyword", **args)
    finally:
        svc.close(5)
    assert not is_error, payload
    return payload


def tool(built: Built, name: str, **args: Any) -> tuple[bool, dict[str, Any]]:
    svc = in_process_service(built)
    try:
        return dispatched(svc, name, **args)
    finally:
        svc.close(5)


def test_every_file_is_indexed_or_said_why_not(built: tuple[Built, Any]) -> None:
    _, done = built
    assert done.code == 1, done.err  # the scan failed, the rest is indexed
    assert done.summary["files_found"] == {
        ".md": {"indexed": 1}, ".mdx": {"indexed": 1}, ".rst": {"indexed": 1}, ".txt": {"indexed": 1},
        ".pdf": {"indexed": 1, "failed": 1}, ".html": {"not_read": 2}, ".png": {"not_read": 1}}
    assert any("scans/scan.pdf: no text layer" in error for error in done.summary["errors"])
    assert ".html: 2 not read (no reader for this format" in done.err and ".pdf: 1 indexed, 1 failed" in done.err


def test_list_documents_says_what_the_folder_holds(built: tuple[Built, Any]) -> None:
    is_error, listing = tool(built[0], "list_documents")
    assert not is_error
    assert sorted(d["path"] for d in listing["documents"]) == [
        "api/config.rst", "docs/mooring.mdx", "guide/intro.md", "manual/handbook.pdf", "notes/tides.txt"]
    files = {row["extension"]: row for row in listing["files"]}
    assert files[".html"]["not_read"] == 2 and "no reader" in files[".html"]["why_not_read"]
    assert files[".pdf"]["indexed"] == 1 and files[".pdf"]["failed"] == 1
    titles = {d["path"]: d["title"] for d in listing["documents"]}
    assert titles["docs/mooring.mdx"] == "Mooring guide" and titles["api/config.rst"] == "Harbour configuration"
    assert titles["manual/handbook.pdf"] == pdf_fixtures.BOOK_TITLE and titles["notes/tides.txt"] == "Tide table notes"


@pytest.mark.parametrize(("query", "path", "heading", "quote"), [
    ("zeppelin mooring protocol", "docs/mooring.mdx", "Zeppelin moorings", "The zeppelin mooring protocol"),
    ("HARBOUR_TIMEOUT", "api/config.rst", "Harbour configuration", ".. py:data:: HARBOUR_TIMEOUT"),
    ("lighthouse keeper", "guide/intro.md", "Intro", "The lighthouse keeper"),
    ("spring tides lower quay", "notes/tides.txt", "Tide table notes", "Spring tides flood"),
])
def test_each_format_is_found_and_cited_to_its_lines(built: tuple[Built, Any], query: str, path: str, heading: str,
                                                     quote: str) -> None:
    hit = search(built[0], query)["results"][0]
    assert (hit["path"], hit["heading"]) == (path, heading)
    lines = (built[0].corpus / path).read_text(encoding="utf-8").split("\n")
    cited = "\n".join(lines[hit["start_line"] - 1:hit["end_line"]])
    assert quote in cited and quote in hit["text"]
    assert "pages" not in hit  # only a paged document's hits carry pages


def test_each_chunk_records_the_section_the_server_would_work_out_from_its_file(built: tuple[Built, Any]) -> None:
    """What ingest records with each chunk (section_start, section_end) is what a section context
    spans when the server works it out from the file as indexed: by its reader's headings, or by
    the run of passages under one heading path where it cites extracted text (a PDF)."""
    store = built[0].store
    con = sqlite3.connect(store / json.loads((store / "CURRENT.json").read_text())["index"] / rules.KEYWORD_DB)
    try:
        rows = [rules.ChunkRow(*row) for row in con.execute(f"{rules.chunk_select()} ORDER BY c.path, c.chunk_index")]
    finally:
        con.close()
    checked = set()
    for path, chunks in itertools.groupby(rows, key=lambda row: row.path):
        passages = list(chunks)
        raw = (built[0].corpus / path).read_bytes()
        reader = rules.reader_for(path)
        headings = None if reader is not None and reader.extracted else rules.parse_document(raw, path).text.headings
        for row in passages:
            assert (row.section_start, row.section_end) == server.context_range(passages, row, "section", headings), row
        checked.add(path.rsplit(".", 1)[-1])
    assert checked == {"md", "mdx", "rst", "txt", "pdf"}


def test_jsx_and_imports_are_kept_out_of_the_keyword_index(built: tuple[Built, Any]) -> None:
    assert search(built[0], "snippets")["results"] == []  # the import's path
    assert search(built[0], "publish internal")["results"] == []  # the comment
    assert search(built[0], "Summer zeppelin")["results"][0]["path"] == "docs/mooring.mdx"  # a Tab's title


def test_a_pdf_hit_is_cited_by_page_and_printed_label(built: tuple[Built, Any]) -> None:
    hidden = search(built[0], "pilots board at the outer buoy at slack water")
    assert "manual/handbook.pdf" not in [h["path"] for h in hidden["results"]]  # its /Info says lifecycle superseded
    hit = search(built[0], "pilots board at the outer buoy at slack water", include_superseded=True)["results"][0]
    assert hit["path"] == "manual/handbook.pdf" and hit["lifecycle"] == "superseded"
    assert hit["pages"] == {"first": 4, "last": 4, "printed": "1"}  # the 4th sheet is the book's page 1
    assert hit["heading"] == "Chapter 1: Arrival"


def test_get_file_of_a_pdf_serves_its_extracted_text_by_lines_or_pages(built: tuple[Built, Any]) -> None:
    is_error, whole = tool(built[0], "get_file", path="manual/handbook.pdf")
    assert not is_error, whole
    assert whole["source"] == "extracted" and whole["changed_since_ingest"] is False
    assert '[page 4, printed "1"]' in whole["text"] and pdf_fixtures.BOOK_SENTENCES[4] in whole["text"]
    is_error, page = tool(built[0], "get_file", path="manual/handbook.pdf", start_page=5, end_page=5)
    assert not is_error, page
    assert page["text"].startswith('[page 5, printed "2"]') and pdf_fixtures.BOOK_SENTENCES[5] in page["text"]
    assert pdf_fixtures.BOOK_SENTENCES[6] not in page["text"] and page["pages"] == {"first": 5, "last": 5, "printed": "2"}
    hit = search(built[0], "pilots board at the outer buoy", include_superseded=True)["results"][0]
    is_error, cited = tool(built[0], "get_file", path=hit["path"], start_line=hit["start_line"], end_line=hit["end_line"])
    assert not is_error and pdf_fixtures.BOOK_SENTENCES[4] in cited["text"]
    is_error, refused = tool(built[0], "get_file", path="api/config.rst", start_page=1)
    assert is_error and refused["error"]["code"] == "invalid_argument"


def test_get_file_of_a_text_format_is_the_file_as_stored(built: tuple[Built, Any]) -> None:
    is_error, rst = tool(built[0], "get_file", path="api/config.rst", start_line=3, end_line=4)
    assert not is_error and rst["source"] == "disk" and rst["text"] == "Harbour configuration\n====================="


def test_resources_name_each_format_and_read_like_get_file(built: tuple[Built, Any]) -> None:
    svc = in_process_service(built[0])
    try:
        page, _ = svc.resource_page("")
        types = {doc.path: server.document_resource(doc).mime_type for doc, _ in page}
        read = svc.read_resource(server.document_uri("manual/handbook.pdf") + "?start_page=4&end_page=4")
    finally:
        svc.close(5)
    assert types == {"api/config.rst": "text/x-rst", "docs/mooring.mdx": "text/mdx", "guide/intro.md": "text/markdown",
                     "manual/handbook.pdf": "text/plain", "notes/tides.txt": "text/plain"}
    assert read["text"].startswith('[page 4, printed "1"]') and server.resource_contents(
        "local-rag://doc/manual/handbook.pdf", read).contents[0].mime_type == "text/plain"


def test_rag_formats_leaves_a_format_out_and_the_next_run_removes_it(fake: FakeOllama, docs_folder: Path,
                                                                      tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    shutil.copytree(docs_folder, corpus)
    store = tmp_path / "store"
    assert ingest_in_process(fake, corpus, store, RAG_FORMATS="markdown,rst").code == 0
    dry = ingest_in_process(fake, corpus, store, "--dry-run", RAG_FORMATS="markdown")
    assert {"path": "api/config.rst", "action": "remove", "reason": "RAG_FORMATS leaves rst out"} in dry.summary["listing"]
    assert dry.summary["files_found"][".rst"] == {"not_read": 1}
    assert "RAG_FORMATS leaves rst out" in dry.err
    done = ingest_in_process(fake, corpus, store, RAG_FORMATS="markdown")
    assert done.code == 0 and done.summary["removed"] == 1


def test_a_folder_with_nothing_readable_says_what_it_found(fake: FakeOllama, tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in ("index.html", "about.html", "spec.docx"):
        (corpus / name).write_bytes(b"<p>x</p>")
    done = ingest_in_process(fake, corpus, tmp_path / "store", as_json=False)
    assert "files by extension: .html: 2 not read (no reader for this format; readers take .md .markdown .mdx" in done.err
    assert ".docx: 1 not read" in done.err


@pytest.mark.process
def test_the_real_server_reads_every_format_over_stdio(built: tuple[Built, Any]) -> None:
    b = built[0]
    with raw_server(b.store, b.corpus, b.host) as proc:
        is_error, hit = call(proc, "search_corpus", {"query": "HARBOUR_TIMEOUT", "mode": "keyword"})
        assert not is_error and hit["results"][0]["path"] == "api/config.rst"
        is_error, page = call(proc, "get_file", {"path": "manual/handbook.pdf", "start_page": 4, "end_page": 4})
        assert not is_error and page["pages"]["printed"] == "1"
        read = proc.request("resources/read", {"uri": "local-rag://doc/docs/mooring.mdx?start_line=8&end_line=8"})
        assert read["result"]["contents"][0] == {"uri": "local-rag://doc/docs/mooring.mdx?start_line=8&end_line=8",
                                                 "mimeType": "text/mdx", "text": "## Zeppelin moorings",
                                                 "_meta": read["result"]["contents"][0]["_meta"]}


def test_an_index_of_nothing_answers_index_empty_not_an_empty_result(fake: FakeOllama, tmp_path: Path) -> None:
    """A folder of files no reader takes: ingest says so and exits 1; a search is an error that
    says what the folder held, never "no matching passages" (an agent would read that as "the
    documents do not cover it"); list_documents and the instructions say it too."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "index.html").write_text("<p>the docs, as a built site</p>")
    store = tmp_path / "store"
    done = ingest_in_process(fake, corpus, store)
    assert done.code == 1 and any(e.startswith("nothing was indexed: the corpus folder holds .html: 1 not read")
                                  for e in done.summary["errors"]), done.err
    built = Built(corpus, store, fake.host)
    is_error, payload = tool(built, "search_corpus", query="the docs")
    assert is_error and payload["error"]["code"] == "index_empty" and ".html: 1 not read" in payload["error"]["message"]
    is_error, listing = tool(built, "list_documents")
    assert not is_error and listing["total"] == 0 and ".html: 1 not read" in listing["message"]
    facts = server.index_facts(lambda: server.rules.load_settings({"RAG_STORE_DIR": str(store),
                                                                   "RAG_CORPUS_DIR": str(corpus)}))
    assert facts is not None and "holds no document" in facts
