"""Hostile input for the readers added in issue 40 (issue 42's last paragraph): each hostile file of
MDX, reStructuredText and AsciiDoc is read in a child process of its own, under a 1 GB address-space
cap and a deadline, and must come back read whole with what follows the hostile part still
searchable where the format allows; includes of every kind are never followed, through a real
ingest; and what keeps credentials out of the index is checked in every format.

Already covered elsewhere, not repeated here: PDF bombs, cyclic xrefs, huge pages and passwords
(test_pdf.py), 10,000 nested JSX tags one per line, a 1 MB line of JSX tags, an unterminated `{/*`
comment over 50,000 lines and a line of 200,000 `{` (test_readers.py), 1,290 nested rST directives
and megabyte rST lines (test_readers.py), 10,000 nested and unclosed AsciiDoc blocks, megabyte
AsciiDoc lines and 100,000 `include::` lines (test_asciidoc.py); what each costs next to the
Markdown reader is measured by tools/bench.py (HOSTILE_READS), not here."""

from __future__ import annotations

import json
import resource
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pdf_fixtures as fx
import pytest
from fake_ollama import FakeOllama
from helpers import Built, dispatched, in_process_service, ingest_in_process, keyword_db

import corpus_rules as rules

ROOT = Path(__file__).resolve().parents[1]
MEMORY_CAP = 1 << 30  # the child's address space: a reader that expands or copies its input blows it
DEADLINE_S = 30.0  # the PDF extractor's base deadline; every case here reads in ~0.1-4 s when linear

# The child: read and chunk one file, print what came back (or the refusal) as JSON.
READ_ONE = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import corpus_rules as rules
raw = open(sys.argv[2], "rb").read()
probes = json.loads(sys.argv[4])
limit = sys.getrecursionlimit()
try:
    doc = rules.parse_document(raw, sys.argv[3])
except rules.RagError as exc:
    print(json.dumps({"refused": str(exc.code), "message": exc.message}))
    raise SystemExit(0)
text = doc.text
chunks = rules.chunk_document(doc, 512, 64, 1900)
chunked = "\n".join(chunk.searchable for chunk in chunks)
print(json.dumps({
    "lines": len(doc.lines), "searchable_lines": len(text.searchable),
    "searchable_chars": sum(map(len, text.searchable)),
    "headings": len(text.headings), "last_headings": [[h.line, h.level, h.text] for h in text.headings[-3:]],
    "title": doc.title, "metadata": dict(text.metadata), "warnings": list(text.warnings),
    "chunks": len(chunks),
    "found": {p: [n for n, s in enumerate(text.searchable, 1) if p in s][:3] for p in probes},
    "chunked": {p: p in chunked for p in probes},
    "recursion_limit_kept": sys.getrecursionlimit() == limit,
}))
"""


def _capped() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))


def read_bounded(tmp_path: Path, text: str, name: str, probes: list[str] | None = None) -> dict[str, Any]:
    """Read `text` as the file `name` in a child under the memory cap and the deadline; what came back.
    A deadline passed raises subprocess.TimeoutExpired (the child is killed); a blown cap fails."""
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    done = subprocess.run([sys.executable, "-c", READ_ONE, str(ROOT), str(path), name, json.dumps(probes or [])],
                          capture_output=True, text=True, timeout=DEADLINE_S, preexec_fn=_capped, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout)
    if "refused" not in out:
        assert out["recursion_limit_kept"]
        assert out["lines"] == out["searchable_lines"] == len(rules.split_lines(text))
    return out


# ---------------------------------------------------------------------------
# MDX.

TAIL = "\n\n# After the hostile part\n\nTail words stay searchable.\n"


def nested_multiline_tags(depth: int) -> str:
    """`depth` JSX tags nested, each opened over three lines (attributes on their own line)."""
    opened = "".join(f"<Box{k}\n  title=\"level {k}\"\n>\n" for k in range(depth))
    return opened + "Deep text.\n" + "".join(f"</Box{k}>\n" for k in reversed(range(depth)))


@pytest.mark.process
def test_mdx_ten_thousand_nested_tags_on_one_line_and_over_lines(tmp_path: Path) -> None:
    one_line = read_bounded(tmp_path, "<A><B title='t'>" * 10_000 + "Deep text." + "</B></A>" * 10_000 + TAIL,
                            "one-line.mdx", ["Deep text.", "Tail words"])
    over_lines = read_bounded(tmp_path, nested_multiline_tags(10_000) + TAIL, "over-lines.mdx",
                              ["Deep text.", "level 9999", "Tail words"])
    for out in (one_line, over_lines):
        assert out["last_headings"] == [[out["lines"] - 2, 1, "After the hostile part"]]
        assert all(out["found"].values()) and all(out["chunked"].values()), out["found"]


@pytest.mark.process
def test_mdx_unterminated_expressions_read_on(tmp_path: Path) -> None:
    """MDX's reader does not parse expressions: an expression never closed, on one line or opened on
    every line, leaves the headings and text after it as they are."""
    many_lines = "{items.map((item) => (\n" * 50_000
    out = read_bounded(tmp_path, "# Before\n\n" + many_lines + TAIL, "expr.mdx", ["Tail words"])
    assert out["headings"] == 2 and out["last_headings"][-1][2] == "After the hostile part"
    assert out["found"]["Tail words"] and out["chunked"]["Tail words"]
    attribute = '<Card title="Card" onClick={() => {' + "x" * 1_000_000 + "\n"
    out = read_bounded(tmp_path, attribute + TAIL, "attr.mdx", ["Card", "Tail words"])
    assert out["found"]["Tail words"] and out["last_headings"][-1][2] == "After the hostile part"


@pytest.mark.process
def test_mdx_unterminated_jsx_tag(tmp_path: Path) -> None:
    """A tag whose `>` never comes: its attribute lines are the tag's (MDX itself refuses such a
    file); the text before it stays, and once a `>` comes the text after it is read again."""
    opened = "# Before\n\nLead text.\n\n<Card\n  title=\"Shown title\"\n" + '  data-x="1"\n' * 90_000
    never = read_bounded(tmp_path, opened, "never.mdx", ["Lead text.", "Shown title"])
    assert never["last_headings"] == [[1, 1, "Before"]] and all(never["found"].values())
    late = read_bounded(tmp_path, opened + ">\n" + TAIL, "late.mdx", ["Lead text.", "Shown title", "Tail words"])
    assert late["last_headings"][-1][2] == "After the hostile part" and all(late["chunked"].values())


@pytest.mark.process
def test_mdx_unterminated_fence_is_code_to_the_end(tmp_path: Path) -> None:
    code = "```python\n" + "# a comment, not a heading\nvalue = compute()\n" * 45_000
    out = read_bounded(tmp_path, "# Before\n\n" + code + "Tail words in the code.\n", "fence.mdx",
                       ["value = compute()", "Tail words"])
    assert out["headings"] == 1 and all(out["found"].values()) and all(out["chunked"].values())


@pytest.mark.process
def test_mdx_import_and_export_blocks_that_never_end(tmp_path: Path) -> None:
    """An import/export statement runs to a blank line (MDX's rule): one of 90,000 lines is no
    content, and what follows its blank line is read; one that runs to the end leaves nothing."""
    export = "export const data = {\n" + '  key: "no content here",\n' * 90_000
    ended = read_bounded(tmp_path, "import { X } from './x.mdx'\n" + export + TAIL, "esm.mdx",
                         ["no content here", "Tail words"])
    assert ended["found"] == {"no content here": [], "Tail words": [ended["lines"]]}
    assert ended["last_headings"] == [[ended["lines"] - 2, 1, "After the hostile part"]]
    never = read_bounded(tmp_path, export, "esm-to-end.mdx", ["no content here"])
    assert never["searchable_chars"] == 0 and never["chunks"] == 0 and never["headings"] == 0


UNCLOSED_COMMENTS = "{/*" * 166_000 + "\n*/}\n" + "<!--" * 125_000 + "\n-->\n"  # ~1 MB, two lines of openers


@pytest.mark.process
@pytest.mark.heavy
def test_mdx_a_megabyte_line_of_unclosed_comment_openers(tmp_path: Path) -> None:
    out = read_bounded(tmp_path, "# Before\n\n" + UNCLOSED_COMMENTS + TAIL, "comments.mdx", ["Tail words"])
    assert out["found"]["Tail words"] and out["last_headings"][-1][2] == "After the hostile part"


@pytest.mark.process
@pytest.mark.heavy
@pytest.mark.parametrize("name", ["heading.mdx", "heading.md"])  # blanks rescanned from each position: hours
def test_a_heading_with_a_megabyte_run_of_blanks(tmp_path: Path, name: str) -> None:
    heading = "# Start" + " " * 1_000_000 + "end {#anchor}"
    out = read_bounded(tmp_path, heading + TAIL, name, ["Tail words"])
    assert out["headings"] == 2 and out["found"]["Tail words"]
    container = "::: tip Start" + " " * 1_000_000 + "end"  # a container's title: its end blanks, once
    out = read_bounded(tmp_path, container + TAIL, name, ["Start", "Tail words"])
    assert out["found"]["Start"] and out["found"]["Tail words"]


# ---------------------------------------------------------------------------
# reStructuredText.

RST_TAIL = "\n\nAfter the hostile part\n======================\n\nTail words stay searchable.\n"


@pytest.mark.process
def test_rst_seven_thousand_five_hundred_nested_directives(tmp_path: Path) -> None:
    """Nesting costs the square of the depth in indentation: 7,500 levels at one column each is a
    28 MB file (under the 32 MB a text file may hold); read with an explicit stack, no recursion."""
    nested = "\n".join(" " * k + f".. note:: level {k}" for k in range(7_500))
    out = read_bounded(tmp_path, nested + RST_TAIL, "nested.rst", ["Note: level 7499", "Tail words"])
    assert out["last_headings"] == [[out["lines"] - 3, 1, "After the hostile part"]]
    assert all(out["found"].values()) and out["chunked"]["Tail words"]


@pytest.mark.process
def test_rst_five_thousand_nested_block_quotes_and_literal_blocks(tmp_path: Path) -> None:
    quotes = "\n\n".join(" " * k + f"quoted {k}" for k in range(5_000))
    literals = "Code::\n\n" + "\n\n".join(" " * (k + 1) + f"literal {k}::" for k in range(5_000))
    for name, text, deepest in (("quotes.rst", quotes, "quoted 4999"), ("literals.rst", literals, "literal 4999")):
        out = read_bounded(tmp_path, text + RST_TAIL, name, [deepest, "Tail words"])
        assert out["last_headings"] == [[out["lines"] - 3, 1, "After the hostile part"]], name
        assert all(out["found"].values()), (name, out["found"])


@pytest.mark.process
def test_rst_a_directive_with_90000_option_lines(tmp_path: Path) -> None:
    options = "".join(f"   :option-{k}: value {k}\n" for k in range(90_000))
    text = ".. code-block:: python\n   :caption: The caption\n" + options + "\n   answer = 42\n" + RST_TAIL
    out = read_bounded(tmp_path, text, "options.rst", ["The caption", "value 7", "answer = 42", "Tail words"])
    assert out["found"]["value 7"] == [] and out["found"]["The caption"] == [2]
    assert out["found"]["answer = 42"] and out["found"]["Tail words"]
    assert out["last_headings"][-1][2] == "After the hostile part"


@pytest.mark.process
def test_rst_substitution_chains_are_not_expanded(tmp_path: Path) -> None:
    """Sixty substitutions each twice the next (docutils would build 2**60 copies): never expanded."""
    chain = "".join(f".. |s{k}| replace:: |s{k + 1}| |s{k + 1}|\n" for k in range(60)) + ".. |s60| replace:: boom\n"
    out = read_bounded(tmp_path, "Title\n=====\n\n" + chain + "\nUses |s0| here.\n", "subst.rst", ["boom", "s0"])
    assert out["found"]["boom"] == [] and out["found"]["s0"] and out["searchable_chars"] < 100


# ---------------------------------------------------------------------------
# AsciiDoc (nested and unclosed blocks, megabyte lines: test_asciidoc.py).


@pytest.mark.process
def test_asciidoc_attribute_reference_bomb_is_not_expanded(tmp_path: Path) -> None:
    """{a0} is {a1}{a1}, {a1} is {a2}{a2}, … 60 levels (2**60 copies if substituted recursively).
    Header entries are read as written, so a reference shows its value once, as Asciidoctor does
    with entries that name attributes defined after them; the document's keys are not substituted.
    The same chain written in the order that makes each entry double the one before (a body's
    entries are substituted as they are defined) stops growing at ATTRIBUTE_GROWTH_MAX a line."""
    entries = "".join(f":a{k}: {{a{k + 1}}}{{a{k + 1}}}\n" for k in range(60)) + ":a60: boom\n:title: {a0}\n"
    text = "= The {a0} guide\n" + entries + "\nBody with {a0} in it.\n\n== Section {a0}\n\nMore {a0}.\n"
    out = read_bounded(tmp_path, text, "bomb.adoc", ["boom", "{a1}{a1}"])
    assert out["found"]["boom"] == [] and len(out["found"]["{a1}{a1}"]) == 3
    assert out["title"] == "{a0}" and out["last_headings"] == [[out["lines"] - 2, 1, "Section {a1}{a1}"]]
    assert out["searchable_chars"] <= len(text) + 6
    doubling = ":a60: boom\n" + "".join(f":a{k}: {{a{k + 1}}}{{a{k + 1}}}\n" for k in range(59, -1, -1))
    text = "= Guide\n\n" + doubling + "\nBody with {a0} in it.\n\nMore {a0}.\n"
    out = read_bounded(tmp_path, text, "doubling.adoc", ["Body with", "More"])
    assert out["found"]["Body with"] and out["found"]["More"]
    assert out["searchable_chars"] <= len(text) + 2 * rules.ATTRIBUTE_GROWTH_MAX


# ---------------------------------------------------------------------------
# Includes of every kind, never followed: through a real ingest.

INSIDE_TOKEN = "quokkainsidetoken"  # in a corpus file the others include: indexed as that file only
OUTSIDE_TOKEN = "wombatoutsidetoken"  # in files next to the corpus: never indexed
INCLUDING_WORDS = "Platypus lead paragraph."
ETC_PASSWD = Path("/etc/passwd")


def includer_files() -> dict[str, str]:
    """Each format's include forms, at /etc/passwd, a file outside the corpus, a file inside it, a
    URL and the file itself."""
    rst = "\n".join([
        "Including guide", "===============", "", INCLUDING_WORDS, "",
        ".. include:: /etc/passwd", ".. include:: ../outside.rst", ".. include:: inside.rst",
        ".. include:: https://example.invalid/remote.rst", ".. include:: guide.rst",
        ".. literalinclude:: /etc/passwd", ".. literalinclude:: ../outside.rst",
        ".. literalinclude:: inside.rst", "   :lines: 1-3", "",
        ".. raw:: html", "   :file: /etc/passwd", "",
        ".. raw:: html", "   :file: ../outside.rst", "",
        ".. raw:: html", "   :url: https://example.invalid/remote.html", "",
        "Closing words.", ""])
    adoc = "\n".join([
        "= Including guide", "", INCLUDING_WORDS, "",
        "include::/etc/passwd[]", "include::../outside.adoc[]", "include::inside.adoc[]",
        "include::https://example.invalid/remote.adoc[]", "include::guide.adoc[]",
        "include::inside.adoc[tag=all,leveloffset=+1]", "", "[source,text]", "----",
        "include::/etc/passwd[]", "include::../outside.adoc[lines=1..5]", "----", "", "Closing words.", ""])
    mdx = "\n".join([
        "import Outside from '../outside.mdx'", "import Inside from './inside.mdx'",
        "import Passwd from '/etc/passwd'", "", "# Including guide", "", INCLUDING_WORDS, "",
        "<Outside />", "<Inside />", "<Passwd />", "", "Closing words.", ""])
    return {"guide.rst": rst, "guide.adoc": adoc, "guide.mdx": mdx}


@pytest.fixture(scope="module")
def includes_built(fake: FakeOllama, tmp_path_factory: pytest.TempPathFactory) -> tuple[Built, Any]:
    root = tmp_path_factory.mktemp("includes")
    corpus = root / "corpus"
    corpus.mkdir()
    for ext in ("rst", "adoc", "mdx"):
        (root / f"outside.{ext}").write_text(f"Outside\n=======\n\nThe {OUTSIDE_TOKEN} text.\n", encoding="utf-8")
    (corpus / "inside.rst").write_text(f"Inside\n======\n\nThe {INSIDE_TOKEN} text.\n", encoding="utf-8")
    (corpus / "inside.adoc").write_text(f"= Inside\n\nThe {INSIDE_TOKEN} text.\n", encoding="utf-8")
    (corpus / "inside.mdx").write_text(f"# Inside\n\nThe {INSIDE_TOKEN} text.\n", encoding="utf-8")
    for name, text in includer_files().items():
        (corpus / name).write_text(text, encoding="utf-8")
    done = ingest_in_process(fake, corpus, root / "store", RAG_CHUNK_MIN_TOKENS="0")
    return Built(corpus, root / "store", fake.host), done


def chunk_rows(built: Built) -> list[tuple[str, str, str]]:
    """(path, text, searchable) of every chunk in the keyword index."""
    with keyword_db(built.store) as db:
        return [(p, t, s or "") for p, t, s in db.execute("SELECT path, text, searchable FROM chunks")]


def keyword_paths(built: Built, query: str) -> list[str]:
    svc = in_process_service(built)
    try:
        is_error, payload = dispatched(svc, "search_corpus", query=query, mode="keyword", k=20)
    finally:
        svc.close(5)
    assert not is_error, payload
    return [hit["path"] for hit in payload["results"]]


def passwd_lines() -> list[str]:
    if not ETC_PASSWD.is_file():
        return []
    return [line for line in ETC_PASSWD.read_text(encoding="utf-8", errors="replace").splitlines() if ":" in line]


def test_includes_are_never_followed_in_any_format(includes_built: tuple[Built, Any]) -> None:
    built, done = includes_built
    assert done.code == 0, done.err
    rows = chunk_rows(built)
    assert {path for path, _, _ in rows} == {"guide.rst", "guide.adoc", "guide.mdx", "inside.rst", "inside.adoc",
                                              "inside.mdx"}
    for path, text, searchable in rows:
        assert OUTSIDE_TOKEN not in text + searchable, path
        assert INSIDE_TOKEN not in text + searchable or path.startswith("inside."), path
        for line in passwd_lines():
            assert line not in text and line not in searchable, (path, line)
    assert keyword_paths(built, OUTSIDE_TOKEN) == []
    assert sorted(keyword_paths(built, INSIDE_TOKEN)) == ["inside.adoc", "inside.mdx", "inside.rst"]
    assert sorted(keyword_paths(built, "platypus")) == ["guide.adoc", "guide.mdx", "guide.rst"]
    with keyword_db(built.store) as db:
        assert db.execute("SELECT count(*) FROM chunks WHERE path LIKE 'guide.%' AND "
                          "(text LIKE '%Closing words.%' OR searchable LIKE '%Closing words.%')").fetchone() == (3,)


def test_include_directives_are_named_not_followed(includes_built: tuple[Built, Any]) -> None:
    """reStructuredText says how many include/literalinclude directives were left (raw :file: is
    dropped as a directive option, unsaid); AsciiDoc's include:: lines are no content, unsaid."""
    _, done = includes_built
    assert "guide.rst: 8 include/literalinclude directive(s) not followed (first at line 6)" in done.err, done.err
    for format_ in ("rst", "adoc", "mdx"):
        doc = rules.parse_document(includer_files()[f"guide.{format_}"].encode(), f"guide.{format_}")
        shown = "\n".join(doc.text.searchable)
        assert "passwd" not in shown and "outside" not in shown and "example.invalid" not in shown, format_


# ---------------------------------------------------------------------------
# Credentials in content. The project's one rule is per document: `rag: false` (frontmatter, docinfo,
# header attribute, PDF document information) or .ragignore keeps the whole file out. Nothing in
# corpus_rules.py or ingest.py looks for credentials inside a document that is indexed.

SECRETS = {
    "mdx": ("AKIAMDXQ2EXAMPLE7K3Z", "mdx-hunter2-passphrase"),
    "rst": ("AKIARSTQ2EXAMPLE7K3Z", "rst-hunter2-passphrase"),
    "adoc": ("AKIAADOQ2EXAMPLE7K3Z", "adoc-hunter2-passphrase"),
    "pdf": ("AKIAPDFQ2EXAMPLE7K3Z", "pdf-hunter2-passphrase"),
}
KEY_BODY = "b3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQ"


def secret_lines(format_: str) -> list[str]:
    key_id, password = SECRETS[format_]
    return ["Deploy credentials for the staging bucket.", f"aws_access_key_id = {key_id}",
            f"password: {password}", "-----BEGIN OPENSSH PRIVATE KEY-----", f"{KEY_BODY}{format_}",
            "-----END OPENSSH PRIVATE KEY-----"]


def secret_pdf(lines: list[str], metadata: dict[str, str]) -> bytes:
    writer, font = fx._writer_with_font()
    fx._add_page(writer, font, fx.text_block(72, 720, lines))
    writer.add_metadata({"/Title": "Deploy credentials", **metadata})
    return fx._written(writer)


def secret_files(rag_false: bool) -> dict[str, str | bytes]:
    """A document holding credentials in each format, with `rag: false` in its own form or not."""
    def body(format_: str, *, code: bool) -> str:
        lines = secret_lines(format_)
        return "\n".join([lines[0], "", *(["```", *lines[1:], "```"] if code else lines[1:]), ""])

    mdx_keys = "---\nrag: false\n---\n" if rag_false else ""
    rst_keys = ":rag: false\n\n" if rag_false else ""
    adoc_keys = ":rag: false\n" if rag_false else ""
    rst_lines = secret_lines("rst")
    return {
        "deploy.mdx": mdx_keys + "# Deploy\n\n" + body("mdx", code=True),
        "deploy.rst": rst_keys + "Deploy\n======\n\n" + rst_lines[0] + "\n\n::\n\n"
                      + "".join(f"    {line}\n" for line in rst_lines[1:]) + f"\n{rst_lines[2]}\n",
        "deploy.adoc": "= Deploy\n" + adoc_keys + "\n" + "\n".join(
            [secret_lines("adoc")[0], "", "----", *secret_lines("adoc")[1:], "----", "", secret_lines("adoc")[1], ""]),
        "deploy.pdf": secret_pdf(secret_lines("pdf"), {"/rag": "false"} if rag_false else {}),
    }


def build_secrets(fake: FakeOllama, root: Path, rag_false: bool) -> tuple[Built, Any]:
    corpus = root / "corpus"
    corpus.mkdir(parents=True)
    (corpus / "index.md").write_text("# Index\n\nThe staging bucket holds build artefacts.\n", encoding="utf-8")
    for name, content in secret_files(rag_false).items():
        if isinstance(content, bytes):
            (corpus / name).write_bytes(content)
        else:
            (corpus / name).write_text(content, encoding="utf-8")
    done = ingest_in_process(fake, corpus, root / "store", RAG_CHUNK_MIN_TOKENS="0")
    assert done.code == (0 if rag_false else 1), done.err  # refused files fail the run, the rest is indexed
    return Built(corpus, root / "store", fake.host), done


def index_texts(built: Built) -> Iterator[str]:
    """Every text the index keeps: documents' titles, chunks' text, headings and searchable text, the
    text extracted from a PDF."""
    with keyword_db(built.store) as db:
        for row in db.execute("SELECT title FROM documents"):
            yield row[0]
        for row in db.execute("SELECT text, heading, coalesce(searchable, '') FROM chunks"):
            yield from row
        try:
            yield from (row[0] for row in db.execute("SELECT text FROM extracted"))
        except sqlite3.OperationalError:  # an index from before PDFs
            pass


def test_rag_false_keeps_a_document_with_credentials_out_in_every_format(fake: FakeOllama, tmp_path: Path) -> None:
    built, done = build_secrets(fake, tmp_path, rag_false=True)
    assert done.summary["excluded"] == 4, done.summary
    kept = "\n".join(index_texts(built))
    for format_, (key_id, password) in SECRETS.items():
        assert key_id not in kept and password not in kept and f"{KEY_BODY}{format_}" not in kept, format_
        assert keyword_paths(built, key_id) == []
    assert "PRIVATE KEY" not in kept and keyword_paths(built, "staging bucket") == ["index.md"]


@pytest.fixture(scope="module")
def secrets_run(fake: FakeOllama, tmp_path_factory: pytest.TempPathFactory) -> tuple[Built, Any]:
    return build_secrets(fake, tmp_path_factory.mktemp("secrets"), rag_false=False)


@pytest.fixture(scope="module")
def secrets_indexed(secrets_run: tuple[Built, Any]) -> Built:
    return secrets_run[0]


def test_each_reader_reads_the_credentials_and_ingest_refuses_each_file_by_name(
        secrets_run: tuple[Built, Any]) -> None:
    """Each reader's text holds its credential lines (as code where they are code), so the case the
    next test is about is real; ingest refuses each such file by name, saying what and where, and
    indexes the rest."""
    built, done = secrets_run
    for format_ in SECRETS:
        path = f"deploy.{format_}"
        raw = (built.corpus / path).read_bytes()
        text = rules.reader_for(path).read(raw, path)  # the reader alone, before the credential rule
        found = rules.credential_in(text)
        assert found is not None and found.kind in ("a private key", "an AWS access key ID"), (format_, found)
        error = next(e for e in done.summary["errors"] if e.startswith(f"{path}:"))
        assert f"holds what looks like {found.kind}" in error and "never indexed" in error, error
    assert keyword_paths(built, "staging bucket") == ["index.md"]


@pytest.mark.parametrize("format_", list(SECRETS))
def test_a_credential_in_content_never_reaches_the_index(secrets_indexed: Built, format_: str) -> None:
    key_id, password = SECRETS[format_]
    kept = "\n".join(index_texts(secrets_indexed))
    assert key_id not in kept and password not in kept and f"{KEY_BODY}{format_}" not in kept
    assert keyword_paths(secrets_indexed, key_id) == [] and keyword_paths(secrets_indexed, password) == []

