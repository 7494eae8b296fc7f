"""The contract shared by ingest.py (the only writer) and server.py (the reader).

Both import this module and nothing of each other, so the server reads exactly what ingest
wrote. Its sections, in file order:

- Errors: ErrorCode, RagError, store_failure (a store's exceptions in the vocabulary), and
  ingest_command (the command every hint names).
- Configuration: Settings, VARIABLES (every variable, declared once) and load_settings.
- Paths, and opening corpus files without following links (ingest's reads, get_file).
- Frontmatter conventions, token estimation, searchable text.
- Headings and chunking (CHUNKER_VERSION), embedding prefixes (PREFIX_SCHEMES).
- Keyword terms: the one tokenizer for the FTS5 index and for queries; identifier detection.
- Store layout, ids, metadata keys and the manifest (StoreLayout, CURRENT.json).
- The vector-store seam: VectorStore (embedded Chroma) and ServerVectors (a Chroma server),
  one collection per lifecycle, their failures in the vocabulary.
- The embedder: Embedder, the one embedding client of both programs (OllamaEmbedder for Ollama's
  API, OpenAIEmbedder for the OpenAI-compatible one: RAG_EMBED_API), with its own call threads and
  deadlines (an embedding call is bounded even when the server stops answering), and the model
  fingerprint (ModelFingerprint) that tells one model's vectors from another's.

Heavy libraries (ollama, chromadb, markdown-it, frontmatter) are imported inside the
functions that need them: the server must answer the MCP handshake before paying for them.

Its machinery comes last, with the seams that need it (the embedder's call threads, the PDF
extractor's child process); every thread is a daemon:

  thread / process        owner                   runs                                waited on by
  rag-call (pool)         _CallThreads            one embedder call each (on_call_    the caller, bounded
                                                  thread), then waits for the next    (BoundedCall.result/wait)
  PDF extractor (child)   PdfExtractor            extract_pdf_text, one request at    the reader, within a deadline
                                                  a time, within a memory cap         that grows with the file
  parent-watch            end_with_parent         in a child: ends it when its        no one
                                                  parent is gone

  lock                          guards
  _CallThreads._lock            the idle threads' inboxes
  BoundedCall._lock             a call's state (queued, running, abandoned)
  _HEAVY_IMPORTS                numpy imported by one thread at a time (import_heavy)
  _SERVER_CLIENTS_LOCK          the Chroma server clients, one per address and headers
  PdfExtractor._lock, _PDF_EXTRACTOR_LOCK
                                the child's one request at a time; creating the program's extractor
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import datetime
import errno
import fnmatch
import functools
import hashlib
import html
import importlib
import io
import itertools
import json
import logging
import math
import os
import pickle
import queue
import re
import secrets
import selectors
import shlex
import shutil
import signal
import stat
import statistics
import struct
import subprocess
import sys
import threading
import time
import unicodedata
import warnings
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
from pathlib import Path, PurePosixPath
from typing import Any, ClassVar, Literal, Protocol, TypeVar

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
    # An index that holds no document: a search cannot say the documents do not cover something.
    INDEX_EMPTY = "index_empty"
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
# RAG_EMBED_API: the embedding server's HTTP API. "openai" is the OpenAI-compatible embeddings API
# that LM Studio, llama.cpp's llama-server, vLLM, TEI and Infinity serve (POST {url}/embeddings).
EMBED_APIS = ("ollama", "openai")
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


@dataclass(frozen=True, kw_only=True)
class Settings:
    """Every knob of both programs, read and checked in one place (load_settings): a bad value
    is a configuration error that names the variable, never a silent default. A field's default
    here is its variable's default (VARIABLES declares each variable once: the field it sets, its
    reader, its README row)."""

    corpus_dir: Path
    # False when corpus_dir is the default: the server then prefers the folder the index records.
    corpus_dir_explicit: bool = False
    store_dir: Path = field(default_factory=lambda: _abs_path(DEFAULT_STORE_DIR))
    # The embedding servers (OLLAMA_HOST's comma list, or RAG_EMBED_URL's): ingest spreads its calls
    # over them, the server embeds queries with the first that answers (ollama_host is the first).
    ollama_hosts: tuple[str, ...] = (DEFAULT_OLLAMA_HOST,)
    embed_model: str = DEFAULT_EMBED_MODEL
    # True when RAG_EMBED_MODEL was set explicitly: the server then insists it matches the index.
    embed_model_explicit: bool = False
    embed_timeout_s: float = DEFAULT_EMBED_TIMEOUT_S
    chunk_max_tokens: int = DEFAULT_CHUNK_MAX_TOKENS
    chunk_min_tokens: int = DEFAULT_CHUNK_MIN_TOKENS
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
    # Server: keep the index fresh with an `ingest.py --watch` child (RAG_WATCH, or `server.py --watch`).
    watch: bool = False
    # Vectors on a Chroma server instead of the embedded store (RAG_CHROMA_URL), and the headers
    # its requests carry (RAG_CHROMA_HEADERS, a JSON object: an auth proxy's token, say).
    chroma_url: str | None = None
    chroma_headers: Mapping[str, str] = field(default_factory=dict)
    # Ingest: leave out what git ignores when the corpus is in a git work tree (RAG_RESPECT_GITIGNORE).
    respect_gitignore: bool = True
    # Ingest: the formats read (RAG_FORMATS, names of READERS); files of the others are counted, not read.
    # RAG_CODE (ingest --code) adds the code readers (CODE_FORMATS) to them.
    formats: tuple[str, ...] = field(default_factory=lambda: DEFAULT_FORMATS)
    code: bool = False
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
    # The API the embedding servers speak (RAG_EMBED_API, one of EMBED_APIS), the bearer token sent
    # to them (RAG_EMBED_API_KEY: never logged, stored or shown), and the prefix scheme named for a
    # model PREFIX_SCHEMES does not know (RAG_EMBED_PREFIXES; None: the model's own, by its name).
    embed_api: str = "ollama"
    embed_api_key: str | None = field(default=None, repr=False)
    embed_prefixes: str | None = None

    @property
    def ollama_host(self) -> str:
        return self.ollama_hosts[0]

    def embedder(self, host: str, *, model: str | None = None, timeout_s: float | None = None,
                 keep_alive: str | None = None, dimensions: int | None = None) -> Embedder:
        """The client of one embedding server of these settings (its API, its key)."""
        return EMBEDDERS[self.embed_api](host, model or self.embed_model,
                                         self.embed_timeout_s if timeout_s is None else timeout_s,
                                         keep_alive=keep_alive, dimensions=dimensions, api_key=self.embed_api_key)

    def with_code(self) -> Settings:
        """These settings with source code read too (RAG_CODE=1)."""
        return replace(self, code=True, formats=formats_read(self.formats, code=True))

    def describe(self) -> str:
        return (f"corpus={self.corpus_dir} store={self.store_dir} {self.embed_api}={','.join(self.ollama_hosts)} "
                f"model={self.embed_model}")


def formats_read(formats: Collection[str], code: bool) -> tuple[str, ...]:
    """The formats a run reads: those named, and with `code` the code readers' (CODE_FORMATS)."""
    return tuple(f for f in FORMATS if f in formats or (code and f in CODE_FORMATS))


def unknown_variables(env: Mapping[str, str] | None = None) -> list[str]:
    """A warning for each RAG_ variable that is set but read by neither program (a misspelt
    RAG_STORE= would otherwise leave the default store in use without a word)."""
    import difflib

    env = os.environ if env is None else env
    out = []
    for name in sorted(n for n in env if n.startswith("RAG_") and n not in ENVIRONMENT):
        close = difflib.get_close_matches(name, ENVIRONMENT, n=1, cutoff=0.8)
        out.append(f"{name} is set but is no variable of local-rag-mcp" + (f" (did you mean {close[0]}?)" if close else
                                                                         "; see the README's Configuration"))
    return out


def no_corpus_configured(settings: Settings) -> RagError | None:
    """The configuration error of an installed copy run with RAG_CORPUS_DIR unset: pip installs
    no sample corpus beside the code to default to. None when there is a folder to use."""
    if settings.corpus_dir_explicit or settings.corpus_dir.is_dir():
        return None
    return RagError(ErrorCode.INVALID_ARGUMENT, "configuration error: RAG_CORPUS_DIR is not set, and there is no "
                    f"sample corpus beside the program ({settings.corpus_dir}) to default to",
                    "set RAG_CORPUS_DIR to your folder of Markdown, the same for ingest and the server "
                    "(ingest also takes --corpus DIR)")


def _formats_env(env: Mapping[str, str], name: str) -> tuple[str, ...]:
    """RAG_FORMATS: a comma list of reader formats; unset or empty, every format read by default."""
    wanted = tuple(dict.fromkeys(item.lower() for item in _list_env(env, name)))
    unknown = [item for item in wanted if item not in FORMATS]
    if unknown:
        raise _setting_error(name, env[name], "a comma list of " + ", ".join(FORMATS))
    return tuple(f for f in FORMATS if f in wanted) or DEFAULT_FORMATS


def _token_env(env: Mapping[str, str], name: str) -> str | None:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    if len(raw) < 16 or any(ch.isspace() or not ch.isprintable() for ch in raw):
        raise _setting_error(name, "(hidden)", "a secret of at least 16 printable characters without spaces")
    return raw


def _secret_env(env: Mapping[str, str], name: str) -> str | None:
    """A bearer token as the other side issued it: any printable text without spaces (never shown
    back, not even in the error)."""
    raw = env.get(name, "").strip()
    if raw and any(ch.isspace() or not ch.isprintable() for ch in raw):
        raise _setting_error(name, "(hidden)", "a token of printable characters without spaces")
    return raw or None


def _prefixes_env(env: Mapping[str, str], name: str) -> str | None:
    raw = env.get(name, "").strip().lower()
    if raw and raw not in PREFIX_SCHEMES:
        raise _setting_error(name, raw, "one of " + ", ".join(PREFIX_SCHEMES))
    return raw or None


def _embed_hosts_env(env: Mapping[str, str], name: str, default: tuple[str, ...]) -> tuple[str, ...]:
    """The embedding servers: RAG_EMBED_URL's comma list when set (either API), else OLLAMA_HOST's
    (Ollama only: an OpenAI-compatible server has no default address to assume)."""
    api = _embed_api_env(env, "RAG_EMBED_API", field_default("embed_api"))
    raw_url, raw_ollama = env.get(name, "").strip(), env.get("OLLAMA_HOST", "")
    if raw_url:
        return _ollama_hosts_env(env, "RAG_EMBED_URL")
    if api == "ollama":
        return _ollama_hosts_env({"OLLAMA_HOST": raw_ollama}, "OLLAMA_HOST")
    raise RagError(ErrorCode.INVALID_ARGUMENT, "configuration error: RAG_EMBED_API=openai needs RAG_EMBED_URL",
                   "set RAG_EMBED_URL to the server's base URL as it documents it, e.g. http://127.0.0.1:1234/v1 "
                   "(LM Studio) or http://127.0.0.1:8080/v1 (llama-server); a comma list for several")


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
    """OLLAMA_HOST (or RAG_EMBED_URL): one server address, or a comma list of them (ingest spreads
    its calls over them; the server embeds queries with the first that answers). Each is checked as
    _ollama_host reads it; the same host twice is one host."""
    raw = env.get(name, "").strip()
    if not raw:
        return (DEFAULT_OLLAMA_HOST,)
    hosts = [_ollama_host(name, item.strip()) for item in raw.split(",") if item.strip()]
    if not hosts:
        raise _setting_error(name, raw, _ADDRESS_WANTED[name])
    return tuple(dict.fromkeys(hosts))


_ADDRESS_WANTED = {"OLLAMA_HOST": "an Ollama address such as 127.0.0.1:11434 or http://gpu-box:11434",
                   "RAG_EMBED_URL": "a base URL such as http://127.0.0.1:1234/v1, without credentials in it "
                                    "(the key goes in RAG_EMBED_API_KEY)"}


def _ollama_host(name: str, raw: str) -> str:
    """One address in the forms Ollama's own clients read (`host`, `host:port`,
    `scheme://host[:port][/path]`; no port: Ollama's default), checked here: a value that does not
    parse is a configuration error naming the variable, never a traceback from inside the client."""
    from urllib.parse import urlsplit

    url = raw if "://" in raw else f"http://{raw}"
    try:
        parts = urlsplit(url)
        valid = (parts.scheme in ("http", "https") and bool(parts.hostname) and (parts.port is None or parts.port > 0)
                 and not (parts.query or parts.fragment) and not any(char.isspace() for char in url)
                 # user:password@ in the address would be shown wherever the host is named
                 and not (name == "RAG_EMBED_URL" and (parts.username or parts.password)))
    except ValueError:  # a port that is not a number from 0 to 65535
        valid = False
    if not valid:
        raise _setting_error(name, "(hidden)" if "@" in raw else raw, _ADDRESS_WANTED[name])
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
# Every variable, declared once: VARIABLES (the README's Configuration table, row for row).

EnvReader = Callable[[Mapping[str, str], str, Any], Any]


@dataclass(frozen=True)
class Variable:
    """One environment variable: the Settings field it sets (None: read with another, as
    OLLAMA_HOST is with RAG_EMBED_URL), its reader (env, name, the field's default) -> value, which
    makes a bad value a configuration error naming it, and its row of the README's Configuration
    table (the default as shown, what it does; a test holds the README to these rows)."""

    name: str
    field: str | None
    read: EnvReader | None
    shown: str
    doc: str

    def row(self) -> str:
        return f"| `{self.name}` | {self.shown} | {self.doc} |"


def field_default(name: str) -> Any:
    """A Settings field's default (None for one without: the corpus folder)."""
    spec = Settings.__dataclass_fields__[name]
    if spec.default is not dataclasses.MISSING:
        return spec.default
    if spec.default_factory is not dataclasses.MISSING:
        return spec.default_factory()
    return None


def _text(env: Mapping[str, str], name: str, default: Any) -> Any:
    return env.get(name, "").strip() or default


def _whole(lowest: int, highest: int = 2**31) -> EnvReader:
    return lambda env, name, default: _int_env(env, name, default, lowest, highest)


def _optional_whole(lowest: int, highest: int) -> EnvReader:
    """A whole number in range, or the default (None) when unset."""
    return lambda env, name, default: _int_env(env, name, 0, lowest, highest) or default


def _choice(choices: Sequence[str]) -> EnvReader:
    return lambda env, name, default: _choice_env(env, name, default, choices)


def _addresses(pattern: re.Pattern[str], example: str) -> EnvReader:
    return lambda env, name, default: _addresses_env(env, name, pattern, example)


def _unset_none(reader: Callable[[Mapping[str, str], str], Any]) -> EnvReader:
    """A reader that knows its own unset value (None, no headers, the default formats)."""
    return lambda env, name, default: reader(env, name)


def _embed_api_env(env: Mapping[str, str], name: str, default: str) -> str:
    api = env.get(name, "").strip().lower() or default
    if api not in EMBED_APIS:
        raise _setting_error(name, api, "one of " + ", ".join(EMBED_APIS))
    return api


VARIABLES = (
    Variable('RAG_CORPUS_DIR', 'corpus_dir', _text,
             '`sample-corpus/` next to the code in a clone (never the cwd); none for an installed '
             'copy',
             'the folder of documents to index; the server reads files from the folder the index was '
             'built from when unset'),
    Variable('RAG_STORE_DIR', 'store_dir', _text,
             '`~/.local-rag-mcp/store`',
             'where the index lives (created by ingest only)'),
    Variable('OLLAMA_HOST', None, None,
             '`http://127.0.0.1:11434`',
             'the Ollama server: `host`, `host:port`, `http(s)://host[:port][/path]`; a comma list '
             'spreads ingest over hosts serving the same model (its '
             '[fingerprint](#embedding-servers)); the server asks them in order: a host that is down '
             'or answers vectors of another size or model passes the query to the next, one that has '
             'not answered within 2.5 s gets the next asked beside it (the first answer wins), and a '
             'host that stalled or answered another model is skipped for 15 s'),
    Variable('RAG_EMBED_API', 'embed_api', _embed_api_env,
             '`ollama`',
             "the embedding server's API: `ollama`, or `openai` for an OpenAI-compatible one (LM "
             "Studio, `llama-server`, vLLM, TEI, Infinity, Ollama's `/v1`); see [Embedding "
             'servers](#embedding-servers)'),
    Variable('RAG_EMBED_URL', 'ollama_hosts', _embed_hosts_env,
             "`OLLAMA_HOST`'s (with `ollama`)",
             "the embedding server's base URL as it documents it, e.g. `http://127.0.0.1:1234/v1` "
             '(`POST <url>/embeddings` is called); a comma list for several hosts, used as '
             "`OLLAMA_HOST`'s; required with `openai`; no `user:password@` in it"),
    Variable('RAG_EMBED_API_KEY', 'embed_api_key', _unset_none(_secret_env),
             'unset',
             'sent to the embedding server as `Authorization: Bearer <key>`; never logged, stored, '
             'shown or put in an error message'),
    Variable('RAG_EMBED_MODEL', 'embed_model', _text,
             '`embeddinggemma`',
             "embedding model; the server refuses (`index_incompatible`) another than the index's. "
             "Prefixes are applied by the model's family, whatever the API and however the server "
             "names it (`embeddinggemma-300M-Q8_0.gguf`, LM Studio's "
             '`text-embedding-nomic-embed-text-v1.5`): `embeddinggemma`, `nomic-embed-text`, the e5 '
             'family, `mxbai-embed-large`, `snowflake-arctic-embed`, `bge-m3`; another model gets '
             'none and a warning'),
    Variable('RAG_EMBED_PREFIXES', 'embed_prefixes', _unset_none(_prefixes_env),
             "the model's",
             'ingest: the prefix scheme for a model the table above does not know, one of '
             '`embeddinggemma`, `nomic-embed-text`, `e5`, `mxbai-embed-large`, '
             '`snowflake-arctic-embed`, `snowflake-arctic-embed2`, `bge-m3`, `none`; a change '
             'rebuilds'),
    Variable('RAG_EMBED_TIMEOUT', 'embed_timeout_s', _seconds_env,
             '`60`',
             'seconds an embedding call may take; the server uses at most 30 for a query'),
    Variable('RAG_EMBED_CONCURRENCY', 'embed_concurrency', _optional_whole(1, MAX_EMBED_CONCURRENCY),
             'measured',
             "ingest's calls in flight per host (Ollama's `OLLAMA_NUM_PARALLEL`); unset: doubled from"
             ' 1 while throughput grows'),
    Variable('RAG_EMBED_DIMENSIONS', 'embed_dimensions', _optional_whole(EMBED_DIMENSIONS_MIN, EMBED_DIMENSIONS_MAX),
             "the model's",
             "ingest asks Ollama for vectors this short (`256` of EmbeddingGemma's 768; "
             '[measured](tools/README.md#vector-dimensions)); a change rebuilds, the server follows '
             'the index'),
    Variable('RAG_CHUNK_MAX_TOKENS', 'chunk_max_tokens', _whole(32),
             '`512`',
             "chunk size target in estimated tokens (capped by the model's context)"),
    Variable('RAG_CHUNK_MIN_TOKENS', 'chunk_min_tokens', _whole(0),
             '`64`',
             'sections smaller than this merge with a neighbour; at most `RAG_CHUNK_MAX_TOKENS`'),
    Variable('RAG_STORE_TIMEOUT', 'store_timeout_s', _seconds_env,
             '`20`',
             'seconds a server call waits for the vector store before `store_unavailable`'),
    Variable('RAG_LOG_LEVEL', 'log_level', _choice(LOG_LEVELS),
             '`INFO`',
             "server's stderr log: `DEBUG`, `INFO` (one line per call), `WARNING`, `ERROR`"),
    Variable('RAG_SERVER_WARMUP', 'server_warmup', _flag_env,
             '`1`',
             '`0`: no background warm-up after the handshake (the first call pays the imports)'),
    Variable('RAG_WATCH', 'watch', _flag_env,
             '`0`',
             '`1`: the server keeps the index fresh itself, as `server.py --watch` '
             '([below](#a-server-that-keeps-its-index-fresh))'),
    Variable('RAG_CHROMA_URL', 'chroma_url', _unset_none(_url_env),
             'unset',
             'keep the vectors on a Chroma server, e.g. `http://127.0.0.1:8000` (below)'),
    Variable('RAG_CHROMA_HEADERS', 'chroma_headers', _unset_none(_headers_env),
             'unset',
             'JSON object of headers sent to that server, e.g. `{"Authorization": "Bearer …"}`'),
    Variable('RAG_RESPECT_GITIGNORE', 'respect_gitignore', _flag_env,
             '`1`',
             '`0`: do not leave out what git ignores (ingest)'),
    Variable('RAG_FORMATS', 'formats', _unset_none(_formats_env),
             'every format but `text`',
             'ingest: the formats read, a comma list of `markdown` (`.md`, `.markdown`), `mdx`, '
             '`rst`, `asciidoc` (`.adoc`, `.asciidoc`), `pdf`, `text` (`.txt`); other files are '
             'counted and named, never read'),
    Variable('RAG_CODE', 'code', _flag_env,
             '`0`',
             'ingest: `1` also reads source code (`ingest.py --code` does the same for one run; an '
             'index that holds code keeps reading it unless this is `0`): Python, Go, JavaScript, '
             'TypeScript, Rust and Java in symbol chunks, other source and configuration files in '
             '40-line windows; see [Code corpora](#code-corpora)'),
    Variable('RAG_HTTP_HOST', 'http_host', _text,
             '`127.0.0.1`',
             '`--http`: the address to listen on (`--host` overrides); anything but loopback requires'
             ' `RAG_HTTP_TOKEN`'),
    Variable('RAG_HTTP_PORT', 'http_port', _whole(0, 65535),
             '`8765`',
             '`--http`: the port (`--port` overrides; `0` picks a free one, logged at start)'),
    Variable('RAG_HTTP_TOKEN', 'http_token', _unset_none(_token_env),
             'unset',
             'bearer token every HTTP route but `/health` requires (at least 16 characters)'),
    Variable('RAG_HTTP_ALLOWED_HOSTS', 'http_allowed_hosts', _addresses(HTTP_HOST_PATTERN, "rag.internal:*"),
             'unset',
             'comma list of `Host` values accepted besides loopback names, matched exactly: '
             '`rag.internal:8443`, `rag.internal:*` (any port or none), `rag.internal` (no port)'),
    Variable('RAG_HTTP_ALLOWED_ORIGINS', 'http_allowed_origins', _addresses(HTTP_ORIGIN_PATTERN, "https://portal.internal"),
             'unset',
             "comma list of browser `Origin`s accepted besides the server's own, e.g. "
             '`https://portal.internal`; `http://localhost:*` allows any port'),
    Variable('RAG_HTTP_MAX_IN_FLIGHT', 'http_max_in_flight', _whole(1, 10_000),
             '`16`',
             'HTTP calls at work at once, in each of two budgets (searches that embed the query; all '
             'other calls); past it `503 TOO_BUSY`'),
    Variable('RAG_HTTP_READ_TIMEOUT', 'http_read_timeout_s', _seconds_env,
             '`10`',
             "seconds a client has to send a request's headers, and again its body (`408` past it)"),
    Variable('RAG_HTTP_MAX_CONNECTIONS', 'http_max_connections', _whole(8, 1_000_000),
             '`1000`',
             'open HTTP connections at most (past it `503 TOO_BUSY`); lowered to fit the descriptor '
             'limit'),
    Variable('RAG_TOOL_TIMEOUT', 'tool_timeout_s', _seconds_env,
             '`30`',
             'seconds one HTTP tool call may take before `TIMEOUT_ERROR` 504'),
)

ENVIRONMENT = tuple(variable.name for variable in VARIABLES)


def load_settings(env: Mapping[str, str] | None = None, *, corpus_dir: str | None = None,
                  store_dir: str | None = None, code: bool | None = None) -> Settings:
    """Resolve configuration: explicit arguments over the environment over defaults. Each variable
    is read by its VARIABLES entry; then what depends on two of them.

    The corpus default is next to the code, never the cwd: MCP clients launch servers from
    their own working directory.
    """
    env = os.environ if env is None else env
    read = {v.field: v.read(env, v.name, field_default(v.field)) for v in VARIABLES if v.field and v.read}
    if read["chunk_min_tokens"] > read["chunk_max_tokens"]:
        raise _setting_error("RAG_CHUNK_MIN_TOKENS", str(read["chunk_min_tokens"]),
                             f"a whole number up to RAG_CHUNK_MAX_TOKENS ({read['chunk_max_tokens']})")
    corpus_choice = corpus_dir or read["corpus_dir"]
    code = read["code"] if code is None else code
    return Settings(**{**read, "corpus_dir": _abs_path(corpus_choice or PROJECT_DIR / "sample-corpus"),
                       "corpus_dir_explicit": bool(corpus_choice),
                       "store_dir": _abs_path(store_dir or read["store_dir"]),
                       "embed_model_explicit": bool(env.get("RAG_EMBED_MODEL", "").strip()),
                       "formats": formats_read(read["formats"], code), "code": code})


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
# Documents: the one model every reader returns (readers are below, after searchable text), and
# the keys a document may set, read the same way whatever its format.

CHUNK_MODES = ("whole", "headings")
LIFECYCLES = ("active", "superseded")
SUCCESSORS_MAX = 10  # paths one superseded_by keeps; a longer list is a mistake, not a reading list


@dataclass(frozen=True)
class Heading:
    line: int  # 1-based line of the heading's text in the file as stored
    level: int  # 1 is the document's top level
    text: str  # as shown in heading paths: one line, markup reduced to its text, capped (metadata_text)


@dataclass(frozen=True)
class Page:
    """A page of a paged document (PDF): where it starts in the extracted text, and its number."""

    line: int  # 1-based line of the page's marker line in the extracted text
    number: int  # physical page, 1-based
    label: str  # the printed page label where the document defines one ("x", "10"), else str(number)


@dataclass(frozen=True)
class DocumentText:
    """What a reader makes of one file, whatever its format: the model chunking, keyword terms,
    the store, citations and get_file consume. Line numbers are the file's physical lines as
    stored (a PDF's: those of the text extracted from it, a marker line per page)."""

    lines: tuple[str, ...]  # every line, without line terminators
    # Each line as it is embedded and keyword-indexed (markup reduced to its text, URL payloads
    # shortened); "" where a line is no content (a comment, an import, an underline, metadata).
    searchable: tuple[str, ...]
    body_start: int  # 1-based line where the body starts (after frontmatter, docinfo or a header)
    headings: tuple[Heading, ...]  # in file order
    # 1-based lines where a block begins (paragraph, list, code, directive, table, heading): where
    # a section too long for one chunk may be cut without cutting a block in two.
    block_starts: tuple[int, ...]
    metadata: Mapping[str, Any] = field(default_factory=dict)  # the document's keys as its format writes them
    title: str | None = None  # the format's own title (first H1, first section title, PDF /Title)
    pages: tuple[Page, ...] = ()  # a paged document's pages, in order
    warnings: tuple[str, ...] = ()  # what the reader left out that the user should hear about
    code: CodeStructure | None = None  # a source file's language and symbols (read_code); None for documents


@dataclass(frozen=True)
class SourceDocument:
    """A file after its reader and the document keys: what ingest chunks and indexes."""

    path: str
    title: str
    rag: bool
    chunk_mode: str
    lifecycle: str
    text: DocumentText = field(repr=False)
    superseded_by: tuple[str, ...] = ()  # corpus-relative paths of the documents that replace it
    tags: tuple[str, ...] = ()
    dated: str | None = None  # YYYY-MM-DD: the document's own date (its `updated`, else its `date`)
    # What the reader and the keys ignored and the user should hear about (ingest logs it).
    warnings: tuple[str, ...] = field(default=(), compare=False)

    @property
    def lines(self) -> tuple[str, ...]:
        return self.text.lines

    @property
    def body_start(self) -> int:
        return self.text.body_start

    @property
    def line_count(self) -> int:
        return len(self.text.lines)

    @property
    def kind(self) -> str:
        return "code" if self.text.code is not None else "doc"

    @property
    def language(self) -> str | None:
        return self.text.code.language if self.text.code is not None else None

    @property
    def reader(self) -> Reader:
        found = reader_for(self.path)
        assert found is not None, self.path  # parse_document only reads a path a reader takes
        return found


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


# What one text file may hold. Its reader and the chunker keep every line in memory together, about
# 2 KB a line at worst (a Markdown heading or list item: 100,000 of them peaked near 200 MB), so a
# file of a million one-line headings took 1.6 GB and a minute before anything was embedded. The
# dev set's largest documents (../shared/devset: 270 files of four real doc sites) are 726 KB and
# 3,106 lines: these are 45 and 30 times that, and leave room for the fault suite's 20 MB handbook.
# At the limits one file peaks at 200-350 MB (100,000 headings or list items), 700 MB as one
# 32 MB line. PDFs have limits of their own (the extractor's).
TEXT_FILE_MAX_BYTES = 32 << 20  # checked on the size the walk saw, before a byte is read
TEXT_FILE_MAX_LINES = 100_000  # counted in the bytes, before they are decoded and parsed


def text_file_over_budget(path: str, size: int, lines: int = 0) -> RagError | None:
    """Why a file of a text format is not read (document_invalid naming the budget, the file's
    value and the limit), or None; a file of another format, or none, is not this rule's."""
    reader = reader_for(path)
    if reader is None or reader.extracted:
        return None
    if size > TEXT_FILE_MAX_BYTES:
        what = f"{size / (1 << 20):.1f} MB, more than the {TEXT_FILE_MAX_BYTES >> 20} MB"
    elif lines > TEXT_FILE_MAX_LINES:
        what = f"{lines:,} lines, more than the {TEXT_FILE_MAX_LINES:,} lines"
    else:
        return None
    return RagError(ErrorCode.DOCUMENT_INVALID, f"{path}: {what} one text file may hold; split it to index it",
                    "split it into smaller files")


def decode_text(raw: bytes, path: str) -> str:
    """A text format's bytes as text: UTF-8 (a BOM dropped), never binary."""
    if b"\x00" in raw:
        raise RagError(ErrorCode.DOCUMENT_INVALID, f"{path}: binary file (contains NUL bytes)",
                       f"remove it from the corpus or rename it to something other than {PurePosixPath(path).suffix}")
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


FIELD_VALUE_MAX_CHARS = 4096  # a docinfo field or header attribute read as a value; longer is text


def field_value(raw: str) -> Any:
    """A value written as text (an rST docinfo field, an AsciiDoc attribute, a PDF's document
    information) as frontmatter would hold it: `false` a boolean, `[a.rst, b.rst]` a list, anything
    that does not read as one YAML value (aliases included) the text itself. So every format's keys
    are read by the same rules."""
    import yaml

    text = raw.strip()
    if len(text) > FIELD_VALUE_MAX_CHARS or "*" in text or "&" in text:
        return text
    try:
        value = yaml.safe_load(text)
    except (yaml.YAMLError, RecursionError, ValueError):
        return text
    return value if isinstance(value, (bool, list, str)) else text


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


def _invalid_key(path: str, what: str, value: Any, fix: str) -> RagError:
    return RagError(ErrorCode.DOCUMENT_INVALID, f"{path}: {what}, got {shown(value, 80)}", fix)


def _read_rag(value: Any, path: str, known: Mapping[str, Any]) -> tuple[bool, tuple[str, ...]]:
    if not isinstance(value, bool):  # `rag: 0` equals False in Python but is not a YAML boolean
        raise _invalid_key(path, "rag must be true or false", value, "write `rag: false` to exclude the file, or "
                           "remove the key")
    return value, ()


def _read_choice(name: str, choices: Sequence[str], example: str) -> Callable[..., tuple[str, tuple[str, ...]]]:
    def read(value: Any, path: str, known: Mapping[str, Any]) -> tuple[str, tuple[str, ...]]:
        if not (isinstance(value, str) and value in choices):
            raise _invalid_key(path, f"{name} must be one of {tuple(choices)}", value, f"write `{example}` or remove the key")
        return value, ()
    return read


def _read_title(value: Any, path: str, known: Mapping[str, Any]) -> tuple[str | None, tuple[str, ...]]:
    """A title that is not text, or blank, gives way to the format's own (first heading), silently:
    it is what a reader of the page sees either way."""
    return (metadata_text(nfc(value)) if isinstance(value, str) and value.strip() else None), ()


def _read_successors(value: Any, path: str, known: Mapping[str, Any]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return successors_of(value, path, known["lifecycle"])


TAGS_MAX = 50  # tags one document keeps; a longer list is a mistake (or a keyword dump), not tags
TAG_MAX_CHARS = 100


def _read_tags(value: Any, path: str, known: Mapping[str, Any]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Tags: a list, or one comma-separated string (PDF /Keywords, AsciiDoc :keywords:). Like a
    successor, a tag is a pointer for readers: what cannot be used is left out with a warning."""
    items = value.split(",") if isinstance(value, str) else value if isinstance(value, list) else None
    if items is None:
        return (), (f"{path}: tags must be a list or a comma-separated string, got {shown(value, 80)}; ignored",)
    tags: dict[str, str] = {}  # by match_key: "Deploy" and "deploy" are one tag
    for item in items[:2 * TAGS_MAX]:
        text = metadata_text(nfc(str(item)), TAG_MAX_CHARS) if isinstance(item, str | int | float) else ""
        if text and not isinstance(item, bool):
            tags.setdefault(match_key(text), text)
    warnings = (f"{path}: more than {TAGS_MAX} tags; the rest are ignored",) if len(tags) > TAGS_MAX else ()
    return tuple(tags.values())[:TAGS_MAX], warnings


_ISO_DATE = re.compile(r"(\d{4})-(\d{2})-(\d{2})(?![0-9])")
_PDF_DATE = re.compile(r"D:(\d{4})(\d{2})(\d{2})")


def _read_date(value: Any, path: str, known: Mapping[str, Any]) -> tuple[str | None, tuple[str, ...]]:
    """A date as YYYY-MM-DD: YAML's and TOML's dates and datetimes, text starting with an ISO date
    (a time after it is dropped: dates filter by day), or a PDF date (D:YYYYMMDD...)."""
    if isinstance(value, datetime.date):  # datetime.datetime is one too
        return value.strftime("%Y-%m-%d"), ()
    found = (_ISO_DATE.match(value.strip()) or _PDF_DATE.match(value.strip())) if isinstance(value, str) else None
    if found is not None:
        with contextlib.suppress(ValueError):
            return datetime.date(*map(int, found.groups())).isoformat(), ()
    return None, (f"{path}: a date must be YYYY-MM-DD, got {shown(value, 80)}; ignored",)


def match_key(text: str) -> str:
    """How a name is compared when an agent or a user types it (a title, a file name, a tag):
    NFKC (a pasted NFD name, full-width letters), case-folded, whitespace collapsed and trimmed."""
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


@dataclass(frozen=True)
class DocumentKey:
    """A key a document may set, the same in every format: YAML, TOML or JSON frontmatter (Markdown,
    MDX), the docinfo field list (reStructuredText), header attributes (AsciiDoc), the document
    information (PDF). `read` checks a value that is there (a bad one is document_invalid, or a
    warning where the key is only a pointer for readers); `default` stands in for a missing one.
    The README's frontmatter table lists exactly these keys (a test holds them together)."""

    name: str
    default: Any
    read: Callable[[Any, str, Mapping[str, Any]], tuple[Any, tuple[str, ...]]]
    # The same key as other formats or generators spell it (PDF /Keywords, AsciiDoc :revdate:,
    # Hugo's lastmod), read when the key itself is missing, in this order.
    also: tuple[str, ...] = ()


# In the order they are read: a key's reader sees the keys before it (superseded_by, lifecycle).
DOCUMENT_KEYS = (
    DocumentKey("rag", True, _read_rag),
    DocumentKey("rag_chunk", "whole", _read_choice("rag_chunk", CHUNK_MODES, "rag_chunk: headings")),
    DocumentKey("lifecycle", "active", _read_choice("lifecycle", LIFECYCLES, "lifecycle: superseded")),
    DocumentKey("superseded_by", (), _read_successors),
    DocumentKey("title", None, _read_title),
    DocumentKey("tags", (), _read_tags, also=("keywords", "Keywords")),
    # A document's own date: `updated` first, else `date` (see SourceDocument.dated).
    DocumentKey("updated", None, _read_date, also=("lastmod", "last_modified", "modified", "ModDate")),
    DocumentKey("date", None, _read_date, also=("revdate", "CreationDate")),
)


def document_keys(metadata: Mapping[str, Any], path: str) -> tuple[dict[str, Any], tuple[str, ...]]:
    """Every DOCUMENT_KEYS value of a document's metadata, and the warnings its values gave."""
    values: dict[str, Any] = {}
    warnings: list[str] = []
    for key in DOCUMENT_KEYS:
        name = next((name for name in (key.name, *key.also) if name in metadata), None)
        if name is None:
            values[key.name] = key.default
            continue
        values[key.name], said = key.read(metadata[name], path, values)
        warnings.extend(said)
    return values, tuple(warnings)


# Credentials never enter the index: a file whose text (or its format's keys) holds one is
# refused by name, saying what and where, and nothing of it is stored. Each kind by its issuer's
# documented shape; a value with EXAMPLE in it is a documented placeholder (AWS's
# AKIAIOSFODNN7EXAMPLE), and a shape too loose to tell a secret from prose ("password:") is none.
CREDENTIALS = {
    "private_key": ("a private key", r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----"),
    "aws_key_id": ("an AWS access key ID", r"\b(?:AKIA|ASIA|ABIA|ACCA)[0-9A-Z]{16}\b"),
    "aws_secret": ("an AWS secret access key", r"(?i:aws_?secret_?access_?key)[\s\"':=]{1,6}[A-Za-z0-9/+]{40}(?![A-Za-z0-9/+])"),
    "github": ("a GitHub token", r"\bgh[pousr]_[A-Za-z0-9]{36,}\b|\bgithub_pat_[A-Za-z0-9_]{60,}"),
    "gitlab": ("a GitLab token", r"\bglpat-[A-Za-z0-9_-]{20,}"),
    "slack": ("a Slack token", r"\bxox[abposr]-[0-9A-Za-z-]{10,}"),
    "google": ("a Google API key", r"\bAIza[0-9A-Za-z_-]{35}(?![0-9A-Za-z_-])"),
    "stripe": ("a Stripe live key", r"\b[rs]k_live_[0-9A-Za-z]{24,}"),
    "ai_key": ("an OpenAI or Anthropic API key", r"\bsk-(?:ant-[a-z0-9]+-|proj-)?[A-Za-z0-9_-]{40,}"),
}
# Files that hold secrets by their name: never read, whatever the rules (a .ragignore `!` rule
# cannot bring one back), and named in the run's summary as left out. Matched on the file or
# folder name, case-insensitively, as shell patterns.
SECRET_FILE_NAMES = (".env", ".env.*", "*.env", "*.pem", "*.key", "*.p12", "*.pfx", "*.jks", "*.keystore", "*.kdbx",
                     "id_rsa*", "id_dsa*", "id_ecdsa*", "id_ed25519*", "credentials.json", "credentials.yml",
                     "serviceAccountKey.json", "*-service-account*.json", ".npmrc", ".pypirc", ".netrc", "_netrc",
                     ".git-credentials", ".htpasswd", ".dockercfg")
SECRET_FOLDER_NAMES = (".secrets", ".ssh", ".aws", ".gnupg", ".docker")
_SECRET_FILE = re.compile("|".join(fnmatch.translate(p) for p in SECRET_FILE_NAMES), re.IGNORECASE)
_SECRET_FOLDER = re.compile("|".join(fnmatch.translate(p) for p in SECRET_FOLDER_NAMES), re.IGNORECASE)
SECRET_REFUSAL = "a secret by its name: never indexed (built-in; a .ragignore cannot bring it back)"


def secret_by_name(path: str, is_dir: bool = False) -> bool:
    """Whether a file (or folder) is one that holds secrets by its name (SECRET_FILE_NAMES), or lies
    in a folder that does."""
    parts = PurePosixPath(path).parts
    if not parts:
        return False
    folders = parts if is_dir else parts[:-1]
    return any(_SECRET_FOLDER.match(part) for part in folders) or (not is_dir and bool(_SECRET_FILE.match(parts[-1])))


_CREDENTIAL = re.compile("|".join(f"(?P<{name}>{pattern})" for name, (_, pattern) in CREDENTIALS.items()))
CREDENTIAL_PLACEHOLDER = "EXAMPLE"


@dataclass(frozen=True)
class CredentialFound:
    kind: str  # as CREDENTIALS names it
    where: str  # "line 12", or the key that holds it

    def refusal(self, path: str) -> RagError:
        return RagError(ErrorCode.DOCUMENT_INVALID, f"{path}: {self.where} holds what looks like {self.kind}; a "
                        "file with a credential is never indexed",
                        "remove the credential from the file (or keep the file out with rag: false or "
                        ".ragignore); a documented placeholder (with EXAMPLE in it) is not refused")


# A private key's marker is a credential with its key material: base64 on its line or within the
# next lines (after an encrypted key's Proc-Type and DEK-Info headers). The marker alone is how
# documentation names the format (Spring Boot's "`-----BEGIN PRIVATE KEY-----` in prose").
_KEY_MATERIAL = re.compile(r"[A-Za-z0-9+/=]{40,}")
KEY_MATERIAL_LINES = 4


def credential_in(text: DocumentText) -> CredentialFound | None:
    """The first credential a reader's text holds, in its lines (as stored, or extracted) or the
    string values of its keys; None when there is none."""
    lines = text.lines
    values = [(f"line {n}", line, n) for n, line in enumerate(lines, start=1)]
    values += [(f"the {key!r} key", value, None) for key, value in text.metadata.items() if isinstance(value, str)]
    for where, value, below in values:  # below: the index of the line after a line (None for a key)
        for found in _CREDENTIAL.finditer(value):
            if CREDENTIAL_PLACEHOLDER in found.group():
                continue
            if found.lastgroup == "private_key" and not any(
                    _KEY_MATERIAL.search(piece) for piece in
                    (value[found.end():], *(lines[below:below + KEY_MATERIAL_LINES] if below is not None else ()))):
                continue
            return CredentialFound(CREDENTIALS[found.lastgroup or ""][0], where)
    return None


def parse_document(raw: bytes, path: str) -> SourceDocument:
    """Read one file with the reader its extension names and apply the document keys.
    Raises RagError(document_invalid)."""
    reader = reader_for(path)
    if reader is None:
        raise RagError(ErrorCode.DOCUMENT_INVALID, f"{path}: no reader takes {PurePosixPath(path).suffix or 'it'}",
                       f"the formats read are {', '.join(r.format for r in READERS)}")
    over = text_file_over_budget(path, len(raw), raw.count(b"\n") + (bool(raw) and not raw.endswith(b"\n")))
    if over is not None:
        raise over
    try:
        text = reader.read(raw, path)
    except RecursionError:  # a backstop: each reader bounds its own nesting, and one file must not stop a run
        raise RagError(ErrorCode.DOCUMENT_INVALID, f"{path}: nested too deeply to read",
                       "flatten it, or leave it out with .ragignore") from None
    keys, warnings = document_keys(text.metadata, path)
    if keys["rag"] and (found := credential_in(text)) is not None:  # rag: false keeps it out already
        raise found.refusal(path)
    title = keys["title"] or text.title or PurePosixPath(path).stem
    return SourceDocument(path=path, title=metadata_text(nfc(title)), rag=keys["rag"], chunk_mode=keys["rag_chunk"],
                          lifecycle=keys["lifecycle"], text=text, superseded_by=keys["superseded_by"],
                          tags=keys["tags"], dated=keys["updated"] or keys["date"], warnings=text.warnings + warnings)


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


def tags_column(tags: Sequence[str]) -> str:
    """How the keyword index's documents.tags holds a document's tags."""
    return json.dumps(list(tags), ensure_ascii=False)


def tags_from_column(raw: str | None) -> tuple[str, ...]:
    """The tags documents.tags holds; none for NULL (not recorded) or a value this module did not write."""
    return successors_from_column(raw)  # the same shape: a JSON list of text


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
_SCHEME_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+.-")
_PATH_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-.~:/@!$&*+,;=%")
_QUERY_CHARS = _PATH_CHARS | {"?", "#"}
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
    text = _DATA_URI.sub(rf"\g<1>{PAYLOAD_MARK}", text)
    if "://" in text:
        text = "".join(text[a:b] if keep else PAYLOAD_MARK for a, b, keep in _url_payload_parts(text))
    text = _LINK_PAYLOAD.sub(rf"\g<1>{PAYLOAD_MARK}", text)
    return _RUN_CANDIDATE.sub(lambda m: PAYLOAD_MARK if _is_payload_run(m.group(0)) else m.group(0), text)


def _url_payload_parts(text: str) -> Iterator[tuple[int, int, bool]]:
    """text cut into (start, end, keep) parts, keep False for a URL's payload: what follows the first
    ? or # of an http(s)-like URL (a scheme at a word boundary, ://, path characters)."""
    at = 0
    for _start, query, end in _urls(text, payload=True):
        yield at, query + 1, True
        yield query + 1, end, False
        at = end
    yield at, len(text), True


def _urls(text: str, payload: bool) -> Iterator[tuple[int, int, int]]:
    """(start, first ? or # or end, end) of each URL of text, left to right, as the expression
    `\\b[A-Za-z][A-Za-z0-9+.-]*://[path]*` then `[?#][path?#]+` (payload) or `[path?#]+` finds
    them, in one pass: a regular expression tries every letter of a long run of scheme characters
    (a megabyte line of "a.a.a.", or of "https://") and scans the rest of the run from each."""
    floor = 0  # the end of the last URL: nothing before it starts another
    scanned: tuple[int, int] = (-1, -1)  # a path run already scanned (its start, its end): the same for any start in it
    at = text.find("://")
    while at >= 0:
        run = at
        while run > floor and text[run - 1] in _SCHEME_CHARS:
            run -= 1
        start = next((k for k in range(run, at) if text[k].isascii() and text[k].isalpha()
                      and (k == 0 or not _is_word_character(text[k - 1]))), None)
        path = at + 3
        query = scanned[1] if scanned[0] <= path <= scanned[1] else _skip(text, path, _PATH_CHARS)
        scanned = (path, query)
        if payload:
            end = _skip(text, query + 1, _QUERY_CHARS) if query < len(text) and text[query] in "?#" else query
            found = end > query + 1
        else:
            end = _skip(text, path, _QUERY_CHARS)
            found = end > path
        if start is not None and found:
            yield start, query, end
            floor = end
        at = text.find("://", max(at + 1, floor))


def _skip(text: str, at: int, chars: frozenset[str]) -> int:
    while at < len(text) and text[at] in chars:
        at += 1
    return at


def _is_word_character(char: str) -> bool:
    """What \\w matches (a \\b lies between one and a character that is not)."""
    return char.isalnum() or char == "_"


def _is_payload_run(run: str) -> bool:
    """A long run of base64/hex characters is payload when it mixes letters and digits with few
    separators: paths and snake_case identifiers have a separator every few characters."""
    return (bool(_DIGIT.search(run)) and bool(_ASCII_LETTER.search(run))
            and len(_RUN_SEPARATORS.findall(run)) * 16 <= len(run))


# ---------------------------------------------------------------------------
# Readers: one per format, each making a file's bytes into the one document model (DocumentText).
# Adding a format is one reader function and one row of READERS; nothing downstream knows formats.


@dataclass(frozen=True)
class Reader:
    format: str  # its name in RAG_FORMATS
    extensions: tuple[str, ...]  # lower case, with the dot
    mime_type: str  # of the text get_file and resources/read return
    read: Callable[[bytes, str], DocumentText]  # raises RagError(document_invalid)
    # A piece of one line as embedded, out of its context: the pieces of a line too long for the
    # model are cut from the line as written, and each is made searchable by this.
    inline: Callable[[str], str]
    read_by_default: bool = True  # in RAG_FORMATS when it is unset
    # The text is extracted from a binary file (PDF): ingest stores it, get_file serves it from the index.
    extracted: bool = False
    kind: str = "doc"  # "doc" or "code" (RAG_CODE turns the code readers on; search_corpus's scope)
    # Raised whenever what the reader makes of a file changes: ingest reads every file an older
    # version read again (see stamp), and its passages whose text is the same keep their vectors.
    version: int = 1

    @property
    def stamp(self) -> str:
        """What the documents table records of the reader that read a file (its read_with)."""
        return f"{self.format}:{self.version}"


# Markdown: CommonMark block structure (markdown-it) for headings and block boundaries.


@dataclass(frozen=True)
class BodyHeading:
    line: int  # 0-based line index within the body that was parsed
    end: int  # exclusive
    level: int
    text: str


@dataclass(frozen=True)
class BodyStructure:
    """What chunking needs from the CommonMark parse of a body: its top-level headings and the
    first line (0-based) of every top-level block."""

    headings: tuple[BodyHeading, ...]
    block_starts: tuple[int, ...]
    # 0-based line ranges [start, end) of code (fenced or indented) at any depth, kept as written
    code: tuple[tuple[int, int], ...] = ()
    # ... and of what a reader never sees: HTML comments, <script> and <style> blocks, and the lines
    # no block holds (link reference definitions, `[//]: # (a comment)`; blank lines)
    hidden: tuple[tuple[int, int], ...] = ()


# A heading's attribute list, as MkDocs (attr_list), VitePress and Pandoc write it: `{#id}`,
# `{ #cors-policy }`, `{: #id .class key=value }`. Not text a reader of the page sees.
_ATTRIBUTE = r"(?:[#.][^\s{}]+|[\w-]+=[^\s{}]*)"
_ANCHOR_SUFFIX = re.compile(rf"\{{:?\s*{_ATTRIBUTE}(?:\s+{_ATTRIBUTE})*\s*\}}\s*")


def _without_anchor_suffix(text: str) -> str:
    """`text` without a trailing attribute list; matched from the last "{" only (an attribute holds
    no brace), so a run of blanks is not rescanned from each of its positions."""
    at = text.rfind("{")
    return text[:at].rstrip() if at >= 0 and _ANCHOR_SUFFIX.fullmatch(text, at) else text


def _markdown_tokens(lines: Sequence[str]) -> list[Any]:
    from markdown_it import MarkdownIt

    # markdown-it treats a lone CR as a line break; our lines split on LF only, so the parser
    # must not see one or every line number after it would shift.
    # Block structure only: headings and block boundaries are all chunking reads, and the inline
    # pass (emphasis, links) took 40% of parsing a 20 MB file. Heading text is the inline token's
    # content, which the block pass already sets.
    return MarkdownIt("commonmark").disable(["inline", "text_join"]).parse("\n".join(lines).replace("\r", " "))


_HIDDEN_HTML = re.compile(r"[ \t]*<(?:!--|script\b|style\b)", re.IGNORECASE)


def body_structure(body: Sequence[str]) -> BodyStructure:
    tokens = _markdown_tokens(body)
    top = sorted(tuple(tok.map) for tok in tokens if tok.level == 0 and tok.map and tok.nesting >= 0)
    unheld, at = [], 0
    for start, end in top:
        if start > at:
            unheld.append((at, start))
        at = max(at, end)
    if at < len(body):
        unheld.append((at, len(body)))
    return BodyStructure(headings=tuple(_headings_from_tokens(tokens)),
                         block_starts=tuple(sorted({start for start, _ in top})),
                         code=tuple(tuple(tok.map) for tok in tokens if tok.type in ("fence", "code_block") and tok.map),
                         hidden=(*unheld, *(tuple(tok.map) for tok in tokens
                                            if tok.type == "html_block" and tok.map and _HIDDEN_HTML.match(tok.content))))


def _headings_from_tokens(tokens: Sequence[Any]) -> list[BodyHeading]:
    headings = []
    for i, tok in enumerate(tokens):
        if tok.type == "heading_open" and tok.level == 0 and tok.map:
            text = markup_heading(tokens[i + 1].content)
            # Capped here: every chunk of a section carries its heading path, so a heading of a
            # megabyte would cost memory with the square of its length.
            headings.append(BodyHeading(line=tok.map[0], end=tok.map[1], level=int(tok.tag[1]),
                                        text=metadata_text(nfc(text))))
    return headings


def _first_h1(headings: Sequence[Heading]) -> str | None:
    return next((heading.text or None for heading in headings if heading.level == 1), None)


def read_markdown(raw: bytes, path: str) -> DocumentText:
    """Markdown: frontmatter (YAML, TOML or JSON) for the keys, CommonMark for the structure; the
    title is the first H1. Code stays as written; elsewhere what the page does not show is no
    content: HTML comments, <script> and <style> blocks, tags (but their shown attributes), a
    paragraph of ESM imports (a Docusaurus `.md` page is MDX), container fences (`::: tip`)."""
    lines = split_lines(decode_text(raw, path))
    metadata, body_start = read_frontmatter(lines, path)
    body = lines[body_start - 1:]
    structure = body_structure(body)
    headings = tuple(Heading(h.line + body_start, h.level, h.text) for h in structure.headings)
    return DocumentText(lines=tuple(lines), searchable=("",) * (body_start - 1) + _markdown_searchable(body, structure),
                        body_start=body_start, headings=headings,
                        block_starts=tuple(start + body_start for start in structure.block_starts),
                        metadata=metadata, title=_first_h1(headings))


def _markdown_searchable(body: Sequence[str], structure: BodyStructure) -> tuple[str, ...]:
    how = ["text"] * len(body)
    for ranges, kind in ((structure.hidden, "hidden"), (structure.code, "code")):
        for start, end in ranges:
            how[start:end] = [kind] * (end - start)
    for start, end in _esm_paragraphs(body, how):
        how[start:end] = ["hidden"] * (end - start)
    return tuple(searchable_text(line) if kind == "code" else "" if kind == "hidden" else container_line(line)
                 for line, kind in zip(body, how, strict=True))


_ESM_LINE = re.compile(r"[ \t]*(?:import\s+(?:[\w$*{},\s]+\s+from\s+)?[\"'][^\"']+[\"'];?"
                       r"|export\s+(?:const|let|function|default)\b.*)[ \t]*$")


def _esm_paragraphs(body: Sequence[str], how: Sequence[str]) -> Iterator[tuple[int, int]]:
    """Paragraphs of text whose lines are all ESM statements (`import X from './x.md';`): only an
    MDX page (Docusaurus compiles `.md` as MDX) writes them outside code, and it never shows them."""
    start = None
    for n in range(len(body) + 1):
        esm = n < len(body) and how[n] == "text" and _ESM_LINE.match(body[n]) is not None
        if esm and start is None and (n == 0 or not body[n - 1].strip()):
            start = n
        elif not esm and start is not None:
            if n == len(body) or not body[n].strip():
                yield start, n
            start = None


# MDX (Docusaurus, Mintlify, Nextra, Starlight): Markdown with ESM and JSX. Read line by line, as
# MDX parses it: no indented code and no HTML blocks, so a heading between JSX tags is a heading.
_MDX_FENCE = re.compile(r"^[ \t]*(`{3,}|~{3,})(.*)$")
_MDX_ATX = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*))?$")
_MDX_ESM = re.compile(r"^(?:import|export)\b")
# A JSX or HTML tag on one line: `<Note>`, `</Tab>`, `<Card title="x" icon="y" />`, `<>`. Attribute
# values are quoted strings or {expressions} without braces inside (bounded, never backtracking).
_JSX_TAG = re.compile(r"</?[A-Za-z][\w.:-]*(?:\s+[\w:.-]+(?:=(?:\"[^\"]*\"|'[^']*'|\{[^{}]*(?:\{[^{}]*\}[^{}]*)*\}))?)*"
                      r"\s*/?>|</?>")  # expressions hold one level of braces: style={{color: 'red'}}
_TAG_END = re.compile(r"(?<!=)>")  # not an arrow function's
_JSX_TAG_START = re.compile(r"<[A-Za-z][\w.:-]*(?=\s|$)")
_BACKTICK_RUN = re.compile(r"`+")
_MARKDOWN_ESCAPE = re.compile(r"\\([!-/:-@\[-`{-~])")  # CommonMark: a backslash shows the ASCII punctuation after it
_STRING_LITERAL = re.compile(r"\"([^\"]*)\"|'([^']*)'")  # its text in group 1 or 2
# Attributes whose value is text a reader of the page sees (a tab's or card's title).
_SHOWN_ATTRIBUTE = re.compile(rf"\b(?:title|label|alt|summary|description|heading|caption|text)=(?:{_STRING_LITERAL.pattern})")
# What a tag without a shown attribute shows instead: Docusaurus labels a tab by its value.
_SHOWN_INSTEAD = {"TabItem": re.compile(rf"\bvalue=(?:{_STRING_LITERAL.pattern})")}
# Nextra's and Docusaurus' tab sets name their tabs in an array: <Tabs items={['npm', 'pnpm']}>.
_SHOWN_ITEMS = re.compile(r"\bitems=\{\[([^\[\]{}]*)\]\}")


def _jsx_tag_text(tag: str) -> str:
    """What a reader of the page sees of a tag: the values of its shown attributes."""
    shown = " ".join(a or b for a, b in _SHOWN_ATTRIBUTE.findall(tag))
    if "items={[" in tag:
        shown = " ".join(filter(None, [shown, *(a or b for items in _SHOWN_ITEMS.findall(tag)
                                                for a, b in _STRING_LITERAL.findall(items))]))
    if not shown and (instead := _SHOWN_INSTEAD.get(tag.lstrip("<").split(None, 1)[0] if tag[1:2].isalpha() else "")):
        shown = " ".join(a or b for a, b in instead.findall(tag))
    return shown


def _tag_in_text(text: str, tag: re.Match[str]) -> str:
    """A tag within a line replaced by what it shows, apart from the words beside it."""
    shown = _jsx_tag_text(tag.group())
    if not shown:
        return ""
    before = " " if tag.start() > 0 and not text[tag.start() - 1].isspace() else ""
    after = " " if tag.end() < len(text) and not text[tag.end()].isspace() else ""
    return before + shown + after


def _without_spans(text: str, opening: str, closing: str) -> str:
    """`text` without each `opening`…`closing` span (the first closing after each opening), in one
    pass: once an opening has no closing after it, none after it has."""
    out, at = [], 0
    while (start := text.find(opening, at)) >= 0:
        end = text.find(closing, start + len(opening))
        if end < 0:
            break
        out.append(text[at:start])
        at = end + len(closing)
    out.append(text[at:])
    return "".join(out)


def _atx_text(body: str) -> str:
    """An ATX heading's text without its closing sequence (blanks, then #s) and trailing blanks."""
    text = body.rstrip(" \t")
    bare = text.rstrip("#")
    return bare.rstrip(" \t") if bare != text and bare[-1:] in (" ", "\t") else text


def code_spans(text: str) -> list[tuple[str, bool]]:
    """`text` cut into (piece, is a code span) in order, by CommonMark's rule: a run of n backticks
    opens a span that the next run of exactly n closes; a run no such run follows is literal text.
    Runs are found once and matched by length (bisect), so a line of many unmatched runs stays
    linear-logarithmic."""
    if "`" not in text:
        return [(text, False)]
    runs = [(m.start(), m.end()) for m in _BACKTICK_RUN.finditer(text)]
    by_length: dict[int, list[int]] = {}
    for i, (start, end) in enumerate(runs):
        by_length.setdefault(end - start, []).append(i)
    pieces: list[tuple[str, bool]] = []
    at, i = 0, 0
    while i < len(runs):
        start, end = runs[i]
        same = by_length[end - start]
        j = bisect.bisect_right(same, i)
        if j == len(same):
            i += 1
            continue
        close = runs[same[j]]
        if start > at:
            pieces.append((text[at:start], False))
        pieces.append((text[start:close[1]], True))
        at, i = close[1], same[j] + 1
    if at < len(text):
        pieces.append((text[at:], False))
    return pieces


def markup_inline(text: str) -> str:
    """A piece of Markdown or MDX text as embedded: comments out, HTML and JSX tags reduced to
    their shown attribute values, character references decoded (&nbsp; &#x7B;: generated
    reference pages are full of them), URL payloads shortened. Code spans stay as written:
    `<Aside>` in backticks is a name the page shows, not a tag."""
    return searchable_text("".join(piece if code else _markup_prose(piece) for piece, code in code_spans(text)))


# A container fence (Docusaurus and Starlight admonitions, VitePress custom containers):
# `:::note`, `::: tip Title`, `:::caution[Title]{icon="x"}`, `:::`. Its kind and attributes are
# not text the page shows (the box's label and title are); mkdocstrings' `::: package.module` is
# not one, and stays as written.
_CONTAINER = re.compile(r"[ \t]*(?:>[ \t]*)*:{3,}[ \t]*(?:([A-Za-z][\w-]*)(?=[\s\[{]|$))?[ \t]*"
                        r"(?:\[([^\]]*)\])?[ \t]*(?:\{[^}]*\})?[ \t]*(.*)")  # (the title's end blanks: stripped)
_CONTAINER_LABELS = {kind: kind.capitalize() + ":" for kind in (
    "note", "tip", "info", "warning", "danger", "caution", "important", "details", "success", "question")}
_ALERT = re.compile(r"[ \t]*>[ \t]*\[!(NOTE|TIP|IMPORTANT|WARNING|CAUTION)\][ \t]*$", re.IGNORECASE)


def container_line(line: str) -> str:
    """A line of Markdown or MDX text outside code as embedded: a container fence becomes its
    title or its kind's label (`::: tip Title` "Title", `:::note` "Note:"), a GitHub alert
    (`> [!NOTE]`) its label; any other line its inline markup reduced (markup_inline)."""
    if ":::" in line and (fence := _CONTAINER.fullmatch(line)) is not None \
            and (fence.group(1) or fence.group(2) is not None or not fence.group(3).strip(" \t")):
        kind, bracketed, rest = fence.groups()
        title = bracketed if bracketed is not None else rest.rstrip(" \t")
        if title:
            return markup_inline(title)
        return _CONTAINER_LABELS.get((kind or "").lower(), "")
    if "[!" in line and (alert := _ALERT.fullmatch(line)) is not None:
        return alert.group(1).capitalize() + ":"
    return markup_inline(line)


# An inline link, `[text](destination "title")`, whose destination may hold one level of parentheses
_INLINE_LINK = re.compile(r"\[([^\[\]]*)\]\((?:<[^<>\n]*>|[^()\s]*(?:\([^()\s]*\)[^()\s]*)*)(?:\s+\"[^\"]*\")?\)")


def markup_heading(text: str) -> str:
    """A Markdown or MDX heading's text as cited: its attribute list out, links reduced to their
    text (a heading path is no place for a URL), then its inline markup (markup_inline)."""
    text = _without_anchor_suffix(text)
    if "](" in text:
        text = _INLINE_LINK.sub(r"\1", text)
    return markup_inline(text).strip()


def _markup_prose(text: str) -> str:
    """markup_inline of text outside code spans."""
    return html_text(_without_spans(text, "{/*", "*/}"), _markdown_unescaped)


def _markdown_unescaped(text: str) -> str:
    return _MARKDOWN_ESCAPE.sub(r"\1", text) if "\\" in text else text


def html_text(text: str, unescaped: Callable[[str], str] | None = None) -> str:
    """HTML (or JSX) as its page shows it: comments out, tags reduced to their shown attribute
    values, then a format's own escapes resolved (`unescaped`), character references decoded."""
    text = _without_spans(text, "<!--", "-->")
    if "<" in text:
        text = _JSX_TAG.sub(lambda tag: _tag_in_text(text, tag), text)
    if unescaped is not None:
        text = unescaped(text)
    if "&" in text:
        text = html.unescape(text).replace("\xa0", " ")
    return text


@dataclass
class _MdxState:
    """Where a line of MDX stands, carried from line to line."""

    fence: str | None = None  # the open fence's marker
    transparent: str | None = None  # an open ```mdx-code-block fence's marker: Docusaurus reads its content as MDX
    comment: str | None = None  # the open comment's closing marker ("*/}" or "-->")
    tag: bool = False  # inside a JSX tag whose attributes span lines
    esm: bool = False  # inside an import/export statement (it runs to a blank line)


def _closes(fence: re.Match[str], opening: str) -> bool:
    """Whether a fence line closes the fence `opening` opened: the same character, at least as
    many, nothing after them."""
    return fence.group(1)[0] == opening[0] and len(fence.group(1)) >= len(opening) and not fence.group(2).strip()


def _mdx_line(line: str, state: _MdxState) -> tuple[str, bool, BodyHeading | None]:
    """(searchable text, starts a block, heading) of one line; updates `state`."""
    stripped = line.strip()
    if state.fence is not None:
        closing = _MDX_FENCE.match(line)
        if closing and _closes(closing, state.fence):
            state.fence = None
        return searchable_text(line), False, None
    if state.comment is not None:
        if state.comment in line:
            rest = line.split(state.comment, 1)[1]
            state.comment = None
            return container_line(rest), False, None
        return "", False, None
    if state.tag:  # until its end, or a blank line (an expression never closed must not swallow the page)
        state.tag = bool(stripped) and _TAG_END.search(line) is None
        return _jsx_tag_text(line), False, None
    if not stripped:
        state.esm = False
        return "", False, None
    if state.esm:
        return "", False, None
    fence = _MDX_FENCE.match(line)
    if fence and state.transparent is not None and _closes(fence, state.transparent):
        state.transparent = None
        return "", False, None
    if fence and not ("`" in fence.group(2) and fence.group(1)[0] == "`"):
        if fence.group(2).strip() == "mdx-code-block" and state.transparent is None:
            state.transparent = fence.group(1)
            return "", True, None
        state.fence = fence.group(1)
        return searchable_text(line), True, None
    if _MDX_ESM.match(line):
        state.esm = True
        return "", True, None
    for opening, closing in (("{/*", "*/}"), ("<!--", "-->")):
        at = line.rfind(opening)
        if at >= 0 and closing not in line[at:]:
            state.comment = closing
            return container_line(line[:at]), True, None
    atx = _MDX_ATX.match(line)
    if atx:
        text = metadata_text(nfc(markup_heading(_atx_text(atx.group(2) or ""))))
        return text, True, BodyHeading(0, 0, len(atx.group(1)), text)
    opened = _open_tag_at(line)
    if opened is not None:
        state.tag = True  # a tag whose attributes go on over the next lines
        return container_line(line[:opened]) + " " + _jsx_tag_text(line[opened:]), True, None
    return container_line(line), stripped.startswith("<"), None


def _open_tag_at(line: str) -> int | None:
    """Where a JSX tag starts that the line does not close (its attributes go on over the next
    lines), outside code spans; None when there is none."""
    at = 0
    for piece, code in code_spans(line):
        opened = None if code else _JSX_TAG_START.search(piece)
        if opened and _TAG_END.search(line, at + opened.end()) is None:
            return at + opened.start()
        at += len(piece)
    return None


def read_mdx(raw: bytes, path: str) -> DocumentText:
    """MDX: YAML frontmatter (its `title` is the page title), headings as in Markdown; import and
    export statements and comments are no content; JSX tags are reduced to the text a reader of
    the page sees (`<Tab title="Python">` keeps "Python"), their children stay text; code stays code."""
    lines = split_lines(decode_text(raw, path))
    metadata, body_start = read_frontmatter(lines, path)
    searchable: list[str] = [""] * (body_start - 1)
    headings: list[Heading] = []
    starts: list[int] = []
    state = _MdxState()
    previous_blank = True
    for number in range(body_start, len(lines) + 1):
        line = lines[number - 1]
        inside = state.fence is not None or state.comment is not None or state.tag or state.esm
        text, block, heading = _mdx_line(line, state)
        searchable.append(text)
        if heading is not None:
            headings.append(Heading(number, heading.level, heading.text))
        if block or (previous_blank and line.strip() and not inside):
            starts.append(number)
        previous_blank = not line.strip()
    return DocumentText(lines=tuple(lines), searchable=tuple(searchable), body_start=body_start,
                        headings=tuple(headings), block_starts=tuple(sorted(set(starts))), metadata=metadata,
                        title=_first_h1(headings))


def read_plain_text(raw: bytes, path: str) -> DocumentText:
    """Plain text: paragraphs (blocks at blank lines), no headings; the title is its first line."""
    lines = split_lines(decode_text(raw, path))
    starts = [n for n in range(1, len(lines) + 1) if lines[n - 1].strip() and (n == 1 or not lines[n - 2].strip())]
    first = next((line for line in lines if line.strip()), None)
    return DocumentText(lines=tuple(lines), searchable=tuple(searchable_text(line) for line in lines), body_start=1,
                        headings=(), block_starts=tuple(starts),
                        title=metadata_text(nfc(first)) if first is not None else None)


# ---------------------------------------------------------------------------
# reStructuredText (Sphinx). Read line by line, in one pass with an explicit stack of open blocks (no
# recursion however deep directives nest); inline markup is matched against end positions found once
# per line, so an unbalanced backtick costs a bisection, not a rescan. Unknown directives and roles
# are read by their shape: nothing of Sphinx is imported, nothing is included.
#
# Titles and blocks.

ADORNMENT_CHARS = "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"
_ADORNMENT_SET = frozenset(ADORNMENT_CHARS)
_ADORNMENT = re.compile(r"([" + re.escape(ADORNMENT_CHARS) + r"])\1*[ \t]*")
_EXPLICIT = re.compile(r"[ \t]*\.\.(?:[ \t]|$)")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" \t"))


def _is_adornment(line: str) -> bool:
    return line[:1] in _ADORNMENT_SET and _ADORNMENT.fullmatch(line) is not None


def _opens_block(line: str) -> bool:
    """The deeper-indented lines after this one are a literal or explicit-markup block."""
    return _EXPLICIT.match(line) is not None or line.rstrip().endswith("::")


def _blocked(lines: Sequence[str], blank: Sequence[bool]) -> list[bool]:
    """Per line: inside a literal or explicit-markup block (the opening line itself is not).

    A block runs over the following lines that are blank or indented deeper than its opening line;
    its trailing blank lines are not part of it.
    """
    blocked = [False] * len(lines)
    n = 0
    while n < len(lines):
        if blank[n] or not _opens_block(lines[n]):
            n += 1
            continue
        base = _indent(lines[n])
        k = n + 1
        while k < len(lines) and (blank[k] or _indent(lines[k]) > base):
            blocked[k] = True
            k += 1
        j = k - 1
        while j > n and blank[j]:
            blocked[j] = False
            j -= 1
        n = k
    return blocked


@dataclass(frozen=True)
class _Title:
    row: int  # 0-based index of the title text line
    overlined: bool
    char: str


def _find_titles(lines: Sequence[str], blank: Sequence[bool], blocked: Sequence[bool]) -> list[_Title]:
    # Each line is judged on its own: a title's underline is an adornment line, never a title itself.
    titles = []
    for n, under in enumerate(lines[1:]):
        if under[:1] not in _ADORNMENT_SET or not _is_adornment(under):  # the cheap test first: most lines fail it
            continue
        text = lines[n]
        if blocked[n] or blocked[n + 1] or blank[n] or _is_adornment(text):
            continue
        char, length = under[0], len(under.rstrip())
        over = lines[n - 1] if n >= 1 and not blocked[n - 1] else ""
        overlined = _is_adornment(over) and over[0] == char and len(over.rstrip()) == length
        first = n - 1 if overlined else n
        starts_paragraph = first == 0 or blank[first - 1]
        if length >= len(text.rstrip()) and starts_paragraph and (overlined or _indent(text) == 0):
            titles.append(_Title(n, overlined, char))
    return titles


def _headings(lines: Sequence[str], titles: Sequence[_Title]) -> tuple[Heading, ...]:
    levels: dict[tuple[str, bool], int] = {}
    headings = []
    for title in titles:
        level = levels.setdefault((title.char, title.overlined), len(levels) + 1)
        text = metadata_text(nfc(rst_inline(lines[title.row].strip())))
        headings.append(Heading(line=title.row + 1, level=level, text=text))
    return tuple(headings)


# ---------------------------------------------------------------------------
# Inline markup: roles, literals, emphasis, references, substitutions reduced to their text.

# docutils' recognition rules: a start-string follows whitespace, an opening bracket or quote or a
# delimiter, and is followed by non-whitespace; an end-string follows non-whitespace and is followed
# by whitespace, a closing bracket or quote or punctuation.
_START_AFTER = frozenset("-/:\"'<([{")
_END_BEFORE = frozenset("-/:\\.,;!?\"')>]}")
_CLOSER = {"(": ")", "[": "]", "{": "}", "<": ">", '"': '"', "'": "'"}
_START_CATEGORIES = frozenset({"Ps", "Pi", "Pf", "Pd", "Po"})
_END_CATEGORIES = frozenset({"Pe", "Pi", "Pf", "Pd", "Po"})

# docutils' simple name, always the whole run: the lookahead keeps a shorter one from matching (what
# a possessive quantifier would do; Python 3.11.0-3.11.2 match possessive groups wrongly).
_NAME = r"[^\W_]+(?:[-._+:][^\W_]+)*(?![^\W_]|[-._+:][^\W_])"
_CANDIDATE = re.compile(r"\\.|``|\*\*|\*|_`|`|\||\[|:(?=[^\W_])", re.DOTALL)
_ROLE_NAME = re.compile(":(" + _NAME + ")")
_END_SUFFIX = re.compile("(:" + _NAME + ":)?(__?)?")  # after an interpreted text's closing backtick
_FOOTNOTE_REF = re.compile(r"\[(?:#(?:" + _NAME + r")?|\*|" + _NAME + r")\]_")
# A simple reference `word_`: only from the start of a name (a start inside one would rescan it).
_SIMPLE_REF = re.compile(r"(?<![^\s\-:/'\"<(\[{])(?<![^\W_][-._+:])(" + _NAME + r")__?(?=[\s\\.,;!?\-/:'\")\]}>]|$)")
_ESCAPE = re.compile(r"\\(.)", re.DOTALL)
_MARKUP_CHAR = re.compile(r"[\\`*|\[:_]")


def _may_start(text: str, at: int, after: int) -> bool:
    """Can the start-string text[at:after] open inline markup here?"""
    if after >= len(text) or text[after].isspace():
        return False
    if at == 0:
        return True
    before = text[at - 1]
    if before.isspace():
        return True
    if before in _CLOSER:
        return _CLOSER[before] != text[after]  # '(*)' is not emphasis
    return before in _START_AFTER or (not before.isascii() and unicodedata.category(before) in _START_CATEGORIES)


def _may_end(text: str, after: int) -> bool:
    """Can inline markup end just before text[after]?"""
    if after >= len(text):
        return True
    follower = text[after]
    return (follower.isspace() or follower in _END_BEFORE
            or (not follower.isascii() and unicodedata.category(follower) in _END_CATEGORIES))


def _unescape(text: str) -> str:
    return _ESCAPE.sub(lambda m: "" if m.group(1).isspace() else m.group(1), text) if "\\" in text else text


def _explicit_target(content: str) -> tuple[str, str] | None:
    """`title <target>` -> (title, target); None without an embedded target."""
    if not content.endswith(">"):
        return None
    opening = content.rfind("<")
    if opening < 0 or (opening > 0 and not content[opening - 1].isspace()):
        return None
    return content[:opening].strip(), content[opening + 1:-1].strip()


def _role_text(content: str) -> str:
    """A role's text as shown: `~a.b` and `!a` lose the marker, `title <target>` shows the title."""
    if content[:1] in ("~", "!"):
        content = content[1:]
    titled = _explicit_target(content)
    return _unescape((titled[0] or titled[1]) if titled else content)


def _reference_text(content: str) -> str:
    """A hyperlink reference's text: its link text and, when it embeds one, the URL (links name things)."""
    titled = _explicit_target(content)
    if titled is None:
        return _unescape(content)
    text, target = titled
    if target.endswith("_"):  # an alias of a named target, not a URL
        return _unescape(text)
    return f"{_unescape(text)} {target}".strip()


@dataclass(frozen=True)
class _BacktickEnd:
    at: int  # the closing backtick
    role: bool  # a role is written after it (`text`:role:)
    reference: bool  # `text`_ or `text`__
    after: int  # just past the end-string and its suffix


def _past_underscores(text: str, at: int) -> int:
    """Past the `_` or `__` that makes a reference of what ends before `at` (`|sub|_`, `word__`)."""
    return at + 2 if text.startswith("__", at) else at + 1 if text.startswith("_", at) else at


class _Ends:
    """Where each kind of end-string may close, found once per text (sorted), so that an unmatched
    start-string costs a bisection instead of a scan to the end of the text."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.escaped = {m.start() + 1 for m in _ESCAPE.finditer(text)} if "\\" in text else set()
        self.spots: dict[str, list[int]] = {}
        self.backticks: dict[int, _BacktickEnd] = {}

    def _find(self, mark: str) -> list[int]:
        text, width = self.text, len(mark)
        found = []
        for m in re.finditer(r"(?<=\S)(?=" + re.escape(mark) + ")", text):
            at = m.start()
            if mark == "``":  # backslashes are literal inside a literal
                closes = _may_end(text, at + width)
            elif mark == "`":
                suffix = _END_SUFFIX.match(text, at + 1)
                closes = at not in self.escaped and suffix is not None and _may_end(text, suffix.end())
                if closes:
                    self.backticks[at] = _BacktickEnd(at, bool(suffix.group(1)), bool(suffix.group(2)), suffix.end())
            elif mark == "|":
                closes = at not in self.escaped and _may_end(text, _past_underscores(text, at + 1))
            else:
                closes = at not in self.escaped and _may_end(text, at + width)
            if closes:
                found.append(at)
        return found

    def first(self, mark: str, after: int) -> int | None:
        """The first end-string `mark` past position `after` (so the content is never empty)."""
        if mark not in self.spots:
            self.spots[mark] = self._find(mark)
        spots = self.spots[mark]
        k = bisect.bisect_right(spots, after)
        return spots[k] if k < len(spots) else None

    def first_backtick(self, after: int) -> _BacktickEnd | None:
        at = self.first("`", after)
        return self.backticks[at] if at is not None else None


def _plain(text: str) -> str:
    """Text between markup: simple references `word_` lose their underscore."""
    return _SIMPLE_REF.sub(r"\1", text) if "_" in text else text


def rst_inline(text: str) -> str:
    """Inline markup of one line (or a fragment of one) reduced to the text a reader sees.

    Roles keep their text (`:meth:`~a.B.c`` -> a.B.c, `:ref:`text <t>`` -> text), literals, emphasis,
    interpreted text and substitutions their content, hyperlink references their text and embedded
    URL; footnote references go; escapes are resolved. What does not parse stays as written.
    """
    if _MARKUP_CHAR.search(text) is None:
        return text
    ends = _Ends(text)
    out: list[str] = []
    cursor = scan = 0  # text[cursor:scan] is plain text not yet written; scan is where to look next
    while (found := _CANDIDATE.search(text, scan)) is not None:
        at, mark = found.start(), found.group()
        reduced = _reduce_at(text, at, mark, ends)
        if reduced is None:  # not markup here: stays plain, look past it
            scan = _skip_plain(text, at, mark)
            continue
        shown, scan = reduced
        out.append(_plain(text[cursor:at]))
        out.append(shown)
        # Line breaks the markup spanned stay (after what it shows): a paragraph's lines keep their places.
        out.append("\n" * (text.count("\n", at, scan) - shown.count("\n")))
        cursor = scan
    out.append(_plain(text[cursor:]))
    return "".join(out)


def _skip_plain(text: str, at: int, mark: str) -> int:
    if mark == ":":  # past the whole name chain: every colon in it would fail the same way
        chain = _ROLE_NAME.match(text, at)
        return chain.end() if chain else at + 1
    return at + len(mark)


def _reduce_at(text: str, at: int, mark: str, ends: _Ends) -> tuple[str, int] | None:
    """The markup starting at text[at] (the candidate `mark`): its text and the position past it."""
    if mark.startswith("\\"):
        return ("" if mark[1].isspace() else mark[1]), at + 2
    return _REDUCERS[mark](text, at, ends)


def _literal(text: str, at: int, ends: _Ends) -> tuple[str, int] | None:
    close = ends.first("``", at + 2) if _may_start(text, at, at + 2) else None
    return (text[at + 2:close], close + 2) if close is not None else None


def _emphasis(mark: str) -> Callable[[str, int, _Ends], tuple[str, int] | None]:
    def reduce(text: str, at: int, ends: _Ends) -> tuple[str, int] | None:
        width = len(mark)
        close = ends.first(mark, at + width) if _may_start(text, at, at + width) else None
        return (_unescape(text[at + width:close]), close + width) if close is not None else None
    return reduce


def _substitution(text: str, at: int, ends: _Ends) -> tuple[str, int] | None:
    close = ends.first("|", at + 1) if _may_start(text, at, at + 1) else None
    return (_unescape(text[at + 1:close]), _past_underscores(text, close + 1)) if close is not None else None


def _backticked(text: str, at: int, ends: _Ends, opening: int, role: bool) -> tuple[str, int] | None:
    """`text`, `text`:role:, `text`_, `text <url>`_ with the backtick at `opening`; the markup starts
    at `at` (a role before it, `:role:`text``, or the `_` of an inline target, `_`text``)."""
    if text.startswith("``", opening) or not _may_start(text, at, opening + 1):
        return None
    end = ends.first_backtick(opening + 1)
    if end is None:
        return None
    content = text[opening + 1:end.at]
    if end.reference and not role and not end.role:
        return _reference_text(content), end.after
    return _role_text(content), end.after


def _interpreted(text: str, at: int, ends: _Ends) -> tuple[str, int] | None:
    return _backticked(text, at, ends, opening=at, role=False)


def _role(text: str, at: int, ends: _Ends) -> tuple[str, int] | None:
    name = _ROLE_NAME.match(text, at)
    if name is None or not text.startswith(":`", name.end()):
        return None
    reduced = _backticked(text, at, ends, opening=name.end() + 1, role=True)
    numbered = _NUMBERED_ROLES.get(name.group().strip(":").rsplit(":", 1)[-1].lower())
    if reduced is not None and numbered and reduced[0][:1].isdigit():  # :pep:`8` shows "PEP 8"
        return f"{numbered} {reduced[0]}", reduced[1]
    return reduced


def _internal_target(text: str, at: int, ends: _Ends) -> tuple[str, int] | None:
    return _backticked(text, at, ends, opening=at + 1, role=True)


def _footnote_reference(text: str, at: int, ends: _Ends) -> tuple[str, int] | None:
    found = _FOOTNOTE_REF.match(text, at)
    if found is None or not _may_start(text, at, at + 1) or not _may_end(text, found.end()):
        return None
    return "", found.end()


_NUMBERED_ROLES = {"pep": "PEP", "rfc": "RFC"}  # roles whose bare number the page shows after a name
_REDUCERS: dict[str, Callable[[str, int, _Ends], tuple[str, int] | None]] = {
    "``": _literal, "**": _emphasis("**"), "*": _emphasis("*"), "_`": _internal_target, "`": _interpreted,
    "|": _substitution, "[": _footnote_reference, ":": _role,
}

# ---------------------------------------------------------------------------
# Lines of text: paragraphs, list items, tables, field lists.

_LIST_ITEM = re.compile(r"[ \t]*(?:[-*+\u2022\u2023\u2043]|\(?(?:[0-9]+|[A-Za-z#]|[ivxlcdmIVXLCDM]+)[.)])"
                        r"(?:[ \t]|$)")
_TABLE_BORDER = re.compile(r"[ \t]*(?:(?:=+[ \t]+)+=+|\+(?:[-=]+\+)+)[ \t]*")
_OPTION_TITLES = frozenset({"caption", "title", "header"})  # options whose value the page shows as written
# An object description's options the page shows, with the label it shows them under (Sphinx's
# confval: "Type: str", "Default: 'x'"; an attribute's type and value).
_OBJECT_OPTIONS = {"type": "Type:", "default": "Default:", "value": "Value:"}
_FIELD_NAME_END = re.compile(r":(?=[ \t`]|$)")  # a colon inside a name is followed by anything else


def _field(text: str) -> tuple[str, str] | None:
    """`:name: body` -> (name, body); None when the text is not a field (`:role:`x`` is not)."""
    if len(text) < 3 or text[0] != ":" or text[1] in ": \t":
        return None
    end = _FIELD_NAME_END.search(text, 1)
    if end is None or text.startswith("`", end.end()) or text[end.start() - 1].isspace():
        return None
    return text[1:end.start()], text[end.end():].strip()


def _is_punctuation_rule(stripped: str) -> bool:
    """A transition, a stray underline, a table border: punctuation only, no content."""
    return (len(stripped) >= 4 and _is_adornment(stripped)) or _TABLE_BORDER.fullmatch(stripped) is not None


def _without_literal_marker(line: str) -> str:
    """`Run this::` reads `Run this:`; `Run this ::` and a lone `::` lose the marker (as docutils shows them)."""
    head = line.rstrip()[:-2]
    if not head.strip():
        return ""
    return head.rstrip() if head[-1].isspace() else head + ":"


def _text_line(line: str) -> str:
    stripped = line.strip()
    if not stripped:
        return ""
    if stripped[0] in _ADORNMENT_SET:  # rules, anonymous targets `__ url` and fields all start so
        if _is_punctuation_rule(stripped) or stripped.startswith("__ "):
            return ""
        field = _field(stripped)
        if field is not None:
            return f"{rst_inline(field[0])}: {rst_inline(field[1])}".rstrip()
    return rst_inline(_paragraph_text(line))


def _paragraph_text(line: str) -> str:
    """A line of a paragraph (or a list item's) as its inline markup is read: a literal block's
    `::` marker shown as docutils shows it."""
    return _without_literal_marker(line) if line.rstrip().endswith("::") else line


def _is_paragraph_line(line: str) -> bool:
    """A non-blank line _text_line reads as paragraph text (not a rule, an anonymous target, a field,
    nor a table row or line block, `|` first: read a line, or a row, at a time)."""
    stripped = line.strip()
    return bool(stripped) and not (stripped[0] in _ADORNMENT_SET and (
        stripped[0] == "|" or _is_punctuation_rule(stripped) or stripped.startswith("__ ")
        or _field(stripped) is not None))


def _text_column(line: str) -> int:
    """Where a paragraph line's text starts: past a list item's marker, else its indentation."""
    item = _LIST_ITEM.match(line)
    if item is None:
        return _indent(line)
    rest = line[item.end():]
    return item.end() + len(rest) - len(rest.lstrip(" \t")) if rest.strip() else item.end()


_UNCLOSED_MARK = re.compile(r"[`*|\[]")
_GRID_BORDER = re.compile(r"[ \t]*\+(?:[-=]+\+)+[ \t]*")


def _read_grid_tables(lines: Sequence[str], read_as_text: Sequence[bool], searchable: list[str]) -> list[int]:
    """Grid tables (`+----+----+` borders, `|` between cells) read a row at a time: each cell's text
    joined over the row's lines, the cells in order on the row's first line, its other lines no
    content. Read a line at a time, a cell's sentence was spread over its rows between the other
    columns and the pipes: `| version | The version number of the | a string |`. Returns the rows'
    first lines: where a long table may be cut."""
    rows: list[int] = []
    n = 0
    while n < len(lines):
        if not (read_as_text[n] and _GRID_BORDER.fullmatch(lines[n])):
            n += 1
            continue
        edges = [k for k, char in enumerate(lines[n]) if char == "+"]
        row: list[int] = []
        n += 1
        while n < len(lines) and read_as_text[n] and lines[n][edges[0]:edges[0] + 1] in ("+", "|"):
            if _GRID_BORDER.fullmatch(lines[n]):
                rows += _grid_row(lines, row, edges, searchable)
                row = []
            else:
                row.append(n)
            n += 1
        rows += _grid_row(lines, row, edges, searchable)
    return rows


def _grid_row(lines: Sequence[str], row: Sequence[int], edges: Sequence[int], searchable: list[str]) -> list[int]:
    if not row:
        return []
    cells = [" ".join(filter(None, (lines[n][start + 1:end].strip(" \t|") for n in row)))
             for start, end in itertools.pairwise(edges)]
    searchable[row[0]] = rst_inline(" | ".join(filter(None, cells)))
    for n in row[1:]:
        searchable[n] = ""
    return [row[0]]


def _reduce_paragraphs(lines: Sequence[str], paragraph: Sequence[bool], searchable: list[str]) -> None:
    """Inline markup across the lines of each paragraph, as docutils reads it: prose wrapped at 79
    columns splits roles, links and literals between lines (`:meth:`Request.prepare()` on one,
    `<requests.Request.prepare>` on the next), which a line at a time leaves as written. A line
    continues the paragraph of the line above when both are paragraph text and it starts where
    that one's text starts, not as a new list item. Each line keeps what its own text shows."""
    n = 0
    while n < len(lines):
        end = n + 1
        if paragraph[n]:
            column = _text_column(lines[n])
            while end < len(lines) and paragraph[end] and _indent(lines[end]) == column \
                    and _LIST_ITEM.match(lines[end]) is None:
                end += 1
        # Markup split between lines leaves its opening mark in a line's own reading; without one,
        # the paragraph reads as its lines did.
        if end - n > 1 and any(_UNCLOSED_MARK.search(searchable[k]) for k in range(n, end)):
            searchable[n:end] = rst_inline("\n".join(_paragraph_text(line) for line in lines[n:end])).split("\n")
        n = end


def _verbatim(line: str) -> str:
    return line if line.strip() else ""


# ---------------------------------------------------------------------------
# Explicit markup: directives, comments, targets, substitution definitions, footnotes.

_DIRECTIVE = re.compile(r"([A-Za-z0-9][\w.:+-]*?) ?::(?:[ \t]+|$)")

_CODE, _DROP, _TEXT, _SIGNATURE, _HTML = "code", "drop", "text", "signature", "html"  # how a block's lines are read

_CODE_DIRECTIVES = frozenset({"code-block", "code", "sourcecode", "code-tab", "doctest", "testcode", "testoutput",
                              "testsetup", "testcleanup", "parsed-literal", "math", "productionlist"})
_INCLUDES = frozenset({"include", "literalinclude"})
# Navigation and context settings: neither the line nor the body is content.
_DROPPED_DIRECTIVES = _INCLUDES | {
    "toctree", "currentmodule", "module", "py:module", "py:currentmodule", "highlight", "default-domain", "index",
    "rst-class", "default-role", "role", "contents", "sectnum", "tabularcolumns", "meta"}
_CONDITIONS = frozenset({"only", "ifconfig"})  # the line is a condition; the body is content
_IMAGES = frozenset({"image", "figure"})
_ADMONITIONS = {"note": "Note:", "warning": "Warning:", "tip": "Tip:", "important": "Important:", "caution": "Caution:",
                "danger": "Danger:", "attention": "Attention:", "hint": "Hint:", "error": "Error:",
                "seealso": "See also:", "todo": "Todo:"}
_VERSIONS = {"versionadded": "New in version", "versionchanged": "Changed in version",
             "deprecated": "Deprecated since version", "versionremoved": "Removed in version",
             # Sphinx 7.3's names for the same four (it renders "Added in version"), and CPython's
             "version-added": "Added in version", "version-changed": "Changed in version",
             "version-deprecated": "Deprecated since version", "version-removed": "Removed in version",
             "deprecated-removed": "Deprecated since version"}
_OBJECTS = frozenset({"function", "class", "method", "attribute", "data", "exception", "decorator", "decoratormethod",
                      "classmethod", "staticmethod", "property", "type", "confval", "option", "cmdoption", "envvar",
                      "describe", "object", "program", "event", "setting"})


@dataclass
class _Block:
    """An open literal or explicit-markup block: the lines indented deeper than `base`."""

    base: int
    head: str  # how lines before its first blank line are read (a directive's arguments, options)
    body: str  # how the rest is read
    options: bool = False  # field lines in the head are directive options
    outermost: bool = False  # opened at the top level of the document: its first content line starts a block
    in_head: bool = True
    started: bool = False  # its first content line has been seen


def _is_object(name: str) -> bool:
    """A Sphinx object description (`function`, `py:data`, `autoclass`, any `domain:name`)."""
    return name in _OBJECTS or name.startswith("auto") or ":" in name


def _directive(name: str, argument: str, base: int) -> tuple[str, _Block]:
    """A directive line's searchable text and the block its options and body make."""
    if name in _CODE_DIRECTIVES:
        return "", _Block(base, _CODE, _CODE, options=True)
    if name in _DROPPED_DIRECTIVES:
        return "", _Block(base, _DROP, _DROP)
    if name in _CONDITIONS:
        return "", _Block(base, _TEXT, _TEXT, options=True)
    if name in _IMAGES:
        return "", _Block(base, _DROP, _TEXT, options=True)
    if name == "raw":  # output for one writer: HTML's text is on the page, LaTeX's is not
        return "", _Block(base, _DROP, _HTML if argument.split()[:1] == ["html"] else _DROP, options=True)
    block = _Block(base, _TEXT, _TEXT, options=True)
    if name in _ADMONITIONS:
        return f"{_ADMONITIONS[name]} {rst_inline(argument)}".rstrip(), block
    if name in _VERSIONS:
        version, _, text = argument.partition(" ")
        shown = f"{_VERSIONS[name]} {version}:" if version else _VERSIONS[name]
        return f"{shown} {rst_inline(text.strip())}".rstrip(), block
    if _is_object(name):
        return argument, _Block(base, _SIGNATURE, _TEXT, options=True)
    return rst_inline(argument), block


def _explicit_parts(line: str) -> tuple[str, str, str]:
    """(kind, directive name, argument) of a line starting with `..`; kind is footnote, target
    (targets and substitution definitions), directive or comment."""
    rest = line[_indent(line) + 2:].strip()
    if rest[:1] == "[" and "]" in rest:
        return "footnote", "", rest[rest.index("]") + 1:].strip()
    if rest[:1] in ("_", "|"):
        return "target", "", ""
    directive = _DIRECTIVE.match(rest)
    if directive is not None:
        return "directive", directive.group(1).lower(), rest[directive.end():].strip()
    return "comment", "", rest


def _explicit(line: str, next_is_blank: bool) -> tuple[str, _Block | None]:
    """A line starting with `..`: its searchable text and the block it opens."""
    base = _indent(line)
    kind, name, argument = _explicit_parts(line)
    if kind == "footnote":
        return rst_inline(argument), _Block(base, _TEXT, _TEXT)
    if kind == "directive":
        return _directive(name, argument, base)
    if kind == "comment" and not argument and next_is_blank:  # an empty comment swallows nothing
        return "", None
    return "", _Block(base, _DROP, _DROP)


def _opened(line: str, next_is_blank: bool, outermost: bool) -> tuple[str, _Block | None]:
    """A line read as text, and the block it opens if it is explicit markup or ends with `::`."""
    if _EXPLICIT.match(line):
        shown, block = _explicit(line, next_is_blank)
    else:
        shown = _text_line(line)
        block = _Block(_indent(line), _CODE, _CODE) if line.rstrip().endswith("::") else None
    if block is not None:
        block.outermost = outermost
    return shown, block


def _block_line(block: _Block, line: str, next_is_blank: bool) -> tuple[str, bool, _Block | None]:
    """A line inside the innermost open block: its searchable text, whether it is content (not a
    directive option, not dropped), and the block it opens."""
    if block.in_head and block.options and (option := _field(line.strip())) is not None:
        return _option_text(option[0].lower(), option[1], block.head == _SIGNATURE), False, None
    how = block.head if block.in_head else block.body
    if how == _TEXT:
        shown, inner = _opened(line, next_is_blank, outermost=False)
        return shown, True, inner
    if how == _CODE:
        return _verbatim(line), True, None
    if how == _SIGNATURE:
        return line.strip(), True, None
    if how == _HTML:
        return html_text(line), True, None
    return "", False, None


def _option_text(name: str, value: str, of_object: bool) -> str:
    """What the page shows of a directive option: a title or caption as written, an object's type,
    default or value under its label; nothing of the rest (`:linenos:`, `:members:`)."""
    if name in _OPTION_TITLES:
        return rst_inline(value)
    if of_object and name in _OBJECT_OPTIONS:
        return f"{_OBJECT_OPTIONS[name]} {rst_inline(value)}".rstrip()
    return ""


# ---------------------------------------------------------------------------
# Docinfo: a field list before anything else.


def _skip_comments(lines: Sequence[str], blank: Sequence[bool]) -> int:
    """The first line that is neither blank nor part of a comment in column 0."""
    n = 0
    while n < len(lines):
        line = lines[n]
        if blank[n]:
            n += 1
        elif _EXPLICIT.match(line) and _indent(line) == 0 and _explicit_parts(line)[0] == "comment":
            n += 1
            while n < len(lines) and (blank[n] or _indent(lines[n]) > 0):
                n += 1
        else:
            return n
    return n


def _docinfo(lines: Sequence[str], blank: Sequence[bool], titled_rows: set[int]) -> tuple[dict[str, str], int]:
    """The leading field list's fields and the 0-based line where the body starts (0 without one)."""
    n = _skip_comments(lines, blank)
    metadata: dict[str, str] = {}
    while n < len(lines) and n not in titled_rows and _indent(lines[n]) == 0:
        field = _field(lines[n].strip())
        if field is None:
            break
        parts = [field[1]]
        n += 1
        while n < len(lines) and n not in titled_rows and not blank[n] and _indent(lines[n]) > 0:
            parts.append(lines[n].strip())
            n += 1
        metadata[field[0]] = " ".join(part for part in parts if part)
    if not metadata:
        return {}, 0
    return metadata, n + 1 if n < len(lines) and blank[n] else n


# ---------------------------------------------------------------------------
# The reader.


def _read_lines(lines: Sequence[str], blank: Sequence[bool], titles: Sequence[_Title]) -> tuple[list[str], list[int]]:
    """Every line's searchable text and the 0-based lines where blocks start, in one pass."""
    roles = {title.row: "title" for title in titles}
    for title in titles:
        roles[title.row + 1] = "adornment"
        if title.overlined:
            roles.setdefault(title.row - 1, "adornment")
    searchable = [""] * len(lines)
    paragraph = [False] * len(lines)  # read as paragraph text (see _reduce_paragraphs)
    read_as_text = [False] * len(lines)  # where a grid table would be read as text
    starts: list[int] = []
    stack: list[_Block] = []
    fresh = True  # the next top-level line starts a block (after a blank line, an underline, a block's end)
    for n, line in enumerate(lines):
        if blank[n]:
            if stack:
                stack[-1].in_head = False
            fresh = True
            continue
        if stack:
            indent = _indent(line)
            while stack and indent <= stack[-1].base:
                stack.pop()
                fresh = True
        next_is_blank = n + 1 >= len(lines) or blank[n + 1]
        if stack:
            block = stack[-1]
            read_as_text[n] = (block.head if block.in_head else block.body) == _TEXT
            searchable[n], content, inner = _block_line(block, line, next_is_blank)
            paragraph[n] = read_as_text[n] and content and not _EXPLICIT.match(line) and _is_paragraph_line(line)
            # Where a chunk may be cut inside a block: after a blank line, where its text goes on
            # (never between a directive's line and the body written right below it); a long
            # glossary or list-table was cut mid-sentence, only its first line being a start.
            if content and blank[n - 1] and (read_as_text[n] or (block.outermost and not block.started)):
                starts.append(n)
            block.started |= content
            if inner is not None:
                block.in_head = False
                stack.append(inner)
            continue
        role = roles.get(n)
        if role is None:
            shown, block_opened = _opened(line, next_is_blank, outermost=True)
            paragraph[n] = not _EXPLICIT.match(line) and _is_paragraph_line(line)
            read_as_text[n] = True
        else:  # a title's lines open blocks as any line does (the reference's rule), but read as a title
            shown = rst_inline(line.strip()) if role == "title" else ""
            block_opened = _opened(line, next_is_blank, outermost=True)[1] if _opens_block(line) else None
        if role == "title" or (role is None and (fresh or _EXPLICIT.match(line) or _LIST_ITEM.match(line))):
            starts.append(n)
        searchable[n] = shown
        fresh = role == "adornment" and roles.get(n - 1) == "title"  # a paragraph may follow an underline
        if block_opened is not None:
            stack.append(block_opened)
    _reduce_paragraphs(lines, paragraph, searchable)
    starts += _read_grid_tables(lines, read_as_text, searchable)
    return searchable, starts


def _include_warnings(lines: Sequence[str]) -> tuple[str, ...]:
    rows = [n + 1 for n, line in enumerate(lines) if "include" in line and _EXPLICIT.match(line)
            and (parts := _explicit_parts(line))[0] == "directive" and parts[1] in _INCLUDES]
    if not rows:
        return ()
    return (f"{len(rows)} include/literalinclude directive(s) not followed (first at line {rows[0]}): "
            "the included text is not indexed",)


def read_rst(raw: bytes, path: str) -> DocumentText:
    """reStructuredText (Sphinx): sections by their underlines (and overlines), levels in the order
    the adornment styles first appear, never inside literal or explicit-markup blocks; directives
    keep their content as text or code, navigation (toctree, targets, comments, substitution
    definitions) is no content; roles become their text. A field list at the very top (docinfo,
    `:lifecycle: superseded`) holds the document's keys; the title is the first section title."""
    lines = split_lines(decode_text(raw, path))
    blank = [not line.strip() for line in lines]
    titles = _find_titles(lines, blank, _blocked(lines, blank))
    headings = _headings(lines, titles)
    titled_rows = {row for title in titles for row in (title.row - title.overlined, title.row, title.row + 1)}
    metadata, body = _docinfo(lines, blank, titled_rows)
    searchable, starts = _read_lines(lines, blank, titles)
    searchable[:body] = [""] * body
    return DocumentText(lines=tuple(lines), searchable=tuple(map(searchable_text, searchable)), body_start=body + 1,
                        headings=headings, block_starts=tuple(sorted({n + 1 for n in starts if n >= body})),
                        metadata={name: field_value(value) for name, value in metadata.items()},
                        title=(headings[0].text or None) if headings else None,
                        warnings=tuple(f"{path}: {warning}" for warning in _include_warnings(lines)))


def rst_inline_searchable(text: str) -> str:
    """A piece of reStructuredText as embedded: its inline markup reduced, URL payloads shortened."""
    return searchable_text(rst_inline(text))


# AsciiDoc (Antora): Asciidoctor 2.0's rules, read line by line in one pass with an explicit stack
# (no recursion); every expression is anchored at one position or stops at its own delimiter.
# Nothing is followed or evaluated: include:: lines stay as written, conditionals are dropped but
# what they enclose is kept, attribute references ({name}) are not substituted.

# Asciidoctor drops trailing whitespace from every line before it parses (Ruby's rstrip).
_TRAILING_SPACE = " \t\v\f\r\x00"
ADMONITION_LABELS = {"NOTE": "Note", "TIP": "Tip", "IMPORTANT": "Important", "WARNING": "Warning",
                     "CAUTION": "Caution"}
DISCRETE_STYLES = ("discrete", "float")
MAX_SECTION_MARKS = 6  # "======" (level 5) is the deepest title

# ---------------------------------------------------------------------------
# Lines: what one line is, on its own.

# Delimiter tips (the first four characters, or "--", or "```") and what their block holds:
# compound blocks hold blocks; the others hold lines read one by one.
_BLOCK_MODELS = {"--": "compound", "====": "compound", "****": "compound", "____": "compound",
                 "----": "code", "....": "code", "```": "code", "++++": "pass", "////": "comment",
                 "|===": "table", "!===": "table", ",===": "table", ":===": "table"}
# A style above an open block (`--`) or a quote block (`____`) changes what it holds.
_STYLED_MODELS = {("--", "source"): "code", ("--", "listing"): "code", ("--", "literal"): "code",
                  ("--", "pass"): "pass", ("--", "comment"): "comment", ("--", "verse"): "verse",
                  ("____", "verse"): "verse"}
# A style above a paragraph that makes it something other than text.
_PARAGRAPH_MODELS = {"source": "code", "listing": "code", "literal": "code", "pass": "pass", "comment": "comment"}
_CONDITIONALS = ("ifdef::", "ifndef::", "ifeval::", "endif::")

_ATTRIBUTE_ENTRY = re.compile(r":(!?\w[^:]*):(?:[ \t]+(.*))?")
_INVALID_NAME_CHARS = re.compile(r"[^\w-]")
_ANCHOR_BODY = re.compile(r"(?:[^\W\d]|:)[\w:.-]*(?:, *.+)?")
_ATTRIBUTE_LIST_START = re.compile(r"[\w.#%{,\"']")
_STYLE_END = re.compile(r"[#.%]")
_BLOCK_MACRO = re.compile(r"(\w[\w-]*)::(|\S|\S.*?\S)\[(.*)\]")  # a target up to its first "[" after a non-space
_LAYOUT_BREAK = re.compile(r"'{3,}|<{3,}|([-*_])( *)\1\2\1")
_UNORDERED_ITEM = re.compile(r"[ \t]*(?:-|\*+|\u2022)[ \t]+(.*)")
_ORDERED_ITEM = re.compile(r"[ \t]*(?:\.+|\d+\.|[a-zA-Z]\.|[IVXivx]+\))[ \t]+(.*)")
_CALLOUT_ITEM = re.compile(r"<(?:\d+|\.)>[ \t]+(.*)")
_DESCRIPTION_ITEM = re.compile(r"[ \t]*([^ \t].*?)(?::{2,4}|;;)(?:[ \t]+(.*))?")
_ADMONITION = re.compile(r"(NOTE|TIP|IMPORTANT|WARNING|CAUTION):[ \t]+")
# Callouts at the end of a code line, read backwards ("x = 1 // <1> <2>" reversed starts with
# ">2< >1< //"): anchored at the line's end without searching from every position.
_REVERSED_CALLOUTS = re.compile(r"(?: ?>(?:--)?(?:[0-9]+|\.)(?:--)?!?<(?!\\))+(?: ?(?://|#|--|;;))?")
_CELL_SPEC = re.compile(r"(?:(?:\d+(?:\.\d*)?|(?:\d*\.)?\d+)[*+])?(?:[<^>](?:\.[<^>]?)?|(?:[<^>]?\.)?[<^>])?[a-z]?")
MAX_CELL_SPEC_CHARS = 16  # "2.3+^.^a" is 8: a longer word before a separator is text
_CELL_SEPARATORS = {sep: re.compile(rf"(?<!\\){re.escape(sep)}") for sep in "|!,:"}


def _is_comment_line(line: str) -> bool:
    # "//" starts a comment, "///" does not (Asciidoctor's CommentLineRx); "////" opens a block.
    return line.startswith("//") and line[2:3] != "/"


def _delimiter(line: str) -> str | None:
    """The tip of the delimited block this line opens or closes (Asciidoctor's is_delimited_block?):
    `--`, four or more of one character, a table's `|===`, or a fence of exactly three backticks
    with an optional language."""
    if line == "--":
        return line
    if line.startswith("```"):
        return "```" if line[3:4] != "`" else None
    tip = line[:4]
    if tip in _BLOCK_MODELS and not line[4:].strip(tip[-1]):
        return tip
    return None


def _terminator(line: str, tip: str) -> str:
    """The line that closes the block this line opens: the same line (a fence: three backticks)."""
    return "```" if tip == "```" else line


def _adoc_directive(line: str) -> str | None:
    """"include" or "conditional" for a preprocessor line (include::, ifdef::, ifndef::, ifeval::,
    endif::), which the block parser never sees; None otherwise."""
    if not line.endswith("]"):
        return None
    if line.startswith("include::"):
        target, bracket, _ = line[9:].partition("[")
        return "include" if bracket and target and target == target.strip() else None
    if line.startswith(_CONDITIONALS):
        target, bracket, _ = line.partition("::")[2].partition("[")
        return "conditional" if bracket and not any(c.isspace() for c in target) else None
    return None


def _is_block_attribute_line(line: str) -> bool:
    """`[source,python]`, `[NOTE]`, `[#id.role]`, `[[anchor]]`: metadata for the block below
    (Asciidoctor's BlockAttributeLineRx, which also ends a paragraph)."""
    if len(line) < 2 or line[0] != "[" or line[-1] != "]":
        return False
    if line.startswith("[["):
        return line.endswith("]]") and (len(line) == 4 or _ANCHOR_BODY.fullmatch(line, 2, len(line) - 2) is not None)
    return len(line) == 2 or _ATTRIBUTE_LIST_START.match(line, 1) is not None


def _block_style(line: str) -> str:
    """The style a block attribute line sets (its first positional attribute without #id, .role,
    %option): "source" for `[source,python]`, "NOTE" for `[NOTE]`, "" for `[#id]` or `[[id]]`."""
    if line.startswith("[["):
        return ""
    first = line[1:-1].split(",", 1)[0].strip()
    if first.startswith(('"', "'")) or "=" in first:
        return ""
    return _STYLE_END.split(first, maxsplit=1)[0]


def _section_title(line: str) -> tuple[int, str] | None:
    """(number of markers, title text) of an ATX title: `== Title`, `### Title`, a symmetric
    `== Title ==` (Asciidoctor's ExtAtxSectionTitleRx, Markdown `#` included)."""
    mark = line[:1]
    if mark not in ("=", "#"):
        return None
    marks = len(line) - len(line.lstrip(mark))
    if marks > MAX_SECTION_MARKS or line[marks:marks + 1] not in (" ", "\t"):
        return None
    text = line[marks:].strip(" \t")
    if len(text) > marks and text.endswith(mark * marks) and text[-marks - 1] in " \t":
        text = text[:-marks].rstrip(" \t")
    return marks, text


_SETEXT_LEVELS = {"=": 0, "-": 1, "~": 2, "^": 3, "+": 4}
_ALNUM = re.compile(r"[^\W_]")


def _setext_level(line: str, underline: str) -> int | None:
    """The level of a two-line title (Asciidoctor's setext_section_title?): a line not starting with
    "." that holds a letter or digit, underlined by one character of `= - ~ ^ +` repeated, the two
    no more than a character apart in length (git's manual pages are written so)."""
    if not underline or underline[0] not in _SETEXT_LEVELS or underline.count(underline[0]) != len(underline):
        return None
    if abs(len(line) - len(underline)) >= 2 or line.startswith(".") or not _ALNUM.search(line):
        return None
    return _SETEXT_LEVELS[underline[0]]


def _block_title(line: str) -> str | None:
    """The title of `.Title` (a dot, then a character that is neither a space nor a dot)."""
    if not line.startswith("."):
        return None
    rest = line[1:]
    first = rest[1:2] if rest.startswith(".") else rest[:1]
    return rest if first not in ("", " ", "\t", ".") else None


def _block_macro(line: str) -> str | None:
    """The searchable text of a block macro line (`image::a.png[Alt]` -> "Alt", `toc::[]` -> ""),
    None for any other line."""
    if not line.endswith("]") or "::" not in line or not (match := _BLOCK_MACRO.fullmatch(line)):
        return None
    return asciidoc_inline(_first_positional(match[3]) or _default_alt(match[2])) if match[1] == "image" else ""


def _list_item(line: str) -> str | None:
    """The searchable text of a list item line, its marker dropped (`* Item` -> "Item",
    `CPU:: the processor` -> "CPU: the processor"); None for any other line."""
    match = _UNORDERED_ITEM.fullmatch(line) or _ORDERED_ITEM.fullmatch(line) or _CALLOUT_ITEM.fullmatch(line)
    if match:
        return _text(match[1])
    if ("::" in line or ";;" in line) and (match := _DESCRIPTION_ITEM.fullmatch(line)):
        term, text = _text(match[1]), _text(match[2] or "")
        return f"{term}: {text}" if text else term
    return None


def _text(line: str) -> str:
    """An ordinary text line's searchable text (an escaped preprocessor line is shown as text)."""
    if line.startswith("\\") and _adoc_directive(line[1:]):
        line = line[1:]
    return asciidoc_inline(line.strip(" \t"))


def _paragraph_start(line: str, style: str) -> str:
    """The first line of a text paragraph: an admonition's label spelled out ("NOTE: x" -> "Note: x")."""
    if style in ADMONITION_LABELS:
        return f"{ADMONITION_LABELS[style]}: {_text(line)}"
    if match := _ADMONITION.match(line):
        return f"{ADMONITION_LABELS[match[1]]}: {_text(line[match.end():])}"
    return _text(line)


def _without_callouts(line: str) -> str:
    """A code line without the callout markers at its end (`x = 1 # <1>` -> "x = 1")."""
    if not line.endswith(">"):
        return line
    match = _REVERSED_CALLOUTS.match(line[::-1])
    return line[:len(line) - match.end()].rstrip(_TRAILING_SPACE) if match else line


def _table_row(line: str, separator: str) -> str:
    """A table line's cells, separated by spaces, without cell specifiers (`2+|`, `a|`, `^.^|`)."""
    pieces = [piece.replace("\\" + separator, separator) for piece in _CELL_SEPARATORS[separator].split(line)]
    if separator in "|!":
        pieces[0] = "" if _is_cell_spec(pieces[0].strip(" \t")) else pieces[0]
        pieces[1:-1] = [_without_cell_spec(piece) for piece in pieces[1:-1]]
    return " ".join(text for text in map(_text, pieces) if text)


def _is_cell_spec(token: str) -> bool:
    return len(token) <= MAX_CELL_SPEC_CHARS and _CELL_SPEC.fullmatch(token) is not None


def _without_cell_spec(piece: str) -> str:
    """A cell's text without the next cell's specifier, which ends it after a space (`text 2+`)."""
    cut = max(piece.rfind(" "), piece.rfind("\t"))
    token = piece[cut + 1:]
    return piece[:cut] if cut >= 0 and token and _is_cell_spec(token) else piece


# ---------------------------------------------------------------------------
# The document header.


# Asciidoctor's built-in attributes that stand for a character (or nothing): what `{nbsp}` shows.
_CHARACTER_ATTRIBUTES = {
    "nbsp": " ", "sp": " ", "empty": "", "blank": "", "zwsp": "", "wj": "", "apos": "'", "quot": '"',
    "lsquo": "\u2018", "rsquo": "\u2019", "ldquo": "\u201c", "rdquo": "\u201d", "deg": "\u00b0", "plus": "+",
    "brvbar": "\u00a6", "vbar": "|", "amp": "&", "lt": "<", "gt": ">", "startsb": "[", "endsb": "]", "caret": "^",
    "asterisk": "*", "tilde": "~", "backslash": "\\", "backtick": "`", "two-colons": "::", "two-semicolons": ";;",
    "cpp": "C++", "cxx": "C++", "pp": "++"}
_ATTRIBUTE_REFERENCE = re.compile(r"(?<!\\)\{([\w-]+)\}")
# A value that starts a macro or a URL (`xref:a.adoc`, `https://x`): the `[text]` after its reference
# makes it a link, so it goes into the line as written.
_MACRO_VALUE = re.compile(r"[a-z][\w-]*:\S")
_HELD_VALUE = re.compile("\ue000([0-9]+)\ue001")
ATTRIBUTE_GROWTH_MAX = 4096  # what substitution may add to one line: past it references stay as written
# A reference the document does not define, as the start of a link: `{url-docs}/path[text^]` shows "text"
# (the site's playbook defines it). Where its target ends (its text's "[", or no link), its brackets.
_LINK_STOP = re.compile(r"[\s\[\]]")
_BRACKET = re.compile(r"[\[\]]")
_OPEN_BRACE = re.compile(r"\{")


def substitute_attributes(text: str, attributes: Mapping[str, str], values: list[str]) -> str:
    """`{name}` references replaced by the attributes' values (the document's own entries, then
    the built-in character attributes); an undefined one stays as written (Asciidoctor's default),
    except as the start of a link, which shows its text. As in Asciidoctor, a value is not read for
    quotes or passthroughs (`SQL++` is not a `++` passthrough): one holding their marks is held in
    `values` behind a private-use mark, which restore_attributes puts back once the line is read.
    A line grows by at most ATTRIBUTE_GROWTH_MAX characters (references past it stay as written)."""
    if "{" not in text:
        return text
    room = [ATTRIBUTE_GROWTH_MAX]  # a chain of entries each doubling the one before grows no further

    def value(match: re.Match[str]) -> str:
        name = match[1].lower()
        found = attributes.get(name, _CHARACTER_ATTRIBUTES.get(name))
        if found is None or len(found) - len(match[0]) > room[0]:
            return match[0]
        room[0] -= max(0, len(found) - len(match[0]))
        if not _MARKUP_CHARS.search(found) or _MACRO_VALUE.match(found):
            return found
        values.append(found)
        return f"\ue000{len(values) - 1}\ue001"

    text = _ATTRIBUTE_REFERENCE.sub(value, text)
    return _undefined_links(text) if "{" in text and "[" in text else text


def _undefined_links(text: str) -> str:
    """Each `{name}target[text]` left (an undefined reference starting a link) as its text. The
    target's end and the text's bracket are found by look-ups that only move forward, so a line of
    many references costs one pass."""
    stops, brackets, braces = _Next(text, _LINK_STOP), _Next(text, _BRACKET), _Next(text, _OPEN_BRACE)
    out: list[str] = []
    done = 0
    for reference in _ATTRIBUTE_REFERENCE.finditer(text):
        if reference.start() < done:
            continue
        if text[reference.end():reference.end() + 1] not in ("[", "/", "#", "?"):
            continue  # a link's target is the reference, or it and a path
        opening = stops.at(reference.end())
        if opening < 0:
            break
        if text[opening] != "[" or 0 <= braces.at(reference.end()) < opening:
            continue
        closing = brackets.at(opening + 1)
        if closing < 0:
            break
        if text[closing] == "]":
            out += [text[done:reference.start()], _link_text(text[opening + 1:closing])]
            done = closing + 1
    out.append(text[done:])
    return "".join(out)


def restore_attributes(text: str, values: Sequence[str]) -> str:
    """substitute_attributes' held values back in a line as read."""
    return _HELD_VALUE.sub(lambda m: values[int(m[1])], text) if "\ue000" in text else text


@dataclass(frozen=True)
class _Header:
    end: int  # 0-based index of the first body line
    metadata: dict[str, str]
    title: str | None = None
    title_index: int = -1  # 0-based index of the doctitle line


def _read_header(lines: Sequence[str]) -> _Header:
    """Asciidoctor's parse_document_header: attribute entries, comments and blank lines, then an
    optional doctitle (`= Title`), an author line, a revision line and attribute entries, each
    directly below the one before; a blank line ends the header."""
    metadata: dict[str, str] = {}
    i, entries = _header_entries(lines, 0, metadata, skip_blank=True)
    # Block attribute lines may come first (parse_block_metadata_lines): Antora pages open with an
    # anchor, `[[features.x]]`, then `= Title`. A block title (`.Title`) there means no header.
    title_index = i
    while title_index < len(lines) and _is_block_attribute_line(lines[title_index]):
        title_index += 1
    heading = _section_title(lines[title_index]) if title_index < len(lines) else None
    underlined = (heading is None and title_index + 1 < len(lines)
                  and _setext_level(lines[title_index], lines[title_index + 1]) == 0)
    if underlined:
        heading = (1, lines[title_index].strip())
    if heading is None or heading[0] != 1:
        return _Header(end=i if entries else 0, metadata=metadata)
    i, _ = _header_entries(lines, title_index + 1 + underlined, metadata, skip_blank=False)
    for takes in (_is_author_line, _is_revision_line):
        if i < len(lines) and takes(lines[i]):
            i, _ = _header_entries(lines, i + 1, metadata, skip_blank=False)
    end = i + 1 if i < len(lines) and not lines[i] else i
    values: list[str] = []
    title = restore_attributes(asciidoc_inline(substitute_attributes(heading[1], metadata, values)), values)
    return _Header(end=end, metadata=metadata, title=title.strip() or None, title_index=title_index)


def _is_author_line(line: str) -> bool:
    return bool(line)  # Asciidoctor reads any line right below the doctitle as its author line


def _is_revision_line(line: str) -> bool:
    return bool(line) and not line.startswith(":")  # RevisionInfoLineRx matches anything else


def _header_entries(lines: Sequence[str], i: int, metadata: dict[str, str], *, skip_blank: bool) -> tuple[int, int]:
    """Skip comments, comment blocks and preprocessor lines (and blank lines when skip_blank) and
    store the attribute entries among them: (next line index, how many entries were read)."""
    entries = 0
    while i < len(lines):
        line = lines[i]
        if (skip_blank and not line) or _is_comment_line(line) or _adoc_directive(line):
            i += 1
        elif _delimiter(line) == "////":
            i = _after_comment_block(lines, i)
        elif match := _ATTRIBUTE_ENTRY.fullmatch(line):
            i = _store_entry(lines, i, match, metadata)
            entries += 1
        else:
            break
    return i, entries


def _after_comment_block(lines: Sequence[str], i: int) -> int:
    for j in range(i + 1, len(lines)):
        if lines[j] == lines[i]:
            return j + 1
    return len(lines)


def _store_entry(lines: Sequence[str], i: int, match: re.Match[str], metadata: dict[str, str]) -> int:
    """Store one attribute entry (`:name: value`, continued by a trailing ` \\`; `:name!:` and
    `:!name:` unset it); the index of the line after it."""
    value, i = _entry_value(lines, i, match[2] or "")
    name = match[1]
    unset = name.startswith("!") or name.endswith("!")
    name = _INVALID_NAME_CHARS.sub("", name).lower()  # Asciidoctor's sanitize_attribute_name
    if unset:
        metadata.pop(name, None)
    else:
        metadata[name] = value
    return i


def _entry_value(lines: Sequence[str], i: int, value: str) -> tuple[str, int]:
    """An attribute entry's value with its continuation lines joined, and the index after them."""
    parts = [value]
    i += 1
    while parts[-1].endswith(" \\") and i < len(lines) and lines[i]:
        parts[-1] = parts[-1][:-2].rstrip()
        parts.append(lines[i].strip())
        i += 1
    if parts[-1].endswith(" \\"):
        parts[-1] = parts[-1][:-2].rstrip()
    return " ".join(part for part in parts if part).strip(), i


# ---------------------------------------------------------------------------
# The body: one pass, an explicit stack of open delimited blocks.


@dataclass
class _AdocBlock:
    terminator: str
    model: str  # compound, code, pass, verse, comment or table
    separator: str = "|"  # a table's cell separator
    nested: bool = False  # a table is inside a nested `!===` table


@dataclass
class _Walk:
    lines: Sequence[str]
    searchable: list[str]
    headings: list[Heading] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)  # 0-based
    blocks: list[_AdocBlock] = field(default_factory=list)  # open delimited blocks, outermost first
    block_lines: list[int] = field(default_factory=list)  # the line each of them opened on
    depth_of: dict[str, int] = field(default_factory=dict)  # terminator -> index in blocks
    run: str | None = None  # what the current paragraph-like run is: para, list, code, pass, comment
    in_list: bool = False
    after_blank: bool = False
    pending: int | None = None  # first metadata line (attributes, block title) awaiting its block
    style: str = ""  # the style those metadata lines set
    entry_goes_on: bool = False  # the attribute entry above ends with " \"
    underline: int = -1  # the line underlining a two-line title: read with the title
    attributes: dict[str, str] = field(default_factory=dict)  # the document's, as defined so far
    values: list[str] = field(default_factory=list)  # held by substitute_attributes

    def step(self, i: int) -> None:
        line = self.lines[i]
        if self.blocks and self.blocks[-1].model == "comment":
            # Inside a comment block nothing is read, not even the preprocessor's lines.
            if line in self.depth_of:
                self._close(line)
            return
        if self.entry_goes_on and line:
            self.entry_goes_on = line.endswith(" \\")
            return
        self.entry_goes_on = False
        if i == self.underline:
            return
        kind = _adoc_directive(line)
        if kind:
            if kind == "include" and not self.blocks:
                self.starts.append(i)
            return
        if line in self.depth_of:
            self._close(line)
        elif self.blocks and self.blocks[-1].model != "compound":
            block = self.blocks[-1]
            text = substitute_attributes(line, self.attributes, self.values) if block.model in ("table", "verse") else line
            self.searchable[i] = self._verbatim(block, text)
        else:
            self._structure(i, substitute_attributes(line, self.attributes, self.values))

    def _verbatim(self, block: _AdocBlock, line: str) -> str:
        if block.model == "code":
            return _without_callouts(line)
        if block.model == "pass":
            return line
        if not line or _is_comment_line(line):
            return ""
        if block.model == "verse":
            return _text(line)
        if _delimiter(line):  # a nested table's delimiter, or a block in an `a|` cell
            block.nested ^= line.startswith("!===") and block.separator == "|"
            return ""
        return _table_row(line, "!" if block.nested else block.separator)

    def _structure(self, i: int, line: str) -> None:
        if not line:
            self.run, self.after_blank = None, True
            return
        if _is_comment_line(line):
            return
        if tip := _delimiter(line):
            self._open(i, line, tip)
        elif _is_block_attribute_line(line):
            self.run = None
            self._hold(i, _block_style(line))
        elif self.run is not None:
            self._continue_run(i, line)
        else:
            self._begin(i, line)
        self.after_blank = False

    def _open(self, i: int, line: str, tip: str) -> None:
        model = _STYLED_MODELS.get((tip, self.style), _BLOCK_MODELS[tip])
        self._start(i)
        terminator = _terminator(line, tip)
        self.depth_of[terminator] = len(self.blocks)
        self.blocks.append(_AdocBlock(terminator, model, separator=tip[0]))
        self.block_lines.append(i)
        self.run, self.in_list = None, False

    def _close(self, line: str) -> None:
        """Close the outermost open block this line ends, and every block opened inside it: a
        block's content is everything up to the first line equal to its delimiter."""
        depth = self.depth_of[line]
        for block in self.blocks[depth:]:
            del self.depth_of[block.terminator]
        del self.blocks[depth:], self.block_lines[depth:]
        self.run, self.in_list, self.pending, self.style = None, False, None, ""

    def _continue_run(self, i: int, line: str) -> None:
        if line == "+":  # a list continuation: the next line begins a block attached to the item
            self.run = None
        elif (self.run == "list" or (self.run == "para" and self.in_list)) and (item := _list_item(line)) is not None:
            self._start(i)
            self.searchable[i], self.run = item, "list"
        else:
            self.searchable[i] = self._run_text(self.run, line)

    @staticmethod
    def _run_text(run: str | None, line: str) -> str:
        if run == "code":
            return _without_callouts(line)
        if run == "pass":
            return line
        return "" if run == "comment" else _text(line)

    def _begin(self, i: int, line: str) -> None:
        """A line at a block boundary: the first line of a block, or metadata for the next one."""
        if self.after_blank and self.in_list and line != "+" and _list_item(line) is None:
            self.in_list = False
        if line == "+":
            return
        if (title := _section_title(line)) and (not self.blocks or self.style in DISCRETE_STYLES):
            self._title(i, *title)
        elif (not self.blocks and i + 1 < len(self.lines) and not _ATTRIBUTE_ENTRY.fullmatch(line)
              and (level := _setext_level(line, self.lines[i + 1])) is not None):
            self.underline = i + 1
            self._title(i, level + 1, line.strip())
        elif (block_title := _block_title(line)) is not None:
            self.searchable[i] = _text(block_title)
            self._hold(i, "")
        elif match := _ATTRIBUTE_ENTRY.fullmatch(line):
            self.entry_goes_on = (match[2] or "").endswith(" \\")
            _store_entry([line], 0, match, self.attributes)
            if not self.blocks:
                self.starts.append(i)
        else:
            self._begin_block(i, line)

    def _begin_block(self, i: int, line: str) -> None:
        style = self.style
        self._start(i)
        if (macro := _block_macro(line)) is not None:
            self.searchable[i] = macro
        elif _LAYOUT_BREAK.fullmatch(line):
            pass  # a thematic or page break: no text
        elif (item := _list_item(line)) is not None:
            self.searchable[i], self.run, self.in_list = item, "list", True
        elif style in _PARAGRAPH_MODELS:
            self.run = _PARAGRAPH_MODELS[style]
            self.searchable[i] = self._run_text(self.run, line)
        elif line[0] in " \t":  # a literal paragraph
            self.run = "code"
            self.searchable[i] = _without_callouts(line)
        else:
            self.run = "para"
            self.searchable[i] = _paragraph_start(line, style)

    def _title(self, i: int, marks: int, text: str) -> None:
        shown = asciidoc_inline(text).strip()
        self.searchable[i] = shown
        if not self.blocks:  # inside a block only a discrete heading is a title, and not a section
            self.headings.append(Heading(line=i + 1, level=max(1, marks - 1), text=shown))
            self._start(i)
            self.starts.append(i)
        self.pending, self.style, self.run, self.in_list = None, "", None, False

    def _hold(self, i: int, style: str) -> None:
        """A metadata line: the block below begins here (it may come after blank lines)."""
        if self.pending is None:
            self.pending = i
        self.style = style or self.style

    def _start(self, i: int) -> None:
        if not self.blocks:
            self.starts.append(i if self.pending is None else self.pending)
        self.pending, self.style = None, ""


def read_asciidoc(raw: bytes, path: str) -> DocumentText:
    """AsciiDoc (Antora, Asciidoctor 2.0's rules): the header's title and attribute entries
    (`:lifecycle: superseded`) for the document's keys, `==` section titles outside delimited
    blocks, listing and literal blocks kept as code, comments and attribute entries no content,
    `include::` lines left as written and never followed, conditionals not evaluated."""
    stored = split_lines(decode_text(raw, path))
    lines = [line.rstrip(_TRAILING_SPACE) for line in stored]
    header = _read_header(lines)
    searchable = [""] * len(lines)  # the header's lines too: its title is the document's, indexed as such
    walk = _Walk(lines, searchable, attributes=dict(header.metadata))
    for i in range(header.end, len(lines)):
        walk.step(i)
    warnings = ()
    if walk.blocks:
        warnings = (f"{path}: line {walk.block_lines[0] + 1}: the delimited block opened here is never closed "
                    f"(no line {walk.blocks[0].terminator!r}): it runs to the end of the file",)
    return DocumentText(lines=tuple(stored),
                        searchable=tuple(searchable_text(restore_attributes(line, walk.values)) for line in searchable),
                        body_start=header.end + 1,
                        headings=tuple(Heading(h.line, h.level, metadata_text(nfc(restore_attributes(h.text, walk.values))))
                                       for h in walk.headings),
                        block_starts=tuple(start + 1 for start in sorted(set(walk.starts))),
                        metadata={name: field_value(value) for name, value in header.metadata.items()},
                        title=metadata_text(nfc(header.title)) if header.title else None, warnings=warnings)


def asciidoc_inline_searchable(text: str) -> str:
    """A piece of AsciiDoc as embedded: its inline markup reduced, URL payloads shortened."""
    return searchable_text(asciidoc_inline(text))


# ---------------------------------------------------------------------------
# Inline markup.

# Text that macros and passthroughs protect from further reduction (a URL's underscores, a
# passthrough's asterisks) waits in a list, stood for by "\x00<index>\x01" (both removed from the
# input first, so nothing else can look like one).
_HELD = re.compile(r"\x00([0-9]+)\x01")
_PASS_RUN = re.compile(r"(\\?)(\+\+\+?|\$\$)(.*?)\2")
_PASS_MACRO = re.compile(r"(\\?)pass:[a-z,-]*\[((?:[^\[\]\\]|\\.)*)\]")
_PASS_CONSTRAINED = re.compile(r"(?<![\w;:\\])(\\?)\+([^\s+](?:[^+]*[^\s+])?)\+(?!\w)")
# Named macros match anywhere (as in Asciidoctor); a URL only after a space, a bracket, a quote or
# the start (InlineLinkRx), so that `_https://x[y]_` stays text (or a backslash: escaped).
_MACRO_HEAD = re.compile(r"(\\?)(?:(xref|link|mailto|kbd|btn|menu|footnote|footnoteref|anchor|image|icon"
                         r"|indexterm2?|stem|latexmath|asciimath):|(?<![^\s>()\[\];\"'<\\])(?:https?|ftp|irc|file)://"
                         # an extension's macro (javadoc:a.B[], configprop:x.y[]): its name, then a target
                         r"|(?<![\w:/])([a-z][a-z0-9_-]{2,}):(?=[^\s\[\]/:]))")
_OPEN = re.compile(r"\[")
_NOT_IN_EXTENSION_TARGET = re.compile(r"[:{]")  # `a:b:c[x]` or `{attr}` in it: text, not an extension's macro
_TARGET_END = re.compile(r"[\s\]]")
_CLOSE = re.compile(r"(?<!\\)\]")
# `[[[ref]]]` (a bibliography entry, shown as "[ref]"), `[[id]]` and `[[id,text]]` (shown as nothing).
_BIBLIOGRAPHY_ANCHOR = re.compile(r"\[\[\[((?:[^\W\d]|:)[\w:.-]*)(?:,([^\[\]]*))?\]\]\]")
_INLINE_ANCHOR = re.compile(r"(\\?)\[\[(?:[^\W\d]|:)[\w:.-]*(?:,[^\[\]]*)?\]\]")
# [.role]#text#: before an opening mark (one a text follows), never after one: `[default]` is text
_ROLE_LIST = re.compile(r"(?<![\w\\*_`#])\[[^\[\]]+\](?=([*_`#])\1?[^\s*_`#])")
_XREF_SHORTHAND = re.compile(r"(\\?)<<([\w#/.:{][^<>]*)>>")
_INDEX_TERMS = re.compile(r"\(\(\(([^()]*)\)\)\)|\(\(([^()]*)\)\)")
_ESCAPED_ATTRIBUTE = re.compile(r"\\(\{[\w-]*\})")
_MARKUP_CHARS = re.compile(r"[*_`#^~+\[<(\\:$&]")
_CHARACTER_REFERENCE = re.compile(r"&(?:#[0-9]{1,7}|#[xX][0-9a-fA-F]{1,6}|[A-Za-z][A-Za-z0-9]{1,31});")


def _quote(mark: str, *, constrained: bool) -> re.Pattern[str]:
    """Asciidoctor's quote rule for `mark` (its text never holds the mark itself, so a match stops
    at the next one): constrained between non-word characters, unconstrained doubled anywhere."""
    m = re.escape(mark)
    if constrained:
        return re.compile(rf"(?<![\w;:}}\\])(\\?){m}([^\s{m}](?:[^{m}]*[^\s{m}])?){m}(?!\w)")
    return re.compile(rf"(\\?){m}{m}([^{m}]+){m}{m}")


# In Asciidoctor's order: strong, monospace, emphasis, mark, each doubled first; then ^ and ~.
_QUOTES = (*((mark, _quote(mark, constrained=constrained)) for mark in "*`_#" for constrained in (False, True)),
           ("^", re.compile(r"(\\?)\^([^\s^]+)\^")), ("~", re.compile(r"(\\?)~([^\s~]+)~")))


def asciidoc_inline(text: str) -> str:
    """One line's inline markup reduced to its text: `*bold*` -> "bold", `link:url[text]` ->
    "text url", `xref:page.adoc#id[text]` -> "text", `<<id,text>>` -> "text", `kbd:[Ctrl+C]` ->
    "Ctrl+C", passthroughs -> their text as written, `[[id]]` -> ""; `{name}` stays; an escaped
    `\\*x*` -> "*x*". Never longer than the text. Each rule runs only if its marker is there."""
    if not _MARKUP_CHARS.search(text):
        return text
    text = text.replace("\x00", "").replace("\x01", "")
    if text.endswith(" +"):  # a hard line break
        text = text[:-2].rstrip()
    held: list[str] = []
    if "+" in text or "$$" in text or "pass:" in text:
        text = _hold_passthroughs(text, held)
    text = _reduce_macros(text, held)
    if "[[" in text:
        text = _BIBLIOGRAPHY_ANCHOR.sub(lambda m: f"[{(m[2] or '').strip() or m[1]}]", text)
        text = _INLINE_ANCHOR.sub(_unescaped_or(lambda m: ""), text)
    if "<<" in text:
        text = _XREF_SHORTHAND.sub(lambda m: m[0][1:] if m[1] else _xref_shorthand(m[2], held), text)
    if "((" in text:
        text = _INDEX_TERMS.sub(lambda m: "" if m[1] is not None else m[2], text)
    if "[" in text:
        text = _ROLE_LIST.sub("", text)
    for mark, quote in _QUOTES:
        if mark in text:
            text = quote.sub(_UNQUOTE, text)
    if "\\{" in text:
        text = _ESCAPED_ATTRIBUTE.sub(r"\1", text)
    if "&" in text:  # passed through to the page, which shows the character
        text = _CHARACTER_REFERENCE.sub(lambda m: html.unescape(m[0]), text)
    return _restore(text, held)


def _unescaped_or(reduce: Callable[[re.Match[str]], str]) -> Callable[[re.Match[str]], str]:
    """A replacement that leaves an escaped match (group 1 is the backslash) as written, minus the backslash."""
    return lambda m: m[0][1:] if m[1] else reduce(m)


_UNQUOTE = _unescaped_or(lambda m: m[2])


def _hold(held: list[str], text: str) -> str:
    held.append(_restore(text, held))
    return f"\x00{len(held) - 1}\x01"


def _restore(text: str, held: list[str]) -> str:
    return _HELD.sub(lambda m: held[int(m[1])], text) if held else text


def _hold_passthroughs(text: str, held: list[str]) -> str:
    """`+++x+++`, `++x++`, `$$x$$`, `pass:[x]` and `+x+`: their text as written, held from further reduction."""
    text = _PASS_RUN.sub(_unescaped_or(lambda m: _hold(held, m[3])), text)
    text = _PASS_MACRO.sub(_unescaped_or(lambda m: _hold(held, m[2].replace("\\]", "]"))), text)
    return _PASS_CONSTRAINED.sub(_unescaped_or(lambda m: _hold(held, m[2])), text)


class _Next:
    """Where `pattern` next occurs at or after a position, for positions that never decrease: a
    look-up is only repeated once the position has passed the last answer, so asking at every
    macro of a line costs one scan of the line."""

    def __init__(self, text: str, pattern: re.Pattern[str]) -> None:
        self.text, self.pattern, self.found, self.asked = text, pattern, -1, False

    def at(self, pos: int) -> int:
        if not self.asked or 0 <= self.found < pos:
            match = self.pattern.search(self.text, pos)
            self.found, self.asked = (match.start() if match else -1), True
        return self.found


def _reduce_macros(text: str, held: list[str]) -> str:
    """Inline macros (`name:target[text]`, URLs with text), left to right. The target runs from
    the macro's name to the next `[` with no space or `]` between; both are found by look-ups
    that only move forward, so a line of many names and no bracket costs one pass."""
    if "[" not in text:
        return text
    opens, target_ends, closes = _Next(text, _OPEN), _Next(text, _TARGET_END), _Next(text, _CLOSE)
    not_extension_targets = _Next(text, _NOT_IN_EXTENSION_TARGET)
    out: list[str] = []
    done = 0  # text[:done] is in out
    for head in _MACRO_HEAD.finditer(text):
        if head.start() < done:
            continue  # inside the macro just reduced
        at = opens.at(head.end())
        if at < 0:
            break
        if 0 <= target_ends.at(head.end()) < at or (head[3] and 0 <= not_extension_targets.at(head.end()) < at):
            continue
        close = closes.at(at + 1)
        if close < 0:
            break
        if head[1]:  # escaped: shown as written
            replacement: str | None = text[head.start() + 1:close + 1]
        else:
            name = head[2] or ("extension" if head[3] else "url")
            target = text[head.start() if name == "url" else head.end():at]
            replacement = _macro_text(name, target, text[at + 1:close].replace("\\]", "]"), held)
        if replacement is not None:
            out += [text[done:head.start()], replacement]
            done = close + 1
    out.append(text[done:])
    return "".join(out)


def _macro_text(name: str, target: str, content: str, held: list[str]) -> str | None:
    """What an inline macro shows; None when it is not one (a missing target)."""
    if name in ("kbd", "btn"):
        return None if target else content
    if name in ("footnote", "indexterm2"):
        return content
    if name == "footnoteref":
        return content.partition(",")[2].strip()
    if name in ("stem", "latexmath", "asciimath"):
        return _hold(held, content)
    if not target:
        return None
    if name in ("url", "link", "mailto"):
        label = _link_text(content)
        return f"{label} {_hold(held, target)}" if label else _hold(held, target)
    if name == "xref":
        return content.strip() or _hold(held, target)
    if name == "menu":
        return f"{target} > {content.strip()}" if content.strip() else target
    if name == "image":
        return _first_positional(content) or _default_alt(target)
    if name == "extension":  # what the extension renders is unknown: its text, else its target
        return _first_positional(content) or target
    return ""  # anchor, icon, indexterm: no text of their own


def _default_alt(target: str) -> str:
    """An image's alt text when it has none, as Asciidoctor makes it: the file name without its
    extension, dashes and underscores as spaces (`no.png` "no")."""
    stem = PurePosixPath(target).stem
    return stem.replace("_", " ").replace("-", " ").strip()


def _link_text(content: str) -> str:
    """A link's text: the whole bracket, or its first positional attribute when the bracket is an
    attribute list (holds "="); a trailing "^" (open in a new window) dropped."""
    label = _first_positional(content) if "=" in content else content
    return label.strip().removesuffix("^").strip()


def _first_positional(attributes: str) -> str:
    """The first positional attribute ("Alt text, 200" -> "Alt text"; "" when the first is named)."""
    attributes = attributes.strip()
    if attributes.startswith('"'):
        end = attributes.find('"', 1)
        return attributes[1:end] if end > 0 else attributes[1:]
    first = attributes.split(",", 1)[0].strip()
    return "" if "=" in first else first


def _xref_shorthand(inside: str, held: list[str]) -> str:
    """`<<id,text>>` -> "text", `<<id>>` -> "id"."""
    target, _, label = inside.partition(",")
    return label.strip() or _hold(held, target.strip())


# PDF: the text layer (pypdf, in the PDF extractor's child process: see the end of this module),
# cited by page. The document's lines are the extracted text with a marker line where each page
# starts; ingest stores that text (Reader.extracted) and get_file serves it, so lines stay exact.

# The child's address-space cap (RLIMIT_AS, which Linux enforces; RSS limits it ignores). pypdf
# caps each stream it decodes (PYPDF_LIMITS) but keeps every decoded stream of a document, so a
# file of many streams just under the cap would still take the machine (measured: thirty 70 MB
# streams reached 700 MB before the deadline). The 300-page test book peaks at ~45 MB: 1.5 GB
# leaves a wide margin for real files and the machine whole.
CHILD_MEMORY_LIMIT = 1536 * 1024 * 1024
# The deadline of one PDF. The base covers the child's start-up (0.1-0.4 s) and any ordinary file
# on a slow, busy machine: pypdf read pdfTeX manuals at ~60 pages/s (7 kB a page) and the test
# book's dense text at ~200 pages/s (0.5 kB a page), so 30 s is 1,800 pages or more. The share
# per MB is for large files: at the manuals' pace a MB takes ~2.4 s, so 4 s/MB keeps a margin
# beyond the base (files heavy with images carry far more bytes a page, and cost no more to
# read). Capped, so that one file cannot hold a run for long.
TIMEOUT_BASE_S = 30.0
TIMEOUT_PER_MB_S = 4.0
TIMEOUT_MAX_S = 300.0
# The most text one PDF may yield (15,000-20,000 pages of dense prose): more is a generated or hostile
# file, and the whole of it would travel to and stay in the caller.
TEXT_LIMIT_CHARS = 64_000_000
# pypdf's own limits, pinned so that an upgrade changing its defaults changes nothing here. They
# are pypdf 7's defaults: each stops a kind of bomb long before CHILD_MEMORY_LIMIT does.
PYPDF_LIMITS: dict[str, int] = {
    "zlib_maximum_output_length": 75_000_000,  # a FlateDecode stream that inflates to gigabytes
    "lzw_maximum_output_length": 75_000_000,  # the same for LZW
    "run_length_maximum_output_length": 75_000_000,  # and for RunLength
    "brotli_maximum_output_length": 75_000_000,  # and for Brotli
    "array_based_stream_maximum_output_length": 75_000_000,  # a page's /Contents array, concatenated
    "maximum_declared_stream_length": 75_000_000,  # a /Length that asks for a huge read
    "stream_filters_maximum_length": 16,  # a stream filtered through the same filter again and again
    "stream_decoding_work_maximum_length": 300_000_000,  # the decoding work over one stream's filters
    "stream_parsing_work_maximum_count": 2_000_000,  # operators and operands of one content stream
    "array_maximum_element_count": 100_000,  # an array of millions of elements
    "dictionary_maximum_element_count": 100_000,  # a dictionary of millions of keys
    "page_tree_maximum_entries": 100_000,  # a page tree of millions of nodes
    "page_tree_maximum_depth": 100,  # a page tree nested deeper than any real one
    "outline_maximum_entries": 100_000,  # the same for the outline
    "outline_maximum_depth": 100,
    "xform_maximum_invocations_per_extraction": 5_000,  # form XObjects drawn within each other
    "xmp_maximum_input_length": 5_000_000,  # the XMP metadata stream (its title may be read)
}
# The reader's own limits (PdfReader arguments), pinned likewise.
PYPDF_READER_LIMITS: dict[str, int] = {
    "root_object_recovery_limit": 10_000,  # objects a damaged file's repair scans for its catalog
    "xref_stream_maximum_entries": 2_000_000,  # rows of cross-reference streams altogether
}
PYPDF_WARNINGS_KEPT = 5  # distinct pypdf warnings kept in a PdfText's warnings: the first ones say what matters


class PdfRefused(Exception):
    """A PDF whose text cannot be used, with the reason ("encrypted: …", "damaged: …") and, once
    known, the file's path."""

    def __init__(self, reason: str, path: str = "") -> None:
        super().__init__(f"{path}: {reason}" if path else reason)
        self.reason = reason
        self.path = path


@dataclass(frozen=True)
class PdfPage:
    number: int  # physical page, 1-based
    label: str  # the printed page label where the PDF defines /PageLabels ("x", "A-3", "10"), else str(number)
    text: str  # the page's extracted text layer ("" when the page has none)


@dataclass(frozen=True)
class PdfOutlineEntry:
    title: str
    level: int  # 1 = top level of the outline (bookmarks)
    page: int  # physical page it points to, 1-based


@dataclass(frozen=True)
class PdfText:
    pages: tuple[PdfPage, ...]
    title: str | None  # the document information /Title (or XMP dc:title), stripped; None if absent/empty
    metadata: dict[str, str]  # the other string entries of /Info (Author, Keywords, custom keys), keys without "/"
    outline: tuple[PdfOutlineEntry, ...]
    warnings: tuple[str, ...]  # pages without a text layer, outline entries skipped, what pypdf repaired


def extract_pdf_text(raw: bytes) -> PdfText:
    """The text of one PDF's bytes. Raises PdfRefused; MemoryError passes through (the caller's
    process decides what that means; in the child it is the memory cap)."""
    import pypdf

    heard: list[str] = []
    with pypdf.apply_configuration(**PYPDF_LIMITS), _pypdf_warnings_into(heard):
        try:
            reader = pypdf.PdfReader(io.BytesIO(raw), **PYPDF_READER_LIMITS)
            _unlock(reader)
            return _read_document(reader, heard)
        except (PdfRefused, MemoryError):
            raise
        except Exception as exc:  # noqa: BLE001 - pypdf raises its own errors and plain ones (KeyError, ValueError, RecursionError, …) on damage
            raise PdfRefused(f"damaged: {_short_reason(exc)}") from None


def _short_reason(exc: BaseException) -> str:
    if isinstance(exc, RecursionError):
        return "objects nested too deeply"
    first = (str(exc).splitlines() or [""])[0].strip()
    return (first or type(exc).__name__)[:200]


@contextlib.contextmanager
def _pypdf_warnings_into(heard: list[str]) -> Iterator[None]:
    """pypdf's warnings (its logger and Python warnings) into `heard`, not onto stderr: they say
    what it repaired or skipped, which belongs with the document."""

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            heard.append(record.getMessage())

    logger = logging.getLogger("pypdf")
    handler, propagated = Keep(logging.WARNING), logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
        heard.extend(str(warning.message) for warning in caught)
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagated


def _unlock(reader: Any) -> None:
    """Open an encrypted PDF with the empty user password, as viewers do: many "protected" PDFs
    only restrict printing or copying, and open without one."""
    if not reader.is_encrypted:
        return
    from pypdf.errors import DependencyError

    try:
        opened = reader.decrypt("")
    except DependencyError:
        raise PdfRefused("encrypted: its AES encryption needs the cryptography package") from None
    if not opened:  # PasswordType.NOT_DECRYPTED
        raise PdfRefused("encrypted: a password is needed")


def _read_document(reader: Any, heard: list[str]) -> PdfText:
    notes: list[str] = []
    texts = _page_texts(reader, notes)
    labels = _page_labels(reader, len(texts), notes)
    title, metadata = _document_information(reader, notes)
    outline = _outline(reader, notes)
    pages = tuple(PdfPage(number, label, text) for number, (label, text) in enumerate(zip(labels, texts, strict=True), 1))
    return PdfText(pages, title, metadata, outline, tuple(notes + _distinct(heard)))


def _page_texts(reader: Any, notes: list[str]) -> list[str]:
    """Each page's text ("" where it has none). A page pypdf cannot read is noted and left empty;
    a document with no text at all is refused."""
    texts: list[str] = []
    blank: list[int] = []
    failed: list[int] = []
    first_failure = ""
    total = 0
    for number, page in enumerate(reader.pages, 1):
        try:
            text = page.extract_text()
        except MemoryError:
            raise
        except Exception as exc:  # noqa: BLE001 - one damaged page (pypdf's errors, KeyError, …) leaves the others readable
            failed.append(number)
            first_failure = first_failure or _short_reason(exc)
            text = ""
        else:
            if not text.strip():
                blank.append(number)
                text = ""
        total += len(text)
        if total > TEXT_LIMIT_CHARS:
            raise PdfRefused(f"too large: more than {TEXT_LIMIT_CHARS:,} characters of text")
        texts.append(text)
    _check_some_text(texts, failed, first_failure)
    if blank:
        notes.append(f"{_pages_phrase(blank)} no text layer")
    if failed:
        notes.append(f"{_pages_phrase(failed, 'could')} not be read ({first_failure})")
    return texts


def _check_some_text(texts: Sequence[str], failed: Sequence[int], first_failure: str) -> None:
    if not texts:
        raise PdfRefused("empty: the PDF has no pages")
    if any(texts):
        return
    if failed:
        raise PdfRefused(f"damaged: {first_failure}")
    raise PdfRefused("no text layer: a scanned or image-only PDF (OCR it to make it searchable)")


def number_ranges(numbers: Sequence[int]) -> str:
    """1, 2, 3, 7 -> "1-3, 7"."""
    runs: list[list[int]] = []
    for number in numbers:
        if runs and number == runs[-1][-1] + 1:
            runs[-1].append(number)
        else:
            runs.append([number])
    return ", ".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)


def _pages_phrase(numbers: Sequence[int], verb: str = "has") -> str:
    """"page 2 has", "pages 3, 7-9 have" (or "could", the same for one and many)."""
    shown = number_ranges(numbers)
    plural = len(numbers) > 1
    return f"{'pages' if plural else 'page'} {shown} {'have' if plural and verb == 'has' else verb}"


def _page_labels(reader: Any, count: int, notes: list[str]) -> list[str]:
    """The printed labels (/PageLabels); a page without one (or an empty one) keeps its number."""
    try:
        labels = list(reader.page_labels)
    except Exception as exc:  # noqa: BLE001 - a damaged /PageLabels tree must not cost the text
        notes.append(f"page labels could not be read ({_short_reason(exc)}); physical page numbers used")
        labels = []
    printed = [str(label).strip() for label in labels]
    return [printed[i] if i < len(printed) and printed[i] else str(i + 1) for i in range(count)]


def _document_information(reader: Any, notes: list[str]) -> tuple[str | None, dict[str, str]]:
    """(title, the other string entries) of /Info; the title from XMP's dc:title when /Info has none."""
    strings: dict[str, str] = {}
    try:
        info = reader.metadata or {}
        for key in info:
            value = info[key]  # resolved, where the entry is a reference
            if str(key).startswith("/") and isinstance(value, str) and value.strip():
                strings[str(key)[1:]] = value.strip()
    except Exception as exc:  # noqa: BLE001 - damaged metadata must not cost the text
        notes.append(f"the document information could not be read ({_short_reason(exc)})")
    return strings.pop("Title", None) or _xmp_title(reader, notes), strings


def _xmp_title(reader: Any, notes: list[str]) -> str | None:
    try:
        xmp = reader.xmp_metadata
        titles = (xmp.dc_title or {}) if xmp is not None else {}
    except Exception as exc:  # noqa: BLE001 - damaged XMP must not cost the text
        notes.append(f"the XMP metadata could not be read ({_short_reason(exc)})")
        return None
    title = titles.get("x-default") or next(iter(titles.values()), None)
    return (title.strip() or None) if isinstance(title, str) else None


def _outline(reader: Any, notes: list[str]) -> tuple[PdfOutlineEntry, ...]:
    """The outline in reading order, each entry with its level and physical page; entries that
    point at no page of this PDF (a dangling reference, a web link) are skipped and named."""
    entries: list[PdfOutlineEntry] = []
    skipped: list[str] = []
    try:
        _flatten_outline(reader, reader.outline, 1, entries, skipped)
    except Exception as exc:  # noqa: BLE001 - a damaged outline must not cost the text
        notes.append(f"the outline could not be read ({_short_reason(exc)})")
        return ()
    if skipped:
        shown = ", ".join(repr(title) for title in skipped[:5]) + (f" and {len(skipped) - 5} more" if len(skipped) > 5 else "")
        notes.append(f"outline entries that point at no page of this PDF were skipped: {shown}")
    return tuple(entries)


def _flatten_outline(reader: Any, items: list[Any], level: int, entries: list[PdfOutlineEntry],
                     skipped: list[str]) -> None:
    """pypdf's nested outline: an item, then the list of its children (if any), recursively
    (pypdf caps the depth at PYPDF_LIMITS' outline_maximum_depth)."""
    for item in items:
        if isinstance(item, list):
            _flatten_outline(reader, item, level + 1, entries, skipped)
            continue
        title = " ".join(str(item.title or "").split())
        page = _destination_page(reader, item)
        if page is None:
            skipped.append(title)
        else:
            entries.append(PdfOutlineEntry(title, level, page))


def _destination_page(reader: Any, destination: Any) -> int | None:
    try:
        index = reader.get_destination_page_number(destination)
    except Exception:  # noqa: BLE001 - a destination that is not a page reference (pypdf asserts, or raises)
        return None
    return index + 1 if isinstance(index, int) and index >= 0 else None


def _distinct(heard: Sequence[str]) -> list[str]:
    kept = list(dict.fromkeys(" ".join(message.split())[:200] for message in heard))
    more = len(kept) - PYPDF_WARNINGS_KEPT
    return [f"pypdf: {message}" for message in kept[:PYPDF_WARNINGS_KEPT]] + (
        [f"pypdf: {more} more warnings"] if more > 0 else [])


def pdf_page_marker(page: PdfPage) -> str:
    """The line that starts a page in a PDF's extracted text: its physical number, and the printed
    one where the document numbers it otherwise."""
    return f"[page {page.number}]" if page.label == str(page.number) else f'[page {page.number}, printed "{page.label}"]'


_SENTENCE_END = re.compile(r"[.:!?。)]\s*$")


def pdf_document(pdf: PdfText, path: str) -> DocumentText:
    """The document model of a PDF's text: a marker line per page, then its lines; blocks at pages,
    blank lines and lines after a sentence's end (a PDF's lines are typeset lines, not paragraphs);
    headings from the outline (bookmarks), each at the line of its page that starts with its title,
    else at the page's start."""
    lines: list[str] = []
    starts: list[int] = []
    pages: list[Page] = []
    for page in pdf.pages:
        pages.append(Page(len(lines) + 1, page.number, page.label))
        lines.append(pdf_page_marker(page))
        starts.append(len(lines))
        for text in split_lines(page.text.replace("\r\n", "\n").replace("\r", "\n")):
            after_marker = len(lines) == pages[-1].line
            if text.strip() and (after_marker or not lines[-1].strip() or _SENTENCE_END.search(lines[-1])):
                starts.append(len(lines) + 1)
            lines.append(text)
    markers = {page.line for page in pages}
    searchable = ["" if n in markers else searchable_text(line) for n, line in enumerate(lines, 1)]
    headings = _outline_headings(pdf.outline, pages, lines)
    first_text = next((line for line, meant in zip(lines, searchable, strict=True) if meant.strip()), None)
    return DocumentText(lines=tuple(lines), searchable=tuple(searchable), body_start=1, headings=headings,
                        block_starts=tuple(sorted({*starts, *(h.line for h in headings)})),
                        # Split at headings by default: one chunk for a whole PDF would cite all its pages.
                        metadata={"rag_chunk": "headings", **{key: field_value(value) for key, value in pdf.metadata.items()}},
                        title=metadata_text(nfc(pdf.title or first_text or "")) or None, pages=tuple(pages),
                        warnings=tuple(f"{path}: {warning}" for warning in pdf.warnings))


def _outline_headings(outline: Sequence[PdfOutlineEntry], pages: Sequence[Page], lines: Sequence[str]) -> tuple[Heading, ...]:
    """Each outline entry at the first line of its page, at or after the entry before it, that
    starts with its title (case and spacing aside); else at its page's first line of text. In
    order: an entry never lands before the one before it."""
    by_number = {page.number: page for page in pages}
    ends = {page.number: (pages[i + 1].line - 1 if i + 1 < len(pages) else len(lines)) for i, page in enumerate(pages)}
    headings: list[Heading] = []
    for entry in outline:
        page = by_number.get(entry.page)
        if page is None:
            continue
        floor = max(page.line, headings[-1].line if headings else 0)
        wanted = " ".join(entry.title.casefold().split())
        span = range(floor, ends[entry.page] + 1)
        found = next((n for n in span if wanted and " ".join(lines[n - 1].casefold().split()).startswith(wanted)), None)
        if found is None:
            found = next((n for n in span if n > page.line and lines[n - 1].strip()), floor)
        headings.append(Heading(max(found, floor), max(1, entry.level), metadata_text(nfc(entry.title))))
    return tuple(headings)


_PDF_HINTS = (("no text layer", "leave it out with .ragignore, or give it a text layer (ocrmypdf) and ingest again"),
              ("encrypted", "save a copy without a password, or leave it out with .ragignore"))


def read_pdf(raw: bytes, path: str) -> DocumentText:
    """PDF: the text layer, page by page, cited by physical page and printed page label; headings
    from the outline; the document information's keys (a custom /lifecycle too). A PDF without a
    text layer (a scan), with a password or damaged is document_invalid, never indexed as empty."""
    try:
        pdf = pdf_extractor().extract(raw, path)
    except PdfRefused as exc:
        hint = next((h for start, h in _PDF_HINTS if exc.reason.startswith(start)),
                    "open it in a PDF reader and save it again, or leave it out with .ragignore")
        raise RagError(ErrorCode.DOCUMENT_INVALID, f"{path}: {exc.reason}", hint) from None
    return pdf_document(pdf, path)


# Code: source files read through a syntax tree (tree-sitter) into symbols, the units a code
# chunk follows. Opt-in (RAG_CODE / ingest --code): a repository is full of files that are not
# documentation, and a docs corpus must not change because code sits beside it.


@dataclass(frozen=True)
class CodeSymbol:
    """One definition of a source file: a function, a method (`Class.method`, `Type.Method`), or a
    class or type. Lines are 1-based as stored; `start` includes its decorators and the doc
    comment directly above it."""

    name: str  # qualified: Outer.Inner.method
    start: int
    end: int  # inclusive


@dataclass(frozen=True)
class CodeStructure:
    """What chunking needs of a source file beyond its lines: its language, its symbols (outer
    before inner, in file order) and the lines where a statement starts, where a symbol too long
    for one chunk may be cut."""

    language: str
    symbols: tuple[CodeSymbol, ...] = ()
    statement_starts: tuple[int, ...] = ()  # 1-based, sorted


@dataclass(frozen=True)
class CodeGrammar:
    """How one language's syntax tree names its symbols. `definitions`: node type -> whether its
    members are symbols of their own (a class, an impl block); `transparent`: nodes whose children
    are read as if at the level above (a decorator wrapper, an `export`, `if WIN:` at module level);
    `bodies`: the node types that hold a container's members."""

    module: str  # the grammar package, imported when the first file of the language is read
    entry: str  # its function that returns the language
    definitions: Mapping[str, bool]
    transparent: frozenset[str]
    bodies: frozenset[str]


_COMMON_TRANSPARENT = frozenset({
    "decorated_definition", "if_statement", "else_clause", "elif_clause", "try_statement", "except_clause",
    "finally_clause", "with_statement", "for_statement", "while_statement", "match_statement", "case_clause",
    "block", "export_statement", "attribute_item", "ambient_declaration"})
CODE_GRAMMARS: dict[str, CodeGrammar] = {
    "python": CodeGrammar("tree_sitter_python", "language",
                          {"function_definition": False, "class_definition": True},
                          _COMMON_TRANSPARENT, frozenset({"block"})),
    "go": CodeGrammar("tree_sitter_go", "language",
                      {"function_declaration": False, "method_declaration": False, "type_spec": False},
                      _COMMON_TRANSPARENT | {"type_declaration"}, frozenset()),
    "javascript": CodeGrammar("tree_sitter_javascript", "language",
                              {"function_declaration": False, "generator_function_declaration": False,
                               "class_declaration": True, "method_definition": False, "variable_declarator": False},
                              _COMMON_TRANSPARENT | {"lexical_declaration", "variable_declaration"},
                              frozenset({"class_body"})),
    "typescript": CodeGrammar("tree_sitter_typescript", "language_typescript",
                              {"function_declaration": False, "generator_function_declaration": False,
                               "class_declaration": True, "abstract_class_declaration": True,
                               "interface_declaration": False, "type_alias_declaration": False,
                               "enum_declaration": False, "method_definition": False, "variable_declarator": False,
                               "internal_module": True, "module": True},
                              _COMMON_TRANSPARENT | {"lexical_declaration", "variable_declaration",
                                                     "expression_statement"},
                              frozenset({"class_body", "statement_block"})),
    "tsx": CodeGrammar("tree_sitter_typescript", "language_tsx", {}, frozenset(), frozenset()),  # as typescript
    "rust": CodeGrammar("tree_sitter_rust", "language",
                        {"function_item": False, "struct_item": False, "enum_item": False, "union_item": False,
                         "trait_item": True, "impl_item": True, "mod_item": True, "macro_definition": False,
                         "type_item": False, "function_signature_item": False},
                        _COMMON_TRANSPARENT, frozenset({"declaration_list"})),
    "java": CodeGrammar("tree_sitter_java", "language",
                        {"class_declaration": True, "interface_declaration": True, "enum_declaration": True,
                         "record_declaration": True, "annotation_type_declaration": True,
                         "method_declaration": False, "constructor_declaration": False,
                         "compact_constructor_declaration": False},
                        _COMMON_TRANSPARENT | {"enum_body_declarations"},
                        frozenset({"class_body", "interface_body", "enum_body", "annotation_type_body"})),
}
CODE_GRAMMARS["tsx"] = replace(CODE_GRAMMARS["typescript"], entry="language_tsx")
_WRAPPERS = frozenset({"decorated_definition", "export_statement", "lexical_declaration", "variable_declaration",
                       "ambient_declaration"})
# A variable is a symbol only where it holds a function or a class (`const handler = async () => …`).
_FUNCTION_VALUES = frozenset({"arrow_function", "function_expression", "function", "generator_function",
                              "class", "class_expression"})
# Files of other languages (and configuration) in code corpora: fixed windows of lines, no symbol.
CODE_WINDOW_LINES = 40
WINDOWED_LANGUAGES = {
    ".c": "c", ".h": "c", ".cc": "cpp", ".cpp": "cpp", ".cxx": "cpp", ".hpp": "cpp", ".hh": "cpp", ".cs": "csharp",
    ".rb": "ruby", ".php": "php", ".kt": "kotlin", ".kts": "kotlin", ".swift": "swift", ".scala": "scala",
    ".lua": "lua", ".pl": "perl", ".r": "r", ".dart": "dart", ".ex": "elixir", ".exs": "elixir", ".erl": "erlang",
    ".hs": "haskell", ".ml": "ocaml", ".clj": "clojure", ".zig": "zig", ".nim": "nim", ".jl": "julia",
    ".sh": "shell", ".bash": "shell", ".zsh": "shell", ".ps1": "powershell", ".sql": "sql", ".proto": "protobuf",
    ".graphql": "graphql", ".gql": "graphql", ".vue": "vue", ".svelte": "svelte", ".css": "css",
    ".scss": "scss", ".yaml": "yaml", ".yml": "yaml", ".toml": "toml", ".json": "json", ".ini": "ini",
    ".cfg": "ini", ".tf": "terraform", ".gradle": "gradle", ".cmake": "cmake", ".mk": "make",
}
# The first lines of a generated file say so (Go's convention, and @generated of many generators):
# such a file is left out like one marked `rag: false`; its source is what a reader searches.
GENERATED_MARK = re.compile(r"^.{0,8}(?:Code generated .{0,200}DO NOT EDIT|@generated\b)", re.MULTILINE)
GENERATED_MARK_BYTES = 2048
_COMMENT_LINE = re.compile(r"\s*(?://|#(?!!)|/\*|\*|--|;)")  # a doc comment's or attribute's (#[derive]) lines; not #!


def code_language(path: str) -> str | None:
    """The language of a source file by its extension (None: not a code file)."""
    extension = file_extension(path)
    return _LANGUAGE_BY_EXTENSION.get(extension) or WINDOWED_LANGUAGES.get(extension)


@functools.cache
def _code_language(language: str) -> Any:
    import tree_sitter

    grammar = CODE_GRAMMARS[language]
    try:
        module = importlib.import_module(grammar.module)
    except ModuleNotFoundError as exc:
        raise missing_dependency(exc, "ingest") from None
    return tree_sitter.Language(getattr(module, grammar.entry)())


def _code_parser(language: str) -> Any:
    """A parser of its own for each file (a parser is not shared between threads; making one is cheap)."""
    import tree_sitter

    return tree_sitter.Parser(_code_language(language))


def read_code(raw: bytes, path: str) -> DocumentText:
    """A source file: its lines as stored, its symbols by its syntax tree where the language has a
    grammar here (else none: it is cut in fixed windows). A file marked generated is read as
    `rag: false` (left out and counted)."""
    text = decode_text(raw, path)
    lines = tuple(split_lines(text))
    language = code_language(path) or "text"
    metadata: dict[str, Any] = {}
    warnings_: tuple[str, ...] = ()
    if GENERATED_MARK.search(text[:GENERATED_MARK_BYTES]):
        metadata["rag"] = False
        warnings_ = (f"{path}: generated code (marked in its first lines): left out",)
    structure = CodeStructure(language)
    if language in CODE_GRAMMARS and not metadata:
        structure = code_structure(raw, lines, language)
    return DocumentText(lines=lines, searchable=tuple(searchable_text(line) for line in lines), body_start=1,
                        headings=(), block_starts=structure.statement_starts, metadata=metadata, title=path,
                        warnings=warnings_, code=structure)


def code_structure(raw: bytes, lines: Sequence[str], language: str) -> CodeStructure:
    """A file's symbols and statement starts, from its syntax tree (tree-sitter reads a file with
    syntax errors too: what it can tell apart still counts)."""
    grammar = CODE_GRAMMARS[language]
    tree = _code_parser(language).parse(raw)
    symbols: list[CodeSymbol] = []
    starts: set[int] = set()
    _collect_symbols(tree.root_node, grammar, "", None, lines, symbols, starts)
    return CodeStructure(language, tuple(sorted(symbols, key=lambda s: (s.start, -s.end))), tuple(sorted(starts)))


def _last_line(node: Any) -> int:
    """A node's last line, 1-based (a node ending at column 0 ends on the line before)."""
    row, column = node.end_point
    return max(node.start_point[0] + 1, row if column == 0 else row + 1)


# Syntax nodes looked into for symbols: deeper ones stay in the chunk of the symbol around them (every
# line is still in a chunk), so hostile nesting (thousands of blocks) costs no recursion.
CODE_NESTING_MAX = 64


def _collect_symbols(node: Any, grammar: CodeGrammar, outer: str, wrapped_at: int | None, lines: Sequence[str],
                     symbols: list[CodeSymbol], starts: set[int], depth: int = 0) -> None:
    if depth > CODE_NESTING_MAX:
        return
    for child in node.named_children:
        first = child.start_point[0] + 1
        if _starts_line(lines, child):
            starts.add(first)
        if child.type in grammar.definitions and (name := _symbol_name(child)) is not None:
            qualified = f"{outer}.{name}" if outer else name
            start = _with_doc_comment(lines, min(first, wrapped_at or first), symbols)
            symbols.append(CodeSymbol(qualified, start, _last_line(child)))
            _statement_starts(child, lines, starts)
            if grammar.definitions[child.type]:
                for body in _bodies(child, grammar):
                    _collect_symbols(body, grammar, qualified, None, lines, symbols, starts, depth + 1)
        elif child.type in grammar.transparent:
            # A wrapper's first line (a decorator, `export`, `const`) is its definition's first line.
            wrapper = min(first, wrapped_at or first) if child.type in _WRAPPERS else None
            _collect_symbols(child, grammar, outer, wrapper, lines, symbols, starts, depth + 1)


def _bodies(node: Any, grammar: CodeGrammar) -> list[Any]:
    body = node.child_by_field_name("body")
    if body is not None:
        return [body]
    return [child for child in node.named_children if child.type in grammar.bodies]


def _starts_line(lines: Sequence[str], node: Any) -> bool:
    row, column = node.start_point
    return row < len(lines) and not lines[row][:column].strip()


def _statement_starts(node: Any, lines: Sequence[str], starts: set[int], depth: int = 0) -> None:
    """Lines where a statement of a definition starts (its body's, and theirs, a few levels down):
    where a piece of a long symbol may begin."""
    if depth > 4:
        return
    for child in node.named_children:
        if _starts_line(lines, child):
            starts.add(child.start_point[0] + 1)
        if child.end_point[0] > child.start_point[0]:
            _statement_starts(child, lines, starts, depth + 1)


def _node_text(node: Any | None) -> str | None:
    return node.text.decode("utf-8", "replace") if node is not None and node.text else None


def _symbol_name(node: Any) -> str | None:
    """A definition's name: its own, a Go method's with its receiver's type, a Rust impl block's type."""
    if node.type == "method_declaration" and (receiver := node.child_by_field_name("receiver")) is not None:
        types = [n for n in _descendants(receiver) if n.type == "type_identifier"]
        name = _node_text(node.child_by_field_name("name"))
        return f"{_node_text(types[0])}.{name}" if types and name else name
    if node.type == "impl_item":
        kind = node.child_by_field_name("type")
        found = [n for n in [kind, *_descendants(kind)] if n is not None and n.type == "type_identifier"] if kind else []
        return _node_text(found[0]) if found else _node_text(kind)
    if node.type == "variable_declarator":
        value = node.child_by_field_name("value")
        return _node_text(node.child_by_field_name("name")) if value is not None and value.type in _FUNCTION_VALUES else None
    name = node.child_by_field_name("name")
    return metadata_text(_node_text(name) or "", 200) or None if name is not None else None


def _descendants(node: Any) -> Iterator[Any]:
    for child in node.named_children:
        yield child
        yield from _descendants(child)


def _with_doc_comment(lines: Sequence[str], start: int, symbols: Sequence[CodeSymbol]) -> int:
    """A symbol's first line with the comment lines directly above it (its doc comment), never a
    line of a symbol before it."""
    taken = max((s.end for s in symbols if s.end < start), default=0)
    while start - 1 > taken and _COMMENT_LINE.match(lines[start - 2]) and lines[start - 2].strip():
        start -= 1
    return start


def chunk_code(doc: SourceDocument, max_tokens: int, min_tokens: int, context_tokens: int | None = None) -> list[Chunk]:
    """Split a source file into symbol chunks:
    1. each line goes to the innermost symbol holding it (a class keeps its own lines: header,
       docstring, attributes; its methods are chunks of their own); the code between symbols
       (imports, constants, a module docstring) is grouped, a file without a grammar here cut in
       windows of CODE_WINDOW_LINES;
    2. runs without a word (blank lines, closing braces) join the run before them, so every line
       of the file is in exactly one chunk, a container's header alone on its line joins its
       first member, and neighbouring runs of one name (overloads, a property's setter) join
       within the budget;
    3. a run over max_tokens is cut at statement starts (else between lines), every piece keeping
       the symbol's name; a single line over the context is cut in pieces that share it."""
    code = doc.text.code
    assert code is not None, doc.path
    lines, searchable = doc.lines, doc.text.searchable
    if not any(line.strip() for line in searchable):
        return []
    context_tokens = max(max_tokens, context_tokens or max_tokens)
    body = _Body(tuple(estimate_tokens(line) for line in searchable), (), (0,), ("",))
    runs = _owned_runs(code, len(lines))
    if code.language not in CODE_GRAMMARS:
        runs = [(s, min(s + CODE_WINDOW_LINES, e), name) for s, e, name in runs
                for s in range(s, e, CODE_WINDOW_LINES)]
    runs = _same_names_joined(_headers_joined(_blank_runs_joined(runs, body, searchable), code), body, max_tokens)
    cuts = sorted({line - 1 for line in code.statement_starts})
    chunks: list[Chunk] = []
    for start, end, name in runs:
        for span in _code_pieces(body, _Span(start, end), cuts, max_tokens):
            text = "\n".join(lines[span.start:span.end]).strip("\n").rstrip()
            meant = "\n".join(searchable[span.start:span.end]).strip()
            parts = [(text, meant)]
            if span.end - span.start == 1 and body.tokens(span.start, span.end) > context_tokens:
                parts = [(part.strip(), searchable_text(part.strip()))
                         for part in _cut_long_line(text, max_tokens, min_tokens)]
            for part, part_meant in parts:
                chunks.append(Chunk(len(chunks), span.start + 1, span.end, name, part, part_meant, symbol=name or None))
    return chunks


_WORD_CHAR = re.compile(r"\w")


def _owned_runs(code: CodeStructure, line_count: int) -> list[tuple[int, int, str]]:
    """Runs of lines [start, end) (0-based) with the same innermost symbol, and its name ("" for none)."""
    owner: list[int] = [-1] * line_count
    for n, symbol in enumerate(code.symbols):  # outer before inner: the inner one takes its lines
        for line in range(symbol.start - 1, min(symbol.end, line_count)):
            owner[line] = n
    runs: list[tuple[int, int, str]] = []
    start = 0
    for line in range(1, line_count + 1):
        if line == line_count or owner[line] != owner[start]:
            runs.append((start, line, code.symbols[owner[start]].name if owner[start] >= 0 else ""))
            start = line
    return runs


def _blank_runs_joined(runs: Sequence[tuple[int, int, str]], body: _Body,
                       searchable: Sequence[str]) -> list[tuple[int, int, str]]:
    """Runs with no word in them (blank lines, a class's closing brace) joined to the run before
    them (the first: to the next)."""
    out: list[tuple[int, int, str]] = []
    pending_start: int | None = None
    for start, end, name in runs:
        if not body.meaning(start, end) or not any(_WORD_CHAR.search(line) for line in searchable[start:end]):
            if out:
                out[-1] = (out[-1][0], end, out[-1][2])
            elif pending_start is None:
                pending_start = start
            continue
        out.append((start if pending_start is None else pending_start, end, name))
        pending_start = None
    return out


def _headers_joined(runs: Sequence[tuple[int, int, str]], code: CodeStructure) -> list[tuple[int, int, str]]:
    """A container's header alone on its line (`impl Point {`, `class Foo:` without a docstring)
    joined to its first member's run: a chunk of one line that says nothing but a name."""
    out: list[tuple[int, int, str]] = []
    for start, end, name in runs:
        if out and out[-1][1] - out[-1][0] == 1 and out[-1][2] and name.startswith(out[-1][2] + ".") \
                and any(s.start == out[-1][0] + 1 for s in code.symbols if s.name == out[-1][2]):
            start = out.pop()[0]
        out.append((start, end, name))
    return out


def _same_names_joined(runs: Sequence[tuple[int, int, str]], body: _Body, max_tokens: int) -> list[tuple[int, int, str]]:
    """Neighbouring runs of one name joined where the budget allows: overload stubs with their
    implementation (`@overload def get(...)` x 3, then `def get`), a property with its setter."""
    out: list[tuple[int, int, str]] = []
    for start, end, name in runs:
        if out and name and out[-1][2] == name and body.tokens(out[-1][0], end) <= max_tokens:
            start = out.pop()[0]
        out.append((start, end, name))
    return out


def _code_pieces(body: _Body, span: _Span, cuts: Sequence[int], max_tokens: int) -> list[_Span]:
    """A run cut into pieces within max_tokens: at the last statement start that fits, else after
    the last blank line that fits, else at the last line that fits (a single line over the budget
    is a piece of its own)."""
    pieces: list[_Span] = []
    start = span.start
    while body.tokens(start, span.end) > max_tokens:
        end = start + 1  # the last line end that fits (at least one line)
        while end < span.end and body.tokens(start, end + 1) <= max_tokens:
            end += 1
        # A statement start that leaves at least half a budget behind, else a blank line, else any line.
        at = [c for c in cuts[bisect.bisect_right(cuts, start):bisect.bisect_right(cuts, end)]
              if c < span.end and body.tokens(start, c) >= max_tokens // 2]
        blank = [c for c in range(end, start, -1) if not body.meanings[c - 1] and body.tokens(start, c) >= max_tokens // 2]
        cut = at[-1] if at else blank[0] if blank else end
        if cut >= span.end:
            break
        pieces.append(_Span(start, cut))
        start = cut
    pieces.append(_Span(start, span.end))
    return pieces


# Every format a reader takes, by its RAG_FORMATS name. `text` is opt-in: repositories are full of
# requirements.txt and LICENSE.txt files that are not documentation.
READERS = (
    Reader("markdown", (".md", ".markdown"), "text/markdown", read_markdown, markup_inline, version=5),
    Reader("mdx", (".mdx",), "text/mdx", read_mdx, markup_inline, version=4),
    Reader("rst", (".rst",), "text/x-rst", read_rst, rst_inline_searchable, version=5),
    Reader("asciidoc", (".adoc", ".asciidoc"), "text/asciidoc", read_asciidoc, asciidoc_inline_searchable, version=4),
    Reader("pdf", (".pdf",), "application/pdf", read_pdf, searchable_text, extracted=True),
    Reader("text", (".txt",), "text/plain", read_plain_text, searchable_text, read_by_default=False),
    # Code (RAG_CODE): one reader per language with symbols, one for the other source files.
    Reader("python", (".py", ".pyi"), "text/x-python", read_code, searchable_text, read_by_default=False, kind="code"),
    Reader("go", (".go",), "text/x-go", read_code, searchable_text, read_by_default=False, kind="code"),
    Reader("javascript", (".js", ".mjs", ".cjs", ".jsx"), "text/javascript", read_code, searchable_text,
           read_by_default=False, kind="code"),
    Reader("typescript", (".ts", ".mts", ".cts"), "text/x-typescript", read_code, searchable_text,
           read_by_default=False, kind="code"),
    Reader("tsx", (".tsx",), "text/x-tsx", read_code, searchable_text, read_by_default=False, kind="code"),
    Reader("rust", (".rs",), "text/x-rust", read_code, searchable_text, read_by_default=False, kind="code"),
    Reader("java", (".java",), "text/x-java", read_code, searchable_text, read_by_default=False, kind="code"),
    Reader("code-text", tuple(WINDOWED_LANGUAGES), "text/plain", read_code, searchable_text, read_by_default=False,
           kind="code"),
)
_LANGUAGE_BY_EXTENSION = {extension: reader.format for reader in READERS if reader.format in CODE_GRAMMARS
                          for extension in reader.extensions}
CODE_FORMATS = tuple(reader.format for reader in READERS if reader.kind == "code")
FORMATS = tuple(reader.format for reader in READERS)
DEFAULT_FORMATS = tuple(reader.format for reader in READERS if reader.read_by_default)
_READER_BY_EXTENSION = {extension: reader for reader in READERS for extension in reader.extensions}


def file_extension(path: str) -> str:
    """A file name's extension as readers are picked by it: lower case, with the dot ("" for none)."""
    return PurePosixPath(path).suffix.lower()


def reader_for(path: str, formats: Collection[str] = FORMATS) -> Reader | None:
    """The reader of a file by its extension, if its format is among `formats`."""
    reader = _READER_BY_EXTENSION.get(file_extension(path))
    return reader if reader is not None and reader.format in formats else None


# ---------------------------------------------------------------------------
# Headings and chunking.

# Bump when chunking or keyword terms change: it is part of the manifest, so stores rebuild.
CHUNKER_VERSION = "5"
HEADING_SEPARATOR = " > "
MERGED_HEADING_SEPARATOR = "; "  # between the headings a merged chunk covers (merged_heading)


@dataclass(frozen=True)
class Chunk:
    index: int
    start_line: int  # 1-based, inclusive, in the original file
    end_line: int
    heading: str  # heading path, e.g. "Deploy runbook > Rollback > Database"
    text: str  # the lines as written
    searchable: str  # the same lines as embedded and keyword-indexed (the reader's searchable text)
    symbol: str | None = None  # a code chunk's symbol (Class.method); None for documents and code between symbols


class Passage(Protocol):
    """What section_range reads of a passage: a Chunk as ingest makes it, a ChunkRow as the server reads it."""

    @property
    def start_line(self) -> int: ...
    @property
    def end_line(self) -> int: ...
    @property
    def heading(self) -> str: ...


def section_lines(headings: Sequence[Heading], passage: Passage) -> tuple[int, int] | None:
    """The lines of the section a passage's heading path names: from that heading (the last one of
    its text at or above the passage's end) to the line before the next heading of the same or a
    higher level (the file's end: len-free, a caller clips it). None for a passage under no heading."""
    leaf = passage.heading.split(MERGED_HEADING_SEPARATOR)[0].split(HEADING_SEPARATOR)[-1]
    at = max((n for n, h in enumerate(headings) if h.text == leaf and h.line <= passage.end_line), default=None,
             key=lambda n: headings[n].line)
    if at is None:
        return None
    end = next((h.line - 1 for h in headings[at + 1:] if h.level <= headings[at].level), sys.maxsize)
    return headings[at].line, end


def section_range(ordered: Sequence[Passage], at: int, headings: Sequence[Heading] | None) -> tuple[int, int]:
    """The lines of the section of ordered[at] (a file's passages in line order), always holding the
    passage: from its heading to the next heading of the same or a higher level, by the file's
    `headings` where its reader gives them; else (a PDF, whose reading is dear) the run of passages
    under its heading path. Ingest records it with each chunk (chunks.section_start, section_end)."""
    passage = ordered[at]
    if headings is not None and (found := section_lines(headings, passage)) is not None:
        return min(found[0], passage.start_line), max(found[1], passage.end_line)
    own = passage.heading.split(MERGED_HEADING_SEPARATOR)

    def under(other: Passage) -> bool:
        return any(part == mine or part.startswith(mine + HEADING_SEPARATOR)
                   for part in other.heading.split(MERGED_HEADING_SEPARATOR) for mine in own)

    first = last = at
    while first > 0 and under(ordered[first - 1]):
        first -= 1
    while last + 1 < len(ordered) and under(ordered[last + 1]):
        last += 1
    return min(ordered[first].start_line, passage.start_line), max(ordered[last].end_line, passage.end_line)


PassageT = TypeVar("PassageT", bound=Passage)


def in_file_order(passages: Iterable[PassageT], index: Callable[[PassageT], int]) -> list[PassageT]:
    """A file's passages in line order, as section_range takes them: by lines, then chunk index."""
    return sorted(passages, key=lambda p: (p.start_line, p.end_line, index(p)))


def section_ranges(chunks: Sequence[Chunk], headings: Sequence[Heading] | None) -> dict[int, tuple[int, int]]:
    """section_range of each of a file's chunks, by chunk index."""
    ordered = in_file_order(chunks, lambda c: c.index)
    return {c.index: section_range(ordered, n, headings) for n, c in enumerate(ordered)}


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
        for piece in _word_pieces(word):
            # Only a run of letters larger than the whole budget is cut inside (three letters a token).
            yield from [piece] if searchable_tokens(piece) <= max_tokens else _ESTIMATE_ATOMS.findall(piece)


def _word_pieces(word: str) -> Iterator[str]:
    """A word's data: URIs and URLs whole, the rest in runs of letters and digits and single
    symbols, left to right (where a data: URI and a URL start together, the data: URI)."""
    wholes = sorted([(m.start(), 0, m.end()) for m in _DATA_URI.finditer(word)]
                    + [(start, 1, end) for start, _, end in _urls(word, payload=False)])
    at = 0
    for start, _, end in wholes:
        if start < at:
            continue  # inside the one before: a data: URI's payload holds URL characters, and the other way
        yield from _LETTERS_OR_SYMBOL.findall(word, at, start)
        yield word[start:end]
        at = end
    yield from _LETTERS_OR_SYMBOL.findall(word, at)


_WORD_WITH_SPACE = re.compile(r"\S+\s*|\s+")
_LETTERS_OR_SYMBOL = re.compile(r"[A-Za-z0-9_]+|.", re.DOTALL)
_ESTIMATE_ATOMS = re.compile(r"[A-Za-z]{1,3}|.", re.DOTALL)


def chunk_document(doc: SourceDocument, max_tokens: int, min_tokens: int,
                   context_tokens: int | None = None) -> list[Chunk]:
    """Split a document's body into chunks of about `max_tokens`, estimated on its searchable text
    (a 1.5 KB playground link costs a few tokens); chunk texts are the document's lines as written,
    beside them the same lines as the reader made them searchable.

    `context_tokens` is what the model takes of a chunk with its heading (max_tokens when not given):
    - line ranges are contiguous and cover the body exactly once;
    - a line is cut only when it cannot fit the context with its heading: its pieces (each within
      max_tokens, none under min_tokens) are the only chunks that share a line;
    - no chunk has under min_tokens of searchable text unless the document is one chunk: a small
      span joins a neighbour, over max_tokens if need be, up to context_tokens;
    - a span with no searchable text (blank lines, comments) joins the chunk before it;
    - a chunk's heading is the heading path of its first section, then the last heading of every
      other section it covers (merged_heading); text before the first heading has the title.
    """
    if doc.text.code is not None:
        return chunk_code(doc, max_tokens, min_tokens, context_tokens)
    first = doc.body_start - 1
    lines, searchable = doc.lines[first:], doc.text.searchable[first:]
    if not any(line.strip() for line in searchable):
        return []
    context_tokens = max(max_tokens, context_tokens or max_tokens)
    path_at: dict[int, str] = {0: doc.title}
    stack: list[Heading] = []
    for heading in doc.text.headings:
        stack = [h for h in stack if h.level < heading.level] + [heading]
        path_at[heading.line - 1 - first] = metadata_text(HEADING_SEPARATOR.join(h.text for h in stack if h.text))
    starts = sorted(path_at)
    body = _Body(tuple(estimate_tokens(line) for line in searchable),
                 tuple(start - 1 - first for start in doc.text.block_starts), tuple(starts),
                 tuple(path_at[s] for s in starts))
    if doc.chunk_mode == "whole" and body.tokens(0, len(lines)) <= max_tokens:
        spans = [_Span(0, len(lines))]
    else:
        sections = [_Span(s, e) for s, e in zip(starts, [*starts[1:], len(lines)], strict=True)]
        pieces = [piece for section in sections for piece in _split_oversized(body, section, max_tokens)]
        spans = _merge_small(body, pieces, min_tokens, max_tokens, context_tokens)
    chunks: list[Chunk] = []
    offset = doc.body_start
    inline = doc.reader.inline
    for span in spans:
        meant = "\n".join(searchable[span.start:span.end]).strip()
        if not meant:
            # Spans with nothing searchable (trailing blank lines, an underline) join the previous
            # chunk: its range, and its text as written.
            if chunks:
                chunks[-1] = _extend(chunks[-1], lines, offset, span.end)
            continue
        text = "\n".join(lines[span.start:span.end]).strip()
        paths = body.headings(span.start, span.end)
        # A whole document is named by its first heading (or title), not by all of them.
        heading = merged_heading(paths[:1] if doc.chunk_mode == "whole" and len(spans) == 1 else paths)
        # A single line over the context is the one cut (the embedder halves anything else it refuses).
        cut = (_cut_long_line(text, max_tokens, min_tokens)
               if "\n" not in text and _embedded_tokens(body, span) > context_tokens else [text])
        # a piece of a cut line is read out of its context; a line left whole keeps its reading
        parts = [(part.strip(), inline(part.strip())) for part in cut] if len(cut) > 1 else [(text, meant)]
        for part, part_meant in parts:
            chunks.append(Chunk(len(chunks), span.start + offset, span.end + offset - 1, heading, part, part_meant))
    if chunks and chunks[0].start_line > doc.body_start:  # the lines before the first content are its
        chunks[0] = _extend(chunks[0], lines, offset, chunks[0].end_line - offset + 1, start=0)
    return chunks


def _extend(chunk: Chunk, lines: Sequence[str], offset: int, end: int, start: int | None = None) -> Chunk:
    """`chunk` grown to the body's line indexes start..end (end exclusive; start: where it starts),
    its text with it: its lines as written, or, for a piece of a cut line, the piece and the lines
    around it."""
    first, after = chunk.start_line - offset, chunk.end_line - offset + 1
    start = first if start is None else start
    if chunk.text == "\n".join(lines[first:after]).strip():
        text = "\n".join(lines[start:end]).strip()
    else:
        text = "\n".join([*lines[start:first], chunk.text, *lines[after:end]]).strip()
    return replace(chunk, start_line=start + offset, end_line=end + offset - 1, text=text)


# ---------------------------------------------------------------------------
# Embedding prefixes: a small registry keyed by model family.


@dataclass(frozen=True)
class PrefixScheme:
    name: str
    document: str  # format string with {title} and {text}
    query: str  # format string with {query}
    # Queries against code (search_corpus scope "code"), where the model documents a task for it.
    code_query: str | None = None

    def document_text(self, title: str, text: str) -> str:
        return self.document.format(title=title or "none", text=text)

    def query_text(self, query: str, code: bool = False) -> str:
        return (self.code_query if code and self.code_query else self.query).format(query=query)


_RETRIEVAL_INSTRUCTION = "Represent this sentence for searching relevant passages: {query}"
PREFIX_SCHEMES: dict[str, PrefixScheme] = {
    scheme.name: scheme
    for scheme in (
        PrefixScheme("embeddinggemma", "title: {title} | text: {text}", "task: search result | query: {query}",
                     "task: code retrieval | query: {query}"),
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
    """'library/EmbeddingGemma:latest' -> 'embeddinggemma' (namespace and tag do not change the
    family); the names OpenAI-compatible servers report are read alike: a file name
    ('/models/embeddinggemma-300M-Q8_0.gguf' -> 'embeddinggemma-300m-q8_0') and LM Studio's
    'text-embedding-' prefix ('text-embedding-nomic-embed-text-v1.5' -> 'nomic-embed-text-v1.5')."""
    name = model.strip().lower().rsplit("/", 1)[-1]
    name = name.split(":", 1)[0].removesuffix(".gguf")
    return name.removeprefix("text-embedding-") if name != "text-embedding-" else name


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
    """What ingest sends to the embedder for a chunk: the heading path leads the searchable text
    (a chunk's `searchable`, or a stored passage's text: searchable_text changes neither again)."""
    text = searchable_text(text)
    if heading and heading != title:
        text = f"{searchable_text(heading)}\n\n{text}"
    return scheme.document_text(title, text)


def embedded_code_text(scheme: PrefixScheme, path: str, symbol: str | None, text: str) -> str:
    """What ingest sends to the embedder for a code chunk: its file and symbol name it (the title
    where the scheme has one, `title: src/retry.py Client.send | text: …`; else they lead the text)."""
    name = f"{path} {symbol}" if symbol else path
    text = searchable_text(text)
    if "{title}" not in scheme.document:
        text = f"{searchable_text(name)}\n\n{text}"
    return scheme.document_text(name, text)


def embedded_chunk_text(scheme: PrefixScheme, doc: SourceDocument, chunk: Chunk) -> str:
    """The text embedded for a chunk of `doc`, a document's or a source file's."""
    if doc.kind == "code":
        return embedded_code_text(scheme, doc.path, chunk.symbol, chunk.searchable)
    return embedded_document_text(scheme, doc.title, chunk.heading, chunk.searchable)


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


def path_terms(text: str) -> list[str]:
    """The steps of the dotted, `::` and `/` paths in indexed text, and each two steps that follow
    one another (the keyword index's chunk_steps), so that an identifier held inside a longer path
    is found: `bulk_import` in `records.bulk_import`, `Flask.route` in `flask.Flask.route`, `bar` in
    `Foo::bar`."""
    steps: dict[str, None] = {}
    for run in _RUN.findall(unicodedata.normalize("NFKC", searchable_text(text))):
        if "." in run or ":" in run or "/" in run or "$" in run or "@" in run:
            for piece in _IDENT_PIECE.findall(run):
                steps.update(dict.fromkeys(_path_steps(piece.strip(".-/:$@").lower())))
    return [step for step in steps if step not in _STOP_WORDS]


_PATH_SEPARATOR = re.compile(r"(::|[./:$@])")
PATH_STEPS_PAIRED = 8  # a path of more steps is indexed by its steps alone (a URL: not every pair of them)


def _path_steps(piece: str) -> list[str]:
    """The steps of a dotted, `::` or `/` path, and each two that follow one another, so that an
    identifier held inside a longer path is found (`bulk_import` in `records.bulk_import`,
    `Flask.route` in `flask.Flask.route`, `bar` in `Foo::bar`)."""
    if not _PATH_SEPARATOR.search(piece):
        return []
    split = _PATH_SEPARATOR.split(piece)
    steps = [step for step in split[::2] if step]
    if len(steps) > PATH_STEPS_PAIRED:
        return steps
    pairs = [f"{split[i]}{split[i + 1]}{split[i + 2]}" for i in range(0, len(split) - 2, 2) if split[i] and split[i + 2]]
    return steps + pairs


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
# An ingest watcher (`ingest.py --watch`, alone or started by `server.py --watch`): the lock it
# holds while it lives (one watcher a store; the kernel frees it when the holder dies, so a
# crashed watcher never blocks the next) and what it is doing, for the server to tell.
WATCH_LOCK_FILE = "watch.lock"
WATCH_STATUS_FILE = "WATCH.json"
WATCH_STATUS_MAX_BYTES = 1 << 16
CHROMA_SUBDIR = "chroma"
KEYWORD_DB = "keywords.sqlite3"
COLLECTION_BY_LIFECYCLE = {"active": "chunks_active", "superseded": "chunks_superseded"}
# Chroma metadata keys written on every chunk (chunk_metadata builds them, in this order).
META_KEYS = ("path", "title", "heading", "chunk_index", "start_line", "end_line", "lifecycle",
             "content_hash", "mtime_ns", "chunk_mode", "kind", "symbol", "language")
KINDS = ("doc", "code")


def chunk_metadata(doc: SourceDocument, chunk: Chunk, content_hash: str, mtime_ns: int) -> dict[str, Any]:
    """What is stored with every chunk's vector, `lifecycle` included (the pre-filter's key); a
    document's chunk has "" for symbol and language (Chroma keeps no null)."""
    return dict(zip(META_KEYS, (doc.path, doc.title, chunk.heading, chunk.index, chunk.start_line, chunk.end_line,
                                doc.lifecycle, content_hash, mtime_ns, doc.chunk_mode, doc.kind, chunk.symbol or "",
                                doc.language or ""), strict=True))

# The keyword index's schema: numbered, append-only migrations, each run once per index in order;
# `PRAGMA user_version` records how many have run. Ingest runs the missing ones when it opens an
# index (migrate_keyword_index); the server never writes, it reads the version (schema_version).
# A store written before versions were recorded (user_version 0) has some of the tables and columns:
# its migrations run too, each adding only what is missing.


@dataclass(frozen=True)
class Migration:
    number: int
    # DDL, a statement each; `ALTER TABLE t ADD COLUMN c` is skipped where the column exists.
    statements: tuple[str, ...]
    # Values the new columns need in rows written before them (the embedder's prefix scheme at hand).
    fill: Callable[[Any, PrefixScheme], None] | None = None


def _fill_embed_keys(db: Any, scheme: PrefixScheme) -> None:
    """Chunks written before they carried their embed_key get it, computed from what the rows hold
    (title, heading path, text), so their vectors can be reused too."""
    rows = db.execute("SELECT c.rowid, coalesce(d.title, c.path), c.heading, c.text FROM chunks c "
                      "LEFT JOIN documents d ON d.path = c.path WHERE c.embed_key IS NULL").fetchall()
    db.executemany("UPDATE chunks SET embed_key = ? WHERE rowid = ?", [
        (embed_key(embedded_document_text(scheme, title, heading, text)), rowid) for rowid, title, heading, text in rows])


def _fill_cjk_shares(db: Any, scheme: PrefixScheme) -> None:
    """Documents written before they carried their CJK share get it, from their chunks' text."""
    for (path,) in db.execute("SELECT path FROM documents WHERE cjk_share IS NULL").fetchall():
        text = "\n".join(t for (t,) in db.execute("SELECT text FROM chunks WHERE path = ? ORDER BY chunk_index", (path,)))
        db.execute("UPDATE documents SET cjk_share = ? WHERE path = ?", (round(cjk_share(text), 4), path))


def _fill_successors(db: Any, scheme: PrefixScheme) -> None:
    """None for active documents (successors count only on superseded ones); superseded ones stay
    NULL (not recorded): their rows cannot tell, so plan_changes reads those files again."""
    db.execute("UPDATE documents SET superseded_by = ? WHERE superseded_by IS NULL AND lifecycle != 'superseded'",
               (successors_column(()),))


def recount_common_terms(db: Any) -> None:
    """common_terms anew from FTS5's own counts (one walk of the whole index, as 'optimize')."""
    db.execute("CREATE VIRTUAL TABLE IF NOT EXISTS temp.fts_rows USING fts5vocab(main, chunks_fts, 'row')")
    db.execute("DELETE FROM common_terms")
    db.execute("INSERT INTO common_terms(term, passages) SELECT term, doc FROM temp.fts_rows WHERE doc >= ?",
               (COMMON_TERM_PASSAGES,))


def keyword_row(title: str, heading: str, text: str) -> tuple[str, str, str]:
    """A passage's chunks_fts row (title, heading, body), each column its terms space-joined: what
    ingest writes and common_terms counts."""
    return " ".join(indexed_terms(title)), " ".join(indexed_terms(heading)), " ".join(indexed_terms(text))


def passage_steps(title: str, heading: str, text: str) -> str:
    """A passage's chunk_steps row: the steps of the paths it holds (path_terms), space-joined."""
    return " ".join(path_terms(f"{title}\n{heading}\n{text}"))


def _fill_steps(db: Any, scheme: PrefixScheme) -> None:
    """Every passage's steps, anew (a store whose version was not recorded may hold some already);
    the next run publishes a new generation."""
    db.execute("DELETE FROM chunk_steps")
    rows = db.execute("SELECT c.rowid, coalesce(d.title, c.path), c.heading, coalesce(c.searchable, c.text) "
                      "FROM chunks c LEFT JOIN documents d ON d.path = c.path")
    for batch in iter(lambda: rows.fetchmany(1000), []):  # a million passages' text is not held at once
        db.executemany("INSERT INTO chunk_steps(rowid, steps) VALUES (?, ?)",
                       [(rowid, passage_steps(*columns)) for rowid, *columns in batch])
    db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('unpublished', '1')")


_FTS_TABLE = (f"CREATE VIRTUAL TABLE IF NOT EXISTS {{name}} USING fts5({{columns}}, "
              f"tokenize=\"unicode61 remove_diacritics 0 tokenchars '{FTS_TOKENCHARS}'\")")


KEYWORD_MIGRATIONS = (
    Migration(1, (
        "CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT NOT NULL)",
        # disk_path: the path relative to the corpus as the file system spells it (may be NFD);
        # real_path: its resolved absolute path at ingest. get_file re-resolves disk_path and insists
        # on real_path, which is how a file swapped for a symlink after ingest is caught.
        "CREATE TABLE IF NOT EXISTS documents(path TEXT PRIMARY KEY, title TEXT NOT NULL, lifecycle TEXT NOT NULL, "
        "chunk_mode TEXT NOT NULL, content_hash TEXT NOT NULL, size INTEGER NOT NULL, mtime_ns INTEGER NOT NULL, "
        "disk_path TEXT NOT NULL, real_path TEXT NOT NULL, line_count INTEGER NOT NULL, chunk_count INTEGER NOT NULL)",
        "CREATE TABLE IF NOT EXISTS chunks(id TEXT PRIMARY KEY, path TEXT NOT NULL, chunk_index INTEGER NOT NULL, "
        "start_line INTEGER NOT NULL, end_line INTEGER NOT NULL, heading TEXT NOT NULL, lifecycle TEXT NOT NULL, "
        "text TEXT NOT NULL)",
        "CREATE INDEX IF NOT EXISTS chunks_by_path ON chunks(path, chunk_index)",
        # Documents whose chunks are keyword-indexed but have no vectors yet (ingest ran while the
        # embedder could not embed them), with their chunk count; the next run that can embed takes them first.
        "CREATE TABLE IF NOT EXISTS vectors_pending(path TEXT PRIMARY KEY, chunks INTEGER NOT NULL)",
        _FTS_TABLE.format(name="chunks_fts", columns="title, heading, body"),
    )),
    # embed_key: embed_key() of the exact text embedded for the chunk: ingest reuses its vector for
    # any chunk with the same key.
    Migration(2, ("ALTER TABLE chunks ADD COLUMN embed_key TEXT",
                  "CREATE INDEX IF NOT EXISTS chunks_by_embed_key ON chunks(embed_key)"), _fill_embed_keys),
    # cjk_share: of the body's letters, what the server's language rules read per document.
    Migration(3, ("ALTER TABLE documents ADD COLUMN cjk_share REAL",), _fill_cjk_shares),
    # superseded_by: successors_column() of the document's successors; NULL: not recorded.
    Migration(4, ("ALTER TABLE documents ADD COLUMN superseded_by TEXT",), _fill_successors),
    # How many passages hold each term that was in at least COMMON_TERM_PASSAGES of them when the
    # keyword index was last compacted, kept exact by every write since (in the same transaction).
    # FTS5 counts a term's passages by walking its whole posting list: a common word's count is read
    # here instead. A term not listed is counted by FTS5 (fts5vocab).
    Migration(5, ("CREATE TABLE IF NOT EXISTS common_terms(term TEXT PRIMARY KEY, passages INTEGER NOT NULL) "
                  "WITHOUT ROWID",)),
    # Formats (readers): a chunk's searchable text where it differs from searchable_text(text) (NULL:
    # the text itself); a paged document's pages (pages_column()); the text extracted from a binary
    # document (PDF), which get_file serves: its lines are the ones chunks cite.
    Migration(6, ("ALTER TABLE chunks ADD COLUMN searchable TEXT",
                  "ALTER TABLE documents ADD COLUMN pages TEXT",
                  "CREATE TABLE IF NOT EXISTS extracted(path TEXT PRIMARY KEY, text TEXT NOT NULL)")),
    # The steps of each passage's dotted, `::` and `/` paths (path_terms), in a table of their own:
    # they make a passage hold an identifier, and change no passage's keyword rank (FTS5's bm25
    # measures a row's length over all its columns).
    Migration(7, (_FTS_TABLE.format(name="chunk_steps", columns="steps"),), _fill_steps),
    # A document's tags (tags_column()) and its own date (YYYY-MM-DD, "" for none), which search
    # filters on; NULL: not recorded yet (ingest reads the file again to record them, see keys_unrecorded).
    Migration(8, ("ALTER TABLE documents ADD COLUMN tags TEXT",
                  "ALTER TABLE documents ADD COLUMN dated TEXT")),
    # Code (RAG_CODE): each document's kind ("doc" or "code") and language, each chunk's kind (the
    # scope pre-filter of the keyword channel) and symbol (NULL for a document's and for code between
    # symbols). Rows written before are documents.
    Migration(9, ("ALTER TABLE documents ADD COLUMN kind TEXT NOT NULL DEFAULT 'doc'",
                  "ALTER TABLE documents ADD COLUMN language TEXT",
                  "ALTER TABLE chunks ADD COLUMN kind TEXT NOT NULL DEFAULT 'doc'",
                  "ALTER TABLE chunks ADD COLUMN symbol TEXT")),
    # Each chunk's section (section_range), which a search's section context spans: read, not worked
    # out from the file again for each hit. NULL: not recorded (the server works it out from the
    # file); a document's sections_recorded is 1 once its chunks carry theirs, NULL before (ingest
    # reads the file again to record them, see keys_unrecorded).
    Migration(10, ("ALTER TABLE chunks ADD COLUMN section_start INTEGER",
                   "ALTER TABLE chunks ADD COLUMN section_end INTEGER",
                   "ALTER TABLE documents ADD COLUMN sections_recorded INTEGER")),
    # The reader that read each document (Reader.stamp); NULL: read before it was recorded. Ingest
    # reads a document again when its reader has changed since (see DocumentRow.read_again).
    Migration(11, ("ALTER TABLE documents ADD COLUMN read_with TEXT",)),
)
KEYWORD_SCHEMA_VERSION = KEYWORD_MIGRATIONS[-1].number
_ADD_COLUMN = re.compile(r"ALTER TABLE (\w+) ADD COLUMN (\w+)")


def holds_code(db: Any) -> bool:
    """Whether a keyword index holds source code (one written before code was indexed holds none)."""
    import sqlite3

    try:
        return db.execute("SELECT 1 FROM documents WHERE kind = 'code' LIMIT 1").fetchone() is not None
    except sqlite3.OperationalError:  # no kind column
        return False


def schema_version(db: Any) -> int:
    """How many KEYWORD_MIGRATIONS an index has had. A store written before the version was recorded
    reads as the last migration whose tables and columns it has (what that ingest wrote)."""
    version = int(db.execute("PRAGMA user_version").fetchone()[0])
    if version or not db.execute("SELECT 1 FROM sqlite_master WHERE name = 'documents'").fetchone():
        return version
    tables = {str(name) for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    columns = {f"{table}.{row[1]}" for table in ("chunks", "documents") for row in db.execute(f"PRAGMA table_info({table})")}
    present = ("chunks.embed_key", "documents.cjk_share", "documents.superseded_by")
    legacy = 1 + sum(1 for _ in itertools.takewhile(columns.__contains__, present))
    return 5 if legacy == 4 and "common_terms" in tables else legacy


def migrate_keyword_index(db: Any, scheme: PrefixScheme) -> None:
    """Run the migrations an index has not had, each in a transaction of its own (ingest only)."""
    done = int(db.execute("PRAGMA user_version").fetchone()[0])
    for migration in KEYWORD_MIGRATIONS[done:]:
        db.execute("BEGIN IMMEDIATE")
        try:
            for statement in migration.statements:
                added = _ADD_COLUMN.match(statement)
                if added and added.group(2) in {row[1] for row in db.execute(f"PRAGMA table_info({added.group(1)})")}:
                    continue
                db.execute(statement)
            if migration.fill is not None:
                migration.fill(db, scheme)
            db.execute(f"PRAGMA user_version = {migration.number}")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")


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
    pages: str | None = None  # a paged document's pages (pages_from_column reads it); None: not paged
    tags: str | None = None  # as stored (tags_from_column reads it); None: not recorded
    dated: str | None = None  # the document's own date, "" for none; None: not recorded
    kind: str | None = None  # "doc" or "code"; None: an index written before code (a document)
    language: str | None = None  # a code file's language
    sections_recorded: int | None = None  # 1 once its chunks carry their sections; None: not recorded
    read_with: str | None = None  # the stamp of the reader that read it; None: not recorded

    def read_again(self) -> bool:
        """Whether the reader that read the document has changed since (or was not recorded): ingest
        reads it again, so an index made by an older reader catches up without --full."""
        reader = reader_for(self.path)
        return reader is not None and self.read_with != reader.stamp

    def keys_unrecorded(self) -> bool:
        """A document of a store written before all it holds of a document was recorded (successors,
        tags, its date, its chunks' sections): ingest reads it again to record them."""
        return (self.tags is None or (self.lifecycle == "superseded" and self.superseded_by is None)
                or self.sections_recorded is None)


# The migration that added each column of a row type a reader selects: an older index reads NULL there.
_COLUMN_SINCE = {"superseded_by": 4, "pages": 6, "searchable": 6, "tags": 8, "dated": 8, "kind": 9, "language": 9,
                 "symbol": 9, "section_start": 10, "section_end": 10, "sections_recorded": 10, "read_with": 11}


def select_columns(names: Iterable[str], version: int, table: str = "") -> str:
    return ", ".join(f"NULL AS {name}" if _COLUMN_SINCE.get(name, 0) > version else f"{table}{name}" for name in names)


def document_columns(version: int = KEYWORD_SCHEMA_VERSION) -> str:
    """DocumentRow's columns as a select list for an index of this schema_version: an older one
    reads NULL for a column it lacks (not recorded), so the server reads it as it is (it never
    writes) and ingest adds the column when it opens the index."""
    return select_columns(DocumentRow.__dataclass_fields__, version)


@dataclass(frozen=True)
class ChunkRow:
    """A row of `chunks` with its document's title joined in (chunk_select), so a search needs no
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
    searchable: str | None = None  # as embedded and keyword-indexed, where it is not searchable_text(text)
    kind: str | None = None  # "doc" or "code" (None: an index written before code: a document)
    symbol: str | None = None  # a code chunk's symbol
    language: str | None = None  # a code chunk's language (its document's)
    section_start: int | None = None  # its section's lines (section_range); None: not recorded
    section_end: int | None = None

    @property
    def indexed_text(self) -> str:
        """The passage as embedded and keyword-indexed."""
        return self.searchable if self.searchable is not None else searchable_text(self.text)


def chunk_select(version: int = KEYWORD_SCHEMA_VERSION) -> str:
    """SELECT of ChunkRow's columns (the passage, its document's title) for an index of this schema_version."""
    columns = select_columns(("id", "path", "chunk_index", "start_line", "end_line", "heading", "lifecycle", "text"), version,
                       "c.")
    return (f"SELECT {columns}, coalesce(d.title, c.path), {select_columns(('searchable', 'kind', 'symbol'), version, 'c.')}, "
            f"{select_columns(('language',), version, 'd.')}, {select_columns(('section_start', 'section_end'), version, 'c.')} "
            "FROM chunks c LEFT JOIN documents d ON d.path = c.path")


def pages_column(pages: Sequence[Page]) -> str | None:
    """How documents.pages holds a paged document's pages: [[line, number, label], ...]; NULL when not paged."""
    return json.dumps([[p.line, p.number, p.label] for p in pages], ensure_ascii=False) if pages else None


def pages_from_column(raw: str | None) -> tuple[Page, ...]:
    """The pages documents.pages holds; none for NULL or a value this module did not write."""
    try:
        value = json_value(raw) if raw else []
        return tuple(Page(int(line), int(number), str(label)) for line, number, label in value)
    except (ValueError, TypeError):
        return ()


@dataclass(frozen=True)
class PageSpan:
    """The pages a line range of a paged document lies on: physical numbers and printed labels."""

    first: int
    last: int
    first_label: str
    last_label: str

    def label(self) -> str:
        """The printed page labels, as a book cites them: "10", "10-11"."""
        return self.first_label if self.first == self.last else f"{self.first_label}-{self.last_label}"


def pages_of(pages: Sequence[Page], start_line: int, end_line: int) -> PageSpan | None:
    """The pages lines [start_line, end_line] lie on; None for a document that is not paged. Page
    marker lines at the end of the range are not on a page of it (a chunk takes in the marker of
    the page after it, which holds no text of its own)."""
    if not pages:
        return None
    starts = [page.line for page in pages]
    first = max(0, bisect.bisect_right(starts, start_line) - 1)
    last = max(0, bisect.bisect_right(starts, end_line) - 1)
    while last > first and pages[last].line == end_line:
        last, end_line = last - 1, end_line - 1
    return PageSpan(pages[first].number, pages[last].number, pages[first].label, pages[last].label)


def page_lines(pages: Sequence[Page], line_count: int, first: int, last: int | None) -> tuple[int, int]:
    """The line range of physical pages [first, last] (last None: to the end) of a paged document."""
    numbers = [page.number for page in pages]
    begin = bisect.bisect_left(numbers, first)
    end = bisect.bisect_right(numbers, last) if last is not None else len(pages)
    start_line = pages[begin].line if begin < len(pages) else line_count + 1
    end_line = pages[end].line - 1 if end < len(pages) else line_count
    return start_line, end_line


# What ingest measures about the corpus for the server, kept in the keyword index's `meta` table
# (written in the same transaction as the stamp, so a server never sees one without the other).
META_CORPUS_FACTS = "corpus_facts"
META_CALIBRATION = "calibration"
META_CALIBRATED_AT = "calibrated_at_chunks"  # the active chunk count at the last calibration attempt


@dataclass(frozen=True)
class CorpusFacts:
    """What an agent should know before it phrases a search: how many documents, in which
    languages (a document is Japanese/CJK when at least CJK_DOCUMENT of its letters are), and in
    how many top-level folders (counted, never named: a folder name is corpus text)."""

    documents: int
    superseded: int
    cjk_documents: int
    folders: int | None  # None: facts written before the count (they named folders instead)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: str) -> CorpusFacts:
        data = json_value(raw)
        folders = data.get("folders")
        return cls(documents=int(data["documents"]), superseded=int(data["superseded"]),
                   cjk_documents=int(data["cjk_documents"]),
                   folders=folders if isinstance(folders, int) and not isinstance(folders, bool) else None)


def corpus_facts(rows: Iterable[tuple[str, str, float | None]]) -> CorpusFacts:
    """Facts from (path, lifecycle, cjk_share) of every document."""
    documents = superseded = cjk = 0
    folders: set[str] = set()
    for path, lifecycle, share in rows:
        documents += 1
        superseded += lifecycle == "superseded"
        cjk += reads_as_cjk(share or 0.0)
        if "/" in path:
            folders.add(path.split("/", 1)[0])
    return CorpusFacts(documents, superseded, cjk, len(folders))


META_FILES_FOUND = "files_found"
FILE_OUTCOMES = ("indexed", "excluded", "ignored", "failed", "not_read")


@dataclass(frozen=True)
class FilesFound:
    """What the last ingest found in the corpus folder, per file extension ("" for none), and what
    became of the files: indexed, excluded (`rag: false`), ignored (a scope rule), failed, or
    not read (no reader takes the format, or RAG_FORMATS leaves it out). Nothing is left out
    without a word: the dry run, the summary, list_documents and /health all say it."""

    counts: Mapping[str, Mapping[str, int]]  # extension -> outcome -> files

    def total(self, outcome: str) -> int:
        return sum(by.get(outcome, 0) for by in self.counts.values())

    def left_out(self) -> bool:
        """Whether any file found is not indexed."""
        return any(self.total(outcome) for outcome in FILE_OUTCOMES if outcome != "indexed")

    def rows(self) -> list[dict[str, Any]]:
        """One row per extension, most files first: {extension, <outcome>: n..., why_not_read}."""
        out = []
        for extension, by in sorted(self.counts.items(), key=lambda item: (-sum(item[1].values()), item[0])):
            row: dict[str, Any] = {"extension": extension or "(none)", **{o: by.get(o, 0) for o in FILE_OUTCOMES}}
            row["why_not_read"] = not_read_reason(extension) if by.get("not_read") else None
            out.append(row)
        return out

    def line(self) -> str:
        """One line for a person: what was indexed, and what was not and why."""
        parts = []
        for row in self.rows():
            said = [f"{row[o]} {o.replace('_', ' ')}" for o in FILE_OUTCOMES if row[o]]
            why = f" ({row['why_not_read']})" if row["why_not_read"] else ""
            parts.append(f"{metadata_text(row['extension'])}: {', '.join(said)}{why}")  # a name's tail, as found
        return "; ".join(parts) if parts else "no files"

    def to_json(self) -> str:
        return json.dumps({ext: dict(by) for ext, by in self.counts.items()}, sort_keys=True)

    @classmethod
    def from_json(cls, raw: str) -> FilesFound:
        data = json_value(raw)
        return cls({str(ext): {str(o): int(n) for o, n in by.items() if o in FILE_OUTCOMES} for ext, by in data.items()})


def not_read_reason(extension: str) -> str:
    reader = _READER_BY_EXTENSION.get(extension)
    if reader is not None and reader.kind == "code":
        return f"source code ({reader.format}) is read only with RAG_CODE=1 (ingest --code)"
    if reader is not None:
        return f"RAG_FORMATS leaves {reader.format} out"
    return ("no reader for this format; readers take " + " ".join(e for r in READERS if r.kind == "doc"
                                                                  for e in r.extensions)
            + ", and source files with RAG_CODE=1")


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
    # What the vectors' model is, whatever the server calls it or lists as digest (see
    # ModelFingerprint); None for an index built before fingerprints: its model is not known.
    fingerprint: ModelFingerprint | None = None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["fingerprint"] = self.fingerprint.to_dict() if self.fingerprint is not None else None
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> IndexStamp:
        fields = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        fields["fingerprint"] = ModelFingerprint.from_dict(data.get("fingerprint"))
        return cls(**fields)


def vectors_pending_hint(model: str, corpus: str | os.PathLike[str], store: str | os.PathLike[str],
                         embedder_up: bool | None = None, api: str = "ollama") -> str:
    """What to do about passages that wait for their vectors: the same words from ingest, search,
    list_documents and /health. The command names this corpus and store (typed as shown, it must
    not index the sample corpus into the default store), and the embedding server (of `api`) is
    said to be down only when it is known to be (None: not known)."""
    command = ingest_command("--corpus", shlex.quote(str(corpus)), "--store", shlex.quote(str(store)))
    if api == "ollama":
        server, running, start = ("Ollama", "with Ollama running (`ollama serve`) and the model pulled "
                                  f"(`ollama pull {model}`)", f"start Ollama (`ollama serve`) and `ollama pull {model}`")
    else:
        server, running, start = ("the embedding server", f"with the embedding server (RAG_EMBED_URL) serving {model!r}",
                                  f"start the embedding server (RAG_EMBED_URL) with {model!r} loaded")
    if embedder_up:
        return f"{server} answers: run {command} (unless an ingest is running now): it embeds only the waiting passages"
    if embedder_up is None:
        return f"{running}, run {command}: it embeds only the waiting passages"
    return f"{start}, then run {command}: it embeds only the waiting passages"


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
                           "manifest": self.manifest.to_dict(), "stamp": self.stamp.to_dict(),
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
        parsed_stamp = IndexStamp.from_dict(stamp)
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


def _replace_file(path: Path, text: str) -> None:
    """Write `path` by atomic replace: a reader sees the old or the new file, never half of one.
    The temporary file is created anew (O_EXCL, O_NOFOLLOW): a link planted under its name is
    removed, never written through."""
    tmp = path.with_suffix(".tmp")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644)
    with open(fd, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


# How a watcher's run ended: all done; done but some files failed (each kept what it had);
# files or vectors left for the next run (the embedder down: retried by itself); nothing done.
WATCH_OUTCOMES = ("ok", "some_files_failed", "unfinished", "could_not_finish")


@dataclass(frozen=True)
class WatchRun:
    """One finished run of a watcher."""

    finished_at: str  # ISO 8601, UTC
    outcome: str  # one of WATCH_OUTCOMES
    added: int = 0
    updated: int = 0
    removed: int = 0
    failed: int = 0
    seconds: float = 0.0
    error: str | None = None  # the first error the run logged


@dataclass(frozen=True)
class WatchStatus:
    """What an ingest watcher is doing (WATCH_STATUS_FILE, written by the watcher that holds the
    watch lock, read by the server): whether a run is going and since when, how many changed
    files wait for one (a running run's batch; after a run, the files it left for the next),
    and the last finished run."""

    pid: int
    running: bool
    since: str  # when the current state began (ISO 8601, UTC)
    files_waiting: int = 0
    last_run: WatchRun | None = None

    def to_json(self) -> str:
        # ASCII: an error naming a file whose name is not UTF-8 (surrogate escapes) is still written.
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WatchStatus:
        data = json_value(text)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        last = data.get("last_run")
        run = None
        if last is not None:
            if not isinstance(last, dict) or last.get("outcome") not in WATCH_OUTCOMES:
                raise ValueError("last_run is not a run")
            run = WatchRun(finished_at=str(last["finished_at"]), outcome=last["outcome"],
                           **{name: _whole(last.get(name, 0), name) for name in ("added", "updated", "removed", "failed")},
                           seconds=float(last.get("seconds", 0.0)),
                           error=None if last.get("error") is None else str(last["error"])[:500])
        if not isinstance(data.get("running"), bool):
            raise ValueError("running must be true or false")
        return cls(pid=_whole(data.get("pid"), "pid"), running=data["running"], since=str(data["since"]),
                   files_waiting=_whole(data.get("files_waiting", 0), "files_waiting"), last_run=run)


@dataclass(frozen=True)
class StoreLayout:
    root: Path

    @property
    def current_file(self) -> Path:
        return self.root / CURRENT_FILE

    @property
    def lock_file(self) -> Path:
        return self.root / LOCK_FILE

    @property
    def watch_lock_file(self) -> Path:
        return self.root / WATCH_LOCK_FILE

    @property
    def watch_status_file(self) -> Path:
        return self.root / WATCH_STATUS_FILE

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
        """Atomic replace: a reader sees the old or the new pointer, never half a file."""
        _replace_file(self.current_file, current.to_json())
        _fsync_dir(self.root)

    def watcher_pid(self) -> int | None:
        """The pid of the process holding this store's watch lock; None when no process holds it
        (a pid in the file of a watcher that died is not believed: the lock is the truth). Tried
        with a shared lock taken and dropped at once: a watcher starting at that moment waits a
        second for it (ingest.watch_lock). Read-only: the server never creates the file."""
        import fcntl

        try:
            fd = os.open(self.watch_lock_file, os.O_RDONLY | _NOFOLLOW | _NONBLOCK)
        except OSError:
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
                return int(text) if text.isdigit() else 0  # held, its pid not written yet
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        finally:
            os.close(fd)

    def write_watch_status(self, status: WatchStatus) -> None:
        _replace_file(self.watch_status_file, status.to_json())

    def read_watch_status(self) -> WatchStatus | None:
        """What the watcher last wrote; None when there is nothing readable (the report is a
        courtesy: a damaged file only hides it)."""
        try:
            fd = os.open(self.watch_status_file, os.O_RDONLY | _NOFOLLOW | _NONBLOCK)
        except OSError:
            return None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            return WatchStatus.from_json(os.read(fd, WATCH_STATUS_MAX_BYTES + 1).decode("utf-8"))
        except (OSError, ValueError, TypeError, KeyError):
            return None
        finally:
            os.close(fd)


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
              paths: Sequence[str] | None, kind: str | None = None) -> list[tuple[str, float]]:
        """(id, cosine distance), best first; paths=None and kind=None: unfiltered (the fast path).
        kind: "code" or "doc" (search_corpus's scope), a where-clause on the chunks' metadata."""
        np = import_heavy("numpy")

        where = vector_where(paths, kind)
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


def vector_where(paths: Sequence[str] | None, kind: str | None) -> dict[str, Any] | None:
    """The vector pre-filter: these documents, of this kind. A chunk written before kinds were
    stored has no `kind` key and is a document's: "doc" is "not code", which matches it."""
    clauses: list[dict[str, Any]] = []
    if paths is not None:
        clauses.append({"path": {"$in": list(paths)}})
    if kind is not None:
        clauses.append({"kind": "code"} if kind == "code" else {"kind": {"$ne": "code"}})
    return None if not clauses else clauses[0] if len(clauses) == 1 else {"$and": clauses}


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
              paths: Sequence[str] | None, kind: str | None = None) -> list[tuple[str, float]]: ...

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
    """The server refused an input as longer than the model's context (Ollama with truncate=False,
    or an OpenAI-compatible server's own words for it)."""


@dataclass
class ModelInfo:
    context_length: int | None
    dims: int | None


# EmbeddingGemma and friends, when /api/show does not say.
REGISTRY_CONTEXT_LENGTH = {"embeddinggemma": 2048, "nomic-embed-text": 2048, "mxbai-embed-large": 512,
                           "snowflake-arctic-embed": 512, "snowflake-arctic-embed2": 8192, "bge-m3": 8192,
                           "e5": 512}


class InvalidVectors(RagError):
    """The embedding server answered, but with vectors that cannot be stored or compared: NaN or infinite values,
    or rows of different lengths. The texts of that call fail; the embedder is not declared down."""


class EmbedderTimeout(RagError):
    """The embedding server did not answer a call within its time (down hard, stalled, or overloaded)."""


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
    """fn() run once by a worker thread (run()); its waiters wait at most a bound (result(),
    wait()), in concurrent.futures.Future's words (done, running, cancel, cancelled, result).

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

    def running(self) -> bool:
        """Whether a worker runs fn now (concurrent.futures.Future's words, as are the others)."""
        return self._state == "running" and not self._done.is_set()

    def cancelled(self) -> bool:
        return self._state == "abandoned"

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

    def cancel(self) -> bool:
        """Let a worker skip this call if it has not started it (its waiter gave up): True when
        it will not run."""
        with self._lock:
            if self._state == "queued":
                self._state = "abandoned"
            return self._state == "abandoned"

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None) -> bool:
        """Whether fn finished within `timeout` seconds (concurrent.futures.wait for one call)."""
        return self._done.wait(timeout)

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


class RetryLater(Exception):
    """The server asked to be called again later (HTTP 429 with Retry-After, or Ollama's "server
    busy"): the call waits that long, within its own time, and asks again."""

    def __init__(self, seconds: float, message: str) -> None:
        super().__init__(message)
        self.seconds = seconds


RATE_LIMIT_WAIT_MAX_S = 10.0  # the longest Retry-After honoured in one wait: a longer one is a hint, not a plan
RATE_LIMIT_RETRIES = 3  # asked again at most this often per call, each within the call's time


def retry_after_seconds(value: str | None) -> float:
    """A Retry-After header (seconds, or an HTTP date) as a wait of 0..RATE_LIMIT_WAIT_MAX_S s;
    1 s when it is absent or unreadable."""
    from email.utils import parsedate_to_datetime

    seconds = 1.0
    if value:
        try:
            seconds = float(value.strip())
        except ValueError:
            with contextlib.suppress(TypeError, ValueError, IndexError):
                seconds = parsedate_to_datetime(value).timestamp() - time.time()
    return min(max(seconds, 0.0), RATE_LIMIT_WAIT_MAX_S) if math.isfinite(seconds) else 1.0


# The model fingerprint: a fixed text embedded by every host, its vector kept in a short sketch
# (a fixed random projection, so sparse and dense vectors alike keep their shape in 64 numbers). Two
# hosts serve the same model, quantisation and size when their sketches point the same way.
FINGERPRINT_TEXT = ("local-rag-mcp model fingerprint: the vectors of this sentence tell one embedding model, "
                    "quantisation or size from another. 0123456789")
FINGERPRINT_SKETCH = 64
FINGERPRINT_SEED = 46
# Cosine of two sketches at and above which they are one model's: float noise of ±1e-3 in every
# value (more than one model shows across calls, batch positions and CPU/GPU) keeps it above
# 0.9998; another model, the same one asked for queries, or another size falls well below, and
# outputs rounded to 4 bits (0.993) too (measured: tools/README.md, "Model fingerprint").
FINGERPRINT_MIN_COSINE = 0.999


@functools.cache
def _sketch_projection(dims: int) -> Any:
    np = import_heavy("numpy")
    # RandomState's stream is fixed across numpy versions: one vector, one sketch, for ever.
    return np.random.RandomState(FINGERPRINT_SEED).standard_normal((dims, FINGERPRINT_SKETCH))


@dataclass(frozen=True)
class ModelFingerprint:
    """What identifies the model behind an endpoint, whatever its name or digest: its vectors'
    size, the sketch of FINGERPRINT_TEXT's vector, and the model name the endpoint reported."""

    dims: int
    sketch: tuple[float, ...]
    served_model: str | None = None

    @classmethod
    def of(cls, vector: Any, served_model: str | None = None) -> ModelFingerprint:
        np = import_heavy("numpy")
        vector = np.asarray(vector, dtype=np.float64)
        sketch = vector @ _sketch_projection(len(vector))
        norm = float(np.linalg.norm(sketch))
        sketch = sketch / norm if norm else sketch
        return cls(len(vector), tuple(round(float(x), 5) for x in sketch),
                   metadata_text(served_model, 200) if served_model else None)

    def similarity(self, other: ModelFingerprint) -> float:
        """The sketches' cosine; 0 when the sizes differ."""
        if self.dims != other.dims or len(self.sketch) != len(other.sketch):
            return 0.0
        dot = sum(a * b for a, b in zip(self.sketch, other.sketch, strict=True))
        norms = math.sqrt(sum(a * a for a in self.sketch) * sum(b * b for b in other.sketch))
        return dot / norms if norms else 0.0

    def agrees(self, other: ModelFingerprint) -> bool:
        return self.similarity(other) >= FINGERPRINT_MIN_COSINE

    def describe(self) -> str:
        name = f"{self.served_model!r}, " if self.served_model else ""
        return f"{name}{self.dims} dimensions"

    def to_dict(self) -> dict[str, Any]:
        return {"dims": self.dims, "sketch": list(self.sketch), "served_model": self.served_model}

    @classmethod
    def from_dict(cls, data: Any) -> ModelFingerprint | None:
        """The fingerprint CURRENT.json records; None when there is none or it is unreadable (an
        index from before fingerprints, or a hand-edited one: its model is then not known)."""
        if not isinstance(data, dict):
            return None
        dims, sketch, served = data.get("dims"), data.get("sketch"), data.get("served_model")
        if not (isinstance(dims, int) and not isinstance(dims, bool) and dims > 0 and isinstance(sketch, list)
                and len(sketch) == FINGERPRINT_SKETCH and (served is None or isinstance(served, str))
                and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in sketch)):
            return None
        return cls(dims, tuple(float(x) for x in sketch), served)


@dataclass
class Embedder:
    """The client of one embedding server, whatever its API: every call bounded as a whole by
    `timeout_s`, every failure mapped to the error vocabulary, every vector checked before anyone
    stores or compares it. Ingest (its dispatcher, probes) and the server (query vectors, health)
    use it alike; the APIs differ only in the requests (OllamaEmbedder, OpenAIEmbedder)."""

    host: str
    model: str
    timeout_s: float
    # Asked with every embed call (Ollama only): how long to keep the model loaded afterwards
    # (ingest keeps it for the run; None leaves the server's default).
    keep_alive: str | None = None
    # Asked with every embed call: vectors truncated and renormalised to this many dimensions (see
    # Settings.embed_dimensions); None asks nothing, the model's native size.
    dimensions: int | None = None
    # Sent as a bearer token (RAG_EMBED_API_KEY); never shown: every message is redacted of it.
    api_key: str | None = field(default=None, repr=False)
    _client: Any = field(default=None, init=False, repr=False)
    # The model name the server reported with its last vectors (None until then, or if it said none).
    served_model: str | None = field(default=None, init=False, repr=False)

    SERVER: ClassVar[str] = "the embedding server"
    HOSTS_VARIABLE: ClassVar[str] = "RAG_EMBED_URL"
    DIMENSIONS_FIX: ClassVar[str] = "use a server that honours `dimensions` (vLLM, Ollama's /v1, LM Studio)"
    ADDRESS_HINT: ClassVar[str] = ("check that RAG_EMBED_URL is the base URL of an OpenAI-compatible embeddings API "
                                   "(POST <url>/embeddings)")

    @property
    def where(self) -> str:
        return f"{self.SERVER} at {self.host}"

    # What each API does its own way ------------------------------------------------------------
    def _new_client(self) -> Any:
        raise NotImplementedError

    def _embed_call(self, client: Any, texts: Sequence[str]) -> tuple[Any, str | None]:
        """The raw vectors (a list of lists) and the model name the server reported."""
        raise NotImplementedError

    def _translate(self, exc: BaseException) -> BaseException:
        raise NotImplementedError

    def model_digest(self) -> str | None:
        """The model's digest as the server lists it; None when it does not say."""
        return None

    def model_info(self) -> ModelInfo:
        raise NotImplementedError

    def start_hint(self) -> str:
        """What to do when the server does not answer."""
        raise NotImplementedError

    def model_hint(self) -> str:
        """How to get this server to serve the model (what the index needs)."""
        raise NotImplementedError

    # Shared -----------------------------------------------------------------------------------
    def _transport_error(self, exc: BaseException) -> BaseException:
        """A failure below the API's own answers (no connection, a timeout, not its JSON) in the
        vocabulary; anything else as it is."""
        import httpx

        if isinstance(exc, (ConnectionError, httpx.ConnectError)):
            return RagError(ErrorCode.EMBEDDER_UNAVAILABLE, f"cannot reach {self.where}", self.start_hint())
        if isinstance(exc, httpx.TimeoutException):
            return self.timed_out()
        if isinstance(exc, httpx.HTTPError):
            return RagError(ErrorCode.EMBEDDER_UNAVAILABLE, f"HTTP error talking to {self.where}: {shown(exc, 300)}",
                            self.ADDRESS_HINT)
        if isinstance(exc, (ValueError, TypeError, KeyError)):  # an answer that is not the API's JSON
            return RagError(ErrorCode.EMBEDDER_UNAVAILABLE, f"{self.where} gave an unreadable answer: "
                            f"{shown(exc, 200)}", self.ADDRESS_HINT)
        return exc

    def _get_client(self) -> Any:
        if self._client is None:
            self._client = self._new_client()
        return self._client

    def redact(self, text: str) -> str:
        """`text` without the API key (a server may echo it in an error)."""
        return text.replace(self.api_key, "(the API key)") if self.api_key else text

    def _call(self, fn: Callable[[Any], Any]) -> Any:
        # The client is built (the HTTP libraries imported) before the clock starts: on a loaded
        # machine the imports alone can outlast a short RAG_EMBED_TIMEOUT.
        client = self._get_client()
        return self.answer(on_call_thread(lambda: fn(client)))

    def answer(self, call: BoundedCall, seconds: float | None = None) -> Any:
        """What a call to this server gave within `seconds` (timeout_s unless said), its failures
        in the error vocabulary."""
        seconds = self.timeout_s if seconds is None else seconds
        try:
            return call.result(seconds)
        except TimeoutError:
            raise self.timed_out(seconds) from None
        except RetryLater as exc:
            raise self.rate_limited(exc) from None
        except Exception as exc:  # translated below
            raise self._translated(exc) from exc

    def _translated(self, exc: BaseException) -> BaseException:
        error = self._translate(exc)
        if isinstance(error, RagError) and self.api_key:
            return type(error)(error.code, self.redact(error.message), self.redact(error.hint))
        if isinstance(error, (RetryLater, InputTooLong)) and self.api_key and self.api_key in str(error):
            return RetryLater(error.seconds, self.redact(str(error))) if isinstance(error, RetryLater) \
                else InputTooLong(self.redact(str(error)))
        return error

    def timed_out(self, seconds: float | None = None) -> RagError:
        return EmbedderTimeout(ErrorCode.EMBEDDER_UNAVAILABLE, f"{self.where} did not answer within "
                               f"{self.timeout_s if seconds is None else seconds:g} s",
                               "retry; if the server is loading the model, wait for it, or raise RAG_EMBED_TIMEOUT")

    def rate_limited(self, exc: RetryLater) -> RagError:
        return RagError(ErrorCode.EMBEDDER_UNAVAILABLE, f"{self.where} is refusing calls for now ({exc})",
                        "retry later; with several processes on one server, lower RAG_EMBED_CONCURRENCY")

    def fingerprint(self) -> ModelFingerprint:
        """FINGERPRINT_TEXT embedded alone (no prefix: the same text for every model)."""
        vector = self.embed([FINGERPRINT_TEXT])[0]
        return ModelFingerprint.of(vector, self.served_model)

    def embed(self, texts: Sequence[str]) -> Any:
        """One vector per text, as a float32 matrix (rows in order). InvalidVectors when the
        answer holds NaN or infinite values, or rows of different lengths."""
        return self.begin_embed(texts)()

    def begin_embed(self, texts: Sequence[str], then: Callable[[Any], Any] | None = None,
                    failed: Callable[[BaseException], None] | None = None) -> Callable[[], Any]:
        """Send the embed request now; the function returned waits for the answer (at most
        timeout_s) and gives what embed() gives, or then(that matrix) when `then` is given. `then`
        runs on the thread that received the answer, as soon as it arrives: a search starts its
        vector queries from there rather than waking another thread to do it; `failed(error)`
        runs there when the call (or `then`) fails, for a caller that does not wait. A server that
        asks to be called later (RetryLater) is asked again after the wait it names, within the
        call's time."""
        client = self._get_client()  # outside the timed call, as in _call
        deadline = time.monotonic() + self.timeout_s

        def fetch() -> Any:
            try:
                for attempt in itertools.count():
                    try:
                        raw, self.served_model = self._embed_call(client, texts)
                        break
                    except Exception as exc:  # translated here, raised to the waiter
                        error = self._translated(exc)
                        if not isinstance(error, RetryLater):
                            raise error from exc
                        if attempt >= RATE_LIMIT_RETRIES or time.monotonic() + error.seconds >= deadline:
                            raise self.rate_limited(error) from None
                        logging.getLogger("local-rag.embedder").info("%s asks to be called again in %.1f s (%s)", self.where, error.seconds, error)
                        time.sleep(error.seconds)
                matrix = self._vectors(texts, raw)
                return then(matrix) if then is not None else matrix
            except BaseException as exc:
                if failed is not None:
                    failed(exc)
                raise

        call = on_call_thread(fetch)

        def wait() -> Any:
            try:
                return call.result(self.timeout_s)
            except TimeoutError:
                raise self.timed_out() from None

        return wait

    def _vectors(self, texts: Sequence[str], embeddings: Any) -> Any:
        np = import_heavy("numpy")

        if not isinstance(embeddings, list) or len(embeddings) != len(texts):
            count = len(embeddings) if isinstance(embeddings, list) else "no"
            raise RagError(ErrorCode.EMBEDDER_UNAVAILABLE,
                           f"{self.where} returned {count} embeddings for {len(texts)} inputs", "retry")
        try:
            matrix = np.asarray(embeddings, dtype=np.float32)
        except (ValueError, TypeError):
            matrix = None
        if matrix is None or matrix.ndim != 2 or matrix.shape[1] == 0:
            raise InvalidVectors(ErrorCode.EMBEDDER_UNAVAILABLE, f"{self.where} returned vectors of "
                                 "different lengths", f"check the model: {self.model_hint()}")
        if not np.isfinite(matrix).all():
            raise InvalidVectors(ErrorCode.EMBEDDER_UNAVAILABLE, f"{self.where} returned vectors with NaN or "
                                 "infinite values", f"check the model: {self.model_hint()}")
        if self.dimensions is not None and matrix.shape[1] != self.dimensions:
            # Not a fault of the embedder to wait out: a server too old for `dimensions` ignores it.
            raise RagError(ErrorCode.INVALID_ARGUMENT,
                           f"configuration error: {self.where} returned {matrix.shape[1]}-dimensional vectors "
                           f"for {self.model!r} when asked for {self.dimensions} (RAG_EMBED_DIMENSIONS): it ignores "
                           "`dimensions`", f"{self.DIMENSIONS_FIX}, or unset RAG_EMBED_DIMENSIONS and run "
                           f"{ingest_command()}")
        return matrix


@dataclass
class OllamaEmbedder(Embedder):
    """Ollama's own API (POST /api/embed, /api/show, /api/tags) through the `ollama` client."""

    SERVER: ClassVar[str] = "Ollama"
    HOSTS_VARIABLE: ClassVar[str] = "OLLAMA_HOST"
    DIMENSIONS_FIX: ClassVar[str] = "upgrade Ollama (versions before September 2025 ignore it)"
    ADDRESS_HINT: ClassVar[str] = "check that OLLAMA_HOST points to an Ollama server"

    def _new_client(self) -> Any:
        ollama = import_heavy("ollama")
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        return ollama.Client(host=self.host, timeout=self.timeout_s, headers=headers,
                             transport=_deadline_transport_class()(self.timeout_s))

    def _embed_call(self, client: Any, texts: Sequence[str]) -> tuple[Any, str | None]:
        options: dict[str, Any] = {"keep_alive": self.keep_alive} if self.keep_alive is not None else {}
        if self.dimensions is not None:
            options["dimensions"] = self.dimensions
        response = client.embed(model=self.model, input=list(texts), truncate=False, **options)
        return list(response.embeddings or []), response.model

    def start_hint(self) -> str:
        return f"start Ollama (`ollama serve`) and `ollama pull {self.model}`, or set OLLAMA_HOST"

    def model_hint(self) -> str:
        return f"re-pull it with `ollama pull {self.model}`"

    def _translate(self, exc: BaseException) -> BaseException:
        import ollama

        if isinstance(exc, ollama.ResponseError):
            if exc.status_code == 404:
                return RagError(ErrorCode.MODEL_NOT_FOUND, f"Ollama at {self.host} has no model {self.model!r}",
                                f"run `ollama pull {self.model}`")
            if exc.status_code == 400 and "context length" in str(exc.error):
                return InputTooLong(str(exc.error))
            if exc.status_code == 429 or (exc.status_code == 503 and "busy" in str(exc.error)):
                return RetryLater(1.0, f"HTTP {exc.status_code}: {shown(exc.error, 200)}")
            return RagError(ErrorCode.EMBEDDER_UNAVAILABLE,
                            f"Ollama at {self.host} answered HTTP {exc.status_code}: {shown(exc.error, 300)}",
                            "check the Ollama server log; retry when it is healthy")
        return self._transport_error(exc)

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
        return ModelInfo(context_length=_whole_or(context, registry_context_length(self.model)),
                         dims=_whole_or(dims, None))


def _whole_or(value: Any, default: int | None) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else default


def registry_context_length(model: str) -> int | None:
    family = prefix_scheme_for(model)
    return REGISTRY_CONTEXT_LENGTH.get(family.name if family else "", None)


class _Refused(Exception):
    """An OpenAI-compatible server's HTTP error answer."""

    def __init__(self, status: int, body: str, retry_after: str | None) -> None:
        super().__init__(f"HTTP {status}: {body}")
        self.status, self.body, self.retry_after = status, body, retry_after


# The words OpenAI-compatible servers use to refuse an input longer than the model takes:
# llama-server ("input is too large to process"), vLLM ("maximum context length is 512 tokens"),
# TEI ("`inputs` must have less than 512 tokens"), LM Studio and Ollama's /v1 ("exceeds the context
# length"). Ingest then splits the chunk, as with Ollama's own refusal.
_TOO_LONG = re.compile(r"context length|context window|too (?:long|large)|maximum (?:context|input|sequence)"
                       r"|must have less than|exceeds? the|longer than the|max_model_len|n_ubatch|physical batch",
                       re.IGNORECASE)
_REFUSED_TOO_LONG = (400, 413, 422, 500)


@dataclass
class OpenAIEmbedder(Embedder):
    """The OpenAI-compatible embeddings API (POST {url}/embeddings, GET {url}/models) of LM Studio,
    llama-server, vLLM, TEI, Infinity and Ollama's /v1. Plain httpx rather than the `openai`
    package: httpx is already installed (ollama and mcp use it), so no new dependency, and the
    same DeadlineTransport bounds a call's whole answer as for Ollama."""

    SERVER: ClassVar[str] = "the embedding server"
    HOSTS_VARIABLE: ClassVar[str] = "RAG_EMBED_URL"

    def _new_client(self) -> Any:
        httpx = import_heavy("httpx")
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.Client(base_url=self.host + "/", timeout=self.timeout_s, headers=headers,
                            transport=_deadline_transport_class()(self.timeout_s))

    def _json(self, response: Any) -> Any:
        if response.status_code >= 400:  # redacted at once: the exception may be chained and logged
            raise _Refused(response.status_code, self.redact(response.text[:2000]), response.headers.get("retry-after"))
        return json_value(response.content)

    def _embed_call(self, client: Any, texts: Sequence[str]) -> tuple[Any, str | None]:
        body: dict[str, Any] = {"model": self.model, "input": list(texts), "encoding_format": "float"}
        if self.dimensions is not None:
            body["dimensions"] = self.dimensions
        answer = self._json(client.post("embeddings", json=body))
        if not isinstance(answer, dict) or not isinstance(answer.get("data"), list):
            raise ValueError("no `data` list in the answer")
        rows = answer["data"]
        if all(isinstance(row, dict) and isinstance(row.get("index"), int) for row in rows):
            rows = sorted(rows, key=lambda row: row["index"])
        served = answer.get("model")
        return [row.get("embedding") if isinstance(row, dict) else None for row in rows], \
            served if isinstance(served, str) else None

    def _listed(self) -> list[dict[str, Any]]:
        """GET {url}/models' entries; [] where the server has no such route."""
        try:
            answer = self._json(self._get_client().get("models"))
        except _Refused as exc:
            if exc.status == 404:
                return []
            raise
        data = answer.get("data") if isinstance(answer, dict) else None
        return [entry for entry in data if isinstance(entry, dict) and isinstance(entry.get("id"), str)] \
            if isinstance(data, list) else []

    def _listed_names(self) -> str:
        """The model names the server lists, for a hint (empty when it cannot say)."""
        try:
            names = [printable_text(entry["id"])[:120] for entry in self._listed()]
        except Exception:  # noqa: BLE001 - only a hint: the call's own error is what is raised
            return ""
        return ", ".join(repr(name) for name in names[:8]) + (" …" if len(names) > 8 else "")

    def start_hint(self) -> str:
        return ("start the embedding server (LM Studio's server, `llama-server --embeddings`, vLLM, TEI), or set "
                "RAG_EMBED_URL to its base URL as it documents it (e.g. http://127.0.0.1:1234/v1)")

    def model_hint(self) -> str:
        return f"load {self.model!r} on that server again (GET {self.host}/models lists what it serves)"

    def _translate(self, exc: BaseException) -> BaseException:
        if isinstance(exc, _Refused):
            return self._refusal(exc)
        return self._transport_error(exc)

    @staticmethod
    def _said(body: str) -> str:
        """What an error answer says: its JSON's error message where it has one (OpenAI's
        {"error": {"message": ...}}, TEI's {"error": ...}), else the body."""
        try:
            data = json_value(body)
        except ValueError:
            data = None
        error = data.get("error") if isinstance(data, dict) else None
        message = error.get("message") if isinstance(error, dict) else error
        return shown(message if isinstance(message, str) else body, 300)

    def _refusal(self, exc: _Refused) -> BaseException:
        status, said = exc.status, self._said(exc.body)
        if status in (401, 403):
            return RagError(ErrorCode.EMBEDDER_UNAVAILABLE,
                            f"{self.where} refused the API key (HTTP {status})" if self.api_key else
                            f"{self.where} asks for an API key (HTTP {status})",
                            "set RAG_EMBED_API_KEY to a key that server accepts (it is sent as a bearer token)")
        if status == 429 or (status == 503 and exc.retry_after is not None):
            return RetryLater(retry_after_seconds(exc.retry_after), f"HTTP {status}")
        if status in _REFUSED_TOO_LONG and _TOO_LONG.search(exc.body):
            return InputTooLong(said)
        if status in (400, 404) and "model" in exc.body.lower():
            listed = self._listed_names()
            return RagError(ErrorCode.MODEL_NOT_FOUND, f"{self.where} does not serve the model {self.model!r}: {said}",
                            f"set RAG_EMBED_MODEL to a model it serves ({listed})" if listed else
                            f"load {self.model!r} on that server, or set RAG_EMBED_MODEL to a model it serves")
        if status == 404:
            return RagError(ErrorCode.EMBEDDER_UNAVAILABLE, f"{self.where} has no embeddings API at "
                            f"{self.host}/embeddings (HTTP 404)", "set RAG_EMBED_URL to the base URL the server "
                            "documents, usually ending in /v1 (e.g. http://127.0.0.1:1234/v1)")
        return RagError(ErrorCode.EMBEDDER_UNAVAILABLE, f"{self.where} answered HTTP {status}: {said}",
                        "check the embedding server's log; retry when it is healthy")

    def model_info(self) -> ModelInfo:
        """Context length and dimensions where GET /models says them (vLLM's max_model_len,
        llama-server's meta), the registry's context length as fallback. The list is not
        required to name the model: llama-server and TEI serve one model under a file name."""
        entries = self._call(lambda client: self._listed())
        chosen = next((e for e in entries if same_model(e["id"], self.model)), None) \
            or next((e for e in entries if model_base_name(e["id"]) == model_base_name(self.model)), None) \
            or (entries[0] if len(entries) == 1 else {})
        meta = chosen.get("meta") if isinstance(chosen.get("meta"), dict) else {}
        context = _whole_or(chosen.get("max_model_len"), None) or _whole_or(meta.get("n_ctx_train"), None)
        return ModelInfo(context_length=context or registry_context_length(self.model),
                         dims=_whole_or(meta.get("n_embd"), None))


EMBEDDERS: dict[str, type[Embedder]] = {"ollama": OllamaEmbedder, "openai": OpenAIEmbedder}


def batched(items: Sequence[Any], size: int) -> Iterable[Sequence[Any]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


# ---------------------------------------------------------------------------
# The PDF extractor: extract_pdf_text in a child process of its own, with a deadline and a memory
# cap (pure Python cannot be interrupted reliably, and a hostile file must fail alone). One request
# at a time, a PDF's bytes in, its answer out, each a frame (an
# 8-byte big-endian length, then that many bytes) on the child's stdin and stdout.

_PDF_FRAME_LENGTH = struct.Struct(">Q")
_PDF_MEMORY_ANSWER = pickle.dumps(("memory", None))  # made before any request: it must not need memory then


def serve_pdf_extraction(memory_limit: int = CHILD_MEMORY_LIMIT) -> None:
    """The child's loop: answer each request with ("ok", PdfText), ("refused", reason) or
    ("memory", None); end when stdin closes."""
    import resource

    requests, answers = _take_pdf_protocol_streams()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the whole group; the parent decides
    end_with_parent()
    with contextlib.suppress(ValueError, OSError):  # macOS may refuse it (and does not enforce it): the deadline remains
        resource.setrlimit(resource.RLIMIT_AS, (memory_limit, memory_limit))
    import pypdf  # noqa: F401 - imported once, before the first request arrives

    while (raw := _read_request(requests)) is not None:
        answer = _extraction_answer(raw)
        answers.write(_PDF_FRAME_LENGTH.pack(len(answer)) + answer)
        answers.flush()


def _take_pdf_protocol_streams() -> tuple[io.BufferedReader, io.BufferedWriter]:
    """The protocol's own copies of stdin and stdout; fd 1 then points at stderr, so that whatever
    else writes to stdout (a print in a library, C code) cannot corrupt a frame."""
    requests = os.fdopen(os.dup(0), "rb")
    answers = os.fdopen(os.dup(1), "wb")
    nothing = os.open(os.devnull, os.O_RDONLY)
    os.dup2(nothing, 0)
    os.close(nothing)
    os.dup2(2, 1)
    return requests, answers


def end_with_parent(end: Callable[[], Any] = lambda: os._exit(1)) -> None:
    """Call `end` (by default: exit at once) soon after the process that started this one ends
    (kill -9 included): a thread watches for the child being handed to another parent. Not
    prctl's PR_SET_PDEATHSIG, which fires when the *thread* that started the child ends: the
    caller's worker threads come and go (measured: a child started from a finished thread was
    killed mid-request). The PDF extractor may run on half a second as an orphan: it writes
    nothing anywhere; a server's watcher stops as on Ctrl-C (what it committed is kept)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        end()

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _read_request(stream: io.BufferedReader) -> bytes | None:
    head = stream.read(_PDF_FRAME_LENGTH.size)
    if len(head) < _PDF_FRAME_LENGTH.size:
        return None
    (length,) = _PDF_FRAME_LENGTH.unpack(head)
    body = stream.read(length)
    return body if len(body) == length else None


def _extraction_answer(raw: bytes) -> bytes:
    _reset_child_peak_memory()
    try:
        return pickle.dumps(("ok", extract_pdf_text(raw)), protocol=pickle.HIGHEST_PROTOCOL)
    except PdfRefused as exc:
        return pickle.dumps(("refused", exc.reason))
    except MemoryError:
        return _PDF_MEMORY_ANSWER


def _reset_child_peak_memory() -> None:
    """Linux: restart this process's peak-RSS count (VmHWM), so the parent reads each PDF's own peak."""
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")


# The parent's side.


class _PdfAnswerUnpickler(pickle.Unpickler):
    """An answer holds these classes and builtins, nothing else; found by name, since the child
    imports this module under its file's name and this process may know it by another."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _PDF_ANSWER_CLASSES:
            return _PDF_ANSWER_CLASSES[name]
        raise pickle.UnpicklingError(f"{module}.{name} is not part of an answer")


_PDF_ANSWER_CLASSES: dict[str, type] = {cls.__name__: cls for cls in (PdfText, PdfPage, PdfOutlineEntry)}


class _PdfChildGone(Exception):
    """The child closed its end (it died) before the answer was whole."""


class PdfExtractor:
    """extract_pdf_text in a long-lived child process, with a deadline and a memory cap.

    The child starts with the first PDF, serves every PDF after it, and is started again after it
    died or was killed. A timeout kills it; so does a PDF that needs more than the cap (the child
    is replaced, its heap was left at the cap). One request at a time; close() ends the child, as
    does the interpreter's exit, and the child ends with this process."""

    def __init__(self, *, timeout_base_s: float = TIMEOUT_BASE_S, timeout_per_mb_s: float = TIMEOUT_PER_MB_S,
                 timeout_max_s: float = TIMEOUT_MAX_S, memory_limit: int = CHILD_MEMORY_LIMIT) -> None:
        self._timeout = (timeout_base_s, timeout_per_mb_s, timeout_max_s)
        self._memory_limit = memory_limit
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        self._stop_child: weakref.finalize | None = None
        # The child's peak resident memory (bytes) while it read the last PDF (Linux; None
        # elsewhere, or when it died without a trace): for logs and measurements.
        self.last_peak_memory: int | None = None

    def timeout_for(self, size: int) -> float:
        """Seconds allowed for a PDF of `size` bytes."""
        base, per_mb, cap = self._timeout
        return min(cap, base + per_mb * size / 1_000_000)

    def extract(self, raw: bytes, path: str) -> PdfText:
        """The text of the PDF `raw` (read from `path`, which refusals name). Raises PdfRefused."""
        with self._lock:
            try:
                return self._extract(raw)
            except PdfRefused as exc:
                raise PdfRefused(exc.reason, path) from None

    def close(self) -> None:
        """End the child (a later extract starts another)."""
        with self._lock:
            self._stop()

    def _extract(self, raw: bytes) -> PdfText:
        timeout = self.timeout_for(len(raw))
        deadline = time.monotonic() + timeout
        process = self._running_child()
        self.last_peak_memory = None
        try:
            _send_to_child(process, _PDF_FRAME_LENGTH.pack(len(raw)), deadline)
            _send_to_child(process, raw, deadline)
            kind, value = _PdfAnswerUnpickler(io.BytesIO(_receive_from_child(process, deadline))).load()
        except TimeoutError:
            self.last_peak_memory = _child_peak_memory(process.pid)
            self._stop()
            raise PdfRefused(f"took longer than {timeout:.3g} s") from None
        except (_PdfChildGone, OSError, pickle.UnpicklingError):
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(5.0)  # it is ending; its exit status says how
            self._stop()
            raise PdfRefused(f"the extractor crashed ({_how_child_ended(process.returncode)})") from None
        self.last_peak_memory = _child_peak_memory(process.pid)
        if kind == "memory":
            self._stop()
            raise PdfRefused(f"needs more than {self._memory_limit // (1024 * 1024)} MB of memory")
        if kind == "refused":
            raise PdfRefused(value)
        return value

    def _running_child(self) -> subprocess.Popen[bytes]:
        if self._process is not None and self._process.poll() is None:
            return self._process
        self._stop()  # reaps one that died since the last PDF
        code = (f"import sys; sys.path.insert(0, {str(PROJECT_DIR)!r}); import corpus_rules; "
                f"corpus_rules.serve_pdf_extraction({self._memory_limit})")
        process = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        os.set_blocking(process.stdin.fileno(), False)
        os.set_blocking(process.stdout.fileno(), False)
        self._process = process
        self._stop_child = weakref.finalize(self, _end_pdf_child, process)  # at close, collection or exit
        return process

    def _stop(self) -> None:
        if self._stop_child is not None:
            self._stop_child()
        self._process = self._stop_child = None


def _end_pdf_child(process: subprocess.Popen[bytes]) -> None:
    """Kill and reap the child (it holds nothing worth a graceful end): no zombie is left."""
    for pipe in (process.stdin, process.stdout):
        with contextlib.suppress(OSError):
            pipe.close()
    with contextlib.suppress(OSError):
        process.kill()
    process.wait()


def _send_to_child(process: subprocess.Popen[bytes], data: bytes, deadline: float) -> None:
    fd = process.stdin.fileno()
    view = memoryview(data)
    while view:
        _wait_for_child(fd, selectors.EVENT_WRITE, deadline)
        with contextlib.suppress(BlockingIOError):
            view = view[os.write(fd, view[:1 << 20]):]


def _receive_from_child(process: subprocess.Popen[bytes], deadline: float) -> bytes:
    fd = process.stdout.fileno()
    (length,) = _PDF_FRAME_LENGTH.unpack(_read_exactly_from_child(fd, _PDF_FRAME_LENGTH.size, deadline))
    return _read_exactly_from_child(fd, length, deadline)


def _read_exactly_from_child(fd: int, length: int, deadline: float) -> bytes:
    data = bytearray()
    while len(data) < length:
        _wait_for_child(fd, selectors.EVENT_READ, deadline)
        with contextlib.suppress(BlockingIOError):
            chunk = os.read(fd, min(length - len(data), 1 << 20))
            if not chunk:
                raise _PdfChildGone
            data += chunk
    return bytes(data)


def _wait_for_child(fd: int, event: int, deadline: float) -> None:
    with selectors.DefaultSelector() as selector:
        selector.register(fd, event)
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not selector.select(remaining):
            raise TimeoutError


def _how_child_ended(status: int | None) -> str:
    if status is None:
        return "it stopped answering"
    if status < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-status).name}"
        return f"signal {-status}"
    return f"exit status {status}"


def _child_peak_memory(pid: int) -> int | None:
    """Linux: a live process's peak resident memory in bytes (VmHWM); None elsewhere."""
    with contextlib.suppress(OSError, ValueError), open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return None


_PDF_EXTRACTOR: PdfExtractor | None = None
_PDF_EXTRACTOR_LOCK = threading.Lock()


def pdf_extractor() -> PdfExtractor:
    """The program's one PDF extractor (its child process starts with the first PDF)."""
    global _PDF_EXTRACTOR
    with _PDF_EXTRACTOR_LOCK:
        if _PDF_EXTRACTOR is None:
            _PDF_EXTRACTOR = PdfExtractor()
        return _PDF_EXTRACTOR
