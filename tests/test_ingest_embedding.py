"""Ingest against a slow embedder, and every distinct text embedded once (issues 11 and 14).

Batches are sized to the embedder's measured pace and halved after a timeout; a run interrupted
by Ctrl-C keeps what it committed and the next one continues; a chunk whose exact embedded text
already has a vector in the index (an edit elsewhere in its file, a renamed, moved or copied file)
takes that vector instead of a new embedding call. Real processes and the loopback fake Ollama,
whose per-text latency stands in for a CPU-only embedder."""

from __future__ import annotations

import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from budgets import examples
from fake_ollama import FakeOllama
from faultlib import committed_hashes, index_dir, poll, write_handbooks
from helpers import (
    ROOT,
    Done,
    child_env,
    copy_sample,
    current_of,
    edit,
    finish,
    ingest_args,
    ingest_in_process,
    snapshot,
    start_ingest,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import corpus_rules as rules
import ingest


@pytest.fixture
def fake() -> FakeOllama:
    with FakeOllama() as instance:
        yield instance


def embedded_texts(fake: FakeOllama) -> list[str]:
    """The chunk texts Ollama embedded (not the calibration's headings, embedded as queries)."""
    return [text for text in fake.calls()["embedded_inputs"]
            if not text.startswith("task: search result") and text != rules.FINGERPRINT_TEXT]


# ---------------------------------------------------------------------------
# Batch sizing: a pure function of the measured pace.


@settings(max_examples=examples(200), deadline=None, derandomize=True)
@given(tokens=st.lists(st.integers(1, 600), min_size=1, max_size=200), pace=st.floats(1.0, 1e6),
       target=st.floats(0.1, 10.0))
def test_batch_sizes_stay_within_one_chunk_and_the_cap(tokens: list[int], pace: float, target: float) -> None:
    sizer = ingest.BatchSizer(target_s=target)
    first = sizer.size(tokens)
    assert first == min(ingest.START_CHUNKS, len(tokens))  # a new run starts small
    sizer.measured(sum(tokens[:first]), sum(tokens[:first]) / pace)
    size = sizer.size(tokens)
    assert 1 <= size <= min(ingest.EMBED_BATCH, len(tokens))
    # Within the time budget, unless a single chunk alone is over it.
    assert sum(tokens[:size]) <= sizer.pace * target or size == 1
    sizer.timed_out(size)
    assert sizer.size(tokens) <= max(1, size // 2)


def test_a_slow_embedder_gets_small_calls_and_a_fast_one_full_calls() -> None:
    slow = ingest.BatchSizer(target_s=4.0)
    slow.measured(tokens=800, seconds=8.0)  # 100 tokens a second: a laptop CPU
    assert slow.size([100] * 64) == 4
    fast = ingest.BatchSizer(target_s=4.0)
    fast.measured(tokens=800, seconds=0.01)
    assert fast.size([100] * 200) == ingest.EMBED_BATCH


# ---------------------------------------------------------------------------
# A slow embedder is not a failure.


@pytest.mark.heavy  # 0.1 s a text by design: ~15 s
def test_calls_a_64_chunk_batch_would_time_out_on_still_index_everything(fake: FakeOllama, tmp_path: Path) -> None:
    """0.1 s per text and a 2 s timeout: 64 texts take 6.4 s (too long), 8 take 0.8 s."""
    corpus = copy_sample(tmp_path)
    write_handbooks(corpus, {"handbook.md": 120}, "A")
    fast = ingest_in_process(fake, corpus, tmp_path / "fast")
    assert fast.code == 0, fast.err
    fake.reset()
    fake.configure(delay_per_text_seconds=0.1)
    slow = ingest_in_process(fake, corpus, tmp_path / "slow", RAG_EMBED_TIMEOUT="2")
    assert slow.code == 0, slow.err
    assert (slow.summary["failed"], slow.summary["left_for_next_run"]) == (0, 0)
    assert slow.summary["chunks_written"] == fast.summary["chunks_written"]
    assert "timed out" not in slow.err
    # Chunks' calls (the calibration's short headings are sized by their own few tokens).
    sizes = [len(body["input"]) for _, path, body in fake.calls()["requests"]
             if path == "/api/embed" and not body["input"][0].startswith("task: search result")]
    assert max(sizes) <= 8 < fast.summary["chunks_written"], sizes
    assert all(body.get("keep_alive") == ingest.KEEP_ALIVE for _, path, body in fake.calls()["requests"]
               if path == "/api/embed"), "the model is asked to stay loaded for the run"
    assert snapshot(tmp_path / "slow") == snapshot(tmp_path / "fast")


@pytest.mark.process
def test_a_call_that_times_out_is_retried_with_fewer_chunks(fake: FakeOllama, tmp_path: Path) -> None:
    """Started at the full 64 chunks (as if the first measurement had been optimistic): each timeout
    halves the call until one fits, and the run completes."""
    corpus, store = tmp_path / "corpus", tmp_path / "store"
    write_handbooks(corpus, {"handbook.md": 70}, "A")
    fake.configure(delay_per_text_seconds=0.05)
    proc = subprocess.run([sys.executable, "-c", "import sys, ingest; ingest.START_CHUNKS = 64; "
                           "sys.exit(ingest.main(sys.argv[1:]))", *ingest_args(corpus, store)[2:]],
                          env=child_env(fake, RAG_EMBED_TIMEOUT="1.5", PYTHONPATH=str(ROOT)), capture_output=True,
                          text=True, timeout=300, cwd=ROOT.parent)
    assert proc.returncode == 0, proc.stderr
    assert "an embedding call of 64 chunks timed out" in proc.stderr
    assert "an embedding call of 32 chunks timed out" in proc.stderr
    assert current_of(store)["stamp"]["chunks"] == 70


def test_an_embedder_that_times_out_on_one_chunk_stops_quickly_and_loses_nothing(fake: FakeOllama,
                                                                                  tmp_path: Path) -> None:
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    assert ingest_in_process(fake, corpus, store).code == 0
    before = committed_hashes(index_dir(store))
    edit(corpus / "reference" / "glossary.md", "# Glossary\n\nA new definition.\n")
    edit(corpus / "oncall" / "escalation.md", "# Escalation\n\nRewritten.\n")
    fake.configure(delay_per_text_seconds=5.0)
    started = time.monotonic()
    done = ingest_in_process(fake, corpus, store, RAG_EMBED_TIMEOUT="1")
    elapsed = time.monotonic() - started
    assert done.code == 2, done.err
    assert done.summary["left_for_next_run"] == 2 and done.summary["failed"] == 0
    assert elapsed < 20, f"bounded retries: {elapsed:.1f} s"
    assert committed_hashes(index_dir(store)) == before
    fake.configure(delay_per_text_seconds=0.0)
    again = ingest_in_process(fake, corpus, store)
    assert again.code == 0 and again.summary["updated"] == 2


def interrupted_ingest(fake: FakeOllama, corpus: Path, store: Path, files: int, committed: int,
                       signum: signal.Signals) -> Done:
    """A real ingest of `files` handbooks, sent `signum` once `committed` of them are committed."""
    write_handbooks(corpus, {f"h{i:02d}.md": 30 for i in range(files)}, "A")
    fake.configure(delay_seconds=0.2)
    proc = start_ingest(fake, corpus, store)
    poll(lambda: len(_committed(store)) >= committed or proc.poll() is not None, timeout=120, interval=0.05)
    proc.send_signal(signum)
    return finish(proc)


@pytest.mark.process
def test_sigterm_ends_a_run_as_ctrl_c_does(fake: FakeOllama, tmp_path: Path) -> None:
    """kill (a supervisor, a CI job's timeout) ends a run with 130 and the same message as Ctrl-C,
    not 143 and nothing said (issue 41)."""
    done = interrupted_ingest(fake, tmp_path / "corpus", tmp_path / "store", 6, 1, signal.SIGTERM)
    assert done.code == 130, done.err
    assert "Traceback" not in done.err and "interrupted; what was committed is kept" in done.err


@pytest.mark.process
def test_ctrl_c_keeps_what_was_committed_and_the_next_run_continues(fake: FakeOllama, tmp_path: Path) -> None:
    corpus, store = tmp_path / "corpus", tmp_path / "store"
    # Once a few files are committed with their vectors, Ctrl-C.
    done = interrupted_ingest(fake, corpus, store, 12, 3, signal.SIGINT)
    assert done.code == 130, done.err
    assert "Traceback" not in done.err and "interrupted" in done.err
    committed = _committed(store)
    assert 0 < len(committed) < 12
    fake.reset()
    again = ingest_in_process(fake, corpus, store)
    assert again.code == 0, again.err
    # No committed file is embedded again: only the rest.
    assert again.summary["added"] == 12 - len(committed)
    assert again.summary["chunks_embedded"] == 30 * (12 - len(committed))
    texts = embedded_texts(fake)
    for path in committed:
        assert not any(f"tok{path.replace('.', '')} " in text for text in texts), path


def _committed(store: Path) -> set[str]:
    """Files whose rows are committed with their vectors (not only for keyword search), read from
    whichever index folder exists (before the first publish there is no CURRENT.json yet)."""
    found: set[str] = set()
    for db in store.glob("idx-*/" + rules.KEYWORD_DB):
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
        try:
            found |= {row[0] for row in con.execute(
                "SELECT path FROM documents WHERE path NOT IN (SELECT path FROM vectors_pending)")}
        except sqlite3.Error:
            pass
        finally:
            con.close()
    return found


# ---------------------------------------------------------------------------
# Embed each distinct text once.


def long_document(paragraphs: int, marker: str = "") -> str:
    parts = ["---\nrag_chunk: headings\ntitle: Operations manual\n---\n"]
    for i in range(paragraphs):
        parts.append(f"## Procedure {i}\n\nStep {i} of the manual{marker if i == 17 else ''}: check the gauge "
                     f"number {i}, record the reading, and compare it with yesterday's reading {i}. If the two "
                     f"differ by more than the tolerance printed on gauge {i}, stop the line, call the shift "
                     f"lead, and write the difference into the log book for procedure {i} before going on.\n")
    return "\n".join(parts)


@pytest.mark.heavy  # about 1 s of CPU in ingest runs: in --all, to keep the fast tier's budget
def test_an_edit_in_one_paragraph_embeds_only_that_chunk(fake: FakeOllama, tmp_path: Path) -> None:
    corpus, store = tmp_path / "corpus", tmp_path / "store"
    corpus.mkdir()
    (corpus / "manual.md").write_text(long_document(40), encoding="utf-8")
    first = ingest_in_process(fake, corpus, store)
    assert first.code == 0 and first.summary["chunks_written"] == 40, first.err
    fake.reset()
    edit(corpus / "manual.md", long_document(40, marker=" (revised)"))
    done = ingest_in_process(fake, corpus, store)
    assert done.code == 0, done.err
    assert done.summary["chunks_embedded"] <= 2 and done.summary["chunks_reused"] >= 38
    assert [t for t in embedded_texts(fake) if "Procedure 17" in t]
    assert snapshot(store) == _clean(fake, corpus, tmp_path)


@pytest.mark.heavy  # about 1 s of CPU in ingest runs: in --all, to keep the fast tier's budget
def test_a_renamed_folder_and_a_copied_file_embed_nothing(fake: FakeOllama, tmp_path: Path) -> None:
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    assert ingest_in_process(fake, corpus, store).code == 0
    fake.reset()
    (corpus / "runbooks").rename(corpus / "playbooks")
    shutil.copy2(corpus / "reference" / "api.md", corpus / "reference" / "api-copy.md")
    done = ingest_in_process(fake, corpus, store)
    assert done.code == 0, done.err
    assert (done.summary["added"], done.summary["removed"]) == (3, 2)
    # No chunk text goes to Ollama (the copy moves the chunk count enough for the calibration's
    # headings to be embedded again, as queries).
    assert done.summary["chunks_embedded"] == 0 and embedded_texts(fake) == []
    assert done.summary["chunks_reused"] == done.summary["chunks_written"] > 0
    assert snapshot(store) == _clean(fake, corpus, tmp_path)


def test_full_re_embeds_everything(fake: FakeOllama, tmp_path: Path) -> None:
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    first = ingest_in_process(fake, corpus, store)
    fake.reset()
    full = ingest_in_process(fake, corpus, store, "--full")
    assert full.code == 0
    assert (full.summary["chunks_embedded"], full.summary["chunks_reused"]) == (first.summary["chunks_written"], 0)


@pytest.mark.heavy  # about 1 s of CPU in ingest runs: in --all, to keep the fast tier's budget
def test_weights_re_pulled_under_the_same_name_re_embed_everything(fake: FakeOllama, tmp_path: Path) -> None:
    """`ollama pull` of new weights keeps the model's name and dimensions but changes its digest:
    every stored vector is stale, so the next run embeds every chunk again (no reuse), records the
    new digest, and the run after that has nothing to do."""
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    first = ingest_in_process(fake, corpus, store)
    digest = current_of(store)["stamp"]["model_digest"]
    assert isinstance(digest, str) and len(digest) == 64
    fake.reset()
    fake.configure(weights="re-pulled")
    again = ingest_in_process(fake, corpus, store)
    assert again.code == 0, again.err
    assert again.summary["model_changed"] is True and "weights changed" in again.err
    assert (again.summary["chunks_embedded"], again.summary["chunks_reused"]) == (first.summary["chunks_written"], 0)
    new_digest = current_of(store)["stamp"]["model_digest"]
    assert new_digest not in (None, digest)
    assert current_of(store)["generation"] == 2
    fake.reset()
    fake.configure(weights="re-pulled")
    settled = ingest_in_process(fake, corpus, store)
    assert settled.summary["model_changed"] is False and settled.summary["chunks_embedded"] == 0
    assert current_of(store)["stamp"]["model_digest"] == new_digest


@pytest.mark.heavy  # about 1 s of CPU in ingest runs: in --all, to keep the fast tier's budget
def test_an_index_written_before_embed_keys_gets_them_and_reuses(fake: FakeOllama, tmp_path: Path) -> None:
    """A store from before chunks carried their embed_key: ingest fills the keys from the rows,
    so its vectors are reused like any other."""
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    assert ingest_in_process(fake, corpus, store).code == 0
    db = index_dir(store) / rules.KEYWORD_DB
    con = sqlite3.connect(db)
    con.execute("DROP INDEX IF EXISTS chunks_by_embed_key")
    con.execute("ALTER TABLE chunks DROP COLUMN embed_key")
    con.execute("PRAGMA user_version = 0")  # an older ingest recorded no schema version
    con.commit()
    con.close()
    fake.reset()
    (corpus / "oncall").rename(corpus / "on-call")
    done = ingest_in_process(fake, corpus, store)
    assert done.code == 0, done.err
    assert done.summary["chunks_embedded"] == 0 and done.summary["chunks_reused"] > 0
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    assert con.execute("SELECT count(*) FROM chunks WHERE embed_key IS NULL").fetchone() == (0,)
    con.close()
    assert snapshot(store) == _clean(fake, corpus, tmp_path)


def _clean(fake: FakeOllama, corpus: Path, tmp_path: Path) -> dict:
    reference = tmp_path / f"reference-{time.monotonic_ns()}"
    done = ingest_in_process(fake, corpus, reference)
    assert done.code == 0, done.err
    return snapshot(reference)


@pytest.mark.process
def test_ctrl_c_half_way_through_a_first_ingest_keeps_about_half(fake: FakeOllama, tmp_path: Path) -> None:
    """#28 §5, the case a user met: 13 files, one slow embedder, Ctrl-C when half the chunks
    were embedded. The next run embeds at most 60% of them, and the counts agree everywhere."""
    corpus, store = tmp_path / "corpus", tmp_path / "store"
    write_handbooks(corpus, {f"h{i:02d}.md": 22 for i in range(13)}, "H")
    dry = ingest_in_process(fake, corpus, store, "--dry-run")
    total = dry.summary["estimated_chunks"]
    fake.configure(delay_per_text_seconds=0.05)
    proc = start_ingest(fake, corpus, store)
    poll(lambda: len(fake.embedded_inputs) >= total // 2 or proc.poll() is not None, timeout=120, interval=0.05)
    proc.send_signal(signal.SIGINT)
    done = finish(proc)
    assert done.code == 130, done.err
    fake.reset()
    again = ingest_in_process(fake, corpus, store)
    assert again.code == 0, again.err
    assert again.summary["chunks_embedded"] <= 0.6 * total, (again.summary, total)
    assert again.summary["chunks_embedded"] + again.summary["chunks_reused"] <= total
    whole = ingest_in_process(fake, corpus, tmp_path / "whole")
    assert whole.summary["chunks_written"] == whole.summary["chunks_embedded"] == total
