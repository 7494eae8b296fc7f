"""Loopback fake of the Ollama HTTP API, for tests and benchmarks only (never product code).

It speaks enough of Ollama's API (/api/embed, /api/tags, /api/show, /api/version, /) for the
real ``ollama.Client`` to talk to it over real HTTP, produces deterministic embeddings with
genuine lexical similarity, and can be told to misbehave in-process or through
``POST /_fake/config`` when run as a separate process (``python tests/fake_ollama.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

__all__ = ["FakeOllama", "fake_embedding", "count_tokens", "normalize_model_name", "calls_carrying", "main"]

_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff66-\uff9f\uac00-\ud7af"
_CJK_RUN_RE = re.compile(f"[{_CJK}]+")
# Identifiers such as OLLAMA_KEEP_ALIVE, sev-1 or v0.12.0 stay one token (and are also split).
_WORD_RE = re.compile(rf"[^\W{_CJK}]+(?:[-.'][^\W{_CJK}]+)*")
_PART_RE = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+")
_TASK_QUERY_RE = re.compile(r"^\s*task:[^|]*\|\s*query:\s*")
_TITLE_TEXT_RE = re.compile(r"^\s*title:\s*(.*?)\s*\|\s*text:\s*", re.DOTALL)
_SIMPLE_PREFIX_RE = re.compile(r"^\s*(?:search_query|search_document|query|passage):\s*")
_STOPWORDS = frozenset(
    "a an the and or of to in on at for by with from as is are was were be been it its this that "
    "these those who what when where which how why do does did i you we they he she".split()
)
_SUFFIXES = ("ing", "ed", "er", "es", "s")
_WORD_WEIGHT = 1.0
_WORD_BIGRAM_WEIGHT = 0.25
_CJK_BIGRAM_WEIGHT = 1.0
_CJK_UNIGRAM_WEIGHT = 0.3
_HEAD_DIMS = 64
_HEAD_WEIGHT = 0.5

_EMBED_CONTEXT_ERROR = "the input length exceeds the context length"


def strip_task_prefix(text: str) -> str:
    """Remove the query/document prompt prefixes embedding models are fed with."""
    if m := _TASK_QUERY_RE.match(text):
        return text[m.end():]
    if m := _TITLE_TEXT_RE.match(text):
        title = m.group(1).strip()
        body = text[m.end():]
        return body if title.lower() in ("", "none") else f"{title}\n{body}"
    if m := _SIMPLE_PREFIX_RE.match(text):
        return text[m.end():]
    return text


def _stem(word: str) -> str:
    # Crude on purpose: enough that pages/paged/pager/paging/page meet at "pag".
    for suffix in _SUFFIXES:
        if word.endswith(suffix) and len(word) - len(suffix) >= 3 and not word.endswith("ss"):
            word = word[: -len(suffix)]
            break
    if word.endswith("e") and len(word) > 3:
        word = word[:-1]
    return word


def _features(text: str) -> dict[str, float]:
    feats: dict[str, float] = {}

    def add(key: str, weight: float) -> None:
        feats[key] = feats.get(key, 0.0) + weight

    text = strip_task_prefix(text)
    for run in _CJK_RUN_RE.findall(text):
        if len(run) == 1:
            add("c1:" + run, _CJK_UNIGRAM_WEIGHT)
        for i in range(len(run) - 1):
            add("c2:" + run[i : i + 2], _CJK_BIGRAM_WEIGHT)
    for token in _WORD_RE.findall(_CJK_RUN_RE.sub(" ", text)):
        lower = token.lower()
        parts = [p.lower() for p in _PART_RE.findall(token)]
        words = {lower} | set(parts) if len(parts) > 1 else {lower}
        for word in words:
            if word in _STOPWORDS:
                continue
            add("w:" + _stem(word), _WORD_WEIGHT)
            for i in range(len(word) - 1):
                add("b:" + word[i : i + 2], _WORD_BIGRAM_WEIGHT)
    return feats


def fake_embedding(text: str, dims: int) -> list[float]:
    """Deterministic unit vector whose cosine similarity tracks shared words and CJK bigrams."""
    if dims <= 0:
        raise ValueError("dims must be positive")
    vec = [0.0] * dims
    head = min(dims, _HEAD_DIMS)
    for key, weight in _features(text).items():
        digest = int.from_bytes(hashlib.blake2b(key.encode("utf-8"), digest_size=16).digest(), "big")
        sign = 1.0 if digest & 1 else -1.0
        vec[(digest >> 1) % dims] += sign * weight
        # A second, lighter hit in the leading buckets keeps `dimensions=N` prefixes non-empty.
        vec[(digest >> 64) % head] += sign * weight * _HEAD_WEIGHT
    norm = math.sqrt(sum(v * v for v in vec))
    if norm == 0.0:
        fixed = [0.0] * dims
        fixed[0] = 1.0
        return fixed
    return [v / norm for v in vec]


def count_tokens(text: str) -> int:
    """Deliberately lenient token count, so any conservative estimator never undercounts it."""
    cjk_chars = sum(len(run) for run in _CJK_RUN_RE.findall(text))
    return len(_WORD_RE.findall(_CJK_RUN_RE.sub(" ", text))) + cjk_chars // 2


def normalize_model_name(name: str) -> str:
    """'embeddinggemma' and 'embeddinggemma:latest' name the same model, as in Ollama."""
    name = name.strip()
    return name if ":" in name.rsplit("/", 1)[-1] else f"{name}:latest"


def _hung_up(connection: socket.socket) -> bool:
    """True when the peer closed the connection (readable with nothing to read)."""
    import select

    try:
        readable, _, _ = select.select([connection], [], [], 0)
        return bool(readable) and connection.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def other_weights(vec: list[float], salt: str, noise: float, call: int) -> list[float]:
    """`vec` as other weights would give it: each dimension's sign flipped by the salt (similarity
    between texts kept, similarity to the plain model's vectors gone), then moved by up to
    `noise` (differently in every call, as a GPU runner's float noise)."""
    if salt:
        signs = hashlib.blake2b(salt.encode("utf-8"), digest_size=64).digest()
        vec = [-v if (signs[(i // 8) % 64] >> (i % 8)) & 1 else v for i, v in enumerate(vec)]
        vec = [vec[-1], *vec[:-1]]  # a rotation too: a salt flipping no sign still changes the vector
    if noise:
        import random

        jitter = random.Random(call)
        vec = _renormalize([v + jitter.uniform(-noise, noise) for v in vec])
    return vec


def _renormalize(vec: list[float]) -> list[float]:
    norm = math.sqrt(sum(v * v for v in vec))
    return [v / norm for v in vec] if norm else vec


class _Server(ThreadingHTTPServer):
    allow_reuse_address = True
    daemon_threads = True

    def __init__(self, address: tuple[str, int], fake: FakeOllama) -> None:
        self.fake = fake
        self.open_sockets: set[socket.socket] = set()
        self.sockets_lock = threading.Lock()
        super().__init__(address, _Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # clients that time out or a stop() mid-request cause expected socket errors

    def close_connections(self) -> None:
        # Keep-alive connections outlive shutdown(); close them so a pooled client sees "refused".
        with self.sockets_lock:
            socks = list(self.open_sockets)
            self.open_sockets.clear()
        for sock in socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body go out in separate writes; with Nagle on, delayed ACKs add ~40 ms a call.
    disable_nagle_algorithm = True
    server: _Server

    def setup(self) -> None:
        super().setup()
        with self.server.sockets_lock:
            self.server.open_sockets.add(self.connection)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            with self.server.sockets_lock:
                self.server.open_sockets.discard(self.connection)

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _send(self, status: int, body: bytes, content_type: str, head_only: bool = False) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head_only:
            self.wfile.write(body)

    def _send_json(self, status: int, payload: Any) -> None:
        self._send(status, json.dumps(payload).encode("utf-8"), "application/json; charset=utf-8")

    def _read_json(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        return json.loads(raw) if raw.strip() else {}

    def do_HEAD(self) -> None:
        if self.path == "/":
            self._send(200, b"Ollama is running", "text/plain; charset=utf-8", head_only=True)
        else:
            self._send(404, b"404 page not found", "text/plain", head_only=True)

    def do_GET(self) -> None:
        self._dispatch("GET", None)

    def do_POST(self) -> None:
        try:
            body = self._read_json()
        except (ValueError, UnicodeDecodeError):
            self._send_json(400, {"error": "invalid character in request body"})
            return
        self._dispatch("POST", body)

    def _dispatch(self, method: str, body: Any) -> None:
        fake = self.server.fake
        path = self.path.split("?", 1)[0]
        if not path.startswith("/_fake/"):
            fake._record(method, path, body)
        refused = fake._refuse(path, self.headers)
        if refused is not None:
            status, payload = refused
        elif path == fake.EMBED_PATH:
            with fake._embedding():
                if not fake._work_per_text(body, self.connection):
                    return  # the client hung up while its texts were being "embedded"
                status, payload = fake._handle(method, path, body)
        else:
            status, payload = fake._handle(method, path, body)
        if isinstance(payload, Reply):
            body_bytes = json.dumps(payload.payload).encode("utf-8")
            self.send_response(status)
            for name, value in {"Content-Type": "application/json", **payload.headers}.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body_bytes)))
            self.end_headers()
            self.wfile.write(body_bytes)
        elif isinstance(payload, _Trickle):
            self._send_trickling(status, payload)
        elif isinstance(payload, str):
            self._send(status, payload.encode("utf-8"), "text/plain; charset=utf-8")
        else:
            self._send_json(status, payload)

    def _send_trickling(self, status: int, trickle: _Trickle) -> None:
        """Headers at once, then the body a byte at a time: a stalled server that is not silent."""
        body = json.dumps(trickle.payload).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.flush()
        for i in range(len(body)):
            if self.server.fake._stopping.wait(trickle.interval):
                return
            try:
                self.wfile.write(body[i:i + 1])
                self.wfile.flush()
            except OSError:
                return  # the client gave up


class _Trickle:
    def __init__(self, payload: Any, interval: float) -> None:
        self.payload, self.interval = payload, interval


class Reply:
    """A JSON answer with headers of its own (Retry-After, say)."""

    def __init__(self, payload: Any, headers: dict[str, str]) -> None:
        self.payload, self.headers = payload, headers


def calls_carrying(call_inputs: list[list[str]], text: str) -> int:
    """How many embed calls (their inputs, as in calls()["call_inputs"]) carried an input
    containing `text`."""
    return sum(1 for inputs in call_inputs if any(text in item for item in inputs))


class FakeOllama:
    """In-process fake Ollama server on 127.0.0.1 with switchable faults and a call record."""

    EMBED_PATH = "/api/embed"  # the calls that count as embedding (slots, per-text delays, holds)

    def __init__(
        self,
        models: tuple[str, ...] | list[str] = ("embeddinggemma",),
        dims: int = 768,
        context_length: int = 2048,
        port: int = 0,
    ) -> None:
        self._defaults: dict[str, Any] = {
            "models": tuple(models),
            "dims": dims,
            "context_length": context_length,
        }
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self.port = port
        self.models: tuple[str, ...] = tuple(models)
        self.dims = dims
        self.context_length = context_length
        self.missing_models: set[str] = set()
        self.fail_after: int | None = None
        # Faults keyed on content, not on call numbers (the client sizes its calls by the pace it
        # measures, so a loaded machine changes the numbering): once a call carrying this text has
        # arrived, every later call answers 500, and the models in missing_after_carrying are gone.
        self.fail_after_carrying: str | None = None
        self.missing_after_carrying: tuple[str, set[str]] | None = None
        # (text, dims): once a call carrying the text has arrived, later calls answer vectors of
        # that many dimensions (a host whose model was swapped under the same name mid-run).
        self.wrong_dims_after_carrying: tuple[str, int] | None = None
        self.delay_seconds: float = 0.0
        self.max_input_tokens: int | None = None
        self.wrong_dims: int | None = None
        self.ignore_dimensions = False  # an Ollama too old for /api/embed's `dimensions`
        # Faults of a broken or hostile endpoint: answer embed calls a byte every this many
        # seconds; put NaN into the vectors of inputs containing this text ("" = every input).
        self.trickle_seconds: float | None = None
        self.nan_for: str | None = None
        # A CPU-only embedder: this many seconds per input text, `slots` calls at a time (Ollama's
        # OLLAMA_NUM_PARALLEL; more wait their turn), the work dropped when the client disconnects.
        self.delay_per_text_seconds: float = 0.0
        self.slots = 1
        self.weights = ""  # folded into the model digest and the vectors (a re-pull: other weights)
        # Vectors of another model (quantisation, proxy, mistake) under the same name and digest.
        self.embeds_as = ""
        # Float noise of a real runner: each value moved by up to this much, differently every call.
        self.vector_noise = 0.0
        # Cleared by configure(hold=True): embed calls wait until configure(hold=False), so a test
        # can act while a call is in flight however slow the machine is.
        self._released = threading.Event()
        self._released.set()
        # configure(hold_carrying=TEXT): calls carrying TEXT wait until it is cleared, so a test can
        # act while one chosen file's chunks are in flight, whatever the calls' sizes and numbers;
        # let go, they answer as configured then (fail_after, missing_models).
        self.hold_carrying: str | None = None
        self._runner = threading.BoundedSemaphore(self.slots)
        self.embeds_in_flight = 0
        self.most_embeds_in_flight = 0  # embed calls being handled at once, at most so far
        self.embed_calls = 0
        self.embedded_inputs: list[str] = []
        self.answered_inputs: list[str] = []  # the inputs of the embed calls answered with vectors
        self.call_inputs: list[list[str]] = []  # the inputs of each embed call, in arrival order
        self._carried: set[str] = set()  # the content-keyed faults' texts some call has carried
        self.requests: list[tuple[str, str, Any]] = []

    # lifecycle ----------------------------------------------------------------------------
    def start(self, port: int | None = None) -> FakeOllama:
        if self._server is not None:
            raise RuntimeError("FakeOllama already running")
        self._stopping.clear()
        self._server = _Server(("127.0.0.1", self.port if port is None else port), self)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
            name=f"fake-ollama-{self.port}", daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        self._stopping.set()  # wakes handlers sleeping in delay_seconds
        server.shutdown()
        server.server_close()
        server.close_connections()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def restart(self) -> FakeOllama:
        """Start again on the same port, for "Ollama went down and came back" scenarios."""
        self.stop()
        return self.start(self.port)

    @property
    def running(self) -> bool:
        return self._server is not None

    @property
    def host(self) -> str:
        if not self.port:
            raise RuntimeError("FakeOllama has not been started")
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> FakeOllama:
        return self if self.running else self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # configuration -------------------------------------------------------------------------
    def configure(self, **fields: Any) -> dict[str, Any]:
        """Set any of the fault/model fields (same names as POST /_fake/config); returns config."""
        with self._lock:
            if fields.pop("reset", False):
                self._reset_locked()
            for key, value in fields.items():
                if key == "models":
                    self.models = tuple([value] if isinstance(value, str) else value)
                elif key == "missing_models":
                    self.missing_models = set([value] if isinstance(value, str) else value)
                elif key in ("dims", "context_length"):
                    setattr(self, key, int(value))
                elif key in ("fail_after", "max_input_tokens", "wrong_dims"):
                    setattr(self, key, None if value is None else int(value))
                elif key == "delay_seconds":
                    self.delay_seconds = float(value)
                elif key == "delay_per_text_seconds":
                    self.delay_per_text_seconds = float(value)
                elif key == "slots":
                    self.slots = int(value)
                    self._runner = threading.BoundedSemaphore(self.slots)
                elif key == "trickle_seconds":
                    self.trickle_seconds = None if value is None else float(value)
                elif key == "ignore_dimensions":
                    self.ignore_dimensions = bool(value)
                elif key == "nan_for":
                    self.nan_for = None if value is None else str(value)
                elif key == "weights":  # a re-pull under the same name: another digest in /api/tags
                    self.weights = str(value)
                elif key == "embeds_as":
                    self.embeds_as = str(value)
                elif key == "vector_noise":
                    self.vector_noise = float(value)
                elif key == "fail_after_carrying":  # counted from now on
                    self.fail_after_carrying = None if value is None else str(value)
                    self._carried.clear()
                elif key == "missing_after_carrying":  # [text, [model, ...]], counted from now on
                    self.missing_after_carrying = None if value is None else (str(value[0]), set(value[1]))
                    self._carried.clear()
                elif key == "wrong_dims_after_carrying":  # [text, dims], counted from now on
                    self.wrong_dims_after_carrying = None if value is None else (str(value[0]), int(value[1]))
                    self._carried.clear()
                elif key == "hold":
                    (self._released.clear if value else self._released.set)()
                elif key == "hold_carrying":
                    self.hold_carrying = None if value is None else str(value)
                else:
                    raise ValueError(f"unknown fake config field: {key}")
            return self._config_locked()

    def config(self) -> dict[str, Any]:
        with self._lock:
            return self._config_locked()

    def _config_locked(self) -> dict[str, Any]:
        return {
            "models": list(self.models),
            "missing_models": sorted(self.missing_models),
            "dims": self.dims,
            "context_length": self.context_length,
            "fail_after": self.fail_after,
            "fail_after_carrying": self.fail_after_carrying,
            "missing_after_carrying": (None if self.missing_after_carrying is None else
                                       [self.missing_after_carrying[0], sorted(self.missing_after_carrying[1])]),
            "wrong_dims_after_carrying": (None if self.wrong_dims_after_carrying is None else
                                          list(self.wrong_dims_after_carrying)),
            "delay_seconds": self.delay_seconds,
            "max_input_tokens": self.max_input_tokens,
            "wrong_dims": self.wrong_dims,
            "ignore_dimensions": self.ignore_dimensions,
            "trickle_seconds": self.trickle_seconds,
            "nan_for": self.nan_for,
            "delay_per_text_seconds": self.delay_per_text_seconds,
            "slots": self.slots,
            "weights": self.weights,
            "embeds_as": self.embeds_as,
            "vector_noise": self.vector_noise,
            "hold": not self._released.is_set(),
            "hold_carrying": self.hold_carrying,
        }

    def reset(self) -> None:
        """Restore constructor defaults, switch all faults off and clear the call record."""
        with self._lock:
            self._reset_locked()

    def _reset_locked(self) -> None:
        self.models = self._defaults["models"]
        self.dims = self._defaults["dims"]
        self.context_length = self._defaults["context_length"]
        self.missing_models = set()
        self.fail_after = None
        self.fail_after_carrying = None
        self.missing_after_carrying = None
        self.wrong_dims_after_carrying = None
        self.delay_seconds = 0.0
        self.max_input_tokens = None
        self.wrong_dims = None
        self.ignore_dimensions = False
        self.trickle_seconds = None
        self.nan_for = None
        self._released.set()
        self.hold_carrying = None
        self.delay_per_text_seconds = 0.0
        self.slots = 1
        self._runner = threading.BoundedSemaphore(1)
        self.weights = ""
        self.embeds_as = ""
        self.vector_noise = 0.0
        self.most_embeds_in_flight = 0
        self.embed_calls = 0
        self.embedded_inputs = []
        self.answered_inputs = []
        self.call_inputs = []
        self._carried = set()
        self.requests = []

    def calls(self) -> dict[str, Any]:
        with self._lock:
            return {
                "embed_calls": self.embed_calls,
                "embedded_inputs": list(self.embedded_inputs),
                "answered_inputs": list(self.answered_inputs),
                "most_embeds_in_flight": self.most_embeds_in_flight,
                "call_inputs": [list(inputs) for inputs in self.call_inputs],
                "requests": [[m, p, b] for m, p, b in self.requests],
            }

    def calls_carrying(self, text: str) -> int:
        with self._lock:
            return calls_carrying(self.call_inputs, text)

    def answered_carrying(self, text: str) -> int:
        """How many inputs containing `text` were answered with vectors so far."""
        with self._lock:
            return sum(text in item for item in self.answered_inputs)

    # request handling ----------------------------------------------------------------------
    def _record(self, method: str, path: str, body: Any) -> None:
        with self._lock:
            self.requests.append((method, path, body))

    def _refuse(self, path: str, headers: Any) -> tuple[int, Any] | None:
        """An answer given before the request is handled (FakeOpenAI's key check); None: handle it."""
        return None

    def _carrying_texts(self) -> list[str]:
        texts = [self.fail_after_carrying]
        if self.missing_after_carrying is not None:
            texts.append(self.missing_after_carrying[0])
        if self.wrong_dims_after_carrying is not None:
            texts.append(self.wrong_dims_after_carrying[0])
        return [text for text in texts if text is not None]

    def _available(self, name: str) -> bool:
        wanted = normalize_model_name(name)
        missing = {normalize_model_name(m) for m in self.missing_models}
        return wanted not in missing and wanted in {normalize_model_name(m) for m in self.models}

    def _handle(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        if method == "GET" and path == "/":
            return 200, "Ollama is running"
        if method == "GET" and path == "/api/version":
            return 200, {"version": "0.12.0"}
        if method == "GET" and path == "/api/tags":
            return 200, self._tags()
        if method == "POST" and path == "/api/show":
            return self._show(body)
        if method == "POST" and path == "/api/embed":
            return self._embed(body)
        if method == "POST" and path == "/_fake/config":
            try:
                return 200, self.configure(**(body or {}))
            except (TypeError, ValueError) as exc:
                return 400, {"error": str(exc)}
        if method == "GET" and path == "/_fake/config":
            return 200, self.config()
        if method == "GET" and path == "/_fake/calls":
            return 200, self.calls()
        if method == "POST" and path == "/_fake/reset":
            self.reset()
            return 200, self.config()
        return 404, "404 page not found"

    def _model_entry(self, name: str) -> dict[str, Any]:
        full = normalize_model_name(name)
        return {
            "name": full,
            "model": full,
            "modified_at": "2025-09-01T00:00:00Z",
            "size": 621875417,
            "digest": hashlib.sha256(f"{full}{self.weights}".encode()).hexdigest(),
            "details": self._details(),
        }

    @staticmethod
    def _details() -> dict[str, Any]:
        return {
            "parent_model": "",
            "format": "gguf",
            "family": "gemma3",
            "families": ["gemma3"],
            "parameter_size": "307.58M",
            "quantization_level": "BF16",
        }

    def _tags(self) -> dict[str, Any]:
        with self._lock:
            names = [m for m in self.models if self._available(m)]
        return {"models": [self._model_entry(m) for m in names]}

    def _not_found(self, name: str) -> tuple[int, Any]:
        return 404, {"error": f'model "{name}" not found, try pulling it first'}

    def _show(self, body: Any) -> tuple[int, Any]:
        name = str((body or {}).get("model") or (body or {}).get("name") or "")
        with self._lock:
            if not self._available(name):
                return self._not_found(name)
            dims, ctx = self.dims, self.context_length
        return 200, {
            "license": "Gemma Terms of Use",
            "modelfile": f"FROM {normalize_model_name(name)}\n",
            "parameters": "",
            "template": "{{ .Prompt }}",
            "details": self._details(),
            "model_info": {
                "general.architecture": "gemma3",
                "general.parameter_count": 307581696,
                "gemma3.context_length": ctx,
                "gemma3.embedding_length": dims,
            },
            "capabilities": ["embedding"],
            "modified_at": "2025-09-01T00:00:00Z",
        }

    @contextlib.contextmanager
    def _embedding(self) -> Iterator[None]:
        with self._lock:
            self.embeds_in_flight += 1
            self.most_embeds_in_flight = max(self.most_embeds_in_flight, self.embeds_in_flight)
        try:
            yield
        finally:
            with self._lock:
                self.embeds_in_flight -= 1

    def _work_per_text(self, body: Any, connection: socket.socket) -> bool:
        """Spend delay_per_text_seconds per input text, `slots` calls at a time; False when the client
        disconnected meanwhile (its work is dropped, as a runner does when the request is cancelled)."""
        with self._lock:
            per_text = self.delay_per_text_seconds
        if per_text <= 0:
            return True
        raw = body.get("input") if isinstance(body, dict) else None
        count = len(raw) if isinstance(raw, list) else 1
        with self._runner:
            deadline = time.monotonic() + per_text * count
            while (left := deadline - time.monotonic()) > 0:
                if self._stopping.wait(min(left, 0.05)) or _hung_up(connection):
                    return False
        return True

    def _embed(self, body: Any) -> tuple[int, Any]:
        started = time.perf_counter_ns()
        body = body if isinstance(body, dict) else {}
        name = str(body.get("model") or "")
        raw = body.get("input", "")
        if isinstance(raw, str):
            inputs: list[str] | None = [raw] if raw else []  # "" gets no embeddings, as in Ollama
        elif isinstance(raw, list) and all(isinstance(x, str) for x in raw):
            inputs = list(raw)
        else:
            inputs = None
        truncate = body.get("truncate", True) is not False
        dimensions = body.get("dimensions")

        with self._lock:
            self.embed_calls += 1
            self.embedded_inputs.extend(inputs or [])
            self.call_inputs.append(list(inputs or []))
            call_number = self.embed_calls
            delay, fail_after = self.delay_seconds, self.fail_after
            # A content-keyed fault hits the calls after the first one carrying its text.
            failing = self.fail_after_carrying in self._carried
            if self.missing_after_carrying is not None and self.missing_after_carrying[0] in self._carried:
                self.missing_models |= self.missing_after_carrying[1]
            switched = self.wrong_dims_after_carrying
            switched_dims = switched[1] if switched is not None and switched[0] in self._carried else None
            self._carried |= {text for text in self._carrying_texts() if any(text in item for item in inputs or [])}
            hold = self.hold_carrying
            held = hold if hold is not None and any(hold in item for item in inputs or []) else None
        if delay > 0:
            self._stopping.wait(delay)
        while not self._released.wait(0.05) and not self._stopping.is_set():
            pass
        while held is not None and self.hold_carrying == held and not self._stopping.wait(0.01):
            pass
        if held is not None:  # a held call meets the faults configured while it was held
            with self._lock:
                fail_after = self.fail_after
        if failing or (fail_after is not None and call_number > fail_after):
            return 500, {"error": "llama runner process has terminated: exit status 2 (fake fail_after)"}
        if inputs is None:
            return 400, {"error": "invalid input type"}

        with self._lock:
            if not self._available(name):
                return self._not_found(name)
            limit = self.max_input_tokens if self.max_input_tokens is not None else self.context_length
            dims = self.wrong_dims if self.wrong_dims is not None else self.dims
            dims = switched_dims if switched_dims is not None else dims
            if self.ignore_dimensions:
                dimensions = None

        counts = [count_tokens(text) for text in inputs]
        if not truncate and any(c > limit for c in counts):
            return 400, {"error": _EMBED_CONTEXT_ERROR}
        if dimensions is not None and (not isinstance(dimensions, int) or dimensions <= 0):
            return 400, {"error": "dimensions must be a positive integer"}

        with self._lock:
            salt, noise = self.weights + self.embeds_as, self.vector_noise
        vectors = [other_weights(fake_embedding(text, dims), salt, noise, call_number) for text in inputs]
        if dimensions is not None and dimensions < dims:
            vectors = [_renormalize(v[:dimensions]) for v in vectors]
        with self._lock:
            nan_for, trickle = self.nan_for, self.trickle_seconds
        if nan_for is not None:
            vectors = [[math.nan] * len(v) if nan_for in text else v for v, text in zip(vectors, inputs, strict=True)]
        with self._lock:
            self.answered_inputs.extend(inputs)
        payload = {
            "model": name,
            "embeddings": vectors,
            "total_duration": time.perf_counter_ns() - started,
            "load_duration": 0,
            "prompt_eval_count": sum(min(c, limit) for c in counts),
        }
        return 200, (payload if trickle is None else _Trickle(payload, trickle))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Loopback fake Ollama server (tests/benchmarks).")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--dims", type=int, default=768)
    parser.add_argument("--context-length", type=int, default=2048)
    parser.add_argument("--model", action="append", dest="models", metavar="NAME")
    args = parser.parse_args(argv)

    fake = FakeOllama(
        models=tuple(args.models or ["embeddinggemma"]),
        dims=args.dims,
        context_length=args.context_length,
        port=args.port,
    )
    return serve_until_signalled(fake)


def serve_until_signalled(fake: FakeOllama) -> int:
    """Start `fake`, announce its host on stdout, and serve until SIGTERM/SIGINT or until the
    parent process is gone (a crashed test or benchmark must not leave the fake behind)."""
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    fake.start()
    print(f"FAKE_OLLAMA_READY {fake.host}", flush=True)
    try:
        while not done.wait(0.2) and os.getppid() != 1:
            pass
    finally:
        fake.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
