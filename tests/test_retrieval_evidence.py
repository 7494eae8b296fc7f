"""Retrieval that uses the agent, and says what it knows: extra phrasings in one search, exact
identifiers (present, absent, present only as parts), the confidence of the best hit with the
corpus calibration ingest measures, and the live index facts in the instructions. A real index
built by the real ingest through the loopback fake Ollama; the service in-process, and the real
`python server.py` over stdio for the instructions.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import anyio
import pytest
from fake_ollama import FakeOllama
from helpers import (
    Built,
    chunk_calls,
    connect,
    in_process_service,
    ingest_index,
    keyword_db,
    sample_built,
    tool_payload,
)

import server
from corpus_rules import CJK_DOCUMENT, Calibration, CorpusFacts, StoreLayout, cjk_share

pytestmark = pytest.mark.process  # real processes (servers, ingest, Chroma): only in `pytest --all` (tests/README.md)


@pytest.fixture(scope="module")
def built(fake: FakeOllama, indexed_sample: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Built:
    return sample_built(indexed_sample, tmp_path_factory.mktemp("evidence"), fake.host)


def search(svc: server.RetrievalService, **args: Any) -> dict[str, Any]:
    is_error, payload = tool_payload("search_corpus", server.mcp_result(server.dispatch(svc, "search_corpus", args)))
    assert not is_error, payload
    return payload


def search_error(svc: server.RetrievalService, **args: Any) -> dict[str, Any]:
    is_error, payload = tool_payload("search_corpus", server.mcp_result(server.dispatch(svc, "search_corpus", args)))
    assert is_error, payload
    return payload["error"]


# ---------------------------------------------------------------------------
# Identifiers.


def test_identifier_present_is_found_whole_and_said_so(built: Built) -> None:
    svc = in_process_service(built)
    payload = search(svc, query="What does error E4091 mean for my PUT request?")
    top = payload["results"][0]
    assert top["path"] == "reference/api.md" and "E4091" in top["exact_matches"]
    assert payload["missing_identifiers"] == []
    # Holding the identifier is said; the level comes from how the passage stands out and its terms.
    assert payload["confidence"] != "low" and "contains E4091" in payload["confidence_reason"]
    for hit in payload["results"]:
        assert ("E4091" in hit["exact_matches"]) == ("E4091" in hit["text"])


def test_identifier_absent_is_reported_and_confidence_is_low(built: Built) -> None:
    svc = in_process_service(built)
    payload = search(svc, query="OLLAMA_KEEP_ALIVE")
    assert payload["missing_identifiers"] == ["OLLAMA_KEEP_ALIVE"]
    assert payload["confidence"] == "low" and "OLLAMA_KEEP_ALIVE" in payload["confidence_reason"]
    assert all(hit["exact_matches"] == [] for hit in payload["results"])
    keyword = search(svc, query="OLLAMA_KEEP_ALIVE", mode="keyword")
    assert keyword["missing_identifiers"] == ["OLLAMA_KEEP_ALIVE"]


def test_a_phrasings_missing_guess_is_listed_but_does_not_make_an_answer_low(built: Built) -> None:
    """The agent's phrasing guesses a setting the documents do not name; the question is answered."""
    svc = in_process_service(built)
    alone = search(svc, query="How do I roll back a deploy?")
    guessed = search(svc, query="How do I roll back a deploy?", queries=["DEPLOYCTL_ROLLBACK_TARGET"])
    assert guessed["missing_identifiers"] == ["DEPLOYCTL_ROLLBACK_TARGET"]
    assert alone["confidence"] != "low" and guessed["confidence"] != "low", guessed["confidence_reason"]
    asked = search(svc, query="What does DEPLOYCTL_ROLLBACK_TARGET do when I roll back a deploy?")
    assert asked["confidence"] == "low" and "DEPLOYCTL_ROLLBACK_TARGET" in asked["confidence_reason"]


@pytest.fixture(scope="module")
def parts_corpus(fake: FakeOllama, tmp_path_factory: pytest.TempPathFactory) -> Built:
    """Passages that say "keep ... alive" again and again (strong on the identifier's parts), and
    one terse passage with OLLAMA_KEEP_ALIVE itself."""
    root = tmp_path_factory.mktemp("parts")
    corpus = root / "corpus"
    corpus.mkdir()
    for n in range(4):
        (corpus / f"keepalive-{n}.md").write_text(
            f"# Keeping sessions alive {n}\n\n" + "Keep the session alive; keep alive pings keep the ollama "
            "connection alive. To keep it alive, keep sending. " * 6 + "\n", encoding="utf-8")
    (corpus / "settings.md").write_text(
        "# Server settings\n\n## Model unloading\n\nSet `OLLAMA_KEEP_ALIVE=30m` to hold the model in memory for "
        "thirty minutes after the last request.\n", encoding="utf-8")
    (corpus / "other.md").write_text("# Other\n\nNothing about sessions here, only deploy notes.\n", encoding="utf-8")
    store = root / "store"
    done = ingest_index(corpus, store, fake.host)
    assert done.returncode == 0, done.stderr
    return Built(corpus, store, fake.host)


def test_whole_identifier_ranks_above_passages_with_only_its_parts(parts_corpus: Built) -> None:
    svc = in_process_service(parts_corpus)
    for mode in ("hybrid", "keyword"):
        payload = search(svc, query="how long does ollama keep a model alive? OLLAMA_KEEP_ALIVE", mode=mode, k=6)
        paths = [hit["path"] for hit in payload["results"]]
        assert paths[0] == "settings.md", (mode, paths)
        assert payload["results"][0]["exact_matches"] == ["OLLAMA_KEEP_ALIVE"]
        assert all(hit["exact_matches"] == [] for hit in payload["results"][1:])
        assert payload["missing_identifiers"] == []


def test_an_identifier_held_inside_a_dotted_path_is_present(fake: FakeOllama, indexed_sample: tuple[Path, Path],
                                                           tmp_path: Path) -> None:
    """runbooks/deploy.md writes `flagctl set records.bulk_import off`: asked for bulk_import, the
    search must not say no passage holds it, and that passage holds it whole (issue 41)."""
    svc = in_process_service(sample_built(indexed_sample, tmp_path, fake.host))
    for mode in ("hybrid", "keyword"):
        payload = search(svc, query="bulk_import", mode=mode)
        assert payload["missing_identifiers"] == [], (mode, payload["missing_identifiers"])
        top = payload["results"][0]
        assert top["path"] == "runbooks/deploy.md" and "records.bulk_import" in top["text"]
        assert top["exact_matches"] == ["bulk_import"]
        assert "no indexed passage contains" not in (payload.get("message") or "")


def test_identifier_present_only_as_parts_is_missing(parts_corpus: Built) -> None:
    svc = in_process_service(parts_corpus)
    payload = search(svc, query="OLLAMA_KEEP_ALIVE_SESSIONS default")
    assert payload["missing_identifiers"] == ["OLLAMA_KEEP_ALIVE_SESSIONS"]
    assert payload["results"], "the parts still find passages: the best the corpus has"
    assert payload["confidence"] == "low"


# ---------------------------------------------------------------------------
# Languages: a passage is in its document's language.

SHIPPER_DOC = """---
rag_chunk: headings
---
# ログ送信の設定

## 概要

各ノードで動作するシッパーがコンテナの標準出力からログを収集し、中央のログ基盤へまとめて送信します。
送信先と保持期間は環境変数で指定します。本番環境では送信先を必ず明示的に設定してください。
保持期間の既定値は十四日です。監査の対象となるサービスでは四百日に設定する必要があります。

## 設定例

```bash
export LOG_SHIPPER_ENDPOINT=https://logs.example.internal:6514
export LOG_RETENTION_DAYS=400
export LOG_SHIPPER_BATCH_SIZE=500
nimbus-log-shipper restart --config /etc/nimbus/shipper.yaml --verbose --wait-for-ready
nimbus-log-shipper status --output json --include-queue-depth --include-last-error
```
"""

RELEASE_DOC = """# リリース手順

## 準備

リリースの前に変更履歴を確認し、すべてのテストが成功していることを確かめてください。
承認者の確認が済んでから、本番環境への反映を始めます。作業中は監視画面を開いておきます。

## 反映

反映は段階的に進めます。最初に一部のノードへ反映し、エラー率が上がらないことを確認してから残りへ広げます。
問題が見つかった場合は、直前の版へ戻してから原因を調べてください。
"""


@pytest.fixture(scope="module")
def japanese(fake: FakeOllama, tmp_path_factory: pytest.TempPathFactory) -> Built:
    """Japanese documents only, one section of which is a code block (Latin letters almost all)."""
    root = tmp_path_factory.mktemp("japanese")
    corpus = root / "corpus"
    corpus.mkdir()
    (corpus / "shipper.md").write_text(SHIPPER_DOC, encoding="utf-8")
    (corpus / "release.md").write_text(RELEASE_DOC, encoding="utf-8")
    store = root / "store"
    done = ingest_index(corpus, store, fake.host)
    assert done.returncode == 0, done.stderr
    return Built(corpus, store, fake.host)


def test_a_code_section_of_a_japanese_document_is_japanese(japanese: Built) -> None:
    """Read on its own the 設定例 passage is English (its letters are code); the Japanese terms
    it holds are evidence for a Japanese question all the same. (Keyword mode: BM25 decides the
    top hit; the confidence reads the same term evidence as in hybrid mode.)"""
    svc = in_process_service(japanese)
    payload = search(svc, query="設定例", mode="keyword", k=2)
    top = payload["results"][0]
    assert top["heading"].endswith("設定例"), payload["results"]
    assert cjk_share(top["text"]) < CJK_DOCUMENT
    assert "of the query's distinctive terms" in payload["confidence_reason"], payload["confidence_reason"]


def test_an_english_question_over_japanese_documents_is_ranked_by_its_meaning(japanese: Built) -> None:
    """The question's words meet only the code of the Japanese passages (restart, status): the
    keyword channel has no evidence and adds nothing to any hit's fused score. An identifier
    named as written is evidence across languages."""
    svc = in_process_service(japanese)
    question = "How do I restart the log shipper and check the status of its queue?"
    hybrid = search(svc, query=question, k=4)["results"]
    vector = search(svc, query=question, k=4, mode="vector")["results"]
    assert "keyword" in hybrid[0]["matched"], "the keyword channel did match the code"
    assert [(h["path"], h["start_line"], h["rank_score"]) for h in hybrid] == [
        (h["path"], h["start_line"], h["rank_score"]) for h in vector]
    named = search(svc, query="Where is LOG_SHIPPER_BATCH_SIZE set?", k=4)["results"][0]
    assert named["exact_matches"] == ["LOG_SHIPPER_BATCH_SIZE"]
    assert named["rank_score"] > 1 / (server.RRF_K + 1), "more than the vector channel alone gives"


# ---------------------------------------------------------------------------
# Several phrasings in one search.


def test_extra_phrasings_find_what_the_query_alone_misses(built: Built) -> None:
    svc = in_process_service(built)
    question = "ステージングのロールバック手順は？"  # "the staging rollback procedure?" over English runbooks
    alone = search(svc, query=question, k=3)
    assert "runbooks/deploy.md" not in [h["path"] for h in alone["results"][:1]]
    together = search(svc, query=question, queries=["roll back a deploy to the previous version",
                                                    "deployctl rollback --to previous"], k=3)
    top = together["results"][0]
    assert top["path"] == "runbooks/deploy.md" and "Rollback" in top["heading"]
    assert set(top["phrasings"]) >= {1, 2} and top["phrasings"] == sorted(top["phrasings"])
    assert all(set(h["phrasings"]) <= {0, 1, 2} and h["phrasings"] for h in together["results"])
    assert "--to" not in together["missing_identifiers"]


def test_phrasings_are_embedded_in_one_call(built: Built, fake: FakeOllama) -> None:
    svc = in_process_service(built)
    before = fake.calls()["embed_calls"]
    search(svc, query="first phrasing about canary gates", queries=["second about bake time", "third about waves"])
    assert fake.calls()["embed_calls"] == before + 1
    inputs = fake.calls()["embedded_inputs"][-3:]
    assert [text.rsplit("query: ", 1)[1] for text in inputs] == [
        "first phrasing about canary gates", "second about bake time", "third about waves"]
    search(svc, query="first phrasing about canary gates", queries=["second about bake time"])
    assert fake.calls()["embed_calls"] == before + 1, "cached phrasings are not embedded again"


def test_queries_are_validated(built: Built) -> None:
    svc = in_process_service(built)
    assert search_error(svc, query="x", queries=["a", "b", "c", "d", "e"])["code"] == "invalid_argument"
    assert search_error(svc, query="x", queries=["  "])["code"] == "invalid_argument"
    assert search_error(svc, query="x", queries="not a list")["code"] == "invalid_argument"
    same = search(svc, query="deploy freeze", queries=["deploy freeze", " deploy freeze "])
    assert all(hit["phrasings"] == [0] for hit in same["results"]), "duplicates of the query add nothing"


def test_a_phrasing_does_not_change_the_meaning_of_score(built: Built) -> None:
    svc = in_process_service(built)
    payload = search(svc, query="rotation schedule", queries=["who is on call this week"], k=5,
                     min_score=0.2)
    assert all(hit["score"] is not None and hit["score"] >= 0.2 for hit in payload["results"])


# ---------------------------------------------------------------------------
# Confidence and its calibration.


def test_ingest_measures_a_calibration_once(built: Built, fake: FakeOllama) -> None:
    db = keyword_db(built.store)
    raw = db.execute("SELECT value FROM meta WHERE key = 'calibration'").fetchone()
    assert raw, "ingest stores a calibration"
    calibration = Calibration.from_json(raw[0])
    assert -1.0 <= calibration.unrelated < calibration.related <= 1.0 and calibration.queries >= 4
    before = chunk_calls(fake)  # a run probes each host's model fingerprint: not a chunk's call
    assert ingest_index(built.corpus, built.store, fake.host).returncode == 0
    assert chunk_calls(fake) == before, "an unchanged corpus is not recalibrated"


def test_confidence_separates_answerable_from_off_topic(built: Built) -> None:
    svc = in_process_service(built)
    answered = search(svc, query="who gets paged for a sev-1 and how fast must they acknowledge")
    assert answered["confidence"] in ("high", "medium"), answered["confidence_reason"]
    assert "unrelated" in answered["confidence_reason"]
    off_topic = search(svc, query="how long should sourdough bread proof overnight")
    assert off_topic["confidence"] == "low", off_topic["confidence_reason"]
    nothing = search(svc, query="qqqzzzxxy", mode="keyword")
    assert nothing["results"] == [] and nothing["confidence"] is None


def test_old_index_gains_calibration_and_language_shares_on_the_next_ingest(fake: FakeOllama,
                                                                           sample_index: tuple[Path, Path]) -> None:
    built = Built(*sample_index, fake.host)
    path = StoreLayout(built.store).keyword_db(built.index_dir.name)
    with sqlite3.connect(path) as db:  # as a store written before either existed
        db.execute("ALTER TABLE documents DROP COLUMN cjk_share")
        db.execute("PRAGMA user_version = 0")  # an older ingest recorded no schema version
        db.execute("DELETE FROM meta WHERE key IN ('calibration', 'calibrated_at_chunks', 'corpus_facts')")
    svc = in_process_service(built)
    payload = search(svc, query="who gets paged for a sev-1")
    assert "no calibration" in payload["confidence_reason"]
    svc.close(timeout=10)
    assert ingest_index(built.corpus, built.store, fake.host).returncode == 0
    db = keyword_db(built.store)
    shares = dict(db.execute("SELECT path, cjk_share FROM documents").fetchall())
    assert shares["ja/log-collection.md"] > 0.3 and shares["reference/api.md"] == 0.0
    assert db.execute("SELECT 1 FROM meta WHERE key = 'calibration'").fetchone()
    facts = CorpusFacts.from_json(db.execute("SELECT value FROM meta WHERE key = 'corpus_facts'").fetchone()[0])
    assert (facts.documents, facts.cjk_documents) == (6, 1)


def test_instructions_carry_live_index_facts(built: Built, fake: FakeOllama) -> None:
    async def handshake() -> str:
        async with connect(built.server_env(fake.host)) as client:
            return client.instructions or ""

    instructions = anyio.run(handshake)
    assert "6 documents (1 in Japanese/CJK, 5 in other languages (mostly English)); 1 superseded" in instructions
    assert "1 superseded, in 4 top-level folders (list_documents names them); " in instructions
    assert "queries" in instructions and "confidence" in instructions
    assert len(instructions.encode()) <= 2048, len(instructions.encode())
    facts = json.loads(keyword_db(built.store).execute("SELECT value FROM meta WHERE key = 'corpus_facts'")
                       .fetchone()[0])
    assert facts["documents"] == 6
