"""What ingest leaves out (issue 11): built-in excludes, nested .ragignore files with negation, what
git ignores, and the dry run that lists every path with the rule that decided it. Ingest runs in the
test process against the loopback fake Ollama."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from fake_ollama import FakeOllama
from faultlib import committed_hashes, index_dir
from helpers import Run, copy_sample, edit, ingest_in_process

import corpus_rules as rules


def write(path: Path, text: str = "# Page\n\nSome documentation.\n") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def indexed(store: Path) -> set[str]:
    return set(committed_hashes(index_dir(store)))


def dry_run(fake: FakeOllama, corpus: Path, store: Path, *extra: str, **env: str) -> Run:
    return ingest_in_process(fake, corpus, store, "--dry-run", *extra, as_json=False, **env)


def test_built_in_excludes_nested_ragignore_and_negation(fake: FakeOllama, tmp_path: Path) -> None:
    corpus, store = tmp_path / "corpus", tmp_path / "store"
    write(corpus / "guide" / "intro.md")
    write(corpus / "node_modules" / "left-pad" / "README.md", "# left-pad\n\nNOT-DOCS-NODE-MODULES\n")
    write(corpus / "app" / "node_modules" / "x" / "README.md")
    write(corpus / ".venv" / "lib" / "README.md")
    write(corpus / "vendor" / "api" / "reference.md")  # brought back by the root .ragignore
    write(corpus / "build" / "out.md")
    write(corpus / "drafts" / "idea.md")
    write(corpus / "guide" / "drafts" / "wip.md")
    write(corpus / "guide" / "drafts" / "ready.md")  # brought back by guide/.ragignore
    write(corpus / "notes" / "todo.draft.md")
    write(corpus / "notes" / "meeting.md")
    write(corpus / ".ragignore", "# scope of the docs\ndrafts/\n*.draft.md\n!vendor/\n")
    write(corpus / "guide" / ".ragignore", "!drafts/\ndrafts/*\n!drafts/ready.md\n")
    done = ingest_in_process(fake, corpus, store)
    assert done.code == 0, done.err
    assert indexed(store) == {"guide/intro.md", "vendor/api/reference.md", "guide/drafts/ready.md",
                              "notes/meeting.md"}
    # node_modules/, app/node_modules/, .venv/, build/, drafts/, guide/drafts/wip.md, notes/todo.draft.md
    assert done.summary["ignored"] == 7
    assert b"NOT-DOCS-NODE-MODULES" not in b"".join(p.read_bytes() for p in store.rglob("*") if p.is_file())


@pytest.mark.heavy  # about 1 s of CPU in ingest runs: in --all, to keep the fast tier's budget
def test_a_rule_added_after_indexing_removes_the_files_chunks(fake: FakeOllama, tmp_path: Path) -> None:
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    assert ingest_in_process(fake, corpus, store).code == 0
    assert "runbooks/deploy.md" in indexed(store)
    write(corpus / ".ragignore", "runbooks/\n")
    done = ingest_in_process(fake, corpus, store)
    assert done.code == 0, done.err
    assert (done.summary["removed"], done.summary["ignored"]) == (2, 1)
    assert not any(path.startswith("runbooks/") for path in indexed(store))
    (corpus / ".ragignore").unlink()
    back = ingest_in_process(fake, corpus, store)
    assert back.summary["added"] == 2 and back.summary["chunks_embedded"] == back.summary["chunks_written"]


def git(corpus: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(corpus), *args], check=True, capture_output=True, timeout=60)


def test_a_corpus_in_a_git_repository_leaves_out_what_git_ignores(fake: FakeOllama, tmp_path: Path) -> None:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    corpus, store = tmp_path / "repo" / "docs", tmp_path / "store"
    write(corpus / "index.md")
    write(corpus / "site" / "generated.md", "# Generated\n\nBUILD-OUTPUT-TOKEN\n")
    write(corpus / "api" / "spec.md")
    write(corpus / "api" / "spec.generated.md")
    write(corpus / "tracked-but-matching.md")
    write(tmp_path / "repo" / ".gitignore", "docs/site/\n*.generated.md\ndocs/tracked-but-matching.md\n")
    git(tmp_path / "repo", "init", "-q")
    git(tmp_path / "repo", "config", "user.email", "t@example.com")
    git(tmp_path / "repo", "config", "user.name", "t")
    git(tmp_path / "repo", "add", "-A")
    # Tracked although a rule matches it: git does not ignore a tracked file, and neither does ingest.
    git(tmp_path / "repo", "add", "-f", "docs/tracked-but-matching.md")
    git(tmp_path / "repo", "commit", "-qm", "docs")
    done = ingest_in_process(fake, corpus, store)
    assert done.code == 0, done.err
    assert indexed(store) == {"index.md", "api/spec.md", "tracked-but-matching.md"}
    # RAG_RESPECT_GITIGNORE=0: git's rules do not apply.
    everything = ingest_in_process(fake, corpus, tmp_path / "store2", RAG_RESPECT_GITIGNORE="0")
    assert everything.code == 0 and indexed(tmp_path / "store2") == {
        "index.md", "api/spec.md", "api/spec.generated.md", "site/generated.md", "tracked-but-matching.md"}
    listing = dry_run(fake, corpus, store, "--json")
    entries = {e["path"]: e for e in json.loads(listing.out)["listing"]}
    assert entries["site/"]["action"] == "ignore" and ".gitignore:1:docs/site/" in entries["site/"]["reason"]
    assert ".gitignore:2:*.generated.md" in entries["api/spec.generated.md"]["reason"]


def test_dry_run_lists_every_path_with_its_rule(fake: FakeOllama, tmp_path: Path) -> None:
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    write(corpus / "node_modules" / "pkg" / "README.md")
    write(corpus / "notes" / "a.draft.md")
    write(corpus / ".ragignore", "# nothing half-written\n*.draft.md\n")
    assert ingest_in_process(fake, corpus, store).code == 0
    edit(corpus / "reference" / "glossary.md", "# Glossary\n\nRewritten.\n")
    write(corpus / "new" / "page.md")
    (corpus / "oncall" / "escalation.md").unlink()
    fake.reset()
    human = dry_run(fake, corpus, store)
    assert human.code == 0, human.err
    lines = human.out.splitlines()
    assert "add       new/page.md  (1 chunk(s) to embed or reuse)" in lines
    assert any(line.startswith("update    reference/glossary.md") for line in lines)
    assert "remove    oncall/escalation.md  (gone from the corpus)" in lines
    assert "exclude   private/offsite-backup.md  (rag: false)" in lines
    # Left out by a scope rule is "ignore", as the summary counts it ("ignored"); "exclude" is rag: false.
    assert "ignore    node_modules/  (built-in rule: node_modules/)" in lines
    assert "ignore    notes/a.draft.md  (.ragignore: line 2: *.draft.md)" in lines
    assert "unchanged runbooks/deploy.md" in lines
    machine = json.loads(dry_run(fake, corpus, store, "--json").out)
    actions = {e["path"]: e["action"] for e in machine["listing"]}
    assert actions["new/page.md"] == "add" and actions["oncall/escalation.md"] == "remove"
    # The dry run asked Ollama the model's context length, as a run does, and embedded nothing.
    assert {path for _, path, _ in fake.requests} <= {"/api/show"}
    assert {p.name for p in store.iterdir()} == {rules.CURRENT_FILE, rules.LOCK_FILE, current_index(store)}


def current_index(store: Path) -> str:
    return json.loads((store / rules.CURRENT_FILE).read_text(encoding="utf-8"))["index"]



def test_the_dry_run_says_what_the_run_then_does(fake: FakeOllama, tmp_path: Path) -> None:
    """Its counts and chunk estimate are the run's own, and each removal says why: deleted, ignored
    (a folder's rule), excluded, or of a format no longer read (issue 41)."""
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    write(corpus / "extra" / "notes.mdx", "# Notes\n\nSome notes about the deploy.\n")
    assert ingest_in_process(fake, corpus, store).code == 0
    write(corpus / "new" / "page.md", "# New\n\nA new page about rollbacks and their checks.\n")
    edit(corpus / "reference" / "glossary.md", "# Glossary\n\nRewritten from the start.\n")
    (corpus / "oncall" / "escalation.md").unlink()
    write(corpus / ".ragignore", "ja/\n")
    edit(corpus / "reference" / "api.md", "---\nrag: false\n---\n# API\n\nHidden now.\n")
    env = {"RAG_FORMATS": "markdown"}
    dry = ingest_in_process(fake, corpus, store, "--dry-run", **env)
    assert dry.code == 0, dry.err
    listed = {(e["path"], e["action"], e["reason"]) for e in dry.summary["listing"]}
    assert ("oncall/escalation.md", "remove", "gone from the corpus") in listed
    assert ("ja/log-collection.md", "remove", "now ignored (.ragignore: line 1: ja/)") in listed
    assert {("reference/api.md", "remove", "now excluded (rag: false)"), ("reference/api.md", "exclude", "rag: false")} <= listed
    assert ("extra/notes.mdx", "remove", "RAG_FORMATS leaves mdx out") in listed
    assert ("ja/", "ignore", ".ragignore: line 1: ja/") in listed
    run = ingest_in_process(fake, corpus, store, **env)
    assert run.code == 0, run.err
    counted = ("added", "updated", "unchanged", "removed", "excluded", "ignored", "failed")
    assert {k: dry.summary[k] for k in counted} == {k: run.summary[k] for k in counted}
    assert dry.summary["estimated_chunks"] == run.summary["chunks_written"] + run.summary["chunks_without_vectors"]
    assert [e["action"] for e in dry.summary["listing"]].count("ignore") == dry.summary["ignored"]
    assert [e["action"] for e in dry.summary["listing"]].count("exclude") == dry.summary["excluded"]
