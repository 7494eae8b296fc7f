"""The readers (issue 40): every format becomes the one document model, its sections as the dev set's
reference rules define them, its searchable text rule by rule, and chunks that cover it exactly.

Each format's sections are checked against a reference written here from the documented rules
(tests/README.md says where they come from), on generated documents; hostile input must come back
read, whole, without a RecursionError (what it costs is measured by tools/bench.py --readers)."""

from __future__ import annotations

import re
import sys
import textwrap
from collections.abc import Callable, Sequence
from itertools import pairwise

import pytest
from budgets import examples
from helpers import ROOT
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import corpus_rules as rules
from corpus_rules import DocumentText, SourceDocument

HYPOTHESIS = settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])


def read(text: str, path: str) -> DocumentText:
    return rules.parse_document(textwrap.dedent(text).lstrip("\n").encode(), path).text


def assert_model(text: DocumentText) -> None:
    """What every reader promises of its model, whatever the input."""
    lines = text.lines
    assert len(text.searchable) == len(lines)
    assert all("\n" not in s for s in text.searchable)
    assert all(not s.strip() for line, s in zip(lines, text.searchable, strict=True) if not line.strip())
    assert all(not s.strip() for s in text.searchable[:text.body_start - 1])
    assert 1 <= text.body_start <= len(lines) + 1
    starts = list(text.block_starts)
    assert starts == sorted(set(starts)) and all(text.body_start <= n <= len(lines) for n in starts)
    for heading in text.headings:
        assert text.body_start <= heading.line <= len(lines) and heading.line in text.block_starts
        assert heading.text == rules.metadata_text(heading.text)
    assert [h.line for h in text.headings] == sorted({h.line for h in text.headings})


def assert_chunks_cover(doc: SourceDocument, chunks: Sequence[rules.Chunk], context: int) -> None:
    """Every line of content is in exactly one chunk (the pieces of one cut line share it), each
    chunk's text is its lines as stored and its searchable text theirs as read, and each chunk is
    named by the heading path of its first section."""
    text = doc.text
    body = range(text.body_start, len(text.lines) + 1)
    if not any(text.searchable[n - 1].strip() for n in body):
        assert chunks == []
        return
    assert [c.index for c in chunks] == list(range(len(chunks)))
    assert chunks[0].start_line == text.body_start and chunks[-1].end_line == len(text.lines)
    for prev, nxt in pairwise(chunks):
        assert nxt.start_line in (prev.end_line, prev.end_line + 1), (prev, nxt)
    shared = {nxt.start_line for prev, nxt in pairwise(chunks) if nxt.start_line == prev.end_line}
    for chunk in chunks:
        assert chunk.searchable and chunk.searchable == chunk.searchable.strip()
        assert rules.estimate_tokens(chunk.searchable) <= context
        if chunk.start_line not in shared and chunk.end_line not in shared:
            assert chunk.text == "\n".join(text.lines[chunk.start_line - 1:chunk.end_line]).strip()
            assert chunk.searchable == "\n".join(text.searchable[chunk.start_line - 1:chunk.end_line]).strip()
    covering = {n: [c for c in chunks if c.start_line <= n <= c.end_line] for n in body}
    for n in body:
        if text.searchable[n - 1].strip() and n not in shared:
            assert len(covering[n]) == 1, (n, covering[n])
    paths = heading_paths(doc.title, text)
    for chunk in chunks:
        first = next(n for n in range(chunk.start_line, chunk.end_line + 1) if text.searchable[n - 1].strip())
        assert chunk.heading.startswith(paths[first]) or doc.chunk_mode == "whole", (chunk, paths[first])


def heading_paths(title: str, text: DocumentText) -> dict[int, str]:
    """The heading path of every line, from the headings: what a reader of the page sees above it."""
    out, stack, at = {}, [], 0
    headings = list(text.headings)
    for n in range(1, len(text.lines) + 1):
        while at < len(headings) and headings[at].line == n:
            stack = [h for h in stack if h.level < headings[at].level] + [headings[at]]
            at += 1
        out[n] = rules.metadata_text(rules.HEADING_SEPARATOR.join(h.text for h in stack if h.text)) if stack else title
    return out


def assert_chunked(doc: SourceDocument, max_tokens: int, min_tokens: int) -> None:
    context = max_tokens + 40
    assert_chunks_cover(doc, rules.chunk_document(doc, max_tokens, min_tokens, context), context)


# ---------------------------------------------------------------------------
# References: section rules as the dev set documents them (its README), written out again here.

_ATX = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?[ \t]*$")
_FENCE = re.compile(r"^\s*(`{3,}|~{3,})(.*)$")
_ADORNMENT = re.compile(r"^([!-/:-@\[-`{-~])\1*\s*$")


def reference_mdx_headings(lines: Sequence[str]) -> list[tuple[int, int]]:
    """ATX headings outside fences (any indentation) and multi-line {/* */} comments, after a YAML
    frontmatter; import/export statements run to a blank line (MDX's own rule)."""
    heads, fence, comment, esm = [], None, False, False
    start = next((i + 1 for i in range(1, len(lines)) if lines[i].strip() == "---"), 0) \
        if lines and lines[0].strip() == "---" else 0
    for n in range(start, len(lines)):
        line = lines[n]
        opened = _FENCE.match(line)
        if fence:
            if opened and opened.group(1)[0] == fence[0] and len(opened.group(1)) >= len(fence) \
                    and not opened.group(2).strip():
                fence = None
        elif comment:
            comment = "*/}" not in line
        elif esm:
            esm = bool(line.strip())
        elif opened:
            fence = opened.group(1)
        elif line.startswith(("import ", "export ")):
            esm = True
        elif "{/*" in line and "*/}" not in line[line.rfind("{/*"):]:
            comment = True
        elif (atx := _ATX.match(line)) is not None:
            heads.append((n + 1, len(atx.group(1))))
    return heads


def reference_rst_headings(lines: Sequence[str]) -> list[tuple[int, int]]:
    """Titles: a text line with an underline at least as long, maybe an overline of the same
    character and length; in column 0 unless overlined; a paragraph of its own; never inside a
    literal block (after `::`) or an explicit-markup block (`..`). Levels by first appearance of
    each (character, overlined) style."""
    inside = [False] * len(lines)
    for n, line in enumerate(lines):
        if inside[n] or not line.strip() or not (re.match(r"\s*\.\.(\s|$)", line) or line.rstrip().endswith("::")):
            continue
        depth = len(line) - len(line.lstrip())
        end = n + 1
        while end < len(lines) and (not lines[end].strip() or len(lines[end]) - len(lines[end].lstrip()) > depth):
            end += 1
        while end - 1 > n and not lines[end - 1].strip():
            end -= 1
        for k in range(n + 1, end):
            inside[k] = True
    styles: list[tuple[str, bool]] = []
    heads = []
    n = 0
    while n + 1 < len(lines):
        title, under = lines[n], lines[n + 1]
        if inside[n] or inside[n + 1] or not title.strip() or _ADORNMENT.match(title) or not _ADORNMENT.match(under):
            n += 1
            continue
        width = len(under.rstrip())
        over = n >= 1 and not inside[n - 1] and _ADORNMENT.match(lines[n - 1]) is not None \
            and lines[n - 1][0] == under[0] and len(lines[n - 1].rstrip()) == width
        top = n - 1 if over else n
        if width < len(title.rstrip()) or (top and lines[top - 1].strip()) or (not over and title[0].isspace()):
            n += 1
            continue
        style = (under[0], over)
        if style not in styles:
            styles.append(style)
        heads.append((n + 1, styles.index(style) + 1))
        n += 2
    return heads


# ---------------------------------------------------------------------------
# The reader table and RAG_FORMATS.


def test_one_reader_per_extension_and_the_formats_setting() -> None:
    extensions = [e for reader in rules.READERS for e in reader.extensions]
    assert len(extensions) == len(set(extensions))
    assert {r.format for r in rules.READERS if r.kind == "doc"} == {"markdown", "mdx", "rst", "text"} | {
        r.format for r in rules.READERS if r.format in ("asciidoc", "pdf")}
    assert not set(rules.CODE_FORMATS) & set(rules.DEFAULT_FORMATS)  # code is opt-in (RAG_CODE)
    assert set(rules.load_settings({"RAG_CODE": "1"}).formats) == set(rules.DEFAULT_FORMATS) | set(rules.CODE_FORMATS)
    assert rules.reader_for("guide/Intro.MDX").format == "mdx"
    assert rules.reader_for("notes.txt") is not None and rules.reader_for("notes.txt", rules.DEFAULT_FORMATS) is None
    assert rules.reader_for("page.html") is None and rules.reader_for("Makefile") is None
    assert rules.load_settings({}).formats == rules.DEFAULT_FORMATS and "text" not in rules.DEFAULT_FORMATS
    assert rules.load_settings({"RAG_FORMATS": " RST , markdown"}).formats == ("markdown", "rst")
    with pytest.raises(rules.RagError, match="RAG_FORMATS"):
        rules.load_settings({"RAG_FORMATS": "markdown,html"})


def test_every_format_reads_the_same_document_keys() -> None:
    """Frontmatter, docinfo: the same keys, the same rules, the same errors."""
    mdx = rules.parse_document(b"---\nlifecycle: superseded\nsuperseded_by: new.mdx\ntitle: Old\n---\n# H\n\nx\n", "a.mdx")
    rst = rules.parse_document(b":lifecycle: superseded\n:superseded_by: new.rst\n\nOld\n===\n\nx\n", "a.rst")
    assert (mdx.lifecycle, mdx.superseded_by, mdx.title) == ("superseded", ("new.mdx",), "Old")
    assert (rst.lifecycle, rst.superseded_by, rst.title) == ("superseded", ("new.rst",), "Old")
    assert not rules.parse_document(b":rag: false\n\nT\n=\n", "x.rst").rag
    assert rules.parse_document(b":superseded_by: [a.rst, b.rst]\n:lifecycle: superseded\n\nT\n=\n",
                                "x.rst").superseded_by == ("a.rst", "b.rst")
    with pytest.raises(rules.RagError, match="lifecycle must be one of") as caught:
        rules.parse_document(b":lifecycle: retired\n\nT\n=\n", "x.rst")
    assert caught.value.code is rules.ErrorCode.DOCUMENT_INVALID


def test_the_readme_lists_exactly_the_document_keys() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = readme.split("| key | values | effect |", 1)[1].split("\n\n", 1)[0]
    listed = re.findall(r"^\| `([a-z_]+)` \|", table, re.MULTILINE)
    assert listed == [key.name for key in rules.DOCUMENT_KEYS]


# ---------------------------------------------------------------------------
# Markdown.


def test_markdown_searchable_text_is_what_the_page_shows_and_code_stays_as_written() -> None:
    """What real sites showed: Docusaurus compiles `.md` as MDX (imports, <Tabs>), VitePress and
    Docusaurus write admonitions as container fences, GitHub alerts, HTML comments and badges in
    headings; none of it is text a reader of the page sees. Code is untouched, indented or fenced."""
    text = read("""
        import Tabs from '@theme/Tabs';
        import TabItem from '@theme/TabItem';

        # Guide <Badge text="beta" type="warning" />

        <!-- a note to editors -->
        <script setup>
        const hidden = 1
        </script>

        ::: tip Keep builds warm
        Reuse the cache.
        :::

        :::note
        > [!WARNING]
        <TabItem value="npm">npm \\[flags] &amp; `<Tabs>` here</TabItem>

        ## Install [the CLI](https://example.com/cli "title") {#install}

        ```html
        <!-- code keeps its comment -->
        ::: tip
        ```

            <div>indented code</div>

        import this is prose, not a statement

        [//]: # (an editor's comment)
        [uv]: https://github.com/astral-sh/uv
        """, "guide.md")
    assert_model(text)
    shown = dict(zip(text.lines, text.searchable, strict=True))
    assert shown["import Tabs from '@theme/Tabs';"] == "" and shown["import TabItem from '@theme/TabItem';"] == ""
    assert [h.text for h in text.headings] == ["Guide beta", "Install the CLI"] and text.title == "Guide beta"
    assert shown["<!-- a note to editors -->"] == "" and shown["const hidden = 1"] == ""
    assert (shown["::: tip Keep builds warm"], shown[":::"], shown[":::note"], shown["> [!WARNING]"]) == (
        "Keep builds warm", "", "Note:", "Warning:")
    assert shown['<TabItem value="npm">npm \\[flags] &amp; `<Tabs>` here</TabItem>'] == "npm npm [flags] & `<Tabs>` here"
    assert shown["<!-- code keeps its comment -->"] == "<!-- code keeps its comment -->"
    assert shown["::: tip"] == "::: tip" and shown["    <div>indented code</div>"] == "    <div>indented code</div>"
    assert shown["import this is prose, not a statement"] == "import this is prose, not a statement"
    assert shown["[//]: # (an editor's comment)"] == "" and shown["[uv]: https://github.com/astral-sh/uv"] == ""
    assert rules.container_line("::: mkdocstrings.handler") == "::: mkdocstrings.handler", "not a container"


# ---------------------------------------------------------------------------
# MDX.


def test_mdx_imports_comments_and_jsx_are_not_searchable_but_their_text_is() -> None:
    text = read("""
        ---
        title: "Build a server"
        ---
        import { Tabs } from "/snippets/tabs.mdx";
        export const meta = {
          draft: false,
        };

        {/* a comment
            # not a heading
        */}

        ## Install {#install}

        <Note>
        Servers can connect to **any** client.
        </Note>

        <Tabs>
        <Tab title="Python">
        ```bash
        # a shell comment, not a heading
        uv add "mcp[cli]"
        ```
        </Tab>
        </Tabs>

        <Card
          title="Quickstart"
          icon="rocket"
          href="/quickstart"
        >
        Start here.
        </Card>
        """, "build.mdx")
    assert_model(text)
    assert text.metadata == {"title": "Build a server"}
    lines = dict(zip(text.lines, text.searchable, strict=True))
    assert lines['import { Tabs } from "/snippets/tabs.mdx";'] == "" and lines["  draft: false,"] == ""
    assert lines["    # not a heading"] == ""
    assert lines["## Install {#install}"] == "Install"
    assert lines["<Note>"] == "" and lines["Servers can connect to **any** client."] == "Servers can connect to **any** client."
    assert lines['<Tab title="Python">'] == "Python"
    assert lines["# a shell comment, not a heading"] == "# a shell comment, not a heading"
    assert lines['  title="Quickstart"'] == "Quickstart" and lines['  href="/quickstart"'] == ""
    assert [(h.line, h.level, h.text) for h in text.headings] == [(13, 2, "Install")]


def test_mdx_headings_between_jsx_tags_are_headings() -> None:
    text = read("""
        <Steps>
        <Step title="One">
        ### Configure the client
        Text.
        </Step>
        </Steps>
        """, "steps.mdx")
    assert [(h.line, h.text) for h in text.headings] == [(3, "Configure the client")]


def test_mdx_code_spans_keep_what_looks_like_a_tag() -> None:
    """`<Aside>` in backticks names a component the page shows; it is not a tag (a heading of
    Starlight's components reference was cited as "`` Props")."""
    text = read("""
        ## `<Aside>` Props

        Use the `<Aside>` component, or <Note>inline</Note>; flags: `--server <name>`, ``a `<b>` c``.
        The `<Tabs` tag in backticks opens nothing:
        text that follows.
        """, "asides.mdx")
    assert [h.text for h in text.headings] == ["`<Aside>` Props"]
    assert text.searchable[2] == "Use the `<Aside>` component, or inline; flags: `--server <name>`, ``a `<b>` c``."
    assert text.searchable[3:5] == ("The `<Tabs` tag in backticks opens nothing:", "text that follows.")
    assert rules.markup_inline("<Tabs items={['npm', \"pnpm\"]}>") == "npm pnpm", "a tab set's labels"
    assert rules.markup_inline("<ins style={{color: 'red'}} className=\"box\" />x") == "x", "nested braces"


def reference_code_spans(text: str) -> list[tuple[str, bool]]:
    """CommonMark's code spans, scanned naively: from each backtick run, the next run of the same length."""
    pieces, at, i = [], 0, 0
    while i < len(text):
        if text[i] != "`":
            i += 1
            continue
        n = len(text) - len(text[i:].lstrip("`")) - i
        j, close = i + n, None
        while j < len(text):
            if text[j] == "`":
                m = len(text) - len(text[j:].lstrip("`")) - j
                if m == n:
                    close = j + m
                    break
                j += m
            else:
                j += 1
        if close is None:
            i += n
            continue
        if i > at:
            pieces.append((text[at:i], False))
        pieces.append((text[i:close], True))
        at = i = close
    if at < len(text) or not pieces:
        pieces.append((text[at:], False))
    return pieces


@HYPOTHESIS
@given(st.text(st.sampled_from("`a <>x"), max_size=40))
def test_code_spans_follow_commonmark(text: str) -> None:
    pieces = rules.code_spans(text)
    assert "".join(piece for piece, _ in pieces) == text
    assert pieces == reference_code_spans(text)


_MDX_PIECES = st.sampled_from([
    ["# Title"], ["## Section {#anchor}"], ["### Deeper ###"], ["    # indented four: text"], ["#not a heading"],
    ["Some text with `code` and a [link](https://x.y/?a=1#b)."], ["<Note>", "Noted.", "</Note>"],
    ['<Tab title="Python">'], ["</Tab>"], ["<Card", '  title="A card"', ">"], ["{/* one-line comment */}"],
    ["{/* a comment", "# inside the comment", "*/}"], ["```python", "# code comment", "x = 1", "```"],
    ["  ~~~~", "  # in an indented fence", "  ~~~~"], ["````", "```", "# still code", "````"],
    ['import { X } from "./x.mdx"', ""], ["export const a = 1", ""], ["- a list item", "- another"], [""], [""],
])


@st.composite
def mdx_documents(draw: st.DrawFn) -> list[str]:
    lines = ["---", "title: Generated", "---"] if draw(st.booleans()) else []
    for piece in draw(st.lists(_MDX_PIECES, max_size=25)):
        lines += piece
    return lines


@HYPOTHESIS
@given(mdx_documents(), st.integers(16, 200))
def test_mdx_sections_agree_with_the_reference_and_chunks_cover_the_document(lines: list[str], budget: int) -> None:
    doc = rules.parse_document("\n".join(lines).encode(), "gen.mdx")
    assert_model(doc.text)
    assert [(h.line, h.level) for h in doc.text.headings] == reference_mdx_headings(lines)
    assert_chunked(doc, budget, budget // 4)


# ---------------------------------------------------------------------------
# reStructuredText.


def rst(text: str) -> DocumentText:
    return read(text, "doc.rst")


def rst_searchable(text: str) -> list[str]:
    return list(rst(text).searchable)


def test_rst_levels_follow_the_order_adornment_styles_first_appear() -> None:
    text = rst("""
        =====
        Top
        =====

        Sub
        ===

        Deeper
        ------

        Again
        =====
        """)
    assert [(h.line, h.level, h.text) for h in text.headings] == [(2, 1, "Top"), (5, 2, "Sub"), (8, 3, "Deeper"),
                                                                  (11, 2, "Again")]
    assert text.title == "Top"


def test_rst_heading_text_is_reduced_and_titles_inside_blocks_are_not_headings() -> None:
    text = rst("""
        The :func:`url_for`   ``helper``
        ==================================

        Example::

            Not a title
            ===========

        .. note::

           Not a title either
           ==================

        Too long for its underline
        =====
        """)
    assert [(h.line, h.text) for h in text.headings] == [(1, "The url_for helper")]


def test_rst_titles_adornments_and_transitions() -> None:
    assert rst_searchable("""
        ======
         Top
        ======

        Text.

        ----------

        More text.
        """) == ["", "Top", "", "", "Text.", "", "", "", "More text."]


def test_rst_comments_targets_and_substitution_definitions_are_not_content() -> None:
    assert rst_searchable("""
        .. a comment
           with a body

        ..
           a lone comment's body

        .. _label:
        .. _flask: https://flask.palletsprojects.com
        __ https://example.com
        .. |logo| image:: logo.png
           :alt: the logo

        Text.
        """) == ["", "", "", "", "", "", "", "", "", "", "", "", "Text."]


def test_rst_navigation_and_context_directives_are_not_content_and_includes_are_not_followed() -> None:
    text = rst("""
        .. toctree::
           :maxdepth: 2

           installation
           quickstart

        .. currentmodule:: flask
        .. module:: flask.json
        .. highlight:: python
        .. index:: single: config
        .. include:: ../CHANGES.rst
        .. literalinclude:: app.py
           :lines: 1-10
        """)
    assert list(text.searchable) == [""] * 13
    assert len(text.warnings) == 1 and "doc.rst" in text.warnings[0] and "not followed" in text.warnings[0]


def test_rst_code_blocks_keep_code_as_written_and_drop_options_but_captions() -> None:
    assert rst_searchable("""
        .. code-block:: python
           :caption: The ``app`` module
           :linenos:

           app = Flask(__name__)  # *not* emphasis, `not` a role
        """) == ["", "The app module", "", "", "   app = Flask(__name__)  # *not* emphasis, `not` a role"]


def test_rst_literal_blocks_after_double_colon() -> None:
    assert rst_searchable("""
        Run it with::

            $ flask --app hello run *now*

        ::

            y
        """) == ["Run it with:", "", "    $ flask --app hello run *now*", "", "", "", "    y"]


def test_rst_admonitions_versions_and_object_descriptions() -> None:
    assert rst_searchable("""
        .. note:: Read :func:`this`.
        .. warning::

           Do **not** deploy.
        .. seealso:: :doc:`/deploying/index`
        .. versionchanged:: 2.1 The ``x`` argument.
        .. deprecated:: 2.3
        .. py:data:: SECRET_KEY
        .. autoclass:: flask.Flask
           :members:
        .. option:: --extra-files
        .. tab:: Bash
        .. image:: _static/flask.png
        """) == ["Note: Read this.", "Warning:", "", "   Do not deploy.", "See also: /deploying/index",
                 "Changed in version 2.1: The x argument.", "Deprecated since version 2.3:", "SECRET_KEY",
                 "flask.Flask", "", "--extra-files", "Bash", ""]


def test_rst_shows_what_sphinx_renders_of_object_options_version_directives_and_numbered_roles() -> None:
    """A confval's type and default are what "what is the default of X" asks (Sphinx renders them
    "Type: …", "Default: …"); Sphinx 7.3's version-* directives and :pep:/:rfc: name what they show."""
    assert rst_searchable("""
        .. confval:: project
           :type: :code-py:`str`
           :default: ``'Project name not set'``
           :no-index:

           The documented project's name.
        .. attribute:: docname
           :type: str
           :value: None
        .. code-block:: python
           :type: not an object: an option like any other
        .. version-added:: 9.0 Something.
        .. csv-table:: Prefixes
           :header: "Directive", "Option prefix"
        See :pep:`8`, :rfc:`7231#section-4` and :pep:`the style guide <8>`.
        """) == ["project", "Type: str", "Default: 'Project name not set'", "", "",
                 "   The documented project's name.", "docname", "Type: str", "Value: None", "", "",
                 "Added in version 9.0: Something.", "Prefixes", '"Directive", "Option prefix"',
                 "See PEP 8, RFC 7231#section-4 and the style guide."]


def test_rst_inline_markup_across_the_lines_of_a_paragraph_keeps_each_line_in_its_place() -> None:
    """Prose wrapped at 79 columns splits roles, links and literals between lines (a third of the
    files of five real Sphinx sites); docutils reads markup per paragraph, so does the reader."""
    assert rst_searchable("""
        You can replace :meth:`Request.prepare()
        <requests.Request.prepare>` with a call to `Pygments
        <https://pygments.org>`_. When ``latex_engine
        = 'lualatex'`` and **the first
        line**::

            code ``stays
            as written``

        - an item whose :func:`text
          <x>` goes on
        - a new item, ``not
        joined`` to it
        """) == ["You can replace Request.prepare()", " with a call to Pygments https://pygments.org",
                 ". When latex_engine", "= 'lualatex' and the first", "line:", "", "    code ``stays",
                 "    as written``", "", "- an item whose text", " goes on", "- a new item, ``not", "joined`` to it"]


def test_rst_raw_math_and_where_a_long_directive_body_may_be_cut() -> None:
    """`raw` HTML shows its text, LaTeX nothing; math stays as written. A long glossary or table
    was cut mid-sentence (its first line the only block start): inside a block, a line after a
    blank line starts a block, the body right below a directive's line does not."""
    text = rst("""
        .. raw:: html

           <span id="x"></span><p>Shown &amp; <b>bold</b></p>
        .. raw:: latex

           \\addtocontents{toc}{x}
        .. math::

           \\alpha_i |x|
        .. glossary::

           environment
              A structure where information about all documents is saved.

           extension
              A custom role or directive.
        .. note:: The argument,
           and its next line.
        """)
    assert list(text.searchable[:9]) == ["", "", "   Shown & bold", "", "", "", "", "", "   \\alpha_i |x|"]
    starts = set(text.block_starts)
    assert {12, 15} <= starts, "each glossary entry after a blank line"
    assert 18 not in starts, "the line right below a directive continues it"


def test_rst_grid_tables_are_read_a_row_at_a_time() -> None:
    """A cell's sentence spread over a row's lines is one text, the row's cells on its first line
    (setuptools' API reference read `| version | The version number of the | a string |`)."""
    text = rst("""
        +---------+---------------------------+----------+
        | Arg     | Description               | Type     |
        +=========+===========================+==========+
        | version | The version number of the | a string |
        |         | package; see              |          |
        |         | :mod:`distutils.version`  |          |
        +---------+---------------------------+----------+
        | name    | The name                  | a string |
        +---------+---------------------------+----------+
        """)
    assert list(text.searchable) == [
        "", "Arg | Description | Type", "",
        "version | The version number of the package; see distutils.version | a string", "", "", "",
        "name | The name | a string", ""]
    assert {2, 4, 8} <= set(text.block_starts), "a long table may be cut between its rows"


def test_rst_docinfo_at_the_top_is_metadata_and_a_later_field_list_is_content() -> None:
    text = rst("""
        :lifecycle: superseded
        :orphan:

        Title
        =====

        :param x: the ``x``
        """)
    assert text.metadata == {"lifecycle": "superseded", "orphan": ""} and text.body_start == 4
    assert text.searchable[6] == "param x: the x" and text.block_starts[0] == 4


@pytest.mark.parametrize(("line", "shown"), [
    (":meth:`~flask.Flask.route`", "flask.Flask.route"),
    (":ref:`text <target>`", "text"),
    (":abbr:`LIFO (last-in, first-out)`", "LIFO (last-in, first-out)"),
    ("see `Flask <https://flask.palletsprojects.com>`_ now", "see Flask https://flask.palletsprojects.com now"),
    ("|name| and |ref|_, [1]_ gone", "name and ref,  gone"),
    ("unbalanced `tick, :func:`x and **bold", "unbalanced `tick, :func:`x and **bold"),
    ("snake_case __init__ 2 * 3 (*) a*b*c", "snake_case __init__ 2 * 3 (*) a*b*c"),
])
def test_rst_inline_markup(line: str, shown: str) -> None:
    assert rules.rst_inline(line) == shown


_RST_WORDS = st.sampled_from(["Flask", "config", "SECRET_KEY", ":func:`url_for`", "``code``", "*emph*", "word_",
                              "|sub|", "x::", "a*b", "`tick", "..", "--", ":ref:`wrapped", "<target>`", "``split",
                              "literal``"])


@st.composite
def rst_documents(draw: st.DrawFn, depth: int = 0) -> list[str]:
    def words() -> str:
        return " ".join(draw(st.lists(_RST_WORDS, min_size=1, max_size=5)))

    lines: list[str] = []
    if depth == 0 and draw(st.booleans()):
        lines += [":lifecycle: superseded", ""]
    for _ in range(draw(st.integers(1, 10 if depth == 0 else 3))):
        kind = draw(st.sampled_from(["title", "title", "para", "literal", "directive", "other", "list"]))
        if kind == "title" and depth == 0:
            text = draw(st.sampled_from(["Configuration", "API", "The app"])) if draw(st.booleans()) else words()
            char = draw(st.sampled_from(list("=-~^\"'`#*+")))
            width = max(1, len(text) + draw(st.sampled_from([0, 0, 3, -2])))
            title = [char * width] if draw(st.booleans()) else []
            lines += [*title, (" " if title and draw(st.booleans()) else "") + text, char * width]
        elif kind == "literal":
            lines += [words() + "::", "", "    Not a title", "    ===========", "    code"]
        elif kind == "directive" and depth < 2:
            name = draw(st.sampled_from(["note::", "code-block:: python", "toctree::", "py:data:: X", "tab:: Bash",
                                         "unknown:: arg"]))
            body = draw(rst_documents(depth + 1))
            lines += [".. " + name, "   :caption: c", "", *[("   " + b) if b.strip() else "" for b in body]]
        elif kind == "other":
            lines += draw(st.sampled_from([[".. a comment", "   body"], [".. _label:"], ["----------"],
                                           ["+-----+------+", "| a   | Flask |", "|     | word_ |", "+=====+======+"],
                                           ["=====  =====", "A      B", "=====  ====="]]))
        elif kind == "list":
            lines += ["- " + words(), "- " + words()]
        else:
            lines += [words(), words()]
        lines += [""] * draw(st.sampled_from([1, 1, 2, 0]))
    return lines


@HYPOTHESIS
@given(rst_documents(), st.integers(16, 200))
def test_rst_sections_agree_with_the_reference_and_chunks_cover_the_document(lines: list[str], budget: int) -> None:
    doc = rules.parse_document("\n".join(lines).encode(), "gen.rst")
    assert_model(doc.text)
    assert [(h.line, h.level) for h in doc.text.headings] == reference_rst_headings(lines)
    assert_chunked(doc, budget, budget // 4)


# ---------------------------------------------------------------------------
# Plain text (opt-in).


def test_plain_text_is_paragraphs_titled_by_the_first_line() -> None:
    text = read("""

        Release notes
        More about it.

        Second paragraph.
        """, "NOTES.txt")
    assert_model(text)
    assert text.title == "Release notes" and text.headings == () and text.block_starts == (1, 4)


# ---------------------------------------------------------------------------
# Any text, any format: read whole or refused as document_invalid, never another failure.

TEXT_FORMATS = [".md", ".mdx", ".rst", ".txt"] + [e for r in rules.READERS if r.format == "asciidoc" for e in r.extensions]


@HYPOTHESIS
@given(st.sampled_from(TEXT_FORMATS), st.text() | st.text(alphabet="#=-~:.`*_|<>/{}[]\\ \t\nab!+", max_size=400))
def test_any_text_is_read_into_the_model(extension: str, text: str) -> None:
    try:
        doc = rules.parse_document(text.encode("utf-8", "surrogatepass"), "any" + extension)
    except rules.RagError as exc:
        assert exc.code is rules.ErrorCode.DOCUMENT_INVALID
        return
    assert_model(doc.text)
    assert_chunked(doc, 64, 8)


# ---------------------------------------------------------------------------
# Hostile input: read whole, no recursion. What it costs is in tools/bench.py --readers.

HOSTILE: list[tuple[str, str, Callable[[], str]]] = [
    ("a 1 MB line of prose", ".rst", lambda: "word " * 200_000),
    ("a 1 MB line of backticks", ".rst", lambda: "`" * 1_000_000),
    ("10,000 unbalanced roles on a line", ".rst", lambda: "x `y :role:`z ``w **v " * 10_000),
    ("nested directives past the recursion limit", ".rst",
     lambda: "\n".join(" " * (3 * k) + ".. note:: level" for k in range(1_290))),
    ("100,000 comment lines", ".rst", lambda: "..\n" * 100_000),
    ("10,000 nested JSX tags", ".mdx", lambda: "\n".join([*(f"<Box{k} title='t'>" for k in range(10_000)), "# In",
                                                           *(f"</Box{k}>" for k in reversed(range(10_000)))])),
    ("a 1 MB line of JSX tags", ".mdx", lambda: '<Tab title="x">' * 70_000),
    ("an unterminated comment", ".mdx", lambda: "{/* " + "# not a heading\n" * 50_000),
    ("an unterminated expression", ".mdx", lambda: "{" * 200_000 + "\n# Heading\n"),
]


@pytest.mark.heavy  # hostile input whose size is the point: `pytest --all` only (tests/README.md)
@pytest.mark.parametrize(("extension", "make"), [(e, m) for _, e, m in HOSTILE], ids=[n for n, _, _ in HOSTILE])
def test_hostile_input_is_read_whole(extension: str, make: Callable[[], str]) -> None:
    raw = make().encode()
    limit = sys.getrecursionlimit()
    doc = rules.parse_document(raw, "hostile" + extension)
    assert sys.getrecursionlimit() == limit
    assert len(doc.text.searchable) == len(doc.lines) == len(rules.split_lines(raw.decode()))
    assert rules.chunk_document(doc, 512, 64, 1900) or not any(s.strip() for s in doc.text.searchable)
