"""Rewrite one marked section of tools/README.md from a run's own output (bench.py, eval.py
--write-readme), so the published figures are what a run printed, not a copy made by hand.

A section is the text between `<!-- NAME:begin -->` and `<!-- NAME:end -->`, each on a line of
its own and each exactly once; everything outside the markers is left as it was.
"""

from __future__ import annotations

from pathlib import Path

README = Path(__file__).resolve().parent / "README.md"


class SectionError(ValueError):
    """The file lacks the section's markers, has them more than once, or in the wrong order."""


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def replace_section(text: str, name: str, body: str) -> str:
    """`text` with the lines between `name`'s markers replaced by `body` (markers kept)."""
    begin, end = markers(name)
    lines = text.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.strip() == begin]
    stops = [i for i, line in enumerate(lines) if line.strip() == end]
    if len(starts) != 1 or len(stops) != 1:
        found = f"{len(starts)} {begin} and {len(stops)} {end}"
        raise SectionError(f"section {name!r} needs exactly one {begin} line and one {end} line; found {found}")
    if stops[0] < starts[0]:
        raise SectionError(f"section {name!r}: {end} comes before {begin}")
    inner = body.strip("\n") + "\n" if body.strip() else ""
    return "".join(lines[:starts[0] + 1]) + inner + "".join(lines[stops[0]:])


def write_section(path: Path, name: str, body: str) -> None:
    """Rewrite `name`'s section of the file at `path` in place (SectionError, OSError on failure)."""
    text = path.read_text(encoding="utf-8")
    path.write_text(replace_section(text, name, body), encoding="utf-8")
