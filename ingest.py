"""Index a folder of documentation into the local store (the only program that writes it).

Documents (a reader per format: Markdown, MDX, reStructuredText, AsciiDoc, PDF) -> chunks
(corpus_rules) -> document-prefixed text embedded through Ollama ->
written only after embedding succeeded. Per batch of files: new vectors go to Chroma under
content-derived ids, then one SQLite transaction commits the files' chunk rows and keyword
terms (the commit point the server trusts), then the old vectors are deleted. A crash at any
point leaves every file with one committed set of chunks; the next run removes the leftovers.

Exit status: 0 all good, 1 some files failed, 2 nothing done.

The run is one sequence of stages on the main thread (run, _run_stages: walk, plan before the
lock, then under the store lock prepare, _carry_out_plan, publish); the threads around it only move
data and are all daemons. Their code is the module's last section (the vector store's process, the
progress line), but for Embedding's dispatcher, which sits with the embedding rules it keeps:

  thread                   owner                 runs                                   waited on by
  main                     run                   the stages; reads files (within        -
                                                 READ_TIME_BUDGET_S, SIGALRM's clock)
  ingest-embedding (one)   Embedding             sends each round's calls, takes their  the main thread, per group
                                                 answers, tunes concurrency per host    (FilesJob.call.result)
  rag-call (pool)          rules.on_call_thread  one embedding call each; its answer    the dispatcher, which
                                                 goes to the dispatcher's inbox         answers a call late past
                                                                                        the embedder's timeout
  ingest-vector-requests   VectorProcess         sends vector writes to the child       the main thread, per
                                                 process that owns Chroma               request's answer
  ingest-progress          ProgressLine          the progress line every few seconds    no one
  (child process)          VectorProcess         every Chroma write (a VectorWriter):   its requests' answers,
                                                 a crash there cannot take the run      bounded
                                                 with it

The store lock (StoreLayout's lock file, flock) keeps a second ingest out while one writes; the
watch lock keeps a second watcher out. In process, ProgressLine._lock guards the line's counts.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import errno
import fcntl
import functools
import itertools
import json
import logging
import os
import queue
import shutil
import signal
import sqlite3
import stat
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Collection, Generator, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, TypeVar

import corpus_rules as rules
from corpus_rules import DocumentRow, ErrorCode, RagError

log = logging.getLogger("ingest")

EMBED_BATCH = 64  # chunks per /api/embed call, at most
# The first call of a run: small enough for a slow CPU embedder to answer well within the timeout,
# big enough that one call's fixed cost does not swamp the measured pace (see BatchSizer).
START_CHUNKS = 8
# An embedding call should take about this long (and at most this share of RAG_EMBED_TIMEOUT):
# long enough to amortise the call, short enough that a slow CPU embedder never hits the timeout.
EMBED_CALL_TARGET_S = 4.0
EMBED_CALL_SHARE_OF_TIMEOUT = 0.25
KEEP_ALIVE = "30m"  # asked of Ollama with every call: keep the model loaded for the run
# How long a run with nothing to embed waits for Ollama's answer about the model.
OPTIONAL_PROBE_TIMEOUT_S = 5.0
PROGRESS_EVERY_S = 5.0  # a progress line at least this often when stderr is not a terminal
COMMIT_BATCH_CHUNKS = 256  # chunks per Chroma upsert + SQLite transaction, at most
# A commit group holds about this much embedding at the measured pace, so Ctrl-C or an embedder
# going away loses little of a slow first ingest (and the first group is one call's worth).
COMMIT_EVERY_S = 10.0
# When embedding what has no vectors yet would take longer than this, those files are indexed
# for keyword search and published first: a first answer does not wait for a slow embedder.
KEYWORDS_FIRST_AFTER_S = 10.0
UPSERT_BATCH = 1000  # records per Chroma upsert call
# The keyword index is rewritten into one FTS5 segment once the rows written since its last
# rewrite reach this share of it (see Store.compact_keywords); the count is kept in `meta`.
KEYWORD_OPTIMIZE_SHARE = 0.1
META_ROWS_SINCE_OPTIMIZE = "keyword_rows_since_optimize"


# ---------------------------------------------------------------------------
# Walking the corpus.


@dataclass(frozen=True)
class CorpusFile:
    path: str  # stored form: relative, POSIX, NFC
    disk_path: str  # relative, as the file system spells it
    real_path: str
    size: int
    mtime_ns: int
    identity: tuple[int, int] = (0, 0)  # (device, inode) the walk saw: the read insists on it

    def parts_below(self, root_real: str) -> list[str]:
        """The components of the file's real path below the corpus root."""
        return os.path.relpath(self.real_path, root_real).split(os.sep)


# ---------------------------------------------------------------------------
# Scope: what the walk leaves out, and why.

RAGIGNORE = ".ragignore"
RAGIGNORE_MAX_BYTES = 1 << 20
# Folders that are never documentation. A `!name/` rule in a .ragignore brings one back.
BUILT_IN_EXCLUDES = ("node_modules/", ".venv/", "venv/", "__pycache__/", "site-packages/", "dist/", "build/",
                     "vendor/", ".*/",
                     # Minified and lock files: generated from sources and manifests that are read.
                     "*.min.js", "*.min.css", "*.map", "package-lock.json", "npm-shrinkwrap.json", "yarn.lock",
                     "pnpm-lock.yaml", "*.lock", "go.sum")
BUILT_IN_FOLDERS = frozenset(rule[:-1] for rule in BUILT_IN_EXCLUDES if rule.endswith("/") and "*" not in rule)


@dataclass(frozen=True)
class _RuleFile:
    folder: str  # corpus-relative folder the rules apply below ("" for the root)
    source: str  # what to call it in an explanation
    lines: tuple[str, ...]  # the pattern lines, as written
    spec: Any  # pathspec.GitIgnoreSpec of those lines


class Scope:
    """Decides what the walk leaves out: the built-in excludes, then every .ragignore from the
    corpus root down (gitignore syntax, each file's patterns relative to its folder, the deepest
    matching rule winning, `!` bringing a path back), then what git ignores when the corpus is in
    a git work tree. Each exclusion comes with the rule that made it. Patterns are matched by
    pathspec (git's own wildmatch rules); what git ignores is asked of git itself."""

    def __init__(self, walk_root: str, git_ignored: set[str] | None = None) -> None:
        self.root = walk_root
        self.files: list[_RuleFile] = [self._rules("", "built-in rule", BUILT_IN_EXCLUDES)]
        self.git_ignored = git_ignored or set()

    @staticmethod
    def _rules(folder: str, source: str, lines: Sequence[str]) -> _RuleFile:
        import pathspec

        return _RuleFile(folder, source, tuple(lines), pathspec.GitIgnoreSpec.from_lines(lines))

    def enter(self, folder: str, root_fd: int, parts: Sequence[str]) -> str | None:
        """Read the .ragignore of a folder the walk enters (beneath the root, no links followed).
        Returns a warning when it cannot be read."""
        try:
            raw = rules.read_beneath(root_fd, [*parts, RAGIGNORE])
        except FileNotFoundError:
            return None
        except (OSError, rules.PathChanged) as exc:
            return f"{folder + '/' if folder else ''}{RAGIGNORE} not read ({exc})"
        if len(raw) > RAGIGNORE_MAX_BYTES:
            return f"{folder + '/' if folder else ''}{RAGIGNORE} not read (larger than {RAGIGNORE_MAX_BYTES} bytes)"
        source = f"{folder + '/' if folder else ''}{RAGIGNORE}"
        try:
            self.files.append(self._rules(folder, source, raw.decode("utf-8-sig", "replace").splitlines()))
        except Exception as exc:  # noqa: BLE001 - pathspec refuses a malformed pattern
            return f"{source} not used: {rules.shown(exc, 200)}"
        return None

    def excluded(self, rel: str, is_dir: bool) -> str | None:
        """The rule that leaves `rel` (corpus-relative, as the file system spells it) out, or None."""
        verdict: str | None = None
        for rule_file in self.files:
            if not rules.path_matches_prefix(rel, rule_file.folder) or rel == rule_file.folder:
                continue
            inner = rel[len(rule_file.folder) + 1:] if rule_file.folder else rel
            found = rule_file.spec.check_file(inner + ("/" if is_dir else ""))
            if found.include is not None:
                line = self._line_of(rule_file, found.index)
                verdict = f"{rule_file.source}: {line}" if found.include else None
        if verdict is None and (rel + ("/" if is_dir else "")) in self.git_ignored:
            verdict = "ignored by git"
        return verdict

    @staticmethod
    def _line_of(rule_file: _RuleFile, index: int | None) -> str:
        patterns = [line for line in rule_file.lines if line.strip() and not line.lstrip().startswith("#")]
        if rule_file.source == "built-in rule" or index is None:
            return patterns[index] if index is not None and index < len(patterns) else "?"
        # pathspec numbers the file's lines; say which line, as git check-ignore -v does.
        return f"line {index + 1}: {rule_file.lines[index].strip()}" if index < len(rule_file.lines) else "?"


def git_ignored(corpus: Path) -> tuple[set[str] | None, str | None]:
    """What git ignores below the corpus (paths relative to it; folders end with /), asked of git
    itself (.gitignore files, .git/info/exclude, the user's excludes file). (None, None) outside a
    git work tree; (None, warning) when git's answer cannot be used."""
    inside = _git(corpus, "rev-parse", "--is-inside-work-tree")
    if inside is None or inside.strip() != "true":
        return None, None
    listed = _git(corpus, "ls-files", "-z", "--others", "--ignored", "--exclude-standard", "--directory", "--", ".")
    if listed is None:
        return None, "git did not answer which files it ignores; its ignore rules are not applied"
    entries = {entry for entry in listed.split("\0") if entry}
    if entries & {".", "./"}:
        return None, "git ignores the corpus folder itself; its ignore rules are not applied"
    return entries, None


def explain_git_ignored(corpus: Path, paths: Sequence[str]) -> dict[str, str]:
    """`source:line:pattern` of the git rule behind each path (for the dry run's listing)."""
    if not paths:
        return {}
    answer = _git(corpus, "check-ignore", "-v", "--no-index", "--", *paths) or ""
    out = {}
    for row in answer.splitlines():  # "<source>:<line>:<pattern>\t<path>"
        rule, _, path = row.partition("\t")
        out[path] = f"git {rule}"
    return out


@dataclass
class Walk:
    root_real: str = ""
    root_id: tuple[int, int] = (0, 0)
    files: list[CorpusFile] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    failures: dict[str, str] = field(default_factory=dict)  # path -> reason (name problems)
    # Folders that could not be listed (corpus-relative, "" for the root's own entries): what is
    # indexed below them is kept, not removed, and counts as failed.
    unreadable: dict[str, str] = field(default_factory=dict)
    # Left out by the scope: corpus-relative path (folders end with /) -> the rule.
    ignored: dict[str, str] = field(default_factory=dict)
    # Files no reader of the run takes, by extension ("" for none): counted, never read.
    not_read: collections.Counter[str] = field(default_factory=collections.Counter)


def walk_corpus(root: Path, respect_gitignore: bool = True, formats: Collection[str] = rules.DEFAULT_FORMATS) -> Walk:
    """Every file of the `formats` below root that the scope keeps; symlinks followed only inside
    the root. The other files of the folders walked are counted by extension."""
    root_real = os.path.realpath(root)
    try:
        root_id = os.stat(root_real)
        root_fd = rules.open_folder(root_real)
    except (OSError, rules.PathChanged) as exc:
        raise RagError(ErrorCode.CORPUS_MISSING, f"corpus folder {root} cannot be read ({exc})",
                       "check the folder and its permissions, or set RAG_CORPUS_DIR / --corpus") from None
    walk = Walk(root_real=root_real, root_id=(root_id.st_dev, root_id.st_ino))
    ignored_by_git, warning = git_ignored(root) if respect_gitignore else (None, None)
    if warning:
        walk.warnings.append(warning)
    scope = Scope(root_real, ignored_by_git)
    try:
        _walk(root, root_fd, scope, walk, formats)
    finally:
        os.close(root_fd)
    walk.files.sort(key=lambda f: f.path)
    return walk


def _walk(root: Path, root_fd: int, scope: Scope, walk: Walk, formats: Collection[str]) -> None:
    seen_dirs = {walk.root_real}
    seen_paths: set[str] = set()
    pending: list[tuple[Path, str]] = [(root, walk.root_real)]
    while pending:
        directory, directory_real = pending.pop()
        folder = rules.relative_corpus_path(root, directory) if directory != root else ""
        disk_folder = directory.relative_to(root).as_posix() if directory != root else ""
        below = [] if directory_real == walk.root_real else os.path.relpath(directory_real, walk.root_real).split(os.sep)
        problem = scope.enter(disk_folder, root_fd, below)
        if problem:
            walk.warnings.append(problem)
        try:
            entries = sorted(os.scandir(directory), key=lambda e: e.name)
        except OSError as exc:
            if directory == root:
                raise RagError(ErrorCode.CORPUS_MISSING, f"corpus folder {root} cannot be listed ({exc.strerror})",
                               "check the folder's permissions") from None
            walk.unreadable[folder] = exc.strerror or str(exc)
            walk.warnings.append(f"cannot list {directory}: {exc.strerror}; what is indexed below it is kept")
            continue
        for entry in entries:
            link = entry.is_symlink()
            real = os.path.realpath(entry.path)
            if link and not rules.is_within(Path(walk.root_real), Path(real)):
                walk.warnings.append(f"skipped symlink {entry.path}: it resolves outside the corpus ({real})")
                continue
            readable = rules.reader_for(entry.name, formats) is not None
            disk_rel = f"{disk_folder}/{entry.name}" if disk_folder else entry.name
            try:
                st = os.stat(entry.path)
            except OSError as exc:
                if exc.errno in (errno.ENOENT, errno.ELOOP):
                    # Gone since the listing, or a link that leads nowhere: nothing to index.
                    walk.warnings.append(f"skipped {entry.path}: {exc.strerror}")
                elif readable and not scope.excluded(disk_rel, is_dir=False):
                    # There, but unreadable: what is indexed of it stays.
                    walk.failures[rules.relative_corpus_path(root, Path(entry.path))] = (
                        f"{disk_rel}: cannot be read ({exc.strerror})")
                else:
                    walk.warnings.append(f"skipped {entry.path}: {exc.strerror}")
                continue
            if rules.secret_by_name(rules.nfc(disk_rel), stat.S_ISDIR(st.st_mode)):
                walk.ignored[rules.nfc(disk_rel) + ("/" if stat.S_ISDIR(st.st_mode) else "")] = rules.SECRET_REFUSAL
                continue
            if stat.S_ISDIR(st.st_mode):
                reason = scope.excluded(disk_rel, is_dir=True)
                if reason:
                    walk.ignored[disk_rel + "/"] = reason
                elif real in seen_dirs:
                    walk.warnings.append(f"skipped {entry.path}: folder already visited (symlink cycle)")
                else:
                    seen_dirs.add(real)
                    pending.append((Path(entry.path), real))
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            if not readable:
                walk.not_read[rules.file_extension(entry.name)] += 1
                continue
            try:
                disk_rel.encode("utf-8")
            except UnicodeEncodeError:
                walk.warnings.append(f"skipped {entry.path!r}: file name is not valid UTF-8")
                continue
            reason = scope.excluded(disk_rel, is_dir=False)
            path = rules.relative_corpus_path(root, Path(entry.path))
            if reason:
                walk.ignored[path] = reason
                continue
            if path in seen_paths:
                walk.failures[path] = f"{disk_rel}: another file has the same name after Unicode NFC normalisation"
                continue
            seen_paths.add(path)
            unservable = rules.unservable_path_reason(path)
            if unservable:
                walk.failures[path] = f"{disk_rel!r}: {unservable}; rename the file to index it"
                continue
            walk.files.append(CorpusFile(path, disk_rel, real, st.st_size, st.st_mtime_ns, (st.st_dev, st.st_ino)))


# ---------------------------------------------------------------------------
# The keyword index / registry (SQLite), the commit point.


def _section_headings(doc: rules.SourceDocument) -> tuple[rules.Heading, ...] | None:
    """The headings a document's sections run between; none for an extracted text (a PDF's): the
    server cites its extracted lines, so its sections are runs of passages under one heading path."""
    return None if doc.reader.extracted else doc.text.headings


def _key_columns(doc: rules.SourceDocument) -> tuple[str, str, str]:
    """documents.superseded_by, tags and dated for a document, as the keyword index holds them."""
    return rules.successors_column(doc.superseded_by), rules.tags_column(doc.tags), doc.dated or ""


def open_keyword_db(path: Path, scheme: rules.PrefixScheme) -> sqlite3.Connection:
    """The keyword index at `path`, created or migrated to the current schema."""
    path.parent.mkdir(parents=True, exist_ok=True)
    con = sqlite3.connect(path, timeout=30, isolation_level=None)
    con.execute("PRAGMA journal_mode=WAL")
    con.execute("PRAGMA synchronous=FULL")
    # Text of files turned `rag: false` must not linger in free pages.
    con.execute("PRAGMA secure_delete=ON")
    rules.migrate_keyword_index(con, scheme)
    return con


@contextlib.contextmanager
def transaction(con: sqlite3.Connection) -> Iterator[None]:
    con.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        con.execute("ROLLBACK")
        raise
    con.execute("COMMIT")


def load_registry(con: sqlite3.Connection) -> dict[str, DocumentRow]:
    rows = con.execute(f"SELECT {rules.document_columns(rules.schema_version(con))} FROM documents")
    return {r[0]: DocumentRow(*r) for r in rows}


# Chunks that have (or must have) a vector: every committed chunk but those of documents that wait.
WITH_VECTORS = "FROM chunks WHERE path NOT IN (SELECT path FROM vectors_pending)"


def committed_chunk_ids(con: sqlite3.Connection) -> dict[str, str]:
    """id -> lifecycle of every committed chunk that has a vector."""
    return dict(con.execute(f"SELECT id, lifecycle {WITH_VECTORS}"))


def load_waiting(con: sqlite3.Connection) -> dict[str, int]:
    """Documents indexed for keyword search only, and their chunk counts (none in a store written
    before keyword-first indexing existed)."""
    try:
        return {str(path): int(n) for path, n in con.execute("SELECT path, chunks FROM vectors_pending")}
    except sqlite3.OperationalError as exc:
        if "no such table" not in str(exc):
            raise
        return {}


# ---------------------------------------------------------------------------
# Preparing files: parse, chunk, embed.


@dataclass
class PreparedFile:
    file: CorpusFile
    doc: rules.SourceDocument
    content_hash: str
    chunks: list[rules.Chunk]
    vectors: list[Any] = field(default_factory=list)  # one per chunk, once embedded
    keys: list[str] = field(default_factory=list)  # embed_key of each chunk's embedded text


def chunk_budget(context_length: int, target: int, scheme: rules.PrefixScheme, title: str) -> int:
    """Tokens left for chunk text: the target, capped by the context minus the prefix and title,
    with room kept for the heading path that leads the embedded text."""
    overhead = prefix_tokens(scheme, title) + 64
    return max(16, min(target, context_length - overhead))


def prefix_tokens(scheme: rules.PrefixScheme, title: str) -> int:
    """What the prefix scheme and the title take of the model's context in every chunk."""
    return rules.estimate_tokens(scheme.document_text(title, ""))


def split_chunk(doc: rules.SourceDocument, chunk: rules.Chunk) -> list[rules.Chunk]:
    """Halve a chunk that Ollama still found too long (our estimate was too optimistic).

    Several lines: cut between lines, at the paragraph boundary nearest the middle if there is
    one, and the halves keep exact line ranges. One line (or a piece of one): cut at the space
    nearest the middle; the halves share that line, as the chunker's long-line pieces do."""
    lines = doc.lines[chunk.start_line - 1:chunk.end_line]
    searchable = doc.text.searchable[chunk.start_line - 1:chunk.end_line]
    filled = [i for i, line in enumerate(searchable) if line.strip()]
    if len(filled) >= 2:
        cuts = list(range(filled[0] + 1, filled[-1] + 1))
        paragraph = [k for k in cuts if not lines[k - 1].strip()]
        middle = (filled[0] + filled[-1] + 1) / 2
        cut = min(paragraph or cuts, key=lambda k: abs(k - middle))
        return [rules.Chunk(0, chunk.start_line, chunk.start_line + cut - 1, chunk.heading,
                            "\n".join(lines[:cut]).strip(), "\n".join(searchable[:cut]).strip(), chunk.symbol),
                rules.Chunk(0, chunk.start_line + cut, chunk.end_line, chunk.heading,
                            "\n".join(lines[cut:]).strip(), "\n".join(searchable[cut:]).strip(), chunk.symbol)]
    text = chunk.text
    if len(text) < 2:
        return [chunk]
    spaces = [i for i, ch in enumerate(text) if ch.isspace()]
    cut = min(spaces, key=lambda i: abs(i - len(text) // 2)) if spaces else len(text) // 2
    line = chunk.start_line + (filled[0] if filled else 0)
    halves = (text[:cut].strip(), text[cut:].strip())
    return [rules.Chunk(0, chunk.start_line, line, chunk.heading, halves[0], doc.reader.inline(halves[0]), chunk.symbol),
            rules.Chunk(0, line, chunk.end_line, chunk.heading, halves[1], doc.reader.inline(halves[1]), chunk.symbol)]


@dataclass
class BatchSizer:
    """How many chunks the next embedding call carries, so that a call takes about `target_s` at
    the embedder's measured pace (a CPU-only Ollama embeds a few chunks a second; a GPU hundreds).

    The first call of a run carries START_CHUNKS; after every call the pace in estimated tokens per
    second is re-measured, and the next call takes as many chunks as that pace embeds in `target_s`
    (at least one, at most EMBED_BATCH). A call that timed out halves the ceiling; calls that
    succeed double it back."""

    target_s: float
    pace: float | None = None  # estimated tokens per second, smoothed over calls
    ceiling: int = EMBED_BATCH

    def size(self, upcoming_tokens: Sequence[int]) -> int:
        if self.pace is None:
            return max(1, min(START_CHUNKS, self.ceiling, len(upcoming_tokens)))
        budget = self.pace * self.target_s
        count = used = 0
        for tokens in upcoming_tokens[:self.ceiling]:
            if count and used + tokens > budget:
                break
            count += 1
            used += tokens
        return max(1, count)

    def measured(self, tokens: int, seconds: float) -> None:
        pace = tokens / max(seconds, 1e-3)
        self.pace = pace if self.pace is None else 0.5 * self.pace + 0.5 * pace
        self.ceiling = min(EMBED_BATCH, self.ceiling * 2)

    def timed_out(self, size: int) -> None:
        self.ceiling = max(1, size // 2)


# Calls in flight per host, when RAG_EMBED_CONCURRENCY does not fix it (see ConcurrencyTuner):
# a doubling is kept when the host's throughput grows by at least this factor.
CONCURRENCY_GAIN = 1.25
# A commit group's texts go out in at least this many calls per call slot: when a host serves
# fewer calls at once than it is sent, its runners still stay busy while the rest wait their turn.
CALLS_PER_SLOT = 2


@dataclass
class ConcurrencyTuner:
    """How many embedding calls one host works on at a time. Ollama embeds OLLAMA_NUM_PARALLEL
    calls at once; a CPU-only one often gains nothing from a second call, a GPU or a bigger machine
    several times as much. RAG_EMBED_CONCURRENCY fixes the level (`fixed`); otherwise it is found
    by measuring.

    A level's throughput is the tokens its calls carried per second of the host's busy time (time
    with at least one call in flight): calls beyond what the host serves at once wait in its queue,
    so the busy time grows with them and the throughput stays flat. From one call at a time, the
    level doubles while its throughput is at least CONCURRENCY_GAIN times the level before's; the
    first doubling that gains less settles one step back. A timed-out call halves the level and
    settles it."""

    fixed: int | None = None
    level: int = 1
    settled: bool = False
    best: float = 0.0  # the throughput of the level before
    epoch: int = 0  # counts the level's changes: calls sent at an earlier level do not count for this one
    window_busy_s: float | None = None  # the host's busy time when this level's first call went out
    window_tokens: int = 0
    window_calls: int = 0

    def __post_init__(self) -> None:
        if self.fixed is not None:
            self.level, self.settled = self.fixed, True

    def sent(self, busy_s: float) -> int:
        """A call goes out (the host's busy time so far); returns the epoch it belongs to."""
        if self.window_busy_s is None:
            self.window_busy_s = busy_s
        return self.epoch

    def measured(self, tokens: float, busy_s: float, epoch: int) -> None:
        """A call of `epoch` answered: its tokens, and the host's busy time so far."""
        if self.settled or epoch != self.epoch or self.window_busy_s is None:
            return
        self.window_tokens += tokens
        self.window_calls += 1
        if self.window_calls < CALLS_PER_SLOT * self.level:  # as many calls as a group of this level sends
            return
        rate = self.window_tokens / max(busy_s - self.window_busy_s, 1e-6)
        self.window_busy_s, self.window_tokens, self.window_calls = None, 0, 0
        self.epoch += 1
        log.debug("%d call(s) at a time: %.0f tokens/s (the level before: %.0f)", self.level, rate, self.best)
        if self.level > 1 and rate < self.best * CONCURRENCY_GAIN:
            self.level //= 2
            self.settled = True
        elif self.level * 2 > rules.MAX_EMBED_CONCURRENCY:
            self.settled = True
        else:
            self.best = rate
            self.level *= 2

    def timed_out(self) -> None:
        if self.fixed is None:
            self.level, self.settled = max(1, self.level // 2), True


@dataclass
class Host:
    """One Ollama host of the run as Embedding uses it: its own batch sizes and calls in flight
    (a GPU box and a laptop embed at different paces), and why it left the rotation, if it did."""

    embedder: rules.Embedder
    sizer: BatchSizer
    tuner: ConcurrencyTuner
    in_flight: int = 0
    out: RagError | None = None
    calls: int = 0
    chunks: int = 0
    most_in_flight: int = 0
    busy_s: float = 0.0  # time with at least one call in flight, up to `since`
    since: float = field(default_factory=time.monotonic)

    def free(self) -> int:
        return 0 if self.out is not None else max(0, self.tuner.level - self.in_flight)

    def moved(self, by: int) -> None:
        """Count a call sent (+1) or answered (-1)."""
        now = time.monotonic()
        if self.in_flight:
            self.busy_s += now - self.since
        self.since = now
        self.in_flight += by
        self.most_in_flight = max(self.most_in_flight, self.in_flight)

    def report(self) -> dict[str, Any]:
        return {"host": self.embedder.host, "calls": self.calls, "chunks": self.chunks,
                "most_in_flight": self.most_in_flight, "level": self.tuner.level,
                "left_rotation": None if self.out is None else self.out.message}


@dataclass(eq=False)
class _Round:
    """Texts on their way through Embedding's dispatcher: they go out in calls after the texts of
    the rounds queued before them, and `result` waits for every one's answer."""

    texts: list[str]
    share: int  # texts per call at most: CALLS_PER_SLOT calls per slot of the hosts when queued
    chunks: bool  # chunks' texts (counted as embedded), or queries
    tokens: list[int] = field(init=False)
    vectors: list[Any] = field(init=False)
    at: int = 0  # the texts before this one went out
    resend: collections.deque[list[int]] = field(default_factory=collections.deque)
    in_flight: int = 0
    dropped: bool = False  # failed or given up: sends nothing more, its answers are ignored
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.tokens = [rules.estimate_tokens(text) for text in self.texts]
        self.vectors = [None] * len(self.texts)

    def has_work(self) -> bool:
        return not self.dropped and (bool(self.resend) or self.at < len(self.texts))

    def next_batch(self, host: Host) -> list[int]:
        """The positions of the texts the next call to `host` carries: texts to resend first."""
        if self.resend:
            batch = self.resend.popleft()
            if len(batch) > host.sizer.ceiling:
                self.resend.appendleft(batch[host.sizer.ceiling:])
                batch = batch[:host.sizer.ceiling]
            return batch
        size = min(host.sizer.size(self.tokens[self.at:]), self.share)
        if not host.tuner.settled:  # short calls while the host's level is measured: it is found sooner
            size = min(size, START_CHUNKS)
        self.at += size
        return list(range(self.at - size, self.at))

    def fail(self, error: BaseException) -> None:
        self.error, self.dropped = error, True
        self.done.set()

    def result(self) -> list[Any]:
        """A vector per text, or None for a text Ollama refused as longer than the model's context."""
        self.done.wait()  # every call is bounded: the round ends, or fails, in time
        if self.error is not None:
            raise self.error
        return self.vectors


@dataclass
class _Answer:
    """An embedding call's outcome, as its thread hands it to the dispatching one."""

    host: Host
    round: _Round
    batch: list[int]  # positions of its texts in the round's texts
    vectors: Any
    error: BaseException | None
    seconds: float
    epoch: int  # the host's concurrency level it was sent at (ConcurrencyTuner.epoch)
    number: int  # the call's number in the run (Embedding._out)


@dataclass
class FilesJob:
    """A commit group's files on their way through Embedding (begin_files, then finish_files)."""

    files: Sequence[PreparedFile]
    known: dict[str, Any] = field(default_factory=dict)  # embed key -> vector, for this group
    fresh: set[str] = field(default_factory=set)  # the keys Ollama embedded for this group
    keys: list[str] = field(default_factory=list)  # the keys of the texts in flight
    call: _Round | None = None  # their vectors, in keys' order
    # Keys an earlier group's round is embedding (a copied text): its vector is taken from there.
    borrowed: dict[str, tuple[_Round, int]] = field(default_factory=dict)


class Embedding:
    """Gives every chunk of a commit group its vector, embedding each distinct text once.

    A chunk whose exact embedded text (title, heading path, text, under this index's manifest)
    already has a vector in the index reuses it, wherever it came from: the same file after an edit
    elsewhere, a renamed or copied file, a copy in a group still embedding. Only new texts go to
    Ollama, in calls sized by each host's BatchSizer, as many in flight on each host as its
    ConcurrencyTuner allows, spread over the hosts of OLLAMA_HOST by one dispatcher that takes the
    groups' texts in order (see _dispatch). A call that times out is retried with half as many
    chunks; with other hosts in the rotation, the host that timed out (or failed) leaves it for
    the run and its texts go to the others, and only when no host is left is the embedder
    unavailable. No text is sent to two hosts at once. A chunk Ollama refuses as too long is split
    and its pieces embedded; nothing is ever truncated."""

    def __init__(self, embedders: Sequence[rules.Embedder], scheme: rules.PrefixScheme, dims: int,
                 reuse: Callable[[Sequence[str]], dict[str, Any]], concurrency: int | None = None) -> None:
        self.hosts = [Host(embedder, BatchSizer(target_s=min(EMBED_CALL_TARGET_S,
                                                             embedder.timeout_s * EMBED_CALL_SHARE_OF_TIMEOUT)),
                           ConcurrencyTuner(fixed=concurrency)) for embedder in embedders]
        self.scheme = scheme
        self.dims = dims
        self.reuse = reuse  # embed keys -> stored vectors of those keys (those that exist)
        self.calls = 0
        self.embedded = 0  # chunks whose vector Ollama computed in this run
        self.embedding_s = 0.0  # wall time spent with chunks' calls in flight
        self.reused = 0  # chunks that took a vector the index already had
        self.on_embedded: Callable[[int], None] = lambda chunks: None  # progress, after every call
        self.on_reused: Callable[[int], None] = lambda chunks: None  # progress, after every group
        self.on_split: Callable[[int], None] = lambda more: None  # a chunk Ollama refused became more
        # One dispatcher thread for the run sends every round's calls: the next group's texts go
        # out as soon as this group's are all out, so no slot waits for a group's slowest call.
        self._inbox: queue.SimpleQueue[_Answer | _Round | None] = queue.SimpleQueue()
        self._dispatcher: threading.Thread | None = None
        self._rounds: list[_Round] = []  # the dispatcher's, in the order queued
        self._chunk_calls = 0  # chunks' calls in flight, and since when (embedding_s)
        self._chunk_calls_since = 0.0
        self._in_flight_keys: dict[str, tuple[_Round, int]] = {}  # the keys of groups begun, not finished
        # The calls out, by number: when each must have answered, and its answer should it not
        # (the dispatcher's clock: a call runs on one thread, with no second one waiting on it).
        self._out: dict[int, tuple[float, _Answer]] = {}
        self._numbers = itertools.count()

    def seconds_for(self, chunks: int) -> float | None:
        """How long embedding this many chunks takes at this run's pace (None before a call)."""
        if not self.embedded:
            return None
        return chunks * self._busy_s() / self.embedded

    def _busy_s(self) -> float:
        """Wall time with chunks' calls out so far, the stretch still under way included: with the
        rounds following each other, the calls may not all land until the run's last one."""
        ongoing = time.monotonic() - self._chunk_calls_since if self._chunk_calls else 0.0
        return self.embedding_s + ongoing

    @staticmethod
    def finished(job: FilesJob) -> bool:
        """Whether the job's texts in flight have all been answered (finish_files would not wait on Ollama)."""
        return job.call is None or job.call.done.is_set()

    def pace_pending(self) -> bool:
        """Whether chunks were sent and none answered yet (the pace is about to be known)."""
        return self.calls > 0 and not self.embedded

    def close(self) -> None:
        """End the dispatcher; rounds still queued fail (the run gave them up)."""
        if self._dispatcher is not None:
            self._inbox.put(None)

    def text(self, doc: rules.SourceDocument, chunk: rules.Chunk) -> str:
        return rules.embedded_chunk_text(self.scheme, doc, chunk)

    def embed_files(self, files: Sequence[PreparedFile]) -> None:
        self.finish_files(self.begin_files(files))

    def begin_files(self, files: Sequence[PreparedFile]) -> FilesJob:
        """PlanBeforeLock up the vectors the index already has and send the rest to Ollama; the calls go on
        while the caller works (ingest commits the group before): finish_files waits for them."""
        job = FilesJob(files)
        self._begin_round(job)
        return job

    def finish_files(self, job: FilesJob) -> None:
        """Every chunk of the job's files with its vector (pf.keys, pf.vectors). A chunk Ollama
        refused as too long is split, and its pieces go through another round."""
        while job.call is not None or job.borrowed:
            try:
                vectors = job.call.result() if job.call is not None else []  # Ctrl-C interrupts the wait
            finally:  # a later group takes these from the index now, or (after a failure) embeds them anew
                self._forget(job)
            too_long = set()
            for key, vector in zip(job.keys, vectors, strict=True):
                if vector is None:
                    too_long.add(key)
                else:
                    job.known[key] = vector
                    job.fresh.add(key)
            for key, (owner, at) in job.borrowed.items():
                vector = owner.result()[at]
                if vector is None:
                    too_long.add(key)
                else:
                    job.known[key] = vector
            job.borrowed = {}
            for pf in job.files:
                for chunk in [c for c in pf.chunks if rules.embed_key(self.text(pf.doc, c)) in too_long]:
                    at = pf.chunks.index(chunk)
                    pf.chunks[at:at + 1] = parts = self._split(pf.doc, chunk)
                    self.on_split(len(parts) - 1)
            self._begin_round(job)
        for pf in job.files:
            pf.keys = [rules.embed_key(self.text(pf.doc, chunk)) for chunk in pf.chunks]
            pf.vectors = [job.known[key] for key in pf.keys]
        # Every chunk that did not take a vector Ollama computed for it: stored ones, and copies.
        reused = sum(len(pf.keys) for pf in job.files) - len(job.fresh)
        self.reused += reused
        self.on_reused(reused)

    def _begin_round(self, job: FilesJob) -> None:
        """The texts of the job's chunks that have no vector yet: those the index has are taken,
        those a group begun before is embedding are borrowed from it, the others queued (job.call;
        None when nothing is left to embed)."""
        texts = {rules.embed_key(text): text for text in
                 (self.text(pf.doc, chunk) for pf in job.files for chunk in pf.chunks)}
        wanted = {key: text for key, text in texts.items() if key not in job.known}
        job.borrowed = {key: self._in_flight_keys[key] for key in wanted if key in self._in_flight_keys}
        asked = [key for key in wanted if key not in job.borrowed]
        stored = self.reuse(asked) if asked else {}
        job.known.update(stored)
        missing = {key: wanted[key] for key in asked if key not in stored}
        job.keys = list(missing)
        job.call = self._queue(list(missing.values()), chunks=True) if missing else None
        if job.call is not None:
            self._in_flight_keys.update((key, (job.call, at)) for at, key in enumerate(job.keys))

    def _split(self, doc: rules.SourceDocument, chunk: rules.Chunk) -> list[rules.Chunk]:
        parts = split_chunk(doc, chunk)
        if len(parts) < 2:
            raise RagError(ErrorCode.DOCUMENT_INVALID,
                           f"{doc.path}: lines {chunk.start_line}-{chunk.end_line} cannot be split below the model's "
                           "context", "shorten that passage")
        return parts

    def embed_queries(self, queries: Sequence[str]) -> list[Any]:
        """Query vectors (the calibration's), in calls sized like the chunks' and counted as calls,
        not as chunks embedded."""
        vectors = self._embed_texts([self.scheme.query_text(q) for q in queries], chunks=False)
        if any(v is None for v in vectors):
            raise RagError(ErrorCode.DOCUMENT_INVALID, "a heading is longer than the model's context",
                           "(calibration only)")
        return vectors

    def _embed_texts(self, texts: list[str], chunks: bool = True) -> list[Any]:
        """A vector per text, or None for a text Ollama refused as longer than the model's context."""
        return self._queue(texts, chunks).result()

    def _queue(self, texts: list[str], chunks: bool) -> _Round:
        """The texts as a round behind those queued before (see _dispatch), in calls of at most an
        even share of CALLS_PER_SLOT calls per slot: a small group still keeps every slot busy."""
        slots = sum(host.tuner.level for host in self.hosts if host.out is None)
        share = -(-len(texts) // (CALLS_PER_SLOT * slots)) if slots > 1 else len(texts)
        round_ = _Round(texts, max(1, share), chunks)
        if self._dispatcher is None:
            self._dispatcher = threading.Thread(target=self._dispatch, name="ingest-embedding", daemon=True)
            self._dispatcher.start()
        self._inbox.put(round_)
        return round_

    def abandon(self, job: FilesJob) -> None:
        """Send no more of a group's texts (the run gave it up after an error)."""
        if job.call is not None:
            job.call.dropped = True
            self._forget(job)

    def _forget(self, job: FilesJob) -> None:
        """A later group no longer borrows the job's texts in flight."""
        for key in job.keys:
            self._in_flight_keys.pop(key, None)

    def _dispatch(self) -> None:
        """The run's embedding calls, on a thread of its own until close.

        0. A round with no text left to send and no call out ends (answered, failed or given up).
        1. Fill every free call slot of every host in the rotation with the oldest round's texts
           that have not gone out: texts to resend first, then the next ones, as many as the
           host's sizer says (see _Round.next_batch).
        2. When no call is in flight and texts wait, no host is left: those rounds fail with the
           last host's failure.
        3. Wait for a call's answer (or a new round) and take it (see _take_answer): vectors kept, texts
           to resend queued, a failed host out of the rotation. A call that has not answered by its
           embedder's timeout is answered as timed out here (next_message); its late answer, if
           any, is dropped."""
        failure: RagError | None = None
        while True:
            # 0. rounds that ended
            for round_ in [r for r in self._rounds if not r.has_work() and not r.in_flight]:
                self._rounds.remove(round_)
                round_.done.set()
            # 1. fill the free slots
            for host in self.hosts:
                while host.free() and (round_ := next((r for r in self._rounds if r.has_work()), None)):
                    self._send(host, round_, round_.next_batch(host))
            # 2. no host left
            if not any(r.in_flight for r in self._rounds):
                for round_ in [r for r in self._rounds if r.has_work()]:
                    round_.fail(failure or RagError(ErrorCode.EMBEDDER_UNAVAILABLE, "no embedding host to embed with"))
            # 3. the next answer
            message = self.next_message()
            if message is None:
                for round_ in self._rounds:
                    round_.fail(RagError(ErrorCode.EMBEDDER_UNAVAILABLE, "the run gave up its embedding calls"))
                return
            if isinstance(message, _Round):
                self._rounds.append(message)
                continue
            if message.number not in self._out:
                continue  # answered already: by its timeout
            del self._out[message.number]
            round_ = message.round
            self._count_landed(message)
            if not round_.dropped:
                try:
                    failure = self._take_answer(message) or failure
                except BaseException as exc:  # noqa: BLE001 - the round's waiter raises it
                    round_.fail(exc)

    def _send(self, host: Host, round_: _Round, batch: list[int]) -> None:
        self.calls += 1
        host.calls += 1
        host.moved(+1)
        round_.in_flight += 1
        if round_.chunks:
            if not self._chunk_calls:
                self._chunk_calls_since = time.monotonic()
            self._chunk_calls += 1
        epoch = host.tuner.sent(host.busy_s)
        texts = [round_.texts[i] for i in batch]
        sent_at = time.monotonic()
        number = next(self._numbers)

        def answer(vectors: Any, error: BaseException | None) -> _Answer:
            return _Answer(host, round_, batch, vectors, error, time.monotonic() - sent_at, epoch, number)

        # On the call's thread, as it answers or fails: handed to the dispatching one, which reads
        # its inbox only once this call is registered below.
        host.embedder.begin_embed(texts, then=lambda vectors: self._inbox.put(answer(vectors, None)),
                                  failed=lambda exc: self._inbox.put(answer(None, exc)))
        # Timed from here: the client is built (its imports paid) before the call goes out.
        self._out[number] = (time.monotonic() + host.embedder.timeout_s, answer(None, host.embedder.timed_out()))

    def next_message(self) -> _Answer | _Round | None:
        """The next call's answer or round queued, or the answer of a call whose time is up (the
        one that was due first)."""
        while True:
            due = min(self._out.items(), key=lambda item: item[1][0], default=None)
            try:
                return self._inbox.get(timeout=None if due is None else max(0.0, due[1][0] - time.monotonic()))
            except queue.Empty:
                if due is not None and time.monotonic() >= due[1][0]:
                    return due[1][1]

    def _count_landed(self, answer: _Answer) -> None:
        """Count a call answered: its host's calls in flight, its round's, the time spent embedding."""
        answer.host.moved(-1)
        answer.round.in_flight -= 1
        if answer.round.chunks:
            self._chunk_calls -= 1
            if not self._chunk_calls:
                self.embedding_s += time.monotonic() - self._chunk_calls_since

    def _take_answer(self, answer: _Answer) -> RagError | None:
        """Take one call's answer; returns the failure that took its host out of the rotation."""
        host, round_, batch, error = answer.host, answer.round, answer.batch, answer.error
        if error is None:
            error = self._wrong_size(host, answer.vectors)
        if isinstance(error, rules.InputTooLong):
            if len(batch) == 1:
                return None  # its vector stays None: the caller splits that chunk
            round_.resend.extendleft([i] for i in reversed(batch))  # find the one: the same texts one at a time
            return None
        if isinstance(error, rules.EmbedderTimeout) and not self._others_in_rotation(host):
            if len(batch) == 1:
                raise error
            log.info("an embedding call of %d chunks timed out; retrying with fewer", len(batch))
            host.sizer.timed_out(len(batch))
            host.tuner.timed_out()
            round_.resend.appendleft(batch)
            return None
        if isinstance(error, RagError) and error.code in EMBEDDER_DOWN and not isinstance(error, rules.InvalidVectors):
            if host.out is None:
                host.out = error
                if self._others_in_rotation(host):
                    log.warning("%s: that host is left out of this run; its texts go to the other hosts (%s)",
                                error.message, error.hint)
            round_.resend.appendleft(batch)
            return error
        if error is not None:
            raise error
        used = sum(round_.tokens[i] for i in batch)
        host.sizer.measured(used, answer.seconds)
        host.tuner.measured(used, host.busy_s, answer.epoch)
        for i, vector in zip(batch, answer.vectors, strict=True):
            round_.vectors[i] = vector
        if round_.chunks:
            host.chunks += len(batch)
            self.embedded += len(batch)
            self.on_embedded(len(batch))
        return None

    def _wrong_size(self, host: Host, vectors: Any) -> RagError | None:
        """A host whose vectors are not the index's size serves another model under the name (swapped
        mid-run): it leaves the rotation like a host that went down, and its texts go to the others."""
        wrong = {len(v) for v in vectors if len(v) != self.dims}
        if not wrong:
            return None
        embedder = host.embedder
        return RagError(ErrorCode.EMBEDDER_UNAVAILABLE,
                        f"{embedder.where} answered {min(wrong)}-dimensional vectors for {embedder.model!r}, "
                        f"the index holds {self.dims}",
                        f"the model changed under the same name? {embedder.model_hint()}, or leave that host out "
                        f"of {embedder.HOSTS_VARIABLE}; run ingest again: it rebuilds when the model's size changed")

    def _others_in_rotation(self, host: Host) -> bool:
        return any(other is not host and other.out is None for other in self.hosts)

    def report(self) -> list[dict[str, Any]]:
        return [host.report() for host in self.hosts]


def renumber(chunks: Sequence[rules.Chunk]) -> list[rules.Chunk]:
    return [replace(c, index=i) for i, c in enumerate(chunks)]


# ---------------------------------------------------------------------------
# Writing: vectors first, then the SQLite commit, then old vectors out.


@dataclass
class Sent:
    """Files whose vectors went to the store (the operations up to `ticket`), rows not committed."""

    files: list[PreparedFile]
    new_ids: set[str]
    ticket: int


class Store:
    """One index: its vectors (a collection per lifecycle, embedded or on a Chroma server) plus
    the SQLite keyword index in the index folder."""

    def __init__(self, layout: rules.StoreLayout, manifest: rules.IndexManifest, settings: rules.Settings,
                 vectors: rules.Vectors) -> None:
        self.name = manifest.index_name()
        self.manifest = manifest
        meta = {f"manifest_{k}": v for k, v in manifest.to_dict().items()}  # the space: VECTOR_CONFIGURATION
        layout.index_dir(self.name).mkdir(parents=True, exist_ok=True)
        self.vectors = vectors.open(settings, layout, self.name, meta)
        self.scheme = rules.PREFIX_SCHEMES.get(manifest.prefix_scheme, rules.PREFIX_SCHEMES["none"])
        self.db = open_keyword_db(layout.keyword_db(self.name), self.scheme)
        self._vector_writes_marked = False
        self._rows_written = 0  # keyword rows inserted or deleted in this run, for compact_keywords
        self._common_terms = {term for (term,) in self.db.execute("SELECT term FROM common_terms")}
        # Vectors sent to the store whose rows are not committed yet, by embed key: reusable
        # by the next group before the rows that make them findable are committed.
        self._sent_vectors: dict[str, Any] = {}

    def record_keys(self, docs: Iterable[rules.SourceDocument]) -> None:
        """The document keys and the chunks' sections of unchanged files read again (see
        DocumentRow.keys_unrecorded)."""
        with transaction(self.db):
            for doc in docs:
                self.db.execute("UPDATE documents SET superseded_by = ?, tags = ?, dated = ?, sections_recorded = 1 "
                                "WHERE path = ?", (*_key_columns(doc), doc.path))
                chunks = [rules.Chunk(index, start, end, heading, "", "") for index, start, end, heading in self.db.execute(
                    "SELECT chunk_index, start_line, end_line, heading FROM chunks WHERE path = ?", (doc.path,))]
                sections = rules.section_ranges(chunks, _section_headings(doc))
                self.db.executemany("UPDATE chunks SET section_start = ?, section_end = ? WHERE path = ? AND chunk_index = ?",
                                    [(*lines, doc.path, index) for index, lines in sections.items()])
            self._mark_unpublished()

    def unindexed_successors(self) -> list[tuple[str, str]]:
        """(document, successor) for every successor a document names that is not indexed."""
        indexed = {path for (path,) in self.db.execute("SELECT path FROM documents")}
        return [(str(path), successor) for path, raw in self.db.execute(
                    "SELECT path, superseded_by FROM documents WHERE superseded_by IS NOT NULL ORDER BY path")
                for successor in rules.successors_from_column(raw) if successor not in indexed]

    def _active_chunks(self) -> int:
        return int(self.db.execute("SELECT count(*) FROM chunks WHERE lifecycle = 'active'").fetchone()[0])

    def needs_calibration(self) -> bool:
        """Never calibrated, or the active chunk count drifted since the last attempt (a corpus
        too small to calibrate is not retried on every run)."""
        row = self.db.execute("SELECT value FROM meta WHERE key = ?", (rules.META_CALIBRATED_AT,)).fetchone()
        active = self._active_chunks()
        if row is None:
            return active > 0
        last = int(row[0])
        return abs(active - last) > rules.CALIBRATION_DRIFT * max(last, 1)

    def calibrate(self, embed_queries: Callable[[Sequence[str]], Sequence[Any]]) -> rules.Calibration | None:
        """Measure the corpus's Calibration: its own headings as queries, each against its nearest
        active passages. Stored in `meta` with the chunk count it was measured at; None when the
        corpus is too small or too uniform to measure (and no calibration is kept then)."""
        rows = self.db.execute("SELECT id, path, heading FROM chunks WHERE lifecycle = 'active'").fetchall()
        queries = rules.calibration_queries(rows)
        calibration = None
        if len(queries) >= rules.CALIBRATION_MIN_QUERIES:
            vectors = embed_queries([q for _, q in queries])
            neighbours = []
            for (own, _query), vector in zip(queries, vectors, strict=True):
                found = self.vectors.query("active", vector, rules.CALIBRATION_NEIGHBOURS, None)
                marks = ",".join("?" * len(found))
                paths = dict(self.db.execute(f"SELECT id, path FROM chunks WHERE id IN ({marks})",
                                             [i for i, _ in found]).fetchall()) if found else {}
                neighbours.append((own, [(paths[i], 1.0 - d) for i, d in found if i in paths]))
            calibration = rules.calibrate(neighbours, len(rows))
        with transaction(self.db):
            if calibration is None:  # a scale measured on another corpus would mislead
                self.db.execute("DELETE FROM meta WHERE key = ?", (rules.META_CALIBRATION,))
            else:
                self.db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)",
                                (rules.META_CALIBRATION, calibration.to_json()))
            self.db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)",
                            (rules.META_CALIBRATED_AT, str(len(rows))))
        return calibration

    def stored_vectors(self, keys: Sequence[str]) -> dict[str, Any]:
        """The vectors the index already holds for these embed keys (those it has)."""
        found = {key: self._sent_vectors[key] for key in keys if key in self._sent_vectors}
        keys = [key for key in keys if key not in found]
        owners: dict[str, dict[str, str]] = {}  # lifecycle -> chunk id -> key
        for batch in rules.batched(keys, 500):
            marks = ",".join("?" * len(batch))
            # Not the chunks that wait for their vectors (indexed for keyword search first): asking
            # the vector process for what it does not hold would wait behind its writes for nothing.
            for chunk, lifecycle, key in self.db.execute(
                    f"SELECT id, lifecycle, embed_key {WITH_VECTORS} AND embed_key IN ({marks})", list(batch)):
                owners.setdefault(lifecycle, {}).setdefault(chunk, key)
        for lifecycle, by_id in owners.items():
            ids = [i for i, key in by_id.items() if key not in found]
            for batch in rules.batched(ids, 1000):
                got_ids, vectors = self.vectors.embeddings(lifecycle, batch)
                for chunk, vector in zip(got_ids, vectors, strict=True):
                    found.setdefault(by_id[chunk], vector)
        return found

    def close(self) -> None:
        self.db.close()
        self.vectors.close()

    def reconcile(self) -> int:
        """Delete vectors no committed chunk owns (left by a crash); return how many.

        A file with a committed chunk whose vector is missing loses all its rows and vectors,
        so it is embedded again in this run (or stays gone if it left the corpus)."""
        committed = committed_chunk_ids(self.db)
        removed = 0
        present: set[str] = set()
        for lifecycle in rules.LIFECYCLES:
            ids = self.vectors.ids(lifecycle)
            stray = [i for i in ids if committed.get(i) != lifecycle]
            present.update(i for i in ids if committed.get(i) == lifecycle)
            self.vectors.delete(lifecycle, stray)
            removed += len(stray)
        missing = [i for i in committed if i not in present]
        if missing:
            # Drop the whole file, not only its registry row: if it still exists it is embedded
            # again as new; if it is gone, nothing of it may linger in either store.
            paths = sorted({row[0] for i in missing for row in self.db.execute("SELECT path FROM chunks WHERE id = ?", (i,))})
            removed += sum(1 for i in self._chunk_ids_of(paths) if i in present)
            self.remove(paths)
        return removed

    def send(self, files: Sequence[PreparedFile]) -> Sent:
        """Send these embedded files' vectors to the store (written while the caller goes on);
        commit() makes them the files' chunks."""
        self.begin_vector_writes()
        new_ids: set[str] = set()
        ticket = 0
        for lifecycle in rules.LIFECYCLES:
            records = [(rules.chunk_id(pf.file.path, pf.content_hash, chunk.index), vector, chunk.text,
                        rules.chunk_metadata(pf.doc, chunk, pf.content_hash, pf.file.mtime_ns))
                       for pf in files if pf.doc.lifecycle == lifecycle
                       for chunk, vector in zip(pf.chunks, pf.vectors, strict=True)]
            new_ids.update(record[0] for record in records)
            for batch in rules.batched(records, UPSERT_BATCH):
                ids, vectors, texts, metas = zip(*batch, strict=True)
                ticket = self.vectors.upsert(lifecycle, ids, vectors, texts, metas)
        for pf in files:
            self._sent_vectors.update(zip(pf.keys, pf.vectors, strict=True))
            pf.vectors = []  # 100k chunks of vectors would hold GBs until the end
        return Sent(list(files), new_ids, ticket)

    def commit_without_vectors(self, files: Sequence[PreparedFile]) -> None:
        """Make these files' chunks findable by keyword before they have vectors (Ollama cannot
        embed them now, or would take long): one transaction writes their rows and notes them as
        waiting; the commit that later brings their vectors replaces both. Only for files with no
        vectors in this index (new ones, or ones already waiting), so nothing embedded is lost."""
        with transaction(self.db):
            self._delete_rows([pf.file.path for pf in files])
            for pf in files:
                pf.keys = [rules.embed_key(rules.embedded_chunk_text(self.scheme, pf.doc, c)) for c in pf.chunks]
                self._insert_rows(pf)
            self.db.executemany("INSERT INTO vectors_pending(path, chunks) VALUES (?, ?)",
                                [(pf.file.path, len(pf.chunks)) for pf in files])
            self._mark_unpublished()

    def waiting_chunks(self) -> int:
        return int(self.db.execute("SELECT coalesce(sum(chunks), 0) FROM vectors_pending").fetchone()[0])

    def commit(self, sent: Sent) -> None:
        """Once the store holds their vectors, one transaction makes the files' new chunk rows
        and keyword terms the truth; then their old vectors go."""
        self.vectors.settle(sent.ticket)
        paths = [pf.file.path for pf in sent.files]
        old = self._chunk_ids_of(paths)
        with transaction(self.db):
            waited = {pf.file.path for pf in sent.files if self._waits_as_written(pf)}
            self._delete_rows([path for path in paths if path not in waited])
            for pf in sent.files:
                if pf.file.path in waited:  # its rows are these chunks already: they wait no more
                    self.db.execute("DELETE FROM vectors_pending WHERE path = ?", (pf.file.path,))
                else:
                    self._insert_rows(pf)
            self._mark_unpublished()
        for pf in sent.files:
            for key in pf.keys:
                self._sent_vectors.pop(key, None)
        self._delete_vectors({i: lc for i, lc in old.items() if i not in sent.new_ids})

    def remove(self, paths: Sequence[str]) -> None:
        self.begin_vector_writes()
        old = self._chunk_ids_of(paths)
        with transaction(self.db):
            self._delete_rows(paths)
            self._mark_unpublished()
        self._delete_vectors(old)

    def update_mtimes(self, updates: Sequence[tuple[CorpusFile, DocumentRow]]) -> None:
        """Content unchanged, mtime moved: no embedding, but chunks carry the file's mtime."""
        self.begin_vector_writes()
        for file, row in updates:
            ids = list(self._chunk_ids_of([file.path]))
            if ids:
                found, metas = self.vectors.metadatas(row.lifecycle, ids)
                self.vectors.update_metadatas(row.lifecycle, found, [{**m, "mtime_ns": file.mtime_ns} for m in metas])
        with transaction(self.db):
            self.db.executemany("UPDATE documents SET mtime_ns = ?, size = ? WHERE path = ?",
                                [(f.mtime_ns, f.size, f.path) for f, _ in updates])
            self._mark_unpublished()

    def relocate(self, files: Sequence[CorpusFile]) -> None:
        """Unchanged files whose location on disk changed (the corpus folder moved): record where they
        are now, which get_file checks, without embedding anything."""
        with transaction(self.db):
            self.db.executemany("UPDATE documents SET disk_path = ?, real_path = ? WHERE path = ?",
                                [(f.disk_path, f.real_path, f.path) for f in files])
            self._mark_unpublished()

    # Chroma may hold vectors that SQLite does not own (a run writing them was killed) only while
    # this flag is set: set before a run's first vector write, cleared when the run ends normally.
    # Reconciling reads every id (~1 s at 100k chunks), so a clean no-op run skips it.
    def begin_vector_writes(self) -> None:
        if not self._vector_writes_marked:
            with transaction(self.db):
                self.db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('vector_writes', '1')")
            self._vector_writes_marked = True

    def needs_reconcile(self, count: bool) -> bool:
        """After an interrupted run, or (with `count`) when the vector counts disagree with the
        committed rows (vectors lost or added behind ingest's back); counting is cheap, listing ids
        is not. A run with nothing to write does not count: it would open the vector store for
        that alone, and the next run that writes (or --full) finds such damage."""
        if self.db.execute("SELECT 1 FROM meta WHERE key = 'vector_writes'").fetchone() is not None:
            return True
        if not count:
            return False
        committed = dict(self.db.execute(f"SELECT lifecycle, count(*) {WITH_VECTORS} GROUP BY lifecycle"))
        return any(self.vectors.count(lifecycle) != committed.get(lifecycle, 0) for lifecycle in rules.LIFECYCLES)

    def end_vector_writes(self) -> None:
        self.vectors.settle()  # the last deletes of old vectors included
        with transaction(self.db):
            self.db.execute("DELETE FROM meta WHERE key = 'vector_writes'")

    # Committed changes not yet announced in CURRENT.json (generation): set in the transaction that
    # commits them, cleared after CURRENT.json is replaced, so a crash in between is published by
    # the next run even if it finds nothing else to do.
    def _mark_unpublished(self) -> None:
        self.db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('unpublished', '1')")

    def unpublished(self) -> bool:
        return self.db.execute("SELECT 1 FROM meta WHERE key = 'unpublished'").fetchone() is not None

    def mark_published(self) -> None:
        with transaction(self.db):
            self.db.execute("DELETE FROM meta WHERE key = 'unpublished'")

    def _waits_as_written(self, pf: PreparedFile) -> bool:
        """Whether the file's rows are the ones _insert_rows would write for it now: indexed for
        keyword search first (in this run, or in one without Ollama) from the same content, chunks
        and place on disk, waiting only for their vectors. A first build that published keywords
        first then writes its keyword index once, not twice."""
        path = pf.file.path
        if self.db.execute("SELECT 1 FROM vectors_pending WHERE path = ?", (path,)).fetchone() is None:
            return False
        written = self.db.execute("SELECT content_hash, size, mtime_ns, disk_path, real_path FROM documents "
                                  "WHERE path = ?", (path,)).fetchone()
        if written != (pf.content_hash, pf.file.size, pf.file.mtime_ns, pf.file.disk_path, pf.file.real_path):
            return False
        chunks = self.db.execute("SELECT id, embed_key FROM chunks WHERE path = ? ORDER BY chunk_index", (path,))
        return chunks.fetchall() == [(rules.chunk_id(path, pf.content_hash, chunk.index), key)
                                     for chunk, key in zip(pf.chunks, pf.keys, strict=True)]

    def _chunk_ids_of(self, paths: Sequence[str]) -> dict[str, str]:
        out: dict[str, str] = {}
        for path in paths:
            out.update(self.db.execute("SELECT id, lifecycle FROM chunks WHERE path = ?", (path,)))
        return out

    def _count_common_terms(self, rows: Iterable[Sequence[str]], change: int) -> None:
        """Keep common_terms exact: each row's common terms counted in (1) or out (-1), in the
        caller's transaction."""
        if not self._common_terms:
            return
        delta: collections.Counter[str] = collections.Counter()
        for row in rows:
            delta.update(rules.row_terms(*row) & self._common_terms)
        self.db.executemany("UPDATE common_terms SET passages = passages + ? WHERE term = ?",
                            [(change * n, term) for term, n in delta.items()])

    def _delete_rows(self, paths: Sequence[str]) -> None:
        for path in paths:
            if self._common_terms:
                self._count_common_terms(self.db.execute(
                    "SELECT title, heading, body FROM chunks_fts WHERE rowid IN "
                    "(SELECT rowid FROM chunks WHERE path = ?)", (path,)), -1)
            gone = self.db.execute("DELETE FROM chunks_fts WHERE rowid IN (SELECT rowid FROM chunks WHERE path = ?)",
                                   (path,))
            self.db.execute("DELETE FROM chunk_steps WHERE rowid IN (SELECT rowid FROM chunks WHERE path = ?)", (path,))
            self._rows_written += max(gone.rowcount, 0)
            self.db.execute("DELETE FROM chunks WHERE path = ?", (path,))
            self.db.execute("DELETE FROM documents WHERE path = ?", (path,))
            self.db.execute("DELETE FROM extracted WHERE path = ?", (path,))
            self.db.execute("DELETE FROM vectors_pending WHERE path = ?", (path,))

    def _insert_rows(self, pf: PreparedFile) -> None:
        doc, path = pf.doc, pf.file.path
        self._rows_written += len(pf.chunks)
        fts_rows = []
        sections = rules.section_ranges(pf.chunks, _section_headings(doc))
        for chunk, key in zip(pf.chunks, pf.keys, strict=True):
            # The searchable text is stored only where it is not the text's own (MDX's tags, rST's roles).
            searchable = None if chunk.searchable == rules.searchable_text(chunk.text) else chunk.searchable
            cur = self.db.execute(
                "INSERT INTO chunks(id, path, chunk_index, start_line, end_line, heading, lifecycle, text, embed_key, "
                "searchable, kind, symbol, section_start, section_end) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (rules.chunk_id(path, pf.content_hash, chunk.index), path, chunk.index, chunk.start_line,
                 chunk.end_line, chunk.heading, doc.lifecycle, chunk.text, key, searchable, doc.kind, chunk.symbol,
                 *sections[chunk.index]))
            fts_row = rules.keyword_row(doc.title, chunk.heading, chunk.searchable)
            self.db.execute("INSERT INTO chunks_fts(rowid, title, heading, body) VALUES (?, ?, ?, ?)",
                            (cur.lastrowid, *fts_row))
            self.db.execute("INSERT INTO chunk_steps(rowid, steps) VALUES (?, ?)",
                            (cur.lastrowid, rules.passage_steps(doc.title, chunk.heading, chunk.searchable)))
            fts_rows.append(fts_row)
        self._count_common_terms(fts_rows, 1)
        self.db.execute(
            "INSERT INTO documents(path, title, lifecycle, chunk_mode, content_hash, size, mtime_ns, disk_path, "
            "real_path, line_count, chunk_count, cjk_share, pages, superseded_by, tags, dated, kind, language, "
            "sections_recorded, read_with) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 1, ?)",
            (path, doc.title, doc.lifecycle, doc.chunk_mode, pf.content_hash, pf.file.size, pf.file.mtime_ns,
             pf.file.disk_path, pf.file.real_path, doc.line_count, len(pf.chunks),
             round(rules.cjk_share("\n".join(doc.text.searchable[doc.body_start - 1:])), 4),
             rules.pages_column(doc.text.pages), *_key_columns(doc), doc.kind, doc.language, doc.reader.stamp))
        if doc.reader.extracted:
            self.db.execute("INSERT INTO extracted(path, text) VALUES (?, ?)", (path, "\n".join(doc.lines)))

    def _delete_vectors(self, ids: dict[str, str]) -> None:
        for lifecycle in rules.LIFECYCLES:
            self.vectors.delete(lifecycle, [i for i, lc in ids.items() if lc == lifecycle])

    def compact_keywords(self) -> bool:
        """Rewrite the keyword index into one FTS5 segment once enough of it was written since the
        last rewrite (KEYWORD_OPTIMIZE_SHARE); whether it did.

        FTS5 writes a segment per transaction and merges them only part way, so after a build of
        thousands of commit groups a query term is looked up in a dozen or more b-trees, and a
        common word's matches are merged across all of them on every search. One transaction;
        a server keeps reading the previous segments meanwhile (WAL). common_terms is counted anew
        with it. A failure (a full disk) leaves the index as it was, correct and slower: a later
        run tries again."""
        row = self.db.execute("SELECT value FROM meta WHERE key = ?", (META_ROWS_SINCE_OPTIMIZE,)).fetchone()
        written = (int(row[0]) if row else 0) + self._rows_written
        if not written:
            return False
        due = written >= KEYWORD_OPTIMIZE_SHARE * max(self.counts()[1], 1)
        started = time.monotonic()
        try:
            with transaction(self.db):
                if due:
                    self.db.execute("INSERT INTO chunks_fts(chunks_fts) VALUES ('optimize')")
                    self.db.execute("INSERT INTO chunk_steps(chunk_steps) VALUES ('optimize')")
                    rules.recount_common_terms(self.db)
                self.db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)",
                                (META_ROWS_SINCE_OPTIMIZE, "0" if due else str(written)))
        except sqlite3.Error as exc:
            log.warning("the keyword index was not compacted (%s); searches stay correct, and a later run "
                        "tries again", rules.shown(exc, 200))
            return False
        self._rows_written = 0
        if due:
            self._common_terms = {term for (term,) in self.db.execute("SELECT term FROM common_terms")}
            # The WAL now holds the whole rewrite; give its space back when no reader needs it.
            with contextlib.suppress(sqlite3.Error):
                self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            log.info("keyword index compacted into one segment in %.1f s (%d rows written since the last time)",
                     time.monotonic() - started, written)
        return due

    def counts(self) -> tuple[int, int]:
        files = self.db.execute("SELECT count(*) FROM documents").fetchone()[0]
        chunks = self.db.execute("SELECT count(*) FROM chunks").fetchone()[0]
        return files, chunks

    def stamp(self, stamp: rules.IndexStamp, found: rules.FilesFound, in_vectors: bool) -> None:
        """The stamp and what the walk found in the keyword index, and (in_vectors) the stamp in the
        vector store's metadata too."""
        facts = rules.corpus_facts(self.db.execute("SELECT path, lifecycle, cjk_share FROM documents"))
        with transaction(self.db):
            self.db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('stamp', ?)", (json.dumps(stamp.to_dict()),))
            self.db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)",
                            (rules.META_CORPUS_FACTS, facts.to_json()))
            self.db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)",
                            (rules.META_FILES_FOUND, found.to_json()))
            self.db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('manifest', ?)",
                            (json.dumps(self.manifest.to_dict()),))
        if in_vectors:
            # A store's metadata takes scalars only: the fingerprint goes as its JSON text.
            self.vectors.merge_metadata({f"stamp_{k}": json.dumps(v) if isinstance(v, dict) else v
                                         for k, v in stamp.to_dict().items() if v is not None})


# ---------------------------------------------------------------------------
# Stamp and lock.


# The corpus is untrusted input, and so is the git repository around it: its .git/config can
# name programs that `git status` would run (an fsmonitor hook, clean filters for files it
# re-hashes, hooks run when the index is refreshed, commands in submodules). Git is asked only
# for the commit and for whether anything under the corpus changed, with all of that switched off.
GIT_TIMEOUT_S = 20.0
_GIT_SAFETY = ("-c", "core.fsmonitor=false", "-c", "core.hooksPath=/dev/null", "-c", "core.untrackedCache=false",
               "-c", "protocol.allow=never", "-c", "core.pager=cat", "-c", "diff.external=", "-c", "core.quotePath=false")


def _git(corpus: Path, *args: str) -> str | None:
    """git's stdout for one command in the corpus with every safety above, or None on failure."""
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0", "GIT_TERMINAL_PROMPT": "0", "GIT_PAGER": "cat"}
    try:
        done = subprocess.run(["git", *_GIT_SAFETY, "-C", str(corpus), *args], capture_output=True, text=True,
                              timeout=GIT_TIMEOUT_S, env=env, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    # check-ignore answers 1 when nothing given to it is ignored: an answer, not a failure.
    return done.stdout if done.returncode == 0 or (args[:1] == ("check-ignore",) and done.returncode == 1) else None


def corpus_git_state(corpus: Path) -> tuple[str | None, bool | None]:
    """(HEAD commit, dirty) of the git work tree the corpus is in; (None, None) outside git."""
    head = _git(corpus, "rev-parse", "HEAD")
    if head is None:
        return None, None
    # Filter programs come from the repository's config; each one named there is set to nothing.
    filters = _git(corpus, "config", "--name-only", "--get-regexp", r"^filter\..*\.(clean|smudge|process)$") or ""
    disabled = [arg for name in filters.split() for arg in ("-c", f"{name}=")]
    disabled += [arg for name in {n.rsplit(".", 1)[0] for n in filters.split()} for arg in ("-c", f"{name}.required=false")]
    status = _git(corpus, *disabled, "status", "--porcelain", "--ignore-submodules=all", "--", ".")
    return head.strip(), None if status is None else bool(status.strip())


@contextlib.contextmanager
def ingest_lock(layout: rules.StoreLayout) -> Iterator[None]:
    layout.root.mkdir(parents=True, exist_ok=True)
    # O_NOFOLLOW: a link planted under the lock's name is refused, never truncated through.
    try:
        fd = os.open(layout.lock_file, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise RagError(ErrorCode.STORE_UNWRITABLE, f"{layout.lock_file} is a symbolic link; ingest does not write "
                           "through links in the store", f"remove {layout.lock_file} and run ingest again") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise RagError(ErrorCode.STORE_UNWRITABLE, f"{layout.lock_file} is not a regular file",
                       f"remove {layout.lock_file} and run ingest again")
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _lock_holder(fd)
            raise RagError(ErrorCode.LOCK_HELD, f"another ingest (pid {holder}) is writing {layout.root}",
                           "wait for it to finish, then run ingest again") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)


WATCH_LOCK_RETRY_S = 1.0  # a watcher waiting for another to stop looks again this often


@contextlib.contextmanager
def watch_lock(layout: rules.StoreLayout) -> Iterator[None]:
    """One watcher a store: the store's watch lock, held while this watcher lives (the kernel lets
    go of it when the process dies, kill -9 included, so a crashed watcher never blocks the next).
    When another process holds it, say so once and wait: this one takes over when that one
    stops (a systemd watcher restarted beside a server's, say). Ctrl-C ends the wait."""
    layout.root.mkdir(parents=True, exist_ok=True)
    fd = os.open(layout.watch_lock_file, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    try:
        said = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not said:
                    log.warning("another watcher (pid %s) keeps %s fresh; this one waits and takes over when it stops",
                                _lock_holder(fd), layout.root)
                    said = True
                time.sleep(WATCH_LOCK_RETRY_S)
        if said:
            log.warning("the other watcher stopped; this one watches %s now", layout.root)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)


def _lock_holder(fd: int) -> str:
    """The pid the lock's holder wrote into the lock file. It writes it just after taking the lock,
    so an ingest started at the same moment can look before it is there (measured: 1 in 6 runs
    reported "pid unknown"): look again for a moment."""
    for _ in range(50):
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
        if holder:
            return holder
        time.sleep(0.01)
    return "unknown"


# ---------------------------------------------------------------------------
# The run.


@dataclass
class Summary:
    scanned: int = 0
    added: int = 0
    updated: int = 0
    unchanged: int = 0
    removed: int = 0
    excluded: int = 0  # rag: false
    ignored: int = 0  # files and folders left out by the scope (built-in rules, .ragignore, git)
    failed: int = 0
    chunks_written: int = 0
    chunks_embedded: int = 0  # by Ollama, in this run
    chunks_reused: int = 0  # took a vector the index already had (same embedded text)
    left_for_next_run: int = 0  # changed files that keep their old chunks: the embedder became unavailable
    chunks_without_vectors: int = 0  # written for keyword search only in this run (not in chunks_written)
    vectors_pending: int = 0  # chunks of the index that wait for their vectors, after this run
    embedding_calls: int = 0
    # Per Ollama host: calls, chunks, most calls in flight, the level it settled at, why it left the rotation.
    embedders: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    commit: str | None = None
    dirty: bool | None = None
    index: str = ""
    rebuilt: bool = False
    model_changed: bool = False  # Ollama listed other weights under the model's name: all re-embedded
    dry_run: bool = False
    estimated_chunks: int = 0
    errors: list[str] = field(default_factory=list)
    listing: list[dict[str, str]] = field(default_factory=list)  # dry run: what it would do to each path
    # What the walk found per file extension and what became of each file (rules.FilesFound).
    files_found: dict[str, dict[str, int]] = field(default_factory=dict)

    def line(self) -> str:
        if self.dry_run:
            return (f"dry run: {self.scanned} scanned, {'would rebuild the index: ' if self.rebuilt else ''}"
                    f"would add {self.added}, update {self.updated}, "
                    f"remove {self.removed}; {self.unchanged} unchanged, {self.excluded} excluded, {self.ignored} ignored, "
                    f"{self.failed} failed; about {self.estimated_chunks} chunks to embed")
        left = f", {self.left_for_next_run} left for the next run" if self.left_for_next_run else ""
        left += ", every chunk re-embedded: the model's weights changed" if self.model_changed else ""
        keyword_only = (f", {self.chunks_without_vectors} indexed for keyword search first" if self.chunks_without_vectors
                        else "")
        waiting = f"; {self.vectors_pending} chunks without vectors" if self.vectors_pending else ""
        return (f"{self.scanned} scanned, {self.added} added, {self.updated} updated, {self.unchanged} unchanged, "
                f"{self.removed} removed, {self.excluded} excluded, {self.ignored} ignored, {self.failed} failed{left}; "
                f"{self.chunks_written} chunks written ({self.chunks_embedded} embedded, {self.chunks_reused} reused)"
                f"{keyword_only}, {self.embedding_calls} embedding calls, {self.seconds:.1f} s, "
                f"corpus commit {self.commit or 'none'}{' (dirty)' if self.dirty else ''}{waiting}")


@dataclass
class Plan:
    """What the walk found, compared with the registry. `changed` files are parsed, not chunked yet
    (chunking needs the model's context length)."""

    unchanged: list[CorpusFile] = field(default_factory=list)
    mtime_only: list[tuple[CorpusFile, DocumentRow]] = field(default_factory=list)
    # Unchanged content at a new location on disk (the corpus folder moved).
    relocated: list[CorpusFile] = field(default_factory=list)
    changed: list[PreparedFile] = field(default_factory=list)
    excluded: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    removed: list[str] = field(default_factory=list)
    # Changed files with no vectors in the index (new ones, or ones waiting for vectors): the ones
    # that can be indexed for keyword search first. `waiting_as_they_were`: waiting, content the same.
    without_vectors: set[str] = field(default_factory=set)
    waiting_as_they_were: set[str] = field(default_factory=set)
    # Unchanged files read again because the store had not recorded all their document keys
    # (see DocumentRow.keys_unrecorded): what to record for each.
    keys: dict[str, rules.SourceDocument] = field(default_factory=dict)
    # Files read again because a newer reader reads their format (DocumentRow.read_again): updated,
    # their passages whose text is the same keeping their vectors.
    reread: set[str] = field(default_factory=set)
    warnings: list[str] = field(default_factory=list)  # of the files parsed (SourceDocument.warnings)

    def writes_vectors(self) -> bool:
        """Whether carrying out the plan writes to the vector store."""
        return bool(self.changed or self.removed or self.mtime_only)


def plan_changes(walk: Walk, registry: dict[str, DocumentRow], full: bool,
                 waiting: Collection[str] = ()) -> Plan:
    """Compare the walk with the registry: stat first, content hash only for files whose size or
    mtime moved. Files `waiting` for their vectors are changed files whatever their content.
    Needs neither Ollama nor a write."""
    plan = Plan(failed=dict(walk.failures))
    seen = set(walk.failures)
    for folder, reason in walk.unreadable.items():
        for path in registry:
            if rules.path_matches_prefix(path, folder):
                plan.failed.setdefault(path, f"{path}: kept as indexed: its folder {folder} cannot be listed ({reason})")
                seen.add(path)
    root_fd = rules.open_folder(walk.root_real, walk.root_id) if walk.files else -1
    try:
        _compare_files(plan, seen, walk, registry, root_fd, full, waiting)
    finally:
        if root_fd >= 0:
            os.close(root_fd)
    excluded = set(plan.excluded)
    plan.removed = sorted(p for p in registry if p not in seen or p in excluded)
    return plan


def _compare_files(plan: Plan, seen: set[str], walk: Walk, registry: dict[str, DocumentRow], root_fd: int,
                   full: bool, waiting: Collection[str]) -> None:
    for file in walk.files:
        seen.add(file.path)
        row = registry.get(file.path)
        waits = file.path in waiting
        stat_unchanged = row is not None and rules.looks_unchanged(file.size, file.mtime_ns, row.size, row.mtime_ns)
        unrecorded = row is not None and row.keys_unrecorded()
        reread = row is not None and row.read_again()
        if reread:
            plan.reread.add(file.path)
        if row and not full and not waits and stat_unchanged and not unrecorded and not reread:
            plan.unchanged.append(file)
            if (file.disk_path, file.real_path) != (row.disk_path, row.real_path):
                plan.relocated.append(file)
            continue
        over = rules.text_file_over_budget(file.path, file.size)
        if over is not None:  # never read: its bytes alone could outgrow the memory
            plan.failed[file.path] = over.message
            continue
        try:
            # Opened beneath the root without following links, and only if it is still the file the
            # walk saw (a swap for a link, FIFO or device in between is refused, never followed).
            raw = rules.read_beneath(root_fd, file.parts_below(walk.root_real), identity=file.identity, size=file.size)
        except rules.PathChanged as exc:
            plan.failed[file.path] = f"{file.path}: not read: {exc}; run ingest again"
            continue
        except OSError as exc:
            plan.failed[file.path] = f"{file.path}: cannot read ({exc.strerror})"
            continue
        digest = rules.content_hash(raw)
        if row and not full and not waits and row.content_hash == digest and not reread:
            if unrecorded:
                try:
                    doc = read_document(raw, file.path)
                except RagError as exc:
                    plan.failed[file.path] = exc.message
                    continue
                plan.keys[file.path] = doc
                plan.warnings.extend(doc.warnings)
            if stat_unchanged:
                plan.unchanged.append(file)
            else:
                plan.mtime_only.append((file, row))
            if (file.disk_path, file.real_path) != (row.disk_path, row.real_path):
                plan.relocated.append(file)
            continue
        try:
            doc = read_document(raw, file.path)
        except RagError as exc:
            plan.failed[file.path] = exc.message
            continue
        plan.warnings.extend(doc.warnings)
        if not doc.rag:
            plan.excluded.append(file.path)
            continue
        plan.changed.append(PreparedFile(file, doc, digest, []))
        if row is None or waits:
            plan.without_vectors.add(file.path)
        if waits and row is not None and row.content_hash == digest:
            plan.waiting_as_they_were.add(file.path)


# How long one text file's reader may take. The size budgets (corpus_rules.TEXT_FILE_MAX_BYTES,
# _LINES) bound the readers to seconds on any file they let through; this is the backstop for a
# reader that meets input it is slow on: that file fails, by name, and the rest is indexed.
# A PDF's extraction has its own time limit, in its child process.
READ_TIME_BUDGET_S = 60.0


class _ReadTimeUp(BaseException):  # not an Exception: a reader's `except Exception` must not swallow it
    pass


def read_document(raw: bytes, path: str, seconds: float | None = None) -> rules.SourceDocument:
    """rules.parse_document within READ_TIME_BUDGET_S (`seconds`), else document_invalid saying so.
    The clock is SIGALRM's: it interrupts the reader between two Python steps (one C call, such as a
    regular expression's match, runs to its end first). Only on the main thread, where ingest reads.
    Where the interruption lands in code that swallows it (a garbage collector's callback), the
    read runs on to its end and the file fails all the same: the clock rang."""
    seconds = READ_TIME_BUDGET_S if seconds is None else seconds
    reader = rules.reader_for(path)
    if reader is None or reader.extracted or threading.current_thread() is not threading.main_thread():
        return rules.parse_document(raw, path)
    rang: list[bool] = []

    def time_up(*_: Any) -> None:
        rang.append(True)
        raise _ReadTimeUp

    previous = signal.signal(signal.SIGALRM, time_up)
    try:
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            document = rules.parse_document(raw, path)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        if rang:
            raise _ReadTimeUp
        return document
    except _ReadTimeUp:
        raise RagError(ErrorCode.DOCUMENT_INVALID, f"{path}: reading it took more than {seconds:g} s, the time one "
                       "text file may take; split it to index it", "split it into smaller files") from None
    finally:
        signal.signal(signal.SIGALRM, previous)


def chunk_files(files: Sequence[PreparedFile], budget: ChunkBudget) -> None:
    for pf in files:
        pf.chunks = rules.chunk_document(pf.doc, budget(pf.doc.title), budget.min_tokens, budget.context(pf.doc.title))


@dataclass
class ChunkBudget:
    context_length: int
    target: int
    min_tokens: int
    scheme: rules.PrefixScheme

    def __call__(self, title: str) -> int:
        return chunk_budget(self.context_length, self.target, self.scheme, title)

    def context(self, title: str) -> int:
        """What the model takes of a chunk's heading and text beside the prefix and title: up to
        this a long line stays whole and a small span joins a neighbour."""
        return max(16, self.context_length - prefix_tokens(self.scheme, title))


@dataclass(frozen=True)
class ModelFacts:
    """What ingest needs to know about the embedding model, asked of the server once per run."""

    dims: int
    context_length: int
    digest: str | None = None  # as Ollama's /api/tags lists it; None where the server does not say
    fingerprint: rules.ModelFingerprint | None = None  # None only for facts made without asking


def probe_model(embedder: rules.Embedder, scheme: rules.PrefixScheme, settings: rules.Settings) -> ModelFacts:
    """Ask the server for the model's dimensions, context length and fingerprint (RagError when it
    is down or lacks the model). Called before the store is touched whenever anything may need
    embedding. With RAG_EMBED_DIMENSIONS the dimensions are the ones asked for, once one vector
    shows that the server honours them."""
    info = embedder.model_info()
    probe = [scheme.query_text("dimension probe")]
    native = info.dims or len(replace(embedder, dimensions=None).embed(probe)[0])
    dims = native
    if embedder.dimensions is not None:
        if embedder.dimensions > native:
            raise RagError(ErrorCode.INVALID_ARGUMENT,
                           f"configuration error: RAG_EMBED_DIMENSIONS={embedder.dimensions} is more than the "
                           f"{native} dimensions of {embedder.model!r}", f"set RAG_EMBED_DIMENSIONS to {native} or "
                           "fewer (a size the model was trained for: EmbeddingGemma's are 768, 512, 256 and 128), "
                           "or unset it for the model's own size")
        dims = len(embedder.embed(probe)[0])  # the embedder checks it is the size asked for
    fingerprint = fingerprint_of(embedder, dims)
    try:
        digest = embedder.model_digest()
    except RagError as exc:  # only a safeguard: a server that cannot list its models still embeds
        log.info("%s did not list its models (%s); re-pulled weights are noticed by the fingerprint alone",
                 embedder.where, exc.message)
        digest = None
    return ModelFacts(dims=dims, context_length=info.context_length or settings.chunk_max_tokens, digest=digest,
                      fingerprint=fingerprint)


def fingerprint_of(embedder: rules.Embedder, dims: int) -> rules.ModelFingerprint | None:
    """The host's model fingerprint; None (not known this run) for a host that fails the probe or
    answers it in another size than it reports: its embedding calls say what is wrong with them."""
    try:
        fingerprint = embedder.fingerprint()
    except rules.InputTooLong:  # a context shorter than one sentence: nothing to embed chunks with either
        return None
    except RagError as exc:
        if exc.code not in EMBEDDER_DOWN:
            raise
        log.warning("%s: the model's fingerprint is not known this run (%s)", exc.message, exc.hint)
        return None
    return fingerprint if fingerprint.dims == dims else None


def weights_changed(current: rules.CurrentIndex | None, index_name: str, model: ModelFacts | None) -> bool:
    """Whether the server's model is not the one the live index was embedded with, under the same
    name: another digest listed (a re-pull), or vectors whose fingerprint disagrees (another
    quantisation or model behind the name, whatever the server lists). Every stored vector is then
    stale, even with the same dimensions."""
    if current is None or current.index != index_name or model is None:
        return False
    digest_moved = None not in (model.digest, current.stamp.model_digest) and model.digest != current.stamp.model_digest
    recorded = current.stamp.fingerprint
    return digest_moved or (None not in (recorded, model.fingerprint)
                            and not model.fingerprint.agrees(recorded))  # type: ignore[union-attr]  # both known


def how_the_model_changed(current: rules.CurrentIndex, model: ModelFacts) -> str:
    recorded, now = current.stamp.fingerprint, model.fingerprint
    if recorded is not None and now is not None and not now.agrees(recorded):
        return (f"its vectors' fingerprint moved: {recorded.describe()} then, {now.describe()} now, similarity "
                f"{now.similarity(recorded):.3f}")
    return f"digest {(current.stamp.model_digest or '?')[:12]}, now {(model.digest or '?')[:12]}"


def probe_hosts(embedders: Sequence[rules.Embedder], scheme: rules.PrefixScheme, settings: rules.Settings,
                reference: rules.ModelFingerprint | None = None) -> tuple[ModelFacts, list[rules.Embedder]]:
    """The model's facts and the hosts that embed with it in this run. One host: probe_model's
    facts, or its error. Several: asked at once; a host that is down or lacks the model is left
    out of the run (a warning), and the error is raised only when no host answers. Hosts whose
    model differs (its fingerprint: another model, quantisation or size behind the name) are left
    out by name (see agreeing_hosts): vectors from them could not be compared with the others'."""
    if len(embedders) == 1:
        model = probe_model(embedders[0], scheme, settings)
        warn_if_served_model_differs(embedders[0], model, scheme)
        return model, list(embedders)
    calls = [rules.on_call_thread(functools.partial(probe_model, embedder, scheme, settings)) for embedder in embedders]
    facts: dict[str, ModelFacts] = {}
    failures: list[RagError] = []
    for embedder, call in zip(embedders, calls, strict=True):
        try:
            facts[embedder.host] = call.result()
        except RagError as exc:
            if exc.code not in EMBEDDER_DOWN:
                raise
            failures.append(exc)
    if not facts:  # the first host's error is the run's; the others are said too
        for exc in failures[1:]:
            log.warning("%s (%s)", exc.message, exc.hint)
        raise failures[0]
    for exc in failures:
        log.warning("%s: that host is left out of this run (%s)", exc.message, exc.hint)
    kept = agreeing_hosts(embedders, facts, reference)
    first = facts[kept[0].host]
    warn_if_served_model_differs(kept[0], first, scheme)
    return (ModelFacts(dims=first.dims, context_length=min(facts[e.host].context_length for e in kept),
                       digest=first.digest, fingerprint=first.fingerprint), kept)


def agreeing_hosts(embedders: Sequence[rules.Embedder], facts: Mapping[str, ModelFacts],
                   reference: rules.ModelFingerprint | None) -> list[rules.Embedder]:
    """The hosts (of those that answered) whose fingerprints agree: with the index's when some
    host's does (`reference`), else the largest group (the earliest host's on a tie: the one a
    user lists first). Each host left out is named, with how far its vectors are from the others'."""
    answered = [e for e in embedders if e.host in facts]

    if all(facts[e.host].fingerprint is None for e in answered):
        return answered  # none could be checked (each too slow for the probe): the dimensions are, per call

    def group(fingerprint: rules.ModelFingerprint | None) -> list[rules.Embedder]:
        return [e for e in answered if fingerprint is not None and (fp := facts[e.host].fingerprint) is not None
                and fp.agrees(fingerprint)]

    by_index = group(reference)
    if by_index:
        kept, chosen, against = by_index, reference, "the index's vectors"
    else:
        kept = max((group(facts[e.host].fingerprint) for e in answered), key=len)
        chosen, against = facts[kept[0].host].fingerprint, kept[0].where
    for embedder in answered:
        if embedder in kept:
            continue
        fp = facts[embedder.host].fingerprint
        if fp is None:  # said by fingerprint_of; its vectors could not be compared with the others'
            log.warning("%s could not be checked against %s: that host is left out of this run", embedder.where,
                        against)
            continue
        log.warning("%s embeds with another model than %s (%s; fingerprint similarity %.3f, %s needed): that host "
                    "is left out of this run (%s, or leave it out of %s)", embedder.where, against, fp.describe(),
                    fp.similarity(chosen) if chosen is not None else 0.0, rules.FINGERPRINT_MIN_COSINE,
                    embedder.model_hint(), embedder.HOSTS_VARIABLE)
    return kept


def warn_if_served_model_differs(embedder: rules.Embedder, facts: ModelFacts, scheme: rules.PrefixScheme) -> None:
    """The prefixes follow RAG_EMBED_MODEL (or RAG_EMBED_PREFIXES): say so when the server reports
    a model of another known family (an OpenAI-compatible server serves what it loaded, whatever
    the request names)."""
    served = facts.fingerprint.served_model if facts.fingerprint is not None else None
    family = rules.prefix_scheme_for(served) if served else None
    if family is not None and family.name != scheme.name:
        log.warning("%s reports the model %r (%s prefixes) but this run uses %s prefixes for %r: set RAG_EMBED_MODEL "
                    "(or RAG_EMBED_PREFIXES) to match what it serves", embedder.where, served, family.name,
                    scheme.name, embedder.model)


def probe_model_if_reachable(settings: rules.Settings, scheme: rules.PrefixScheme,
                             reference: rules.ModelFingerprint | None = None) -> ModelFacts | None:
    quick = [settings.embedder(host, timeout_s=min(settings.embed_timeout_s, OPTIONAL_PROBE_TIMEOUT_S),
                               dimensions=settings.embed_dimensions)
             for host in settings.ollama_hosts]
    try:
        return probe_hosts(quick, scheme, settings, reference)[0]
    except RagError as exc:
        log.info("nothing to embed, so this run goes on without the embedding server (%s)", exc.message)
        return None


def context_length_if_reachable(settings: rules.Settings) -> int | None:
    """The model's context length as the first host of OLLAMA_HOST reports it, within
    OPTIONAL_PROBE_TIMEOUT_S; None when it does not say."""
    embedder = settings.embedder(settings.ollama_host, timeout_s=min(settings.embed_timeout_s, OPTIONAL_PROBE_TIMEOUT_S))
    try:
        return embedder.model_info().context_length
    except RagError:
        return None


def assumed_context_length(settings: rules.Settings, scheme: rules.PrefixScheme) -> int:
    """The model's context when Ollama cannot say (a dry run, a run without Ollama): its registry entry's."""
    return rules.REGISTRY_CONTEXT_LENGTH.get(scheme.name, settings.chunk_max_tokens)


def scheme_for(settings: rules.Settings) -> rules.PrefixScheme:
    """The model's query and document prefixes: RAG_EMBED_PREFIXES' scheme when set, else the one
    of RAG_EMBED_MODEL's family (whatever the API: EmbeddingGemma through llama-server is still
    EmbeddingGemma), else none."""
    if settings.embed_prefixes is not None:
        return rules.PREFIX_SCHEMES[settings.embed_prefixes]
    model = settings.embed_model
    scheme = rules.prefix_scheme_for(model)
    if scheme is None:
        log.warning("unknown embedding model %r: no query/document prefixes will be used (RAG_EMBED_PREFIXES names "
                    "a scheme for it)", model)
        return rules.PREFIX_SCHEMES["none"]
    return scheme


_T = TypeVar("_T")


def _registry_of(layout: rules.StoreLayout, current: rules.CurrentIndex | None) -> dict[str, DocumentRow]:
    return _read_live(layout, current, load_registry, {})


def run_settings(args: argparse.Namespace) -> rules.Settings:
    """The settings of a run (or a watch): the environment's, --corpus, --store and --code. An index
    built with code is read with code again unless RAG_CODE says otherwise: a run without --code (a
    watcher a server started, a re-index typed from memory) must not remove the code."""
    settings = rules.load_settings(corpus_dir=args.corpus, store_dir=args.store, code=args.code or None)
    if settings.code or "RAG_CODE" in os.environ or not _holds_code(rules.StoreLayout(settings.store_dir)):
        return settings
    log.info("the index holds source code (indexed with --code or RAG_CODE=1): reading it again (RAG_CODE=0 "
             "removes it)")
    return settings.with_code()


def _holds_code(layout: rules.StoreLayout) -> bool:
    """Whether the live index holds source code: a store with no index, or one written before code, holds none."""
    try:
        return _read_live(layout, layout.read_current(), rules.holds_code, False)
    except (RagError, OSError, sqlite3.Error):  # unreadable: the run itself says why
        return False


def _waiting_of(layout: rules.StoreLayout, current: rules.CurrentIndex | None) -> dict[str, int]:
    return _read_live(layout, current, load_waiting, {})


def _read_live(layout: rules.StoreLayout, current: rules.CurrentIndex | None,
                  read: Callable[[sqlite3.Connection], _T], empty: _T) -> _T:
    """What `read` finds in the live index, read without leaving a trace: a read-only WAL
    connection would create the -wal and -shm files. immutable=1 reads the database file as it is;
    when that fails (a writer is mid-transaction), a plain read-only connection does."""
    if current is None or not layout.keyword_db(current.index).exists():
        return empty
    uri = layout.keyword_db(current.index).as_uri()
    for options in ("?mode=ro&immutable=1", "?mode=ro"):
        try:
            con = sqlite3.connect(uri + options, uri=True, timeout=30)
            try:
                return read(con)
            finally:
                con.close()
        except sqlite3.DatabaseError:
            if options == "?mode=ro":
                raise
    raise AssertionError("unreachable")


def set_aside_damaged_keywords(layout: rules.StoreLayout, current: rules.CurrentIndex) -> bool:
    """For --full: a keyword index that cannot be read (not a database, malformed) is moved aside
    as keywords.sqlite3.damaged, so the run rebuilds it from the corpus. The store's own hint names
    --full for exactly this; the damaged copy is kept for a post-mortem."""
    try:
        _registry_of(layout, current)
        return False
    except sqlite3.DatabaseError as exc:
        path = layout.keyword_db(current.index)
        log.warning("the keyword index %s is damaged (%s): set aside as %s.damaged; rebuilding it from the corpus",
                    path, exc, path.name)
        for suffix in ("", "-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.replace(f"{path}{suffix}", f"{path}.damaged{suffix}")
        return True


def check_same_corpus(current: rules.CurrentIndex | None, corpus: Path, store: Path, replace: bool) -> None:
    """A store holds the index of one corpus folder. Indexing another one into it would delete the
    first one's chunks (files it does not have count as removed), so that takes --replace-corpus."""
    if current is None or not current.corpus_dir or replace:
        return
    indexed = Path(current.corpus_dir)
    if indexed == corpus:
        return
    with contextlib.suppress(OSError):  # the indexed folder may be gone (moved)
        if os.path.samefile(indexed, corpus):
            return
    raise RagError(ErrorCode.CORPUS_MISMATCH,
                   f"the store {store} holds the index of {indexed}; this run would index {corpus} into it and "
                   f"remove every file {corpus} does not have",
                   "to index a second folder, give it its own store (--store DIR or RAG_STORE_DIR); if the folder "
                   "moved, or you mean to replace the index, pass --replace-corpus (files unchanged at the same "
                   "relative path keep their embeddings)")


def dry_run(args: argparse.Namespace, settings: rules.Settings, layout: rules.StoreLayout, walk: Walk,
            current: rules.CurrentIndex | None, summary: Summary) -> Summary:
    """What a real run would change, without Ollama and without writing anything."""
    registry, waiting = _registry_of(layout, current), _waiting_of(layout, current)
    _guard_empty(walk, registry, args.allow_empty)
    scheme = scheme_for(settings)
    # Ollama is asked the model's context length, which cuts the chunks as a run would (/api/show,
    # briefly; nothing is embedded); when it does not answer, the registry's stands in. The live
    # index's dimensions stand in for the model's (a dimension change alone goes unnoticed).
    context = context_length_if_reachable(settings) or assumed_context_length(settings, scheme)
    likely = rules.manifest_for(settings, scheme.name, dims=current.manifest.dims if current else 0)
    summary.index = current.index if current else ""
    if current is not None and likely.index_name() != current.index:
        summary.rebuilt = True  # a real run would rebuild everything into a new index
        summary.index = likely.index_name()
        registry, waiting = {}, {}
    plan = plan_changes(walk, registry, args.full, waiting)
    chunk_files(plan.changed, ChunkBudget(context, settings.chunk_max_tokens, settings.chunk_min_tokens, scheme))
    _fill_summary(summary, plan)
    for warning in plan.warnings:
        log.warning("%s", warning)
    summary.estimated_chunks = sum(len(pf.chunks) for pf in plan.changed)
    summary.listing = dry_run_listing(walk, plan, settings)
    summary.files_found = dict(files_found(walk, plan).counts)
    return summary


def dry_run_listing(walk: Walk, plan: Plan, settings: rules.Settings) -> list[dict[str, str]]:
    """Every path the run would touch or leave out, with what it would do and why: the scope a user
    can check before paying for embeddings. Its actions are the summary's counts: add, update,
    remove, exclude (rag: false), ignore (a scope rule), fail, unchanged."""
    ignored = {p: explained for p, explained in explain_git_ignored(settings.corpus_dir, [
        p for p, why in walk.ignored.items() if why == "ignored by git"]).items()}
    entries = [{"path": pf.file.path, "action": "add" if pf.file.path in plan.without_vectors else "update",
                "reason": (f"indexed for keyword search; its {len(pf.chunks)} chunk(s) to embed"
                           if pf.file.path in plan.waiting_as_they_were else
                           f"read again by a newer {pf.doc.reader.format} reader; {len(pf.chunks)} chunk(s) to embed or reuse"
                           if pf.file.path in plan.reread else f"{len(pf.chunks)} chunk(s) to embed or reuse")}
               for pf in plan.changed]
    entries += [{"path": f.path, "action": "unchanged", "reason": ""} for f in plan.unchanged]
    entries += [{"path": f.path, "action": "unchanged", "reason": "content unchanged, mtime moved"}
                for f, _ in plan.mtime_only]
    entries += [{"path": p, "action": "exclude", "reason": "rag: false"} for p in plan.excluded]
    entries += [{"path": p, "action": "ignore", "reason": ignored.get(p, why)} for p, why in walk.ignored.items()]
    entries += [{"path": p, "action": "fail", "reason": why} for p, why in plan.failed.items()]
    entries += [{"path": p, "action": "remove", "reason": removal_reason(p, plan, walk, settings.formats)}
                for p in plan.removed]
    order = {"add": 0, "update": 1, "remove": 2, "exclude": 3, "ignore": 4, "fail": 5, "unchanged": 6}
    return sorted(entries, key=lambda e: (order[e["action"]], e["path"]))


def listing_line(entry: Mapping[str, str]) -> str:
    """A dry-run listing entry as a person reads it: a corpus path (and a rule quoted from an ignore
    file) reach a terminal here, so each goes through the server CLI's rule (rules.metadata_text:
    control sequences, bidi overrides and line breaks neutralised), never cut; --json stays exact."""
    path, reason = (rules.metadata_text(entry[key], max(1, len(entry[key]))) for key in ("path", "reason"))
    return f"{entry['action']:9} {path}" + (f"  ({reason})" if reason else "")


def removal_reason(path: str, plan: Plan, walk: Walk, formats: Collection[str]) -> str:
    """Why an indexed document leaves the index: excluded, ignored (itself or a folder of it), of a
    format no longer read, or gone from the folder."""
    if path in plan.excluded:
        return "now excluded (rag: false)"
    rule = walk.ignored.get(path) or next((why for p, why in walk.ignored.items()
                                           if p.endswith("/") and path.startswith(p)), None)
    if rule is not None:
        return f"now ignored ({rule})"
    if rules.reader_for(path, formats) is None:
        return rules.not_read_reason(rules.file_extension(path))
    return "gone from the corpus"


def run(args: argparse.Namespace, summary: Summary | None = None, vectors: rules.Vectors | None = None) -> Summary:
    """One ingest run. `summary` is filled in as the run goes, so a run that stops on an error can
    still report what it did. `vectors`: a vector process to use (--watch keeps one for all its
    runs); by default the run starts its own."""
    summary = Summary(dry_run=args.dry_run) if summary is None else summary
    started = time.monotonic()
    settings = run_settings(args)
    corpus = settings.corpus_dir
    if not corpus.is_dir():  # before the configuration is shown: an installed copy has no default corpus to show
        raise rules.no_corpus_configured(settings) or RagError(
            ErrorCode.CORPUS_MISSING, f"corpus folder {corpus} does not exist", "set RAG_CORPUS_DIR or pass --corpus DIR")
    log.info("resolved configuration: %s", settings.describe())
    for warning in rules.unknown_variables():
        log.warning("%s", warning)
    layout = rules.StoreLayout(settings.store_dir)
    # Started when the run knows it has work (see _run_stages), not for a run with nothing to write.
    owned = vectors is None and not args.dry_run
    if owned:
        vectors = VectorProcess()
    try:
        _run_stages(args, summary, settings, layout, vectors)
    finally:
        if owned:
            vectors.shut()  # type: ignore[union-attr]  # owned: made above, never None here
        summary.seconds = time.monotonic() - started  # a run that failed took its time too
    return summary


@dataclass(frozen=True)
class Run:
    """One ingest run: what it was asked, what the walk found, and what it learned of the live
    index and the model. Every stage reads it; a stage that learns something returns a new Run
    with it (the look before the lock: `model`, `hosts`, `unembeddable`; under the lock:
    `current`, `full`), never writes into the one it was given."""

    args: argparse.Namespace
    settings: rules.Settings
    layout: rules.StoreLayout
    summary: Summary
    walk: Walk
    scheme: rules.PrefixScheme
    embedders: list[rules.Embedder]  # one per host of OLLAMA_HOST
    current: rules.CurrentIndex | None  # the live index; read again under the lock
    model: ModelFacts | None = None  # None: Ollama did not answer, or was not needed
    hosts: list[rules.Embedder] = field(default_factory=list)  # those that embed in this run (probed)
    # Why nothing can be embedded in this run (Ollama down, or without the model) when the run
    # goes on to index files for keyword search only.
    unembeddable: RagError | None = None
    full: bool = False  # no vector reused: --full, or new weights under the model's name

    def context_length(self) -> int:
        """The model's context, or (without Ollama) the one its registry entry gives: files chunked
        with it are chunked again with the model's own when they are embedded."""
        if self.model is not None:
            return self.model.context_length
        return assumed_context_length(self.settings, self.scheme)

    def index_name(self, dims: int) -> str:
        return rules.manifest_for(self.settings, self.scheme.name, dims).index_name()

    def recorded_fingerprint(self) -> rules.ModelFingerprint | None:
        """The live index's model fingerprint, which the hosts of this run are checked against."""
        return self.current.stamp.fingerprint if self.current is not None else None


@dataclass
class PlanBeforeLock:
    """The plan made before the lock, and the registry it compared the walk with: under the lock
    it stands as long as the index holds that same registry."""

    registry: dict[str, DocumentRow]
    waiting: dict[str, int]
    plan: Plan


@dataclass
class PreparedIndex:
    """The index a run writes (opened, repaired after an interrupted run) and its plan, chunked."""

    store: Store
    plan: Plan
    registry: dict[str, DocumentRow]  # what the plan compared the walk with
    waiting: dict[str, int]  # the documents of the registry that wait for vectors
    repaired: int  # vectors removed that no committed chunk owned


def _run_stages(args: argparse.Namespace, summary: Summary, settings: rules.Settings, layout: rules.StoreLayout,
            vectors: rules.Vectors | None) -> None:
    """run() once its settings are read, in stages: the walk; the look before the lock (is Ollama
    needed?); then under the lock prepare (open, plan, chunk), write and publish. `vectors` is
    None only for a dry run."""
    corpus = settings.corpus_dir
    walk = walk_corpus(corpus, settings.respect_gitignore, settings.formats)
    for warning in walk.warnings:
        log.warning("%s", warning)
    summary.scanned = len(walk.files) + len(walk.failures)
    summary.ignored = len(walk.ignored)
    current = layout.read_current()
    check_same_corpus(current, corpus, settings.store_dir, args.replace_corpus)
    if args.dry_run:
        dry_run(args, settings, layout, walk, current, summary)
        return
    assert vectors is not None
    embedders = [settings.embedder(host, keep_alive=KEEP_ALIVE, dimensions=settings.embed_dimensions)
                 for host in settings.ollama_hosts]
    run = Run(args, settings, layout, summary, walk, scheme_for(settings), embedders, current)
    run, look = _look_before_the_lock(run, vectors)
    with ingest_lock(layout):
        run, prepared = _prepare(run, vectors, look)
        try:
            changed_anything = _carry_out_plan(run, prepared)
            _publish(run, prepared, changed_anything)
        finally:
            prepared.store.close()


def _look_before_the_lock(run: Run, vectors: rules.Vectors) -> tuple[Run, PlanBeforeLock | None]:
    """Ask Ollama before the store is touched whenever anything may need embedding (when it is
    down or lacks the model, nothing in the store changes, not even the lock file). A run with
    nothing to embed does not need it: it still asks, briefly, to notice a model re-pulled with
    other dimensions (a rebuild), and goes on without it when it does not answer. Without Ollama,
    files with no vectors yet are indexed for keyword search only (see has_files_for_keywords_alone).
    Returns the run with what it learned of the model, and the plan against the live index, made
    to know that (None where the run embeds everything anyway)."""
    current = run.current
    look = None
    if current is not None and not run.args.full and run.index_name(current.manifest.dims) == current.index:
        registry, waiting = _registry_of(run.layout, current), _waiting_of(run.layout, current)
        look = PlanBeforeLock(registry, waiting, plan_changes(run.walk, registry, full=False, waiting=waiting))
    if look is None or look.plan.changed:
        vectors.start()  # Chroma's import overlaps the probe, planning and chunking
        try:
            model, hosts = probe_hosts(run.embedders, run.scheme, run.settings, run.recorded_fingerprint())
        except RagError as exc:
            if exc.code not in EMBEDDER_DOWN or not has_files_for_keywords_alone(run, look):
                raise
            log.warning("%s: new files are indexed for keyword search only; their vectors wait for the embedding server",
                        exc.message)
            return replace(run, unembeddable=exc), look
        return replace(run, model=model, hosts=hosts), look
    return replace(run, model=probe_model_if_reachable(run.settings, run.scheme, run.recorded_fingerprint())), look


EMBEDDER_DOWN = (ErrorCode.EMBEDDER_UNAVAILABLE, ErrorCode.MODEL_NOT_FOUND)


def has_files_for_keywords_alone(run: Run, look: PlanBeforeLock | None) -> bool:
    """Whether a run that cannot embed has files to index for keyword search: files with no
    vectors in the index. Never by rebuilding an index that has vectors (its replacement would
    have none): a first ingest, a rebuild of an index that has none, or new files."""
    if run.current is None:
        return True
    if look is None:
        return run.current.manifest.dims == 0
    return bool(look.plan.without_vectors - look.plan.waiting_as_they_were)


def _prepare(run: Run, vectors: rules.Vectors, look: PlanBeforeLock | None) -> tuple[Run, PreparedIndex]:
    """Under the lock: the index this run writes, opened and planned (the look before the lock
    reused when it still holds), its files chunked; the run with what it learned meanwhile. On a
    failure the index is closed again."""
    run, dims = _dims_under_the_lock(run)
    prepared = _open_and_plan(run, dims, vectors, look)
    try:
        if prepared.plan.changed and run.model is None and run.unembeddable is None:
            # Another ingest or an editor changed files since the look before the lock.
            model, hosts = probe_hosts(run.embedders, run.scheme, run.settings, run.recorded_fingerprint())
            run = replace(run, model=model, hosts=hosts)
            if model.dims != dims:
                prepared.store.close()
                prepared = _open_and_plan(run, model.dims, vectors, None)
        _report_prepared(run, prepared)
        chunk_files(prepared.plan.changed, ChunkBudget(run.context_length(), run.settings.chunk_max_tokens,
                                                  run.settings.chunk_min_tokens, run.scheme))
    except BaseException:
        prepared.store.close()
        raise
    return run, prepared


def _dims_under_the_lock(run: Run) -> tuple[Run, int]:
    """The live index read again (another run may have published since the look) and the guards
    checked before anything is written; the run with that index and whether it re-embeds every
    chunk (full), and the vectors' dimensions this run writes."""
    current = run.layout.read_current()
    check_same_corpus(current, run.settings.corpus_dir, run.settings.store_dir, run.args.replace_corpus)
    if run.args.full and current is not None:
        set_aside_damaged_keywords(run.layout, current)
    _guard_empty(run.walk, _registry_of(run.layout, current), run.args.allow_empty)
    # Without model facts (Ollama unreachable) the live index's dimensions stand; a first index
    # built without Ollama has none (0), and the first run that can embed rebuilds it.
    dims = run.model.dims if run.model is not None else current.manifest.dims if current is not None else 0
    run.summary.model_changed = weights_changed(current, run.index_name(dims), run.model)
    if run.summary.model_changed:
        log.warning("the embedding server's %s is not the one this index was embedded with (%s): re-embedding every "
                    "chunk", run.settings.embed_model, how_the_model_changed(current, run.model))  # type: ignore[arg-type]  # changed: both known
    return replace(run, current=current, full=run.args.full or run.summary.model_changed), dims


def _report_prepared(run: Run, prepared: PreparedIndex) -> None:
    summary, current, store = run.summary, run.current, prepared.store
    summary.index = store.name
    summary.rebuilt = current is None or current.index != store.name
    if summary.rebuilt and current is not None:
        log.info("index manifest changed (%s -> %s): rebuilding into a new index; the old one stays live "
                 "until the new one is complete", current.index, store.name)
    if prepared.repaired:
        log.info("removed %d vectors left by an interrupted run", prepared.repaired)
    _fill_summary(summary, prepared.plan, embeds=run.unembeddable is None)
    for warning in prepared.plan.warnings:
        log.warning("%s", warning)


def _open_and_plan(run: Run, dims: int, vectors: rules.Vectors, look: PlanBeforeLock | None) -> PreparedIndex:
    """Open (or create) the index for these dimensions, repair what an interrupted run left, and
    compare the corpus with what it holds. Files are read and parsed again only when the index
    holds other documents than the look saw (another run wrote in between, or the repair dropped
    files whose vectors were lost)."""
    store = Store(run.layout, rules.manifest_for(run.settings, run.scheme.name, dims), run.settings, vectors)
    registry, waiting = load_registry(store.db), load_waiting(store.db)
    plan = _plan_for(run, registry, waiting, look)
    repaired = 0
    if run.full or store.needs_reconcile(count=plan.writes_vectors()):
        repaired = store.reconcile()
        repaired_registry = load_registry(store.db)
        if repaired_registry != registry:
            registry, plan = repaired_registry, plan_changes(run.walk, repaired_registry, run.full, waiting)
    return PreparedIndex(store, plan, registry, waiting, repaired)


def _plan_for(run: Run, registry: dict[str, DocumentRow], waiting: dict[str, int], look: PlanBeforeLock | None) -> Plan:
    if look is not None and not run.full and (look.registry, look.waiting) == (registry, waiting):
        return look.plan
    return plan_changes(run.walk, registry, run.full, waiting)


def _carry_out_plan(run: Run, prepared: PreparedIndex) -> bool:
    """Carry out the plan: metadata-only updates, embedding and writing the changed files (or,
    without Ollama, indexing those with no vectors yet for keyword search), the removals, then the
    calibration. True when the index changed (a new generation is due)."""
    store, plan, summary = prepared.store, prepared.plan, run.summary
    changed_anything = bool(prepared.repaired) or store.unpublished()
    if plan.mtime_only:
        store.update_mtimes(plan.mtime_only)
        changed_anything = True
    if plan.relocated:
        store.relocate(plan.relocated)
        changed_anything = True
    if plan.keys:
        store.record_keys(plan.keys.values())
        changed_anything = True
    # --full is the way to force every chunk through the embedder: no reuse then (and
    # new weights under the model's name make every stored vector unusable).
    embedding = Embedding(run.hosts or run.embedders, run.scheme, store.manifest.dims,
                          reuse=(lambda keys: {}) if run.full else store.stored_vectors,
                          concurrency=run.settings.embed_concurrency)
    try:
        if run.unembeddable is not None:
            written, run_errors = _index_without_vectors(run, prepared, plan.changed, run.unembeddable)
            stopped = None
        else:
            written, run_errors, stopped = GroupWriter(run, prepared, embedding).write()
        changed_anything = changed_anything or bool(written)
        if plan.removed:
            store.remove(plan.removed)
            changed_anything = True
        store.end_vector_writes()  # every vector written this run is owned by a committed row
        for path, successor in store.unindexed_successors():
            # The server names only indexed successors: this one is named to nobody until it is indexed.
            log.warning("%s: superseded_by names %s, which is not indexed (missing, excluded or of a format not read)",
                        path, rules.shown(successor))
        if run.model is not None and store.needs_calibration():
            changed_anything = _calibrate(store, embedding) or changed_anything
        summary.embedding_calls = embedding.calls
        summary.embedders = embedding.report()
    finally:
        embedding.close()
    for host in summary.embedders:
        if host["calls"]:
            log.info("embedded %d chunks on %s in %d calls, at most %d at a time", host["chunks"], host["host"],
                     host["calls"], host["most_in_flight"])
    summary.failed = len(plan.failed)
    summary.vectors_pending = store.waiting_chunks()
    summary.errors = [*sorted(plan.failed.values()), *run_errors]
    if summary.vectors_pending:
        hint = rules.vectors_pending_hint(run.settings.embed_model, run.settings.corpus_dir, run.settings.store_dir,
                                          embedder_up=None if stopped is not None
                                          else run.unembeddable is None and run.model is not None,
                                          api=run.settings.embed_api)
        summary.errors.append(f"{summary.vectors_pending} chunks without vectors (found by keyword search only): {hint}")
    return changed_anything


def _calibrate(store: Store, embedding: Embedding) -> bool:
    """Measure the corpus's similarity calibration (the server's confidence scale); an embedder
    that fails now leaves the previous calibration in place. True when it was measured (or found impossible)."""
    try:
        calibration = store.calibrate(embedding.embed_queries)
    except RagError as exc:
        log.warning("similarity calibration skipped (%s); the previous one stays", exc.message)
        return False
    if calibration is not None:
        log.info("similarity calibration: unrelated %.3f, related %.3f (%d headings as queries)",
                 calibration.unrelated, calibration.related, calibration.queries)
    return True


class GroupWriter:
    """Embeds the changed files a commit group at a time; each group's vectors go to the store as
    soon as they are embedded, and its rows commit while the next groups are embedded (the store
    writes those vectors meanwhile). The next group is queued before this one is waited for, so the
    embedding calls go on from one group to the next.

    Groups hold about COMMIT_EVERY_S of embedding at the measured pace (the first one call's
    worth), so an interrupted run keeps what it embedded. Once the pace says the files with no
    vectors yet would take longer than KEYWORDS_FIRST_AFTER_S, they are indexed for keyword search
    and published first, then embedded. write() returns the paths written, the run's own errors and
    why the embedding stopped part-way (the embedder going away, no host left in the rotation: files
    with no vectors yet are then indexed for keyword search only; said even when every file it left
    was, and the pending passages' hint does not claim the embedder answers).

    Per group (step): 1. the next group begun, 2. keyword search first when embedding is slow,
    3. the keyword pass advanced (published when done), 4. this group embedded and sent, the one
    before it committed. Whatever fails, a group already embedded and sent is committed first."""

    def __init__(self, run: Run, prepared: PreparedIndex, embedding: Embedding) -> None:
        self.run, self.prepared, self.embedding = run, prepared, embedding
        self.store, self.plan, self.summary = prepared.store, prepared.plan, run.summary
        self.written: set[str] = set()  # paths committed with their vectors
        self.started: set[str] = set()  # paths given to a group so far
        self.keyword_only: set[str] = set()  # paths indexed for keyword search first in this run
        self.progress = ProgressLine(len(self.plan.changed), sum(len(pf.chunks) for pf in self.plan.changed))
        embedding.on_embedded = self.progress.embedded
        embedding.on_reused = self.progress.embedded
        embedding.on_split = self.progress.grew
        # True once the keyword pass is done, or when this index may not publish rows without vectors.
        self.keywords_first = not may_publish_without_vectors(run, self.store)
        self.pending: Sent | None = None  # sent to the store, not committed yet
        self.job: FilesJob | None = None  # the group being embedded
        self.upcoming: FilesJob | None = None  # the next one, begun
        # Files to index for keyword search first, taken from the end (None: no pass under way).
        self.keyword_queue: list[PreparedFile] | None = None
        self.keyword_line = contextlib.ExitStack()  # the progress line's keyword pass, while it lasts
        self.keyword_written: Callable[[int], None] = lambda files: None

    def write(self) -> tuple[set[str], list[str], RagError | None]:
        groups = _groups(self.plan.changed,
                         lambda: _group_chunks(self.embedding, self.progress.chunks, first=not self.started))
        try:
            if self.plan.changed:
                # Marked before the first embedding call: nothing between groups waits on the
                # keyword index for it (a writer holding that lock stops the run before any vector).
                self.store.begin_vector_writes()
            self.job = self.begin(next(groups, None))
            while self.job is not None:
                self.step(groups)
            self.commit_pending()
        except KeyboardInterrupt:
            self.commit_pending()  # embedded and sent: kept (the vector process ignores Ctrl-C)
            raise
        except RagError as exc:
            return self.stopped(exc)
        finally:
            self.keyword_line.close()
            self.progress.finish()
            self.summary.chunks_embedded, self.summary.chunks_reused = self.embedding.embedded, self.embedding.reused
        return self.written, [], None

    def step(self, groups: Iterator[list[PreparedFile]]) -> None:
        """One group through the numbered steps (see the class)."""
        # 1. the next group, its calls following this group's without a pause
        self.upcoming = self.committed_first(lambda: self.begin(next(groups, None)))
        # 2. keyword search first, when the pace says embedding the new files takes long
        self.start_keyword_pass_if_slow()
        # 3. the keyword pass, a share at least per group; published when done
        self.advance_keyword_pass()
        # 4. this group embedded and sent; the one before it committed
        group = self.committed_first(lambda: _embedded(self.embedding, self.job, self.plan))  # type: ignore[arg-type]  # in step: a job
        sent = self.store.send(group) if group else None
        self.commit_pending()
        self.pending, self.job, self.upcoming = sent, self.upcoming, None

    def begin(self, group: list[PreparedFile] | None) -> FilesJob | None:
        if group is None:
            return None
        self.started.update(pf.file.path for pf in group)
        return self.embedding.begin_files(group)

    def committed_first(self, fn: Callable[[], Any]) -> Any:
        """fn(), the group embedded before it failed committed first: it stays."""
        try:
            return fn()
        except RagError:
            self.commit_pending()
            raise

    def commit_pending(self) -> None:
        """Commit the group sent and not committed yet, if any."""
        sent = self.pending
        if sent is not None:
            self.store.commit(sent)
            self.written.update(pf.file.path for pf in sent.files)
            self.summary.chunks_written += sum(len(pf.chunks) for pf in sent.files)
            self.progress.committed(len(sent.files))
            self.pending = None

    def start_keyword_pass_if_slow(self) -> None:
        rest = [] if self.keywords_first else [pf for pf in self.plan.changed if pf.file.path not in self.started
                                               and pf.file.path in self.plan.without_vectors]
        wait = self.embedding.seconds_for(sum(len(pf.chunks) for pf in rest))
        if rest and wait is not None and wait > KEYWORDS_FIRST_AFTER_S:
            self.keywords_first, self.keyword_queue = True, rest
            log.info("embedding %d file(s) new to the index will take about %.0f s: indexing them for keyword "
                     "search first", len(rest), wait)
            self.keyword_written = self.keyword_line.enter_context(self.progress.keyword_pass(len(rest)))

    def advance_keyword_pass(self) -> None:
        """Write the keyword pass while this group embeds (a share at least); once it is done, the
        keyword index goes live: this group's predecessor committed, a generation published."""
        while self.keyword_queue:
            taken, paths = _write_some_without_vectors(self.store, self.keyword_queue, self.started, self.summary)
            self.keyword_only.update(paths)
            self.keyword_written(taken)
            if self.embedding.finished(self.job):  # type: ignore[arg-type]  # in step: a job
                break
        if self.keyword_queue == []:
            self.keyword_queue = None
            self.commit_pending()  # findable in the generation published now
            self.keyword_line.close()
            _publish(self.run, self.prepared, changed_anything=True)

    def stopped(self, exc: RagError) -> tuple[set[str], list[str], RagError | None]:
        """The embedder went away mid-run (even one chunk at a time timed out): what was committed
        stays, the rest keeps its old chunks (or, with none, is indexed for keyword search). Any
        other failure is raised."""
        for given_up in (self.job, self.upcoming):
            if given_up is not None:
                self.embedding.abandon(given_up)
        if exc.code not in EMBEDDER_DOWN:
            raise exc
        rest = [pf for pf in self.plan.changed
                if pf.file.path not in self.written | self.keyword_only and pf.file.path not in self.plan.failed]
        indexed, errors = _index_without_vectors(self.run, self.prepared, rest, exc)
        return self.written | indexed, errors or [f"{exc.message}; the embedding stopped there ({exc.hint})"], exc


def may_publish_without_vectors(run: Run, store: Store) -> bool:
    """Whether rows without vectors may be published in this index: never in a rebuild that would
    replace a live index that has vectors (its replacement would have fewer)."""
    current = run.current
    return current is None or current.index == store.name or current.manifest.dims == 0


def _index_without_vectors(run: Run, prepared: PreparedIndex, files: Sequence[PreparedFile],
                           why: RagError) -> tuple[set[str], list[str]]:
    """Files that cannot be embedded now: those with no vectors in the index are indexed for
    keyword search (when this index may publish that; those waiting as they were stay so), the
    others keep their previous chunks and vectors until the next run. Returns the paths written
    and the error that says what was left."""
    plan, summary = prepared.plan, run.summary
    allowed = may_publish_without_vectors(run, prepared.store)
    files = [pf for pf in files if pf.file.path not in plan.waiting_as_they_were]
    first = [pf for pf in files if allowed and pf.file.path in plan.without_vectors]
    _write_without_vectors(prepared.store, first, summary)
    indexed = {pf.file.path for pf in first}
    left = [pf.file.path for pf in files if pf.file.path not in indexed]
    summary.left_for_next_run = len(left)
    if not left:
        return indexed, []
    named = ", ".join(left[:10]) + (f" and {len(left) - 10} more" if len(left) > 10 else "")
    return indexed, [f"{why.message}; {len(left)} file(s) left for the next run: {named} ({why.hint})"]


def _write_without_vectors(store: Store, files: Sequence[PreparedFile], summary: Summary) -> None:
    for group in rules.batched(files, COMMIT_BATCH_CHUNKS):
        store.commit_without_vectors(group)
    summary.chunks_without_vectors += sum(len(pf.chunks) for pf in files)


def _write_some_without_vectors(store: Store, queue_: list[PreparedFile], started: Collection[str],
                                summary: Summary) -> tuple[int, list[str]]:
    """Index about COMMIT_BATCH_CHUNKS chunks' worth of files from the end of the queue for keyword
    search; a file a group has begun to embed meanwhile is dropped (the groups take the plan from
    its start, the pass from its end). Returns how many files left the queue, and the paths written."""
    files: list[PreparedFile] = []
    taken = chunks = 0
    while queue_ and chunks < COMMIT_BATCH_CHUNKS:
        pf = queue_.pop()
        taken += 1
        if pf.file.path not in started:
            files.append(pf)
            chunks += len(pf.chunks)
    if files:
        store.commit_without_vectors(files)
        summary.chunks_without_vectors += chunks
    return taken, [pf.file.path for pf in files]


def _group_chunks(embedding: Embedding, total: int, first: bool) -> int:
    """How many chunks the next commit group holds: one call's worth until the pace is known, then about
    COMMIT_EVERY_S of embedding at the measured pace (COMMIT_BATCH_CHUNKS while every vector so
    far was reused), and never more than a tenth of the run: an interruption loses little."""
    if first or embedding.pace_pending():
        return START_CHUNKS
    per_chunk = embedding.seconds_for(1)
    by_time = int(COMMIT_EVERY_S / per_chunk) if per_chunk else COMMIT_BATCH_CHUNKS
    return max(START_CHUNKS, min(COMMIT_BATCH_CHUNKS, by_time, total // 10))


def _embedded(embedding: Embedding, job: FilesJob, plan: Plan) -> list[PreparedFile]:
    """A commit group's files with their vectors; when one file's own content fails, the others
    still go (the failing ones are recorded in plan.failed)."""
    group = list(job.files)
    try:
        embedding.finish_files(job)
    except RagError as exc:
        if not _fails_files_alone(exc):
            raise
        group = _embed_individually(embedding, group, plan)
    for pf in group:
        pf.chunks = renumber(pf.chunks)
    return group


def _model_to_record(current: rules.CurrentIndex | None, model: ModelFacts | None, summary: Summary,
                     plan: Plan) -> tuple[str | None, rules.ModelFingerprint | None]:
    """The model digest and fingerprint the index's vectors now come from: the server's, unless new
    weights were found and not every file was re-embedded (then the old ones stay, so the next run
    re-embeds again); the recorded ones when this run did not ask the server (or it did not say)."""
    old = (current.stamp.model_digest, current.stamp.fingerprint) if current is not None else (None, None)
    if model is None or (summary.model_changed and (summary.left_for_next_run or plan.failed)):
        return old
    return model.digest or old[0], model.fingerprint or old[1]


def _publish(run: Run, prepared: PreparedIndex, changed_anything: bool) -> None:
    """Stamp the index and, when anything changed, point CURRENT.json at it with a new generation
    (running servers reopen on it). A rebuild with failures stays unpublished. Called again in a
    run that published its keyword index first: the live index is read from CURRENT.json, which
    only this run writes while it holds the store lock."""
    summary, settings, store = run.summary, run.settings, prepared.store
    current = run.layout.read_current()
    store.compact_keywords()  # before the stamp: a new generation goes live compact
    summary.commit, summary.dirty = corpus_git_state(settings.corpus_dir)
    found = files_found(run.walk, prepared.plan)
    summary.files_found = dict(found.counts)
    files, chunks = store.counts()
    digest, fingerprint = _model_to_record(current, run.model, summary, prepared.plan)
    stamp = rules.IndexStamp(commit=summary.commit, dirty=summary.dirty,
                             ingested_at=datetime.now(UTC).isoformat(timespec="seconds"),
                             files=files, chunks=chunks,
                             model_digest=digest, fingerprint=fingerprint,
                             vectors_pending=store.waiting_chunks())
    announce = (summary.rebuilt or changed_anything or summary.model_changed or current is None
                or current.corpus_dir != str(settings.corpus_dir) or current.corpus_id != run.walk.root_id
                or (current.stamp.fingerprint is None and fingerprint is not None)
                or (current.stamp.commit, current.stamp.dirty) != (stamp.commit, stamp.dirty))
    # The vector store's copy of the stamp follows the generations; a run that changed nothing
    # does not open the vector store just to note when it ran.
    store.stamp(stamp, found, in_vectors=announce or store.vectors.in_use())
    if current is not None and current.index != store.name and (prepared.plan.failed or summary.left_for_next_run):
        summary.errors.append(f"the new index {store.name} is incomplete; {current.index} stays live until a "
                              "run completes without failures")
        return
    if announce:
        generation = (current.generation + 1) if current else 1
        run.layout.write_current(rules.CurrentIndex(index=store.name, generation=generation, manifest=store.manifest,
                                                    stamp=stamp, corpus_dir=str(settings.corpus_dir),
                                                    corpus_id=run.walk.root_id))
        store.mark_published()
        if current is not None and current.index != store.name:
            # The previous index is no longer live: its vectors and its folder go.
            try:
                rules.vector_store(settings, run.layout, current.index).drop()
            except RagError as exc:
                log.warning("the previous index's vectors could not be removed (%s); they stay unused", exc.message)
            shutil.rmtree(run.layout.index_dir(current.index), ignore_errors=True)


def _fails_files_alone(exc: RagError) -> bool:
    """A passage that cannot be split under the context, or texts Ollama answers with NaN or
    infinite vectors: the files they belong to fail, the run goes on."""
    return exc.code is ErrorCode.DOCUMENT_INVALID or isinstance(exc, rules.InvalidVectors)


def _embed_individually(embedding: Embedding, group: list[PreparedFile], plan: Plan) -> list[PreparedFile]:
    """Embed a group's files one by one, so only the files at fault fail (keeping their old chunks)."""
    kept = []
    for pf in group:
        try:
            embedding.embed_files([pf])
            kept.append(pf)
        except RagError as exc:
            if not _fails_files_alone(exc):
                raise
            plan.failed[pf.file.path] = exc.message if exc.message.startswith(pf.file.path) else (
                f"{pf.file.path}: not indexed: {exc.message}")
    return kept


def _groups(files: Sequence[PreparedFile], limit: Callable[[], int]) -> Iterator[list[PreparedFile]]:
    """Whole files, in order, in groups of at most `limit()` chunks (asked anew for each group),
    unless one file alone holds more."""
    group: list[PreparedFile] = []
    size, bound = 0, limit()
    for pf in files:
        if group and size + len(pf.chunks) > bound:
            yield group
            group, size, bound = [], 0, limit()
        group.append(pf)
        size += len(pf.chunks)
        if size >= bound:
            yield group
            group, size, bound = [], 0, limit()
    if group:
        yield group


def files_found(walk: Walk, plan: Plan) -> rules.FilesFound:
    """Every file the walk came upon, by extension, and what became of it in the plan."""
    counts: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for path in plan.failed:
        counts[rules.file_extension(path)]["failed"] += 1
    excluded = set(plan.excluded)
    for file in walk.files:
        if file.path not in plan.failed:
            counts[rules.file_extension(file.path)]["excluded" if file.path in excluded else "indexed"] += 1
    for path in walk.ignored:
        if not path.endswith("/"):
            counts[rules.file_extension(path)]["ignored"] += 1
    for extension, files in walk.not_read.items():
        counts[extension]["not_read"] += files
    return rules.FilesFound({extension: dict(by) for extension, by in counts.items()})


def _fill_summary(summary: Summary, plan: Plan, embeds: bool = True) -> None:
    """Added: files new to the index, or to its vector search (they waited for vectors); without
    an embedder, a file that waits as it was stays unchanged."""
    as_they_were = 0 if embeds else len(plan.waiting_as_they_were)
    summary.added = len(plan.without_vectors) - as_they_were
    summary.updated = len(plan.changed) - len(plan.without_vectors)
    summary.unchanged = len(plan.unchanged) + len(plan.mtime_only) + as_they_were
    summary.removed = len(plan.removed)
    summary.excluded = len(plan.excluded)
    summary.failed = len(plan.failed)
    summary.errors = sorted(plan.failed.values())


def _guard_empty(walk: Walk, registry: dict[str, DocumentRow], allow_empty: bool) -> None:
    if not walk.files and not walk.failures and registry and not allow_empty:
        raise RagError(ErrorCode.CORPUS_EMPTY,
                       f"the corpus has no document of a format read but the index holds {len(registry)}; refusing to delete them",
                       "check RAG_CORPUS_DIR (an unmounted drive?), or pass --allow-empty to empty the index")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Index a folder of documentation for local-rag-mcp.")
    parser.add_argument("--corpus", help="corpus folder (default: $RAG_CORPUS_DIR, in a clone sample-corpus/)")
    parser.add_argument("--store", help="store folder (default: $RAG_STORE_DIR or ~/.local-rag-mcp/store)")
    parser.add_argument("--full", action="store_true", help="re-embed every file, changed or not")
    parser.add_argument("--code", action="store_true",
                        help="index source code too, in symbol chunks (as RAG_CODE=1; default: documentation only)")
    parser.add_argument("--dry-run", action="store_true", help="report what would change; embed and write nothing")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    parser.add_argument("--allow-empty", action="store_true", help="allow an empty corpus to empty the index")
    parser.add_argument("--watch", action="store_true",
                        help="after the run, keep watching the corpus and re-run once changes settle (Ctrl-C stops)")
    parser.add_argument("--settle", type=float, default=WATCH_SETTLE_S, metavar="SECONDS",
                        help="with --watch: how long changes must be quiet before a run (default: %(default)s)")
    parser.add_argument("--exit-with-parent", action="store_true",
                        help="with --watch: stop as on Ctrl-C when the process that started it ends (server.py "
                             "--watch starts its watcher so, and it must not outlive a server killed with -9)")
    parser.add_argument("--replace-corpus", action="store_true",
                        help="index this corpus into a store built from another folder (a moved corpus, or a "
                             "deliberate switch); without it such a run is refused")
    return parser.parse_args(argv)


def failure_of(exc: BaseException) -> RagError:
    """A run that stopped on something other than a RagError, in the error vocabulary: the store
    could not be written (disk full, read-only, another user's), or an unexpected failure (its
    trace goes to the log). What was committed before it stays; the next run carries on."""
    if isinstance(exc, ModuleNotFoundError):
        return rules.missing_dependency(exc, "ingest.py")
    failure = rules.store_failure(exc, "store")
    if failure.code is ErrorCode.INTERNAL and not isinstance(exc, (OSError, sqlite3.Error)):
        log.error("ingest failed unexpectedly:\n%s", traceback.format_exc())
        text = (str(exc).splitlines() or [""])[0][:300]
        return RagError(ErrorCode.INTERNAL, f"ingest failed unexpectedly: {type(exc).__name__}: {text}",
                        "the trace is above; run ingest again, and report it if it repeats")
    return failure


def run_once(args: argparse.Namespace, quiet: bool = False,
             vectors: rules.Vectors | None = None) -> tuple[int, Summary]:
    """One run and its report: (exit status, summary). Every way a run can stop ends here in the
    error vocabulary; Ctrl-C propagates (committed work is kept, the next run continues)."""
    summary = Summary(dry_run=args.dry_run)
    try:
        run(args, summary, vectors)
    except Exception as exc:  # noqa: BLE001 - every way a run can stop ends in the vocabulary
        error = exc if isinstance(exc, RagError) else failure_of(exc)
        log.error("%s", error.message)
        if error.hint:
            log.error("next: %s", error.hint)
        if args.json:
            print(json.dumps({"exit": 2, **error.payload(), **asdict(summary)}, ensure_ascii=False), flush=True)
        return 2, summary
    found = rules.FilesFound(summary.files_found)
    if found.left_out() and not found.total("indexed") and not args.allow_empty:
        # A search of such an index would look like "the documents do not cover it": say it here.
        summary.errors.append(f"nothing {'would be' if summary.dry_run else 'was'} indexed: the corpus folder holds "
                              f"{found.line()}")
    for error in summary.errors:
        log.error("%s", error)
    if summary.dry_run and not args.json:
        for entry in summary.listing:
            print(listing_line(entry))
    if not quiet:
        print(f"ingest: {summary.line()}", file=sys.stderr)
        if summary.dry_run or found.left_out():
            print(f"ingest: files by extension: {found.line()}", file=sys.stderr)
    if summary.left_for_next_run and not (summary.chunks_written or summary.chunks_without_vectors):
        status = 2  # the embedder is unavailable and nothing could be indexed
    else:
        status = 1 if summary.failed or summary.errors else 0
    if args.json:
        print(json.dumps({"exit": status, **asdict(summary)}, ensure_ascii=False), flush=True)
    return status, summary


# ---------------------------------------------------------------------------
# Fresh by itself: --watch.

WATCH_SETTLE_S = 1.0  # a burst of changes is indexed once it has been quiet this long
WATCH_GROUP_MAX_S = 10.0  # changes that never stop are indexed at least this often
WATCH_ROOT_GONE_S = 10.0  # a corpus folder missing this long is gone, not being swapped
WATCH_RETRY_S = (15.0, 60.0, 300.0)  # after a run that could not finish: retry, backing off
IGNORE_FILES = {RAGIGNORE, ".gitignore"}


def relevant_change(path: str, formats: Collection[str] = rules.FORMATS) -> bool:
    """Changes a run would see: files a reader of `formats` takes (source files only with RAG_CODE),
    ignore files, and what may be a folder (a renamed or deleted folder of documents). Editor temp and swap files (x.md~, .x.md.swp, .#x.md),
    anything in a dot-folder (.git) and other files are not."""
    parts = Path(path).parts
    name = parts[-1] if parts else ""
    if name in IGNORE_FILES:
        return not any(part.startswith(".") for part in parts[:-1])
    if any(part.startswith(".") for part in parts) or name.endswith("~") or name.startswith("#"):
        return False
    return rules.reader_for(name, formats) is not None or "." not in name


def watch(args: argparse.Namespace) -> int:
    """Index, then keep the index fresh: a run after every burst of changes once it settles.

    1. the store's watch lock (watch_lock): one watcher a store, waiting while another runs;
    2. a first run, then one after each settled burst of changes; a run that could not finish
       (Ollama down, another ingest holding the ingest lock, files left) is retried with a back-off;
    3. at each run's start and end, the status file says what the watcher does (WatchReport).

    The ingest lock is held only while a run is active, so a manual `python ingest.py` can run
    between. One line per run. Ctrl-C (or SIGTERM, or with --exit-with-parent the end of the
    process that started it) stops cleanly."""
    import watchfiles

    settings = run_settings(args)
    corpus = settings.corpus_dir
    if not corpus.is_dir():  # nothing to watch: the run says why (not configured, or not there)
        return run_once(args)[0]
    if args.exit_with_parent:
        rules.end_with_parent(_stop_orphan)
    layout = rules.StoreLayout(settings.store_dir)
    try:
        with watch_lock(layout):
            return _watch(args, watchfiles, corpus, WatchReport(layout), settings.formats)
    except OSError as exc:  # the watch lock could not be made (a read-only store, a link in its place)
        raise rules.store_failure(exc, str(layout.watch_lock_file)) from None


def _watch(args: argparse.Namespace, watchfiles: Any, corpus: Path, report: WatchReport,
           formats: Collection[str]) -> int:
    settle_ms = int(args.settle * 1000)
    log.info("watching %s (runs once changes have settled for %.1f s)", corpus, args.settle)
    vectors = VectorProcess()  # one for every run: Chroma's import and a process start are paid once
    # One watcher for the whole watch, watching before the first run: what changes while a run
    # is busy is kept for the next batch (a watcher set up after the first run missed an edit
    # made during it, after its walk; one set up anew after each run, one made in that gap).
    batches = _change_batches(watchfiles, corpus, settle_ms, formats)
    identity = folder_identity(corpus)
    next(batches)  # starts the watcher: a second at most; what it saw, the first run sees too
    report.running(0)
    status, summary = run_once(args, quiet=True, vectors=vectors)
    report.finished(status, summary)
    _watch_line("start", status, summary)
    retries = 0
    logging.getLogger("ingest").setLevel(logging.WARNING)  # one line per run from here on
    try:
        while True:
            due = WATCH_RETRY_S[min(retries, len(WATCH_RETRY_S) - 1)] if _unfinished(status, summary) else None
            changes = _next_changes(batches, corpus, identity, due)
            if changes == "gone":
                log.error("the corpus folder %s is gone (for %g s); watch stops with exit 2 so that a service "
                          "manager restarts it once the folder is back", corpus, WATCH_ROOT_GONE_S)
                return 2
            if changes == "replaced":
                # A deploy or a re-clone (mv docs docs.old && mv docs.new docs): the watcher still
                # watches the old folder; attach to the new one and index it.
                log.warning("the corpus folder %s was replaced; watching the new one", corpus)
                batches.close()
                batches = _change_batches(watchfiles, corpus, settle_ms, formats)
                identity = folder_identity(corpus)
                what = "corpus folder replaced"
            else:
                what = f"{len(changes)} change(s)" if changes else "retry"
            if not vectors.usable():  # killed from outside, or a write failed: the next run gets a new one
                vectors.shut()
                vectors = VectorProcess()
            report.running(len(changes) if isinstance(changes, set) else 0)
            status, summary = run_once(args, quiet=True, vectors=vectors)
            report.finished(status, summary)
            retries = retries + 1 if _unfinished(status, summary) and not changes else 0
            _watch_line(what, status, summary)
    except KeyboardInterrupt:
        print("ingest: watch stopped; what was committed is kept", file=sys.stderr, flush=True)
        return 0
    finally:
        batches.close()
        vectors.shut()
        report.close()


class WatchReport(logging.Handler):
    """The watcher's status file (rules.WatchStatus in the store): rewritten when a run starts and
    when it ends, with the first error the run logged (this handler hears the ingest log). A
    status that cannot be written is said once and costs the watch nothing."""

    def __init__(self, layout: rules.StoreLayout) -> None:
        super().__init__(logging.ERROR)
        self.layout = layout
        self.last: rules.WatchRun | None = None
        self.error: str | None = None
        self._unwritable = False
        log.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        if self.error is None:
            self.error = record.getMessage()[:500]

    def running(self, files_waiting: int) -> None:
        self.error = None
        self._write(rules.WatchStatus(pid=os.getpid(), running=True, since=_now(), files_waiting=files_waiting,
                                      last_run=self.last))

    def finished(self, status: int, summary: Summary) -> None:
        outcome = ("could_not_finish" if status not in (0, 1) else "unfinished" if _unfinished(status, summary)
                   else "some_files_failed" if status else "ok")
        self.last = rules.WatchRun(finished_at=_now(), outcome=outcome, added=summary.added, updated=summary.updated,
                                   removed=summary.removed, failed=summary.failed, seconds=round(summary.seconds, 3),
                                   error=self.error if status else None)
        self._write(rules.WatchStatus(pid=os.getpid(), running=False, since=self.last.finished_at,
                                      files_waiting=summary.left_for_next_run, last_run=self.last))

    def _write(self, status: rules.WatchStatus) -> None:
        try:
            self.layout.write_watch_status(status)
        except (OSError, ValueError) as exc:
            if not self._unwritable:
                log.warning("the watch status (%s) cannot be written: %s", self.layout.watch_status_file, exc)
                self._unwritable = True

    def close(self) -> None:
        log.removeHandler(self)
        super().close()


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


WATCH_ORPHAN_GRACE_S = 30.0  # a watcher whose server is gone stops as on Ctrl-C; past this, at once


def _stop_orphan() -> None:
    """--exit-with-parent: the process that started this watcher is gone (a server killed with
    -9): stop as SIGTERM does, and exit outright if that has not happened within the grace."""
    log.warning("the process that started this watcher is gone; stopping")
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(WATCH_ORPHAN_GRACE_S)
    os._exit(1)


def _interrupt(*_: Any) -> None:
    raise KeyboardInterrupt


def _unfinished(status: int, summary: Summary) -> bool:
    return status == 2 or bool(summary.left_for_next_run or summary.vectors_pending)


def _change_batches(watchfiles: Any, corpus: Path, settle_ms: int,
                    formats: Collection[str] = rules.FORMATS) -> Generator[set[str], None, None]:
    """The relevant paths of each settled burst of changes, and an empty set about every second
    without one. The watcher keeps collecting between two batches."""
    for batch in watchfiles.watch(corpus, watch_filter=lambda _change, path: relevant_change(path, formats), step=settle_ms,
                                  debounce=int(WATCH_GROUP_MAX_S * 1000), rust_timeout=1000, yield_on_timeout=True,
                                  raise_interrupt=True):
        yield {path for _, path in batch}


def folder_identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of a folder; None when there is no folder there."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISDIR(st.st_mode) else None


def _next_changes(batches: Iterator[set[str]], corpus: Path, identity: tuple[int, int] | None,
                  wait_s: float | None) -> set[str] | Literal["gone", "replaced"]:
    """The next non-empty batch; an empty set when `wait_s` passed first (a retry is due);
    "replaced" when another folder now has the corpus's name; "gone" when no folder has had it
    for WATCH_ROOT_GONE_S (a swap leaves a moment without one)."""
    deadline = None if wait_s is None else time.monotonic() + wait_s
    missing_since: float | None = None
    for changes in itertools.chain(batches, _seconds()):
        now = folder_identity(corpus)
        if now is None:
            missing_since = missing_since or time.monotonic()
            if time.monotonic() - missing_since >= WATCH_ROOT_GONE_S:
                return "gone"
            continue
        if now != identity:
            return "replaced"
        missing_since = None
        if changes:
            return changes
        if deadline is not None and time.monotonic() >= deadline:
            return set()
    raise AssertionError("unreachable: _seconds never ends")


def _seconds() -> Iterator[set[str]]:
    """An empty batch every second, for when the watcher itself ended (its folder was removed)."""
    while True:
        time.sleep(1.0)
        yield set()


def _watch_line(what: str, status: int, summary: Summary) -> None:
    state = {0: "ok", 1: "some files failed", 2: "could not finish; will retry"}.get(status, str(status))
    print(f"ingest: watch {what}: {summary.added} added, {summary.updated} updated, {summary.removed} removed, "
          f"{summary.failed} failed; {summary.chunks_written} chunks written ({summary.chunks_embedded} embedded, "
          f"{summary.chunks_reused} reused) in {summary.seconds:.1f} s [{state}]", file=sys.stderr, flush=True)


class TerminalSafeFormatter(logging.Formatter):
    """Log lines as they reach a terminal: a corpus name inside a message (a folder's, an OSError's)
    has its control sequences neutralised by the rule the server CLI uses (rules.printable_text)."""

    def format(self, record: logging.LogRecord) -> str:
        return rules.printable_text(super().format(record))


def main(argv: Sequence[str] | None = None) -> int:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(TerminalSafeFormatter("%(name)s: %(levelname)s: %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("watchfiles").setLevel(logging.WARNING)
    args = parse_args(argv)
    if args.watch and args.dry_run:
        print("ingest: --watch and --dry-run do not go together", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _interrupt)  # kill, systemd's stop, a supervisor: end as Ctrl-C does (130)
    try:
        if args.watch:
            return watch(args)
        return run_once(args)[0]
    except KeyboardInterrupt:
        print("ingest: interrupted; what was committed is kept, and the next run continues from there",
              file=sys.stderr, flush=True)
        return 130
    except (RagError, ModuleNotFoundError) as exc:  # --watch's start: its settings, or its watcher's library
        error = rules.missing_dependency(exc, "ingest.py") if isinstance(exc, ModuleNotFoundError) else exc
        log.error("%s", error.message)
        if error.hint:
            log.error("next: %s", error.hint)
        return 2


# ===========================================================================
# Machinery, last: the thread and child process around the stages (see the module docstring's
# table). The embedding dispatcher is Embedding's, above, with the rules it keeps.
# ===========================================================================


# ---------------------------------------------------------------------------
# The run's vector store (rules.Vectors): in a process of its own (VectorProcess, every real run)
# or in this one (InProcessVectors, the fast tests). Both are the same client, VectorClient, over
# a different connection to the same VectorWriter, so they behave the same, errors included.


def _die_with_parent() -> None:
    """Linux: the kernel kills this process when the ingest that started it dies (kill -9
    included), so no write of a dead run lands after the next run has started. Elsewhere the
    process ends when its pipe closes."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(Exception):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class VectorWriter:
    """The far end of a VectorClient: one VectorStore, one answer per operation, ("ok", value) or
    ("error", (code, message, hint)).

    After a write fails (a full disk, say), the store is never touched again: every later
    operation gets that write's error at once. Chroma can keep a lock from the failed write, and
    its next write then waits on it for ever (seen with a file-size limit: SQLite's busy loop in
    one of Chroma's own connections). The client is replaced after a failed write."""

    def __init__(self) -> None:
        self._vectors: rules.VectorStore | None = None
        self._failed: tuple[Any, ...] | None = None  # the failed write's error

    def answer(self, operation: str, args: tuple[Any, ...]) -> tuple[str, Any]:
        try:
            answer: tuple[str, Any] = ("ok", self._carry_out(operation, args))
        except RagError as exc:
            answer = ("error", (exc.code, exc.message, exc.hint))
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the client
            answer = ("error", (ErrorCode.INTERNAL, f"the vector store failed: {rules.shown(exc, 300)}",
                                "run ingest again; if it repeats, report it"))
        if answer[0] == "error" and operation in rules.VECTOR_WRITES and self._failed is None:
            self._failed = answer[1]
        return answer

    def _carry_out(self, operation: str, args: tuple[Any, ...]) -> Any:
        if self._failed is not None:
            raise RagError(*self._failed)
        if operation == "open":
            settings, layout, index_name, metadata = args
            self._vectors = rules.vector_store(settings, layout, index_name, create=True).open(
                create=True, metadata=metadata)
            return None
        if self._vectors is None:
            raise RagError(ErrorCode.INTERNAL, f"vector store operation {operation!r} before open", "report it")
        if operation == "close":
            self._vectors, vectors = None, self._vectors
            return vectors.close()
        if operation not in (*rules.VECTOR_WRITES, *rules.VECTOR_READS):
            raise RagError(ErrorCode.INTERNAL, f"unknown vector store operation {operation!r}", "report it")
        return getattr(self._vectors, operation)(*args)

    def finish(self) -> None:
        """Close the store, unless a write failed: closing a store left locked could wait for ever too."""
        if self._vectors is not None and self._failed is None:
            self._vectors.close()
        self._vectors = None


def _serve_vectors(fd: int) -> None:
    """The vector process's loop, on its end of the socket `fd`: a VectorWriter answering the
    operations in the order they were sent. Ends when the socket closes."""
    from multiprocessing.connection import Connection

    conn = Connection(fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the whole group; the parent decides
    _die_with_parent()
    rules.import_heavy("chromadb")  # ~1 s, paid while the parent walks the corpus and asks Ollama
    writer = VectorWriter()
    while True:
        try:
            operation, args = conn.recv()
        except (EOFError, OSError):
            break
        try:
            conn.send(writer.answer(operation, args))
        except (BrokenPipeError, OSError):
            break
    writer.finish()


class VectorClient:
    """rules.Vectors over a connection to a VectorWriter (subclasses make the connection); the
    protocol's signatures are checked against VectorStore's and this class's by a test.

    Operations run in the order sent: writes (upsert, delete) return at once and are waited for
    with settle(), before the rows that need them commit; reads wait for everything sent before
    them. A failure of a write is raised by the next settle or read. The store is opened by the
    first operation that needs it."""

    def __init__(self) -> None:
        self._conn: Any = None  # send, recv, poll and close, as multiprocessing's Connection
        self._opening: tuple[Any, ...] | None = None  # open() arguments, sent with the first operation
        self._open = False  # a store is open at the far end
        self._sent = 0
        self._answered = 0
        self._awaiting: collections.deque[str] = collections.deque()  # operations sent, not yet answered
        self._failure: RagError | None = None  # the first failed write: every later settle raises it

    def start(self) -> None:
        raise NotImplementedError

    def usable(self) -> bool:
        raise NotImplementedError

    def shut(self) -> None:
        raise NotImplementedError

    def _gone(self) -> RagError:
        raise NotImplementedError

    def in_use(self) -> bool:
        return self._open

    def open(self, settings: rules.Settings, layout: rules.StoreLayout, index_name: str,
             metadata: dict[str, Any]) -> VectorClient:
        """Open an index's store (a fresh client: it sees every write made since) when the first
        operation needs it; its errors are raised there. A writer whose write failed opens
        nothing more (the error is raised): --watch starts a new one."""
        if self._conn is not None:
            with contextlib.suppress(RagError):
                self.settle()
        self._opening = (settings, layout, index_name, metadata)
        return self

    # Writes: sent now, done in order; settle() waits for them.
    def upsert(self, lifecycle: str, ids: Sequence[str], embeddings: Sequence[Any], documents: Sequence[str],
               metadatas: Sequence[dict[str, Any]]) -> int:
        return self._send("upsert", (lifecycle, list(ids), list(embeddings), list(documents), list(metadatas)))

    def delete(self, lifecycle: str, ids: Sequence[str]) -> int:
        return self._send("delete", (lifecycle, list(ids)))

    def settle(self, ticket: int | None = None) -> None:
        """Wait until the operations sent up to `ticket` (default: all) are done; raise the first
        failed write so far."""
        upto = self._sent if ticket is None else ticket
        while self._answered < upto:
            with contextlib.suppress(RagError):
                self._take_answer()
        if self._failure is not None:
            raise self._failure

    # Reads: answered once everything sent before them is done.
    def ids(self, lifecycle: str) -> list[str]:
        return self._read("ids", lifecycle)

    def count(self, lifecycle: str) -> int:
        return self._read("count", lifecycle)

    def embeddings(self, lifecycle: str, ids: Sequence[str]) -> tuple[list[str], Any]:
        return self._read("embeddings", lifecycle, list(ids))

    def metadatas(self, lifecycle: str, ids: Sequence[str]) -> tuple[list[str], list[dict[str, Any]]]:
        return self._read("metadatas", lifecycle, list(ids))

    def update_metadatas(self, lifecycle: str, ids: Sequence[str], metadatas: Sequence[dict[str, Any]]) -> None:
        self._read("update_metadatas", lifecycle, list(ids), list(metadatas))

    def query(self, lifecycle: str, vector: Sequence[float], n: int,
              paths: Sequence[str] | None, kind: str | None = None) -> list[tuple[str, float]]:
        return self._read("query", lifecycle, vector, n, paths, kind)

    def merge_metadata(self, updates: dict[str, Any]) -> None:
        self._read("merge_metadata", updates)

    def close(self) -> None:
        """Close the store (the writer stays for another open); a failure here changes nothing.
        A store that was never opened has nothing to close."""
        self._opening = None
        if not self._open:
            return
        self._open = False
        with contextlib.suppress(RagError):
            self._send("close", ())
            self.settle()

    def _read(self, operation: str, *args: Any) -> Any:
        ticket = self._send(operation, args)
        self.settle(ticket - 1)
        return self._take_answer()

    def _send(self, operation: str, args: tuple[Any, ...]) -> int:
        self.start()
        if self._opening is not None and operation != "open":
            opening, self._opening = self._opening, None
            self._read("open", *opening)
            self._open = True
        while self._conn.poll():  # answers never pile up in the pipe while a big request goes out
            with contextlib.suppress(RagError):
                self._take_answer()
        self._transmit((operation, args))
        self._sent += 1
        self._awaiting.append(operation)
        return self._sent

    def _transmit(self, message: tuple[str, tuple[Any, ...]]) -> None:
        try:
            self._conn.send(message)
        except (BrokenPipeError, OSError):
            raise self._gone() from None

    def _take_answer(self) -> Any:
        try:
            status, value = self._conn.recv()
        except (EOFError, OSError):
            raise self._gone() from None
        self._answered += 1
        operation = self._awaiting.popleft()
        if status == "error":
            error = RagError(*value)
            if self._failure is None and operation in rules.VECTOR_WRITES:
                self._failure = error
            raise error
        return value


class VectorProcess(VectorClient):
    """The run's vector store in a process of its own.

    Chroma's upsert holds the GIL for its whole length (measured: a thread with work to do got
    0.07 s of CPU during 2 s of upserts), so in one process nothing else of ingest runs while
    Chroma writes. Here the next group's embedding and the previous group's keyword rows run
    meanwhile.

    Nothing starts until a run needs the store: a run with nothing to write never pays Chroma's
    import (~1.5 s of CPU). A run that will write calls start() as soon as it knows, so the
    import overlaps its model probe, planning and chunking. The process dies with ingest."""

    def __init__(self) -> None:
        super().__init__()
        self._process: subprocess.Popen[bytes] | None = None
        # Requests go out from a thread of their own: the process reads the next one only when it
        # has written the one before, so sending a group's vectors (megabytes) on the caller's
        # thread held up the next group's embedding calls for a whole upsert (8 call slots were
        # used at 0.69 of their rate). None ends the thread.
        self._outbox: queue.SimpleQueue[tuple[str, tuple[Any, ...]] | None] = queue.SimpleQueue()
        self._sender: threading.Thread | None = None

    def start(self) -> None:
        """Start the process now (it imports Chroma meanwhile); idempotent."""
        if self._process is not None:
            return
        import socket
        from multiprocessing.connection import Connection

        # A plain interpreter, not multiprocessing's spawn: that would run the caller's main
        # module again in the child. Its stdout is not ours: there `--json` prints the summary.
        mine, theirs = socket.socketpair()
        with theirs:
            self._process = subprocess.Popen(
                [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r}); "
                 f"import ingest; ingest._serve_vectors({theirs.fileno()})"],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        self._conn = Connection(mine.detach())

    def _transmit(self, message: tuple[str, tuple[Any, ...]]) -> None:
        if self._sender is None:
            self._sender = threading.Thread(target=self._send_out, name="ingest-vector-requests", daemon=True)
            self._sender.start()
        self._outbox.put(message)

    def _send_out(self) -> None:
        """The requests, in the order sent, then the end of the connection (shut). A process that
        is gone takes no more of them, and the answer awaited next says so (see _gone)."""
        try:
            while (message := self._outbox.get()) is not None:
                self._conn.send(message)
        except (BrokenPipeError, OSError):
            pass
        finally:
            with contextlib.suppress(Exception):
                self._conn.close()

    def usable(self) -> bool:
        """Whether another run can use this process: not started yet, or alive with none of its
        writes failed (after one, it touches the store no more; see VectorWriter)."""
        return self._process is None or (self._process.poll() is None and self._failure is None)

    def _gone(self) -> RagError:
        assert self._process is not None
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._process.wait(1.0)
        error = RagError(ErrorCode.INTERNAL, "the vector process ended unexpectedly (exit status "
                         f"{self._process.returncode})", "run ingest again; what was committed stays")
        if self._failure is None:
            self._failure = error
        return error

    def shut(self) -> None:
        """End the process. When everything sent was answered (the store closed last) there is
        nothing left for it to do and its exit is not waited for (~0.1 s); otherwise it may still
        be writing, and it is waited for (killed after 30 s), so no write lands after this."""
        if self._process is None:
            return
        settled = self._answered == self._sent
        if self._sender is not None:  # it closes the connection once what was sent has gone out
            self._outbox.put(None)
        else:
            with contextlib.suppress(Exception):
                self._conn.close()
        if settled:
            return
        try:
            self._process.wait(30.0)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait(5.0)


class _AnsweredHere:
    """A connection whose far end is a VectorWriter in this process: an operation is carried out
    as it is sent, its answer kept until received."""

    def __init__(self) -> None:
        self._writer = VectorWriter()
        self._answers: collections.deque[tuple[str, Any]] = collections.deque()

    def send(self, message: tuple[str, tuple[Any, ...]]) -> None:
        self._answers.append(self._writer.answer(*message))

    def recv(self) -> tuple[str, Any]:
        return self._answers.popleft()

    def poll(self) -> bool:
        return bool(self._answers)

    def close(self) -> None:
        self._writer.finish()


class InProcessVectors(VectorClient):
    """The run's vector store in this process: what VectorProcess does, without a process (a
    test drives ingest.run in one process with it; nothing overlaps Chroma's writes)."""

    def start(self) -> None:
        if self._conn is None:
            self._conn = _AnsweredHere()

    def usable(self) -> bool:
        return self._failure is None

    def _gone(self) -> RagError:
        raise AssertionError("an in-process vector writer cannot go away")

    def shut(self) -> None:
        if self._conn is not None:
            self._conn.close()


# ---------------------------------------------------------------------------
# The progress line, and its ticker thread.


class ProgressLine:
    """ProgressLine on stderr: live on a terminal, otherwise a line every PROGRESS_EVERY_S seconds.

    A ticker thread prints the non-terminal lines, so a slow embedding call cannot make ingest go
    silent: the line then says how long the current call has been waiting."""

    def __init__(self, files: int, chunks: int) -> None:
        self.files, self.chunks = files, chunks
        self.files_done = self.chunks_done = 0
        self.start = self.call_started = time.monotonic()
        self.last = 0.0
        self.tty = sys.stderr.isatty()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.ticked = False
        # [files done, files] while files are indexed for keyword search first (no call is waited for)
        self._keyword_pass: list[int] | None = None
        self._ticker: threading.Thread | None = None
        if not self.tty and files:
            self._ticker = threading.Thread(target=self._tick, name="ingest-progress", daemon=True)
            self._ticker.start()

    def embedded(self, chunks: int) -> None:
        with self._lock:
            self.chunks_done += chunks
            self.call_started = time.monotonic()
        if self.tty:
            self._print_if_due(0.2)

    def grew(self, chunks: int) -> None:
        """Chunks Ollama found too long were split: the total grows, so it ends where the summary does."""
        with self._lock:
            self.chunks += chunks

    def committed(self, files: int) -> None:
        with self._lock:
            self.files_done += files
        if self.tty:
            self._print_if_due(0.2)

    @contextlib.contextmanager
    def keyword_pass(self, files: int) -> Iterator[Callable[[int], None]]:
        """While `files` are indexed for keyword search first: the line says so and counts them
        (a call Ollama answered before the pass is not being waited for)."""
        with self._lock:
            self._keyword_pass = [0, files]

        def done(count: int) -> None:
            with self._lock:
                if self._keyword_pass is not None:
                    self._keyword_pass[0] += count

        try:
            yield done
        finally:
            with self._lock:
                self._keyword_pass = None
                self.call_started = time.monotonic()

    def line(self) -> str:
        with self._lock:
            if self._keyword_pass is not None:
                done, files = self._keyword_pass
                return (f"ingest: indexing {files} files for keyword search first, their vectors after: "
                        f"{done}/{files} files")
            now = time.monotonic()
            elapsed = now - self.start
            rate = self.chunks_done / elapsed if elapsed > 0 else 0.0
            left = max(0, self.chunks - self.chunks_done)
            eta = f"ETA {left / rate:.0f} s" if rate > 0 else "ETA unknown"
            waiting = now - self.call_started
            line = (f"ingest: {self.files_done}/{self.files} files, {self.chunks_done}/{self.chunks} chunks embedded "
                    f"or reused, {rate:.1f} chunks/s, {eta}")
            if waiting >= PROGRESS_EVERY_S and left:
                line += f"; waiting {waiting:.0f} s for the embedding server"
            return line

    def _print_if_due(self, every: float) -> None:
        now = time.monotonic()
        if now - self.last < every:
            return
        self.last = now
        print("\r" + self.line(), end="", file=sys.stderr, flush=True)

    def _tick(self) -> None:
        while not self._stop.wait(PROGRESS_EVERY_S):
            self.ticked = True
            print(self.line(), file=sys.stderr, flush=True)

    def finish(self) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join(timeout=5)
            if self.ticked:  # a run long enough to report progress says where it got to
                print(self.line(), file=sys.stderr, flush=True)
        if self.tty and self.last:
            print(file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
