"""The AsciiDoc reader (issue 40): an Antora page read line by line, Asciidoctor's rules one at a
time, hostile input read whole (what it costs is in tools/bench.py --readers), and properties of
generated documents checked against an independent reference for section titles."""

from __future__ import annotations

import re
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest
from budgets import examples
from hypothesis import given, settings
from hypothesis import strategies as st

import corpus_rules as rules
from corpus_rules import DocumentText as Reading
from corpus_rules import Heading, asciidoc_inline


def read_asciidoc(lines: Sequence[str]) -> Reading:
    """The reader on these lines, as ingest reads a file of them."""
    text = "".join(line + "\n" for line in lines)  # each line ends: split_lines gives back these lines
    return rules.read_asciidoc(text.encode("utf-8", "surrogatepass"), "page.adoc")


def read(text: str) -> Reading:
    return read_asciidoc(text.split("\n")[:-1] if text.endswith("\n") else text.split("\n"))


def line_of(lines: list[str], prefix: str) -> int:
    """1-based number of the first line starting with prefix."""
    return next(i for i, line in enumerate(lines, 1) if line.startswith(prefix))


# ---------------------------------------------------------------------------
# An Antora page, read whole.

ANTORA_PAGE = r"""// modules/ROOT/pages/playbook.adoc
= Configure the *Playbook*
Jane Doe <jane@example.org>
v2.3, 2024-05-01: Reworked
:description: How to configure an Antora playbook.
:page-aliases: playbook.adoc, old/playbook.adoc
:Lifecycle: superseded
:page-toclevels: 2 \
  with a continuation
:experimental:
:experimental!:
ifdef::env-github[]
:tip-caption: :bulb:
endif::[]

An Antora _playbook_ tells Antora where to find content.
See xref:ROOT:index.adoc[the overview] and <<keys,the keys>>.
== Not a title: this line goes on with the paragraph

[#keys]
== Playbook keys

.Required keys
[cols="1,2"]
|===
|Key |Description

|`site.title`
|The site's *title*.

2+|Spanning cell
a|
----
nested listing
----
|===

=== A source example

[source,yaml]
----
site:
  title: Docs # <1>
  url: https://example.org <2>
== not a title
----
<1> The site title.
<2> The URL.

NOTE: Use `antora -v` to check.

[TIP]
====
Nested example.

== Not a section
[discrete]
=== Discrete inside

-----
==== still code
-----
====

include::partial$footer.adoc[]

ifdef::env-site[]
Shown on the site.
endif::[]

// a comment
////
== Commented title
include::hidden.adoc[]
////

CPU:: the processor
RAM:: the memory

* Item one
** Nested item with a link:https://antora.org[Antora site]
+
[source,js]
----
console.log(1) // <1>
----
* Item two

image::diagram.png[Architecture diagram,600]

==== Deep section ====

[discrete]
===== Floating heading

[[anchor-x]]
## Markdown-style heading

= A part-level title

:body-attr: value
"""


@pytest.fixture(scope="module")
def page() -> tuple[list[str], Reading]:
    lines = ANTORA_PAGE.split("\n")[:-1]
    return lines, read_asciidoc(lines)


def test_antora_page_header(page: tuple[list[str], Reading]) -> None:
    lines, reading = page
    assert reading.title == "Configure the Playbook"
    assert reading.metadata == {
        "description": "How to configure an Antora playbook.",
        "page-aliases": "playbook.adoc, old/playbook.adoc",
        "lifecycle": "superseded",  # names are case-insensitive: Asciidoctor lowercases them
        "page-toclevels": "2 with a continuation",
        "tip-caption": ":bulb:",  # conditionals are not evaluated: what they enclose is read
    }
    assert reading.body_start == line_of(lines, "An Antora")
    assert reading.searchable[1] == ""  # the header is the document's title and keys, not its body
    assert all(text == "" for k, text in enumerate(reading.searchable[:reading.body_start - 1]) if k != 1)
    assert reading.warnings == ()
    assert len(reading.searchable) == len(lines)


def test_antora_page_headings(page: tuple[list[str], Reading]) -> None:
    lines, reading = page
    assert [(h.level, h.text) for h in reading.headings] == [
        (1, "Playbook keys"), (2, "A source example"), (3, "Deep section"), (4, "Floating heading"),
        (1, "Markdown-style heading"), (1, "A part-level title")]
    assert [h.line for h in reading.headings] == [
        line_of(lines, prefix) for prefix in ("== Playbook", "=== A source", "==== Deep", "===== Floating",
                                                       "## Markdown", "= A part")]


def test_antora_page_searchable(page: tuple[list[str], Reading]) -> None:
    lines, reading = page
    expected = {
        "An Antora": "An Antora playbook tells Antora where to find content.",
        "See xref": "See the overview and the keys.",
        "== Not a title:": "== Not a title: this line goes on with the paragraph",  # inside a paragraph: text
        "[#keys]": "",
        ".Required keys": "Required keys",
        '[cols="1,2"]': "",
        "|===": "",
        "|Key |Description": "Key Description",
        "|`site.title`": "site.title",
        "|The site's *title*.": "The site's title.",
        "2+|Spanning cell": "Spanning cell",
        "a|": "",
        "nested listing": "nested listing",
        "  title: Docs # <1>": "  title: Docs",  # code stays code, callouts go
        "  url: https://example.org <2>": "  url: https://example.org",
        "== not a title": "== not a title",
        "<1> The site title.": "The site title.",
        "NOTE: Use": "Note: Use antora -v to check.",
        "[TIP]": "",
        "== Not a section": "== Not a section",  # a title-shaped line inside a block is text
        "=== Discrete inside": "Discrete inside",
        "==== still code": "==== still code",
        "include::partial$footer.adoc[]": "",
        "ifdef::env-site[]": "",
        "Shown on the site.": "Shown on the site.",
        "// a comment": "",
        "== Commented title": "",
        "include::hidden.adoc[]": "",
        "CPU:: the processor": "CPU: the processor",
        "* Item one": "Item one",
        "** Nested item": "Nested item with a Antora site https://antora.org",
        "+": "",
        "console.log(1) // <1>": "console.log(1)",
        "image::diagram.png": "Architecture diagram",
        "==== Deep section ====": "Deep section",
        "[[anchor-x]]": "",
        ":body-attr: value": "",
    }
    for prefix, text in expected.items():
        assert reading.searchable[line_of(lines, prefix) - 1] == text, prefix


def test_antora_page_block_starts(page: tuple[list[str], Reading]) -> None:
    lines, reading = page
    starts = set(reading.block_starts)
    assert list(reading.block_starts) == sorted(starts)
    for prefix in ("An Antora", "[#keys]", "== Playbook keys", ".Required keys", "=== A source", "[source,yaml]",
                   "<1> The site", "<2> The URL", "NOTE:", "[TIP]", "include::partial", "Shown on the site",
                   "////", "CPU::", "RAM::", "* Item one", "** Nested", "[source,js]", "* Item two", "image::",
                   "[[anchor-x]]", "## Markdown", ":body-attr:"):
        assert line_of(lines, prefix) in starts, prefix
    for prefix in ("See xref", "== Not a title:", '[cols="1,2"]', "|===", "|Key", "2+|", "nested listing",
                   "site:", "----", "Nested example", "=== Discrete inside", "ifdef::env-site", "// a comment",
                   "== Commented", "console.log"):
        assert line_of(lines, prefix) not in starts, prefix
    assert all(heading.line in starts for heading in reading.headings)


# ---------------------------------------------------------------------------
# The header.


@pytest.mark.parametrize(("text", "title", "metadata", "body_start"), [
    ("Just a paragraph.\n", None, {}, 1),
    ("// only a comment\n\nText.\n", None, {}, 1),
    ("= Title\n\nText.\n", "Title", {}, 3),
    ("\n\n// leading comment\n= Title\n\nText.\n", "Title", {}, 6),
    ("# Markdown Title\n\nText.\n", "Markdown Title", {}, 3),
    ("= Title =\n\nText.\n", "Title", {}, 3),  # a symmetric title
    (":toc: left\n:page-role: home\n\nText.\n", None, {"toc": "left", "page-role": "home"}, 4),
    (":toc: left\n\n= Title\n:a: 1\n\nText.\n", "Title", {"toc": "left", "a": "1"}, 6),
    ("= T\nAuthor Name\nv1.0\n:a: b\n\nBody\n", "T", {"a": "b"}, 6),
    ("= T\n:a: b\nAuthor after attributes\n\nBody\n", "T", {"a": "b"}, 5),
    ("= T\n:a: 1\n:a!:\n:!b:\n:c:\n\nBody\n", "T", {"c": ""}, 7),  # unset removes, an empty value stays
    ("= T\n:long: one \\\n  two \\\n  three\n:next: x\n\nB\n", "T", {"long": "one two three", "next": "x"}, 7),
    ("= T\n:Some_Name.x: v\n\nB\n", "T", {"some_namex": "v"}, 4),  # Asciidoctor's sanitized name
    ("= T\n// comment\n:a: b\n////\nblock comment\n////\n:c: d\n\nB\n", "T", {"a": "b", "c": "d"}, 9),
    ("= T\nAuthor\nRevision\nFirst body line\n", "T", {}, 4),  # no blank line: the body starts right there
    ("= T\n", "T", {}, 2),
    ("= T\n\n", "T", {}, 3),
    ("= *Bold* `code` xref:a.adoc[Title]\n", "Bold code Title", {}, 2),
    ("== Not a doctitle\n\nText\n", None, {}, 1),
    # block attribute lines above (Antora's `[[id]]`) are the document's (parse_document_header)
    ("[[top]]\n[.lead]\n= Title\n:a: b\n\nB\n", "Title", {"a": "b"}, 6),
    (".Caption\n= Not a doctitle\n", None, {}, 1),  # a block title above: no header
])
def test_header(text: str, title: str | None, metadata: dict[str, str], body_start: int) -> None:
    reading = read(text)
    assert (reading.title, reading.metadata, reading.body_start) == (title, metadata, body_start)
    assert all(start >= reading.body_start for start in reading.block_starts)


def test_line_below_doctitle_is_the_author_line() -> None:
    # Asciidoctor reads any line right below the doctitle as its author: not a section.
    reading = read("= Title\n== Section\n\nText\n")
    assert reading.headings == ()
    assert reading.searchable == ("", "", "", "Text")  # the header is the title and keys, not the body


def test_empty_document() -> None:
    assert read_asciidoc([]) == Reading(lines=(), searchable=(), body_start=1, headings=(), block_starts=())


# ---------------------------------------------------------------------------
# Section titles.


@pytest.mark.parametrize(("line", "level", "text"), [
    ("== Level one", 1, "Level one"),
    ("=== Two", 2, "Two"),
    ("====== Five", 5, "Five"),
    ("## Markdown one", 1, "Markdown one"),
    ("###### Markdown five", 5, "Markdown five"),
    ("== Symmetric ==", 1, "Symmetric"),
    ("== Asymmetric ===", 1, "Asymmetric ==="),
    ("==\tTab", 1, "Tab"),
    ("== *Bold* and `code` [[id]]", 1, "Bold and code"),
    ("= Part in the body", 1, "Part in the body"),
    ("== ==", 1, "=="),
])
def test_section_titles(line: str, level: int, text: str) -> None:
    reading = read(f"Intro.\n\n{line}\n")
    assert reading.headings == (Heading(line=3, level=level, text=text),)
    assert reading.searchable[2] == text and 3 in reading.block_starts


@pytest.mark.parametrize("line", ["======= Seven", "==No space", "  == Indented", "#hashtag", "==", "== "])
def test_not_section_titles(line: str) -> None:
    assert read(f"Intro.\n\n{line}\n").headings == ()


def test_title_directly_below_a_paragraph_is_text() -> None:
    reading = read("A paragraph\n== Goes on\n* not a list either\n\n== Title\n")
    assert [h.line for h in reading.headings] == [5]
    assert reading.searchable[1:3] == ("== Goes on", "* not a list either")


def test_title_after_metadata_and_directives() -> None:
    reading = read("Para.\n\n[[id]]\n[appendix]\nifdef::x[]\n== Appendix\nendif::[]\n.Title\n== Next\n")
    assert [(h.line, h.text) for h in reading.headings] == [(6, "Appendix"), (9, "Next")]
    assert {3, 6, 8, 9} <= set(reading.block_starts)


def test_discrete_heading_is_a_heading_outside_blocks_only() -> None:
    reading = read("[discrete]\n== Floating\n\n====\n[discrete]\n== Inside\n====\n")
    assert reading.headings == (Heading(line=2, level=1, text="Floating"),)
    assert reading.searchable[5] == "Inside"


# ---------------------------------------------------------------------------
# Delimited blocks.


def test_nested_blocks_need_different_delimiters() -> None:
    lines = ["====", "outer", "=====", "== inner text", "=====", "after inner", "====", "", "== Out"]
    reading = read_asciidoc(lines)
    assert reading.headings == (Heading(line=9, level=1, text="Out"),)
    assert reading.block_starts == (1, 9)
    assert reading.searchable == ("", "outer", "", "== inner text", "", "after inner", "", "", "Out")


def test_two_line_titles_as_gits_manual_pages_write_them() -> None:
    """Asciidoctor reads a line underlined by `=`, `-`, `~`, `^` or `+` of about its length as a
    title (its default, `underline_style_section_titles`): git's 944 pages are written so, and
    read as listing blocks that never closed they were 88k lines of code and no headings."""
    reading = read(textwrap.dedent("""\
        git-add(1)
        ==========

        NAME
        ----
        git-add - Add file contents to the index

        OPTIONS
        -------
        Text.

        ----
        a listing, not a title
        ----

        Sub part
        ~~~~~~~~
        .A block title
        --------------
        code
        --------------
        """))
    assert reading.title == "git-add(1)" and reading.warnings == ()
    assert [(h.line, h.level, h.text) for h in reading.headings] == [(4, 1, "NAME"), (8, 1, "OPTIONS"), (16, 2, "Sub part")]
    assert reading.searchable[4] == "" and reading.searchable[12] == "a listing, not a title"


def test_block_ends_at_first_line_equal_to_its_delimiter() -> None:
    # Asciidoctor reads an example block's content up to its first "====", even one inside a listing.
    lines = ["====", "----", "====", "after it", "----", "== Title"]  # ("after" would be a two-line title)
    reading = read_asciidoc(lines)
    assert reading.searchable[3] == "after it"
    assert reading.block_starts == (1, 4, 5)  # the second "----" opens a new listing, unclosed
    assert reading.headings == ()
    assert reading.warnings == ("page.adoc: line 5: the delimited block opened here is never closed (no line '----'): "
                                "it runs to the end of the file",)


def test_verbatim_blocks_hold_no_structure() -> None:
    text = "....\n== a\n* b\n[source]\n// c\n....\n```ruby\n== d\n```\n++++\n<b>*x*</b>\n++++\n"
    reading = read(text)
    assert reading.headings == ()
    assert reading.searchable == ("", "== a", "* b", "[source]", "// c", "", "", "== d", "", "", "<b>*x*</b>", "")
    assert reading.block_starts == (1, 7, 10)


@pytest.mark.parametrize(("code", "kept"), [
    ("x = 1 <1>", "x = 1"),
    ("x = 1 // <1> <2>", "x = 1"),
    ("x = 1 # <.>", "x = 1"),
    ("<tag/> <!--1-->", "<tag/>"),
    ("a -- <3>", "a"),
    ("escaped \\<1>", "escaped \\<1>"),
    ("List<String> items", "List<String> items"),
    ("<div>", "<div>"),
])
def test_callouts_leave_code(code: str, kept: str) -> None:
    assert read(f"[source]\n----\n{code}\n----\n").searchable[2] == kept


def test_fence_is_three_backticks_exactly() -> None:
    reading = read("````\n== Title\n````\n")
    assert [h.line for h in reading.headings] == []  # "````" is a paragraph, the title goes on with it
    assert reading.searchable[1] == "== Title"


def test_comment_block_hides_everything() -> None:
    reading = read("////\n== T\ninclude::x[]\nifdef::y[]\n////\nText\n")
    assert reading.searchable == ("", "", "", "", "", "Text")
    assert reading.headings == () and reading.block_starts == (1, 6)


def test_styles_change_what_a_block_holds() -> None:
    text = ("[source,python]\n--\nx = *1*  # <1>\n--\n\n[comment]\n--\nhidden\n--\n\n[verse]\n____\n*Roses*\n== red\n____\n"
            "\n[source]\nprint(*a*)\n\n[comment]\nnot shown\n\n[NOTE]\nAn *admonition*.\n")
    reading = read(text)
    shown = [s for s in reading.searchable if s]
    assert shown == ["x = *1*", "Roses", "== red", "print(*a*)", "Note: An admonition."]


def test_unclosed_blocks_run_to_the_end() -> None:
    reading = read("Text\n\n----\n== code\n\n== more code\n")
    assert reading.headings == ()
    assert reading.searchable[3] == "== code" and reading.block_starts == (1, 3)
    assert reading.warnings and reading.warnings[0].startswith("page.adoc: line 3:")


def test_tables() -> None:
    text = ('[cols="1,1"]\n|===\n|Name |Value\n\n|a |b\n2+^.^|Spanning *cell*\n'
            "|escaped \\| bar |x\n|cell going\non\n"
            "a|\n!===\n!inner !cell\n!===\n|===\n\n,===\nx,y\n,===\n")
    reading = read(text)
    assert reading.searchable == ("", "", "Name Value", "", "a b", "Spanning cell", "escaped | bar x", "cell going",
                                  "on", "", "", "inner cell", "", "", "", "", "x y", "")
    assert reading.block_starts == (1, 16)


# ---------------------------------------------------------------------------
# Searchable text of block-level lines.


def test_attribute_references_extension_macros_and_what_real_antora_pages_show() -> None:
    """What Spring Boot's, Couchbase's and Asciidoctor's own Antora pages showed: `{name}` defined in
    the document (or built in) shows its value, an undefined one starting a link shows the link's
    text; an extension's macro (javadoc:, configprop:) its text or target; `[default]` inside
    backticks is text, not a role list; character references are the characters."""
    text = read(textwrap.dedent("""\
        [[features.x]]
        = {sqlpp} versus SQL
        :sqlpp: SQL++
        :ref: xref:n1ql:reference/index.adoc

        {sqlpp} reads {ref}[the {sqlpp} reference] and {url-site}/docs[the docs^].
        *[{nbsp}]* &#8212; javadoc:org.x.FailureAnalyzer[] and configprop:server.port[] or javadoc:a.B[the B].
        (by default, `[default]`) and `-r [root]` but [.role]#styled# and [.big]##big##.
        image:icons/no_entry.png[] {unknown} stays.

        == Using {sqlpp}
        """))
    assert text.title == "SQL++ versus SQL" and [h.text for h in text.headings] == ["Using SQL++"]
    assert text.searchable[5:9] == (
        "SQL++ reads the SQL++ reference and the docs.",
        "[ ] — org.x.FailureAnalyzer and server.port or the B.",
        "(by default, [default]) and -r [root] but styled and big.",
        "no entry {unknown} stays.")


@pytest.mark.parametrize(("line", "text"), [
    ("TIP: Try `this`.", "Tip: Try this."),
    ("WARNING: Careful", "Warning: Careful"),
    ("CAUTION: Hot", "Caution: Hot"),
    ("IMPORTANT: Read", "Important: Read"),
    ("NOTE:no space", "NOTE:no space"),
    (".A block title", "A block title"),
    ("..Dotted title", ".Dotted title"),
    (". An ordered item", "An ordered item"),
    ("1. Numbered", "Numbered"),
    ("- Dash item", "Dash item"),
    ("*** Deep item", "Deep item"),
    ("<1> Callout text", "Callout text"),
    ("CPU:: the processor", "CPU: the processor"),
    ("Term;; text", "Term: text"),
    ("Term:::", "Term"),
    ("image::a.png[]", "a"),  # no alt: Asciidoctor makes it from the file name
    ("image::img/arch_overview-2.svg[]", "arch overview 2"),
    ("image::a.png[\"Alt, with comma\",300]", "Alt, with comma"),
    ("video::id[youtube]", ""),
    ("toc::[]", ""),
    ("'''", ""),
    ("<<<", ""),
    ("* * *", ""),
    ("[NOTE]", ""),
    ("[quote, Abraham Lincoln]", ""),
    ("[#id.role]", ""),
    ("[[id,Reference text]]", ""),
    (":name: value", ""),
    ("// comment", ""),
    ("///not a comment", "///not a comment"),
    ("ifndef::a,b[]", ""),
    ("ifeval::[{x} > 1]", ""),
    ("endif::a[]", ""),
    ("include::{partialsdir}/a.adoc[tag=x]", ""),
    ("\\include::not-a-directive.adoc[]", "include::not-a-directive.adoc[]"),
    ("  indented literal *text*", "  indented literal *text*"),
    ("Hard line break +", "Hard line break"),
    ("+", ""),
    ("   ", ""),
])
def test_line_text(line: str, text: str) -> None:
    assert read(f"First.\n\n{line}\n").searchable[2] == text


def test_attribute_entry_continuation_in_body() -> None:
    reading = read("Text.\n\n:a: one \\\n two \\\n three\nNext paragraph\n")
    assert reading.searchable == ("Text.", "", "", "", "", "Next paragraph")
    assert reading.block_starts == (1, 3, 6)


# ---------------------------------------------------------------------------
# Block starts.


def test_block_starts() -> None:
    text = ("Para one\ngoes on\n\n* item\n* item two\ncontinued\n\n. first\n\nPara\n* not an item\n\n"
            ".Title\n[source]\n----\ncode\n----\n\n[NOTE]\n\nText after a blank\n\ninclude::a[]\ninclude::b[]\n")
    reading = read(text)
    assert reading.block_starts == (1, 4, 5, 8, 10, 13, 19, 23, 24)


def test_list_items_after_an_attached_block_are_starts() -> None:
    reading = read("* one\n+\nattached paragraph\n* two\n")
    assert reading.block_starts == (1, 3, 4)
    assert reading.searchable == ("one", "", "attached paragraph", "two")


# ---------------------------------------------------------------------------
# Inline markup.


@pytest.mark.parametrize(("text", "reduced"), [
    ("*bold* _italic_ `mono` #mark# x^2^ H~2~O", "bold italic mono mark x2 H2O"),
    ("**un**con __str__ained ``mo``no ##ma##rk", "uncon strained mono mark"),
    ("link:https://antora.org[Antora site]", "Antora site https://antora.org"),
    ("https://example.org/a_b_[the docs^]", "the docs https://example.org/a_b_"),
    ("link:https://x.org[text,window=_blank]", "text https://x.org"),
    ('link:https://x.org["text, with comma",role=ext]', "text, with comma https://x.org"),
    ("https://example.org[]", "https://example.org"),
    ("mailto:team@example.org[Write us]", "Write us team@example.org"),
    ("see xref:ROOT:install.adoc#linux[Install on Linux].", "see Install on Linux."),
    ("xref:install.adoc[]", "install.adoc"),
    ("<<section-id,the section>> and <<other>>", "the section and other"),
    ("kbd:[Ctrl+C] then btn:[OK]", "Ctrl+C then OK"),
    ("menu:File[Save As]", "File > Save As"),
    ("text footnote:[The note.] more", "text The note. more"),
    ("pass:[<u>*x*</u>] and +*literal*+ and +++<b>raw</b>+++", "<u>*x*</u> and *literal* and <b>raw</b>"),
    ("the {product-name} version {version}", "the {product-name} version {version}"),
    ("\\{not-an-attribute}", "{not-an-attribute}"),
    ("before anchor:here[] [[there]]after [[[bib]]] ref", "before  after [bib] ref"),
    ("\\*not bold* and \\_not italic_", "*not bold* and _not italic_"),
    ("\\xref:a.adoc[kept]", "xref:a.adoc[kept]"),
    ("\\https://x.org[kept]", "https://x.org[kept]"),
    ("[.role]#styled# [.big]*bold*", "styled bold"),
    ("image:icon.png[An icon,16] icon:heart[2x]", "An icon "),
    ("stem:[sqrt(4) = 2]", "sqrt(4) = 2"),
    ("((term)) and (((hidden,term)))", "term and "),
    ("snake_case_word and __init__", "snake_case_word and init"),
    ("Issue #123 and #456", "Issue #123 and #456"),
    ("unbalanced * ` [ ** __ << ]] ((", "unbalanced * ` [ ** __ << ]] (("),
    ("a *b `c _d", "a *b `c _d"),
    ("*bold with `mono` inside*", "bold with mono inside"),
    ("_link:https://x.org[emphasised link]_", "emphasised link https://x.org"),
    ("_https://x.org[not a link]_", "https://x.org[not a link]"),  # a URL needs a space or bracket before it
    ("", ""),
])
def test_inline(text: str, reduced: str) -> None:
    assert asciidoc_inline(text) == reduced


def test_text_lines_use_the_inline_reduction() -> None:
    line = "A *bold* xref:a.adoc[link] with {attr} and kbd:[Ctrl+C]"
    assert read(f"{line}\n").searchable == (asciidoc_inline(line),)


# ---------------------------------------------------------------------------
# Hostile input: each case alone, read whole.


def timed(name: str, run: Callable[[], object]) -> object:
    """`run`, which must finish (a quadratic reader would not, in a test run's time)."""
    return run()


@pytest.mark.heavy  # hostile input whose size is the point: `pytest --all` only (tests/README.md)
@pytest.mark.parametrize("unit", ["word ", "*", "`", "[", "_b ", "a*", "+a", "#", "((", "<<", "xref:", "https://",
                                  "link:x[", "[[a,", "pass:[", "kbd:[", "\\*", "++", "+++a", ":: ", "<1>", "|a ",
                                  "*`[_#^~+<>(:\\ ", "{a}", "{a}/", "{a}[", "abc:x.", "abc:x.[", "{nbsp}"])
def test_one_megabyte_line(unit: str) -> None:
    line = unit * (1_000_000 // len(unit)) + "x[y]"  # a bracket at the end: a macro's or a link's text
    for where, context in (("as text", [line]), ("in a listing", ["----", line, "----"]),
                           ("in a table", ["|===", line, "|==="])):
        reading = timed(f"1 MB line of {unit!r} {where}", lambda c=context: read_asciidoc(c))
        assert isinstance(reading, Reading) and len(reading.searchable) == len(context)


@pytest.mark.heavy  # hostile input whose size is the point: `pytest --all` only (tests/README.md)
def test_ten_thousand_nested_blocks() -> None:
    depth = 10_000
    lines = ["=" * (4 + k) for k in range(depth)] + ["text"] + ["=" * (4 + k) for k in reversed(range(depth))]
    lines += ["", "== After"]
    reading = timed("10,000 nested example blocks", lambda: read_asciidoc(lines))
    assert isinstance(reading, Reading)
    assert reading.headings == (Heading(line=len(lines), level=1, text="After"),)
    assert reading.block_starts == (1, len(lines))
    assert reading.searchable[depth] == "text" and reading.warnings == ()
    mixed = [char * (4 + k // 4) for k, char in zip(range(depth), "=*_-" * depth, strict=False)]
    unclosed = timed("10,000 unclosed mixed blocks", lambda: read_asciidoc(mixed + ["== Not a title"]))
    assert isinstance(unclosed, Reading) and unclosed.headings == () and len(unclosed.warnings) == 1


@pytest.mark.heavy  # hostile input whose size is the point: `pytest --all` only (tests/README.md)
def test_hundred_thousand_section_titles() -> None:
    lines = [f"{'=' * (2 + k % 5)} Title {k}" for k in range(100_000)]
    reading = timed("100,000 section titles", lambda: read_asciidoc(lines))
    assert isinstance(reading, Reading) and len(reading.headings) == 100_000
    assert reading.block_starts == tuple(range(1, 100_001))


def test_ten_thousand_unbalanced_markup_characters() -> None:
    for char in "*`[":
        line = char * 10_000
        assert timed(f"10,000 unbalanced {char!r}", lambda ln=line: asciidoc_inline(ln)) == line
    mixed = "*`[_#<<((" * 10_000
    reading = timed("10,000 of each unbalanced markup run", lambda: read_asciidoc([mixed]))
    assert isinstance(reading, Reading)


def test_hundred_thousand_includes() -> None:
    lines = [f"include::partial$part-{k}.adoc[leveloffset=+1]" for k in range(100_000)]
    reading = timed("100,000 include:: lines", lambda: read_asciidoc(lines))
    assert isinstance(reading, Reading)
    assert set(reading.searchable) == {""} and reading.block_starts == tuple(range(1, 100_001))


def test_ten_thousand_conditionals_without_endif() -> None:
    lines = [line for k in range(10_000) for line in (f"ifdef::attr-{k}[]", f"Text {k}")]
    reading = timed("10,000 ifdef:: without endif::", lambda: read_asciidoc(lines))
    assert isinstance(reading, Reading)
    assert reading.searchable[1::2] == tuple(f"Text {k}" for k in range(10_000))
    assert reading.block_starts == (2,)  # one paragraph: the directives are invisible to it


# ---------------------------------------------------------------------------
# An independent reference for section titles: two passes, Asciidoctor's forward search for a
# block's closing line, then a paragraph flag over the lines outside blocks.

REF_DELIMITER = re.compile(r"--|-{4,}|\.{4,}|={4,}|\*{4,}|_{4,}|\+{4,}|/{4,}|[|!,:]={3,}|```(?!`).*")
REF_DIRECTIVE = re.compile(r"include::[^\s\[](?:[^\[]*[^\s\[])?\[.*\]|(?:ifdef|ifndef|ifeval|endif)::\S*?\[.*\]")
REF_ATTRIBUTE_LINE = re.compile(r"\[(?:|[\w.#%{,\"'].*|\[(?:|(?:[^\W\d]|:)[\w:.-]*(?:, *.+)?)\])\]")
REF_COMMENT = re.compile(r"//(?!/).*")
REF_ATX = re.compile(r"(={1,6}|#{1,6})[ \t]+[^ \t].*")
REF_ONE_LINE_BLOCKS = (re.compile(r"\.\.?[^ \t.].*"), re.compile(r":!?\w[^:]*:(?:[ \t].*)?"),
                       re.compile(r"\w[\w-]*::(?:|\S|\S.*?\S)\[.*\]"), re.compile(r"'{3,}|<{3,}|([-*_])( *)\1\2\1"))


REF_SETEXT = re.compile(r"(?!\.).*[^\W_].*")  # Asciidoctor's SetextSectionTitleRx
REF_UNDERLINES = {"=": 0, "-": 1, "~": 2, "^": 3, "+": 4}


def reference_setext(line: str, underline: str) -> int | None:
    """A two-line title's level (setext_section_title?), from its documented rule."""
    if underline and underline[0] in REF_UNDERLINES and set(underline) == {underline[0]} \
            and abs(len(line) - len(underline)) < 2 and REF_SETEXT.fullmatch(line):
        return REF_UNDERLINES[underline[0]]
    return None


def reference_sections(raw: list[str], body_start: int) -> tuple[list[tuple[int, int]], list[bool]]:
    """(line, level) of every section title, and which lines belong to a top-level delimited block
    (delimiters included): Asciidoctor's forward search for a block's closing line, a paragraph
    flag over the lines outside blocks, and at a block boundary a title before anything else (a
    line underlined as a two-line title is not a delimiter)."""
    lines = [line.rstrip(" \t\v\f\r\x00") for line in raw]  # Ruby's rstrip, as Asciidoctor reads lines
    inside = [False] * len(lines)
    titles, in_paragraph = [], False
    k = body_start - 1
    while k < len(lines):
        line = lines[k]
        if REF_DIRECTIVE.fullmatch(line) or REF_COMMENT.fullmatch(line):
            k += 1
            continue
        if not in_paragraph and (match := REF_ATX.fullmatch(line)):
            titles.append((k + 1, max(1, len(match[1]) - 1)))
        elif (not in_paragraph and k + 1 < len(lines) and line != "+" and not REF_ATTRIBUTE_LINE.fullmatch(line)
              and not REF_ONE_LINE_BLOCKS[1].fullmatch(line)
              and (level := reference_setext(line, lines[k + 1])) is not None):
            titles.append((k + 1, max(1, level)))
            k += 2
            continue
        elif REF_DELIMITER.fullmatch(line):
            closing = "```" if line.startswith("```") else line
            end = next((j for j in range(k + 1, len(lines)) if lines[j] == closing), len(lines))
            inside[k:end + 1] = [True] * (min(end + 1, len(lines)) - k)
            k, in_paragraph = end + 1, False
            continue
        elif not line or line == "+" or REF_ATTRIBUTE_LINE.fullmatch(line):
            in_paragraph = False
        elif not in_paragraph:
            in_paragraph = not any(block.fullmatch(line) for block in REF_ONE_LINE_BLOCKS)
        k += 1
    return titles, inside


# ---------------------------------------------------------------------------
# Generated documents: realistic pieces, each line labelled with what it must read as.


@dataclass(frozen=True)
class Line:
    text: str
    role: str  # content, title, empty (must read as ""), free (no expectation)
    inside: bool = False  # within a delimited block (delimiters included)
    level: int = 0  # a title's level
    opening: bool = False  # the opening delimiter of a top-level block (may be a block start)


WORDS = ["alpha", "Beta", "gamma", "delta", "*bold*", "_emphasis_", "`code`", "{version}", "xref:guide.adoc[Guide]",
         "link:https://example.org[site]", "<<intro,Intro>>", "kbd:[Ctrl+C]", "footnote:[a note]", "#mark#", "H~2~O",
         "C++", "see:"]
CODE = ["print(1)", "x = 1 # <1>", "== not a title", "* not a list", "NOTE: not an admonition", "// kept in code",
        "[source]", ".not a title", "  indented()"]
words = st.lists(st.sampled_from(WORDS), min_size=1, max_size=6).map(" ".join)
plain = st.lists(st.sampled_from(["alpha", "Beta", "gamma", "delta"]), min_size=1, max_size=4).map(" ".join)


def content(text: str, inside: bool = False) -> Line:
    return Line(text, "content", inside)


def empty(text: str, inside: bool = False) -> Line:
    return Line(text, "empty", inside)


def delimiter(text: str, nested: bool) -> Line:
    return Line(text, "empty", True, opening=not nested)


@st.composite
def paragraph(draw: st.DrawFn, inside: bool = False) -> list[Line]:
    return [content(draw(words), inside) for _ in range(draw(st.integers(1, 3)))]


@st.composite
def section_title(draw: st.DrawFn) -> list[Line]:
    marks = draw(st.sampled_from(["==", "===", "====", "=====", "======", "##", "###", "="]))
    lead = draw(st.sampled_from([[], [empty("[[sec-id]]")], [empty("[discrete]")], [empty("[#id.role]")]]))
    if draw(st.integers(0, 3)) == 0:  # a two-line title, as git's manual pages write them
        text, char = draw(words), draw(st.sampled_from("=-~^+"))
        underline = char * max(1, len(text) + draw(st.sampled_from([-1, 0, 1])))
        return [*lead, Line(text, "title", level=max(1, "=-~^+".index(char))), Line(underline, "empty")]
    closing = f" {marks}" if draw(st.booleans()) and marks[0] == "=" else ""
    return [*lead, Line(f"{marks} {draw(words)}{closing}", "title", level=max(1, len(marks) - 1))]


@st.composite
def listing(draw: st.DrawFn, inside: bool = False) -> list[Line]:
    opening = draw(st.sampled_from(["----", "-----", "....", "```", "```python"]))
    closing = "```" if opening.startswith("```") else opening
    lead = draw(st.sampled_from([[], [empty("[source,python]", inside)], [content(".Example", inside)]]))
    body = [content(draw(st.sampled_from(CODE)), True) for _ in range(draw(st.integers(0, 4)))]
    if draw(st.booleans()):
        body.insert(0, empty(draw(st.sampled_from(["include::example$a.py[tag=x]", "ifdef::x[]", "endif::[]"])), True))
    return [*lead, delimiter(opening, inside), *body, empty(closing, True)]


@st.composite
def compound(draw: st.DrawFn, depth: int = 0) -> list[Line]:
    char = draw(st.sampled_from("=*_-"))
    fence = "--" if char == "-" else char * (4 + depth)
    inner: list[Line] = []
    for _ in range(draw(st.integers(1, 3))):
        kinds = [paragraph(inside=True), listing(inside=True),
                 st.builds(lambda w: [content(f"== {w}", True)], plain),
                 st.just([empty("// inner comment", True)])]
        if depth < 2 and char != "-":
            kinds += [compound(depth + 1)] * 2
        inner += [*draw(st.one_of(kinds)), empty("", True)]
    lead = draw(st.sampled_from([[], [empty("[NOTE]")], [empty("[sidebar]")]])) if depth == 0 else []
    return [*lead, delimiter(fence, depth > 0), *inner, empty(fence, True)]


@st.composite
def body_piece(draw: st.DrawFn) -> list[Line]:
    return draw(st.one_of(
        paragraph(), section_title(), section_title(), section_title(), listing(), compound(), compound(),
        st.builds(lambda w: [content(f"NOTE: {w}")], words),
        st.lists(st.tuples(st.sampled_from(["*", "**", ".", "-", "1.", "<1>"]), words), min_size=1, max_size=3)
        .map(lambda items: [content(f"{marker} {text}") for marker, text in items]),
        st.lists(plain, min_size=1, max_size=3).map(lambda terms: [content(f"{t}:: {t}") for t in terms]),
        st.builds(lambda w: [delimiter("////", False), Line(f"== {w}", "empty", True), empty("include::x.adoc[]", True),
                             empty("////", True)], plain),
        st.builds(lambda w: [empty(f"// {w}")], words),
        st.builds(lambda w: [Line(f":attr-{w.split()[0]}: {w}", "free")], plain),
        st.just([empty("include::partial$footer.adoc[]")]),
        st.builds(lambda p: [empty("ifdef::env-site[]"), *p, empty("endif::[]")], paragraph()),
        st.builds(lambda w: [content(f"image::diagram.png[{w}]")], plain),
        st.builds(lambda w: [content(f".{w}"), *[content(x) for x in ["First line", "second line"]]], plain),
        st.builds(lambda w: [content(f"  literal {w}")], words),
        st.builds(lambda a, b: [delimiter("|===", False), content(f"|{a} |{b}", True), empty("", True),
                                content(f"a|{b}", True), empty("|===", True)], plain, plain),
    ))


@dataclass(frozen=True)
class Generated:
    lines: list[Line]
    body_start: int
    title: str | None
    metadata: dict[str, str]
    blank_separated: bool  # every piece of the body is set off by a blank line


@st.composite
def header(draw: st.DrawFn) -> tuple[list[str], str | None, dict[str, str]]:
    lines = list(draw(st.sampled_from([[], ["// generated page"]])))
    title = draw(st.none() | words)
    if title is not None:
        lines.append(f"= {title}")
        lines += draw(st.sampled_from([[], ["Ada Lovelace <ada@example.org>"],
                                       ["Ada Lovelace", "v1.0, 2024-01-01: First"]]))
    metadata: dict[str, str] = {}
    for name in draw(st.lists(st.sampled_from(["lifecycle", "description", "Page-Aliases", "toc"]), max_size=5)):
        form = draw(st.sampled_from(["set", "continued", "unset-after", "unset-before", "directive"]))
        value = draw(plain)
        key = name.lower()
        if form == "set":
            lines.append(f":{name}: {value}")
            metadata[key] = value
        elif form == "continued":
            lines += [f":{name}: {value} \\", f"  {value}"]
            metadata[key] = f"{value} {value}"
        elif form == "directive":
            lines += ["ifdef::env-site[]", f":{name}: {value}", "endif::[]"]
            metadata[key] = value
        else:
            lines.append(f":{name}!:" if form == "unset-after" else f":!{name}:")
            metadata.pop(key, None)
    if title is None and not any(line.startswith(":") for line in lines):
        return [], None, {}  # no header at all: leading comments belong to the body
    return lines, (asciidoc_inline(title).strip() or None) if title is not None else None, metadata


@st.composite
def documents(draw: st.DrawFn) -> Generated:
    head, title, metadata = draw(header())
    lines = [Line(text, "content" if text.startswith("= ") else "empty") for text in head]
    lines += [Line("", "empty")] if head else []
    pieces = [draw(paragraph())] + draw(st.lists(body_piece(), max_size=10))
    blank_separated = True
    for k, piece in enumerate(pieces):
        # Pieces may touch, but not so that a line and the next piece's first line make a two-line
        # title (`alpha` over `----`): this generator's labels say what each piece is alone.
        two_line_title = len(piece) > 1 and piece[-2].role == "title" and not piece[-2].text.startswith(("=", "#"))
        if k and draw(st.integers(0, 5)) == 0 and reference_setext(lines[-1].text, piece[0].text) is None \
                and not two_line_title:  # (a title only at a block's start: below a paragraph's line it is text)
            blank_separated = False
        elif k:
            lines.append(Line("", "empty"))
        lines += piece
    return Generated(lines, len(head) + 2 if head else 1, title, metadata, blank_separated)


def check_invariants(lines: list[str], reading: Reading) -> None:
    assert len(reading.searchable) == len(lines)
    assert list(reading.block_starts) == sorted(set(reading.block_starts))
    assert all(reading.body_start <= start <= len(lines) for start in reading.block_starts)
    assert all(heading.line in reading.block_starts for heading in reading.headings)
    assert [h.line for h in reading.headings] == sorted(h.line for h in reading.headings)
    assert all(1 <= heading.level <= 5 for heading in reading.headings)
    assert 1 <= reading.body_start <= len(lines) + 1


@settings(max_examples=examples(300), deadline=None)
@given(documents())
def test_generated_documents(doc: Generated) -> None:
    lines = [line.text for line in doc.lines]
    reading = read_asciidoc(lines)
    check_invariants(lines, reading)
    assert (reading.body_start, reading.title, reading.metadata) == (doc.body_start, doc.title, doc.metadata)
    for number, (line, text) in enumerate(zip(doc.lines, reading.searchable, strict=True), 1):
        if line.role == "content" and number >= reading.body_start:  # the header is the title and keys
            assert text, (number, line)
        elif line.role == "empty":
            assert text == "", (number, line)
        if line.inside and not line.opening:
            assert number not in reading.block_starts, (number, line)
    heading_lines = {h.line for h in reading.headings}
    assert not any(doc.lines[n - 1].inside for n in heading_lines)
    titles, inside = reference_sections(lines, reading.body_start)
    assert [(h.line, h.level) for h in reading.headings] == titles
    assert not any(inside[n - 1] for n in heading_lines)
    if doc.blank_separated:
        expected = [(n, line.level) for n, line in enumerate(doc.lines, 1)
                    if line.role == "title" and n >= doc.body_start]
        assert [(h.line, h.level) for h in reading.headings] == expected


# What a file the reader is handed can hold: UTF-8 text without NUL (such a file is refused as binary).
TEXT = st.characters(exclude_categories=("Cs",), exclude_characters="\x00")
SOUP = ["", "== Title", "=== Sub", "= Part", "## Md", "======= seven", "==NoSpace", "== Sym ==", "----", "-----",
        "....", "====", "=====", "****", "____", "--", "++++", "////", "|===", "!===", "```", "```ruby", "````",
        "text line", "*bold* text", "* item", ". item", "term:: def", "<1> callout", "NOTE: note", "[source,ruby]",
        "[discrete]", "[comment]", "[verse]", "[[anchor]]", "[#id]", ".Block title", ":attr: value", "// comment",
        "///not comment", "+", "include::x.adoc[]", "ifdef::x[]", "endif::[]", "\\include::x[]", "image::a.png[Alt]",
        "'''", "<<<", "  indented", "|a |b", "a|", "2+|x", "#hash", "xref:a[b] <<c>> `d` [[e]]"]


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(st.sampled_from(SOUP) | st.text(TEXT, max_size=12), max_size=40))
def test_line_soup_agrees_with_the_reference(lines: list[str]) -> None:
    lines = [line.replace("\n", " ") for line in lines]
    reading = read_asciidoc(lines)
    check_invariants(lines, reading)
    if not any(line.rstrip().endswith(" \\") for line in lines):  # the reference reads no continued entries
        titles, inside = reference_sections(lines, reading.body_start)
        assert [(h.line, h.level) for h in reading.headings] == titles


@settings(max_examples=examples(300), deadline=None)
@given(st.text(TEXT))
def test_arbitrary_text_never_raises(text: str) -> None:
    lines = text.split("\n")
    check_invariants(lines, read_asciidoc(lines))


@settings(max_examples=examples(500), deadline=None)
@given(st.text(alphabet=st.sampled_from(list("*_`#^~+[]<>():,\\!=|.- ab1\x00")) | st.characters(), max_size=60))
def test_inline_is_total_and_never_longer(text: str) -> None:
    reduced = asciidoc_inline(text)
    assert len(reduced) <= len(text)
    assert "\x01" not in reduced or "\x01" in text  # every held text is put back
