"""Any local embedding server (issue 46 §1) and the model fingerprint (issue 42 D3).

The real httpx client (OpenAIEmbedder) against the loopback FakeOpenAI (LM Studio, llama-server,
vLLM, TEI), ingest and the server through the one embedder seam, and the fingerprint that tells
one model's vectors from another's whatever the server calls it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fake_ollama import FakeOllama
from fake_openai import TOO_LONG_WORDS, FakeOpenAI
from faultlib import write_handbooks
from helpers import (
    SERVER,
    Hosts,
    chunk_inputs,
    copy_sample,
    current_of,
    dispatched,
    in_process_service,
    ingest_in_process,
    raw_server,
    run_ingest,
    sample_built,
    search_paths,
    stderr_text,
)

import corpus_rules as rules
from corpus_rules import ErrorCode, RagError

KEY = "sk-local-rag-test-key-0123456789"
QUESTION = "who gets paged for a sev-1"


@pytest.fixture
def openai() -> Iterator[FakeOpenAI]:
    with FakeOpenAI() as fake:
        yield fake


def openai_env(*fakes: FakeOpenAI, **extra: str) -> dict[str, str]:
    """The variables of a run against these OpenAI-compatible servers."""
    return {"RAG_EMBED_API": "openai", "RAG_EMBED_URL": ",".join(fake.host for fake in fakes), **extra}


def embedder(fake: FakeOpenAI, model: str = "embeddinggemma", timeout: float = 5, **kwargs: Any) -> rules.Embedder:
    settings = rules.load_settings(openai_env(fake, RAG_EMBED_MODEL=model, RAG_EMBED_TIMEOUT=str(timeout),
                                              **({"RAG_EMBED_API_KEY": kwargs.pop("key")} if "key" in kwargs else {})))
    return settings.embedder(fake.host, **kwargs)


def refused(call: Any) -> RagError:
    with pytest.raises(RagError) as caught:
        call()
    return caught.value


# ---------------------------------------------------------------------------
# Settings.


def test_the_api_and_its_addresses_are_read_once() -> None:
    ollama = rules.load_settings({"OLLAMA_HOST": "gpu:11434"})
    assert (ollama.embed_api, ollama.ollama_hosts) == ("ollama", ("http://gpu:11434",))
    assert isinstance(ollama.embedder(ollama.ollama_host), rules.OllamaEmbedder)
    both = rules.load_settings({"RAG_EMBED_API": "OpenAI", "RAG_EMBED_URL": "http://a:1234/v1/, b:8080/v1",
                                "OLLAMA_HOST": "ignored:1"})
    assert (both.embed_api, both.ollama_hosts) == ("openai", ("http://a:1234/v1", "http://b:8080/v1"))
    assert isinstance(both.embedder(both.ollama_host), rules.OpenAIEmbedder)
    # RAG_EMBED_URL serves Ollama too
    assert rules.load_settings({"RAG_EMBED_URL": "http://gpu:11434"}).ollama_hosts == ("http://gpu:11434",)


@pytest.mark.parametrize(("env", "names"), [
    ({"RAG_EMBED_API": "tei"}, "RAG_EMBED_API"),
    ({"RAG_EMBED_API": "openai"}, "RAG_EMBED_URL"),
    ({"RAG_EMBED_API": "openai", "RAG_EMBED_URL": "http://user:s3cret@host:1234/v1"}, "RAG_EMBED_URL"),
    ({"RAG_EMBED_API_KEY": "two words"}, "RAG_EMBED_API_KEY"),
    ({"RAG_EMBED_PREFIXES": "gemma"}, "RAG_EMBED_PREFIXES"),
])
def test_a_bad_embedding_setting_is_a_configuration_error_naming_it(env: dict[str, str], names: str) -> None:
    error = refused(lambda: rules.load_settings(env))
    assert error.code is ErrorCode.INVALID_ARGUMENT and names in error.message + error.hint
    assert "s3cret" not in error.message + error.hint and "two words" not in error.message + error.hint


def test_the_key_is_in_no_representation_of_the_settings() -> None:
    settings = rules.load_settings(openai_env(FakeOpenAI(port=9), RAG_EMBED_API_KEY=KEY))
    assert settings.embed_api_key == KEY
    assert KEY not in repr(settings) + settings.describe() + repr(settings.embedder(settings.ollama_host))


@pytest.mark.parametrize(("served", "scheme"), [
    ("embeddinggemma-300M-Q8_0.gguf", "embeddinggemma"),
    ("/models/embeddinggemma-300m-qat-Q4_0.gguf", "embeddinggemma"),
    ("text-embedding-embeddinggemma-300m-qat", "embeddinggemma"),  # LM Studio
    ("ggml-org/embeddinggemma-300M-GGUF", "embeddinggemma"),
    ("text-embedding-nomic-embed-text-v1.5", "nomic-embed-text"),
    ("nomic-embed-text-v1.5.Q8_0.gguf", "nomic-embed-text"),
    ("intfloat/multilingual-e5-small", "e5"),
    ("BAAI/bge-m3", "bge-m3"),
    ("Snowflake/snowflake-arctic-embed-l-v2.0", "snowflake-arctic-embed2"),
])
def test_prefixes_follow_the_model_however_the_server_names_it(served: str, scheme: str) -> None:
    found = rules.prefix_scheme_for(served)
    assert found is not None and found.name == scheme


def test_rag_embed_prefixes_names_the_scheme_of_an_unknown_model() -> None:
    import ingest

    unknown = rules.load_settings({"RAG_EMBED_MODEL": "acme-embed-v3"})
    assert ingest.scheme_for(unknown).name == "none"
    named = rules.load_settings({"RAG_EMBED_MODEL": "acme-embed-v3", "RAG_EMBED_PREFIXES": "e5"})
    assert ingest.scheme_for(named) is rules.PREFIX_SCHEMES["e5"]


# ---------------------------------------------------------------------------
# The client against the fake: each fault in the vocabulary.


def test_vectors_come_back_in_order_with_the_name_the_server_reports(openai: FakeOpenAI) -> None:
    openai.configure(served_as="embeddinggemma-300M-Q8_0.gguf", any_model=True)
    client = embedder(openai, "whatever-it-is-called")
    matrix = client.embed(["alpha beta", "gamma", "delta epsilon"])
    assert matrix.shape == (3, 768) and client.served_model == "embeddinggemma-300M-Q8_0.gguf"
    assert client.model_info() == rules.ModelInfo(context_length=2048, dims=768)  # llama-server's meta
    assert client.model_digest() is None  # the API has no digest: the fingerprint stands in for it


def test_a_server_that_is_down_is_named_with_a_hint_for_that_api() -> None:
    error = refused(lambda: embedder(FakeOpenAI(port=9)).embed(["x"]))
    assert error.code is ErrorCode.EMBEDDER_UNAVAILABLE and "http://127.0.0.1:9/v1" in error.message
    assert "ollama" not in error.hint.lower() and "RAG_EMBED_URL" in error.hint


def test_a_refused_key_is_said_and_never_shown(openai: FakeOpenAI) -> None:
    """The fake echoes the key it was given in its 401, as some servers do."""
    openai.configure(api_key="the-right-one")
    error = refused(lambda: embedder(openai, key=KEY).embed(["x"]))
    assert error.code is ErrorCode.EMBEDDER_UNAVAILABLE and "refused the API key (HTTP 401)" in error.message
    assert "RAG_EMBED_API_KEY" in error.hint and KEY not in error.message + error.hint + repr(error.__cause__)
    missing = refused(lambda: embedder(openai).embed(["x"]))
    assert "asks for an API key" in missing.message
    openai.configure(api_key=KEY)
    assert embedder(openai, key=KEY).embed(["x"]).shape == (1, 768)
    assert openai.keys_seen[-1] == f"Bearer {KEY}"


def test_an_unknown_model_is_model_not_found_naming_what_the_server_lists(openai: FakeOpenAI) -> None:
    error = refused(lambda: embedder(openai, "nomic-embed-text").embed(["x"]))
    assert error.code is ErrorCode.MODEL_NOT_FOUND and "'nomic-embed-text'" in error.message
    assert "'embeddinggemma'" in error.hint and "RAG_EMBED_MODEL" in error.hint


def test_a_url_without_the_api_path_says_where_the_api_is(openai: FakeOpenAI) -> None:
    client = rules.load_settings(openai_env(openai)).embedder(openai.host.removesuffix("/v1"))
    error = refused(lambda: client.embed(["x"]))
    assert error.code is ErrorCode.EMBEDDER_UNAVAILABLE and "/v1" in error.hint


def test_rate_limiting_waits_as_long_as_retry_after_says_then_asks_again(openai: FakeOpenAI) -> None:
    openai.configure(rate_limited_calls=2, retry_after="0.4")
    started = time.monotonic()
    assert embedder(openai).embed(["x"]).shape == (1, 768)
    assert time.monotonic() - started >= 0.8 and openai.calls()["embed_calls"] == 1  # two 429s, then one answer
    openai.configure(rate_limited_calls=100, retry_after="0.05")
    error = refused(lambda: embedder(openai).embed(["x"]))  # bounded: it gives up, saying why
    assert error.code is ErrorCode.EMBEDDER_UNAVAILABLE and "refusing calls for now (HTTP 429)" in error.message
    openai.configure(rate_limited_calls=1, retry_after="3600")  # longer than the call's time: not waited for
    started = time.monotonic()
    assert "HTTP 429" in refused(lambda: embedder(openai, timeout=2).embed(["x"])).message
    assert time.monotonic() - started < 2


def test_retry_after_reads_seconds_and_dates_bounded() -> None:
    assert rules.retry_after_seconds("2") == 2.0
    assert rules.retry_after_seconds(None) == rules.retry_after_seconds("soon") == 1.0
    assert rules.retry_after_seconds("86400") == rules.RATE_LIMIT_WAIT_MAX_S
    assert rules.retry_after_seconds("-5") == 0.0
    assert rules.retry_after_seconds("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # in the past


@pytest.mark.parametrize("words", sorted(TOO_LONG_WORDS))
def test_each_servers_words_for_too_long_are_input_too_long(openai: FakeOpenAI, words: str) -> None:
    openai.configure(too_long_words=words, max_input_tokens=3)
    with pytest.raises(rules.InputTooLong):
        embedder(openai).embed(["one two three four five"])


def test_wrong_dimensions_nan_and_a_slow_server_are_refused(openai: FakeOpenAI) -> None:
    openai.configure(ignore_dimensions=True)
    ignored = refused(lambda: embedder(openai, dimensions=256).embed(["x"]))
    assert ignored.code is ErrorCode.INVALID_ARGUMENT and "when asked for 256" in ignored.message
    openai.configure(ignore_dimensions=False, nan_for="poison")
    with pytest.raises(rules.InvalidVectors):
        embedder(openai).embed(["clean", "poison pill"])
    openai.configure(nan_for=None, delay_seconds=3)
    started = time.monotonic()
    with pytest.raises(rules.EmbedderTimeout):
        embedder(openai, timeout=0.5).embed(["x"])
    assert time.monotonic() - started < 2


# ---------------------------------------------------------------------------
# The fingerprint.


def test_a_fingerprint_tolerates_float_noise_and_tells_other_models_apart(openai: FakeOpenAI) -> None:
    reference = embedder(openai).fingerprint()
    openai.configure(vector_noise=1e-3)  # a runner's float noise, different in every call
    noisy = [embedder(openai).fingerprint() for _ in range(3)]
    assert all(reference.agrees(fp) and fp != reference for fp in noisy)
    openai.configure(vector_noise=0, embeds_as="Q4_K_M")
    other = embedder(openai).fingerprint()
    assert not reference.agrees(other) and other.similarity(reference) < 0.5
    openai.configure(embeds_as="")
    smaller = embedder(openai, dimensions=256).fingerprint()
    assert smaller.dims == 256 and not reference.agrees(smaller)


def test_a_fingerprint_reads_back_and_an_unreadable_one_is_not_known() -> None:
    fingerprint = rules.ModelFingerprint.of([0.6, 0.8] + [0.0] * 62, "embeddinggemma-300M-Q8_0.gguf")
    assert rules.ModelFingerprint.from_dict(json.loads(json.dumps(fingerprint.to_dict()))) == fingerprint
    for junk in (None, "x", {"dims": 2}, {"dims": True, "sketch": [0.0] * 64}, {"dims": 2, "sketch": ["a"] * 64},
                 {"dims": 2, "sketch": [float("nan")] * 64}, {"dims": 2, "sketch": [0.0] * 3}):
        assert rules.ModelFingerprint.from_dict(junk) is None
    stamp = rules.IndexStamp(None, None, "now", 1, 1, fingerprint=fingerprint)
    assert rules.IndexStamp.from_dict(json.loads(json.dumps(stamp.to_dict()))) == stamp
    old = {k: v for k, v in stamp.to_dict().items() if k != "fingerprint"}  # a store from before fingerprints
    assert rules.IndexStamp.from_dict(old).fingerprint is None


# ---------------------------------------------------------------------------
# Ingest through the seam.


def test_ingest_with_an_openai_server_records_the_model_and_never_the_key(openai: FakeOpenAI, tmp_path: Path) -> None:
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    openai.configure(api_key=KEY, served_as="embeddinggemma-300M-Q8_0.gguf", any_model=True)
    done = ingest_in_process(openai, corpus, store, **openai_env(openai, RAG_EMBED_API_KEY=KEY))
    assert done.code == 0, done.err
    assert done.summary["chunks_embedded"] == len(chunk_inputs(openai)) > 0
    current = current_of(store)
    assert current["stamp"]["fingerprint"]["served_model"] == "embeddinggemma-300M-Q8_0.gguf"
    assert current["stamp"]["fingerprint"]["dims"] == 768 and current["stamp"]["model_digest"] is None
    assert current["manifest"]["prefix_scheme"] == "embeddinggemma"
    written = (store / rules.CURRENT_FILE).read_text() + "".join(
        p.read_bytes().decode("latin-1") for p in store.rglob("*") if p.is_file())
    assert KEY not in written and KEY not in done.err + done.out
    assert set(openai.keys_seen) == {f"Bearer {KEY}"}


@pytest.mark.heavy  # about 1 s of CPU in ingest runs: in --all, to keep the fast tier's budget
def test_a_chunk_too_long_for_the_server_is_split_as_with_ollama(openai: FakeOpenAI, tmp_path: Path) -> None:
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    write_handbooks(corpus, {"handbook.md": 3}, "A")
    openai.configure(too_long_words="tei", max_input_tokens=120)
    done = ingest_in_process(openai, corpus, store, **openai_env(openai))
    assert done.code == 0, done.err
    assert done.summary["chunks_embedded"] > 0 and done.summary["failed"] == 0


def test_a_host_of_another_model_under_the_same_name_and_digest_is_left_out_by_name(tmp_path: Path) -> None:
    """Issue 42 D3 at ingest: the liar lists the right digest; its fingerprint gives it away."""
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    with FakeOllama() as good, FakeOllama() as liar:
        liar.configure(embeds_as="Q2_K")
        done = ingest_in_process(Hosts((good, liar)), corpus, store)
        assert done.code == 0, done.err
        # the index has no fingerprint yet: one host against one, the one listed first stands
        assert f"Ollama at {liar.host} embeds with another model than Ollama at {good.host}" in done.err
        assert "that host is left out of this run" in done.err and not chunk_inputs(liar, "embedded_inputs")
        good.reset()
        liar.reset()
        liar.configure(embeds_as="Q2_K")
        corpus.joinpath("new.md").write_text("# New\n\nA page about kettles and marble.\n")
        again = ingest_in_process(Hosts((liar, good)), corpus, store)  # now the index decides, not the order
        assert again.code == 0, again.err
        assert f"Ollama at {liar.host} embeds with another model than the index's vectors" in again.err
        assert not chunk_inputs(liar, "embedded_inputs") and chunk_inputs(good)
        assert not again.summary["model_changed"]


def test_an_index_whose_model_moved_behind_the_name_is_re_embedded(fake: FakeOllama, tmp_path: Path) -> None:
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    fake.reset()
    assert ingest_in_process(fake, corpus, store).code == 0
    before = current_of(store)["stamp"]["fingerprint"]
    fake.configure(embeds_as="another quantisation")  # same name, same digest, other vectors
    try:
        done = ingest_in_process(fake, corpus, store)
    finally:
        fake.reset()
    assert done.code == 0 and done.summary["model_changed"], done.err
    assert "its vectors' fingerprint moved" in done.err
    assert done.summary["chunks_embedded"] == done.summary["chunks_written"] > 0
    after = current_of(store)["stamp"]["fingerprint"]
    assert after != before and current_of(store)["stamp"]["model_digest"] is not None


# ---------------------------------------------------------------------------
# The server through the seam.


def test_the_server_skips_a_host_of_another_model_and_degrades_when_none_is_left(
        indexed_sample: tuple[Path, Path], tmp_path: Path) -> None:
    """Issue 42 D3 at query time: the fingerprint text rides with a host's first query; a host
    whose vectors disagree is skipped; with none left hybrid answers from keywords."""
    with FakeOllama() as liar, FakeOllama() as good:
        liar.configure(embeds_as="Q2_K")
        built = sample_built(indexed_sample, tmp_path, Hosts((liar, good)).host)
        svc = in_process_service(built, RAG_EMBED_TIMEOUT="6")
        is_error, payload = dispatched(svc, "search_corpus", query=QUESTION, mode="vector")
        assert not is_error and payload["results"] and payload["degraded"] is None, payload
        assert liar.calls_carrying(rules.FINGERPRINT_TEXT) == 1 and good.calls_carrying(rules.FINGERPRINT_TEXT) == 1
        is_error, payload = dispatched(svc, "search_corpus", query="rollback the database", mode="vector")
        assert not is_error and good.calls_carrying(rules.FINGERPRINT_TEXT) == 1  # checked once, then trusted
        good.stop()
        svc = in_process_service(built, RAG_EMBED_TIMEOUT="6")
        is_error, payload = dispatched(svc, "search_corpus", query=QUESTION)
        assert not is_error and payload["degraded"] == "index_incompatible" and payload["results"], payload
        assert "embeds with another model than the index was built with" in payload["hint"]
        is_error, payload = dispatched(svc, "search_corpus", query="a fresh question", mode="vector")
        assert is_error and "embeds with another model" in payload["error"]["message"], payload
        assert good.host in payload["error"]["message"]  # and the one that could not be reached


@pytest.mark.process
def test_ingest_and_search_over_stdio_with_an_openai_server_and_a_key(openai: FakeOpenAI, tmp_path: Path) -> None:
    """End to end through the real processes: ingest with RAG_EMBED_API=openai, the stdio server
    finds it, and the key is in no log line, instructions, CURRENT.json or the CLI's answers."""
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    openai.configure(api_key=KEY)
    env = openai_env(openai, RAG_EMBED_API_KEY=KEY, RAG_LOG_LEVEL="DEBUG")
    done = run_ingest(openai, corpus, store, **env)
    assert done.code == 0, done.err
    assert KEY not in done.err + done.out + (store / rules.CURRENT_FILE).read_text()
    with raw_server(store, corpus, openai.host, **env) as server:
        server.handshake()
        assert search_paths(server, QUESTION, mode="vector")[0].startswith("oncall/"), stderr_text(server)
        said = b"".join(server.stdout_lines).decode()  # the instructions and every answer
        assert '"instructions"' in said and KEY not in said and KEY not in stderr_text(server)
    cli_env = {**{k: v for k, v in os.environ.items() if not k.startswith(("RAG_", "OLLAMA_"))}, **env,
               "RAG_STORE_DIR": str(store), "RAG_CORPUS_DIR": str(corpus)}
    openai.configure(api_key="another-key")  # the server's answer to a refused key, as the CLI prints it
    cli = subprocess.run([sys.executable, str(SERVER), "search", "--json", "--mode", "vector", "fresh words"],
                         env=cli_env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert "refused the API key" in cli.stdout, cli.stdout + cli.stderr
    assert KEY not in cli.stdout + cli.stderr


@pytest.mark.process
def test_health_over_http_says_a_refused_key_without_the_key(openai: FakeOpenAI, indexed_sample: tuple[Path, Path],
                                                             tmp_path: Path) -> None:
    from test_http import bridge, http_server

    built = sample_built(indexed_sample, tmp_path, openai.host)
    openai.configure(api_key="the-right-one")
    env = built.server_env(openai.host, **openai_env(openai, RAG_EMBED_API_KEY=KEY))
    with http_server(env) as server:
        deadline = time.monotonic() + 60
        while (body := httpx.get(f"{server.base}/health").json())["embedder"] == "not probed yet":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        said = json.dumps(body)
        assert "refused the API key" in said and "RAG_EMBED_API_KEY" in said, body
        answer = bridge(server, "search_corpus", {"query": QUESTION})  # hybrid: keywords, saying why
        assert answer.status_code == 200 and "refused the API key" in answer.text, answer.text
        assert KEY not in said + answer.text
    assert KEY not in server.stderr


# ---------------------------------------------------------------------------
# The README's examples, as written.


def readme_examples() -> list[dict[str, str]]:
    """The variables each example of the README's "Embedding servers" exports."""
    import re
    import shlex

    readme = (Path(rules.__file__).parent / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Embedding servers", 1)[1].split("\n## ", 1)[0]
    examples = []
    for line in re.findall(r"^export (RAG_.*)$", section, flags=re.M):
        examples.append(dict(word.split("=", 1) for word in shlex.split(line, posix=True)))
    return examples


def test_the_readme_examples_of_embedding_servers_work_as_written(openai: FakeOpenAI) -> None:
    """Each example's variables, its address moved to the fake (which serves any model name, as
    llama-server and TEI do, and wants the key when the example gives one)."""
    examples = readme_examples()
    assert len(examples) == 3 and {e["RAG_EMBED_API"] for e in examples} == {"openai"}
    openai.configure(any_model=True)
    for example in examples:
        settings = rules.load_settings({**example, "RAG_EMBED_API_KEY": KEY if "RAG_EMBED_API_KEY" in example else ""})
        url = settings.ollama_host
        assert url.endswith("/v1") and settings.embed_model == example["RAG_EMBED_MODEL"]
        assert rules.prefix_scheme_for(settings.embed_model) is rules.PREFIX_SCHEMES["embeddinggemma"]
        openai.configure(api_key=KEY if settings.embed_api_key else None, served_as=settings.embed_model)
        client = settings.embedder(openai.host)
        assert client.embed(["x"]).shape == (1, 768) and client.served_model == settings.embed_model


@pytest.mark.process
def test_the_real_cli_skips_a_host_of_another_model_by_name(indexed_sample: tuple[Path, Path], tmp_path: Path) -> None:
    """Issue 42 D3 through the real process: `server.py search` with the liar listed first."""
    with FakeOllama() as liar, FakeOllama() as good:
        liar.configure(embeds_as="Q2_K")
        built = sample_built(indexed_sample, tmp_path, Hosts((liar, good)).host)
        env = {**{k: v for k, v in os.environ.items() if not k.startswith(("RAG_", "OLLAMA_"))},
               **built.server_env(Hosts((liar, good)).host)}
        done = subprocess.run([sys.executable, str(SERVER), "search", "--json", "--mode", "vector", QUESTION],
                              env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
        payload = json.loads(done.stdout)
        assert done.returncode == 0 and payload["results"][0]["path"].startswith("oncall/"), done.stderr
        assert f"Ollama at {liar.host} embeds with another model than the index was built with" in done.stderr
        assert good.calls_carrying(rules.FINGERPRINT_TEXT) == 1
