"""Freshness on every search hit (issue 29, section 6), in process: each hit says whether its file
changed on disk since ingest, from one stat per distinct path against the size and mtime the index
recorded. Through the real service over a real index of (a copy of) sample-corpus built by the
real ingest, every result checked against the tool's outputSchema; tests/test_progress_e2e.py
checks the same through the real `python server.py` over stdio.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from pathlib import Path
from typing import Any

import pytest
from fake_ollama import FakeOllama
from helpers import Built, dispatched, edit, in_process_service

import corpus_rules as rules
import server


@pytest.fixture
def fresh(fake: FakeOllama, sample_index: tuple[Path, Path]) -> Built:
    return Built(*sample_index, fake.host)


def test_each_hit_says_whether_its_file_changed_on_disk(fresh: Built) -> None:
    svc = in_process_service(fresh)
    query = "deploy rollback database escalation"
    _, before = dispatched(svc, "search_corpus", query=query, k=10)
    paths = {hit["path"] for hit in before["results"]}
    assert {"oncall/escalation.md", "runbooks/deploy.md"} <= paths and len(paths) >= 3, paths
    assert all(not hit["changed_on_disk"] and hit["freshness"] == "unchanged" for hit in before["results"])
    target = fresh.corpus / "oncall" / "escalation.md"
    edit(target, target.read_text(encoding="utf-8") + "\nA line added after ingest.\n")
    (fresh.corpus / "runbooks" / "deploy.md").unlink()
    _, after = dispatched(svc, "search_corpus", query=query, k=10)
    states = {hit["path"]: (hit["changed_on_disk"], hit["freshness"]) for hit in after["results"]}
    assert states.pop("oncall/escalation.md") == (True, "modified")
    assert states.pop("runbooks/deploy.md") == (True, "deleted")
    assert states and all(state == (False, "unchanged") for state in states.values()), states
    view = server.search_view(after)
    assert "[modified on disk since the index was built" in view and "[deleted on disk since" in view
    assert view.count("on disk since the index was built") == sum(hit["changed_on_disk"] for hit in after["results"])


def test_a_file_swapped_for_a_link_to_an_identical_copy_reads_as_modified(fresh: Built, tmp_path: Path) -> None:
    """Same size, same mtime, but a link: get_file refuses it, so the hit must not say unchanged."""
    svc = in_process_service(fresh)
    target = fresh.corpus / "oncall" / "escalation.md"
    copy = tmp_path / "elsewhere.md"
    copy.write_bytes(target.read_bytes())
    st = target.stat()
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns))
    target.unlink()
    target.symlink_to(copy)
    _, found = dispatched(svc, "search_corpus", query="deploy rollback database escalation", k=10)
    states = {hit["path"]: (hit["changed_on_disk"], hit["freshness"]) for hit in found["results"]}
    assert states["oncall/escalation.md"] == (True, "modified"), states
    refused, answer = dispatched(svc, "get_file", path="oncall/escalation.md")
    assert refused and answer["error"]["code"] == "path_rejected", answer


def test_freshness_stats_the_hits_files_once_each(fresh: Built, monkeypatch: pytest.MonkeyPatch) -> None:
    """Never the whole corpus per search: one stat per distinct path of the hits (with passages:
    a section context reads its hits' files too)."""
    svc = in_process_service(fresh)
    dispatched(svc, "search_corpus", query="sev-1 paging", k=10)  # the staleness count's first pass is done
    seen: list[str] = []
    real_lstat = os.lstat

    def counting(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        if threading.current_thread() is threading.main_thread():  # not the background staleness recount
            seen.append(str(path))
        return real_lstat(path, *args, **kwargs)

    monkeypatch.setattr(server.os, "lstat", counting)
    _, found = dispatched(svc, "search_corpus", query="sev-1 paging", k=10, context="passage")
    corpus_stats = [p for p in seen if p.startswith(str(fresh.corpus))]
    assert sorted(corpus_stats) == sorted({str(fresh.corpus / hit["path"]) for hit in found["results"]})


def test_disk_state_names_what_happened(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("hello\n", encoding="utf-8")
    st = (tmp_path / "a.md").stat()
    doc = rules.DocumentRow("a.md", "A", "active", "markdown", "h", st.st_size, st.st_mtime_ns, "a.md",
                            str(tmp_path / "a.md"), 1, 1, rules.successors_column(()))
    assert server.disk_state(tmp_path, doc) == "unchanged"
    edit(tmp_path / "a.md", "hello, changed\n")
    assert server.disk_state(tmp_path, doc) == "modified"
    (tmp_path / "a.md").unlink()
    assert server.disk_state(tmp_path, doc) == "deleted"
    (tmp_path / "a.md").write_text("x", encoding="utf-8")
    inside = dataclasses.replace(doc, path="a.md/b.md", disk_path="a.md/b.md", real_path=str(tmp_path / "a.md/b.md"))
    assert server.disk_state(tmp_path, inside) == "deleted"  # a file where its folder was
    assert server.count_changed_files(tmp_path, [doc, inside]) == 2
    # What the staleness count reads of every document: its place, size and mtime.
    assert server.count_changed_files(tmp_path, [server.IndexedFile(d.disk_path, d.size, d.mtime_ns)
                                                 for d in (doc, inside)]) == 2


def test_the_staleness_count_streams_every_document_once_and_a_failed_count_fails_no_search(
        fresh: Built, tmp_path: Path) -> None:
    """The count reads the documents through a connection of its own, off the store lock (a list of
    100k documents' rows held 25 MB of a million-chunk server's memory); a count that cannot read
    them leaves the search its answer, without the hint, and the next call counts again."""
    svc = in_process_service(fresh)
    with svc.manager.lock:
        index = svc.manager.open()
        documents = index.documents()
        files = index.indexed_files()
        assert next(files) == server.IndexedFile(documents[0].disk_path, documents[0].size, documents[0].mtime_ns)
    assert [*files] == [server.IndexedFile(d.disk_path, d.size, d.mtime_ns) for d in documents[1:]]
    (fresh.corpus / documents[-1].disk_path).unlink()
    keywords = index.keyword_path
    hidden = keywords.rename(tmp_path / "elsewhere.sqlite3")  # the open connection keeps reading it
    try:
        is_error, payload = dispatched(svc, "search_corpus", query="rollback", mode="keyword")
        assert not is_error and payload["results"] and payload["staleness"]["changed_files"] == 0, payload
    finally:
        hidden.rename(keywords)
    _, payload = dispatched(svc, "search_corpus", query="rollback", mode="keyword")
    assert payload["staleness"]["changed_files"] == 1, payload


def test_files_added_since_ingest_are_counted_and_a_thin_search_says_so(fresh: Built) -> None:
    """A file ingest would take that the index does not hold counts as added until ingest runs
    (moved in with an old mtime too: by its ctime); files the scope leaves out, files no reader
    takes, and the file kept out by `rag: false` at ingest do not."""
    svc = in_process_service(fresh)
    is_error, payload = dispatched(svc, "search_corpus", query="rollback", mode="keyword")
    assert not is_error and payload["staleness"]["added_files"] == 0, payload
    notes = fresh.corpus / "notes"
    notes.mkdir()
    (notes / "new.md").write_text("# New\n\nA page written after the ingest.\n", encoding="utf-8")
    moved = fresh.corpus.parent / "moved.md"
    moved.write_text("# Moved\n\nA page moved in with its old mtime.\n", encoding="utf-8")
    os.utime(moved, (1_000_000_000, 1_000_000_000))
    moved.rename(notes / "moved.md")
    (notes / "diagram.png").write_bytes(b"\x89PNG")  # no reader takes it
    (fresh.corpus / "node_modules").mkdir()
    (fresh.corpus / "node_modules" / "readme.md").write_text("# Vendored\n", encoding="utf-8")  # left out
    fresh_svc = in_process_service(fresh)  # a new service: the count is made once a generation
    is_error, payload = dispatched(fresh_svc, "search_corpus", query="qwxzyv", mode="keyword")
    assert not is_error and not payload["results"], payload
    assert payload["staleness"]["added_files"] == 2 and payload["staleness"]["changed_files"] == 0, payload
    assert "2 file(s) added since the last ingest" in payload["message"], payload["message"]
    # With a watcher on the store (here: this process holds its watch lock), the hint says it
    # indexes them by itself, rather than asking for an ingest.
    import fcntl

    fd = os.open(rules.StoreLayout(fresh.store).watch_lock_file, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        _, payload = dispatched(in_process_service(fresh), "search_corpus", query="qwxzyv", mode="keyword")
        assert payload["index"]["watch"]["by"] == "another process", payload["index"]
        assert "the index watcher indexes them within seconds" in payload["staleness"]["hint"], payload["staleness"]
    finally:
        os.close(fd)


def test_files_added_are_counted_by_a_walk_only_when_a_folder_changed(fresh: Built,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """ingest's walk costs ~80 ms a thousand files and the count is refreshed every few seconds
    beside the searches: it walks again only when a folder changed since its last count."""
    import ingest

    walks: list[Path] = []
    real_walk = ingest.walk_corpus
    monkeypatch.setattr(ingest, "walk_corpus", lambda root, *args: walks.append(root) or real_walk(root, *args))
    svc = in_process_service(fresh)
    index = svc.manager.open()
    settings = rules.load_settings({"RAG_STORE_DIR": str(fresh.store), "RAG_CORPUS_DIR": str(fresh.corpus)})
    assert server.count_added_files(fresh.corpus, index, settings) == 0 and walks == [], "nothing changed: no walk"
    (fresh.corpus / "runbooks" / "new.md").write_text("# New\n\nwritten after the ingest\n", encoding="utf-8")
    assert server.count_added_files(fresh.corpus, index, settings) == 1 and len(walks) == 1
    assert server.count_added_files(fresh.corpus, index, settings) == 1 and len(walks) == 1, "no folder changed since"
    edit(fresh.corpus / "runbooks" / "new.md", "# New\n\nedited in place\n")  # an edit changes no folder
    assert server.count_added_files(fresh.corpus, index, settings) == 1 and len(walks) == 1
    (fresh.corpus / "guides").mkdir(exist_ok=True)
    (fresh.corpus / "guides" / "another.md").write_text("# Another\n\nnew folder\n", encoding="utf-8")
    assert server.count_added_files(fresh.corpus, index, settings) == 2 and len(walks) == 2
