"""The contract shared by ingest.py (the only writer) and server.py (the reader).

Both import this module and nothing of each other, so the server reads exactly what ingest
wrote. Its sections, in file order:

- Errors: ErrorCode, RagError, store_failure (a store's exceptions in the vocabulary), and
  ingest_command (the command every hint names).
- Configuration: Settings, ENVIRONMENT (every variable) and load_settings.
- Paths, and opening corpus files without following links (ingest's reads, get_file).
- Frontmatter conventions, token estimation, searchable text.
- Headings and chunking (CHUNKER_VERSION), embedding prefixes (PREFIX_SCHEMES).
- Keyword terms: the one tokenizer for the FTS5 index and for queries; identifier detection.
- Store layout, ids, metadata keys and the manifest (StoreLayout, CURRENT.json).
- The vector-store seam: VectorStore (embedded Chroma) and ServerVectors (a Chroma server),
  one collection per lifecycle, their failures in the vocabulary.
- The embedder: OllamaEmbedder, the one Ollama client of both programs, with its own call
  threads and deadlines (an embedding call is bounded even when Ollama stops answering).

Heavy libraries (ollama, chromadb, markdown-it, frontmatter) are imported inside the
functions that need them: the server must answer the MCP handshake before paying for them.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import functools
import hashlib
import importlib
import itertools
import json
import math
import os
import queue
import re
import secrets
import shlex
import shutil
import stat
import statistics
import sys
import threading
import time
import unicodedata
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path, PurePosixPath
from typing import Any, Literal, Protocol

PROJECT_DIR = Path(__file__).resolve().parent


def _installed_version() -> str:
    """The version pyproject.toml declares, as pip installed it (a checkout never installed reads
    the file itself)."""
    import importlib.metadata

    try:
        return importlib.metadata.version("local-rag-mcp")
    except importlib.metadata.PackageNotFoundError:
        import tomllib

        return tomllib.loads((PROJECT_DIR / "pyproject.toml").read_text(encoding="utf-8"))["project"]["version"]


TOOL_VERSION = _installed_version()

# ---------------------------------------------------------------------------
# Errors: one vocabulary for ingest and server.


class ErrorCode(StrEnum):
    INVALID_ARGUMENT = "invalid_argument"
    INDEX_MISSING = "index_missing"
    INDEX_INCOMPATIBLE = "index_incompatible"
    EMBEDDER_UNAVAILABLE = "embedder_unavailable"
    MODEL_NOT_FOUND = "model_not_found"
    NOT_INDEXED = "not_indexed"
    PATH_REJECTED = "path_rejected"
    # A store that is there but cannot answer now (locked by another process, slow, a Chroma
    # server down): retry later. `internal` is kept for what nobody expected (a bug, damage).
    STORE_UNAVAILABLE = "store_unavailable"
    INTERNAL = "internal"
    # Ingest-side codes.
    DOCUMENT_INVALID = "document_invalid"
    CORPUS_MISSING = "corpus_missing"
    CORPUS_EMPTY = "corpus_empty"
    CORPUS_MISMATCH = "corpus_mismatch"
    STORE_UNWRITABLE = "store_unwritable"
    LOCK_HELD = "lock_held"
    # Passages indexed for keyword search while Ollama could not embed them: vector search has
    # nothing (or not everything) to search until ingest runs with Ollama.
    VECTORS_PENDING = "vectors_pending"


class RagError(Exception):
    """An expected failure: a code, what happened, and what to do next."""

    def __init__(self, code: ErrorCode, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.hint = hint

    def payload(self) -> dict[str, dict[str, str]]:
        return {"error": {"code": str(self.code), "message": self.message, "hint": self.hint}}

    def __str__(self) -> str:
        return f"{self.code}: {self.message}" + (f" ({self.hint})" if self.hint else "")


# The console scripts pyproject.toml's [project.scripts] installs (a test holds the two together).
SERVER_SCRIPT = "local-rag-mcp"
INGEST_SCRIPT = "local-rag-ingest"
# A clone (or an editable install of one), not a copy pip installed: pyproject.toml is beside the code.
IN_CHECKOUT = (PROJECT_DIR / "pyproject.toml").is_file()
CLONE_PYTHON = PROJECT_DIR / ".venv" / "bin" / "python"  # the environment the quick start makes


def _ingest_program() -> list[str]:
    """How this user runs ingest from a shell. In a clone run as `python server.py`: this
    interpreter (or the clone's .venv when this one lacks the project's libraries) and the
    clone's ingest.py, by absolute paths (a bare `python` may be one without the project).
    Started as a console script, or installed: the console script beside it, by name when that
    is what PATH finds, else by its path; failing that, `-m ingest`."""
    started = Path(sys.argv[0]).absolute() if sys.argv and sys.argv[0] else None
    as_script = started is not None and started.name in (SERVER_SCRIPT, INGEST_SCRIPT)
    if IN_CHECKOUT and not as_script:
        import importlib.util

        lacking = importlib.util.find_spec("chromadb") is None and CLONE_PYTHON.is_file()
        return [str(CLONE_PYTHON) if lacking else sys.executable, str(PROJECT_DIR / "ingest.py")]
    import sysconfig

    for folder in ([started.parent] if started is not None and as_script else []) + [Path(sysconfig.get_path("scripts"))]:
        script = folder / INGEST_SCRIPT
        if script.is_file():
            on_path = shutil.which(INGEST_SCRIPT)
            return [INGEST_SCRIPT if on_path and Path(on_path).resolve() == script.resolve() else str(script)]
    return [sys.executable, "-m", "ingest"]


# What every hint tells the operator to run to (re)build an index: the one command that writes,
# as this user runs it here; and as HTTP callers read it, its folders not named (see server.redact).
_INGEST_PROGRAM = _ingest_program()
INGEST_COMMAND = shlex.join(_INGEST_PROGRAM)
INGEST_COMMAND_SHOWN_REMOTELY = " ".join(f"<path>/{Path(part).name}" if os.path.isabs(part) else part
                                         for part in _INGEST_PROGRAM)


def ingest_command(*flags: str) -> str:
    """The ingest command with these flags, as hints quote it."""
    return f"`{' '.join((INGEST_COMMAND, *flags))}`"


def missing_dependency(exc: ModuleNotFoundError, program: str) -> RagError:
    """A library the project needs that this interpreter cannot import: `program` (ingest.py or
    server.py) was started with a Python the project is not installed into, or its installation
    is incomplete. The hint names the Python that has it (the clone's .venv) or the install."""
    if IN_CHECKOUT and CLONE_PYTHON.is_file() and Path(sys.executable).absolute() != CLONE_PYTHON:
        hint = (f"run it with the clone's environment: {shlex.join([str(CLONE_PYTHON), str(PROJECT_DIR / program)])} "
                f"(or activate it first: . {shlex.quote(str(PROJECT_DIR / '.venv' / 'bin' / 'activate'))})")
    elif IN_CHECKOUT:
        hint = f"install the project into this Python: {shlex.join([sys.executable, '-m', 'pip', 'install', str(PROJECT_DIR)])}"
    else:
        hint = f"reinstall local-rag-mcp into this Python: {shlex.join([sys.executable, '-m', 'pip', 'install', '--force-reinstall', 'local-rag-mcp'])}"
    return RagError(ErrorCode.INVALID_ARGUMENT, f"configuration error: the Python running {program} ({sys.executable}) "
                    f"cannot import {exc.name!r}, which local-rag-mcp needs", hint)


def store_failure(exc: BaseException, what: str) -> RagError:
    """A failure of the store (keyword database or vector store) in the vocabulary: another Chroma
    version, a lock held elsewhere, a disk that is full or read-only, or something else."""
    if isinstance(exc, RagError):
        return exc
    text = (str(exc).splitlines() or [type(exc).__name__])[0][:300]
    lowered = text.lower()
    code = getattr(exc, "errno", None)
    if "unapplied migrations" in lowered:
        return RagError(ErrorCode.INDEX_INCOMPATIBLE, f"the {what} was written by another Chroma version: {text}",
                        f"run {ingest_command()} with this installation; it upgrades the store")
    if code in (errno.ENOSPC, errno.EFBIG) or any(
            words in lowered for words in ("disk is full", "no space left", "file too large", "disk i/o error")):
        return RagError(ErrorCode.STORE_UNWRITABLE, f"the {what} could not be written (is the disk full?): {text}",
                        "free some space and run ingest again; what was committed is kept")
    if code in (errno.EACCES, errno.EPERM, errno.EROFS) or any(
            words in lowered for words in ("readonly", "read-only", "permission denied", "unable to open database")):
        return RagError(ErrorCode.STORE_UNWRITABLE, f"the {what} cannot be written: {text}",
                        "check that RAG_STORE_DIR (or --store) is a folder this user can write")
    if "locked" in lowered or "busy" in lowered:
        return RagError(ErrorCode.STORE_UNAVAILABLE, f"the {what} is locked: {text}",
                        "another process holds it; retry in a moment (an ingest may be running)")
    return RagError(ErrorCode.INTERNAL, f"the {what} failed: {text}",
                    "if an ingest is running, retry when it finishes; otherwise rebuild the index with "
                    + ingest_command("--full"))


# ---------------------------------------------------------------------------
# Configuration.

DEFAULT_OLLAMA_HOST = "http://127.0.0.1:11434"
DEFAULT_EMBED_MODEL = "embeddinggemma"
DEFAULT_STORE_DIR = "~/.local-rag-mcp/store"
DEFAULT_EMBED_TIMEOUT_S = 60.0
MAX_EMBED_CONCURRENCY = 32  # RAG_EMBED_CONCURRENCY's ceiling, and the measured one's
# Chunk size target, measured on the dev set (see README "Design decisions"); the hard cap is
# always the model's context length read from Ollama.
DEFAULT_CHUNK_MAX_TOKENS = 512
DEFAULT_CHUNK_MIN_TOKENS = 64
# RAG_EMBED_DIMENSIONS' range: fewer than 32 dimensions keep too little to rank by, and no
# embedding model Ollama serves has more than 8192.
EMBED_DIMENSIONS_MIN, EMBED_DIMENSIONS_MAX = 32, 8192


def _abs_path(value: str | os.PathLike[str]) -> Path:
    return Path(os.path.abspath(os.path.expanduser(str(value))))


def _setting_error(name: str, raw: str, wanted: str) -> RagError:
    return RagError(ErrorCode.INVALID_ARGUMENT, f"configuration error: {name}={raw[:100]!r} is not {wanted}",
                    f"set {name} to {wanted}, or unset it for the default")


def _int_env(env: Mapping[str, str], name: str, default: int, lowest: int, highest: int = 2**31) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise _setting_error(name, raw, f"a whole number from {lowest} to {highest}") from None
    if not lowest <= value <= highest:
        raise _setting_error(name, raw, f"a whole number from {lowest} to {highest}")
    return value


def _seconds_env(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise _setting_error(name, raw, "a positive number of seconds, e.g. 60")
    return value


def _flag_env(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise _setting_error(name, raw, "1 or 0 (true or false)")


def _choice_env(env: Mapping[str, str], name: str, default: str, choices: Sequence[str]) -> str:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    if raw.upper() not in choices:
        raise _setting_error(name, raw, "one of " + ", ".join(choices))
    return raw.upper()


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
# RAG_HTTP_ALLOWED_HOSTS entries (and the Host headers matched against them): a name or bracketed
# IPv6 literal, then maybe a port ("*": any port, or none); RAG_HTTP_ALLOWED_ORIGINS entries alike.
HTTP_HOST_PATTERN = re.compile(r"(\[[0-9a-f:.]+\]|[a-z0-9.-]+)(?::(\d{1,5}|\*))?")
HTTP_ORIGIN_PATTERN = re.compile(r"(https?)://(\[[0-9a-f:.]+\]|[a-z0-9.-]+)(?::(\d{1,5}|\*))?")
DEFAULT_STORE_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class Settings:
    """Every knob of both programs, read and checked in one place (load_settings): a bad value
    is a configuration error that names the variable, never a silent default."""

    corpus_dir: Path
    # False when corpus_dir is the default: the server then prefers the folder the index records.
    corpus_dir_explicit: bool
    store_dir: Path
    # The hosts of OLLAMA_HOST (a comma list): ingest spreads its calls over them, the server embeds
    # queries with the first that answers (ollama_host is the first).
    ollama_hosts: tuple[str, ...]
    embed_model: str
    # True when RAG_EMBED_MODEL was set explicitly: the server then insists it matches the index.
    embed_model_explicit: bool
    embed_timeout_s: float
    chunk_max_tokens: int
    chunk_min_tokens: int
    # Ingest: the `dimensions` asked of Ollama for every vector (RAG_EMBED_DIMENSIONS; a
    # Matryoshka model's vectors truncated and renormalised); None: the model's native size. The
    # server asks what the live index records, whatever this says.
    embed_dimensions: int | None = None
    # Ingest: embedding calls in flight per host (RAG_EMBED_CONCURRENCY); None: found per host by
    # measuring what it sustains (see ingest.ConcurrencyTuner).
    embed_concurrency: int | None = None
    # Server: how long a call waits for the vector store; stderr log level; background warm-up.
    store_timeout_s: float = DEFAULT_STORE_TIMEOUT_S
    log_level: str = "INFO"
    server_warmup: bool = True
    # Vectors on a Chroma server instead of the embedded store (RAG_CHROMA_URL), and the headers
    # its requests carry (RAG_CHROMA_HEADERS, a JSON object: an auth proxy's token, say).
    chroma_url: str | None = None
    chroma_headers: Mapping[str, str] = field(default_factory=dict)
    # Ingest: leave out what git ignores when the corpus is in a git work tree (RAG_RESPECT_GITIGNORE).
    respect_gitignore: bool = True
    # `server.py --http`: where it listens, the bearer token every route but /health requires, host
    # names and origins allowed besides loopback's (DNS-rebinding protection), how many calls may
    # be in flight at once (per budget), how long one tool call may take, how long a client may
    # take to send a request (headers, then body), and how many connections may be open at once.
    http_host: str = "127.0.0.1"
    http_port: int = 8765
    http_token: str | None = field(default=None, repr=False)
    http_allowed_hosts: tuple[str, ...] = ()
    http_allowed_origins: tuple[str, ...] = ()
    http_max_in_flight: int = 16
    tool_timeout_s: float = 30.0
    http_read_timeout_s: float = 10.0
    http_max_connections: int = 1000

    @property
    def ollama_host(self) -> str:
        return self.ollama_hosts[0]

    def describe(self) -> str:
        return (f"corpus={self.corpus_dir} store={self.store_dir} ollama={','.join(self.ollama_hosts)} "
                f"model={self.embed_model}")


# Every variable load_settings reads, in the README's order (a test holds the three together).
ENVIRONMENT = ("RAG_CORPUS_DIR", "RAG_STORE_DIR", "OLLAMA_HOST", "RAG_EMBED_MODEL", "RAG_EMBED_TIMEOUT",
               "RAG_EMBED_CONCURRENCY", "RAG_EMBED_DIMENSIONS", "RAG_CHUNK_MAX_TOKENS", "RAG_CHUNK_MIN_TOKENS",
               "RAG_STORE_TIMEOUT", "RAG_LOG_LEVEL",
               "RAG_SERVER_WARMUP", "RAG_CHROMA_URL", "RAG_CHROMA_HEADERS", "RAG_RESPECT_GITIGNORE", "RAG_HTTP_HOST",
               "RAG_HTTP_PORT", "RAG_HTTP_TOKEN", "RAG_HTTP_ALLOWED_HOSTS", "RAG_HTTP_ALLOWED_ORIGINS",
               "RAG_HTTP_MAX_IN_FLIGHT", "RAG_HTTP_READ_TIMEOUT", "RAG_HTTP_MAX_CONNECTIONS", "RAG_TOOL_TIMEOUT")


def load_settings(env: Mapping[str, str] | None = None, *, corpus_dir: str | None = None,
                  store_dir: str | None = None) -> Settings:
    """Resolve configuration: explicit arguments over the environment over defaults.

    The corpus default is next to the code, never the cwd: MCP clients launch servers from
    their own working directory.
    """
    env = os.environ if env is None else env
    model = env.get("RAG_EMBED_MODEL", "").strip()
    max_tokens = _int_env(env, "RAG_CHUNK_MAX_TOKENS", DEFAULT_CHUNK_MAX_TOKENS, 32)
    min_tokens = _int_env(env, "RAG_CHUNK_MIN_TOKENS", DEFAULT_CHUNK_MIN_TOKENS, 0)
    if min_tokens > max_tokens:
        raise _setting_error("RAG_CHUNK_MIN_TOKENS", str(min_tokens),
                             f"a whole number up to RAG_CHUNK_MAX_TOKENS ({max_tokens})")
    corpus_choice = corpus_dir or env.get("RAG_CORPUS_DIR", "").strip()
    return Settings(
        corpus_dir=_abs_path(corpus_choice or PROJECT_DIR / "sample-corpus"),
        corpus_dir_explicit=bool(corpus_choice),
        store_dir=_abs_path(store_dir or env.get("RAG_STORE_DIR", "").strip() or DEFAULT_STORE_DIR),
        ollama_hosts=_ollama_hosts_env(env, "OLLAMA_HOST"),
        embed_concurrency=_int_env(env, "RAG_EMBED_CONCURRENCY", 0, 1, MAX_EMBED_CONCURRENCY) or None,
        embed_model=model or DEFAULT_EMBED_MODEL,
        embed_model_explicit=bool(model),
        embed_timeout_s=_seconds_env(env, "RAG_EMBED_TIMEOUT", DEFAULT_EMBED_TIMEOUT_S),
        chunk_max_tokens=max_tokens,
        chunk_min_tokens=min_tokens,
        embed_dimensions=_int_env(env, "RAG_EMBED_DIMENSIONS", 0, EMBED_DIMENSIONS_MIN, EMBED_DIMENSIONS_MAX) or None,
        store_timeout_s=_seconds_env(env, "RAG_STORE_TIMEOUT", DEFAULT_STORE_TIMEOUT_S),
        log_level=_choice_env(env, "RAG_LOG_LEVEL", "INFO", LOG_LEVELS),
        server_warmup=_flag_env(env, "RAG_SERVER_WARMUP", True),
        chroma_url=_url_env(env, "RAG_CHROMA_URL"),
        chroma_headers=_headers_env(env, "RAG_CHROMA_HEADERS"),
        respect_gitignore=_flag_env(env, "RAG_RESPECT_GITIGNORE", True),
        http_host=env.get("RAG_HTTP_HOST", "").strip() or "127.0.0.1",
        http_port=_int_env(env, "RAG_HTTP_PORT", 8765, 0, 65535),
        http_token=_token_env(env, "RAG_HTTP_TOKEN"),
        http_allowed_hosts=_addresses_env(env, "RAG_HTTP_ALLOWED_HOSTS", HTTP_HOST_PATTERN, "rag.internal:*"),
        http_allowed_origins=_addresses_env(env, "RAG_HTTP_ALLOWED_ORIGINS", HTTP_ORIGIN_PATTERN,
                                            "https://portal.internal"),
        http_max_in_flight=_int_env(env, "RAG_HTTP_MAX_IN_FLIGHT", 16, 1, 10_000),
        tool_timeout_s=_seconds_env(env, "RAG_TOOL_TIMEOUT", 30.0),
        http_read_timeout_s=_seconds_env(env, "RAG_HTTP_READ_TIMEOUT", 10.0),
        http_max_connections=_int_env(env, "RAG_HTTP_MAX_CONNECTIONS", 1000, 8, 1_000_000),
    )


def no_corpus_configured(settings: Settings) -> RagError | None:
    """The configuration error of an installed copy run with RAG_CORPUS_DIR unset: pip installs
    no sample corpus beside the code to default to. None when there is a folder to use."""
    if settings.corpus_dir_explicit or settings.corpus_dir.is_dir():
        return None
    return RagError(ErrorCode.INVALID_ARGUMENT, "configuration error: RAG_CORPUS_DIR is not set, and there is no "
                    f"sample corpus beside the program ({settings.corpus_dir}) to default to",
                    "set RAG_CORPUS_DIR to your folder of Markdown, the same for ingest and the server "
                    "(ingest also takes --corpus DIR)")


def _token_env(env: Mapping[str, str], name: str) -> str | None:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    if len(raw) < 16 or any(ch.isspace() or not ch.isprintable() for ch in raw):
        raise _setting_error(name, "(hidden)", "a secret of at least 16 printable characters without spaces")
    return raw


def _list_env(env: Mapping[str, str], name: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in env.get(name, "").split(",") if item.strip())


def _addresses_env(env: Mapping[str, str], name: str, pattern: re.Pattern[str], example: str) -> tuple[str, ...]:
    """A comma list of hosts or origins, each as the HTTP door matches it exactly (lower case): an
    entry it could never match is a configuration error, not a silent refusal of every client."""
    entries = tuple(item.lower().rstrip("/") for item in _list_env(env, name))
    for entry in entries:
        if not pattern.fullmatch(entry):
            raise _setting_error(name, entry, f"a comma list such as {example}")
    return entries


def _ollama_hosts_env(env: Mapping[str, str], name: str) -> tuple[str, ...]:
    """OLLAMA_HOST: one Ollama address, or a comma list of them (ingest spreads its calls over
    them; the server embeds queries with the first that answers). Each is checked as _ollama_host reads it; the
    same host twice is one host."""
    raw = env.get(name, "").strip()
    if not raw:
        return (DEFAULT_OLLAMA_HOST,)
    hosts = [_ollama_host(name, item.strip()) for item in raw.split(",") if item.strip()]
    if not hosts:
        raise _setting_error(name, raw, "an Ollama address such as 127.0.0.1:11434 or http://gpu-box:11434")
    return tuple(dict.fromkeys(hosts))


def _ollama_host(name: str, raw: str) -> str:
    """One address in the forms Ollama's own clients read (`host`, `host:port`,
    `scheme://host[:port][/path]`; no port: Ollama's default), checked here: a value that does not
    parse is a configuration error naming the variable, never a traceback from inside the client."""
    from urllib.parse import urlsplit

    url = raw if "://" in raw else f"http://{raw}"
    try:
        parts = urlsplit(url)
        valid = (parts.scheme in ("http", "https") and bool(parts.hostname) and (parts.port is None or parts.port > 0)
                 and not (parts.query or parts.fragment) and not any(char.isspace() for char in url))
    except ValueError:  # a port that is not a number from 0 to 65535
        valid = False
    if not valid:
        raise _setting_error(name, raw, "an Ollama address such as 127.0.0.1:11434 or http://gpu-box:11434")
    return url.rstrip("/")


def _url_env(env: Mapping[str, str], name: str) -> str | None:
    from urllib.parse import urlsplit

    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        parts = urlsplit(raw)
        valid = parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port is not None
    except ValueError:
        valid = False
    if not valid or parts.path not in ("", "/") or parts.query:
        raise _setting_error(name, raw, "a URL such as http://127.0.0.1:8000 (scheme, host and port)")
    return raw.rstrip("/")


def _headers_env(env: Mapping[str, str], name: str) -> dict[str, str]:
    raw = env.get(name, "").strip()
    if not raw:
        return {}
    try:
        value = json_value(raw)
    except ValueError:
        value = None
    if not (isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())):
        raise _setting_error(name, "(hidden)", 'a JSON object of header names and values, e.g. {"Authorization": '
                             '"Bearer ..."}')
    return value


# ---------------------------------------------------------------------------
# Paths.


def nfc(text: str) -> str:
    return unicodedata.normalize("NFC", text)


def normalize_relative_path(raw: str, *, allow_empty: bool = False) -> str:
    """Validate a corpus-relative path given by a client; return its NFC POSIX form.

    Refuses absolute paths, `~`, `..`, NUL, backslashes; anything URL-encoded-looking is left
    literal (only a document URI is percent-decoded, before its path gets here; so a path's
    `%2e%2e` is just a file name that will not be in the index).
    """
    if not isinstance(raw, str):
        raise RagError(ErrorCode.INVALID_ARGUMENT, "path must be a string", "pass a corpus-relative path")
    try:
        text = nfc(raw.strip())
    except (UnicodeError, ValueError):
        raise RagError(ErrorCode.PATH_REJECTED, "path is not valid Unicode", "pass a corpus-relative path") from None
    if not text:
        if allow_empty:
            return ""
        raise RagError(ErrorCode.INVALID_ARGUMENT, "path is empty", "pass a path as listed by list_documents")
    reasons = _path_problems(text)
    if reasons:
        raise RagError(ErrorCode.PATH_REJECTED, f"path {text[:200]!r} {' and '.join(reasons)}",
                       "pass a path relative to the corpus root, as listed by list_documents")
    return "/".join(p for p in text.split("/") if p not in ("", "."))


def _path_problems(text: str) -> list[str]:
    reasons = []
    if "\x00" in text:
        reasons.append("contains NUL")
    if "\\" in text:
        reasons.append("contains a backslash")
    parts = [p for p in text.split("/") if p not in ("", ".")]
    # Checked on the normalised form as well: "./~/x" must not become "~/x".
    if text.startswith(("/", "~")) or re.match(r"^[A-Za-z]:", text) or (parts and parts[0].startswith("~")):
        reasons.append("is absolute")
    if any(p == ".." for p in parts):
        reasons.append("contains '..'")
    if any(unicodedata.category(ch) == "Cc" and ch != "\x00" for ch in text):
        reasons.append("contains control characters")
    if has_lone_surrogates(text):
        reasons.append("contains lone surrogates")
    return reasons


def has_lone_surrogates(text: str) -> bool:
    """JSON escapes let clients send unpaired UTF-16 halves; they are not valid Unicode text."""
    return any(0xD800 <= ord(ch) <= 0xDFFF for ch in text)


def unservable_path_reason(path: str) -> str | None:
    """Why get_file could not serve a file stored under `path` (None when it can): one rule for
    both sides, so ingest refuses (as a per-file error) exactly the names the server would refuse."""
    problems = _path_problems(path)
    if problems:
        return "its name " + " and ".join(problems).replace("is absolute", "looks like an absolute path")
    if normalize_relative_path(path) != path:
        return "its name starts or ends with white space, or has empty or '.' segments"
    return None


def relative_corpus_path(root: Path, file_path: Path) -> str:
    """The stored form of a corpus file's path: relative, POSIX separators, NFC."""
    return nfc(PurePosixPath(*file_path.relative_to(root).parts).as_posix())


def is_within(root: Path, candidate: Path) -> bool:
    """True when `candidate` (already resolved) lies inside `root` (already resolved)."""
    try:
        candidate.relative_to(root)
    except ValueError:
        return False
    return True


def path_matches_prefix(path: str, prefix: str) -> bool:
    """Segment-wise prefix: 'runbooks' matches 'runbooks/deploy.md', not 'runbooks-old/x.md'."""
    if not prefix:
        return True
    return path == prefix or path.startswith(prefix.rstrip("/") + "/")


# ---------------------------------------------------------------------------
# Opening corpus files without following anything that was not checked (ingest reads, get_file).

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # a FIFO swapped in must not hang the open
# What an O_NOFOLLOW/O_DIRECTORY open answers when a component is not what was checked.
_SWAPPED = {errno.ELOOP, errno.ENOTDIR, errno.EMLINK, errno.ENXIO}


class PathChanged(Exception):
    """A file or one of its folders is not what was checked: a link, a FIFO, a device, another
    file, or a folder of another identity in its place."""


def open_folder(path: str | os.PathLike[str], identity: tuple[int, int] | None = None) -> int:
    """A descriptor of the folder at `path` (already resolved), refusing a link in its place and,
    when `identity` (device, inode) is given, any other folder. FileNotFoundError when gone."""
    try:
        fd = os.open(path, os.O_RDONLY | _DIRECTORY | _NOFOLLOW)
    except OSError as exc:
        if exc.errno in _SWAPPED:
            raise PathChanged(f"{path} is not a folder") from None
        raise
    if identity is not None:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != tuple(identity):
            os.close(fd)
            raise PathChanged(f"{path} is not the folder that was indexed")
    return fd


def read_beneath(root_fd: int, parts: Sequence[str], *, identity: tuple[int, int] | None = None,
                 size: int | None = None) -> bytes:
    """The bytes of the regular file at root/parts, each component opened beneath the one before
    with O_NOFOLLOW, so a link anywhere below the root is refused rather than followed.

    `identity` (device, inode) and `size` are what the caller saw when it chose the file; any
    difference raises PathChanged. Reads stop at the size fstat reports at the open (or `size`),
    so a file that grows while it is read, or a device, cannot make this read without end.
    FileNotFoundError when the file or a folder on its path is gone.
    """
    if not parts:
        raise PathChanged("no file name")
    fd = os.dup(root_fd)
    try:
        for index, part in enumerate(parts):
            last = index == len(parts) - 1
            flags = os.O_RDONLY | _NOFOLLOW | (_NONBLOCK if last else _DIRECTORY)
            try:
                next_fd = os.open(part, flags, dir_fd=fd)
            except OSError as exc:
                if exc.errno in _SWAPPED:
                    raise PathChanged(f"{'/'.join(parts)} changed into a link or another kind of file") from None
                raise
            os.close(fd)
            fd = next_fd
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise PathChanged(f"{'/'.join(parts)} is not a regular file")
        if identity is not None and (st.st_dev, st.st_ino) != tuple(identity):
            raise PathChanged(f"{'/'.join(parts)} was replaced by another file")
        if size is not None and st.st_size != size:
            raise PathChanged(f"{'/'.join(parts)} changed size while it was being read")
        os.set_blocking(fd, True)
        limit = st.st_size if size is None else size
        pieces: list[bytes] = []
        remaining = limit
        while remaining > 0:
            block = os.read(fd, min(remaining, 1 << 20))
            if not block:
                break
            pieces.append(block)
            remaining -= len(block)
        data = b"".join(pieces)
        if size is not None and len(data) != size:
            raise PathChanged(f"{'/'.join(parts)} changed size while it was being read")
        return data
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------
# Frontmatter conventions.

CHUNK_MODES = ("whole", "headings")
LIFECYCLES = ("active", "superseded")
SUCCESSORS_MAX = 10  # paths one superseded_by keeps; a longer list is a mistake, not a reading list


@dataclass(frozen=True)
class SourceDocument:
    """A Markdown file after frontmatter rules, with line numbers of the original file."""

    path: str
    title: str
    rag: bool
    chunk_mode: str
    lifecycle: str
    lines: tuple[str, ...]  # every physical line of the file, without line terminators
    body_start: int  # 1-based line where the body starts (after the frontmatter)
    superseded_by: tuple[str, ...] = ()  # corpus-relative paths of the documents that replace it
    # What parse_document ignored and the user should hear about (ingest logs it).
    warnings: tuple[str, ...] = field(default=(), compare=False)
    # The body's CommonMark structure when parse_document already parsed it (for the title), so
    # chunk_document does not parse a large file twice.
    structure: BodyStructure | None = field(default=None, compare=False, repr=False)

    @property
    def line_count(self) -> int:
        return len(self.lines)


def split_lines(text: str) -> list[str]:
    # Physical lines as editors count them: split on LF only; tolerate CRLF.
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]


# File systems and sync tools round mtimes (FAT: 2 s); within this an unchanged size means unchanged.
MTIME_TOLERANCE_NS = 2_000_000_000


def looks_unchanged(size: int, mtime_ns: int, indexed_size: int, indexed_mtime_ns: int) -> bool:
    """Ingest skips such a file without reading it; the server's staleness hint counts the others."""
    return size == indexed_size and abs(mtime_ns - indexed_mtime_ns) <= MTIME_TOLERANCE_NS


def decode_markdown(raw: bytes, path: str) -> str:
    if b"\x00" in raw:
        raise RagError(ErrorCode.DOCUMENT_INVALID, f"{path}: binary file (contains NUL bytes)",
                       "remove it from the corpus or rename it to something other than .md")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise RagError(ErrorCode.DOCUMENT_INVALID, f"{path}: not UTF-8 ({exc.reason} at byte {exc.start})",
                       "re-save the file as UTF-8") from None


@functools.cache
def frontmatter_handlers() -> tuple[tuple[str, Any], ...]:
    """python-frontmatter's handlers, by kind: YAML between `---` lines, TOML between `+++` lines
    (Hugo), JSON between a `{` line and a `}` line. The library's own TOMLHandler needs the
    third-party `toml` package; the standard library's tomllib reads TOML as well."""
    import tomllib

    from frontmatter.default_handlers import BaseHandler, JSONHandler, YAMLHandler

    class TOMLHandler(BaseHandler):  # type: ignore[misc]  # frontmatter ships no type hints
        FM_BOUNDARY = re.compile(r"^\+{3,}\s*$", re.MULTILINE)
        START_DELIMITER = END_DELIMITER = "+++"

        def load(self, fm: str, **kwargs: Any) -> Any:
            return tomllib.loads(fm)

    return (("YAML", YAMLHandler()), ("TOML", TOMLHandler()), ("JSON", JSONHandler()))


def read_frontmatter(lines: Sequence[str], path: str) -> tuple[dict[str, Any], int]:
    """(metadata, 1-based line where the body starts) of a file's lines.

    A handler's opening boundary on the first line and its closing boundary on a later line make
    frontmatter; the handler splits that block and parses it. Line numbers come from the lines
    themselves, so they stay exact whatever the boundary regexes would swallow. YAML aliases are
    refused before anything is built (a few hundred bytes of nested aliases expand to gigabytes).
    """
    if not lines:
        return {}, 1
    for kind, handler in frontmatter_handlers():
        if not handler.FM_BOUNDARY.fullmatch(lines[0]):
            continue
        closing = next((i for i in range(1, len(lines)) if handler.FM_BOUNDARY.fullmatch(lines[i])), None)
        if closing is None:
            return {}, 1  # an opening line alone is not frontmatter: the file is all body
        fm, _ = handler.split("\n".join(lines[:closing + 1]) + "\n")
        try:
            if kind == "YAML":
                _refuse_yaml_aliases(fm)
            loaded = handler.load(fm)
        except RagError as exc:
            raise RagError(exc.code, f"{path}: {exc.message}", exc.hint) from None
        except RecursionError:
            raise RagError(ErrorCode.DOCUMENT_INVALID, f"{path}: {kind} frontmatter nested too deeply",
                           "flatten the frontmatter") from None
        except Exception as exc:  # noqa: BLE001 - yaml, tomllib and json each raise their own
            first = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
            raise RagError(ErrorCode.DOCUMENT_INVALID, f"{path}: malformed {kind} frontmatter: {first}",
                           f"fix the frontmatter between the {handler.START_DELIMITER or '{ }'} lines") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise RagError(ErrorCode.DOCUMENT_INVALID, f"{path}: frontmatter is not a mapping",
                           "write frontmatter as key: value lines")
        return loaded, closing + 2
    return {}, 1


def _refuse_yaml_aliases(fm: str) -> None:
    import yaml
    from frontmatter.default_handlers import SafeLoader

    for event in yaml.parse(fm, Loader=SafeLoader):
        if isinstance(event, yaml.AliasEvent):
            raise RagError(ErrorCode.DOCUMENT_INVALID, "YAML frontmatter uses an alias (*name); aliases are not "
                           "supported", "write the value out instead of referring to an &anchor")


def json_value(text: str | bytes) -> Any:
    """json.loads for text from a file or a variable: nesting too deep for the parser (a CURRENT.json
    of 100,000 brackets) is a ValueError like any other bad form, not a RecursionError."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def shown(value: Any, limit: int = 200) -> str:
    """A value from a file or a request, quoted in a message: repr (control characters and lone
    surrogates escaped), cut at `limit` characters. Containers are named, never formatted: a YAML
    value can expand without bound, and a megabyte argument is not echoed back whole."""
    if isinstance(value, (dict, list, tuple, set)):
        return f"a {type(value).__name__}"
    try:
        text = value if isinstance(value, str) else str(value)
    except ValueError:  # an integer too long to print
        return f"a {type(value).__name__}"
    return repr(text[:limit]) + ("..." if len(text) > limit else "")


# Characters that are not text where corpus text is shown as a field (a title, a heading, a folder
# name): C0/C1 controls (terminal escapes), line and paragraph separators, bidi overrides and
# isolates, zero-width and invisible formatting characters. Each is shown as one space.
_NOT_METADATA = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u180e\u200b-\u200f\u2028-\u202e\u2060-\u2069"
                           "\u206a-\u206f\ufeff\ufff9-\ufffb]")
METADATA_MAX_CHARS = 300  # a title or a heading, as stored and shown


def metadata_text(text: str, limit: int = METADATA_MAX_CHARS) -> str:
    """Corpus text as a one-line field: invisible and control characters neutralised, whitespace
    collapsed, and cut at `limit` characters with "…" (the whole text stays in the file)."""
    flat = " ".join(_NOT_METADATA.sub(" ", text).split())
    return flat if len(flat) <= limit else flat[:limit - 1].rstrip() + "\u2026"


def printable_text(text: str) -> str:
    """Corpus text for a terminal: the same characters neutralised, its lines and tabs kept."""
    return _NOT_METADATA.sub(lambda found: found.group() if found.group() in "\n\t" else " ", text)


def parse_document(raw: bytes, path: str) -> SourceDocument:
    """Apply the frontmatter conventions to one file's bytes. Raises RagError(document_invalid)."""
    text = decode_markdown(raw, path)
    lines = split_lines(text)
    meta, body_start = read_frontmatter(lines, path)
    rag = meta.get("rag", True)
    if not isinstance(rag, bool):  # `rag: 0` equals False in Python but is not a YAML boolean
        raise RagError(ErrorCode.DOCUMENT_INVALID, f"{path}: rag must be true or false, got {shown(rag, 80)}",
                       "write `rag: false` to exclude the file, or remove the key")
    chunk_mode = meta.get("rag_chunk", "whole")
    if not (isinstance(chunk_mode, str) and chunk_mode in CHUNK_MODES):
        raise RagError(ErrorCode.DOCUMENT_INVALID, f"{path}: rag_chunk must be one of {CHUNK_MODES}, got "
                       f"{shown(chunk_mode, 80)}", "write `rag_chunk: headings` or remove the key")
    lifecycle = meta.get("lifecycle", "active")
    if not (isinstance(lifecycle, str) and lifecycle in LIFECYCLES):
        raise RagError(ErrorCode.DOCUMENT_INVALID, f"{path}: lifecycle must be one of {LIFECYCLES}, got "
                       f"{shown(lifecycle, 80)}", "write `lifecycle: superseded` or remove the key")
    successors, warnings = successors_of(meta.get("superseded_by"), path, lifecycle)
    title = meta.get("title")
    structure = None
    if not (isinstance(title, str) and title.strip()):
        structure = body_structure(lines[body_start - 1:])
        title = _first_h1(structure) or PurePosixPath(path).stem
    return SourceDocument(path=path, title=metadata_text(nfc(str(title))), rag=rag, chunk_mode=chunk_mode,
                          lifecycle=lifecycle, lines=tuple(lines), body_start=body_start,
                          superseded_by=successors, warnings=warnings, structure=structure)


def successors_of(value: Any, path: str, lifecycle: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(successors, warnings) of a `superseded_by` value: a corpus-relative path or a list of them,
    each normalised as a client's path is. Unlike the other keys, a bad value is not an error
    for the file: a successor is a pointer for readers, so what cannot be used is left out with a
    warning and the document is indexed as it says otherwise."""
    if value is None:
        return (), ()
    if lifecycle != "superseded":
        return (), (f"{path}: superseded_by is ignored: the document is not `lifecycle: superseded`",)
    items = [value] if isinstance(value, str) else value if isinstance(value, list) else None
    if items is None:
        return (), (f"{path}: superseded_by must be a corpus-relative path or a list of them, got "
                    f"{shown(value, 80)}; ignored",)
    kept: list[str] = []
    warnings: list[str] = []
    for position, item in enumerate(items):
        # Bounded whatever the list holds: no more than SUCCESSORS_MAX kept, 2x that looked at.
        if len(kept) == SUCCESSORS_MAX or position == 2 * SUCCESSORS_MAX:
            warnings.append(f"{path}: superseded_by names more than {SUCCESSORS_MAX} paths; the rest are ignored")
            break
        try:
            successor = normalize_relative_path(item) if isinstance(item, str) else None
        except RagError as exc:
            warnings.append(f"{path}: superseded_by entry ignored: {exc.message}")
            continue
        if not successor:  # not text, or only "." segments (the corpus root is no document)
            warnings.append(f"{path}: superseded_by entry {shown(item, 80)} is not a path; ignored")
        elif successor == path:
            warnings.append(f"{path}: superseded_by names the document itself; ignored")
        elif successor not in kept:
            kept.append(successor)
    return tuple(kept), tuple(warnings)


def successors_column(successors: Sequence[str]) -> str:
    """How the keyword index's documents.superseded_by holds a document's successors."""
    return json.dumps(list(successors), ensure_ascii=False)


def successors_from_column(raw: str | None) -> tuple[str, ...]:
    """The successors documents.superseded_by holds; none for NULL (not recorded) or a value
    this module did not write."""
    try:
        value = json_value(raw) if raw else []
    except ValueError:
        return ()
    return tuple(item for item in value if isinstance(item, str)) if isinstance(value, list) else ()


def _first_h1(structure: BodyStructure) -> str | None:
    for heading in structure.headings:
        if heading.level == 1:
            return heading.text or None
    return None


# ---------------------------------------------------------------------------
# Token estimation.

_CJK_CHARS = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff66-\uff9f\uac00-\ud7af"
_LATIN_WORD = re.compile(r"[A-Za-z]+")
_WHITESPACE = re.compile(r"\s")


def estimate_tokens(text: str) -> int:
    """A deliberately high token estimate for English and CJK alike.

    Every CJK character, digit and symbol counts as one token and Latin words as one per three
    letters; real tokenizers (Gemma, XLM-R) use fewer, so a chunk under the estimate fits.
    Counted without walking the pieces (it runs on every line and chunk of a corpus): every
    character that is neither whitespace nor a Latin letter is one token.
    """
    words = _LATIN_WORD.findall(text)
    letters = sum(map(len, words))
    spaces = len(_WHITESPACE.findall(text))
    return sum((len(word) + 2) // 3 for word in words) + len(text) - spaces - letters


# ---------------------------------------------------------------------------
# Searchable text: what is embedded and keyword-indexed (the stored text stays as written).

PAYLOAD_MARK = "\u2026"  # "…": what stands in for a payload; not a keyword character, one token
_URL_PATH_CHARS = r"A-Za-z0-9_\-.~:/@!$&*+,;=%"  # ASCII only: Japanese prose often follows a URL unspaced
_DATA_URI = re.compile(rf"(\bdata:[A-Za-z0-9.+-]*(?:/[A-Za-z0-9.+-]+)?(?:;[A-Za-z0-9.+-]+(?:=[A-Za-z0-9.+-]+)?)*,)"
                       rf"[{_URL_PATH_CHARS}?#]+")
_URL_START = r"\b[A-Za-z][A-Za-z0-9+.-]*://"  # a scheme and ://
_URL_PAYLOAD = re.compile(rf"({_URL_START}[{_URL_PATH_CHARS}]*[?#])[{_URL_PATH_CHARS}?#]+")
_LINK_PAYLOAD = re.compile(rf"(\]\([^\s()?#]*[?#])[{_URL_PATH_CHARS}?#]+")  # a Markdown link's relative destination
# Longer than a sha256 in hex (64), the longest hash people paste into a search (a git sha is 40).
LONG_RUN_CHARS = 65
_RUN_CANDIDATE = re.compile(rf"[A-Za-z0-9+/_-]{{{LONG_RUN_CHARS},}}={{0,2}}")
_RUN_SEPARATORS = re.compile(r"[+/_-]")
_DIGIT = re.compile(r"[0-9]")
_ASCII_LETTER = re.compile(r"[A-Za-z]")


def searchable_text(text: str) -> str:
    """The text as it is embedded and keyword-indexed: URL payloads shortened to a mark.

    A URL's query string and fragment, a Markdown link destination's, a `data:` URI's data and
    long base64/hex runs carry no meaning for search (a VitePress playground link holds ~1.5 KB
    of base64 in its fragment); scheme, host, path and link text stay. Line by line (nothing
    crosses a newline), never longer than the text, and applying it twice changes nothing.
    """
    if len(text) < LONG_RUN_CHARS and ":" not in text and "](" not in text:
        return text  # no URL, data: URI, link destination or long run: the chunker asks this per word
    for payload in (_DATA_URI, _URL_PAYLOAD, _LINK_PAYLOAD):
        text = payload.sub(rf"\g<1>{PAYLOAD_MARK}", text)
    return _RUN_CANDIDATE.sub(lambda m: PAYLOAD_MARK if _is_payload_run(m.group(0)) else m.group(0), text)


def _is_payload_run(run: str) -> bool:
    """A long run of base64/hex characters is payload when it mixes letters and digits with few
    separators: paths and snake_case identifiers have a separator every few characters."""
    return (bool(_DIGIT.search(run)) and bool(_ASCII_LETTER.search(run))
            and len(_RUN_SEPARATORS.findall(run)) * 16 <= len(run))


# ---------------------------------------------------------------------------
# Headings and chunking.

# Bump when chunking or keyword terms change: it is part of the manifest, so stores rebuild.
CHUNKER_VERSION = "5"
HEADING_SEPARATOR = " > "
MERGED_HEADING_SEPARATOR = "; "  # between the headings a merged chunk covers (merged_heading)
_ANCHOR_SUFFIX = re.compile(r"\s*\{#[^}]*\}\s*$")


@dataclass(frozen=True)
class Heading:
    line: int  # 0-based line index within the body that was parsed
    end: int  # exclusive
    level: int
    text: str


@dataclass(frozen=True)
class Chunk:
    index: int
    start_line: int  # 1-based, inclusive, in the original file
    end_line: int
    heading: str  # heading path, e.g. "Deploy runbook > Rollback > Database"
    text: str


def _markdown_tokens(lines: Sequence[str]) -> list[Any]:
    from markdown_it import MarkdownIt

    # markdown-it treats a lone CR as a line break; our lines split on LF only, so the parser
    # must not see one or every line number after it would shift.
    # Block structure only: headings and block boundaries are all chunking reads, and the inline
    # pass (emphasis, links) took 40% of parsing a 20 MB file. Heading text is the inline token's
    # content, which the block pass already sets.
    return MarkdownIt("commonmark").disable(["inline", "text_join"]).parse("\n".join(lines).replace("\r", " "))


@dataclass(frozen=True)
class BodyStructure:
    """What chunking needs from the CommonMark parse of a body: its top-level headings and the
    first line (0-based) of every top-level block."""

    headings: tuple[Heading, ...]
    block_starts: tuple[int, ...]


def body_structure(body: Sequence[str]) -> BodyStructure:
    tokens = _markdown_tokens(body)
    return BodyStructure(headings=tuple(_headings_from_tokens(tokens)),
                         block_starts=tuple(sorted(tok.map[0] for tok in tokens
                                                   if tok.level == 0 and tok.map and tok.nesting >= 0)))


def _headings_from_tokens(tokens: Sequence[Any]) -> list[Heading]:
    headings = []
    for i, tok in enumerate(tokens):
        if tok.type == "heading_open" and tok.level == 0 and tok.map:
            text = _ANCHOR_SUFFIX.sub("", tokens[i + 1].content).strip()
            # Capped here: every chunk of a section carries its heading path, so a heading of a
            # megabyte would cost memory with the square of its length.
            headings.append(Heading(line=tok.map[0], end=tok.map[1], level=int(tok.tag[1]),
                                    text=metadata_text(nfc(text))))
    return headings


@dataclass(frozen=True)
class _Body:
    """What chunking measures of a body: each line's searchable tokens, its blocks and sections."""

    meanings: tuple[int, ...]  # estimate_tokens of each line's searchable text
    block_starts: tuple[int, ...]  # first line of every top-level block, sorted
    section_starts: tuple[int, ...]  # first line of every section (0 first), sorted
    section_paths: tuple[str, ...]  # each section's heading path ("" for none)
    running: tuple[int, ...] = ()  # running sums of meanings, from 0, so a range costs two lookups

    def __post_init__(self) -> None:
        object.__setattr__(self, "running", (0, *itertools.accumulate(self.meanings)))

    def meaning(self, start: int, end: int) -> int:
        return self.running[end] - self.running[start]

    def tokens(self, start: int, end: int) -> int:
        """The budget's measure of lines: searchable tokens plus one a line break."""
        return self.meaning(start, end) + end - start

    def headings(self, start: int, end: int) -> list[str]:
        """Heading paths of the sections lines [start, end) hold text of, in order."""
        filled = next((i for i in range(start, end) if self.meanings[i]), start)
        first = bisect.bisect_right(self.section_starts, filled) - 1
        last = bisect.bisect_left(self.section_starts, end)
        return [path for path in self.section_paths[first:last] if path]


@dataclass(frozen=True)
class _Span:
    start: int  # 0-based index into the body lines, inclusive
    end: int  # exclusive


def searchable_tokens(text: str) -> int:
    """The chunker's measure of text: its estimate once URL payloads are shortened, as embedded."""
    return estimate_tokens(searchable_text(text))


def merged_heading(paths: Sequence[str]) -> str:
    """The heading of a chunk covering these sections' heading paths: the first path, then the
    last heading of every other path, after "; ". A first path the second extends is named by
    it (an intro merged with its first subsection reads "Guide > Testing", not "Guide; Testing").

    ["Guide", "Guide > Testing", "Guide > Testing > Unit", "Guide > Setup"] -> "Guide > Testing > Unit; Setup"
    """
    paths = list(paths)
    while len(paths) > 1 and paths[1].startswith(paths[0] + HEADING_SEPARATOR):
        paths.pop(0)
    if not paths:
        return ""
    return metadata_text(MERGED_HEADING_SEPARATOR.join([paths[0], *(p.rsplit(HEADING_SEPARATOR, 1)[-1]
                                                                   for p in paths[1:])]))


def _embedded_tokens(body: _Body, span: _Span) -> int:
    """A span's tokens as embedded: its lines led by its heading and a blank line."""
    return body.tokens(span.start, span.end) + _heading_tokens(merged_heading(body.headings(span.start, span.end))) + 2


@functools.lru_cache(maxsize=1024)
def _heading_tokens(heading: str) -> int:
    """searchable_tokens of a heading, kept: merging asks again for the same headings, and one
    absurd heading (200 KB) re-estimated at every check made chunking its file 30 times slower."""
    return searchable_tokens(heading)


def _split_oversized(body: _Body, span: _Span, max_tokens: int) -> list[_Span]:
    """Split a section at top-level block boundaries (never inside a fence), then at lines; a
    line over the budget on its own is a piece of its own."""
    if body.tokens(span.start, span.end) <= max_tokens:
        return [span]
    starts = body.block_starts
    cuts = starts[bisect.bisect_right(starts, span.start):bisect.bisect_left(starts, span.end)]
    # A single block above the budget (a huge fence or list) falls back to line boundaries.
    fine: list[tuple[int, int]] = []
    for start, end in zip([span.start, *cuts], [*cuts, span.end], strict=True):
        fine.extend([(start, end)] if body.tokens(start, end) <= max_tokens else [(i, i + 1) for i in range(start, end)])
    pieces: list[_Span] = []
    for start, end in fine:
        if pieces and body.tokens(pieces[-1].start, end) <= max_tokens:
            pieces[-1] = _Span(pieces[-1].start, end)
        else:
            pieces.append(_Span(start, end))
    return pieces


def _merge_small(body: _Body, spans: list[_Span], min_tokens: int, max_tokens: int,
                 context_tokens: int) -> list[_Span]:
    """Join every span under min_tokens of meaning with a neighbour: one where the pair stays
    within max_tokens first, else up to context_tokens (a little over the budget beats a
    fragment); then the next span (a heading-only section belongs with what follows). Where
    neither pair fits the context, the small span takes lines from a neighbour (_reshare)."""
    merged: list[_Span] = []

    def resolve(at: int) -> bool:
        """Join merged[at] with a neighbour if it is small and one fits; whether anything changed."""
        span = merged[at]
        if body.meaning(span.start, span.end) >= min_tokens:
            return False
        options = []
        for low in (at, at - 1):  # with the next span, then with the previous one
            if 0 <= low < len(merged) - 1:
                pair = _Span(merged[low].start, merged[low + 1].end)
                if _embedded_tokens(body, pair) <= context_tokens:
                    options.append(((body.tokens(pair.start, pair.end) > max_tokens, low != at), low, [pair]))
                elif shared := _reshare(body, merged[low], merged[low + 1], min_tokens, context_tokens):
                    options.append(((True, low != at), low, shared))
        if not options:
            return False
        _, low, replacement = min(options, key=lambda option: option[0])
        merged[low:low + 2] = replacement
        return len(replacement) == 1  # a reshare leaves no small span behind: nothing more to do here

    for span in spans:
        merged.append(span)
        # merged[-2] now has both neighbours; a join may leave a small span again, so repeat.
        while len(merged) >= 2 and resolve(len(merged) - 2):
            pass
    while len(merged) >= 2 and resolve(len(merged) - 1):
        pass
    # A reshare shrinks a neighbour after the span before it was found too big to join it: look
    # at every small span once more (joins only shorten the list, reshares are not repeated).
    at = 0
    while at < len(merged):
        at = max(0, at - 1) if len(merged) >= 2 and resolve(at) else at + 1
    return merged


def _reshare(body: _Body, left: _Span, right: _Span, min_tokens: int, context_tokens: int) -> list[_Span] | None:
    """Two neighbours too big to join, one of them under min_tokens: cut them again where both
    have min_tokens and fit the context, at a block boundary if one will do, nearest the old cut."""
    inside = [k for k in range(left.start + 1, right.end) if k != right.start]
    blocks = set(body.block_starts)
    for candidates in ([k for k in inside if k in blocks], inside):
        fitting = [k for k in candidates
                   if body.meaning(left.start, k) >= min_tokens and body.meaning(k, right.end) >= min_tokens
                   and _embedded_tokens(body, _Span(left.start, k)) <= context_tokens
                   and _embedded_tokens(body, _Span(k, right.end)) <= context_tokens]
        if fitting:
            cut = min(fitting, key=lambda k: abs(k - right.start))
            return [_Span(left.start, cut), _Span(cut, right.end)]
    return None


def _cut_long_line(line: str, max_tokens: int, min_tokens: int) -> list[str]:
    """Pieces of one line too long for the model's context (minified JSON, data), each within
    max_tokens of searchable text: cut at whitespace, else between words and symbols, never
    inside a URL. A last piece under min_tokens shares the cut with the one before it evenly."""
    units = list(_cut_units(line, max_tokens))
    costs = [searchable_tokens(unit) for unit in units]
    bounds = [0]
    used = 0
    for i, cost in enumerate(costs):
        if used + cost > max_tokens and i > bounds[-1]:
            bounds.append(i)
            used = 0
        used += cost
    if len(bounds) > 1 and sum(costs[bounds[-1]:]) < min_tokens:
        start = bounds[-2]
        half = sum(costs[start:]) / 2
        bounds[-1] = min(range(start + 1, len(costs)), key=lambda k: abs(sum(costs[start:k]) - half))
    return ["".join(units[a:b]) for a, b in zip(bounds, [*bounds[1:], len(units)], strict=True)]


def _cut_units(line: str, max_tokens: int) -> Iterable[str]:
    """A line's pieces that are never cut: words with their trailing space; a word over the
    budget by itself falls back to URLs (whole), runs of letters and digits, and single symbols."""
    for word in _WORD_WITH_SPACE.findall(line):
        if searchable_tokens(word) <= max_tokens:
            yield word
            continue
        for part in _WORD_PIECES.finditer(word):
            # Only a run of letters larger than the whole budget is cut inside (three letters a token).
            piece = part.group(0)
            yield from [piece] if searchable_tokens(piece) <= max_tokens else _ESTIMATE_ATOMS.findall(piece)


_WORD_WITH_SPACE = re.compile(r"\S+\s*|\s+")
_URL = re.compile(rf"{_URL_START}[{_URL_PATH_CHARS}?#]+")
_WORD_PIECES = re.compile(rf"{_DATA_URI.pattern}|{_URL.pattern}|[A-Za-z0-9_]+|.", re.DOTALL)
_ESTIMATE_ATOMS = re.compile(r"[A-Za-z]{1,3}|.", re.DOTALL)


def chunk_document(doc: SourceDocument, max_tokens: int, min_tokens: int,
                   context_tokens: int | None = None) -> list[Chunk]:
    """Split a document's body into chunks of about `max_tokens`, estimated on searchable_text
    (a 1.5 KB playground link costs a few tokens); chunk texts are the document's lines as written.

    `context_tokens` is what the model takes of a chunk with its heading (max_tokens when not given):
    - line ranges are contiguous and cover the body exactly once;
    - a line is cut only when it cannot fit the context with its heading: its pieces (each within
      max_tokens, none under min_tokens) are the only chunks that share a line;
    - no chunk has under min_tokens of searchable text unless the document is one chunk: a small
      span joins a neighbour, over max_tokens if need be, up to context_tokens;
    - a chunk's heading is the heading path of its first section, then the last heading of every
      other section it covers (merged_heading); text before the first heading has the title.
    """
    lines = doc.lines[doc.body_start - 1:]
    if not any(line.strip() for line in lines):
        return []
    context_tokens = max(max_tokens, context_tokens or max_tokens)
    structure = doc.structure if doc.structure is not None else body_structure(lines)
    path_at: dict[int, str] = {0: doc.title}
    stack: list[Heading] = []
    for heading in structure.headings:
        stack = [h for h in stack if h.level < heading.level] + [heading]
        path_at[heading.line] = metadata_text(HEADING_SEPARATOR.join(h.text for h in stack if h.text))
    starts = sorted(path_at)
    body = _Body(tuple(searchable_tokens(line) for line in lines), structure.block_starts, tuple(starts),
                 tuple(path_at[s] for s in starts))
    if doc.chunk_mode == "whole" and body.tokens(0, len(lines)) <= max_tokens:
        spans = [_Span(0, len(lines))]
    else:
        sections = [_Span(s, e) for s, e in zip(starts, [*starts[1:], len(lines)], strict=True)]
        pieces = [piece for section in sections for piece in _split_oversized(body, section, max_tokens)]
        spans = _merge_small(body, pieces, min_tokens, max_tokens, context_tokens)
    chunks: list[Chunk] = []
    offset = doc.body_start
    for span in spans:
        text = "\n".join(lines[span.start:span.end]).strip()
        if not text:
            # Whitespace-only spans (trailing blank lines) join the previous chunk's range.
            if chunks:
                chunks[-1] = _extend(chunks[-1], span.end + offset - 1)
            continue
        paths = body.headings(span.start, span.end)
        # A whole document is named by its first heading (or title), not by all of them.
        heading = merged_heading(paths[:1] if doc.chunk_mode == "whole" and len(spans) == 1 else paths)
        # A single line over the context is the one cut (the embedder halves anything else it refuses).
        cut = "\n" not in text and _embedded_tokens(body, span) > context_tokens
        for part in _cut_long_line(text, max_tokens, min_tokens) if cut else [text]:
            chunks.append(Chunk(len(chunks), span.start + offset, span.end + offset - 1, heading, part.strip()))
    if chunks and chunks[0].start_line > doc.body_start:
        first = chunks[0]
        chunks[0] = Chunk(0, doc.body_start, first.end_line, first.heading, first.text)
    return chunks


def _extend(chunk: Chunk, end_line: int) -> Chunk:
    return Chunk(chunk.index, chunk.start_line, end_line, chunk.heading, chunk.text)


# ---------------------------------------------------------------------------
# Embedding prefixes: a small registry keyed by model family.


@dataclass(frozen=True)
class PrefixScheme:
    name: str
    document: str  # format string with {title} and {text}
    query: str  # format string with {query}

    def document_text(self, title: str, text: str) -> str:
        return self.document.format(title=title or "none", text=text)

    def query_text(self, query: str) -> str:
        return self.query.format(query=query)


_RETRIEVAL_INSTRUCTION = "Represent this sentence for searching relevant passages: {query}"
PREFIX_SCHEMES: dict[str, PrefixScheme] = {
    scheme.name: scheme
    for scheme in (
        PrefixScheme("embeddinggemma", "title: {title} | text: {text}", "task: search result | query: {query}"),
        PrefixScheme("nomic-embed-text", "search_document: {text}", "search_query: {query}"),
        PrefixScheme("e5", "passage: {text}", "query: {query}"),
        PrefixScheme("mxbai-embed-large", "{text}", _RETRIEVAL_INSTRUCTION),
        PrefixScheme("snowflake-arctic-embed", "{text}", _RETRIEVAL_INSTRUCTION),
        # Arctic Embed 2.0 (model card): queries get "query: ", documents nothing.
        PrefixScheme("snowflake-arctic-embed2", "{text}", "query: {query}"),
        # bge-m3's model card: no instruction is needed for dense retrieval.
        PrefixScheme("bge-m3", "{text}", "{query}"),
        PrefixScheme("none", "{text}", "{query}"),
    )
}
_FAMILY_PATTERNS = (
    ("embeddinggemma", re.compile(r"^embeddinggemma")),
    ("nomic-embed-text", re.compile(r"^nomic-embed-text")),
    ("e5", re.compile(r"(^|-)e5(-|$)")),
    ("mxbai-embed-large", re.compile(r"^mxbai-embed-large")),
    ("snowflake-arctic-embed2", re.compile(r"^snowflake-arctic-embed(2|-[a-z]+-v2)")),
    ("snowflake-arctic-embed", re.compile(r"^snowflake-arctic-embed")),
    ("bge-m3", re.compile(r"^bge-m3")),
)


def model_base_name(model: str) -> str:
    """'library/EmbeddingGemma:latest' -> 'embeddinggemma' (namespace and tag do not change the family)."""
    name = model.strip().lower().rsplit("/", 1)[-1]
    return name.split(":", 1)[0]


def canonical_model_name(model: str) -> str:
    """The identity of a model as Ollama resolves it: 'EmbeddingGemma', 'library/embeddinggemma'
    and 'embeddinggemma:latest' are one model; 'alice/bge-m3' and 'bob/bge-m3' are two."""
    name = model.strip().lower()
    for default in ("registry.ollama.ai/", "library/"):
        name = name.removeprefix(default)
    return name if ":" in name.rsplit("/", 1)[-1] else name + ":latest"


def same_model(a: str, b: str) -> bool:
    return canonical_model_name(a) == canonical_model_name(b)


def prefix_scheme_for(model: str) -> PrefixScheme | None:
    """The documented prefix scheme of a model family; None for an unknown model (no prefix)."""
    base = model_base_name(model)
    for name, pattern in _FAMILY_PATTERNS:
        if pattern.search(base):
            return PREFIX_SCHEMES[name]
    return None


def embedded_document_text(scheme: PrefixScheme, title: str, heading: str, text: str) -> str:
    """What ingest sends to the embedder for a chunk: the heading path leads the searchable text."""
    text = searchable_text(text)
    if heading and heading != title:
        text = f"{searchable_text(heading)}\n\n{text}"
    return scheme.document_text(title, text)


# ---------------------------------------------------------------------------
# Keyword terms: one tokenizer for the FTS5 index and for queries.

_STOP_WORDS = frozenset(
    "a an and are as at be by can do does for from how i if in into is it its of on or so that the their "
    "then there these this to was what when where which who why will with you your".split()
)
_RUN = re.compile(rf"[{_CJK_CHARS}]+|[^\s{_CJK_CHARS}]+")
_CJK_RUN = re.compile(rf"[{_CJK_CHARS}]")
_HIRAGANA_ONLY = re.compile(r"^[\u3040-\u309f]+$")
_IDENT_PIECE = re.compile(r"[\w.\-/:$@]+")
_CAMEL_EDGE = re.compile(r"[a-z][A-Z]|[A-Z][A-Z][a-z]")
_CAMEL = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+\d*|[A-Z]+\d*|\d+")
_WORD_PARTS = re.compile(r"[^\W_]+")
FTS_TOKENCHARS = "_.-/:$@"


def keyword_terms(text: str) -> list[str]:
    """Terms for the keyword channel: identifiers whole and in parts, words, CJK bigrams.

    `OLLAMA_KEEP_ALIVE` -> ollama_keep_alive, ollama, keep, alive; `defineProps` -> defineprops,
    define, props; Japanese runs -> overlapping character bigrams.
    """
    terms: list[str] = []
    for run in _RUN.findall(unicodedata.normalize("NFKC", text)):
        if _CJK_RUN.match(run):
            # Hiragana-only bigrams are particles and inflections (しま, ます): noise that
            # measurably hurt the Japanese dev-set queries.
            bigrams = (run[i:i + 2] for i in range(max(1, len(run) - 1)))
            terms.extend(b for b in bigrams if not _HIRAGANA_ONLY.match(b))
            continue
        terms.extend(_run_terms(run))
    return terms


def indexed_terms(text: str) -> list[str]:
    """The keyword terms of indexed text (a title, heading path or chunk): those of its
    searchable_text, as ingest writes them and the server reads a passage's."""
    return keyword_terms(searchable_text(text))


@functools.lru_cache(maxsize=1 << 16)
def _run_terms(run: str) -> tuple[str, ...]:
    """The terms of one whitespace-delimited, non-CJK run. Cached: prose repeats its words, and
    this was the slowest step of indexing a 20 MB file."""
    terms: list[str] = []
    for piece in _IDENT_PIECE.findall(run):
        piece = piece.strip(".-/:$@")
        if not piece:
            continue
        words = _WORD_PARTS.findall(piece)
        parts = [w.lower() for w in words]
        # camelCase / PascalCase halves: defineProps -> define, props (digits stay attached).
        parts += [p.lower() for w in words if _CAMEL_EDGE.search(w) for p in _CAMEL.findall(w)]
        whole = piece.lower()
        terms.extend(t for t in dict.fromkeys([whole, *parts]) if t not in _STOP_WORDS)
    return tuple(terms)


QUERY_TERMS_MAX = 64


def query_terms(query: str) -> list[str]:
    """A query's keyword terms as the keyword channel searches them: unique, in order, at most 64."""
    return list(dict.fromkeys(keyword_terms(query)))[:QUERY_TERMS_MAX]


def fts_any(terms: Sequence[str]) -> str | None:
    """An FTS5 MATCH expression that can only mean "any of these terms": every term is quoted, so
    user text is never FTS5 syntax (quotes, *, NEAR, -, column filters). None for no terms."""
    return " OR ".join(_fts_quoted(term) for term in terms) or None


def fts_every(terms: Sequence[str]) -> str | None:
    """As fts_any, for "every one of these terms"."""
    return " AND ".join(_fts_quoted(term) for term in terms) or None


def _fts_quoted(term: str) -> str:
    return '"' + term.replace('"', '""') + '"'


# Identifier-like query tokens: what a user types when they mean one exact thing. Each is checked
# as a whole keyword term (identifier_term), so `OLLAMA_KEEP_ALIVE` is not "found" through a
# passage that only says "keep alive".
_BACKTICKED = re.compile(r"`([^`\n]{2,100})`")
_QUERY_TOKEN = re.compile(r"[^\s,;()\[\]{}<>\"'`!?、。，．（）「」『』]+")
_IDENTIFIER_SHAPES = (
    re.compile(r"--?[A-Za-z][\w-]*"),  # --flags
    re.compile(r"/[\w.{}:-]+(?:/[\w.{}:-]*)*"),  # /api/paths, /slash-commands
    re.compile(r"[A-Za-z][A-Za-z0-9]*(?:_[A-Za-z0-9]+)+"),  # UPPER_SNAKE, snake_case
    re.compile(r"[a-z]+[0-9]*[A-Z][A-Za-z0-9]*"),  # camelCase
    re.compile(r"[A-Z][a-z0-9]+[A-Z][A-Za-z0-9]*"),  # PascalCase with two humps or more (ReplicaSet)
    re.compile(r"[A-Za-z_$][\w$-]*(?:\.[A-Za-z_$][\w$-]*)+"),  # dotted.names, file.ext
    re.compile(r"[A-Z]{1,5}\d{2,}"),  # error codes: E1234, HTTP404
    re.compile(r"E[A-Z]{3,}"),  # errno names: ENOSPC, EACCES
    re.compile(r"[A-Z][A-Z0-9]*(?:-[A-Z0-9]+)+"),  # codes and keys: QZX-7781, PROJ-1234 (with a digit, below)
    re.compile(r"[a-z][a-z0-9]*(?:-[a-z0-9]+)+"),  # kebab-case, kept below only when unmistakable
)
_KEBAB = _IDENTIFIER_SHAPES[-1]
_UPPER_CODE = _IDENTIFIER_SHAPES[-2]
# A call's name starts a keyword token: not after a letter, digit or joiner (Japanese may precede).
_CALL = re.compile(rf"(?<![^\W{_CJK_CHARS}])(?<![.\-/:$@])([A-Za-z_$][A-Za-z0-9_$.]*)\((?!e?s\))")  # ref(), not file(s)
_NON_CJK = re.compile(rf"[^{_CJK_CHARS}]+")
IDENTIFIERS_MAX = 8


def _looks_like_identifier(token: str) -> bool:
    if not any(shape.fullmatch(token) for shape in _IDENTIFIER_SHAPES):
        return False
    if _UPPER_CODE.fullmatch(token):
        return any(ch.isdigit() for ch in token)  # READ-ONLY is shouting, QZX-7781 a code
    if _KEBAB.fullmatch(token):
        # Hyphenated English (on-call, read-only) is not an identifier; v-model and sev-1 are.
        return any(len(part) == 1 or any(ch.isdigit() for ch in part) for part in token.split("-"))
    if "." in token and not token.startswith("/"):
        # e.g. and i.e. are not dotted names.
        return any(len(part) > 1 for part in token.split("."))
    return True


def query_identifiers(query: str) -> list[str]:
    """The identifier-like tokens of a query, as typed, at most IDENTIFIERS_MAX: a single token in
    backticks, calls (`ref()`), and tokens shaped like UPPER_SNAKE, snake_case, camelCase,
    PascalCase, dotted.names, /api/paths, --flags, error codes (E1234, ENOSPC) or kebab-case with a
    digit or a one-letter part (v-model, sev-1). A token ends where Japanese text begins."""
    text = nfc(query)
    found: list[str] = []
    for span in _BACKTICKED.findall(text):
        tokens = span.split()
        # `pyproject.toml` is an identifier whatever its shape; in `uv run --frozen` only --frozen is.
        found.extend(tokens if len(tokens) == 1 and len(span) > 1 else
                     [t for t in map(_query_token, tokens) if _looks_like_identifier(t)])
    rest = _BACKTICKED.sub(" ", text)
    found.extend(f"{name}()" for name in _CALL.findall(unicodedata.normalize("NFKC", rest)))
    for token in _QUERY_TOKEN.findall(rest):
        # Japanese runs straight into code (`v-modelを使う`): the script change ends the token.
        found.extend(run for run in map(_query_token, _NON_CJK.findall(token)) if _looks_like_identifier(run))
    unique: dict[str, str] = {}
    for token in found:
        term = identifier_term(token)
        if term and term not in unique:
            unique[term] = token
    return list(unique.values())[:IDENTIFIERS_MAX]


def _query_token(token: str) -> str:
    """A token as an identifier is written, without the sentence's punctuation (`ENOSPC:`, `base,`)."""
    return token.rstrip(".:,")


def identifier_term(identifier: str) -> str | None:
    """The keyword term an identifier is indexed under as a whole (the first term
    keyword_terms gives it): `OLLAMA_KEEP_ALIVE` -> ollama_keep_alive, `--frozen` -> frozen."""
    terms = keyword_terms(identifier)
    return terms[0] if terms and not _CJK_RUN.match(terms[0]) else None


def cjk_share(text: str) -> float:
    """The share of CJK characters among the letters of a text (0.0 for none), how a document's
    or a query's language is told apart: Japanese or Chinese text is mostly CJK, English none."""
    if len(text) > CJK_SAMPLE_CHARS:  # a language share needs no more than a spread-out sample
        step = len(text) // 4
        text = "".join(text[i * step:i * step + CJK_SAMPLE_CHARS // 4] for i in range(4))
    letters = len(_LETTER.findall(text))
    return len(_CJK_CHAR.findall(text)) / letters if letters else 0.0


_LETTER = re.compile(r"[^\W\d_]")
_CJK_CHAR = re.compile(f"[{_CJK_CHARS}]")
CJK_SAMPLE_CHARS = 1 << 16
# A text whose letters are at least this share CJK is written in Japanese/CJK. English holds none;
# Japanese text with code and API names in it holds far less than its prose suggests (a Latin word
# counts ~5 letters, a Japanese one ~2): the Vite docs' documents measure 0.29-0.71, and a Japanese
# question naming two identifiers 0.17.
CJK_DOCUMENT = 0.1


def reads_as_cjk(share: float) -> bool:
    """Whether a text with this cjk_share is written in Japanese/CJK (for documents and queries alike)."""
    return share >= CJK_DOCUMENT


# ---------------------------------------------------------------------------
# Store layout, ids, metadata keys, manifest.

CURRENT_FILE = "CURRENT.json"
STORE_ID_FILE = "store-id"
STORE_ID = re.compile(r"[0-9a-f]{16}")
CURRENT_MAX_BYTES = 1 << 20
INDEX_NAME = re.compile(r"idx-[0-9a-f]{12}")
LOCK_FILE = "ingest.lock"
CHROMA_SUBDIR = "chroma"
KEYWORD_DB = "keywords.sqlite3"
COLLECTION_BY_LIFECYCLE = {"active": "chunks_active", "superseded": "chunks_superseded"}
# Chroma metadata keys written on every chunk (chunk_metadata builds them, in this order).
META_KEYS = ("path", "title", "heading", "chunk_index", "start_line", "end_line", "lifecycle",
             "content_hash", "mtime_ns", "chunk_mode")


def chunk_metadata(doc: SourceDocument, chunk: Chunk, content_hash: str, mtime_ns: int) -> dict[str, Any]:
    """What is stored with every chunk's vector, `lifecycle` included (the pre-filter's key)."""
    return dict(zip(META_KEYS, (doc.path, doc.title, chunk.heading, chunk.index, chunk.start_line, chunk.end_line,
                                doc.lifecycle, content_hash, mtime_ns, doc.chunk_mode), strict=True))

KEYWORD_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
-- disk_path: the path relative to the corpus as the file system spells it (may be NFD);
-- real_path: its resolved absolute path at ingest. get_file re-resolves disk_path and insists on
-- real_path, which is how a file swapped for a symlink after ingest is caught. cjk_share: of the
-- body's letters (NULL only in stores written before it existed, until ingest fills it).
-- superseded_by: successors_column() of the frontmatter's successors; NULL: not recorded (a store
-- written before it existed: ingest reads such superseded documents again to record it).
CREATE TABLE IF NOT EXISTS documents(
    path TEXT PRIMARY KEY, title TEXT NOT NULL, lifecycle TEXT NOT NULL, chunk_mode TEXT NOT NULL,
    content_hash TEXT NOT NULL, size INTEGER NOT NULL, mtime_ns INTEGER NOT NULL,
    disk_path TEXT NOT NULL, real_path TEXT NOT NULL, line_count INTEGER NOT NULL, chunk_count INTEGER NOT NULL,
    cjk_share REAL, superseded_by TEXT);
-- embed_key: embed_key() of the exact text embedded for the chunk (ingest reuses its vector for any
-- chunk with the same key); NULL only in stores written before it existed, until ingest fills it.
CREATE TABLE IF NOT EXISTS chunks(
    id TEXT PRIMARY KEY, path TEXT NOT NULL, chunk_index INTEGER NOT NULL,
    start_line INTEGER NOT NULL, end_line INTEGER NOT NULL, heading TEXT NOT NULL,
    lifecycle TEXT NOT NULL, text TEXT NOT NULL, embed_key TEXT);
CREATE INDEX IF NOT EXISTS chunks_by_path ON chunks(path, chunk_index);
-- Documents whose chunks are keyword-indexed but have no vectors yet (ingest ran while Ollama could
-- not embed them), with their chunk count; the next run that can embed takes them first.
CREATE TABLE IF NOT EXISTS vectors_pending(path TEXT PRIMARY KEY, chunks INTEGER NOT NULL);
CREATE VIRTUAL TABLE IF NOT EXISTS chunks_fts USING fts5(
    title, heading, body, tokenize="unicode61 remove_diacritics 0 tokenchars '{FTS_TOKENCHARS}'");
-- How many passages hold each term that was in at least COMMON_TERM_PASSAGES of them when the
-- keyword index was last compacted, kept exact by every write since (in the same transaction).
-- FTS5 counts a term's passages by walking its whole posting list: a common word's count is read
-- here instead. A term not listed is counted by FTS5 (fts5vocab).
CREATE TABLE IF NOT EXISTS common_terms(term TEXT PRIMARY KEY, passages INTEGER NOT NULL) WITHOUT ROWID;
"""
# A term in this many passages has its count kept by ingest (see common_terms): FTS5's own count
# costs time in proportion to the passages, paid by a server for each new word of each generation.
COMMON_TERM_PASSAGES = 2000


def row_terms(*columns: str) -> set[str]:
    """The distinct FTS5 tokens of a chunks_fts row, from its columns as ingest writes them:
    space-joined keyword terms, each one token, already case-folded."""
    return {term for column in columns for term in column.split()}


# bm25 column weights (title, heading, body): a heading or title hit says more than a body hit.
FTS_WEIGHTS = (2.0, 3.0, 1.0)


@dataclass(frozen=True)
class DocumentRow:
    """A row of `documents` (document_columns(), in this order)."""

    path: str
    title: str
    lifecycle: str
    chunk_mode: str
    content_hash: str
    size: int
    mtime_ns: int
    disk_path: str
    real_path: str
    line_count: int
    chunk_count: int
    superseded_by: str | None  # as stored (successors_from_column reads it); None: not recorded

    def successors_unrecorded(self) -> bool:
        """A superseded document of a store written before successors were recorded."""
        return self.lifecycle == "superseded" and self.superseded_by is None


def document_columns(present: Iterable[str]) -> str:
    """DocumentRow's columns as a select list for a documents table with these columns: a store
    written before superseded_by existed reads NULL (not recorded) for it, so the server reads it
    without a migration (it never writes) and ingest adds the column when it opens the store."""
    have = set(present)
    return ", ".join(f"NULL AS {name}" if name == "superseded_by" and name not in have else name
                     for name in DocumentRow.__dataclass_fields__)


@dataclass(frozen=True)
class ChunkRow:
    """A row of `chunks` with its document's title joined in (CHUNK_SELECT), so a search needs no
    separate title query."""

    id: str
    path: str
    chunk_index: int
    start_line: int
    end_line: int
    heading: str
    lifecycle: str
    text: str
    title: str


CHUNK_COLUMNS = ("c.id, c.path, c.chunk_index, c.start_line, c.end_line, c.heading, c.lifecycle, c.text, "
                 "coalesce(d.title, c.path)")
CHUNK_SELECT = f"SELECT {CHUNK_COLUMNS} FROM chunks c LEFT JOIN documents d ON d.path = c.path"


# What ingest measures about the corpus for the server, kept in the keyword index's `meta` table
# (written in the same transaction as the stamp, so a server never sees one without the other).
META_CORPUS_FACTS = "corpus_facts"
META_CALIBRATION = "calibration"
META_CALIBRATED_AT = "calibrated_at_chunks"  # the active chunk count at the last calibration attempt
FACTS_FOLDERS_MAX = 8


@dataclass(frozen=True)
class CorpusFacts:
    """What an agent should know before it phrases a search: how many documents, in which
    languages (a document is Japanese/CJK when at least CJK_DOCUMENT of its letters are), and the
    biggest top-level folders."""

    documents: int
    superseded: int
    cjk_documents: int
    folders: tuple[tuple[str, int], ...]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: str) -> CorpusFacts:
        data = json_value(raw)
        return cls(documents=int(data["documents"]), superseded=int(data["superseded"]),
                   cjk_documents=int(data["cjk_documents"]),
                   folders=tuple((str(name), int(count)) for name, count in data["folders"]))


def corpus_facts(rows: Iterable[tuple[str, str, float | None]]) -> CorpusFacts:
    """Facts from (path, lifecycle, cjk_share) of every document."""
    documents = superseded = cjk = 0
    folders: dict[str, int] = {}
    for path, lifecycle, share in rows:
        documents += 1
        superseded += lifecycle == "superseded"
        cjk += reads_as_cjk(share or 0.0)
        top = path.split("/", 1)[0] + "/" if "/" in path else "(top level)"
        folders[top] = folders.get(top, 0) + 1
    biggest = sorted(folders.items(), key=lambda item: (-item[1], item[0]))[:FACTS_FOLDERS_MAX]
    return CorpusFacts(documents, superseded, cjk, tuple(biggest))


@dataclass(frozen=True)
class Calibration:
    """How far a passage that answers a query stands out from the crowd of near misses in this
    corpus, measured at ingest with the corpus's own headings as queries. A query's *margin* is
    its best passage's similarity minus the mean similarity of the next ones (up to
    MARGIN_CROWD): `related` is the median margin of each heading's best passage in its own
    document, `unrelated` the median margin of its best passage among the other documents only
    (an on-topic question the documents do not answer). Raw cosine scores mean little across
    embedders and query lengths (one embedder puts everything at 0.85-0.90, a long question scores
    lower than a short heading); how far the best stands out from the crowd does."""

    unrelated: float
    related: float
    queries: int
    chunks: int

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: str) -> Calibration:
        data = json_value(raw)
        values = (float(data["unrelated"]), float(data["related"]))
        if not all(math.isfinite(v) for v in values):
            raise ValueError("calibration values must be finite")
        return cls(*values, queries=int(data["queries"]), chunks=int(data["chunks"]))

    def position(self, margin: float) -> float:
        """Where a margin sits on this scale: 0 at unrelated, 1 at related, beyond them outside."""
        span = max(self.related - self.unrelated, 1e-6)
        return (margin - self.unrelated) / span


MARGIN_CROWD = 20  # a margin compares the best similarity with the mean of the next ones, up to this rank


def margin(similarities: Sequence[float], best: float | None = None) -> float | None:
    """How far `best` (default: the best of the similarities) stands out from the crowd: minus
    the mean of ranks 2..MARGIN_CROWD of the similarities. None for fewer than three."""
    ranked = sorted(similarities, reverse=True)[:MARGIN_CROWD]
    if len(ranked) < 3:
        return None
    return (ranked[0] if best is None else best) - statistics.fmean(ranked[1:])


CALIBRATION_QUERIES = 48  # headings embedded as queries at ingest (one batched call)
CALIBRATION_MIN_QUERIES = 4
CALIBRATION_NEIGHBOURS = 2 * MARGIN_CROWD
CALIBRATION_DRIFT = 0.2  # recalibrate when the active chunk count moved by more than this share
CALIBRATION_PER_DOCUMENT = 3


def calibration_queries(rows: Iterable[tuple[str, str, str]], limit: int = CALIBRATION_QUERIES) -> list[tuple[str, str]]:
    """(path, query) pairs from (chunk id, path, heading path) rows: the last heading of a chunk,
    at most CALIBRATION_PER_DOCUMENT per document and `limit` in all, in the order of a hash of
    the chunk id (ids are content-addressed: the same corpus gives the same sample, spread over
    its documents). Headings too short to be a question, and repeats, are skipped."""
    picked: list[tuple[str, str]] = []
    per_document: dict[str, int] = {}
    seen: set[str] = set()
    for _chunk, path, heading in sorted(rows, key=lambda row: hashlib.sha256(row[0].encode()).digest()):
        last = heading.rsplit(" > ", 1)[-1].strip()
        if per_document.get(path, 0) >= CALIBRATION_PER_DOCUMENT or last.lower() in seen or len(keyword_terms(last)) < 2:
            continue
        picked.append((path, last))
        per_document[path] = per_document.get(path, 0) + 1
        seen.add(last.lower())
        if len(picked) >= limit:
            break
    return picked


def calibrate(neighbours: Sequence[tuple[str, Sequence[tuple[str, float]]]], chunks: int) -> Calibration | None:
    """A Calibration from each calibration query's own path and its nearest passages as
    (path, similarity), best first: the related margin over all of them when the best is in the
    query's own document, the unrelated margin over the other documents' alone. None when fewer
    than CALIBRATION_MIN_QUERIES queries gave both."""
    unrelated, related = [], []
    for own, found in neighbours:
        everything = [sim for _path, sim in found]
        others = [sim for path, sim in found if path != own]
        if not found or found[0][0] != own:
            continue
        answered, missed = margin(everything), margin(others)
        if answered is not None and missed is not None:
            related.append(answered)
            unrelated.append(missed)
    if len(related) < CALIBRATION_MIN_QUERIES:
        return None
    return Calibration(unrelated=round(statistics.median(unrelated), 6), related=round(statistics.median(related), 6),
                       queries=len(related), chunks=chunks)


def embed_key(embedded_text: str) -> str:
    """What identifies a vector within an index: the exact text that was embedded (the index's
    manifest fixes the model, its dimensions and the prefix scheme). Chunks with the same key have
    the same vector, whichever file, place or run they come from."""
    return hashlib.sha256(embedded_text.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def chunk_id(path: str, content_hash: str, index: int) -> str:
    """Ids depend on the content: a file's new generation never overwrites its old one, so a
    crash between writing new chunks and deleting old ones leaves both sets intact."""
    return f"{hashlib.sha256(path.encode()).hexdigest()[:16]}-{content_hash[:16]}-{index:05d}"


def chunk_document_key(chunk: str) -> str:
    """What a chunk id says of its document (see chunk_id): equal for the chunks of one path."""
    return chunk.split("-", 1)[0]


def content_hash(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


@dataclass(frozen=True)
class IndexManifest:
    model: str
    dims: int
    prefix_scheme: str
    chunker_version: str
    chunk_max_tokens: int
    chunk_min_tokens: int
    # The `dimensions` every vector was asked for (RAG_EMBED_DIMENSIONS at ingest), which the
    # server asks for its query vectors too; None: the model's native size, nothing asked.
    embed_dimensions: int | None = None
    tool_version: str = TOOL_VERSION

    def fingerprint(self) -> str:
        """What decides whether an index can be updated in place (tool version does not)."""
        key = {k: v for k, v in self.to_dict().items() if k != "tool_version"}
        key["model"] = canonical_model_name(self.model)
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]

    def index_name(self) -> str:
        return f"idx-{self.fingerprint()}"

    def to_dict(self) -> dict[str, Any]:
        """The fields, an embed_dimensions of None left out: indexes built before it existed keep
        their names (the fingerprint) and their CURRENT.json, and a store's metadata takes no None."""
        return {k: v for k, v in asdict(self).items() if not (k == "embed_dimensions" and v is None)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> IndexManifest:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


def manifest_for(settings: Settings, prefix_scheme: str, dims: int) -> IndexManifest:
    """The manifest an index built with these settings has (the dry run and the real run alike)."""
    return IndexManifest(model=settings.embed_model, dims=dims, prefix_scheme=prefix_scheme,
                         chunker_version=CHUNKER_VERSION, chunk_max_tokens=settings.chunk_max_tokens,
                         chunk_min_tokens=settings.chunk_min_tokens, embed_dimensions=settings.embed_dimensions)


@dataclass(frozen=True)
class IndexStamp:
    commit: str | None
    dirty: bool | None
    ingested_at: str
    files: int
    chunks: int
    # The model's digest as Ollama listed it when these vectors were embedded (None where it did
    # not say): weights re-pulled under the same name make every stored vector stale.
    model_digest: str | None = None
    vectors_pending: int = 0  # chunks found by keyword only: their vectors wait for Ollama


def vectors_pending_hint(model: str) -> str:
    """What to do about passages that wait for their vectors: the same words from ingest, search,
    list_documents and /health."""
    return (f"start Ollama (`ollama serve`) and `ollama pull {model}`, then run {ingest_command()}: "
            "it embeds only the waiting passages")


@dataclass(frozen=True)
class CurrentIndex:
    """CURRENT.json: which index folder is live, its manifest and stamp, and a generation
    counter that ingest bumps after every run that changed something."""

    index: str
    generation: int
    manifest: IndexManifest
    stamp: IndexStamp
    # The folder ingest indexed: the server reads files from it unless RAG_CORPUS_DIR is set,
    # so a server registered without the variable still finds a corpus indexed with --corpus.
    corpus_dir: str = ""
    # (device, inode) of that folder at ingest: get_file serves files only from beneath a folder
    # with this identity, so a look-alike tree swapped in at the same path is refused.
    corpus_id: tuple[int, int] | None = None

    def to_json(self) -> str:
        return json.dumps({"format": 1, "index": self.index, "generation": self.generation,
                           "manifest": self.manifest.to_dict(), "stamp": asdict(self.stamp),
                           "corpus_dir": self.corpus_dir,
                           "corpus_id": list(self.corpus_id) if self.corpus_id else None}, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> CurrentIndex:
        """Parse CURRENT.json, trusting nothing in it: the index name must be one ingest creates
        (it becomes a path), numbers must be integers in range. ValueError otherwise."""
        data = json_value(text)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        index = data.get("index")
        if not (isinstance(index, str) and INDEX_NAME.fullmatch(index)):
            raise ValueError(f"index {str(index)[:80]!r} is not an index folder name (idx-<12 hex digits>)")
        manifest, stamp = data.get("manifest"), data.get("stamp")
        if not isinstance(manifest, dict) or not isinstance(stamp, dict):
            raise ValueError("manifest and stamp must be objects")
        corpus_id = data.get("corpus_id")
        if corpus_id is not None:
            if not (isinstance(corpus_id, list) and len(corpus_id) == 2):
                raise ValueError("corpus_id must be [device, inode]")
            corpus_id = (_whole(corpus_id[0], "corpus_id"), _whole(corpus_id[1], "corpus_id"))
        parsed_manifest = IndexManifest.from_dict(manifest)
        for name in ("model", "prefix_scheme", "chunker_version"):
            if not isinstance(getattr(parsed_manifest, name), str):
                raise ValueError(f"manifest.{name} must be text")
        for name in ("dims", "chunk_max_tokens", "chunk_min_tokens"):
            _whole(getattr(parsed_manifest, name), f"manifest.{name}")
        if parsed_manifest.embed_dimensions is not None:
            _whole(parsed_manifest.embed_dimensions, "manifest.embed_dimensions")
        parsed_stamp = IndexStamp(**stamp)
        if parsed_stamp.model_digest is not None and not isinstance(parsed_stamp.model_digest, str):
            raise ValueError("stamp.model_digest must be text")
        _whole(parsed_stamp.files, "stamp.files")
        _whole(parsed_stamp.chunks, "stamp.chunks")
        _whole(parsed_stamp.vectors_pending, "stamp.vectors_pending")
        corpus_dir = data.get("corpus_dir", "")
        if not isinstance(corpus_dir, str):
            raise ValueError("corpus_dir must be text")
        return cls(index=index, generation=_whole(data.get("generation"), "generation"), manifest=parsed_manifest,
                   stamp=parsed_stamp, corpus_dir=corpus_dir, corpus_id=corpus_id)


def _whole(value: Any, name: str) -> int:
    """A JSON integer in 0..2**63-1 (not a boolean, not a float such as 1e400)."""
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**63:
        raise ValueError(f"{name} must be a whole number in range, got {str(value)[:40]}")
    return value


def _no_link(path: Path, kind_ok: Callable[[int], bool]) -> Path:
    """`path` when it does not exist yet or is what ingest makes there (a folder, a file), never
    a symbolic link: index_incompatible otherwise."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return path
    except OSError as exc:
        raise store_failure(exc, str(path)) from None
    if not kind_ok(mode):
        what = "a symbolic link" if stat.S_ISLNK(mode) else "not what ingest makes there"
        raise RagError(ErrorCode.INDEX_INCOMPATIBLE, f"{path} is {what}: the store was changed by hand",
                       f"remove it and run {ingest_command('--full')}")
    return path


@dataclass(frozen=True)
class StoreLayout:
    root: Path

    @property
    def current_file(self) -> Path:
        return self.root / CURRENT_FILE

    @property
    def lock_file(self) -> Path:
        return self.root / LOCK_FILE

    def index_dir(self, name: str) -> Path:
        # Every index path is built here: only names ingest creates, and only folders (no links),
        # so a tampered CURRENT.json or a link planted in the store can never point ingest (which
        # deletes old index folders) or the server outside the store.
        if not INDEX_NAME.fullmatch(name):
            raise RagError(ErrorCode.INDEX_INCOMPATIBLE, f"{name[:80]!r} is not an index folder name",
                           f"run {ingest_command('--full')} to rebuild the index")
        return _no_link(self.root / name, stat.S_ISDIR)

    def chroma_dir(self, name: str) -> Path:
        return _no_link(self.index_dir(name) / CHROMA_SUBDIR, stat.S_ISDIR)

    def keyword_db(self, name: str) -> Path:
        return _no_link(self.index_dir(name) / KEYWORD_DB, stat.S_ISREG)

    def read_current(self) -> CurrentIndex | None:
        try:
            fd = os.open(self.current_file, os.O_RDONLY | _NOFOLLOW | _NONBLOCK)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise RagError(ErrorCode.INDEX_INCOMPATIBLE, f"{self.current_file} cannot be opened ({exc.strerror}): a "
                           "link or something else that ingest did not write",
                           f"remove it and run {ingest_command('--full')}") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ValueError("not a regular file")
            raw = os.read(fd, CURRENT_MAX_BYTES + 1)
            if len(raw) > CURRENT_MAX_BYTES:
                raise ValueError(f"larger than {CURRENT_MAX_BYTES} bytes")
            return CurrentIndex.from_json(raw.decode("utf-8"))
        except (ValueError, KeyError, TypeError) as exc:
            raise RagError(ErrorCode.INDEX_INCOMPATIBLE, f"{self.current_file} is unreadable: {str(exc)[:300]}",
                           f"run {ingest_command('--full')} to rebuild the index") from None
        finally:
            os.close(fd)

    def write_current(self, current: CurrentIndex) -> None:
        """Atomic replace: a reader sees the old or the new pointer, never half a file. The
        temporary file is created anew (O_EXCL, O_NOFOLLOW): a link planted under its name is
        removed, never written through."""
        tmp = self.current_file.with_suffix(".tmp")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644)
        with open(fd, "w", encoding="utf-8") as fh:
            fh.write(current.to_json())
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.current_file)
        _fsync_dir(self.root)


    def store_id(self, create: bool) -> str:
        """This store's identity on a shared Chroma server: random, made by the first ingest, kept
        in the store folder. Two stores sharing one server never see each other's collections."""
        path = self.root / STORE_ID_FILE
        try:
            fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _NONBLOCK)
        except FileNotFoundError:
            if not create:
                raise RagError(ErrorCode.INDEX_MISSING, f"{path} does not exist (no index yet)", INGEST_HINT) from None
            identity = secrets.token_hex(8)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644)
            with open(fd, "w", encoding="ascii") as fh:
                fh.write(identity + "\n")
            return identity
        try:
            text = os.read(fd, 64).decode("ascii", "replace").strip()
        finally:
            os.close(fd)
        if not STORE_ID.fullmatch(text):
            raise RagError(ErrorCode.INDEX_INCOMPATIBLE, f"{path} does not hold a store id",
                           f"remove {path} and run {ingest_command('--full')}")
        return text


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------
# Where an index's vectors live: the vector-store seam.
#
# Both programs reach the vectors through VectorStore: one Chroma collection per lifecycle,
# either embedded in the index folder (PersistentClient, the default) or on a Chroma server
# (HttpClient, when RAG_CHROMA_URL is set). Both speak the same Chroma API, so the data operations
# are written once; the two backends differ in how a client is made, what a collection is called,
# how an index's vectors are found and dropped, and how their failures read.

INGEST_HINT = f"run {ingest_command()} (with the same RAG_STORE_DIR and RAG_CORPUS_DIR as this server)"


def ingest_hint(settings: Settings) -> str:
    """INGEST_HINT, after setting RAG_CORPUS_DIR when there is no corpus to index (an installed
    copy has no sample corpus beside it)."""
    unset = no_corpus_configured(settings)
    return INGEST_HINT if unset is None else f"{unset.hint}; then {INGEST_HINT}"
# Ids are listed, and deleted, a page at a time: a Chroma server caps a request's size.
VECTOR_PAGE = 5000


# Chroma's HNSW graph is rebuilt by each process that opens a collection from the part of its log
# not yet folded into the graph on disk, and not the same way twice: at Chroma's default ef_search
# (100) the 50 nearest passages of one query differed between processes (three sets in six runs on
# the dev set's Vite docs), so one question got different answers. At 400 every run returned the
# exact 50 nearest. The space is named here too: a configuration overrides the `hnsw:space` metadata.
VECTOR_SEARCH_EF = 400
VECTOR_CONFIGURATION = {"hnsw": {"space": "cosine", "ef_search": VECTOR_SEARCH_EF}}


def searched_thoroughly(collection: Any) -> Any:
    """The collection, with ef_search raised to VECTOR_SEARCH_EF where it was created lower
    (an index written before this setting); the writer's call, the server never modifies."""
    hnsw = (getattr(collection, "configuration_json", None) or {}).get("hnsw") or {}
    if hnsw.get("ef_search", VECTOR_SEARCH_EF) < VECTOR_SEARCH_EF:
        collection.modify(configuration={"hnsw": {"ef_search": VECTOR_SEARCH_EF}})
    return collection


class VectorStore:
    """One index's vectors. `open(create=True)` (ingest) makes what is missing; `open(create=False)`
    (the server) never creates anything and answers index_missing instead. Every failure of the
    store comes out as a RagError of the vocabulary."""

    where = "vector store"

    def __init__(self, index_name: str) -> None:
        self.index_name = index_name
        self._client: Any = None
        self._collections: dict[str, Any] = {}

    # What a backend defines ----------------------------------------------------------------
    def _connect(self, create: bool) -> Any:
        raise NotImplementedError

    def collection_name(self, lifecycle: str) -> str:
        raise NotImplementedError

    def drop(self) -> None:
        """Remove this index's vectors (an index that is no longer live)."""
        raise NotImplementedError

    def _failure(self, exc: BaseException) -> RagError:
        return store_failure(exc, self.where)

    # Shared --------------------------------------------------------------------------------
    def open(self, create: bool, metadata: Mapping[str, Any] | None = None) -> VectorStore:
        from chromadb.errors import NotFoundError

        self.close()
        try:
            client = self._connect(create)
            collections: dict[str, Any] = {}
            for lifecycle in LIFECYCLES:
                name = self.collection_name(lifecycle)
                if create:
                    collections[lifecycle] = searched_thoroughly(client.get_or_create_collection(
                        name, metadata=dict(metadata or {}), configuration=VECTOR_CONFIGURATION))
                else:
                    try:
                        collections[lifecycle] = client.get_collection(name)
                    except NotFoundError:
                        pass  # reported (index_missing) when a search needs it
        except RagError:
            raise
        except Exception as exc:  # noqa: BLE001 - any Chroma failure here is a store problem
            raise self._failure(exc) from None
        self._client, self._collections = client, collections
        return self

    def close(self) -> None:
        client, self._client, self._collections = self._client, None, {}
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()

    def collection(self, lifecycle: str) -> Any:
        if self._client is None:
            self.open(create=False)
        found = self._collections.get(lifecycle)
        if found is None:
            raise RagError(ErrorCode.INDEX_MISSING, f"the collection {self.collection_name(lifecycle)!r} is missing "
                           f"from the {self.where}", INGEST_HINT)
        return found

    def _do(self, lifecycle: str, operation: Callable[[Any], Any]) -> Any:
        collection = self.collection(lifecycle)
        try:
            return operation(collection)
        except RagError:
            raise
        except Exception as exc:  # noqa: BLE001 - translated into the vocabulary
            raise self._failure(exc) from None

    def upsert(self, lifecycle: str, ids: Sequence[str], embeddings: Sequence[Any], documents: Sequence[str],
               metadatas: Sequence[Mapping[str, Any]]) -> None:
        self._do(lifecycle, lambda col: col.upsert(ids=list(ids), embeddings=list(embeddings),
                                                   documents=list(documents), metadatas=list(metadatas)))

    def delete(self, lifecycle: str, ids: Sequence[str]) -> None:
        for page in batched(list(ids), VECTOR_PAGE):
            self._do(lifecycle, lambda col, page=page: col.delete(ids=list(page)))

    def ids(self, lifecycle: str) -> list[str]:
        """Every id in a collection, a page at a time."""
        found: list[str] = []
        while True:
            page = self._do(lifecycle, lambda col: col.get(include=[], limit=VECTOR_PAGE, offset=len(found)))["ids"]
            found.extend(str(i) for i in page)
            if len(page) < VECTOR_PAGE:
                return found

    def count(self, lifecycle: str) -> int:
        return int(self._do(lifecycle, lambda col: col.count()))

    def embeddings(self, lifecycle: str, ids: Sequence[str]) -> tuple[list[str], Any]:
        """Stored vectors of these ids: (ids found, one row each)."""
        if not ids:
            return [], []
        got = self._do(lifecycle, lambda col: read_through_writes(
            lambda: col.get(ids=list(ids), include=["embeddings"])))
        vectors = got.get("embeddings")
        if vectors is None or len(vectors) == 0:
            return [], []
        return [str(i) for i in got["ids"]], vectors

    def metadatas(self, lifecycle: str, ids: Sequence[str]) -> tuple[list[str], list[dict[str, Any]]]:
        got = self._do(lifecycle, lambda col: col.get(ids=list(ids), include=["metadatas"]))
        return [str(i) for i in got["ids"]], [dict(m) for m in got["metadatas"]]

    def update_metadatas(self, lifecycle: str, ids: Sequence[str], metadatas: Sequence[Mapping[str, Any]]) -> None:
        self._do(lifecycle, lambda col: col.update(ids=list(ids), metadatas=list(metadatas)))

    def query(self, lifecycle: str, vector: Sequence[float], n: int,
              paths: Sequence[str] | None) -> list[tuple[str, float]]:
        """(id, cosine distance), best first; paths=None: unfiltered (the fast path)."""
        np = import_heavy("numpy")

        where = {"path": {"$in": list(paths)}} if paths is not None else None
        query = np.asarray(vector, dtype=np.float32)
        found = self._do(lifecycle, lambda col: col.query(query_embeddings=[query], n_results=n, where=where,
                                                          include=["distances"]))
        ids = (found.get("ids") or [[]])[0]
        distances = (found.get("distances") or [[]])[0]
        return [(str(i), float(d)) for i, d in zip(ids, distances, strict=True)]

    def merge_metadata(self, updates: Mapping[str, Any]) -> None:
        """Add keys to every collection's own metadata (the index stamp)."""
        for lifecycle in LIFECYCLES:
            def merged(col: Any) -> None:
                meta = dict(col.metadata or {})
                meta.pop("hnsw:space", None)  # the distance space cannot be modified after creation
                meta.update(updates)
                col.modify(metadata=meta)

            self._do(lifecycle, merged)


TORN_READ_PAUSES_S = (0.05, 0.1, 0.2, 0.4, 0.8)  # ~1.5 s in all: longer than one write batch takes to apply
TORN_READS = ("error finding id", "error getting embedding")  # Chroma's words for a vector not (yet, or any more) there


def read_through_writes(read: Callable[[], Any]) -> Any:
    """A Chroma get that includes embeddings, retried while it meets a write half applied.

    Chroma reads such a get's records from its metadata segment, then each one's vector from its
    HNSW segment, without a snapshot between the two. A write landing in between fails the get
    (TORN_READS). Ingest never reads while it writes, but a killed ingest's last request goes
    on running on a Chroma server, and the next reader can meet it. Any other error is raised at once."""
    for pause in TORN_READ_PAUSES_S:
        try:
            return read()
        except Exception as exc:  # noqa: BLE001 - only the torn read is retried; the rest is re-raised
            if not any(words in str(exc).lower() for words in TORN_READS):
                raise
        time.sleep(pause)
    return read()


COMPACTION_ROOM_BYTES = 256 << 20  # a compaction failing with less free space than this: the disk is full


class EmbeddedVectors(VectorStore):
    """Chroma's PersistentClient on the index folder's chroma/ (the default)."""

    def __init__(self, chroma_dir: Path, index_name: str) -> None:
        super().__init__(index_name)
        self.chroma_dir = chroma_dir
        self.where = f"vector store {chroma_dir}"

    def collection_name(self, lifecycle: str) -> str:
        return COLLECTION_BY_LIFECYCLE[lifecycle]

    def _failure(self, exc: BaseException) -> RagError:
        """Chroma's compaction says only "Error in compaction: Failed to apply logs to the ... segment"
        when the disk fills while it writes its segments: on a nearly full disk that is the cause."""
        failure = store_failure(exc, self.where)
        if failure.code is not ErrorCode.INTERNAL or "compaction" not in failure.message.lower():
            return failure
        try:
            free = shutil.disk_usage(self.chroma_dir if self.chroma_dir.exists() else self.chroma_dir.parent).free
        except OSError:
            return failure
        if free >= COMPACTION_ROOM_BYTES:
            return failure
        said = (str(exc).splitlines() or [type(exc).__name__])[0][:300]
        return RagError(ErrorCode.STORE_UNWRITABLE, f"the {self.where} could not be written: {free >> 20} MB are left "
                        f"on its disk ({said})", "free some space and run ingest again; what was committed is kept")

    def _connect(self, create: bool) -> Any:
        os.environ.setdefault("ANONYMIZED_TELEMETRY", "False")
        chromadb = import_heavy("chromadb")
        from chromadb.api.shared_system_client import SharedSystemClient
        from chromadb.config import Settings as ChromaSettings

        if not create:
            # PersistentClient creates whatever is missing: look before constructing it.
            self._probe(self.chroma_dir / "chroma.sqlite3")
        # A cached system would serve an older view of the files (a long-lived client does not see
        # another process's writes).
        SharedSystemClient.clear_system_cache()
        # A reader validates migrations: a store written by another Chroma version is reported,
        # never migrated by the server (ingest migrates it).
        return chromadb.PersistentClient(path=str(self.chroma_dir), settings=ChromaSettings(
            anonymized_telemetry=False, allow_reset=False, migrations="apply" if create else "validate"))

    def _probe(self, sqlite_file: Path) -> None:
        """Refuse a chroma.sqlite3 that is missing or is not a Chroma database before Chroma sees
        it: given an empty or foreign file, PersistentClient writes a fresh schema into it."""
        import sqlite3

        if not sqlite_file.is_file():
            raise RagError(ErrorCode.INDEX_MISSING, f"the vector store {sqlite_file} does not exist", INGEST_HINT)
        try:
            # mode=rw: never creates the file, and can roll back a journal left by a killed ingest
            # (as Chroma's own connection would); only SELECTs run here.
            db = sqlite3.connect(sqlite_file.as_uri() + "?mode=rw", uri=True, timeout=5.0)
            try:
                db.execute("SELECT 1 FROM migrations LIMIT 1").fetchall()
                db.execute("SELECT 1 FROM collections LIMIT 1").fetchall()
            finally:
                db.close()
        except sqlite3.OperationalError as exc:
            if "no such table" in str(exc):
                raise RagError(ErrorCode.INDEX_MISSING, f"the vector store {sqlite_file} holds no Chroma database "
                               f"({exc})", INGEST_HINT) from None
            raise self._failure(exc) from None
        except sqlite3.Error as exc:
            raise self._failure(exc) from None

    def drop(self) -> None:
        self.close()
        shutil.rmtree(self.chroma_dir, ignore_errors=True)


class ServerVectors(VectorStore):
    """chromadb.HttpClient on a Chroma server (RAG_CHROMA_URL). Collections are named
    lr-<store id>-<index name>-<lifecycle>: the index name carries the manifest fingerprint, so a
    rebuild writes new collections and goes live only when complete, and the store id keeps
    stores that share one server apart."""

    def __init__(self, url: str, headers: Mapping[str, str], store_id: str, index_name: str,
                 timeout_s: float) -> None:
        super().__init__(index_name)
        self.url, self.headers, self.store_id, self.timeout_s = url, dict(headers), store_id, timeout_s
        self.where = f"Chroma server at {url}"

    def collection_name(self, lifecycle: str) -> str:
        return f"lr-{self.store_id}-{self.index_name}-{lifecycle}"

    def _connect(self, create: bool) -> Any:
        """The process's one client for this server (each construction costs ~60 ms and keeps
        cache entries until the process ends), after a quick heartbeat: HttpClient itself waits
        without limit on a server that accepts connections but does not answer."""
        self._heartbeat()
        key = (self.url, tuple(sorted(self.headers.items())))
        with _SERVER_CLIENTS_LOCK:
            client = _SERVER_CLIENTS.get(key)
            if client is None:
                client = _SERVER_CLIENTS[key] = self._new_client()
        return client

    def _heartbeat(self) -> None:
        import urllib.error
        import urllib.request

        request = urllib.request.Request(f"{self.url}/api/v2/heartbeat", headers=self.headers)
        try:
            with urllib.request.urlopen(request, timeout=HEARTBEAT_TIMEOUT_S) as response:
                response.read(4096)
        except (OSError, urllib.error.URLError) as exc:
            reason = getattr(exc, "reason", exc)
            raise RagError(ErrorCode.STORE_UNAVAILABLE, f"the Chroma server at {self.url} does not answer ({reason})",
                           f"start it (`chroma run --path DIR --port N`) or correct RAG_CHROMA_URL={self.url}, "
                           "then retry") from None

    def _new_client(self) -> Any:
        os.environ.setdefault("ANONYMIZED_TELEMETRY", "False")
        from urllib.parse import urlsplit

        chromadb = import_heavy("chromadb")
        import httpx
        from chromadb.config import Settings as ChromaSettings

        parts = urlsplit(self.url)
        client = chromadb.HttpClient(host=parts.hostname or "", port=parts.port or 8000, ssl=parts.scheme == "https",
                                     headers=self.headers, settings=ChromaSettings(anonymized_telemetry=False))
        # chromadb 1.x builds its HTTP session without any timeout and offers no setting for one;
        # this bounds every read from a server that stopped answering (pinned by a test).
        client._server._session.timeout = httpx.Timeout(self.timeout_s, connect=HEARTBEAT_TIMEOUT_S)
        return client

    def close(self) -> None:
        self._client, self._collections = None, {}  # the shared client stays for the next open

    def _failure(self, exc: BaseException) -> RagError:
        import httpx

        failure = store_failure(exc, self.where)
        if failure.code is ErrorCode.INTERNAL:
            # A connection refused, reset or timed out is the server not being there, not a bug.
            unreachable = isinstance(exc, (OSError, httpx.TransportError))
            return RagError(ErrorCode.STORE_UNAVAILABLE if unreachable else ErrorCode.INTERNAL, failure.message,
                            f"check that the Chroma server at RAG_CHROMA_URL={self.url} is running and reachable "
                            f"(`chroma run --path DIR --port N`), then retry")
        return failure

    def drop(self) -> None:
        from chromadb.errors import NotFoundError

        client = self._connect(create=False)
        for lifecycle in LIFECYCLES:
            with contextlib.suppress(NotFoundError):
                client.delete_collection(self.collection_name(lifecycle))
        self.close()


_SERVER_CLIENTS: dict[tuple[Any, ...], Any] = {}
_SERVER_CLIENTS_LOCK = threading.Lock()
HEARTBEAT_TIMEOUT_S = 2.0


def vector_store(settings: Settings, layout: StoreLayout, index_name: str, *, create: bool = False) -> VectorStore:
    """The one factory: where this store keeps the vectors of `index_name`."""
    if settings.chroma_url:
        return ServerVectors(settings.chroma_url, settings.chroma_headers, layout.store_id(create), index_name,
                             settings.store_timeout_s)
    return EmbeddedVectors(layout.chroma_dir(index_name), index_name)


# What ingest needs of its vector writer. Writes (upsert, delete) may run behind the caller's back:
# each returns a ticket, settle(ticket) waits for the writes up to it, and a failed write is
# raised by the next settle or read; after one, the writer touches the store no more (Chroma can
# keep a lock from it). Reads see every write sent before them. Two implementations, in ingest.py:
# VectorProcess (a process of its own, the real runs) and InProcessVectors (the same, in the
# caller's process: the fast tests).
VECTOR_WRITES = ("upsert", "delete")
VECTOR_READS = ("ids", "count", "embeddings", "metadatas", "update_metadatas", "query", "merge_metadata")


class Vectors(Protocol):
    def start(self) -> None:
        """Get ready now (the process imports Chroma meanwhile); idempotent."""

    def open(self, settings: Settings, layout: StoreLayout, index_name: str, metadata: dict[str, Any]) -> Vectors:
        """Open an index's store when the first operation needs it (its errors are raised there)."""

    def in_use(self) -> bool:
        """Whether the store is open (an operation needed it)."""

    def upsert(self, lifecycle: str, ids: Sequence[str], embeddings: Sequence[Any], documents: Sequence[str],
               metadatas: Sequence[dict[str, Any]]) -> int: ...

    def delete(self, lifecycle: str, ids: Sequence[str]) -> int: ...

    def settle(self, ticket: int | None = None) -> None: ...

    def ids(self, lifecycle: str) -> list[str]: ...

    def count(self, lifecycle: str) -> int: ...

    def embeddings(self, lifecycle: str, ids: Sequence[str]) -> tuple[list[str], Any]: ...

    def metadatas(self, lifecycle: str, ids: Sequence[str]) -> tuple[list[str], list[dict[str, Any]]]: ...

    def update_metadatas(self, lifecycle: str, ids: Sequence[str], metadatas: Sequence[dict[str, Any]]) -> None: ...

    def query(self, lifecycle: str, vector: Sequence[float], n: int,
              paths: Sequence[str] | None) -> list[tuple[str, float]]: ...

    def merge_metadata(self, updates: dict[str, Any]) -> None: ...

    def close(self) -> None:
        """Close the store (the writer stays for another open); a failure here changes nothing."""

    def usable(self) -> bool:
        """Whether another run can use this writer (none of its writes failed)."""

    def shut(self) -> None:
        """End the writer, waiting for writes still under way."""


# ---------------------------------------------------------------------------
# The embedder: one client wrapper for ingest and server, errors mapped to the vocabulary.


class InputTooLong(Exception):
    """Ollama refused an input as longer than the model's context (truncate=False)."""


@dataclass
class ModelInfo:
    context_length: int | None
    dims: int | None


# EmbeddingGemma and friends, when /api/show does not say.
REGISTRY_CONTEXT_LENGTH = {"embeddinggemma": 2048, "nomic-embed-text": 2048, "mxbai-embed-large": 512,
                           "snowflake-arctic-embed": 512, "snowflake-arctic-embed2": 8192, "bge-m3": 8192,
                           "e5": 512}


class InvalidVectors(RagError):
    """Ollama answered, but with vectors that cannot be stored or compared: NaN or infinite values,
    or rows of different lengths. The texts of that call fail; the embedder is not declared down."""


class EmbedderTimeout(RagError):
    """Ollama did not answer a call within its time (down hard, stalled, or overloaded)."""


_HEAVY_IMPORTS = threading.Lock()


def import_heavy(name: str) -> Any:
    """numpy, ollama or chromadb, imported on first use. numpy is imported by one thread at a time:
    the server warms up (imports chromadb, hence numpy) in the background while the first call may
    be importing numpy for the embedder, and two threads importing numpy at once can see it
    half-initialized ("partially initialized module 'numpy._typing'"), which CPython's per-module
    locks do not prevent for numpy's circular imports. The others are imported after numpy and
    outside that lock, where the per-module locks suffice: a search's embedder never waits for
    the warm-up's ~1 s chromadb import.

    Importing ollama builds a module-level client from the raw OLLAMA_HOST, which raises on a
    value load_settings reads fine (a pasted trailing space, a comma list): it sees the first
    host as read, the variable swapped under the lock."""
    with _HEAVY_IMPORTS:
        numpy = importlib.import_module("numpy")
        if name == "numpy":
            return numpy
        raw = os.environ.get("OLLAMA_HOST")
        if name == "ollama" and name not in sys.modules and raw is not None:
            with contextlib.suppress(RagError):  # an invalid value is said by load_settings, not here
                os.environ["OLLAMA_HOST"] = _ollama_hosts_env(os.environ, "OLLAMA_HOST")[0]
            try:
                return importlib.import_module(name)
            finally:
                os.environ["OLLAMA_HOST"] = raw
    return importlib.import_module(name)


class _CallThreads:
    """Daemon threads that run one call each and then wait for the next. Starting a thread per
    call cost ~0.3 ms of a 4 ms search (the caller waits until the new thread is scheduled). A
    call that never returns (a stalled embedder its waiter gave up on) keeps its thread; the next
    call takes another idle thread or starts one."""

    IDLE_MAX = 8

    def __init__(self) -> None:
        self._idle: list[queue.SimpleQueue[Callable[[], None]]] = []
        self._lock = threading.Lock()

    def run(self, task: Callable[[], None]) -> None:
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
        if inbox is None:
            inbox = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(inbox,), name="rag-call", daemon=True).start()
        inbox.put(task)

    def _serve(self, inbox: queue.SimpleQueue[Callable[[], None]]) -> None:
        while True:
            inbox.get()()
            with self._lock:
                if len(self._idle) >= self.IDLE_MAX:
                    return
                self._idle.append(inbox)


_CALL_THREADS = _CallThreads()


class BoundedCall:
    """fn() run once by a worker thread (run()); its waiters wait at most a bound (result()).

    The one bounded-call mechanism of both processes: the embedder's calls (each on a thread of
    _CALL_THREADS, see on_call_thread) and the server's Chroma calls (queued for its one thread,
    see server.ChromaWorker, which may abandon a call still queued when its waiter gave up). A
    waiter that gives up leaves a started call running to its end on a daemon thread, which never
    keeps the process from exiting; starting a call and waiting for it apart lets the caller work
    meanwhile (a search runs its keyword channel while Ollama embeds)."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._fn = fn
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._state: Literal["queued", "running", "abandoned"] = "queued"
        self._value: Any = None
        self._error: BaseException | None = None

    @property
    def queued(self) -> bool:
        return self._state == "queued"

    def run(self, running: contextlib.AbstractContextManager[Any] | None = None) -> None:
        """Call fn on this thread, inside `running` (the worker's own book-keeping), unless the
        call was abandoned while queued."""
        with self._lock:
            if self._state == "abandoned":
                return
            self._state = "running"
        try:
            with running or contextlib.nullcontext():
                self._value = self._fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            self._error = exc
        finally:
            self._done.set()

    def abandon_if_queued(self) -> None:
        """Let a worker skip this call if it has not started it (its waiter gave up)."""
        with self._lock:
            if self._state == "queued":
                self._state = "abandoned"

    def finished(self, seconds: float | None) -> bool:
        return self._done.wait(seconds)

    def result(self, seconds: float | None = None) -> Any:
        """fn's value, or what it raised; TimeoutError when it has not finished within `seconds`."""
        if not self._done.wait(seconds):
            raise TimeoutError(f"no answer within {seconds:g} s")
        if self._error is not None:
            raise self._error
        return self._value


def on_call_thread(fn: Callable[[], Any]) -> BoundedCall:
    """fn() running on a daemon thread of its own from now on (see _CALL_THREADS).

    An HTTP client's timeout bounds each read, not the call: an endpoint that sends its headers and
    then a byte a second would keep a call alive for ever. The caller gets its answer within the
    bound whatever the other side does; the abandoned call ends on its own (see _DeadlineStream)."""
    call = BoundedCall(fn)
    _CALL_THREADS.run(call.run)
    return call


@functools.cache
def _deadline_transport_class() -> type:
    import httpx

    class DeadlineStream(httpx.SyncByteStream):
        def __init__(self, inner: Any, deadline: float) -> None:
            self.inner, self.deadline = inner, deadline

        def __iter__(self) -> Any:
            for chunk in self.inner:
                if time.monotonic() > self.deadline:
                    raise httpx.ReadTimeout("the answer was still arriving when the call's time was up")
                yield chunk

        def close(self) -> None:
            self.inner.close()

    class DeadlineTransport(httpx.HTTPTransport):
        """Ends a response whose body is still arriving when the call's time is up, so a call
        abandoned by its waiter (see on_call_thread) does not trickle on for ever."""

        def __init__(self, seconds: float) -> None:
            super().__init__()
            self.seconds = seconds

        def handle_request(self, request: Any) -> Any:
            deadline = time.monotonic() + self.seconds
            response = super().handle_request(request)
            response.stream = DeadlineStream(response.stream, deadline)
            return response

    return DeadlineTransport


@dataclass
class OllamaEmbedder:
    """The embedder client: every call bounded as a whole by `timeout_s`, every failure mapped to
    the error vocabulary, every vector checked before anyone stores or compares it."""

    host: str
    model: str
    timeout_s: float
    # Asked of Ollama with every embed call: how long to keep the model loaded afterwards
    # (ingest keeps it for the run; None leaves Ollama's default).
    keep_alive: str | None = None
    # Asked of Ollama with every embed call: vectors truncated and renormalised to this many
    # dimensions (see Settings.embed_dimensions); None asks nothing, the model's native size.
    dimensions: int | None = None
    _client: Any = field(default=None, init=False, repr=False)

    def _get_client(self) -> Any:
        if self._client is None:
            ollama = import_heavy("ollama")

            self._client = ollama.Client(host=self.host, timeout=self.timeout_s,
                                         transport=_deadline_transport_class()(self.timeout_s))
        return self._client

    def _call(self, fn: Callable[[Any], Any]) -> Any:
        # The client is built (ollama and httpx imported) before the clock starts: on a loaded
        # machine the imports alone can outlast a short RAG_EMBED_TIMEOUT.
        client = self._get_client()
        return self.answer(on_call_thread(lambda: fn(client)))

    def answer(self, call: BoundedCall, seconds: float | None = None) -> Any:
        """What a call to this Ollama gave within `seconds` (timeout_s unless said), its failures
        in the error vocabulary."""
        seconds = self.timeout_s if seconds is None else seconds
        try:
            return call.result(seconds)
        except TimeoutError:
            raise self._timed_out(seconds) from None
        except Exception as exc:  # translated below
            raise self._translate(exc) from exc

    def _timed_out(self, seconds: float | None = None) -> RagError:
        return EmbedderTimeout(ErrorCode.EMBEDDER_UNAVAILABLE, f"Ollama at {self.host} did not answer within "
                               f"{self.timeout_s if seconds is None else seconds:g} s",
                               "retry; if Ollama is loading the model, wait for it, or raise RAG_EMBED_TIMEOUT")

    def _translate(self, exc: BaseException) -> BaseException:
        import httpx
        import ollama

        if isinstance(exc, ollama.ResponseError):
            if exc.status_code == 404:
                return RagError(ErrorCode.MODEL_NOT_FOUND, f"Ollama at {self.host} has no model {self.model!r}",
                                f"run `ollama pull {self.model}`")
            if exc.status_code == 400 and "context length" in str(exc.error):
                return InputTooLong(str(exc.error))
            return RagError(ErrorCode.EMBEDDER_UNAVAILABLE,
                            f"Ollama at {self.host} answered HTTP {exc.status_code}: {shown(exc.error, 300)}",
                            "check the Ollama server log; retry when it is healthy")
        if isinstance(exc, (ConnectionError, httpx.ConnectError)):
            return RagError(ErrorCode.EMBEDDER_UNAVAILABLE, f"cannot reach Ollama at {self.host}",
                            f"start Ollama (`ollama serve`) and `ollama pull {self.model}`, or set OLLAMA_HOST")
        if isinstance(exc, httpx.TimeoutException):
            return self._timed_out()
        if isinstance(exc, httpx.HTTPError):
            return RagError(ErrorCode.EMBEDDER_UNAVAILABLE, f"HTTP error talking to Ollama at {self.host}: {shown(exc, 300)}",
                            "check that OLLAMA_HOST points to an Ollama server")
        if isinstance(exc, (ValueError, TypeError)):  # an answer that is not Ollama's JSON
            return RagError(ErrorCode.EMBEDDER_UNAVAILABLE, f"Ollama at {self.host} gave an unreadable answer: "
                            f"{shown(exc, 200)}", "check that OLLAMA_HOST points to an Ollama server")
        return exc

    def model_digest(self) -> str | None:
        """The model's digest as Ollama lists it (`/api/tags`); None when it is not listed there."""
        listed = self._call(lambda client: client.list())
        for entry in listed.models or []:
            if entry.model and same_model(entry.model, self.model):
                return entry.digest or None
        return None

    def model_info(self) -> ModelInfo:
        """Context length and dimensions from `POST /api/show`, registry values as fallback."""
        shown_model = self._call(lambda client: client.show(self.model))
        info = dict(shown_model.modelinfo or {})
        arch = info.get("general.architecture")
        context = info.get(f"{arch}.context_length") if arch else None
        dims = info.get(f"{arch}.embedding_length") if arch else None
        if not isinstance(context, int) or isinstance(context, bool) or context <= 0:
            family = prefix_scheme_for(self.model)
            context = REGISTRY_CONTEXT_LENGTH.get(family.name if family else "", None)
        return ModelInfo(context_length=context,
                         dims=dims if isinstance(dims, int) and not isinstance(dims, bool) and dims > 0 else None)

    def embed(self, texts: Sequence[str]) -> Any:
        """One vector per text, as a float32 matrix (rows in order). InvalidVectors when Ollama's
        answer holds NaN or infinite values, or rows of different lengths."""
        return self.begin_embed(texts)()

    def begin_embed(self, texts: Sequence[str], then: Callable[[Any], Any] | None = None) -> Callable[[], Any]:
        """Send the embed request now; the function returned waits for the answer (at most
        timeout_s) and gives what embed() gives, or then(that matrix) when `then` is given. `then`
        runs on the thread that received the answer, as soon as it arrives: a search starts its
        vector queries from there rather than waking another thread to do it."""
        options: dict[str, Any] = {"keep_alive": self.keep_alive} if self.keep_alive is not None else {}
        if self.dimensions is not None:
            options["dimensions"] = self.dimensions
        client = self._get_client()  # outside the timed call, as in _call

        def fetch() -> Any:
            try:
                response = client.embed(model=self.model, input=list(texts), truncate=False, **options)
            except Exception as exc:  # translated here, raised to the waiter
                raise self._translate(exc) from exc
            matrix = self._vectors(texts, response)
            return then(matrix) if then is not None else matrix

        call = on_call_thread(fetch)

        def wait() -> Any:
            try:
                return call.result(self.timeout_s)
            except TimeoutError:
                raise self._timed_out() from None

        return wait

    def _vectors(self, texts: Sequence[str], response: Any) -> Any:
        np = import_heavy("numpy")

        if len(response.embeddings) != len(texts):
            raise RagError(ErrorCode.EMBEDDER_UNAVAILABLE,
                           f"Ollama returned {len(response.embeddings)} embeddings for {len(texts)} inputs", "retry")
        try:
            matrix = np.asarray(response.embeddings, dtype=np.float32)
        except (ValueError, TypeError):
            matrix = None
        if matrix is None or matrix.ndim != 2 or matrix.shape[1] == 0:
            raise InvalidVectors(ErrorCode.EMBEDDER_UNAVAILABLE, f"Ollama at {self.host} returned vectors of "
                                 "different lengths", "check the model; re-pull it with `ollama pull " f"{self.model}`")
        if not np.isfinite(matrix).all():
            raise InvalidVectors(ErrorCode.EMBEDDER_UNAVAILABLE, f"Ollama at {self.host} returned vectors with NaN or "
                                 "infinite values", f"check the model; re-pull it with `ollama pull {self.model}`")
        if self.dimensions is not None and matrix.shape[1] != self.dimensions:
            # Not a fault of the embedder to wait out: an Ollama too old for `dimensions` ignores it.
            raise RagError(ErrorCode.INVALID_ARGUMENT,
                           f"configuration error: Ollama at {self.host} returned {matrix.shape[1]}-dimensional vectors "
                           f"for {self.model!r} when asked for {self.dimensions} (RAG_EMBED_DIMENSIONS): it ignores "
                           "`dimensions`", "upgrade Ollama (versions before September 2025 ignore it), or unset "
                           f"RAG_EMBED_DIMENSIONS and run {ingest_command()}")
        return matrix


def batched(items: Sequence[Any], size: int) -> Iterable[Sequence[Any]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]
