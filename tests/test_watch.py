"""`python ingest.py --watch` as a user leaves it running (issue 11): a real subprocess watching a
corpus, a real `python server.py` answering from the store it keeps fresh. Edits, additions,
deletions, renames and editor-style atomic saves show up in search within seconds; a burst of
writes causes a few runs, not one per write; the lock is free between runs; Ctrl-C stops cleanly."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_ollama import FakeOllama
from faultlib import gone, poll, vector_processes
from helpers import ROOT, RawServer, call, child_env, copy_sample, raw_server, run_ingest

pytestmark = pytest.mark.process  # real processes (servers, ingest, Chroma): only in `pytest --all` (tests/README.md)

SETTLE_S = 0.3
VISIBLE_WITHIN_S = 15.0  # generous for a loaded CI machine; the bench measures the real latency


class Watcher:
    def __init__(self, fake: FakeOllama, corpus: Path, store: Path, **popen: Any) -> None:
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "ingest.py"), "--corpus", str(corpus), "--store",
                                      str(store), "--watch", "--settle", str(SETTLE_S)], env=child_env(fake),
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT.parent,
                                     **popen)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        poll(lambda: self.runs() >= 1 or self.proc.poll() is not None, timeout=120, interval=0.05)
        assert self.proc.poll() is None, "".join(self.lines)

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)

    def runs(self) -> int:
        return sum(1 for line in self.lines if line.startswith("ingest: watch "))

    def wait_for_run_after(self, count: int) -> None:
        poll(lambda: self.runs() > count, timeout=VISIBLE_WITHIN_S, interval=0.05)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            code = self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        self._reader.join(timeout=10)
        return code


@pytest.fixture
def watched(tmp_path: Path) -> Iterator[tuple[FakeOllama, Path, Path, Watcher]]:
    with FakeOllama() as fake:
        corpus, store = copy_sample(tmp_path), tmp_path / "store"
        watcher = Watcher(fake, corpus, store)
        try:
            yield fake, corpus, store, watcher
        finally:
            code = watcher.stop()
            assert code == 0 and "watch stopped" in "".join(watcher.lines), "".join(watcher.lines)[-3000:]
            assert "Traceback" not in "".join(watcher.lines)


def paths_found(server: RawServer, query: str) -> set[str]:
    is_error, payload = call(server, "search_corpus", {"query": query, "mode": "keyword", "k": 20})
    assert not is_error, payload
    return {hit["path"] for hit in payload["results"]}


def test_edits_additions_deletions_renames_and_atomic_saves_show_up(watched: tuple) -> None:
    fake, corpus, store, watcher = watched
    with raw_server(store, corpus, fake.host) as server:
        def visible(query: str, path: str | None) -> None:
            deadline = time.monotonic() + VISIBLE_WITHIN_S
            while True:
                found = paths_found(server, query)
                if (path in found) if path else not found:
                    return
                assert time.monotonic() < deadline, (query, path, found, "".join(watcher.lines)[-2000:])
                time.sleep(0.1)

        def change(make: Callable[[], object], query: str, path: str | None) -> None:
            """Make a change, see it in search, then wait for its run's line: the change is
            searchable once committed, and the line comes after CURRENT.json. So every run is
            counted before the next change is made, however slowly the machine runs."""
            runs = watcher.runs()
            make()
            visible(query, path)
            watcher.wait_for_run_after(runs)

        (corpus / "notes").mkdir()
        change(lambda: (corpus / "notes" / "kumquat.md").write_text("# Kumquat\n\nKUMQUATADDED orchard notes.\n",
                                                                    encoding="utf-8"),
               "KUMQUATADDED", "notes/kumquat.md")
        glossary = corpus / "reference" / "glossary.md"
        change(lambda: glossary.write_text(glossary.read_text(encoding="utf-8") + "\nZEBRAEDITED: a new term.\n",
                                           encoding="utf-8"),
               "ZEBRAEDITED", "reference/glossary.md")
        change(lambda: (corpus / "notes" / "kumquat.md").rename(corpus / "notes" / "citrus.md"),
               "KUMQUATADDED", "notes/citrus.md")
        assert "notes/kumquat.md" not in paths_found(server, "KUMQUATADDED")
        change(lambda: (corpus / "notes" / "citrus.md").unlink(), "KUMQUATADDED", None)
        # An editor's atomic save: write a temp file beside it, then rename it over the real one,
        # plus a backup file (x.md~) and a swap file: one run, for the real file only.
        before = watcher.runs()
        deploy = corpus / "runbooks" / "deploy.md"
        temp = corpus / "runbooks" / ".deploy.md.tmp1234"
        temp.write_text(deploy.read_text(encoding="utf-8") + "\nATOMICSAVED closing line.\n", encoding="utf-8")
        (corpus / "runbooks" / "deploy.md~").write_text("backup", encoding="utf-8")
        (corpus / "runbooks" / ".deploy.md.swp").write_text("swap", encoding="utf-8")
        os.replace(temp, deploy)
        visible("ATOMICSAVED", "runbooks/deploy.md")
        watcher.wait_for_run_after(before)
        time.sleep(SETTLE_S * 4)
        assert watcher.runs() == before + 1, watcher.lines[-5:]
        last_run = [line for line in watcher.lines if line.startswith("ingest: watch ")][-1]
        assert "1 updated" in last_run and "0 added" in last_run, last_run


def test_a_burst_of_writes_makes_a_few_runs_and_the_lock_is_free_between(watched: tuple) -> None:
    fake, corpus, store, watcher = watched
    before = watcher.runs()
    burst = corpus / "burst"
    burst.mkdir()
    for i in range(100):
        (burst / f"page-{i:03d}.md").write_text(f"# Page {i}\n\nBURSTTOKEN{i:03d} page {i}.\n", encoding="utf-8")
    poll(lambda: sum(_added(line) for line in watcher.lines if not line.startswith("ingest: watch start")) >= 100,
         timeout=60, interval=0.1)
    time.sleep(SETTLE_S * 5)
    runs = watcher.runs() - before
    assert 1 <= runs <= 3, watcher.lines[-6:]
    # Between runs the ingest lock is free: a manual run works (and has nothing to do).
    manual = run_ingest(fake, corpus, store)
    assert manual.code == 0 and manual.summary["added"] == 0, manual.err


def _added(line: str) -> int:
    if not line.startswith("ingest: watch "):
        return 0
    words = line.split()
    return int(words[words.index("added,") - 1]) if "added," in words else 0


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the watcher's child in /proc (Linux)")
def test_a_vector_process_killed_between_runs_is_replaced_and_dies_with_the_watcher(tmp_path: Path) -> None:
    """The watcher keeps one vector process for all its runs; killed from outside, the next run
    starts a new one instead of failing on a dead pipe; kill -9 of the watcher takes it along."""
    with FakeOllama() as fake:
        corpus, store = copy_sample(tmp_path), tmp_path / "store"
        watcher = Watcher(fake, corpus, store)
        try:
            children = vector_processes(watcher.proc.pid)
            assert len(children) == 1, children
            os.kill(children[0], signal.SIGKILL)
            poll(lambda: gone(children[0]), timeout=10, interval=0.05)
            runs = watcher.runs()
            (corpus / "after-kill.md").write_text("# After\n\nPHOENIXTOKEN rises again.\n", encoding="utf-8")
            watcher.wait_for_run_after(runs)
            last = [line for line in watcher.lines if line.startswith("ingest: watch ")][-1]
            assert "1 added" in last and "[ok]" in last, watcher.lines[-3:]
            with raw_server(store, corpus, fake.host) as server:
                assert paths_found(server, "PHOENIXTOKEN") == {"after-kill.md"}
            replacement = vector_processes(watcher.proc.pid)
            assert len(replacement) == 1 and replacement != children, (children, replacement)
        finally:
            watcher.proc.kill()
            watcher.proc.wait(timeout=10)
        poll(lambda: gone(replacement[0]), timeout=10, interval=0.05)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the watcher's child in /proc (Linux)")
def test_a_vector_process_whose_write_failed_is_replaced(tmp_path: Path) -> None:
    """A full disk fails a run in Chroma's write; once there is room again the next run works. The
    vector process whose write failed is not used again: Chroma can keep a lock from the failed
    write, and its next write waited for ever on it. The disk is 'full' by a file-size limit on
    the watcher, which its first vector process inherits; the limit is then lifted on the watcher
    only, so a reused process would still fail."""

    def small_files() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        # The soft limit only: lifting it again later needs no privilege.
        resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, resource.RLIM_INFINITY))

    with FakeOllama() as fake:
        corpus, store = copy_sample(tmp_path), tmp_path / "store"
        watcher = Watcher(fake, corpus, store, preexec_fn=small_files)
        try:
            first = [line for line in watcher.lines if line.startswith("ingest: watch ")][-1]
            assert "could not finish" in first, watcher.lines[-3:]
            assert any("could not be written" in line for line in watcher.lines), watcher.lines[-3:]
            children = vector_processes(watcher.proc.pid)
            assert len(children) == 1, children
            resource.prlimit(watcher.proc.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
            runs = watcher.runs()
            (corpus / "after-full.md").write_text("# After\n\nROOMTOKEN again.\n", encoding="utf-8")
            watcher.wait_for_run_after(runs)
            last = [line for line in watcher.lines if line.startswith("ingest: watch ")][-1]
            assert "[ok]" in last, watcher.lines[-3:]
            with raw_server(store, corpus, fake.host) as server:
                assert paths_found(server, "ROOMTOKEN") == {"after-full.md"}
            replacement = vector_processes(watcher.proc.pid)
            assert len(replacement) == 1 and replacement != children, (children, replacement)
        finally:
            watcher.proc.kill()
            watcher.proc.wait(timeout=10)


def test_a_replaced_corpus_folder_is_watched_again_and_a_gone_one_exits_non_zero(tmp_path: Path) -> None:
    """A deploy swaps the folder (mv docs docs.old && mv docs.new docs): the watch re-attaches and
    indexes the new one. A folder that stays gone ends the watch with exit 2, so that systemd's
    Restart=on-failure restarts it."""
    with FakeOllama() as fake:
        corpus, store = copy_sample(tmp_path), tmp_path / "store"
        fresh = copy_sample(tmp_path, "fresh")
        (fresh / "swapped-in.md").write_text("# Swapped in\n\nThe quokkafish rotation arrived with the deploy.\n")
        watcher = Watcher(fake, corpus, store)
        try:
            runs = watcher.runs()
            corpus.rename(tmp_path / "corpus.old")
            fresh.rename(corpus)
            watcher.wait_for_run_after(runs)
            with raw_server(store, corpus, fake.host) as server:
                assert "swapped-in.md" in paths_found(server, "quokkafish")
            runs = watcher.runs()
            (corpus / "later.md").write_text("# Later\n\nThe narwhalbadger desk answers pages.\n")
            watcher.wait_for_run_after(runs)
            with raw_server(store, corpus, fake.host) as server:
                assert "later.md" in paths_found(server, "narwhalbadger"), "changes in the new folder are seen"
            corpus.rename(tmp_path / "corpus.gone")
            code = watcher.proc.wait(timeout=60)
        finally:
            watcher.stop()
        assert code == 2 and "is gone" in "".join(watcher.lines), "".join(watcher.lines)[-2000:]


def test_a_second_watcher_on_the_store_waits_and_takes_over_when_the_first_stops(tmp_path: Path) -> None:
    """One watcher a store (issue 46): a second `ingest.py --watch` on it says who holds the store's
    watch lock and waits, running nothing; once the first stops it takes over and indexes what
    changed meanwhile. A crashed holder frees the lock too: the kernel lets go of it."""
    with FakeOllama() as fake:
        corpus, store = copy_sample(tmp_path), tmp_path / "store"
        first = Watcher(fake, corpus, store)
        try:
            _second_watcher_takes_over(fake, corpus, store, first)
        finally:
            first.proc.kill()
            first.proc.wait(timeout=30)


def _second_watcher_takes_over(fake: FakeOllama, corpus: Path, store: Path, first: Watcher) -> None:
    second = subprocess.Popen([sys.executable, str(ROOT / "ingest.py"), "--corpus", str(corpus), "--store", str(store),
                               "--watch", "--settle", str(SETTLE_S)], env=child_env(fake), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=ROOT.parent)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(second.stderr), daemon=True).start()  # type: ignore[arg-type]
    try:
        poll(lambda: any(f"another watcher (pid {first.proc.pid}) keeps" in line for line in lines), timeout=60,
             interval=0.05)
        time.sleep(SETTLE_S * 5)
        assert not any(line.startswith("ingest: watch ") for line in lines), lines
        first.proc.kill()  # a crash: no clean stop
        first.proc.wait(timeout=30)
        (corpus / "handover.md").write_text("# Handover\n\nHANDOVERTOKEN after the first watcher died.\n",
                                            encoding="utf-8")
        poll(lambda: any(line.startswith("ingest: watch start") for line in lines), timeout=60, interval=0.05)
        assert any("the other watcher stopped" in line for line in lines), lines
        with raw_server(store, corpus, fake.host) as server:
            assert paths_found(server, "HANDOVERTOKEN") == {"handover.md"}
    finally:
        second.send_signal(signal.SIGINT)
        assert second.wait(timeout=60) == 0, "".join(lines)[-2000:]
