"""The fake Ollama server, exercised through the real ollama.Client over loopback HTTP."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import ollama
import pytest
from fake_ollama import FakeOllama, count_tokens, fake_embedding

MODEL = "embeddinggemma"


def _client(fake: FakeOllama, timeout: float = 5) -> ollama.Client:
    return ollama.Client(host=fake.host, timeout=timeout)


def _norm(vec: Sequence[float]) -> float:
    return math.sqrt(sum(v * v for v in vec))


def _cos(a: Sequence[float], b: Sequence[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True)) / (_norm(a) * _norm(b))


def _http_json(url: str, payload: dict[str, Any] | None = None) -> Any:
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        return json.loads(resp.read())


def test_embed_list_and_string_input(fake_ollama: FakeOllama) -> None:
    client = _client(fake_ollama)
    listed = client.embed(model=MODEL, input=["alpha beta", "gamma delta"])
    single = client.embed(model=f"{MODEL}:latest", input="alpha beta")
    again = client.embed(model=MODEL, input=["alpha beta"])

    assert len(listed.embeddings) == 2
    assert all(len(v) == 768 for v in listed.embeddings)
    assert all(abs(_norm(v) - 1.0) < 1e-9 for v in listed.embeddings)
    assert list(single.embeddings[0]) == list(listed.embeddings[0]) == list(again.embeddings[0])
    assert list(listed.embeddings[0]) == fake_embedding("alpha beta", 768)
    assert listed.embeddings[0] != listed.embeddings[1]
    assert listed.prompt_eval_count == 4
    assert listed.total_duration is not None and listed.load_duration is not None


def test_dimensions_truncate_and_renormalise(fake_ollama: FakeOllama) -> None:
    full = fake_embedding("matryoshka vectors", 768)
    vec = _client(fake_ollama).embed(model=MODEL, input="matryoshka vectors", dimensions=128).embeddings[0]
    assert len(vec) == 128
    assert abs(_norm(vec) - 1.0) < 1e-9
    assert _cos(vec, full[:128]) > 0.999999


def test_show_list_version_and_root(fake_ollama: FakeOllama) -> None:
    client = _client(fake_ollama)
    info = client.show(MODEL)
    assert info.modelinfo is not None
    assert info.modelinfo["gemma3.context_length"] == 2048
    assert info.modelinfo["gemma3.embedding_length"] == 768
    assert info.details is not None and info.details.family == "gemma3"
    assert [m.model for m in client.list().models] == ["embeddinggemma:latest"]

    assert _http_json(f"{fake_ollama.host}/api/version") == {"version": "0.12.0"}
    resp = httpx.get(fake_ollama.host)
    assert (resp.status_code, resp.text) == (200, "Ollama is running")
    assert resp.headers["content-type"].startswith("text/plain")
    assert httpx.head(fake_ollama.host).status_code == 200


def test_custom_model_dims_and_context() -> None:
    with FakeOllama(models=("nomic-embed-text:v1.5",), dims=64, context_length=512) as fake:
        client = _client(fake)
        assert client.show("nomic-embed-text:v1.5").modelinfo["gemma3.context_length"] == 512  # type: ignore[index]  # modelinfo: optional in the model
        assert len(client.embed(model="nomic-embed-text:v1.5", input="x").embeddings[0]) == 64
        with pytest.raises(ollama.ResponseError):
            client.embed(model="nomic-embed-text", input="x")  # ":latest" is a different tag


def test_unknown_or_missing_model_is_404(fake_ollama: FakeOllama) -> None:
    client = _client(fake_ollama)
    with pytest.raises(ollama.ResponseError) as err:
        client.embed(model="nope", input="x")
    assert err.value.status_code == 404
    assert err.value.error == 'model "nope" not found, try pulling it first'

    fake_ollama.missing_models = {MODEL}
    for call in (lambda: client.embed(model=MODEL, input="x"), lambda: client.show(MODEL)):
        with pytest.raises(ollama.ResponseError) as err:
            call()
        assert err.value.status_code == 404
        assert "not found, try pulling it first" in str(err.value)
    assert client.list().models == []


def test_fail_after(fake_ollama: FakeOllama) -> None:
    client = _client(fake_ollama)
    fake_ollama.fail_after = 2
    client.embed(model=MODEL, input="one")
    client.embed(model=MODEL, input="two")
    with pytest.raises(ollama.ResponseError) as err:
        client.embed(model=MODEL, input="three")
    assert err.value.status_code == 500
    assert fake_ollama.embed_calls == 3


def test_content_keyed_faults_hit_the_calls_after_the_first_carrying_their_text(fake_ollama: FakeOllama) -> None:
    client = _client(fake_ollama)
    fake_ollama.configure(fail_after_carrying="MARK", missing_after_carrying=["OTHER", [MODEL]])
    client.embed(model=MODEL, input=["plain"])
    client.embed(model=MODEL, input=["plain", "has MARK inside"])  # the carrying call itself answers
    with pytest.raises(ollama.ResponseError) as err:
        client.embed(model=MODEL, input="after")
    assert err.value.status_code == 500 and fake_ollama.calls_carrying("MARK") == 1
    fake_ollama.configure(fail_after_carrying=None)
    client.embed(model=MODEL, input="OTHER arrives")
    with pytest.raises(ollama.ResponseError) as err:
        client.embed(model=MODEL, input="the model is gone now")
    assert err.value.status_code == 404
    assert [len(inputs) for inputs in fake_ollama.calls()["call_inputs"]] == [1, 2, 1, 1, 1]
    # Set again, a fault counts from then: earlier carrying calls do not arm it.
    fake_ollama.configure(missing_models=[], missing_after_carrying=None, fail_after_carrying="MARK")
    client.embed(model=MODEL, input="fine again")
    fake_ollama.reset()
    assert fake_ollama.calls_carrying("MARK") == 0 and fake_ollama.config()["fail_after_carrying"] is None


def test_context_length_and_truncate(fake_ollama: FakeOllama) -> None:
    client = _client(fake_ollama)
    fake_ollama.max_input_tokens = 10
    long_text = " ".join(f"word{i}" for i in range(11))
    assert count_tokens(long_text) == 11
    with pytest.raises(ollama.ResponseError) as err:
        client.embed(model=MODEL, input=["short", long_text], truncate=False)
    assert err.value.status_code == 400
    assert "input length exceeds the context length" in err.value.error

    ok = client.embed(model=MODEL, input=["short", long_text], truncate=True)
    assert len(ok.embeddings) == 2
    assert len(client.embed(model=MODEL, input=long_text).embeddings) == 1  # truncate defaults to true

    fake_ollama.max_input_tokens = None  # falls back to context_length (2048)
    client.embed(model=MODEL, input=long_text, truncate=False)


def test_wrong_dims(fake_ollama: FakeOllama) -> None:
    fake_ollama.wrong_dims = 384
    assert len(_client(fake_ollama).embed(model=MODEL, input="x").embeddings[0]) == 384


def test_wrong_dims_after_carrying_switch_the_size_after_the_carrying_call(fake_ollama: FakeOllama) -> None:
    client = _client(fake_ollama)
    fake_ollama.configure(wrong_dims_after_carrying=["MARK", 512])
    assert len(client.embed(model=MODEL, input="has MARK").embeddings[0]) == 768  # the carrying call itself
    assert len(client.embed(model=MODEL, input="after").embeddings[0]) == 512
    assert fake_ollama.config()["wrong_dims_after_carrying"] == ["MARK", 512]


def test_delay_beyond_client_timeout_raises_httpx_read_timeout(fake_ollama: FakeOllama) -> None:
    fake_ollama.delay_seconds = 0.2
    assert len(_client(fake_ollama, timeout=5).embed(model=MODEL, input="x").embeddings) == 1
    fake_ollama.delay_seconds = 2.0
    # ollama.Client does not wrap timeouts: the httpx exception escapes as is.
    with pytest.raises(httpx.ReadTimeout):
        _client(fake_ollama, timeout=0.3).embed(model=MODEL, input="x")


def test_held_embed_calls_answer_once_released(fake_ollama: FakeOllama) -> None:
    import threading

    fake_ollama.configure(hold=True)
    answers: list[int] = []
    call = threading.Thread(
        target=lambda: answers.append(len(_client(fake_ollama).embed(model=MODEL, input="x").embeddings)))
    call.start()
    call.join(0.5)
    assert call.is_alive() and not answers and fake_ollama.calls()["embed_calls"] == 1
    fake_ollama.configure(hold=False)
    call.join(5)
    assert answers == [1]


def test_stop_refuses_then_restart_on_same_port(fake_ollama: FakeOllama) -> None:
    client = _client(fake_ollama)  # one pooled keep-alive client across the outage
    client.embed(model=MODEL, input="before")
    port = fake_ollama.port
    fake_ollama.stop()
    with pytest.raises(ConnectionError):
        client.embed(model=MODEL, input="during")
    with pytest.raises(ConnectionError):
        ollama.Client(host=fake_ollama.host, timeout=5).list()

    fake_ollama.restart()
    assert fake_ollama.port == port
    assert len(client.embed(model=MODEL, input="after").embeddings) == 1


def test_call_record_and_reset(fake_ollama: FakeOllama) -> None:
    client = _client(fake_ollama)
    client.embed(model=MODEL, input=["a", "b"])
    client.embed(model=MODEL, input="c")
    client.show(MODEL)
    assert fake_ollama.embed_calls == 2
    assert fake_ollama.embedded_inputs == ["a", "b", "c"]
    assert [(m, p) for m, p, _ in fake_ollama.requests] == [
        ("POST", "/api/embed"), ("POST", "/api/embed"), ("POST", "/api/show"),
    ]
    assert fake_ollama.requests[1][2]["input"] == "c"

    fake_ollama.fail_after = 0
    fake_ollama.reset()
    assert (fake_ollama.embed_calls, fake_ollama.embedded_inputs, fake_ollama.requests) == (0, [], [])
    assert fake_ollama.fail_after is None
    client.embed(model=MODEL, input="d")


def test_control_endpoint(fake_ollama: FakeOllama) -> None:
    client = _client(fake_ollama)
    cfg = _http_json(f"{fake_ollama.host}/_fake/config", {"fail_after": 1, "wrong_dims": 16})
    assert cfg["fail_after"] == 1 and fake_ollama.wrong_dims == 16
    assert len(client.embed(model=MODEL, input="x").embeddings[0]) == 16
    with pytest.raises(ollama.ResponseError):
        client.embed(model=MODEL, input="y")

    calls = _http_json(f"{fake_ollama.host}/_fake/calls")
    assert calls["embed_calls"] == 2
    assert calls["embedded_inputs"] == ["x", "y"]
    assert [r[1] for r in calls["requests"]] == ["/api/embed", "/api/embed"]  # control calls unrecorded

    _http_json(f"{fake_ollama.host}/_fake/config", {"reset": True, "missing_models": [MODEL]})
    assert fake_ollama.fail_after is None and fake_ollama.embed_calls == 0
    with pytest.raises(ollama.ResponseError) as err:
        client.embed(model=MODEL, input="z")
    assert err.value.status_code == 404

    with pytest.raises(urllib.error.HTTPError) as http_err:
        _http_json(f"{fake_ollama.host}/_fake/config", {"no_such_field": 1})
    assert http_err.value.code == 400


def test_standalone_process_prints_ready_and_serves() -> None:
    script = Path(__file__).with_name("fake_ollama.py")
    proc = subprocess.Popen(
        [sys.executable, str(script), "--dims", "32", "--model", "m1", "--model", "m2:q8"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        assert line.startswith("FAKE_OLLAMA_READY http://127.0.0.1:")
        host = line.split(" ", 1)[1]
        client = ollama.Client(host=host, timeout=5)
        assert len(client.embed(model="m1", input="hi").embeddings[0]) == 32
        assert {m.model for m in client.list().models} == {"m1:latest", "m2:q8"}
        _http_json(f"{host}/_fake/config", {"fail_after": 0})
        with pytest.raises(ollama.ResponseError):
            client.embed(model="m1", input="hi")
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0


def _rank(query: str, docs: dict[str, str]) -> list[str]:
    q = fake_embedding(query, 768)
    return sorted(docs, key=lambda k: _cos(q, fake_embedding(docs[k], 768)), reverse=True)


def test_lexical_similarity_ranks_on_call_doc_first() -> None:
    docs = {
        "oncall": "title: On-call | text: Sev-1 incidents page the primary on-call engineer "
        "immediately (pager alias ops-primary); the secondary is paged after 15 minutes.",
        "backup": "title: Database backups | text: Nightly backups of the Postgres database "
        "are taken at 02:00 and retained for 30 days; restores are tested monthly.",
        "css": "title: Theming | text: The CSS theme uses custom properties for colours; "
        "dark mode switches the variables on the root element.",
    }
    query = "task: search result | query: who gets paged for a sev-1"
    assert _rank(query, docs)[0] == "oncall"
    q = fake_embedding(query, 768)
    sims = {k: _cos(q, fake_embedding(v, 768)) for k, v in docs.items()}
    assert sims["oncall"] > 3 * max(sims["backup"], sims["css"], 0.05)


def test_japanese_bigrams_rank_matching_doc_first() -> None:
    docs = {
        "oncall": "title: 当番 | text: 重大な障害が発生したら、当番のエンジニアに連絡してください。",
        "backup": "title: バックアップ | text: データベースのバックアップは毎晩取得され、三十日間保存されます。",
        "css": "title: テーマ | text: スタイルシートのテーマはカスタムプロパティで色を定義します。",
    }
    assert _rank("task: search result | query: 障害が発生したときの当番は誰ですか", docs)[0] == "oncall"


def test_prefixes_identifiers_and_edge_cases() -> None:
    plain = fake_embedding("keep alive setting", 64)
    assert fake_embedding("search_query: keep alive setting", 64) == plain
    assert fake_embedding("title: none | text: keep alive setting", 64) == plain
    assert fake_embedding("task: search result | query: keep alive setting", 64) == plain
    assert _cos(fake_embedding("OLLAMA_KEEP_ALIVE", 64), plain) > 0.3  # identifier split into parts
    assert _cos(fake_embedding("pages", 256), fake_embedding("page", 256)) > 0.9
    empty = fake_embedding("", 8)
    assert empty == fake_embedding("   ", 8) and abs(_norm(empty) - 1.0) < 1e-12
    assert count_tokens("OLLAMA_KEEP_ALIVE は設定です") == 1 + 5 // 2
