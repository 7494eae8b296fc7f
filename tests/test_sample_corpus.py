"""Tests for tools/gen_sample_corpus.py and the committed sample-corpus/ folder."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
GEN_PATH = ROOT / "tools" / "gen_sample_corpus.py"
CORPUS = ROOT / "sample-corpus"


def _load_generator() -> ModuleType:
    name = "gen_sample_corpus_under_test"
    spec = importlib.util.spec_from_file_location(name, GEN_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


gen = _load_generator()

SECRET = "SECRET-OFFSITE-TOKEN-7731"
OLD_COMMANDS = ("kubectl-deploy push --all-at-once", "kubectl-deploy revert")
CURRENT_COMMANDS = ("deployctl rollout --canary 10 --wait", "deployctl rollback --to previous")
EMBEDDING_BUDGET_CHARS = 2048 * 4

JAPANESE = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff]")
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
ATX = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?[ \t]*#*[ \t]*$")
SETEXT = re.compile(r"^ {0,3}(=+|-+)[ \t]*$")


# ---------------------------------------------------------------------------
# Small Markdown helpers (independent of the project's own parser)
# ---------------------------------------------------------------------------


def split_frontmatter(text: str) -> tuple[dict[str, str], str]:
    """Return (simple key: value frontmatter, body)."""
    if not text.startswith("---\n"):
        return {}, text
    end = text.index("\n---\n", 3)
    meta: dict[str, str] = {}
    for line in text[4:end].splitlines():
        key, _, value = line.partition(":")
        meta[key.strip()] = value.strip()
    return meta, text[end + len("\n---\n") :]


def fenced_blocks(body: str) -> list[tuple[str, list[str]]]:
    """(fence marker, inner lines) for every fenced code block."""
    blocks: list[tuple[str, list[str]]] = []
    marker: str | None = None
    inner: list[str] = []
    for line in body.split("\n"):
        m = FENCE.match(line)
        if marker is None:
            if m:
                marker, inner = m.group(1), []
        elif m and m.group(1)[0] == marker[0] and len(m.group(1)) >= len(marker) and not line.strip(marker[0]).strip():
            blocks.append((marker, inner))
            marker = None
        else:
            inner.append(line)
    assert marker is None, "unclosed code fence"
    return blocks


def sections(body: str) -> list[tuple[int, str, str]]:
    """Split a Markdown body at headings (ATX and setext, ignoring code fences).

    Returns (level, heading, text) where text excludes sub-sections; level 0 is
    the text before the first heading.
    """
    lines = body.split("\n")
    result: list[tuple[int, str, list[str]]] = [(0, "", [])]
    marker: str | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        m = FENCE.match(line)
        if marker is not None:
            if m and m.group(1)[0] == marker[0] and len(m.group(1)) >= len(marker):
                marker = None
            result[-1][2].append(line)
        elif m:
            marker = m.group(1)
            result[-1][2].append(line)
        elif ATX.match(line):
            a = ATX.match(line)
            assert a is not None
            result.append((len(a.group(1)), (a.group(2) or "").strip(), []))
        elif (
            i + 1 < len(lines)
            and line.strip()
            and not line.lstrip().startswith(("|", ">", "-", "*"))
            and SETEXT.match(lines[i + 1])
        ):
            level = 1 if lines[i + 1].strip().startswith("=") else 2
            result.append((level, line.strip(), []))
            i += 1
        else:
            result[-1][2].append(line)
        i += 1
    return [(level, title, "\n".join(text).strip()) for level, title, text in result]


def non_code_lines(body: str) -> list[str]:
    out: list[str] = []
    marker: str | None = None
    for line in body.split("\n"):
        m = FENCE.match(line)
        if marker is not None:
            if m and m.group(1)[0] == marker[0] and len(m.group(1)) >= len(marker):
                marker = None
        elif m:
            marker = m.group(1)
        else:
            out.append(line)
    return out


@pytest.fixture(scope="module")
def files() -> dict[str, str]:
    return gen.expected_files()


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(GEN_PATH), *args],
        capture_output=True,
        text=True,
        encoding="utf-8",
        cwd=cwd,
        check=False,
    )


@pytest.fixture()
def fresh(tmp_path: Path) -> Path:
    dest = tmp_path / "corpus"
    gen.write_corpus(dest)
    return dest


# ---------------------------------------------------------------------------
# Committed corpus and generator agree
# ---------------------------------------------------------------------------


def test_committed_corpus_matches_generator() -> None:
    assert CORPUS.is_dir(), "run: python tools/gen_sample_corpus.py"
    diff = gen.diff_corpus(CORPUS)
    assert diff == [], "sample-corpus/ is stale; run python tools/gen_sample_corpus.py\n" + "".join(diff)


def test_check_passes_on_copy_of_committed_corpus(tmp_path: Path) -> None:
    dest = tmp_path / "copy"
    shutil.copytree(CORPUS, dest)
    proc = run_cli("--check", "--dest", str(dest))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout == ""


def test_check_default_dest_is_independent_of_cwd(tmp_path: Path) -> None:
    proc = run_cli("--check", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not (tmp_path / "sample-corpus").exists()


def test_check_passes_on_fresh_copy(fresh: Path) -> None:
    proc = run_cli("--check", "--dest", str(fresh))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) <= 1


def test_check_detects_edited_file(fresh: Path) -> None:
    target = fresh / "reference" / "api.md"
    target.write_text(target.read_text(encoding="utf-8").replace("E4091", "E4099"), encoding="utf-8", newline="\n")
    proc = run_cli("--check", "--dest", str(fresh))
    assert proc.returncode == 1
    assert "--- a/reference/api.md" in proc.stdout
    assert "+++ b/reference/api.md" in proc.stdout
    assert "-| `E4099` | 409" in proc.stdout
    assert "+| `E4091` | 409" in proc.stdout


def test_check_detects_crlf_line_endings(fresh: Path) -> None:
    target = fresh / "reference" / "glossary.md"
    target.write_bytes(target.read_bytes().replace(b"\n", b"\r\n"))
    proc = run_cli("--check", "--dest", str(fresh))
    assert proc.returncode == 1
    assert "a/reference/glossary.md" in proc.stdout


def test_check_detects_extra_file(fresh: Path) -> None:
    (fresh / "runbooks" / "notes.md").write_text("# Notes\n\nscratch\n", encoding="utf-8", newline="\n")
    proc = run_cli("--check", "--dest", str(fresh))
    assert proc.returncode == 1
    assert "runbooks/notes.md" in proc.stdout
    assert "file not expected" in proc.stdout
    assert "-scratch" in proc.stdout


def test_check_detects_missing_file(fresh: Path) -> None:
    (fresh / "oncall" / "escalation.md").unlink()
    proc = run_cli("--check", "--dest", str(fresh))
    assert proc.returncode == 1
    assert "missing file: oncall/escalation.md" in proc.stdout
    assert "+++ b/oncall/escalation.md" in proc.stdout


def test_check_on_missing_folder_lists_every_file(tmp_path: Path, files: dict[str, str]) -> None:
    proc = run_cli("--check", "--dest", str(tmp_path / "nope"))
    assert proc.returncode == 1
    for rel in files:
        assert f"missing file: {rel}" in proc.stdout


def test_diff_corpus_is_empty_after_write(fresh: Path) -> None:
    assert gen.diff_corpus(fresh) == []


# ---------------------------------------------------------------------------
# Writing: determinism and clean-up
# ---------------------------------------------------------------------------


def _snapshot(dest: Path) -> dict[str, bytes]:
    return {p.relative_to(dest).as_posix(): p.read_bytes() for p in sorted(dest.rglob("*")) if p.is_file()}


def test_generating_twice_gives_identical_bytes(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    gen.write_corpus(a)
    first = _snapshot(a)
    gen.write_corpus(a)
    assert _snapshot(a) == first
    proc = run_cli("--dest", str(b), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert _snapshot(b) == first
    assert first == _snapshot(CORPUS)


def test_expected_files_is_pure_and_sorted(files: dict[str, str]) -> None:
    assert gen.expected_files() == files
    assert list(files) == sorted(files)


def test_write_repairs_and_removes_unexpected(fresh: Path) -> None:
    (fresh / "reference" / "api.md").write_text("changed\n", encoding="utf-8")
    (fresh / "oncall" / "escalation.md").unlink()
    (fresh / "stray").mkdir()
    (fresh / "stray" / "old.md").write_text("old\n", encoding="utf-8")
    (fresh / "runbooks" / "extra.txt").write_text("x\n", encoding="utf-8")
    gen.write_corpus(fresh)
    assert gen.diff_corpus(fresh) == []
    assert not (fresh / "stray").exists()
    assert sorted(_snapshot(fresh)) == sorted(gen.expected_files())


def test_write_refuses_a_project_folder(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text("[project]\n", encoding="utf-8")
    (tmp_path / "keep.md").write_text("keep\n", encoding="utf-8")
    with pytest.raises(ValueError):
        gen.write_corpus(tmp_path)
    assert (tmp_path / "keep.md").exists()
    assert gen.main(["--dest", str(tmp_path)]) == 2


def test_files_are_utf8_lf_no_bom(files: dict[str, str]) -> None:
    for rel, text in files.items():
        data = (CORPUS / rel).read_bytes()
        assert not data.startswith(b"\xef\xbb\xbf"), rel
        assert b"\r" not in data, rel
        assert data.decode("utf-8") == text, rel
        assert text.endswith("\n") and not text.endswith("\n\n"), rel
        assert rel.isascii() and rel.endswith(".md"), rel


def test_corpus_is_modest(files: dict[str, str]) -> None:
    assert len(files) >= 6
    assert sum(len(t.encode("utf-8")) for t in files.values()) < 60_000


# ---------------------------------------------------------------------------
# Content invariants other tests rely on
# ---------------------------------------------------------------------------


def test_secret_token_only_in_rag_false_file(files: dict[str, str]) -> None:
    holders = [rel for rel, text in files.items() if SECRET in text]
    assert holders == ["private/offsite-backup.md"]
    meta, _ = split_frontmatter(files["private/offsite-backup.md"])
    assert meta.get("rag") == "false"
    excluded = [rel for rel, text in files.items() if split_frontmatter(text)[0].get("rag") == "false"]
    assert excluded == ["private/offsite-backup.md"]


def test_old_commands_only_in_superseded_file(files: dict[str, str]) -> None:
    for needle in (*OLD_COMMANDS, "kubectl-deploy"):
        holders = [rel for rel, text in files.items() if needle in text]
        assert holders == ["runbooks/deploy-2023.md"], needle


def test_current_commands_only_in_current_runbook(files: dict[str, str]) -> None:
    for needle in CURRENT_COMMANDS:
        holders = [rel for rel, text in files.items() if needle in text]
        assert holders == ["runbooks/deploy.md"], needle


def test_superseded_runbook_frontmatter(files: dict[str, str]) -> None:
    meta, _ = split_frontmatter(files["runbooks/deploy-2023.md"])
    assert meta == {
        "title": "Deploy runbook (2023, superseded)",
        "lifecycle": "superseded",
        "superseded_by": "runbooks/deploy.md",
        "rag_chunk": "headings",
    }
    others = [rel for rel, text in files.items() if split_frontmatter(text)[0].get("lifecycle") == "superseded"]
    assert others == ["runbooks/deploy-2023.md"]


def test_deploy_runbook_structure(files: dict[str, str]) -> None:
    meta, body = split_frontmatter(files["runbooks/deploy.md"])
    assert meta == {"title": "Deploy runbook", "rag_chunk": "headings"}
    heads = [(level, title) for level, title, _ in sections(body) if level]
    assert heads == [
        (1, "Deploy runbook"),
        (2, "Preconditions"),
        (3, "Change freezes"),
        (2, "Rollout"),
        (2, "Rollback"),
        (3, "Database"),
        (3, "Feature flags"),
        (2, "Troubleshooting"),
        (3, "When deployctl itself is unavailable"),
    ]
    # "Troubleshooting" is a setext heading.
    assert "\nTroubleshooting\n---------------\n" in body
    # At least two Markdown tables.
    assert body.count("| --- |") >= 2


def test_deploy_runbook_has_one_over_long_section(files: dict[str, str]) -> None:
    _, body = split_frontmatter(files["runbooks/deploy.md"])
    long = [(title, len(text)) for _, title, text in sections(body) if len(text) > EMBEDDING_BUDGET_CHARS]
    assert [title for title, _ in long] == ["Rollout"]
    rollout = next(text for _, title, text in sections(body) if title == "Rollout")
    assert len(rollout) > 14_000
    assert len(rollout.split()) >= 3_000
    # It can be split at paragraph boundaries into pieces well under budget.
    paragraphs = [p for p in rollout.split("\n\n") if p.strip()]
    assert len(paragraphs) > 20
    assert max(len(p) for p in paragraphs) < EMBEDDING_BUDGET_CHARS // 4
    # Every other section fits the budget comfortably.
    assert all(len(text) < EMBEDDING_BUDGET_CHARS for _, title, text in sections(body) if title != "Rollout")


def test_deploy_runbook_fences_contain_hash_comments(files: dict[str, str]) -> None:
    _, body = split_frontmatter(files["runbooks/deploy.md"])
    blocks = fenced_blocks(body)
    backtick = [inner for marker, inner in blocks if marker.startswith("`")]
    tilde = [inner for marker, inner in blocks if marker.startswith("~")]
    assert any(line.startswith("# ") for inner in backtick for line in inner)
    assert any(line.startswith("# ") for inner in tilde for line in inner)
    # The shell comments must not be taken for headings by the splitter.
    comment_lines = {line[2:].strip() for _, inner in blocks for line in inner if line.startswith("# ")}
    assert comment_lines
    assert not comment_lines & {title for _, title, _ in sections(body)}


def test_escalation_doc_answers_sev1_and_stays_one_chunk(files: dict[str, str]) -> None:
    text = files["oncall/escalation.md"]
    meta, body = split_frontmatter(text)
    assert meta == {"title": "On-call escalation policy"}
    assert "rag_chunk" not in meta
    assert len(text.split()) < 1_500
    assert len(text) < EMBEDDING_BUDGET_CHARS
    for needle in ("## Who gets paged for a sev-1", "Platform Primary rotation", "`@platform-oncall`", "pager: platform-sev1"):
        assert needle in body
    answer = next(t for _, title, t in sections(body) if title == "Who gets paged for a sev-1")
    assert "Platform Primary rotation" in answer and "@platform-oncall" in answer
    # The alias is the escalation doc's answer, not someone else's.
    assert [rel for rel, t in files.items() if "@platform-oncall" in t] == ["oncall/escalation.md"]


def test_japanese_doc(files: dict[str, str]) -> None:
    text = files["ja/log-collection.md"]
    meta, body = split_frontmatter(text)
    assert meta == {}
    assert body.startswith("# ログ収集ガイド\n")
    prose = [
        line
        for line in non_code_lines(body)
        if "LOG_SHIPPER_ENDPOINT" in line and not line.startswith(("|", "#")) and JAPANESE.search(line)
    ]
    assert any("ログの送信先は環境変数 `LOG_SHIPPER_ENDPOINT` で指定します。" in line for line in prose)
    assert any("LOG_RETENTION_DAYS" in line and JAPANESE.search(line) for line in non_code_lines(body))
    japanese_headings = [title for level, title, _ in sections(body) if level == 2 and JAPANESE.search(title)]
    assert len(japanese_headings) >= 2
    assert [rel for rel, t in files.items() if "LOG_SHIPPER_ENDPOINT" in t] == ["ja/log-collection.md"]


def test_api_reference_identifiers(files: dict[str, str]) -> None:
    text = files["reference/api.md"]
    meta, body = split_frontmatter(text)
    assert meta == {}
    assert body.startswith("# Records API reference\n")
    for needle in (
        "NIMBUS_API_TOKEN",
        "NIMBUS_REGION",
        "POST /api/v1/records",
        "GET /api/v1/records/{id}",
        "PUT /api/v1/records/{id}",
        "`E4091` | 409 | Record version conflict",
        "`E4290` | 429 | Rate limited",
        "retry.max_attempts",
    ):
        assert needle in body, needle
    for needle in ("NIMBUS_API_TOKEN", "E4091", "E4290", "retry.max_attempts", "/api/v1/records"):
        assert [rel for rel, t in files.items() if needle in t] == ["reference/api.md"], needle


def test_glossary_has_no_title_source_but_its_file_name(files: dict[str, str]) -> None:
    text = files["reference/glossary.md"]
    meta, body = split_frontmatter(text)
    assert meta == {}
    assert [level for level, _, _ in sections(body) if level] == []
    assert not any(line.startswith("#") for line in body.split("\n"))


def test_title_sources(files: dict[str, str]) -> None:
    """Exactly which title rule each file exercises."""
    frontmatter_titled = sorted(rel for rel, t in files.items() if "title" in split_frontmatter(t)[0])
    assert frontmatter_titled == [
        "oncall/escalation.md",
        "private/offsite-backup.md",
        "runbooks/deploy-2023.md",
        "runbooks/deploy.md",
    ]
    no_frontmatter = sorted(rel for rel, t in files.items() if not t.startswith("---\n"))
    assert no_frontmatter == ["ja/log-collection.md", "reference/api.md", "reference/glossary.md"]
