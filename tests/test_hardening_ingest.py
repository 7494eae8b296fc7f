"""Ingest hardening, round three (issue 42): a host answering vectors of another size mid-run;
corpus names with terminal control sequences in every human line; a text file too big to read."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from budgets import examples
from fake_ollama import FakeOllama
from faultlib import write_handbooks
from helpers import INGEST, Done, Hosts, child_env, finish, ingest_in_process, keyword_db
from hypothesis import given, settings
from hypothesis import strategies as st

import corpus_rules as rules
import ingest

# ---------------------------------------------------------------------------
# D1: a host whose vectors change size mid-run leaves the rotation; the others finish the run.


def test_a_host_answering_another_size_mid_run_is_dropped_and_the_run_finishes(
        fakes: tuple[FakeOllama, FakeOllama], tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    tokens = write_handbooks(corpus, {f"book{i}.md": 30 for i in range(4)}, "A")
    for fake in fakes:
        fake.configure(delay_per_text_seconds=0.01)
    liar = fakes[1]
    liar.configure(wrong_dims_after_carrying=[tokens["book0.md"], 512])
    done = ingest_in_process(Hosts(fakes), corpus, tmp_path / "store", RAG_EMBED_CONCURRENCY="2")
    assert done.code == 0, done.err
    assert done.summary["vectors_pending"] == 0 and done.summary["errors"] == [], done.summary
    assert done.summary["chunks_embedded"] == done.summary["chunks_written"] > 0
    left = [host for host in done.summary["embedders"] if host["left_rotation"]]
    assert [host["host"] for host in left] == [liar.host], done.summary["embedders"]
    warning = f"Ollama at {liar.host} answered 512-dimensional vectors for 'embeddinggemma', the index holds 768"
    assert f"{warning}: that host is left out of this run" in done.err, done.err
    assert "calibration skipped" not in done.err, done.err


def test_every_host_answering_another_size_ends_with_that_cause(
        fakes: tuple[FakeOllama, FakeOllama], tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    tokens = write_handbooks(corpus, {f"book{i}.md": 30 for i in range(4)}, "A")
    for fake in fakes:
        fake.configure(wrong_dims_after_carrying=[tokens["book0.md"], 512])
    done = ingest_in_process(Hosts(fakes), corpus, tmp_path / "store")
    assert done.code == 1, done.err
    assert done.summary["vectors_pending"] > 0
    said = "\n".join(done.summary["errors"])
    assert "512-dimensional vectors for 'embeddinggemma', the index holds 768" in said, said
    assert any(fake.host in said for fake in fakes), said
    assert "start Ollama" not in said, said


# ---------------------------------------------------------------------------
# D4: corpus names reach a terminal in the dry run's listing and in every line of ingest; none of
# their control sequences (ESC, BEL, OSC, bidi overrides) may reach it raw.

# What a terminal acts on: C0/C1 controls but the line break, and the bidi overrides and isolates.
RAW_CONTROL = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
HOSTILE_NAMES = {"bell\x07.md": "# Bell\n\nring\n",
                 "dir\x1b]0;pwned\x07/page\x1b[31m.md": "# Page\n\nhello\n",
                 "clear\x1b[2J.md": "# Clear\n\ntext\n",
                 "okdir/\u202eevil.md": "# Evil\n\nreversed\n",
                 "ignored\x1b[7m.draft.md": "# Draft\n",
                 "blob.\x1b]52;c;aGk=\x07": "not a document\n"}


def hostile_corpus(root: Path) -> Path:
    for name, text in HOSTILE_NAMES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    (root / "plain.md").write_text("# Plain\n\nordinary page\n", encoding="utf-8")
    (root / ".ragignore").write_text("*.draft.md\n", encoding="utf-8")
    (root / "dir\x1b]0;pwned\x07" / ".ragignore").mkdir()  # not read: a warning names its folder
    return root


def ingest_for_a_person(fake: FakeOllama, corpus: Path, store: Path, *extra: str) -> Done:
    """`python ingest.py` without --json: the listing and lines a person reads on a terminal."""
    return finish(subprocess.Popen([sys.executable, str(INGEST), "--corpus", str(corpus), "--store", str(store),
                                    *extra], env=child_env(fake), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True))


@pytest.mark.process
def test_no_control_sequence_of_a_corpus_name_reaches_the_terminal(fake: FakeOllama, tmp_path: Path) -> None:
    corpus, store = hostile_corpus(tmp_path / "corpus"), tmp_path / "store"
    for extra in (("--dry-run",), ()):
        done = ingest_for_a_person(fake, corpus, store, *extra)
        assert done.code == 1, done.err  # the hostile names fail alone; plain.md and evil.md are indexed
        said = done.out + done.err
        assert not RAW_CONTROL.findall(said), said.encode()
        assert "dir ]0;pwned /.ragignore not read" in said and ". ]52;c;agk=: 1 not read" in said, said
        if extra:  # the listing: every name still there to recognise, the failures' reasons exact
            assert "add       okdir/ evil.md  (1 chunk(s) to embed or reuse)" in done.out, done.out
            assert ("fail      dir ]0;pwned /page [31m.md  ('dir\\x1b]0;pwned\\x07/page\\x1b[31m.md': its name "
                    "contains control characters") in done.out, done.out


@settings(max_examples=examples(200), deadline=None, derandomize=True)
@given(path=st.text(), reason=st.text(), action=st.sampled_from(["add", "fail", "ignore", "remove"]))
def test_a_listing_line_is_one_line_without_terminal_controls_and_keeps_every_visible_character_of_the_path(
        path: str, reason: str, action: str) -> None:
    line = ingest.listing_line({"path": path, "reason": reason, "action": action})
    assert "\n" not in line and not RAW_CONTROL.findall(line)
    visible = [ch for ch in path if ch == rules.metadata_text(ch) and not ch.isspace()]
    assert "".join(visible) in line.replace(" ", "")


@settings(max_examples=examples(100), deadline=None, derandomize=True)
@given(extension=st.text(min_size=1).map(lambda tail: "." + tail))
def test_the_files_by_extension_line_shows_no_terminal_controls(extension: str) -> None:
    line = rules.FilesFound({extension: {"not_read": 1}}).line()
    assert "\n" not in line and not RAW_CONTROL.findall(line), line


# ---------------------------------------------------------------------------
# D5: a text file over the per-file budget fails alone (document_invalid, naming the budget, its
# value and the limit) before it is read or parsed; the rest of the corpus is indexed and published.


def normal_page(corpus: Path) -> None:
    corpus.mkdir(parents=True, exist_ok=True)
    (corpus / "normal.md").write_text("# Rollback\n\nRoll back a deploy with the previous tag.\n", encoding="utf-8")


def published_paths(store: Path) -> set[str]:
    return {path for (path,) in keyword_db(store).execute("SELECT path FROM documents")}


def test_a_file_of_more_lines_than_the_budget_fails_alone_and_the_rest_is_published(
        fake: FakeOllama, tmp_path: Path) -> None:
    corpus, store = tmp_path / "corpus", tmp_path / "store"
    normal_page(corpus)
    lines = rules.TEXT_FILE_MAX_LINES + 1
    (corpus / "headings.md").write_text("".join(f"# h{i}\n" for i in range(lines)), encoding="utf-8")
    done = ingest_in_process(fake, corpus, store)
    assert done.code == 1, done.err
    assert (done.summary["added"], done.summary["failed"]) == (1, 1), done.summary
    expected = f"headings.md: {lines:,} lines, more than the {rules.TEXT_FILE_MAX_LINES:,} lines one text file may hold"
    assert any(error.startswith(expected) for error in done.summary["errors"]), done.summary["errors"]
    assert published_paths(store) == {"normal.md"}


def test_a_file_its_reader_is_slow_on_fails_alone_after_the_time_budget(
        fake: FakeOllama, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 42 D5: a reader that takes longer than the time one file may take gives up on that file,
    by name; the rest is indexed and published, and the clock is put back."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("the clock is SIGALRM's, on the main thread where ingest reads; pytest-xdist runs tests off it")
    corpus, store = tmp_path / "corpus", tmp_path / "store"
    normal_page(corpus)
    # About 1.5 s of reading on a fast machine: thirty times the clock's budget below.
    (corpus / "slow.md").write_text("".join(f"- item {i} with **bold** and `code`\n" for i in range(20_000)),
                                    encoding="utf-8")
    ingest.read_document(b"# Warm\n\nThe readers' modules imported before the clock is short.\n", "warm.md")
    monkeypatch.setattr(ingest, "READ_TIME_BUDGET_S", 0.05)
    done = ingest_in_process(fake, corpus, store)
    assert done.code == 1, done.err
    assert done.summary["errors"] == [
        "slow.md: reading it took more than 0.05 s, the time one text file may take; split it to index it"]
    assert published_paths(store) == {"normal.md"}
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0) and signal.getsignal(signal.SIGALRM) == signal.SIG_DFL
    # Within the budget, the same file reads as ever.
    assert ingest.read_document(b"# T\n\ntext\n", "t.md").title == "T"


def test_a_file_of_more_bytes_than_the_budget_is_never_read(fake: FakeOllama, tmp_path: Path) -> None:
    corpus, store = tmp_path / "corpus", tmp_path / "store"
    normal_page(corpus)
    with (corpus / "huge.md").open("wb") as huge:  # sparse: NUL bytes, "binary" if it were ever read
        huge.truncate(rules.TEXT_FILE_MAX_BYTES + (1 << 20))
    done = ingest_in_process(fake, corpus, store)
    assert done.code == 1, done.err
    said = "\n".join(done.summary["errors"])
    megabytes = rules.TEXT_FILE_MAX_BYTES >> 20
    assert f"huge.md: {megabytes + 1}.0 MB, more than the {megabytes} MB one text file may hold" in said, said
    assert "binary" not in said and published_paths(store) == {"normal.md"}


@settings(max_examples=examples(300), deadline=None, derandomize=True)
@given(text=st.text(alphabet="ab\r\n", max_size=24), limit=st.integers(0, 8))
def test_the_line_budget_counts_lines_as_the_readers_split_them(text: str, limit: int) -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(rules, "TEXT_FILE_MAX_LINES", limit)
        try:
            rules.parse_document(text.encode(), "page.txt")
            refused = False
        except rules.RagError as exc:
            refused = "one text file may hold" in exc.message
    assert refused == (len(rules.split_lines(text)) > limit)
