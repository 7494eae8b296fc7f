"""Scenario 2: kill -9 of a real `python ingest.py` at 20 moments spread over its run.

Each moment starts an ingest after every handbook got a new revision and a page was added or
removed, and SIGKILLs it at that moment: while it imports, during a chosen embedding call (the fake
answers slowly), at the exact point between writing a commit group's vectors and committing its
keyword rows (the test holds SQLite's write lock on the keyword index, sees the vectors land in
Chroma, then kills), just after a group's commit while its old vectors are being deleted, just
after the stamp is written, and at fractions of the run's embedding work (the share of its chunks
sent to the embedder, which a loaded machine does not shift as it shifts time). No hook in the product.

After every kill: the store opens, a real server (one process for the whole loop) answers from
it, every file that had chunks still has one complete generation of them, and no answer mixes
two generations of a file. After the loop the next run converges to exactly what a clean ingest
produces. The default run samples 4 moments; `pytest -m slow` runs all 20.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from fake_ollama import FakeOllama, calls_carrying
from faultlib import (
    chunk_counts,
    clean_reference,
    commit_groups,
    committed_hashes,
    gone,
    index_dir,
    poll,
    ro_query,
    vector_count,
    vector_processes,
    write_handbooks,
    write_lock,
)
from helpers import (
    RawServer,
    assert_consistent,
    call,
    copy_sample,
    corpus_hashes,
    current_of,
    finish,
    raw_server,
    run_ingest,
    snapshot,
    start_ingest,
)

import corpus_rules as rules

pytestmark = pytest.mark.process  # real processes (servers, ingest, Chroma): only in `pytest --all` (tests/README.md)

HANDBOOKS = {f"handbooks/h{i:02d}.md": 40 for i in range(16)}
EXTRA = "extra/page.md"
EXTRA_TEXT = "# Extra\n\nAn extra page that comes and goes.\n"
DELAY_S = 0.1  # per embedding call: the run lasts seconds, with room to act inside a call
REVISION = re.compile(r"revision-(\w+) part")
CHECKED = ("handbooks/h00.md", "handbooks/h07.md", "handbooks/h15.md")


@dataclass
class Run:
    proc: subprocess.Popen[str]
    fake: FakeOllama
    index: Path
    base_calls: int  # the fake's embed_calls before this run
    groups: list[list[str]]  # commit groups of this run
    tokens: dict[str, str]  # handbook -> the token in each of its chunks
    chunks: dict[str, int]  # file -> its chunks, for the files this run embeds
    note: str = ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_for_call(self, n: int) -> None:
        poll(lambda: self.fake.embed_calls >= self.base_calls + n or not self.alive())

    def kill(self) -> None:
        """kill -9 of the ingest; its vector process dies with it (PR_SET_PDEATHSIG), a moment
        later: waited for too, so nothing observed afterwards is still being written."""
        children = vector_processes(self.proc.pid)
        self.proc.send_signal(signal.SIGKILL)
        for pid in children:
            poll(lambda pid=pid: gone(pid), timeout=30, interval=0.005)


def at(seconds: float) -> Callable[[Run], None]:
    def moment(run: Run) -> None:
        time.sleep(seconds)
        run.kill()

    return moment


def at_fraction(fraction: float) -> Callable[[Run], None]:
    def moment(run: Run) -> None:
        work = fraction * sum(run.chunks.values())
        poll(lambda: sum(map(len, run.fake.call_inputs[run.base_calls:])) >= work or not run.alive(), timeout=120)
        run.kill()

    return moment


def in_call(n: int) -> Callable[[Run], None]:
    def moment(run: Run) -> None:
        run.wait_for_call(n)
        time.sleep(DELAY_S / 2)
        run.kill()

    return moment


def between_vectors_and_keywords(group: int) -> Callable[[Run], None]:
    """Deterministic: the fake holds the group's first embedding call (the first carrying its first
    file's token) while the test takes the keyword index's write lock; released, the ingest writes
    the group's vectors, then waits for the lock to commit the group before it; kill it once the
    vectors are in Chroma. (A run marks, in its own keyword-index transaction, that it writes
    vectors before its first embedding call: the lock, taken once a call is held, never stops it
    before its vectors.)"""

    def moment(run: Run) -> None:
        token = run.tokens[run.groups[group - 1][0]]

        def carried() -> int:
            return calls_carrying(run.fake.call_inputs[run.base_calls:], token)

        run.fake.configure(hold_carrying=token)
        try:
            assert not carried(), "the run reached the group before the test could hold its first call"
            poll(lambda: carried() or not run.alive())
            with write_lock(run.index / rules.KEYWORD_DB):
                vectors, hashes = vector_count(run.index), committed_hashes(run.index)
                run.fake.configure(hold_carrying=None)
                # All of the group's vectors (an earlier group's may still be landing too).
                size = sum(run.chunks[path] for path in run.groups[group - 1])
                poll(lambda: vector_count(run.index) >= vectors + size or not run.alive())
                run.kill()
                run.proc.wait(timeout=30)
        finally:
            run.fake.configure(hold_carrying=None)
        written = vector_count(run.index) - vectors
        assert written >= size and committed_hashes(run.index) == hashes
        run.note = f"({written} vectors in Chroma, keyword rows not committed)"

    return moment


def after_commit(group: int) -> Callable[[Run], None]:
    """Kill as soon as the group's last file is committed: its old vectors are being deleted."""

    def moment(run: Run) -> None:
        last = run.groups[group - 1][-1]
        old = committed_hashes(run.index).get(last)
        poll(lambda: committed_hashes(run.index).get(last) != old or not run.alive(), interval=0.001)
        run.kill()
        run.proc.wait(timeout=30)
        run.note = f"({stray_vectors(run.index)} vectors without committed rows left behind)"

    return moment


def stray_vectors(index: Path) -> int:
    return vector_count(index) - ro_query(index / rules.KEYWORD_DB, "SELECT count(*) FROM chunks")[0][0]


def after_stamp(run: Run) -> None:
    def stamp() -> list[tuple[str]]:
        return ro_query(run.index / rules.KEYWORD_DB, "SELECT value FROM meta WHERE key = 'stamp'")

    before, generation = stamp(), current_of(run.index.parent)["generation"]
    poll(lambda: stamp() != before or not run.alive(), timeout=120, interval=0.001)
    run.kill()
    run.proc.wait(timeout=30)
    if current_of(run.index.parent)["generation"] == generation:
        run.note = f"(stamp committed, CURRENT.json still at generation {generation})"


MOMENTS: dict[str, Callable[[Run], None]] = {
    "at spawn": at(0.0),
    "while importing": at(0.3),
    **{f"embedding call {n} in flight": in_call(n) for n in (1, 3, 6, 9, 12)},
    **{f"group {g} vectors written, keywords not": between_vectors_and_keywords(g) for g in (2, 3)},
    **{f"group {g} committed, old vectors going": after_commit(g) for g in (1, 2, 3)},
    "stamp written, CURRENT.json not yet": after_stamp,
    **{f"at {f:.0%} of the run": at_fraction(f) for f in (0.15, 0.3, 0.45, 0.6, 0.75, 0.9, 1.05)},
}
SAMPLE = ("group 2 vectors written, keywords not", "embedding call 6 in flight", "group 1 committed, old vectors going",
          "at 45% of the run")
assert len(MOMENTS) == 20 and set(SAMPLE) <= set(MOMENTS)


def check_after_kill(server: RawServer, store: Path, allowed: dict[str, set[str]], must_have: set[str],
                     revision_of: dict[str, str], tokens: dict[str, str]) -> None:
    # Directly, the way the server reads it: one complete committed set per file, vectors present.
    assert_consistent(store, allowed, must_have)
    # Through the server: every file that had chunks still has them, searches answer, and a
    # file's hits all come from the generation its committed rows name.
    listed = {d["path"]: d["chunks"] for d in call(server, "list_documents", {"limit": 500})[1]["documents"]}
    assert all(listed.get(path, 0) > 0 for path in must_have), listed
    committed = committed_hashes(index_dir(store))
    for path in CHECKED:
        expected = {revision_of[committed[path]]}
        for mode in ("keyword", "hybrid"):
            is_error, payload = call(server, "search_corpus", {"query": f"{tokens[path]} part 5", "k": 20,
                                                               "mode": mode, "path_prefix": path})
            assert not is_error and len(payload["results"]) == 20, payload
            assert {m for hit in payload["results"] for m in REVISION.findall(hit["text"])} == expected, (path, mode)
    assert not call(server, "search_corpus", {"query": "who gets paged for a sev-1"})[0]


def kill_loop(fake: FakeOllama, tmp_path: Path, moments: list[str]) -> list[str]:
    fake.reset()
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    tokens = write_handbooks(corpus, HANDBOOKS, "base")
    hashes = corpus_hashes(corpus)
    fake.configure(delay_seconds=DELAY_S)
    first = run_ingest(fake, corpus, store)
    assert first.code == 0, first.err
    # A killed run may leave any file at any revision written so far: all are allowed, none mixed.
    allowed = {path: {digest} for path, digest in hashes.items()}
    allowed[EXTRA] = {rules.content_hash(EXTRA_TEXT.encode())}
    revision_of = {hashes[path]: "base" for path in HANDBOOKS}
    must_have = set(hashes) - {"private/offsite-backup.md"}
    notes = []
    with raw_server(store, corpus, fake.host) as server:
        for step, name in enumerate(moments):
            # Every handbook changes, so every run re-embeds all of them in the same groups.
            write_handbooks(corpus, HANDBOOKS, f"s{step}")
            extra = corpus / EXTRA
            if step % 2:
                extra.unlink(missing_ok=True)
            else:
                extra.parent.mkdir(exist_ok=True)
                extra.write_text(EXTRA_TEXT, encoding="utf-8")
            now = corpus_hashes(corpus)
            for path in HANDBOOKS:
                allowed[path].add(now[path])
                revision_of[now[path]] = f"s{step}"
            index = index_dir(store)
            committed = committed_hashes(index)
            counts = {path: count for path, count in chunk_counts(corpus).items() if committed.get(path) != now[path]}
            run = Run(proc=start_ingest(fake, corpus, store), fake=fake, index=index, base_calls=fake.embed_calls,
                      groups=commit_groups(counts), tokens=tokens, chunks=counts)
            assert len(run.groups) >= 3
            MOMENTS[name](run)
            done = finish(run.proc)
            assert done.code in (-signal.SIGKILL, 0), (name, done.code, done.err[-2000:])
            assert "Traceback" not in done.err, done.err
            notes.append(f"{name}: {'killed' if done.code else 'had finished'} {run.note}".strip())
            check_after_kill(server, store, allowed, must_have, revision_of, tokens)
    fake.configure(delay_seconds=0.0)
    final = run_ingest(fake, corpus, store)
    assert final.code == 0, final.err
    assert snapshot(store) == clean_reference(fake, corpus, tmp_path)
    assert not list(store.glob("*.tmp"))
    return notes


def test_kill_9_at_sampled_moments_then_converges(fake: FakeOllama, tmp_path: Path) -> None:
    notes = kill_loop(fake, tmp_path, list(SAMPLE))
    print(json.dumps(notes, indent=1, ensure_ascii=False))
    assert all(": killed" in note for note in notes), notes


@pytest.mark.slow
def test_kill_9_at_20_moments_then_converges(fake: FakeOllama, tmp_path: Path) -> None:
    notes = kill_loop(fake, tmp_path, list(MOMENTS))
    print(json.dumps(notes, indent=1, ensure_ascii=False))
    # "at 105%" may find the run already over; every other moment lands inside it.
    assert sum(": killed" in note for note in notes) >= 19, notes
