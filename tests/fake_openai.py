"""Loopback fake of an OpenAI-compatible embedding server (LM Studio, llama-server, vLLM, TEI),
for tests and benchmarks only (never product code).

It is FakeOllama (same sockets, same vectors, same faults: down, slow, trickling, NaN, wrong
dimensions, other weights) speaking `POST /v1/embeddings` and `GET /v1/models` instead of
Ollama's API, with the faults of those servers besides: a bearer key (a 401 that echoes the key
it was given, as some do), rate limiting (429 with Retry-After) and each server's own words for
an input longer than the model takes. Run as a process: ``python tests/fake_openai.py``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from fake_ollama import FakeOllama, Reply, _Trickle, count_tokens, serve_until_signalled

__all__ = ["FakeOpenAI", "TOO_LONG_WORDS", "main"]

# How each server refuses an input longer than the model takes: (HTTP status, message).
TOO_LONG_WORDS = {
    "vllm": (400, "This model's maximum context length is {limit} tokens. However, you requested {count} tokens in "
                  "the input for embedding generation. Please reduce the length of the input."),
    "tei": (413, "Input validation error: `inputs` must have less than {limit} tokens. Given: {count}"),
    "llama-server": (500, "input is too large to process. increase the physical batch size"),
    "lmstudio": (400, "The number of tokens to keep from the initial prompt is greater than the context length"),
}


class FakeOpenAI(FakeOllama):
    """FakeOllama over the OpenAI-compatible embeddings API; `host` is the base URL (…/v1)."""

    EMBED_PATH = "/v1/embeddings"
    _OWN = ("api_key", "rate_limited_calls", "retry_after", "too_long_words", "served_as", "any_model")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._reset_own()

    def _reset_own(self) -> None:
        self.api_key: str | None = None  # the bearer token required (None: none)
        self.rate_limited_calls = 0  # the next this many embed calls answer 429
        self.retry_after: str | None = "1"  # their Retry-After header (None: left out)
        self.too_long_words = "vllm"  # whose words refuse a too-long input (TOO_LONG_WORDS)
        self.served_as: str | None = None  # the model name reported (llama-server: its file name)
        self.any_model = False  # embed whatever model is named (llama-server, TEI)
        self.keys_seen: list[str | None] = []

    @property
    def host(self) -> str:
        return super().host + "/v1"

    def configure(self, **fields: Any) -> dict[str, Any]:
        own = {key: fields.pop(key) for key in self._OWN if key in fields}
        if fields.get("reset"):
            with self._lock:
                self._reset_own()
        with self._lock:
            for key, value in own.items():
                if key == "rate_limited_calls":
                    value = int(value)
                elif key == "any_model":
                    value = bool(value)
                elif key == "too_long_words" and value not in TOO_LONG_WORDS:
                    raise ValueError(f"unknown too_long_words: {value}")
                setattr(self, key, value)
        return super().configure(**fields)

    def reset(self) -> None:
        with self._lock:
            self._reset_own()
        super().reset()

    def _refuse(self, path: str, headers: Any) -> tuple[int, Any] | None:
        given = headers.get("Authorization")
        with self._lock:
            self.keys_seen.append(given)
            wanted = self.api_key
            limited = path == self.EMBED_PATH and self.rate_limited_calls > 0
            if limited and (wanted is None or given == f"Bearer {wanted}"):
                self.rate_limited_calls -= 1
            retry_after = self.retry_after
        if not path.startswith("/v1/"):
            return None
        if wanted is not None and given != f"Bearer {wanted}":
            shown = (given or "").removeprefix("Bearer ")
            return 401, {"error": {"message": f"Incorrect API key provided: {shown}", "type": "invalid_request_error",
                                   "code": "invalid_api_key"}}
        if limited:
            return 429, Reply({"error": {"message": "Rate limit reached", "type": "rate_limit_exceeded"}},
                              {} if retry_after is None else {"Retry-After": retry_after})
        return None

    def _available(self, name: str) -> bool:
        return self.any_model or super()._available(name)

    def _handle(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        if method == "GET" and path == "/v1/models":
            with self._lock:
                names = [m for m in self.models if FakeOllama._available(self, m)]
                served, ctx, dims = self.served_as, self.context_length, self.dims
            return 200, {"object": "list", "data": [
                {"id": served or name, "object": "model", "owned_by": "fake",
                 "meta": {"n_ctx_train": ctx, "n_embd": dims}} for name in ([names[0]] if served and names else names)]}
        if method == "POST" and path == self.EMBED_PATH:
            return self._openai_embed(body)
        if path.startswith("/_fake/"):
            return super()._handle(method, path, body)
        return 404, {"error": {"message": "Not Found", "type": "not_found_error"}}

    def _openai_embed(self, body: Any) -> tuple[int, Any]:
        body = body if isinstance(body, dict) else {}
        name = str(body.get("model") or "")
        status, payload = self._embed({"model": name, "input": body.get("input", ""), "truncate": False,
                                       **({"dimensions": body["dimensions"]} if "dimensions" in body else {})})
        trickle = payload.interval if isinstance(payload, _Trickle) else None
        payload = payload.payload if isinstance(payload, _Trickle) else payload
        if status == 404:
            return 404, {"error": {"message": f"The model `{name}` does not exist.", "type": "NotFoundError"}}
        if status == 400 and "context length" in str(payload):
            texts = body.get("input") if isinstance(body.get("input"), list) else [str(body.get("input"))]
            with self._lock:
                words, limit = self.too_long_words, self.max_input_tokens or self.context_length
            code, message = TOO_LONG_WORDS[words]
            count = max(count_tokens(text) for text in texts)
            return code, {"error": {"message": message.format(limit=limit, count=count), "type": "invalid_request_error"}}
        if status != 200:
            return status, {"error": {"message": str(payload.get("error", payload)), "type": "server_error"}}
        with self._lock:
            served = self.served_as or name
        answer = {"object": "list", "model": served,
                  "data": [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(payload["embeddings"])],
                  "usage": {"prompt_tokens": payload["prompt_eval_count"], "total_tokens": payload["prompt_eval_count"]}}
        return 200, (answer if trickle is None else _Trickle(answer, trickle))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Loopback fake OpenAI-compatible embedding server (tests/benchmarks).")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--dims", type=int, default=768)
    parser.add_argument("--context-length", type=int, default=2048)
    parser.add_argument("--model", action="append", dest="models", metavar="NAME")
    args = parser.parse_args(argv)
    fake = FakeOpenAI(models=tuple(args.models or ["embeddinggemma"]), dims=args.dims,
                      context_length=args.context_length, port=args.port)
    return serve_until_signalled(fake)


if __name__ == "__main__":
    sys.exit(main())
