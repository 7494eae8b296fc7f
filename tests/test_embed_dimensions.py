"""RAG_EMBED_DIMENSIONS (issue #30 §2): vectors asked of Ollama at fewer dimensions than the
model's (a Matryoshka model's truncated and renormalised vectors).

Ingest sends `dimensions` with every embed call and records it in the index's manifest; a change
of it rebuilds like a model change, an index built without it keeps its name; the server asks for
the live index's dimensions whatever its own environment says; an Ollama that ignores
`dimensions`, or a size above the model's, is a configuration error before anything is written.
In process, against the loopback fake Ollama (which truncates and renormalises as Ollama does)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy
import pytest
from fake_ollama import FakeOllama
from helpers import (
    ROOT,
    Built,
    chroma_state,
    copy_sample,
    current_of,
    dispatched,
    in_process_service,
    ingest_in_process,
    snapshot,
)
from hypothesis import given
from hypothesis import strategies as st

import corpus_rules as rules
import ingest

QUESTION = "Who gets paged for a sev-1?"


@pytest.fixture
def fake() -> FakeOllama:
    with FakeOllama() as instance:
        yield instance


def embed_requests(fake: FakeOllama) -> list[dict]:
    return [body for _, path, body in fake.requests if path == "/api/embed"]


def stored_lengths(store: Path) -> set[int]:
    return {len(vector) for collection in chroma_state(store).values() for _, _, vector in collection.values()}


# ---------------------------------------------------------------------------
# The setting and the manifest.


@given(st.integers(rules.EMBED_DIMENSIONS_MIN, rules.EMBED_DIMENSIONS_MAX))
def test_a_whole_number_in_range_is_read(value: int) -> None:
    assert rules.load_settings({"RAG_EMBED_DIMENSIONS": f" {value} "}).embed_dimensions == value


def test_unset_means_the_models_own_size() -> None:
    assert rules.load_settings({}).embed_dimensions is None
    assert rules.load_settings({"RAG_EMBED_DIMENSIONS": "  "}).embed_dimensions is None


@pytest.mark.parametrize("raw", ["256d", "2.5", "0", "-256", "31", "8193", "one"])
def test_a_bad_value_is_a_configuration_error_naming_the_variable(raw: str) -> None:
    with pytest.raises(rules.RagError) as caught:
        rules.load_settings({"RAG_EMBED_DIMENSIONS": raw})
    assert caught.value.code == rules.ErrorCode.INVALID_ARGUMENT
    assert "RAG_EMBED_DIMENSIONS" in caught.value.message and "from 32 to 8192" in caught.value.message


def test_an_index_built_without_the_setting_keeps_its_fingerprint() -> None:
    # Pinned: computed by the code before embed_dimensions existed. A changed name would rebuild
    # every existing user's index on upgrade.
    manifest = rules.IndexManifest(model="embeddinggemma", dims=768, prefix_scheme="embeddinggemma",
                                   chunker_version="7", chunk_max_tokens=512, chunk_min_tokens=64)
    assert manifest.fingerprint() == "b8930cab590c"
    asked = rules.IndexManifest(**{**manifest.to_dict(), "dims": 256, "embed_dimensions": 256})
    assert asked.fingerprint() not in (manifest.fingerprint(),
                                       rules.IndexManifest(**{**manifest.to_dict(), "dims": 256}).fingerprint())


def test_a_current_json_without_the_field_reads_as_not_asked(tmp_path: Path, fake: FakeOllama) -> None:
    """CURRENT.json written as the previous version wrote it (no embed_dimensions), read as the same
    index: an ingest without the setting updates it in place and asks Ollama for no `dimensions`."""
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    assert ingest_in_process(fake, corpus, store).code == 0
    current = current_of(store)
    assert "embed_dimensions" not in current["manifest"]
    parsed = rules.StoreLayout(store).read_current()
    assert parsed is not None and parsed.manifest.index_name() == current["index"]
    fake.reset()
    again = ingest_in_process(fake, corpus, store)
    assert again.code == 0, again.err
    assert not again.summary["rebuilt"] and again.summary["index"] == current["index"]
    assert all("dimensions" not in body for body in embed_requests(fake))


@pytest.mark.parametrize("raw", ['"256"', "-1", "true", "2.5"])
def test_an_implausible_embed_dimensions_in_current_json_is_refused(raw: str) -> None:
    manifest = rules.IndexManifest("embeddinggemma", 256, "embeddinggemma", "7", 512, 64, 256).to_dict()
    text = rules.CurrentIndex("idx-" + "0" * 12, 1, rules.IndexManifest.from_dict(manifest),
                              rules.IndexStamp(None, None, "now", 1, 1)).to_json()
    with pytest.raises(ValueError, match="embed_dimensions"):
        rules.CurrentIndex.from_json(text.replace('"embed_dimensions": 256', f'"embed_dimensions": {raw}'))


# ---------------------------------------------------------------------------
# Ingest.


def test_ingest_asks_every_vector_at_the_set_size(tmp_path: Path, fake: FakeOllama) -> None:
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    done = ingest_in_process(fake, corpus, store, RAG_EMBED_DIMENSIONS="256")
    assert done.code == 0, done.err
    bodies = embed_requests(fake)
    assert bodies and all(body.get("dimensions") == 256 for body in bodies)
    manifest = current_of(store)["manifest"]
    assert (manifest["dims"], manifest["embed_dimensions"]) == (256, 256)
    assert stored_lengths(store) == {256}


@pytest.mark.heavy  # about 1 s of CPU in ingest runs: in --all, to keep the fast tier's budget
def test_changing_the_size_rebuilds_and_the_old_index_serves_until_the_new_one_is_complete(
        tmp_path: Path, fake: FakeOllama, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ingest, "EMBED_BATCH", 4)
    monkeypatch.setattr(ingest, "COMMIT_BATCH_CHUNKS", 4)
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    assert ingest_in_process(fake, corpus, store).code == 0
    native = current_of(store)
    native_snapshot = snapshot(store)
    assert native["manifest"]["dims"] == 768

    fake.configure(fail_after=fake.embed_calls + 4)  # the rebuild fails part-way
    failed = ingest_in_process(fake, corpus, store, RAG_EMBED_DIMENSIONS="256")
    assert failed.code == 1
    assert failed.summary["rebuilt"] and failed.summary["index"] != native["index"]
    assert current_of(store) == native and snapshot(store) == native_snapshot
    fake.configure(fail_after=None)
    fake.requests.clear()
    svc = in_process_service(Built(corpus, store, fake.host))
    is_error, answer = dispatched(svc, "search_corpus", query=QUESTION, mode="vector")
    assert not is_error and answer["results"][0]["path"] == "oncall/escalation.md"
    assert [("dimensions" in body) for body in embed_requests(fake)] == [False]  # the live index's size

    done = ingest_in_process(fake, corpus, store, RAG_EMBED_DIMENSIONS="256")
    assert done.code == 0, done.err
    assert done.summary["rebuilt"] and done.summary["index"] == failed.summary["index"]
    assert current_of(store)["manifest"]["dims"] == 256 and stored_lengths(store) == {256}
    assert not (store / native["index"]).exists()

    # Unset again: a rebuild at the model's size, into the first index's name.
    back = ingest_in_process(fake, corpus, store)
    assert back.code == 0, back.err
    assert back.summary["rebuilt"] and back.summary["index"] == native["index"]
    assert current_of(store)["manifest"]["dims"] == 768 and stored_lengths(store) == {768}


def test_an_unchanged_size_updates_in_place(tmp_path: Path, fake: FakeOllama) -> None:
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    assert ingest_in_process(fake, corpus, store, RAG_EMBED_DIMENSIONS="128").code == 0
    index = current_of(store)["index"]
    (corpus / "runbooks" / "new.md").write_text("# Brand new\n\nA page about the fire drill.\n", encoding="utf-8")
    fake.reset()
    again = ingest_in_process(fake, corpus, store, RAG_EMBED_DIMENSIONS="128")
    assert again.code == 0, again.err
    assert not again.summary["rebuilt"] and again.summary["index"] == index and again.summary["added"] == 1
    assert all(body.get("dimensions") == 128 for body in embed_requests(fake))
    assert stored_lengths(store) == {128}


def test_the_dry_run_foresees_the_rebuild(tmp_path: Path, fake: FakeOllama) -> None:
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    assert ingest_in_process(fake, corpus, store).code == 0
    summary = ingest_in_process(fake, corpus, store, "--dry-run", RAG_EMBED_DIMENSIONS="256").summary
    assert summary["rebuilt"] and summary["index"] != current_of(store)["index"]


def test_more_than_the_models_dimensions_is_a_configuration_error(tmp_path: Path, fake: FakeOllama) -> None:
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    done = ingest_in_process(fake, corpus, store, RAG_EMBED_DIMENSIONS="1024")
    assert done.code == 2
    assert "RAG_EMBED_DIMENSIONS=1024 is more than the 768 dimensions of 'embeddinggemma'" in done.err
    assert "to 768 or fewer" in done.err
    assert not (store / "CURRENT.json").exists() and embed_requests(fake) == []


def test_an_ollama_that_ignores_dimensions_is_refused_before_anything_is_written(tmp_path: Path,
                                                                                 fake: FakeOllama) -> None:
    fake.configure(ignore_dimensions=True)
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    done = ingest_in_process(fake, corpus, store, RAG_EMBED_DIMENSIONS="256")
    assert done.code == 2
    assert "returned 768-dimensional vectors for 'embeddinggemma' when asked for 256" in done.err
    assert "ignores `dimensions`" in done.err and "upgrade Ollama" in done.err
    assert not (store / "CURRENT.json").exists() and len(embed_requests(fake)) == 1


# ---------------------------------------------------------------------------
# The server follows the live index.


@pytest.mark.parametrize("server_env", [{}, {"RAG_EMBED_DIMENSIONS": "128"}])
def test_the_server_asks_for_the_live_indexs_dimensions_whatever_its_environment(
        tmp_path: Path, fake: FakeOllama, server_env: dict[str, str]) -> None:
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    assert ingest_in_process(fake, corpus, store, RAG_EMBED_DIMENSIONS="256").code == 0
    fake.reset()
    svc = in_process_service(Built(corpus, store, fake.host), **server_env)
    is_error, answer = dispatched(svc, "search_corpus", query=QUESTION, mode="vector")
    assert not is_error, answer
    assert answer["results"][0]["path"] == "oncall/escalation.md"
    assert [body.get("dimensions") for body in embed_requests(fake)] == [256]


def test_the_server_asks_nothing_of_an_index_at_the_models_size(tmp_path: Path, fake: FakeOllama) -> None:
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    assert ingest_in_process(fake, corpus, store).code == 0
    fake.reset()
    svc = in_process_service(Built(corpus, store, fake.host), RAG_EMBED_DIMENSIONS="256")
    is_error, answer = dispatched(svc, "search_corpus", query=QUESTION, mode="vector")
    assert not is_error and answer["results"]
    assert [("dimensions" in body) for body in embed_requests(fake)] == [False]


def test_the_server_says_when_ollama_ignores_dimensions(tmp_path: Path, fake: FakeOllama) -> None:
    corpus, store = copy_sample(tmp_path), tmp_path / "store"
    assert ingest_in_process(fake, corpus, store, RAG_EMBED_DIMENSIONS="256").code == 0
    fake.configure(ignore_dimensions=True)  # Ollama downgraded under a 256-d index
    svc = in_process_service(Built(corpus, store, fake.host))
    is_error, answer = dispatched(svc, "search_corpus", query=QUESTION, mode="vector")
    assert is_error
    error = answer["error"]
    assert error["code"] == "invalid_argument"
    assert "returned 768-dimensional vectors" in error["message"] and "when asked for 256" in error["message"]
    assert "upgrade Ollama" in error["hint"]


# ---------------------------------------------------------------------------
# tools/bench.py --dims: its fake answers `dimensions` as Ollama does.

_bench_spec = importlib.util.spec_from_file_location("rag_bench", ROOT / "tools" / "bench.py")
assert _bench_spec is not None and _bench_spec.loader is not None
rag_bench = importlib.util.module_from_spec(_bench_spec)
sys.modules["rag_bench"] = rag_bench  # its dataclasses look their module up
_bench_spec.loader.exec_module(rag_bench)


@pytest.mark.parametrize("dimensions", [None, 768, 1024, 256, 32])
def test_the_bench_fake_cuts_and_renormalises_to_the_dimensions_asked(dimensions: int | None) -> None:
    vectors = rag_bench.FastVectors(rag_bench.DIMS)
    texts = ["search result | query: sev-1 paging", "title: none | text: the fire drill", ""]
    full = vectors.matrix(texts)
    cut = vectors.matrix(texts, dimensions)
    size = dimensions if dimensions is not None and dimensions < rag_bench.DIMS else rag_bench.DIMS
    assert cut.shape == (3, size)
    assert numpy.allclose(numpy.linalg.norm(cut, axis=1), 1.0)
    for row, whole in zip(cut, full, strict=True):  # the same direction as the first `size` values
        prefix = whole[:size]
        assert numpy.allclose(row * numpy.linalg.norm(prefix), prefix)
