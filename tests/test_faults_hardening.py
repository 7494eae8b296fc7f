"""Hardening: the corpus, the store and the embedder are untrusted input (issue 16).

Each test reproduces one attack or fault the way it was found: real `python ingest.py` and
`python server.py` processes, real files, the loopback fake Ollama misbehaving over real HTTP.
Where the operating system's permission checks matter and the suite runs as root, the child runs
without root's override capabilities (setpriv), so that `chmod 000` means what it means for a user.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from fake_ollama import FakeOllama
from faultlib import committed_hashes, index_dir
from helpers import (
    ROOT,
    Done,
    call,
    child_env,
    copy_sample,
    current_of,
    edit,
    finish,
    ingest_args,
    raw_server,
    run_ingest,
    store_bytes,
)

import corpus_rules as rules

pytestmark = [pytest.mark.heavy, pytest.mark.process]  # a file over a minute of real processes: `pytest --all` only, scheduled first

OUTSIDE = "OUTSIDE-SECRET-9173"
ALIAS_BOMB = """---
a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
i: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]
rag: *i
---
# Bomb
"""


@pytest.fixture
def indexed(fake: FakeOllama, sample_index: tuple[Path, Path]) -> tuple[Path, Path]:
    fake.reset()
    return sample_index


def as_a_user(command: list[str]) -> list[str]:
    """The command as an ordinary user would run it: as root, without the capabilities that let
    root ignore file permissions."""
    if os.geteuid() != 0:
        return command
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: permission checks cannot apply to the child")
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search", *command]


def run(command: list[str], env: dict[str, str], **popen: Any) -> Done:
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT.parent, **popen)
    return finish(proc)


# ---------------------------------------------------------------------------
# 1. A file swapped between the walk and the read.

SWAPPING_CHILD = r"""
import os, stat, sys
sys.path.insert(0, sys.argv.pop(1))
import ingest
target, kind, outside = os.environ["SWAP_TARGET"], os.environ["SWAP_KIND"], os.environ["SWAP_OUTSIDE"]
walk_corpus = ingest.walk_corpus

def walk_then_swap(*args):
    walk = walk_corpus(*args)
    os.unlink(target)
    if kind == "symlink":
        os.symlink(outside, target)
    elif kind == "fifo":
        os.mkfifo(target)
    elif kind == "device":
        os.mknod(target, stat.S_IFCHR | 0o644, os.makedev(1, 5))  # /dev/zero's numbers
    elif kind == "grown":
        with open(target, "w") as fh:
            fh.write("# Grown\n\n" + "much more text than before " * 1000)
    return walk

ingest.walk_corpus = walk_then_swap
sys.exit(ingest.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("kind", ["symlink", "fifo", "device", "grown"])
def test_a_file_swapped_after_the_walk_is_not_followed(fake: FakeOllama, indexed: tuple[Path, Path],
                                                       tmp_path: Path, kind: str) -> None:
    corpus, store = indexed
    outside = tmp_path / "outside.md"
    outside.write_text(f"# Outside\n\n{OUTSIDE}\n", encoding="utf-8")
    target = corpus / "reference" / "glossary.md"
    edit(target, "# Glossary\n\nChanged, so ingest reads it.\n")
    before = committed_hashes(index_dir(store))
    if kind == "device" and os.geteuid() != 0:
        pytest.skip("creating a device node needs root")
    started = time.monotonic()
    done = run([sys.executable, "-c", SWAPPING_CHILD, str(ROOT), *ingest_args(corpus, store)[2:]],
               child_env(fake, SWAP_TARGET=str(target), SWAP_KIND=kind, SWAP_OUTSIDE=str(outside)))
    assert time.monotonic() - started < 60, "a FIFO or a device must not hang or flood the read"
    assert done.code == 1, done.err
    assert any(error.startswith("reference/glossary.md: not read") for error in done.summary["errors"]), done.summary
    assert OUTSIDE.encode() not in store_bytes(store)
    assert committed_hashes(index_dir(store)) == before  # its old chunks stay, the rest is as it was


# ---------------------------------------------------------------------------
# 2. A YAML alias bomb in frontmatter.


def test_a_yaml_alias_bomb_is_refused_at_once(fake: FakeOllama, indexed: tuple[Path, Path]) -> None:
    corpus, store = indexed
    (corpus / "bomb.md").write_text(ALIAS_BOMB, encoding="utf-8")
    assert len(ALIAS_BOMB.encode()) < 400
    started = time.monotonic()
    done = run(ingest_args(corpus, store), child_env(fake),
               preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30)))
    assert time.monotonic() - started < 60
    assert done.code == 1, done.err
    error = next(e for e in done.summary["errors"] if e.startswith("bomb.md:"))
    assert "alias" in error and len(error) < 500
    assert "Traceback" not in done.err


# ---------------------------------------------------------------------------
# 3 and 14. CURRENT.json is untrusted: its index name and its numbers.


@pytest.mark.parametrize("name", ["../victim", "VICTIM_ABSOLUTE", ".", "", "idx-../../x"])
def test_a_tampered_index_name_never_reaches_outside_the_store(fake: FakeOllama, indexed: tuple[Path, Path],
                                                               tmp_path: Path, name: str) -> None:
    corpus, store = indexed
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("precious", encoding="utf-8")
    current = current_of(store)
    live = current["index"]
    current["index"] = str(victim) if name == "VICTIM_ABSOLUTE" else name
    (store / rules.CURRENT_FILE).write_text(json.dumps(current), encoding="utf-8")
    done = run_ingest(fake, corpus, store)
    assert done.code == 2 and done.summary["error"]["code"] == "index_incompatible", done.err
    assert (victim / "keep.txt").read_text(encoding="utf-8") == "precious"
    assert (store / live).is_dir() and (store / rules.CURRENT_FILE).exists()
    with raw_server(store, corpus, fake.host) as server:
        is_error, payload = call(server, "list_documents", {})
        assert is_error and payload["error"]["code"] == "index_incompatible"


@pytest.mark.parametrize("planted", ["the live index", "a look-alike named in CURRENT.json"])
def test_an_index_folder_that_is_a_link_is_never_followed(fake: FakeOllama, tmp_path: Path, planted: str) -> None:
    """A link with a valid index name, pointing outside the store: ingest would write through it
    and, on the next rebuild, delete what it points at; the server would read it."""
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    assert run_ingest(fake, corpus, store).code == 0
    victim = tmp_path / "victim"
    (victim / rules.CHROMA_SUBDIR).mkdir(parents=True)
    (victim / rules.CHROMA_SUBDIR / "keep.txt").write_text("precious", encoding="utf-8")
    current = current_of(store)
    name = current["index"] if planted == "the live index" else "idx-0123456789ab"
    if planted == "the live index":
        shutil.rmtree(store / name)
    else:
        current["index"] = name
        (store / rules.CURRENT_FILE).write_text(json.dumps(current), encoding="utf-8")
    (store / name).symlink_to(victim, target_is_directory=True)
    before = sorted(p.name for p in victim.rglob("*"))
    done = run_ingest(fake, corpus, store)
    assert done.code == 2 and done.summary["error"]["code"] == "index_incompatible", done.err
    assert "symbolic link" in done.summary["error"]["message"]
    assert sorted(p.name for p in victim.rglob("*")) == before
    assert (victim / rules.CHROMA_SUBDIR / "keep.txt").read_text(encoding="utf-8") == "precious"
    with raw_server(store, corpus, fake.host) as server:
        is_error, payload = call(server, "search_corpus", {"query": "rollback"})
        assert is_error and payload["error"]["code"] == "index_incompatible", payload


@pytest.mark.parametrize("generation", ["1e400", "1.5", "true", "-1", "99999999999999999999999", '"7"'])
def test_a_generation_out_of_range_is_index_incompatible(fake: FakeOllama, indexed: tuple[Path, Path],
                                                         generation: str) -> None:
    corpus, store = indexed
    text = (store / rules.CURRENT_FILE).read_text(encoding="utf-8")
    value = json.dumps(current_of(store)["generation"])
    (store / rules.CURRENT_FILE).write_text(text.replace(f'"generation": {value}', f'"generation": {generation}'),
                                            encoding="utf-8")
    with raw_server(store, corpus, fake.host) as server:
        for tool, args in (("search_corpus", {"query": "rollback"}), ("get_file", {"path": "runbooks/deploy.md"}),
                           ("list_documents", {})):
            is_error, payload = call(server, tool, args)
            assert is_error and payload["error"]["code"] == "index_incompatible", payload
    done = run_ingest(fake, corpus, store)
    assert done.code == 2 and done.summary["error"]["code"] == "index_incompatible"


# ---------------------------------------------------------------------------
# 4. Git in the corpus runs nothing the corpus's repository configures.


def test_git_runs_nothing_the_corpus_repository_configures(fake: FakeOllama, tmp_path: Path) -> None:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    corpus, store, markers = copy_sample(tmp_path), tmp_path / "store", tmp_path / "markers"
    markers.mkdir()

    def program(name: str, body: str = "") -> str:
        path = tmp_path / f"{name}.sh"
        path.write_text(f"#!/bin/sh\ntouch {markers / name}\n{body}\n", encoding="utf-8")
        path.chmod(0o755)
        return str(path)

    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(corpus), *args], check=True, capture_output=True, timeout=60)

    git("init", "-q")
    git("config", "user.email", "t@example.com")
    git("config", "user.name", "t")
    (corpus / ".gitattributes").write_text("*.md filter=evil\n", encoding="utf-8")
    git("add", "-A")
    git("commit", "-qm", "corpus")
    git("config", "core.fsmonitor", program("fsmonitor", "exit 1"))
    git("config", "filter.evil.clean", program("filter", "cat"))
    hook = corpus / ".git" / "hooks" / "post-index-change"
    shutil.copy(program("hook"), hook)
    hook.chmod(0o755)
    for path in markers.iterdir():
        path.unlink()
    # One file rewritten with the same size (git must re-hash it: clean filter), one grown.
    escalation = corpus / "oncall" / "escalation.md"
    edit(escalation, escalation.read_text(encoding="utf-8").replace("sev-1", "sev-2", 1))
    edit(corpus / "reference" / "glossary.md", "# Glossary\n\nGrown.\n" * 3)
    done = run_ingest(fake, corpus, store)
    assert done.code == 0, done.err
    assert sorted(p.name for p in markers.iterdir()) == []
    head = subprocess.run(["git", "-C", str(corpus), "rev-parse", "HEAD"], capture_output=True, text=True,
                          timeout=60).stdout.strip()
    assert (done.summary["commit"], done.summary["dirty"]) == (head, True)


# ---------------------------------------------------------------------------
# 5. An embedder that sends its headers, then a byte a second.


def test_a_trickling_embedder_is_bounded_as_a_whole(fake: FakeOllama, indexed: tuple[Path, Path]) -> None:
    corpus, store = indexed
    edit(corpus / "reference" / "glossary.md", "# Glossary\n\nChanged.\n")
    before = committed_hashes(index_dir(store))
    fake.configure(trickle_seconds=1.0)
    try:
        started = time.monotonic()
        done = run_ingest(fake, corpus, store, RAG_EMBED_TIMEOUT="2")
        elapsed = time.monotonic() - started
        assert done.code != 0 and "did not answer within 2 s" in done.err, done.err
        assert elapsed < 30, f"ingest ran {elapsed:.0f} s against a 2 s timeout"
        assert committed_hashes(index_dir(store)) == before
        with raw_server(store, corpus, fake.host, RAG_EMBED_TIMEOUT="2") as server:
            started = time.monotonic()
            is_error, payload = call(server, "search_corpus", {"query": "who gets paged for a sev-1"})
            assert time.monotonic() - started < 10
            assert not is_error and payload["degraded"] == "embedder_unavailable" and payload["results"]
            # The stalled embedder is left alone for a while: the next search does not wait again.
            started = time.monotonic()
            is_error, payload = call(server, "search_corpus", {"query": "rollback a deploy"})
            assert time.monotonic() - started < 1.5 and payload["degraded"] == "embedder_unavailable"
    finally:
        fake.configure(trickle_seconds=None)


# ---------------------------------------------------------------------------
# 6. A folder that cannot be listed is not a deleted folder.


def test_an_unreadable_folder_keeps_its_documents(fake: FakeOllama, indexed: tuple[Path, Path]) -> None:
    corpus, store = indexed
    before = committed_hashes(index_dir(store))
    runbooks = corpus / "runbooks"
    runbooks.chmod(0o000)
    try:
        done = run(as_a_user(ingest_args(corpus, store)), child_env(fake))
    finally:
        runbooks.chmod(0o755)
    assert done.code == 1, done.err
    assert done.summary["removed"] == 0
    kept = [e for e in done.summary["errors"] if "runbooks" in e and "cannot be listed" in e]
    assert len(kept) == 2, done.summary["errors"]
    assert committed_hashes(index_dir(store)) == before
    assert run_ingest(fake, corpus, store).code == 0


# ---------------------------------------------------------------------------
# 7. get_file and the corpus root swapped for a look-alike tree.


def test_a_look_alike_corpus_root_is_refused(fake: FakeOllama, indexed: tuple[Path, Path]) -> None:
    corpus, store = indexed
    real = corpus.with_name("corpus-real")
    look_alike = corpus.with_name("corpus-look-alike")
    (look_alike / "oncall").mkdir(parents=True)
    (look_alike / "oncall" / "escalation.md").write_text(f"# Look-alike\n\n{OUTSIDE}\n", encoding="utf-8")
    with raw_server(store, corpus, fake.host) as server:
        assert not call(server, "get_file", {"path": "oncall/escalation.md"})[0]
        corpus.rename(real)
        look_alike.rename(corpus)
        try:
            is_error, payload = call(server, "get_file", {"path": "oncall/escalation.md"})
            assert is_error and payload["error"]["code"] == "path_rejected", payload
            assert OUTSIDE not in json.dumps(payload)
        finally:
            corpus.rename(look_alike)
            real.rename(corpus)
        # Swapped back and forth while get_file is called: never a byte of the look-alike.
        stop = threading.Event()

        def swap() -> None:
            while not stop.is_set():
                corpus.rename(real)
                look_alike.rename(corpus)
                corpus.rename(look_alike)
                real.rename(corpus)

        swapper = threading.Thread(target=swap)
        swapper.start()
        answers = []
        try:
            for _ in range(200):
                answers.append(call(server, "get_file", {"path": "oncall/escalation.md"})[1])
        finally:
            stop.set()
            swapper.join()
        assert OUTSIDE not in json.dumps(answers)
        assert all(a.get("error", {}).get("code") in (None, "path_rejected") for a in answers)


# ---------------------------------------------------------------------------
# 8. A moved corpus is readable again after the re-ingest its hint asks for.


def test_a_moved_corpus_is_served_after_its_re_ingest(fake: FakeOllama, indexed: tuple[Path, Path]) -> None:
    corpus, store = indexed
    moved = corpus.with_name("docs-moved")
    corpus.rename(moved)
    fake.reset()
    done = run_ingest(fake, moved, store, "--replace-corpus")
    assert done.code == 0 and done.summary["embedding_calls"] == 0, done.err
    with raw_server(store, None, fake.host) as server:
        for path in ("oncall/escalation.md", "runbooks/deploy.md", "ja/log-collection.md"):
            is_error, payload = call(server, "get_file", {"path": path, "start_line": 1, "end_line": 2})
            assert not is_error and payload["source"] == "disk", payload


# ---------------------------------------------------------------------------
# 9. One rule for file names on both sides.

ODD_NAMES = ["\x01control.md", " leading-space.md", "\u3000ideographic-space.md", "~tilde.md", "back\\slash.md",
             "c:drive.md"]
# Below a folder, only these stay unservable: the rest of the names above are ordinary there.
ODD_ANYWHERE = {"\x01control.md", "back\\slash.md"}


def test_names_get_file_could_not_serve_are_refused_at_ingest(fake: FakeOllama, tmp_path: Path) -> None:
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    (corpus / "odd").mkdir()
    for name in ODD_NAMES:
        for folder in (corpus, corpus / "odd"):
            (folder / name).write_text("# Odd\n\nA file with an odd name.\n", encoding="utf-8")
    done = run_ingest(fake, corpus, store)
    assert done.code == 1, done.err
    refused = [e for e in done.summary["errors"] if "rename the file" in e]
    assert len(refused) == len(ODD_NAMES) + len(ODD_ANYWHERE), done.summary["errors"]
    with raw_server(store, corpus, fake.host) as server:
        listed = call(server, "list_documents", {"limit": 500})[1]
        assert listed["total"] == 6 + len(ODD_NAMES) - len(ODD_ANYWHERE)
        for document in listed["documents"]:  # every name that was indexed can be read back
            is_error, payload = call(server, "get_file", {"path": document["path"]})
            assert not is_error and payload["source"] == "disk", payload


# ---------------------------------------------------------------------------
# 10 and 11. Vectors are checked; cached query vectors belong to one generation.


def test_nan_vectors_fail_their_files_and_degrade_searches(fake: FakeOllama, tmp_path: Path) -> None:
    fake.reset()
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    edit(corpus / "reference" / "glossary.md", "# Glossary\n\nNANTOKEN poisons this file.\n")
    fake.configure(nan_for="NANTOKEN")
    try:
        done = run_ingest(fake, corpus, store)
        assert done.code == 1 and "Traceback" not in done.err, done.err
        assert [e for e in done.summary["errors"] if e.startswith("reference/glossary.md")], done.summary
        assert done.summary["added"] == 6 and current_of(store)["stamp"]["files"] == 5
        with raw_server(store, corpus, fake.host) as server:
            is_error, payload = call(server, "search_corpus", {"query": "NANTOKEN rollback", "mode": "vector"})
            assert is_error and payload["error"]["code"] == "embedder_unavailable" and "NaN" in payload["error"]["message"]
            is_error, payload = call(server, "search_corpus", {"query": "NANTOKEN rollback"})
            assert not is_error and payload["degraded"] == "embedder_unavailable"
            assert all(hit["score"] is None for hit in payload["results"])
            fake.configure(nan_for=None)
            is_error, payload = call(server, "search_corpus", {"query": "NANTOKEN rollback", "mode": "vector"})
            assert not is_error and all(isinstance(hit["score"], float) for hit in payload["results"])
    finally:
        fake.configure(nan_for=None)


def test_cached_query_vectors_do_not_outlive_their_generation(fake: FakeOllama, indexed: tuple[Path, Path]) -> None:
    corpus, store = indexed
    query = "who gets paged for a sev-1"

    def embeds_of_query() -> int:
        return sum(1 for text in fake.calls()["embedded_inputs"] if query in text)

    with raw_server(store, corpus, fake.host) as server:
        call(server, "search_corpus", {"query": query})
        call(server, "search_corpus", {"query": query})
        assert embeds_of_query() == 1  # cached within a generation
        assert run_ingest(fake, corpus, store, "--full").code == 0
        is_error, payload = call(server, "search_corpus", {"query": query})
        assert not is_error and payload["index"]["generation"] == 2
        assert embeds_of_query() == 2  # embedded again for the new generation


# ---------------------------------------------------------------------------
# 12. Store failures are errors of the vocabulary, with a JSON summary.


def test_a_full_disk_stops_ingest_with_a_structured_error(fake: FakeOllama, tmp_path: Path) -> None:
    fake.reset()
    corpus, store = copy_sample(tmp_path), tmp_path / "store"

    def small_files() -> None:  # the process may write no file past 256 KB: a full disk as it sees it
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, 256 << 10))

    done = run(ingest_args(corpus, store), child_env(fake), preexec_fn=small_files)
    assert done.code == 2, done.err
    assert done.summary["error"]["code"] == "store_unwritable" and "Traceback" not in done.err, done.err
    assert done.summary["scanned"] == 7
    again = run_ingest(fake, corpus, store)
    assert again.code == 0, again.err
    assert current_of(store)["stamp"]["files"] == 6


def test_a_store_this_user_cannot_write_is_a_structured_error(fake: FakeOllama, indexed: tuple[Path, Path]) -> None:
    corpus, store = indexed
    edit(corpus / "reference" / "glossary.md", "# Glossary\n\nChanged.\n")
    modes = {path: path.stat().st_mode for path in [store, *store.rglob("*")]}
    for path in modes:
        path.chmod(0o555 if path.is_dir() else 0o444)
    try:
        done = run(as_a_user(ingest_args(corpus, store)), child_env(fake))
    finally:
        for path, mode in modes.items():
            path.chmod(mode)
    assert done.code == 2 and done.summary["error"]["code"] == "store_unwritable", done.err
    assert "Traceback" not in done.err and "RAG_STORE_DIR" in done.summary["error"]["hint"]
    assert run_ingest(fake, corpus, store).code == 0


def test_a_vector_store_that_cannot_be_written_leaves_hybrid_search_to_keywords(
        fake: FakeOllama, indexed: tuple[Path, Path]) -> None:
    """Chroma writes as it opens its index: on a full disk, or in a store this user cannot write,
    it fails as unwritable (the same code; a read-only store is the one a test can make). Vector
    search says so; hybrid answers from the keyword index, which still reads, and says it did."""
    corpus, store = indexed
    env = {**child_env(fake), "RAG_STORE_DIR": str(store), "RAG_CORPUS_DIR": str(corpus)}
    chroma = next(store.glob("idx-*/chroma"))
    modes = {path: path.stat().st_mode for path in [chroma, *chroma.rglob("*")]}
    for path in modes:
        path.chmod(0o555 if path.is_dir() else 0o444)
    try:
        answers = {mode: run(as_a_user([sys.executable, str(ROOT / "server.py"), "search", "--json", "--mode", mode,
                                        "rollback the deploy"]), env) for mode in ("vector", "hybrid", "keyword")}
    finally:
        for path, mode in modes.items():
            path.chmod(mode)
    vector = json.loads(answers["vector"].out)
    assert answers["vector"].code == 2 and vector["error"]["code"] == "store_unwritable", answers["vector"].err
    assert "--full" not in vector["error"]["hint"], "nothing is damaged: rebuilding is the wrong advice"
    hybrid = json.loads(answers["hybrid"].out)
    assert answers["hybrid"].code == 0 and hybrid["results"] and hybrid["degraded"], answers["hybrid"].err
    assert answers["keyword"].code == 0 and json.loads(answers["keyword"].out)["results"]


# ---------------------------------------------------------------------------
# 13. Links planted in the store are never written through.


def test_links_planted_in_the_store_are_not_written_through(fake: FakeOllama, indexed: tuple[Path, Path],
                                                            tmp_path: Path) -> None:
    corpus, store = indexed
    victim = tmp_path / "victim.txt"
    victim.write_text("precious", encoding="utf-8")
    lock = store / rules.LOCK_FILE
    lock.unlink()
    lock.symlink_to(victim)
    done = run_ingest(fake, corpus, store)
    assert done.code == 2 and done.summary["error"]["code"] == "store_unwritable", done.err
    assert victim.read_text(encoding="utf-8") == "precious"
    lock.unlink()
    (store / "CURRENT.tmp").symlink_to(victim)
    edit(corpus / "reference" / "glossary.md", "# Glossary\n\nChanged.\n")
    done = run_ingest(fake, corpus, store)
    assert done.code == 0, done.err
    assert victim.read_text(encoding="utf-8") == "precious"
    assert current_of(store)["generation"] == 2 and not (store / "CURRENT.tmp").exists()


# ---------------------------------------------------------------------------
# 15. Resolving a path that a racing swap breaks.


def test_a_path_that_cannot_be_resolved_is_path_rejected(fake: FakeOllama, indexed: tuple[Path, Path],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    import server

    corpus, store = indexed
    values = {"OLLAMA_HOST": fake.host, "RAG_CORPUS_DIR": str(corpus), "RAG_STORE_DIR": str(store)}
    service = server.RetrievalService(settings_loader=lambda: rules.load_settings(values))

    def racing(path: Any, *args: Any, **kwargs: Any) -> str:
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(server.os.path, "realpath", racing)
    outcome = server.dispatch(service, "get_file", {"path": "oncall/escalation.md"})
    assert outcome.error is not None and outcome.error.code is rules.ErrorCode.PATH_REJECTED, outcome
