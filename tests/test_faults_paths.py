"""Scenario 6: path attacks on get_file (and the path_prefix of the other tools) through one real
`python server.py`. Every attack is refused with path_rejected or not_indexed, and no answer ever
carries a byte of a file outside the corpus, or of a file in the corpus that was never indexed.
"""

from __future__ import annotations

import json
import os
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from fake_ollama import FakeOllama
from helpers import RawServer, call, copy_sample, raw_server, run_ingest

pytestmark = pytest.mark.process  # real processes (servers, ingest, Chroma): only in `pytest --all` (tests/README.md)

OUTSIDE_TOKEN = "OUTSIDE-SECRET-5521"
TWIN_TOKEN = "UNINDEXED-TWIN-8832"
PASSWD_MARK = "root:x:0:0"
CAFE_NFC = unicodedata.normalize("NFC", "notes/café.md")
CAFE_NFD = unicodedata.normalize("NFD", "notes/café.md")
REFUSED = {"path_rejected", "not_indexed"}


@dataclass
class Site:
    corpus: Path
    outside: Path
    server: RawServer
    answers: list[Any] = field(default_factory=list)

    def get(self, path: Any, **lines: int) -> tuple[bool, dict[str, Any]]:
        answer = call(self.server, "get_file", {"path": path, **lines})
        self.answers.append(answer[1])
        return answer

    def refused(self, path: Any) -> str:
        is_error, payload = self.get(path)
        assert is_error and payload["error"]["code"] in REFUSED, (path, payload)
        return str(payload["error"]["code"])


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    tmp = tmp_path_factory.mktemp("paths")
    outside = tmp / "outside"
    for rel in ("secret.md", "deploy.md", "oncall/escalation.md", "runbooks/deploy.md"):
        (outside / rel).parent.mkdir(parents=True, exist_ok=True)
        (outside / rel).write_text(f"# Outside\n\n{OUTSIDE_TOKEN}\n", encoding="utf-8")
    corpus, store = copy_sample(tmp), tmp / "store"
    (corpus / "notes").mkdir()
    (corpus / CAFE_NFC).write_text("# Café\n\nThe indexed café notes.\n", encoding="utf-8")
    (corpus / "notes" / "a b #1.md").write_text("# Spaces and hash\n\nIndexed despite its name.\n", encoding="utf-8")
    with FakeOllama() as fake:
        done = run_ingest(fake, corpus, store)
        assert done.code == 0, done.err
        # After ingest: unindexed twins that differ from indexed names only by case or Unicode
        # normalisation, and a file that was never indexed.
        (corpus / "oncall" / "Escalation.md").write_text(f"# Twin\n\n{TWIN_TOKEN}\n", encoding="utf-8")
        (corpus / CAFE_NFD).write_text(f"# Twin\n\n{TWIN_TOKEN}\n", encoding="utf-8")
        (corpus / "notes" / "late.md").write_text(f"# Late\n\n{TWIN_TOKEN}\n", encoding="utf-8")
        with raw_server(store, corpus, fake.host) as server:
            state = Site(corpus, outside, server)
            yield state
            leaked = json.dumps(state.answers, ensure_ascii=False)
            assert OUTSIDE_TOKEN not in leaked and TWIN_TOKEN not in leaked and PASSWD_MARK not in leaked
            assert len(state.answers) > 60


TRAVERSALS = [
    "../outside/secret.md", "a/../../outside/secret.md", "oncall/../../outside/secret.md", "oncall/./../../x",
    "./../outside/secret.md", "oncall/..", "..", "../", "../../../../../../etc/passwd", " ../outside/secret.md",
    "%2e%2e/outside/secret.md", "%2e%2e%2foutside%2fsecret.md", "..%2f..%2fetc%2fpasswd", "%252e%252e/etc/passwd",
    "..%5c..%5cetc%5cpasswd", "....//....//etc/passwd", "..;/etc/passwd", "\u2025/outside/secret.md",
    "\uff0e\uff0e/outside/secret.md", "..\u2215outside\u2215secret.md",
    "..\\outside\\secret.md", "oncall\\..\\..\\outside\\secret.md", "\\etc\\passwd", "oncall\\escalation.md",
    "/etc/passwd", "//etc/passwd", "/", "C:\\Windows\\win.ini", "C:/Windows/win.ini", "c:x", "file:///etc/passwd",
    "~", "~/secret.md", "~root/.bashrc", "./~/secret.md", "~/../etc/passwd",
    "oncall/escalation.md\x00", "\x00", "oncall/\x00escalation.md", "oncall/escalation.md\x00.txt",
    "oncall/\x1bescalation.md", "oncall/escalation.md\x7f",
    "private/offsite-backup.md", "private", "notes/late.md", "notes/missing.md", "oncall", "oncall/",
    "ONCALL/ESCALATION.MD", "Oncall/escalation.md", "oncall/Escalation.md", "oncall/escalation.MD",
]


def test_traversal_in_every_form_is_refused(site: Site) -> None:
    codes = {path: site.refused(path) for path in TRAVERSALS}
    for path in ("../outside/secret.md", "a/../../outside/secret.md", "/etc/passwd", "~", "oncall\\escalation.md",
                 "oncall/escalation.md\x00", "C:/Windows/win.ini", "\\etc\\passwd"):
        assert codes[path] == "path_rejected", path
    absolute = str(site.outside / "secret.md")
    assert site.refused(absolute) == "path_rejected"
    assert site.refused(os.path.relpath(site.outside / "secret.md", site.corpus)) == "path_rejected"


def test_path_prefix_traversal_is_refused_by_the_other_tools(site: Site) -> None:
    for prefix in ("../outside", "/etc", "~", "a/../..", "oncall\\..", "\x00"):
        for name, arguments in (("search_corpus", {"query": "secret", "path_prefix": prefix, "mode": "keyword"}),
                                ("list_documents", {"path_prefix": prefix})):
            is_error, payload = call(site.server, name, arguments)
            site.answers.append(payload)
            assert is_error and payload["error"]["code"] == "path_rejected", (prefix, payload)


def test_normalisation_and_case_variants_never_reach_the_unindexed_twins(site: Site) -> None:
    # NFC is the stored form; an NFD spelling of the same name means the same indexed file (and
    # is answered from it), never the unindexed NFD-named twin created after ingest.
    for spelling in (CAFE_NFC, CAFE_NFD):
        is_error, payload = site.get(spelling)
        assert not is_error and payload["path"] == CAFE_NFC and "indexed café notes" in payload["text"]
    is_error, payload = site.get("notes/a b #1.md")
    assert not is_error and "Indexed despite its name" in payload["text"]
    for spelling in ("notes/Café.md", "NOTES/café.md", "notes/cafe\u0301.MD", "notes/a b %231.md", "notes/a+b+#1.md"):
        assert site.refused(spelling) == "not_indexed", spelling


def test_swapped_files_and_folders_are_refused(site: Site) -> None:
    corpus, outside = site.corpus, site.outside
    escalation, runbooks, reference = corpus / "oncall" / "escalation.md", corpus / "runbooks", corpus / "reference"
    assert not site.get("oncall/escalation.md")[0]
    # A corpus file swapped for a symlink to /etc/passwd, to an outside file, to a parent folder.
    original = escalation.read_bytes()
    for target in (Path("/etc/passwd"), outside / "secret.md", corpus, Path("/")):
        escalation.unlink()
        escalation.symlink_to(target)
        assert site.refused("oncall/escalation.md") == "path_rejected", target
    escalation.unlink()
    escalation.write_bytes(original)
    # A corpus folder swapped for a symlink: outside, and to another corpus folder, each holding
    # a look-alike deploy.md that was never indexed.
    look_alike = reference / "deploy.md"
    look_alike.write_text(f"# Look-alike\n\n{TWIN_TOKEN}\n", encoding="utf-8")
    runbooks.rename(corpus / "runbooks-real")
    for target in (outside / "runbooks", outside, reference):
        runbooks.symlink_to(target, target_is_directory=True)
        assert site.refused("runbooks/deploy.md") == "path_rejected", target
        runbooks.unlink()
    (corpus / "runbooks-real").rename(runbooks)
    look_alike.unlink()
    # The whole corpus folder swapped for a symlink to a look-alike outside.
    moved = corpus.with_name("corpus-real")
    corpus.rename(moved)
    try:
        corpus.symlink_to(outside, target_is_directory=True)
        for path in ("oncall/escalation.md", "runbooks/deploy.md"):
            assert site.refused(path) == "path_rejected", path
        corpus.unlink()
    finally:
        if corpus.is_symlink():
            corpus.unlink()
        moved.rename(corpus)
    # Everything restored: the same server reads the real files again.
    for path in ("oncall/escalation.md", "runbooks/deploy.md"):
        is_error, payload = site.get(path, start_line=1, end_line=2)
        assert not is_error and payload["source"] == "disk", payload


def test_a_fifo_or_folder_in_place_of_a_file_does_not_hang(site: Site) -> None:
    glossary = site.corpus / "reference" / "glossary.md"
    original = glossary.read_bytes()
    glossary.unlink()
    try:
        os.mkfifo(glossary)
        assert site.refused("reference/glossary.md") == "path_rejected"
        glossary.unlink()
        glossary.mkdir()
        assert site.refused("reference/glossary.md") == "path_rejected"
        glossary.rmdir()
    finally:
        if glossary.is_dir():
            glossary.rmdir()
        elif glossary.exists():
            glossary.unlink()
        glossary.write_bytes(original)
    assert not site.get("reference/glossary.md")[0]
