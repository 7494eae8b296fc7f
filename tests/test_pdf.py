"""The PDF reader (issue 40): the text, labels, outline and metadata of real PDFs (built by
pdf_fixtures as the tests run), the refusals (scan, password, damage), and the extractor's bounds
against hostile files: each fails alone within its deadline and the next PDF is read as usual
(run with -s to see each hostile file's outcome, wall time and the child's peak memory)."""

from __future__ import annotations

import io
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pdf_fixtures as fx
import pytest
from budgets import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import corpus_rules
from corpus_rules import (
    CHILD_MEMORY_LIMIT,
    PdfExtractor,
    PdfOutlineEntry,
    PdfRefused,
    PdfText,
    extract_pdf_text,
)

HERE = Path(__file__).resolve().parent
MIB = 1024 * 1024
RESTART_SLACK_S = 5.0  # beyond the deadline: killing and reaping the child, and a loaded machine


@pytest.fixture(scope="module")
def book() -> PdfText:
    return extract_pdf_text(fx.book_pdf())


@pytest.fixture(scope="module")
def extractor() -> Iterator[PdfExtractor]:
    shared = PdfExtractor()
    yield shared
    shared.close()


def columns_whole_in_order(text: str) -> bool:
    """Every line of the left column, then every line of the right one, in this order in `text`."""
    expected = [line for line in fx.LEFT_COLUMN + fx.RIGHT_COLUMN if line]
    positions = [text.find(line) for line in expected]
    return -1 not in positions and positions == sorted(positions)


# ---------------------------------------------------------------------------
# What the extraction returns.


def test_every_page_has_its_text_and_printed_label(book: PdfText) -> None:
    assert [page.number for page in book.pages] == [1, 2, 3, 4, 5, 6]
    assert tuple(page.label for page in book.pages) == fx.BOOK_LABELS  # physical 4 is printed "1"
    for page in book.pages:
        if page.number == fx.BLANK_PAGE:
            assert page.text == ""
        else:
            assert fx.BOOK_SENTENCES[page.number] in page.text


def test_the_page_without_text_is_reported(book: PdfText) -> None:
    assert f"page {fx.BLANK_PAGE} has no text layer" in book.warnings


def test_two_columns_come_out_whole_in_reading_order(book: PdfText) -> None:
    text = book.pages[fx.TWO_COLUMN_PAGE - 1].text
    assert columns_whole_in_order(text), text
    lines = text.splitlines()
    assert lines.index("six knots at most.") + 1 == lines.index("Right one: tugs are made fast at")


def test_layout_mode_would_interleave_the_columns() -> None:
    """Why plain mode: layout mode renders the page as rows across the page, so each row joins a
    line of the left column to a line of the right one, and a sentence that wraps is cut by the
    other column's text; plain mode follows the content stream, column by column."""
    import pypdf

    page = pypdf.PdfReader(io.BytesIO(fx.book_pdf())).pages[fx.TWO_COLUMN_PAGE - 1]
    layout = page.extract_text(extraction_mode="layout")
    assert not columns_whole_in_order(layout)
    assert any("Left one" in line and "Right one" in line for line in layout.splitlines())
    assert columns_whole_in_order(page.extract_text(extraction_mode="plain"))


def test_outline_is_flattened_with_levels_and_physical_pages(book: PdfText) -> None:
    assert book.outline == tuple(PdfOutlineEntry(title, level, page) for title, level, page in fx.BOOK_OUTLINE)


def test_title_and_custom_metadata(book: PdfText) -> None:
    assert book.title == fx.BOOK_TITLE
    assert fx.BOOK_METADATA.items() <= book.metadata.items()
    assert "Title" not in book.metadata


def test_a_bookmark_to_no_page_is_skipped_with_a_warning() -> None:
    text = extract_pdf_text(fx.book_pdf(broken_bookmark=True))
    assert fx.LOST_BOOKMARK not in [entry.title for entry in text.outline]
    assert len(text.outline) == len(fx.BOOK_OUTLINE)
    assert any(fx.LOST_BOOKMARK in warning for warning in text.warnings)


def test_a_scan_is_refused() -> None:
    with pytest.raises(PdfRefused) as refused:
        extract_pdf_text(fx.scan_pdf())
    assert refused.value.reason == "no text layer: a scanned or image-only PDF (OCR it to make it searchable)"


def test_a_pdf_without_pages_is_refused() -> None:
    import pypdf

    empty = io.BytesIO()
    pypdf.PdfWriter().write(empty)
    with pytest.raises(PdfRefused, match="empty: the PDF has no pages"):
        extract_pdf_text(empty.getvalue())


@pytest.mark.parametrize("algorithm", ["AES-128", "AES-256", "RC4-128"])
def test_a_password_protected_pdf_is_refused(algorithm: str) -> None:
    with pytest.raises(PdfRefused) as refused:
        extract_pdf_text(fx.encrypted_pdf("s3cret", algorithm))
    assert refused.value.reason == "encrypted: a password is needed"


@pytest.mark.parametrize("algorithm", ["AES-128", "AES-256", "RC4-128"])
def test_an_empty_user_password_opens(algorithm: str) -> None:
    text = extract_pdf_text(fx.encrypted_pdf("", algorithm))
    assert fx.ENCRYPTED_SENTENCE in text.pages[0].text


@pytest.mark.heavy  # hostile input whose size is the point: `pytest --all` only (tests/README.md)
def test_more_text_than_the_limit_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(corpus_rules, "TEXT_LIMIT_CHARS", 500_000)
    extract_pdf_text(fx.book_pdf(extra_pages=100))  # ~390,000 characters
    with pytest.raises(PdfRefused, match="too large: more than 500,000 characters of text"):
        extract_pdf_text(fx.book_pdf(extra_pages=150))  # ~585,000


def test_pages_without_text_are_named_as_ranges() -> None:
    from corpus_rules import _pages_phrase

    assert _pages_phrase([2]) == "page 2 has"
    assert _pages_phrase([3, 7, 8, 9, 12]) == "pages 3, 7-9, 12 have"
    assert _pages_phrase([4, 5], "could") == "pages 4-5 could"


# ---------------------------------------------------------------------------
# Bounded: each hostile file fails alone (these start the extractor's child process).


HOSTILE: dict[str, Callable[[], bytes]] = {
    "flate bomb (2 GiB from 2 MB)": fx.flate_bomb_pdf,
    "object stream bomb": fx.object_stream_bomb_pdf,
    "cyclic /Prev chain": fx.cyclic_xref_pdf,
    "xref table declaring 1,000,000": fx.huge_xref_table_pdf,
    "xref stream of 1,000,000 rows": fx.huge_xref_stream_pdf,
    "page tree cycle": fx.page_tree_cycle_pdf,
    "page of 1e9 x 1e9 points": fx.huge_page_pdf,
    "arrays 100,000 deep": fx.deep_array_content_pdf,
    "dictionaries 100,000 deep": fx.deep_dictionary_pdf,
    "truncated": fx.truncated_pdf,
    "random bytes after %PDF-": fx.random_pdf,
}
MUST_BE_REFUSED = {"flate bomb (2 GiB from 2 MB)", "object stream bomb", "page tree cycle", "truncated",
                   "random bytes after %PDF-", "arrays 100,000 deep"}


def read_hostile(name: str, raw: bytes, extractor: PdfExtractor) -> str:
    """Extract `raw`, print what happened, check the bounds; the outcome ("ok …" or the reason)."""
    parent_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    started = time.monotonic()
    try:
        text = extractor.extract(raw, "hostile.pdf")
        outcome = f"ok: {len(text.pages)} page(s), {sum(len(page.text) for page in text.pages)} chars"
    except PdfRefused as exc:
        outcome = exc.reason
    elapsed = time.monotonic() - started
    peak = extractor.last_peak_memory
    print(f"\n{name:32} {len(raw) / 1000:9.1f} kB {elapsed:6.2f} s  child peak "
          f"{'?' if peak is None else f'{peak / MIB:.0f} MB':>7}  {outcome}")
    assert elapsed < extractor.timeout_for(len(raw)) + RESTART_SLACK_S
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - parent_peak < 50 * MIB
    assert not outcome.startswith("the extractor crashed"), outcome
    return outcome


def assert_reads_the_book(extractor: PdfExtractor) -> None:
    text = extractor.extract(fx.book_pdf(), "book.pdf")
    assert fx.BOOK_SENTENCES[1] in text.pages[0].text


@pytest.mark.process
@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_pdf_fails_alone(name: str) -> None:
    raw = HOSTILE[name]()
    extractor = PdfExtractor()  # a child of its own, so that its peak memory is this file's
    try:
        outcome = read_hostile(name, raw, extractor)
        if name in MUST_BE_REFUSED:
            assert not outcome.startswith("ok"), outcome
        assert_reads_the_book(extractor)
    finally:
        extractor.close()


@pytest.mark.process
@pytest.mark.heavy
def test_many_streams_each_under_the_cap_hit_the_deadline_or_the_memory_cap() -> None:
    """Thirty pages of 70 MB streams: each passes pypdf's per-stream cap; together they would
    hold 2 GB. The deadline (30 s + 2 s/MB) or the memory cap stops them, whichever comes first."""
    extractor = PdfExtractor()
    try:
        outcome = read_hostile("30 streams of 70 MB", fx.stacked_bomb_pdf(), extractor)
        assert outcome.startswith(("took longer than", "needs more than")), outcome
        assert_reads_the_book(extractor)
    finally:
        extractor.close()


@pytest.mark.process
def test_the_memory_cap_refuses_and_the_next_pdf_is_read() -> None:
    extractor = PdfExtractor(memory_limit=128 * MIB)  # below what the flate bomb needs before pypdf's cap
    try:
        outcome = read_hostile("flate bomb under a 128 MB cap", fx.flate_bomb_pdf(), extractor)
        assert outcome == "needs more than 128 MB of memory"
        assert_reads_the_book(extractor)
    finally:
        extractor.close()


@pytest.mark.process
def test_a_timeout_kills_the_child_and_the_next_pdf_is_read() -> None:
    extractor = PdfExtractor(timeout_base_s=2.0, timeout_per_mb_s=0.0)
    try:
        assert_reads_the_book(extractor)
        first = extractor._process
        started = time.monotonic()
        with pytest.raises(PdfRefused) as refused:
            extractor.extract(fx.stacked_bomb_pdf(pages=3), "slow.pdf")
        assert refused.value.reason == "took longer than 2 s"
        assert str(refused.value) == "slow.pdf: took longer than 2 s"
        assert time.monotonic() - started < 2.0 + RESTART_SLACK_S
        assert first is not None and first.returncode == -signal.SIGKILL  # killed and reaped
        assert_reads_the_book(extractor)
    finally:
        extractor.close()


@pytest.mark.process
def test_a_child_killed_mid_request_is_reported_and_replaced() -> None:
    extractor = PdfExtractor()
    try:
        assert_reads_the_book(extractor)
        assert extractor._process is not None
        threading.Timer(0.5, os.kill, (extractor._process.pid, signal.SIGKILL)).start()
        with pytest.raises(PdfRefused) as refused:
            extractor.extract(fx.stacked_bomb_pdf(pages=3), "big.pdf")
        assert refused.value.reason == "the extractor crashed (signal SIGKILL)"
        assert_reads_the_book(extractor)
    finally:
        extractor.close()


@pytest.mark.process
def test_a_child_that_died_between_pdfs_is_replaced() -> None:
    extractor = PdfExtractor()
    try:
        assert_reads_the_book(extractor)
        assert extractor._process is not None
        dead = extractor._process
        os.kill(dead.pid, signal.SIGKILL)
        dead.wait()
        assert_reads_the_book(extractor)
        assert extractor._process is not dead
    finally:
        extractor.close()


def alive(pid: int) -> bool:
    """Running (a zombie, or a pid gone, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


@pytest.mark.process
def test_close_ends_and_reaps_the_child() -> None:
    extractor = PdfExtractor()
    assert_reads_the_book(extractor)
    assert extractor._process is not None
    pid = extractor._process.pid
    extractor.close()
    assert not os.path.exists(f"/proc/{pid}")  # reaped: not even a zombie
    assert_reads_the_book(extractor)  # a later PDF starts another
    extractor.close()


def run_owner(tail: str) -> subprocess.Popen[str]:
    """A Python that reads the book with an extractor, prints the child's pid, then runs `tail`."""
    code = (f"import sys; sys.path[:0] = [{str(HERE)!r}, {str(HERE.parent)!r}]; import pdf_fixtures, corpus_rules\n"
            "extractor = corpus_rules.PdfExtractor(); extractor.extract(pdf_fixtures.book_pdf(), 'b')\n"
            f"print(extractor._process.pid, flush=True)\n{tail}")
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def wait_until_gone(pid: int, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not alive(pid)


@pytest.mark.process
def test_the_child_ends_when_the_interpreter_exits() -> None:
    owner = run_owner("")  # no close(): the interpreter's exit ends it
    pid = int(owner.stdout.readline())
    assert owner.wait(30) == 0
    assert wait_until_gone(pid)


@pytest.mark.process
def test_the_child_dies_with_its_parent() -> None:
    owner = run_owner("import time; time.sleep(60)")
    pid = int(owner.stdout.readline())
    assert alive(pid)
    owner.kill()
    owner.wait()
    assert wait_until_gone(pid)  # the child's watch on its parent


@pytest.mark.process
def test_stray_output_on_stdout_cannot_corrupt_an_answer() -> None:
    """A library that prints (Python or C level) in the child: the answer still arrives whole."""
    import pickle

    from corpus_rules import _PDF_FRAME_LENGTH as _FRAME_LENGTH

    code = (f"import os, sys; sys.path.insert(0, {str(HERE.parent)!r}); import corpus_rules\n"
            "real = corpus_rules.extract_pdf_text\n"
            "def noisy(raw):\n"
            "    print('a print from a library', flush=True); os.write(1, b'C code writing to fd 1')\n"
            "    return real(raw)\n"
            "corpus_rules.extract_pdf_text = noisy; corpus_rules.serve_pdf_extraction()")
    raw = fx.book_pdf()
    child = subprocess.run([sys.executable, "-c", code], input=_FRAME_LENGTH.pack(len(raw)) + raw,
                           capture_output=True, timeout=60, check=True)
    (length,) = _FRAME_LENGTH.unpack(child.stdout[:_FRAME_LENGTH.size])
    assert len(child.stdout) == _FRAME_LENGTH.size + length
    kind, text = pickle.loads(child.stdout[_FRAME_LENGTH.size:])
    assert kind == "ok" and fx.BOOK_SENTENCES[1] in text.pages[0].text
    assert b"a print from a library" in child.stderr and b"C code writing to fd 1" in child.stderr


@pytest.mark.process
def test_requests_from_many_threads_are_answered_one_at_a_time(extractor: PdfExtractor) -> None:
    documents = [fx.book_pdf(extra_pages=n) for n in range(6)]
    answers: dict[int, int] = {}

    def read(n: int) -> None:
        answers[n] = len(extractor.extract(documents[n], f"{n}.pdf").pages)

    threads = [threading.Thread(target=read, args=(n,)) for n in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert answers == {n: 6 + n for n in range(6)}


@pytest.mark.process
def test_a_refusal_names_the_file(extractor: PdfExtractor) -> None:
    with pytest.raises(PdfRefused) as refused:
        extractor.extract(fx.scan_pdf(), "scans/manual.pdf")
    assert refused.value.path == "scans/manual.pdf"
    assert str(refused.value).startswith("scans/manual.pdf: no text layer")


@pytest.mark.process
def test_the_timeout_grows_with_the_size_and_is_capped() -> None:
    extractor = PdfExtractor(timeout_base_s=30, timeout_per_mb_s=2, timeout_max_s=300)
    assert extractor.timeout_for(0) == 30
    assert extractor.timeout_for(10_000_000) == 50
    assert extractor.timeout_for(10**9) == 300
    assert CHILD_MEMORY_LIMIT == 1536 * MIB


BOOK = fx.book_pdf()
EDITS = st.lists(st.tuples(st.sampled_from(["flip", "insert", "delete"]), st.integers(0, len(BOOK) * 2),
                           st.integers(0, 255)), min_size=1, max_size=12)


@pytest.fixture(scope="module")
def quick_extractor() -> Iterator[PdfExtractor]:
    """A 10 s deadline, so that a hang found by hypothesis costs 10 s, not 30."""
    shared = PdfExtractor(timeout_base_s=10.0)
    yield shared
    shared.close()


@pytest.mark.process
@settings(max_examples=examples(80), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(edits=EDITS)
def test_a_mutated_book_is_read_or_refused_never_more(quick_extractor: PdfExtractor,
                                                      edits: list[tuple[str, int, int]]) -> None:
    raw = fx.mutated(BOOK, edits)
    started = time.monotonic()
    try:
        assert isinstance(quick_extractor.extract(raw, "mutated.pdf"), PdfText)
    except PdfRefused as exc:
        assert not exc.reason.startswith(("the extractor crashed", "took longer")), exc.reason
    assert time.monotonic() - started < quick_extractor.timeout_for(len(raw)) + RESTART_SLACK_S




def pages_per_second(read: Callable[[], object], pages: int) -> float:
    started = time.monotonic()
    read()
    return pages / (time.monotonic() - started)
