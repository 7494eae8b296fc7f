"""Code corpora (issue 44): source files in symbol chunks through the syntax tree, secrets and junk
never indexed, and every door (search_corpus with scope, get_file, list_documents, resources, the
CLI) over a repository of docs and code in one index."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from budgets import examples
from fake_ollama import FakeOllama
from helpers import Built, call, dispatched, in_process_service, ingest_in_process, keyword_db, raw_server
from helpers import without_echoed_identifier as without_echo
from hypothesis import given, settings
from hypothesis import strategies as st

import corpus_rules as rules

ROOT = Path(__file__).resolve().parent.parent

PYTHON = '''"""Upload helpers."""

import time

MAX_RETRIES = 3


def backoff(attempt: int) -> float:
    """Seconds to wait before the next attempt."""
    return 2 ** attempt


class Uploader:
    """Sends files to the bucket."""

    timeout = 10

    @property
    def name(self) -> str:
        return "uploader"

    def upload(self, path: str) -> None:
        """Retry a failed upload with exponential backoff."""
        for attempt in range(MAX_RETRIES):
            time.sleep(backoff(attempt))


if True:
    def platform_helper() -> None:
        pass
'''
GO = '''// Package retry retries.
package retry

import "time"

// Client talks to the server.
type Client struct {
	n int
}

// Do sends a request, retrying with backoff.
func (c *Client) Do(x int) error {
	time.Sleep(1)
	return nil
}

func helper() {}
'''
TYPESCRIPT = '''import { x } from "y";

/** A user service. */
export class UserService {
  private n = 1;
  /** Get one user by id. */
  async getUser(id: string): Promise<string> {
    return x(id);
  }
}

export interface User { id: string }
export const handler = async (req: Request) => {
  return 1;
};
'''
RUST = '''use std::io;

/// A point.
#[derive(Debug)]
pub struct Point { x: i32 }

impl Point {
    /// New point at the origin.
    pub fn new() -> Self { Point { x: 0 } }
}

fn main() {}
'''
JAVA = '''package a;

import java.util.List;

/** The account. */
public class Account {
  private int balance;

  /** Opens it. */
  public Account() {}

  public int deposit(int amount) {
    balance += amount;
    return balance;
  }
}
'''


def chunks_of(source: str, path: str, max_tokens: int = 512) -> list[rules.Chunk]:
    return rules.chunk_document(rules.parse_document(source.encode(), path), max_tokens, 64)


def covers_every_line_once(chunks: list[rules.Chunk], line_count: int) -> None:
    assert chunks[0].start_line == 1 and chunks[-1].end_line == line_count
    for before, after in zip(chunks, chunks[1:], strict=False):
        assert after.start_line == before.end_line + 1, (before, after)


@pytest.mark.parametrize(("path", "source", "symbols"), [
    ("up.py", PYTHON, [None, "backoff", "Uploader", "Uploader.name", "Uploader.upload", None, "platform_helper"]),
    ("retry.go", GO, [None, "Client", "Client.Do", "helper"]),
    ("user.ts", TYPESCRIPT, [None, "UserService", "UserService.getUser", "User", "handler"]),
    ("point.rs", RUST, [None, "Point", "Point.new", "main"]),
    ("Account.java", JAVA, [None, "Account", "Account.Account", "Account.deposit"]),
])
def test_symbol_chunks_per_language(path: str, source: str, symbols: list[str | None]) -> None:
    chunks = chunks_of(source, path)
    covers_every_line_once(chunks, len(source.splitlines()))
    assert [c.symbol for c in chunks] == symbols
    doc = rules.parse_document(source.encode(), path)
    assert doc.kind == "code" and doc.language == rules.code_language(path) and doc.title == path


def test_a_symbol_keeps_its_doc_comment_decorators_and_attributes() -> None:
    by_symbol = {c.symbol: c for c in chunks_of(PYTHON, "up.py")}
    assert by_symbol["Uploader.name"].text.lstrip().startswith("@property")
    assert '"""Sends files to the bucket."""' in by_symbol["Uploader"].text
    assert chunks_of(GO, "retry.go")[2].text.startswith("// Do sends a request")
    assert chunks_of(RUST, "point.rs")[1].text.startswith("/// A point.\n#[derive(Debug)]")


def test_a_long_symbol_is_cut_at_statements_and_every_piece_keeps_its_name() -> None:
    body = "".join(f"    step_{n} = compute(step_{n - 1}, 'a fairly long argument number {n}')\n" for n in range(1, 200))
    source = f"import os\n\n\ndef pipeline(x):\n    \"\"\"Run it.\"\"\"\n    step_0 = x\n{body}    return step_199\n"
    chunks = chunks_of(source, "long.py", max_tokens=200)
    covers_every_line_once(chunks, len(source.splitlines()))
    pieces = [c for c in chunks if c.symbol == "pipeline"]
    assert len(pieces) > 3 and all(rules.estimate_tokens(c.searchable) <= 200 for c in pieces)
    assert all(c.text.lstrip().startswith(("step_", "return", "def")) for c in pieces)


def test_other_source_files_are_cut_in_windows_without_a_symbol() -> None:
    source = "".join(f"key_{n}: value {n}\n" for n in range(1, 101))
    chunks = chunks_of(source, "config.yaml")
    assert [(c.start_line, c.end_line, c.symbol) for c in chunks] == [(1, 40, None), (41, 80, None), (81, 100, None)]
    assert rules.parse_document(source.encode(), "config.yaml").language == "yaml"


def test_generated_code_is_read_as_rag_false() -> None:
    for mark in ("// Code generated by protoc-gen-go. DO NOT EDIT.\n", "# @generated by a tool\n"):
        doc = rules.parse_document((mark + "package x\n").encode(), "x.go")
        assert not doc.rag and "generated" in doc.warnings[0]


@settings(max_examples=examples(60), deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["def", "class", "const", "blank"]), st.integers(0, 30)), max_size=12),
       st.integers(40, 400))
def test_every_line_belongs_to_exactly_one_chunk(parts: list[tuple[str, int]], budget: int) -> None:
    lines: list[str] = []
    for n, (what, size) in enumerate(parts):
        if what == "def":
            lines += [f"def f{n}(a, b):", '    """Doc."""'] + [f"    a = a + b * {i}" for i in range(size)] + ["    return a"]
        elif what == "class":
            lines += [f"class C{n}:", f"    x = {n}"] + [f"    def m{i}(self):\n        return {i}" for i in range(size % 5)]
        elif what == "const":
            lines += [f"K{n}_{i} = {i}" for i in range(size)]
        else:
            lines += [""] * size
    source = "\n".join(lines) + "\n"
    chunks = chunks_of(source, "gen.py", max_tokens=budget)
    if not source.strip():
        assert chunks == []
        return
    line_count = len(source.split("\n")) - 1
    covers_every_line_once(chunks, line_count)
    assert all(c.symbol is None or all(part in source for part in c.symbol.split(".")) for c in chunks)


def test_secret_files_by_name() -> None:
    for path in (".env", ".env.production", "config/prod.env", "certs/server.pem", "tls.key", "id_rsa", "id_ed25519.pub",
                 "creds/credentials.json", "serviceAccountKey.json", ".npmrc", ".pypirc", ".netrc", "cert.p12", "a.pfx",
                 ".secrets/token.txt", "deploy/.ssh/config"):
        assert rules.secret_by_name(path), path
    for path in ("env.py", "docs/secrets.md", "keys.py", "README.md", "src/environment.ts"):
        assert not rules.secret_by_name(path), path


def test_keyword_terms_of_identifiers() -> None:
    terms = rules.keyword_terms("maxRetries MAX_RETRIES retry_policy.backoff_seconds std::io::Read")
    for term in ("maxretries", "max", "retries", "max_retries", "retry_policy.backoff_seconds", "backoff", "seconds"):
        assert term in terms, term
    assert {"retry_policy", "backoff_seconds"} <= set(rules.path_terms("retry_policy.backoff_seconds"))
    assert "read" in rules.path_terms("std::io::Read") and "io::read" in rules.path_terms("std::io::Read")
    assert set(rules.query_terms("max retries")) <= set(rules.keyword_terms("maxRetries"))
    assert rules.identifier_term("MAX_RETRIES") == "max_retries"


def test_the_embedded_text_names_file_and_symbol_and_code_queries_have_their_task() -> None:
    gemma = rules.PREFIX_SCHEMES["embeddinggemma"]
    assert rules.embedded_code_text(gemma, "src/up.py", "Uploader.upload", "def upload(): ...") == \
        "title: src/up.py Uploader.upload | text: def upload(): ..."
    assert gemma.query_text("where", code=True) == "task: code retrieval | query: where"
    assert gemma.query_text("where") == "task: search result | query: where"
    nomic = rules.PREFIX_SCHEMES["nomic-embed-text"]
    assert rules.embedded_code_text(nomic, "a.py", "f", "x") == "search_document: a.py f\n\nx"
    assert nomic.query_text("q", code=True) == "search_query: q"


def test_code_is_opt_in() -> None:
    assert not rules.load_settings({}).code and "python" not in rules.load_settings({}).formats
    assert "python" in rules.load_settings({"RAG_CODE": "1"}).formats
    assert "python" in rules.load_settings({}, code=True).formats
    with pytest.raises(rules.RagError, match="RAG_CODE"):
        rules.load_settings({"RAG_CODE": "maybe"})


# ---------------------------------------------------------------------------
# A repository with docs, code and secrets in every place, through every door.

PRIVATE_KEY = "-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEA" + "q" * 60 + "\n-----END RSA PRIVATE KEY-----\n"
AWS_KEY = "AKIA" + "QZ7XK2M4N8P6R3T5"
GITHUB_TOKEN = "ghp_" + "Zq8" * 12
SLACK_TOKEN = "xoxb-2048-" + "a1B2c3D4e5f6"
MARKERS = ("MIIEowIBAAKCAQEA", AWS_KEY, GITHUB_TOKEN, SLACK_TOKEN, "hunter2-dotenv", "npm-token-zz9", "pem-body-77")
REPOSITORY = {
    "README.md": "# Uploader\n\nThe uploader retries failed uploads with backoff.\n",
    "docs/design.md": "# Design\n\n## Retries\n\nUploads are retried three times.\n",
    "src/up.py": PYTHON,
    "src/retry.go": GO,
    "web/user.ts": TYPESCRIPT,
    # secrets by name: each holds a marker
    ".env": "API_TOKEN=hunter2-dotenv\n",
    ".env.local": "API_TOKEN=hunter2-dotenv\n",
    "config/credentials.json": '{"token": "hunter2-dotenv"}\n',
    "config/serviceAccountKey.json": '{"private_key": "pem-body-77"}\n',
    "certs/server.pem": "pem-body-77\n",
    "certs/server.key": "pem-body-77\n",
    ".npmrc": "//registry.npmjs.org/:_authToken=npm-token-zz9\n",
    "deploy/id_rsa": PRIVATE_KEY,
    ".secrets/notes.md": "# Notes\n\nhunter2-dotenv\n",
    # secrets in content: a string literal of a normal source file, a config file, a doc
    "src/settings.py": f'"""Settings."""\n\nAWS_KEY_ID = "{AWS_KEY}"\n\n\ndef region() -> str:\n    return "eu"\n',
    "src/client.ts": f'export const token = "{GITHUB_TOKEN}";\nexport function call() {{ return token; }}\n',
    "config/app.yaml": f"slack: {SLACK_TOKEN}\n",
    "docs/keys.md": f"# Keys\n\n```\n{PRIVATE_KEY}```\n",
    # junk: dependencies, minified, lock files, generated code, binaries
    "node_modules/lib/index.js": "function vendored() {}\n",
    "vendor/pkg/a.go": "package pkg\n",
    "dist/bundle.js": "function built() {}\n",
    "web/app.min.js": "function m(){}\n",
    "package-lock.json": "{}\n",
    "src/gen.pb.go": "// Code generated by protoc-gen-go. DO NOT EDIT.\npackage src\n",
    "assets/logo.png": "\x89PNG",
}
SECRET_PATHS = [".env", ".env.local", "config/credentials.json", "config/serviceAccountKey.json", "certs/server.pem",
                "certs/server.key", ".npmrc", "deploy/id_rsa", ".secrets/notes.md", "src/settings.py", "src/client.ts",
                "config/app.yaml", "docs/keys.md"]


@pytest.fixture(scope="module")
def repository(fake: FakeOllama, tmp_path_factory: pytest.TempPathFactory) -> tuple[Built, Any]:
    corpus = tmp_path_factory.mktemp("code") / "repo"
    for rel, text in REPOSITORY.items():
        (corpus / rel).parent.mkdir(parents=True, exist_ok=True)
        (corpus / rel).write_text(text, encoding="utf-8")
    # A .ragignore cannot bring a secret back.
    (corpus / ".ragignore").write_text("!.env\n!certs/server.pem\n!.secrets/\n", encoding="utf-8")
    store = corpus.parent / "store"
    done = ingest_in_process(fake, corpus, store, "--code", RAG_CHUNK_MIN_TOKENS="0")
    return Built(corpus, store, fake.host), done


def test_secrets_and_junk_are_refused_and_counted(repository: tuple[Built, Any]) -> None:
    built, done = repository
    assert done.code == 1, done.err  # the files with a credential in their content failed, by name
    for path in ("src/settings.py", "src/client.ts", "config/app.yaml", "docs/keys.md"):
        assert any(error.startswith(path) and "credential" in error for error in done.summary["errors"]), path
    dry = ingest_in_process(None, built.corpus, built.store, "--code", "--dry-run", OLLAMA_HOST=built.host)
    listing = {entry["path"]: entry for entry in dry.summary["listing"]}
    for path in (".env", ".env.local", "config/credentials.json", "certs/server.pem", ".npmrc", "deploy/id_rsa"):
        assert listing[path]["action"] == "ignore" and "secret" in listing[path]["reason"], path
    assert "secret" in listing[".secrets/"]["reason"]
    for path in ("node_modules/", "vendor/", "dist/", "web/app.min.js", "package-lock.json"):
        assert listing[path]["action"] == "ignore", path
    assert listing["src/gen.pb.go"]["action"] == "exclude"
    assert done.summary["files_found"][".png"] == {"not_read": 1}


def every_door_text(built: Built) -> str:
    """Everything every door answers about the index, as one text."""
    svc = in_process_service(built)
    seen: list[Any] = []
    try:
        for query in ("token", "API_TOKEN", "private key", "AWS key id", "secret", "hunter2", *MARKERS):
            for mode in ("keyword", "hybrid"):
                for scope in ("all", "code", "docs"):
                    is_error, payload = dispatched(svc, "search_corpus", query=query, mode=mode, scope=scope, k=20)
                    assert not is_error and payload.pop("query") == query  # what was asked, said back
                    seen.append(without_echo(payload, query))
        seen.append(dispatched(svc, "list_documents", limit=500))
        for path in SECRET_PATHS:
            is_error, payload = dispatched(svc, "get_file", path=path)
            assert is_error, (path, payload)
            seen.append(payload)
        for _, _, names in os.walk(built.corpus):
            seen.extend(names)
    finally:
        svc.close(5)
    return json.dumps(seen, ensure_ascii=False)


def test_no_secret_is_reachable_through_the_service(repository: tuple[Built, Any]) -> None:
    built, _ = repository
    text = every_door_text(built)
    for marker in MARKERS:
        assert marker not in text, marker


def test_scope_is_a_prefilter_and_hits_say_what_they_are(repository: tuple[Built, Any]) -> None:
    built, _ = repository
    with contextlib.closing(keyword_db(built.store)) as db:
        chunks_of_kind = dict(db.execute("SELECT kind, count(*) FROM chunks GROUP BY kind").fetchall())
    svc = in_process_service(built)
    try:
        _, code = dispatched(svc, "search_corpus", query="retry upload backoff", scope="code", mode="keyword", k=20)
        _, docs = dispatched(svc, "search_corpus", query="retry upload backoff", scope="docs", mode="keyword", k=20)
        for mode in ("vector", "hybrid"):  # the vector channel's where-clause too: never a post-filter
            for scope, kind in (("code", "code"), ("docs", "doc")):
                _, found = dispatched(svc, "search_corpus", query="retry upload backoff", scope=scope, mode=mode, k=20,
                                      context="passage")
                assert found["results"] and {hit["kind"] for hit in found["results"]} == {kind}, (mode, scope)
                if mode == "vector":  # every chunk of the kind is a candidate: none is filtered out after ranking
                    assert len(found["results"]) == min(20, chunks_of_kind[kind]), (scope, len(found["results"]))
        _, both = dispatched(svc, "search_corpus", query="retry upload backoff", mode="hybrid", k=20)
        _, listing = dispatched(svc, "list_documents")
    finally:
        svc.close(5)
    assert code["results"] and all(hit["kind"] == "code" and hit["language"] for hit in code["results"])
    assert docs["results"] and all(hit["kind"] == "doc" and hit["symbol"] is None for hit in docs["results"])
    assert {hit["kind"] for hit in both["results"]} == {"code", "doc"}
    upload = next(hit for hit in code["results"] if hit["symbol"] == "Uploader.upload")
    assert (upload["path"], upload["language"], upload["heading"]) == ("src/up.py", "python", "Uploader.upload")
    lines = PYTHON.splitlines()
    assert lines[upload["start_line"] - 1].strip() == "def upload(self, path: str) -> None:"
    assert {(d["path"], d["kind"], d["language"]) for d in listing["documents"]} == {
        ("README.md", "doc", None), ("docs/design.md", "doc", None), ("src/up.py", "code", "python"),
        ("src/retry.go", "code", "go"), ("web/user.ts", "code", "typescript")}


@pytest.mark.process
def test_every_door_of_the_real_server_over_a_repository(repository: tuple[Built, Any]) -> None:
    built, _ = repository
    with raw_server(built.store, built.corpus, built.host) as proc:
        is_error, found = call(proc, "search_corpus", {"query": "Client Do request", "scope": "code", "mode": "keyword"})
        assert not is_error and found["results"][0]["symbol"] == "Client.Do"
        is_error, read = call(proc, "get_file", {"path": "src/up.py", "start_line": 1, "end_line": 3})
        assert not is_error and read["text"].startswith('"""Upload helpers."""')
        listed = proc.request("resources/list")["result"]["resources"]
        mime = {r["uri"].split("/doc/", 1)[1]: r["mimeType"] for r in listed}
        assert mime["src/up.py"] == "text/x-python" and mime["src/retry.go"] == "text/x-go"
        assert mime["README.md"] == "text/markdown"
        for path in SECRET_PATHS:
            answer = proc.request("resources/read", {"uri": f"local-rag://doc/{path}"})
            assert "error" in answer, (path, answer)
        assert not any(marker in json.dumps(listed) for marker in MARKERS)
    env = {**os.environ, **built.server_env(built.host)}
    env.pop("RAG_EMBED_MODEL", None)
    done = subprocess.run([sys.executable, str(ROOT / "server.py"), "search", "Uploader upload", "--scope", "code",
                           "--mode", "keyword"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "src/up.py:" in done.stdout and "  Uploader.upload  (score -)" in done.stdout
    as_json = subprocess.run([sys.executable, str(ROOT / "server.py"), "search", "token", "--json", "--mode", "keyword"],
                             env=env, capture_output=True, text=True, timeout=60)
    assert not any(marker in as_json.stdout + as_json.stderr for marker in MARKERS)
    hits = json.loads(subprocess.run([sys.executable, str(ROOT / "server.py"), "search", "UserService getUser",
                                      "--json", "--mode", "keyword"], env=env, capture_output=True, text=True,
                                     timeout=60).stdout)["results"]
    assert {"kind", "symbol", "language"} <= set(hits[0]) and hits[0]["language"] == "typescript"


def test_the_watcher_wakes_for_source_files_only_with_code() -> None:
    import ingest

    code = rules.load_settings({"RAG_CODE": "1"}).formats
    assert not ingest.relevant_change("src/up.py", rules.DEFAULT_FORMATS)
    assert ingest.relevant_change("src/up.py", code) and ingest.relevant_change("docs/a.md", rules.DEFAULT_FORMATS)


def test_the_instructions_tell_of_code_only_where_the_index_holds_it(
        repository: tuple[Built, Any], indexed_sample: tuple[Path, Path]) -> None:
    import server

    def facts(store: Path) -> str:
        found = server.index_facts(lambda: rules.load_settings({"RAG_STORE_DIR": str(store)}))
        assert found is not None
        return found

    assert 'scope="code"' in facts(repository[0].store)
    assert 'scope="code"' not in facts(indexed_sample[1])


def test_an_index_built_with_code_keeps_it_until_rag_code_0(fake: FakeOllama, tmp_path: Path) -> None:
    """A run without --code (a watcher a server started, a re-index typed from memory) reads the
    code again rather than removing it; RAG_CODE=0 removes it."""
    corpus, store = tmp_path / "repo", tmp_path / "store"
    for rel in ("README.md", "src/up.py"):
        (corpus / rel).parent.mkdir(parents=True, exist_ok=True)
        (corpus / rel).write_text(REPOSITORY[rel], encoding="utf-8")

    def kinds() -> set[str]:
        with contextlib.closing(keyword_db(store)) as db:
            return {kind for (kind,) in db.execute("SELECT kind FROM documents")}

    assert ingest_in_process(fake, corpus, store, "--code").code == 0 and kinds() == {"doc", "code"}
    (corpus / "src" / "more.py").write_text("def more() -> int:\n    return 1\n", encoding="utf-8")
    # A server without RAG_CODE counts the new source file as added: the next run will index it.
    _, payload = dispatched(in_process_service(Built(corpus, store, fake.host)), "search_corpus", query="more",
                            mode="keyword")
    assert payload["staleness"]["added_files"] == 1, payload["staleness"]
    done = ingest_in_process(fake, corpus, store)
    assert done.code == 0 and "holds source code" in done.err
    with contextlib.closing(keyword_db(store)) as db:
        assert db.execute("SELECT count(*) FROM documents WHERE kind = 'code'").fetchone()[0] == 2, "the new file too"
    assert ingest_in_process(fake, corpus, store, RAG_CODE="0").code == 0 and kinds() == {"doc"}
    assert ingest_in_process(fake, corpus, store).code == 0 and kinds() == {"doc"}, "and stays out"


@pytest.mark.parametrize("path, source", [
    ("deep.py", "def f():\n" + "".join("\t" * (i + 1) + "if x:\n" for i in range(1500)) + "\t" * 1501 + "pass\n"),
    ("deep.py", "".join("\t" * i + f"class C{i}:\n" for i in range(1500)) + "\t" * 1500 + "pass\n"),
    ("deep.ts", "".join(f"namespace N{i} {{\n" for i in range(3000)) + "}\n" * 3000),
    ("deep.go", "package p\nfunc f() {\n" + "{\n" * 5000 + "}\n" * 5000 + "}\n"),
    ("deep.java", "class A {\n" + "".join(f"class B{i} {{\n" for i in range(3000)) + "}\n" * 3001),
    ("deep.rs", "".join(f"mod m{i} {{\n" for i in range(3000)) + "}\n" * 3000),
])
def test_hostile_nesting_is_read_whole_without_recursion(path: str, source: str) -> None:
    """Issue 42: thousands of nested blocks or types are read like any file (symbols looked for
    CODE_NESTING_MAX levels down), every line in exactly one chunk."""
    doc = rules.parse_document(source.encode(), path)
    covers_every_line_once(rules.chunk_document(doc, 512, 64), doc.line_count)
