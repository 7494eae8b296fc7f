"""PDFs the tests build as they run (no binary file is committed).

Well-formed ones are written with pypdf's PdfWriter: text drawn with BT/Tf/Td/Tj in the standard
Type1 font Helvetica, as a typesetter writes it (a two-column page column by column). Hostile ones
are assembled byte by byte, since no writer produces a cyclic xref or a page tree that contains
itself; each is small on disk whatever it expands to.
"""

from __future__ import annotations

import io
import random
import struct
import zlib
from collections.abc import Iterable, Sequence

from pypdf import PageObject, PdfWriter
from pypdf.generic import (
    ContentStream,
    DecodedStreamObject,
    DictionaryObject,
    IndirectObject,
    NameObject,
    NumberObject,
)

BOOK_TITLE = "The Harbour Pilot Handbook"
BOOK_METADATA = {"Author": "Port Authority", "Subject": "Pilotage", "Keywords": "harbour, pilots, tugs",
                 "lifecycle": "superseded"}
# One sentence on each page of book_pdf() that has text, by physical page (page 2 has none).
BOOK_SENTENCES = {
    1: "Cover: edition three of the harbour pilot handbook.",
    3: "Preface: this handbook collects the rules pilots follow in the harbour.",
    4: "Chapter 1 Arrival: pilots board at the outer buoy at slack water.",
    5: "Section 1.1: two columns of boarding rules.",
    6: "Chapter 2 Departure: tugs stand by until the channel is clear.",
}
BOOK_LABELS = ("i", "ii", "iii", "1", "2", "3")  # front matter in roman numerals, then arabic from 1
BLANK_PAGE = 2  # no content stream at all, as a page a scanner left without text
TWO_COLUMN_PAGE = 5
# The two columns of page 5, line by line as typeset: sentences wrap across lines, two paragraphs each.
LEFT_COLUMN = (
    "Left one: the pilot ladder is rigged",
    "on the lee side of the vessel.",
    "Left two: the master confirms the",
    "draught before the pilot boards.",
    "",
    "Left three: radio contact is kept on",
    "channel twelve throughout.",
    "Left four: the boarding speed is",
    "six knots at most.",
)
RIGHT_COLUMN = (
    "Right one: tugs are made fast at",
    "the breakwater light.",
    "Right two: the berth is confirmed",
    "with the harbour master.",
    "",
    "Right three: lines are passed only",
    "when the tugs are in position.",
    "Right four: the pilot leaves once",
    "the vessel is all fast.",
)
BOOK_OUTLINE = (  # (title, level, physical page)
    ("Front matter", 1, 1),
    ("Cover", 2, 1),
    ("Preface", 2, 3),
    ("Chapter 1: Arrival", 1, 4),
    ("1.1 Two columns", 2, 5),
    ("1.1.1 Right column", 3, 5),
    ("Chapter 2: Departure", 1, 6),
)
LOST_BOOKMARK = "Lost chapter"  # book_pdf(broken_bookmark=True): points at an object that is not a page

PAGE_WIDTH, PAGE_HEIGHT = 612, 792  # US Letter, in points
LINE_HEIGHT = 14


def _escaped(text: str) -> bytes:
    return text.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)").encode("cp1252")


def text_block(x: float, y: float, lines: Iterable[str], size: int = 11) -> bytes:
    """One BT…ET block: `lines` from (x, y) downwards, each moved to with Td and drawn with Tj; an
    empty line is a paragraph break (the next line moves down twice as far)."""
    drawn, drop = [f"BT /F1 {size} Tf {x} {y} Td".encode()], 0
    for line in lines:
        if line:
            drawn.append((b"0 -%d Td " % drop if drop else b"") + b"(" + _escaped(line) + b") Tj")
            drop = 0
        drop += LINE_HEIGHT
    return b"\n".join([*drawn, b"ET\n"])


def _page_content(physical: int) -> bytes:
    if physical == TWO_COLUMN_PAGE:  # the heading across the page, then the left column, then the right
        return (text_block(72, 720, [BOOK_SENTENCES[physical]], 14) + text_block(72, 680, LEFT_COLUMN)
                + text_block(320, 680, RIGHT_COLUMN))
    return text_block(72, 720, [BOOK_SENTENCES[physical]], 14)


def appendix_lines(number: int) -> list[str]:
    """A full page of prose (45 lines of ~75 characters) for the scaled-up book."""
    return [f"Appendix page {number}, line {line}: vessels keep clear of the fairway while the dredger works."
            for line in range(1, 46)]


def _writer_with_font() -> tuple[PdfWriter, IndirectObject]:
    writer = PdfWriter()
    font = writer._add_object(DictionaryObject({
        NameObject("/Type"): NameObject("/Font"), NameObject("/Subtype"): NameObject("/Type1"),
        NameObject("/BaseFont"): NameObject("/Helvetica"), NameObject("/Encoding"): NameObject("/WinAnsiEncoding"),
    }))
    return writer, font


def _add_page(writer: PdfWriter, font: IndirectObject, content: bytes | None) -> PageObject:
    """A Letter page drawing `content` in Helvetica as /F1; None leaves it without a content stream."""
    page = writer.add_blank_page(PAGE_WIDTH, PAGE_HEIGHT)
    page[NameObject("/Resources")] = DictionaryObject(
        {NameObject("/Font"): DictionaryObject({NameObject("/F1"): font})})
    if content is not None:
        stream = ContentStream(None, writer)
        stream.set_data(content)
        page.replace_contents(stream)
        page.compress_content_streams()
    return page


def _written(writer: PdfWriter) -> bytes:
    buffer = io.BytesIO()
    writer.write(buffer)
    return buffer.getvalue()


def book_pdf(extra_pages: int = 0, *, broken_bookmark: bool = False) -> bytes:
    """The six-page book the tests read (see the constants above), then `extra_pages` pages of
    appendix prose (the speed measurements scale it up)."""
    writer, font = _writer_with_font()
    for physical in range(1, 7):
        _add_page(writer, font, None if physical == BLANK_PAGE else _page_content(physical))
    for number in range(1, extra_pages + 1):
        _add_page(writer, font, text_block(54, 750, appendix_lines(number), 10))
    writer.set_page_label(page_index_from=0, page_index_to=2, style="/r")
    writer.set_page_label(page_index_from=3, page_index_to=len(writer.pages) - 1, style="/D", start=1)
    _add_outline(writer, font if broken_bookmark else None)
    writer.add_metadata({"/Title": BOOK_TITLE, **{f"/{key}": value for key, value in BOOK_METADATA.items()}})
    return _written(writer)


def _add_outline(writer: PdfWriter, not_a_page: IndirectObject | None) -> None:
    parents: dict[int, IndirectObject] = {}
    for title, level, page in BOOK_OUTLINE:
        parents[level] = writer.add_outline_item(title=title, page_number=page - 1, parent=parents.get(level - 1))
    if not_a_page is not None:  # a destination whose "page" is the font dictionary
        writer.add_outline_item(title=LOST_BOOKMARK, page_number=not_a_page)


def scan_pdf(pages: int = 3) -> bytes:
    """Pages that only paint an image, as a scanner without OCR makes them: no text layer at all."""
    writer, font = _writer_with_font()
    image = DecodedStreamObject()
    image.set_data(bytes(random.Random(7).randrange(256) for _ in range(64 * 64)))
    image.update({NameObject("/Type"): NameObject("/XObject"), NameObject("/Subtype"): NameObject("/Image"),
                  NameObject("/Width"): NumberObject(64), NameObject("/Height"): NumberObject(64),
                  NameObject("/ColorSpace"): NameObject("/DeviceGray"), NameObject("/BitsPerComponent"): NumberObject(8)})
    image_ref = writer._add_object(image)
    for _ in range(pages):
        page = _add_page(writer, font, b"q %d 0 0 %d 0 0 cm /Im1 Do Q\n" % (PAGE_WIDTH, PAGE_HEIGHT))
        page[NameObject("/Resources")][NameObject("/XObject")] = DictionaryObject({NameObject("/Im1"): image_ref})
    return _written(writer)


ENCRYPTED_SENTENCE = "Sealed orders: the pilot boards at dawn."


def encrypted_pdf(user_password: str, algorithm: str = "AES-128") -> bytes:
    """One page of text, encrypted; an empty user password opens it (as many "protected" PDFs do),
    any other needs that password."""
    writer, font = _writer_with_font()
    _add_page(writer, font, text_block(72, 720, [ENCRYPTED_SENTENCE]))
    writer.encrypt(user_password=user_password, owner_password="owner-secret", algorithm=algorithm)
    return _written(writer)


# ---------------------------------------------------------------------------
# Hostile PDFs, assembled byte by byte.

HEADER = b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n"
FONT = b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"
HELLO = text_block(72, 720, ["Hello from a hostile file."])


def stream(data: bytes, entries: bytes = b"") -> bytes:
    return b"<< /Length %d %s>>\nstream\n" % (len(data), entries) + data + b"\nendstream"


def assemble(objects: dict[int, bytes], trailer: bytes = b"/Root 1 0 R") -> bytes:
    """A PDF of these numbered object bodies with a classic xref table and the given trailer entries."""
    out, offsets = _objects(objects)
    size = max(objects) + 1
    xref = len(out)
    out += _xref_table(offsets, size)
    return bytes(out + b"trailer\n<< /Size %d %s >>\nstartxref\n%d\n%%%%EOF\n" % (size, trailer, xref))


def _objects(objects: dict[int, bytes]) -> tuple[bytearray, dict[int, int]]:
    out, offsets = bytearray(HEADER), {}
    for number, body in sorted(objects.items()):
        offsets[number] = len(out)
        out += b"%d 0 obj\n" % number + body + b"\nendobj\n"
    return out, offsets


def _xref_table(offsets: dict[int, int], size: int, declared: int | None = None) -> bytes:
    rows = [b"0000000000 65535 f \n"]
    rows += [b"%010d 00000 n \n" % offsets[n] if n in offsets else b"0000000000 65535 f \n" for n in range(1, size)]
    return b"xref\n0 %d\n" % (declared or size) + b"".join(rows)


def one_page(content: bytes, page_entries: bytes = b"", media_box: bytes = b"[0 0 612 792]") -> dict[int, bytes]:
    """Objects 1-5 of a one-page document: catalog, pages, page, font, content."""
    return {
        1: b"<< /Type /Catalog /Pages 2 0 R >>",
        2: b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        3: b"<< /Type /Page /Parent 2 0 R /MediaBox %s /Resources << /Font << /F1 4 0 R >> >> "
           b"/Contents 5 0 R %s>>" % (media_box, page_entries),
        4: FONT,
        5: content,
    }


def zeros_deflated(size: int, prefix: bytes = b"") -> bytes:
    """zlib data that inflates to `prefix` and then `size` zero bytes, built in milliseconds
    whatever `size` is: after a full flush deflate starts afresh, so every MiB of zeros compresses
    to the same bytes, repeated; the trailer's Adler-32 is computed, not run over the data."""
    mib = 1 << 20
    compressor = zlib.compressobj(9)
    head = compressor.compress(prefix) + compressor.flush(zlib.Z_FULL_FLUSH)
    chunk = compressor.compress(bytes(mib)) + compressor.flush(zlib.Z_FULL_FLUSH)
    whole, rest = divmod(size, mib)
    tail = compressor.compress(bytes(rest)) + compressor.flush(zlib.Z_FULL_FLUSH)
    adler = zlib.adler32(prefix)
    low, high = adler & 0xFFFF, (adler >> 16) + (adler & 0xFFFF) * size  # Adler-32 of `size` zeros more
    final = b"\x03\x00" + struct.pack(">I", ((high % 65521) << 16) | low)  # an empty final block, then Adler-32
    return head + chunk * whole + tail + final


def flate_bomb_pdf(inflated: int = 2 << 30) -> bytes:
    """A page whose one FlateDecode content stream inflates to `inflated` bytes (2 GiB from ~2 MB)."""
    return assemble(one_page(stream(zeros_deflated(inflated, HELLO), b"/Filter /FlateDecode ")))


def stacked_bomb_pdf(pages: int = 30, inflated: int = 70_000_000) -> bytes:
    """`pages` pages, each a content stream just under pypdf's per-stream cap (75 MB): each stream
    passes, and a reader that keeps what it decoded holds them all."""
    content = stream(zeros_deflated(inflated, HELLO), b"/Filter /FlateDecode ")
    kids = b" ".join(b"%d 0 R" % (10 + 2 * n) for n in range(pages))
    objects = {1: b"<< /Type /Catalog /Pages 2 0 R >>",
               2: b"<< /Type /Pages /Kids [%s] /Count %d >>" % (kids, pages), 4: FONT}
    for n in range(pages):
        objects[10 + 2 * n] = (b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources << /Font << /F1 4 0 R"
                               b" >> >> /Contents %d 0 R >>" % (11 + 2 * n))
        objects[11 + 2 * n] = content
    return assemble(objects)


def _xref_stream_pdf(objects: dict[int, bytes], in_stream: dict[int, tuple[int, int]], entries: int,
                     extra: bytes = b"") -> bytes:
    """Objects with a cross-reference stream of `entries` rows (W [1 4 2]); `in_stream` maps an
    object number to (object stream, index) for objects stored compressed; the rest are free."""
    out, offsets = _objects(objects)
    xref_number = max(objects) + 1
    offsets[xref_number] = len(out)
    rows = bytearray()
    for number in range(entries):
        if number in offsets:
            rows += struct.pack(">BIH", 1, offsets[number], 0)
        elif number in in_stream:
            rows += struct.pack(">BIH", 2, *in_stream[number])
        else:
            rows += struct.pack(">BIH", 0, 0, 0)
    body = stream(zlib.compress(bytes(rows), 9), b"/Type /XRef /Size %d /W [1 4 2] /Root 1 0 R /Filter /FlateDecode %s"
                  % (entries, extra))
    out += b"%d 0 obj\n" % xref_number + body + b"\nendobj\n"
    return bytes(out + b"startxref\n%d\n%%%%EOF\n" % offsets[xref_number])


def object_stream_bomb_pdf(inflated: int = 2 << 30) -> bytes:
    """The catalog stored in an object stream that declares ten million objects and inflates to
    `inflated` bytes; a cross-reference stream points into it."""
    catalog = b"<< /Type /Catalog /Pages 2 0 R >> "
    header = b"1 0 ".ljust(20)
    data = zeros_deflated(inflated, header + catalog)
    objects = one_page(stream(HELLO))
    del objects[1]
    objects[6] = stream(data, b"/Type /ObjStm /N 10000000 /First 20 /Filter /FlateDecode ")
    return _xref_stream_pdf(objects, {1: (6, 0)}, entries=8)


def huge_xref_stream_pdf(entries: int = 1_000_000) -> bytes:
    """A cross-reference stream with a row for each of a million objects (7 MB of rows, ~10 kB deflated)."""
    return _xref_stream_pdf(one_page(stream(HELLO)), {}, entries=entries)


def huge_xref_table_pdf(declared: int = 1_000_000) -> bytes:
    """A classic xref table whose subsection header declares a million entries; six follow."""
    out, offsets = _objects(one_page(stream(HELLO)))
    xref = len(out)
    out += _xref_table(offsets, 6, declared)
    return bytes(out + b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (declared, xref))


def cyclic_xref_pdf() -> bytes:
    """Two xref sections whose trailers' /Prev point at each other."""
    out, offsets = _objects(one_page(stream(HELLO)))
    first = len(out)
    section = _xref_table(offsets, 6)
    second = first + len(section) + len(b"trailer\n<< /Size 6 /Root 1 0 R /Prev %010d >>\n" % 0)
    out += section + b"trailer\n<< /Size 6 /Root 1 0 R /Prev %010d >>\n" % second
    out += section + b"trailer\n<< /Size 6 /Root 1 0 R /Prev %010d >>\n" % first
    return bytes(out + b"startxref\n%d\n%%%%EOF\n" % first)


def page_tree_cycle_pdf() -> bytes:
    """A page tree whose inner node lists the root among its kids."""
    objects = one_page(stream(HELLO))
    objects[2] = b"<< /Type /Pages /Kids [6 0 R] /Count 2 >>"
    objects[6] = b"<< /Type /Pages /Parent 2 0 R /Kids [3 0 R 2 0 R] /Count 2 >>"
    objects[3] = objects[3].replace(b"/Parent 2 0 R", b"/Parent 6 0 R")
    return assemble(objects)


def huge_page_pdf() -> bytes:
    """A page a billion points wide and high, its text far from the origin."""
    content = text_block(1e8, 9e8, ["Hello from a very large page."]) + text_block(9e8, 1e3, ["Far corner."])
    return assemble(one_page(stream(content), media_box=b"[0 0 1000000000 1000000000]"))


def deep_array_content_pdf(depth: int = 100_000) -> bytes:
    """A content stream holding an operand nested `depth` arrays deep."""
    return assemble(one_page(stream(HELLO + b"[" * depth + b"]" * depth + b" pop\n")))


def deep_dictionary_pdf(depth: int = 100_000) -> bytes:
    """A page dictionary with an entry nested `depth` dictionaries deep."""
    nested = b"<< /A " * depth + b"1" + b" >>" * depth
    return assemble(one_page(stream(HELLO), page_entries=b"/Deep " + nested + b" "))


def truncated_pdf() -> bytes:
    """The book cut in half: no xref, no trailer, half its objects."""
    whole = book_pdf()
    return whole[:len(whole) // 2]


def random_pdf(size: int = 200_000, seed: int = 1) -> bytes:
    """A PDF header and then random bytes."""
    return b"%PDF-1.7\n" + random.Random(seed).randbytes(size)


def mutated(raw: bytes, edits: Sequence[tuple[str, int, int]]) -> bytes:
    """`raw` with edits applied in order: ("flip", position, bit), ("insert", position, byte) or
    ("delete", position, count); positions wrap around the current length."""
    data = bytearray(raw)
    for kind, position, value in edits:
        at = position % max(len(data), 1)
        if kind == "flip" and data:
            data[at] ^= 1 << (value % 8)
        elif kind == "insert":
            data[at:at] = bytes([value % 256])
        elif kind == "delete":
            del data[at:at + value]
    return bytes(data)
