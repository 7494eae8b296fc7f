"""Scenario 4: a corpus full of bad input, indexed by `python ingest.py` and read through
`python server.py`. Each bad file gets its documented outcome, and the rest of the corpus is
indexed.

Documented outcomes (README "Corpus conventions"): malformed YAML, non-UTF-8 and binary files are
errors for that file (reported with path and reason, previous chunks kept, exit 1); two names that
differ only by Unicode normalisation are an error for the second; paths are stored NFC; symlinks
that leave the corpus are skipped with a warning and cycles are cut; an empty file is indexed as a
document without chunks. Large inputs (a 20 MB file, 10,000 headings) are indexed whole.

The fake Ollama here has a large context and small vectors, and RAG_CHUNK_MAX_TOKENS is raised,
so the 20 MB file makes a few hundred chunks rather than tens of thousands: the test is about
what ingest does with the file, not about how fast the fake embeds.
"""

from __future__ import annotations

import json
import os
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
from fake_ollama import FakeOllama
from faultlib import committed_hashes, index_dir
from helpers import (
    Done,
    call,
    chroma_state,
    chunk_calls,
    copy_sample,
    corpus_hashes,
    edit,
    ingest_in_process,
    keyword_db,
    raw_server,
    search_paths,
)

from corpus_rules import content_hash

pytestmark = pytest.mark.heavy  # its corpus of 40,000 headings takes ~20 s to index: `pytest --all` only

BIG_ENV = {"RAG_CHUNK_MAX_TOKENS": "40000"}
OUTSIDE_TOKEN = "OUTSIDE-SECRET-5521"
MIDDLE_TOKEN, LAST_TOKEN = "MIDDLETOKEN4242", "LASTTOKEN9191"
NFD_NAME = unicodedata.normalize("NFD", "notes/résumé.md")
TWIN_NFC, TWIN_NFD = unicodedata.normalize("NFC", "notes/naïve.md"), unicodedata.normalize("NFD", "notes/naïve.md")
# The walk visits names in code-point order: the NFD spelling ("i" + U+0308) sorts first and
# wins; the NFC one ("ï") is the second, the error.
FIRST_TWIN, SECOND_TWIN = sorted([TWIN_NFC, TWIN_NFD])
BROKEN = {
    "bad/yaml.md": (b"---\ntitle: [oops\n---\n# Yaml\n\nbody\n", "malformed YAML frontmatter"),
    "bad/latin1.md": (b"# Caf\xe9\n\nLatin-1 text, not UTF-8.\n", "not UTF-8"),
    "bad/binary.md": (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x01", "binary file (contains NUL bytes)"),
}


def big_markdown() -> str:
    """About 20 MB: 100 sections of prose paragraphs, a token in the middle and one at the end."""
    paragraph = ("The storage controller replicates every write to three zones before it acknowledges "
                 "the client, and the operator dashboard shows the lag of each replica in seconds. ") * 6
    sections = []
    for i in range(100):
        middle = f" {MIDDLE_TOKEN} appears once here." if i == 50 else ""
        body = "\n\n".join(f"{paragraph}Paragraph {i}.{j}.{middle if j == 100 else ''}" for j in range(200))
        sections.append(f"## Storage section {i}\n\n{body}\n")
    return "# Storage handbook\n\n" + "\n".join(sections) + f"\nThe end: {LAST_TOKEN}.\n"


def many_headings(count: int = 10_000) -> str:
    return "---\nrag_chunk: headings\n---\n# Many headings\n\n" + "".join(
        f"## Heading number {i}\n\nText for heading {i}, token H{i}X.\n\n" for i in range(count))


@dataclass
class Outcome:
    corpus: Path
    store: Path
    outside: Path
    before: dict[str, Any]  # chroma state after the first, clean ingest
    first_hashes: dict[str, str]
    run: Done
    fake: FakeOllama


@pytest.fixture(scope="module")
def outcome(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Outcome]:
    tmp = tmp_path_factory.mktemp("bad-corpus")
    outside = tmp / "outside"
    outside.mkdir()
    (outside / "secret.md").write_text(f"# Outside\n\n{OUTSIDE_TOKEN}\n", encoding="utf-8")
    corpus, store = copy_sample(tmp), tmp / "store"
    # First the files that will break, in good shape, so they have chunks to keep.
    for rel in BROKEN:
        (corpus / rel).parent.mkdir(parents=True, exist_ok=True)
        (corpus / rel).write_text(f"# Good {rel}\n\nGood content of {rel} before it broke.\n", encoding="utf-8")
    with FakeOllama(context_length=131072, dims=64) as fake:
        first = ingest_in_process(fake, corpus, store, **BIG_ENV)
        assert first.code == 0, first.err
        before, first_hashes = chroma_state(store), corpus_hashes(corpus)
        for rel, (content, _) in BROKEN.items():
            edit(corpus / rel, content)
        files = {
            "empty.md": "",
            "blank.md": "  \n\n\t\n",
            "big/storage.md": big_markdown(),
            "big/headings.md": many_headings(),
            NFD_NAME: "# Résumé\n\nThe NFD-named résumé page.\n",
            TWIN_NFD: "# Naive NFD\n\nThe decomposed twin.\n",
            TWIN_NFC: "# Naive NFC\n\nThe composed twin.\n",
            "notes/with space #1.md": "# Spaces and hash\n\nSPACEHASHTOKEN lives here.\n",
            unicodedata.normalize("NFD", "café dir/page.md"): "# Cafe folder\n\nCAFEFOLDERTOKEN here.\n",
        }
        for rel, text in files.items():
            (corpus / rel).parent.mkdir(parents=True, exist_ok=True)
            (corpus / rel).write_text(text, encoding="utf-8")
        loops = corpus / "loops" / "deeper"
        loops.mkdir(parents=True)
        (corpus / "loops" / "here.md").write_text("# Loops\n\nLOOPTOKEN once.\n", encoding="utf-8")
        (corpus / "loops" / "self").symlink_to(".", target_is_directory=True)
        (loops / "parent").symlink_to("../..", target_is_directory=True)
        (corpus / "outside-file.md").symlink_to(outside / "secret.md")
        (corpus / "outside-dir").symlink_to(outside, target_is_directory=True)
        (corpus / "dangling.md").symlink_to(corpus / "nowhere.md")
        os.mkfifo(corpus / "pipe.md")
        run = ingest_in_process(fake, corpus, store, **BIG_ENV)
        yield Outcome(corpus, store, outside, before, first_hashes, run, fake)


def test_bad_files_fail_alone_and_keep_their_chunks(outcome: Outcome) -> None:
    run = outcome.run
    assert run.code == 1, run.err
    assert "Traceback" not in run.err
    errors = run.summary["errors"]
    assert len(errors) == len(set(errors)) == 4, errors  # each failure reported once
    for rel, (_, reason) in BROKEN.items():
        assert f"{rel}: {reason}" in "\n".join(errors)
        assert run.err.count(f"ERROR: {rel}: {reason}") == 1
        assert committed_hashes(index_dir(outcome.store))[rel] == outcome.first_hashes[rel]
        old = {i: v for col in outcome.before.values() for i, v in col.items() if v[1]["path"] == rel}
        now = {i: v for col in chroma_state(outcome.store).values() for i, v in col.items() if v[1]["path"] == rel}
        assert now == old and old, rel
    assert f"{SECOND_TWIN}: another file has the same name after Unicode NFC normalisation" in errors
    assert run.summary["failed"] == 4


def test_rest_of_the_corpus_is_indexed(outcome: Outcome) -> None:
    committed = committed_hashes(index_dir(outcome.store))
    expected = {"empty.md", "blank.md", "big/storage.md", "big/headings.md", NFD_NAME, TWIN_NFC,
                "notes/with space #1.md", "café dir/page.md", "loops/here.md", *BROKEN,
                *(p for p in outcome.first_hashes if p != "private/offsite-backup.md")}
    expected = {unicodedata.normalize("NFC", p) for p in expected}
    assert set(committed) == expected
    assert all(unicodedata.is_normalized("NFC", p) for p in committed)
    with keyword_db(outcome.store) as con:
        disk_paths = dict(con.execute("SELECT path, disk_path FROM documents"))
    for path, digest in committed.items():
        if path not in BROKEN:
            assert digest == content_hash((outcome.corpus / disk_paths[path]).read_bytes()), path
    # The first twin's content is what is indexed under the shared NFC path.
    with keyword_db(outcome.store) as con:
        texts = [t for (t,) in con.execute("SELECT text FROM chunks WHERE path = ?", (TWIN_NFC,))]
        disk = con.execute("SELECT disk_path FROM documents WHERE path = ?", (TWIN_NFC,)).fetchone()[0]
        empties = dict(con.execute("SELECT path, chunk_count FROM documents WHERE path IN ('empty.md', 'blank.md')"))
        loops = con.execute("SELECT count(*) FROM documents WHERE path LIKE 'loops/%'").fetchone()[0]
    assert disk == FIRST_TWIN and texts
    assert empties == {"empty.md": 0, "blank.md": 0}
    assert loops == 1  # the cycle was cut: loops/here.md once, not loops/self/here.md, ...


def test_large_inputs_are_indexed_whole(outcome: Outcome) -> None:
    with keyword_db(outcome.store) as con:
        for rel in ("big/storage.md", "big/headings.md"):
            lines = (outcome.corpus / rel).read_text(encoding="utf-8").split("\n")[:-1]
            rows = list(con.execute("SELECT start_line, end_line, heading, text FROM chunks WHERE path = ? "
                                    "ORDER BY chunk_index", (rel,)))
            assert rows[0][0] <= 5 and rows[-1][1] == len(lines), rel
            for (_, end, _, _), (start, _, _, _) in pairwise(rows):
                assert start in (end, end + 1), rel  # contiguous: nothing lost between chunks
            joined = "".join("".join(text.split()) for *_, text in rows)
            body = "".join(line for line in lines if not line.startswith("---") and line != "rag_chunk: headings")
            assert joined == "".join(body.split()), rel
        headings = dict(con.execute("SELECT text, heading FROM chunks WHERE path = 'big/headings.md'"))
    assert any("H9999X" in text and heading.startswith("Many headings > Heading number")
               for text, heading in headings.items())
    assert (outcome.corpus / "big/storage.md").stat().st_size > 20_000_000


def test_symlinks_out_and_cycles_are_reported_never_followed(outcome: Outcome) -> None:
    err = outcome.run.err
    assert "skipped symlink" in err and "outside-file.md: it resolves outside the corpus" in err
    assert "outside-dir: it resolves outside the corpus" in err
    assert "symlink cycle" in err and "dangling.md" in err
    with keyword_db(outcome.store) as con:
        stored = json.dumps(list(con.execute("SELECT * FROM chunks")) + list(con.execute("SELECT * FROM documents")))
    assert OUTSIDE_TOKEN not in stored and "outside" not in committed_hashes(index_dir(outcome.store))
    assert OUTSIDE_TOKEN not in json.dumps(chroma_state(outcome.store), ensure_ascii=False)


@pytest.mark.process
def test_the_server_serves_what_was_indexed(outcome: Outcome) -> None:
    with raw_server(outcome.store, outcome.corpus, outcome.fake.host, **BIG_ENV) as server:
        for token, path in ((MIDDLE_TOKEN, "big/storage.md"), (LAST_TOKEN, "big/storage.md"),
                            ("H9999X", "big/headings.md"), ("SPACEHASHTOKEN", "notes/with space #1.md"),
                            ("CAFEFOLDERTOKEN", unicodedata.normalize("NFC", "café dir/page.md")),
                            ("LOOPTOKEN", "loops/here.md")):
            assert search_paths(server, token, mode="keyword")[0] == path, token
            assert path in search_paths(server, token), token
        for rel, expected in ((unicodedata.normalize("NFC", NFD_NAME), "The NFD-named résumé page."),
                              (NFD_NAME, "The NFD-named résumé page."),
                              ("notes/with space #1.md", "SPACEHASHTOKEN lives here."), ("empty.md", "")):
            is_error, payload = call(server, "get_file", {"path": rel})
            assert not is_error and payload["source"] == "disk", payload
            assert (expected in payload["text"]) if expected else payload["text"] == "", rel
        is_error, payload = call(server, "get_file", {"path": "big/storage.md", "start_line": 1})
        assert not is_error and payload["truncated"] and payload["next_start_line"] > 1
        listed = {d["path"]: d for d in call(server, "list_documents", {"limit": 500})[1]["documents"]}
        assert listed["empty.md"]["chunks"] == 0 and listed["big/headings.md"]["lines"] > 40_000
        for rel in ("outside-file.md", "outside-dir/secret.md", "pipe.md", "loops/self/here.md"):
            is_error, payload = call(server, "get_file", {"path": rel})
            assert is_error and payload["error"]["code"] == "not_indexed", rel


def test_rerun_reports_the_same_failures_and_embeds_nothing(outcome: Outcome) -> None:
    before = chroma_state(outcome.store)
    calls = chunk_calls(outcome.fake)  # a run probes each host's model fingerprint: not a chunk's call
    again = ingest_in_process(outcome.fake, outcome.corpus, outcome.store, **BIG_ENV)
    assert again.code == 1 and again.summary["failed"] == 4
    assert sorted(again.summary["errors"]) == sorted(outcome.run.summary["errors"])
    assert chunk_calls(outcome.fake) == calls
    assert chroma_state(outcome.store) == before
