"""search_corpus's document, tags and date pre-filters (issue 45 §2): what each admits, that they
are pre-filters in both channels (a filter never empties a result list that had room), that they
commute with k, the messages when nothing matches, and the keys as every format writes them."""

from __future__ import annotations

import datetime
import os
import sqlite3
import unicodedata
from pathlib import Path

import pytest
from budgets import examples
from fake_ollama import FakeOllama
from helpers import Built, build, chunk_inputs, dispatched, in_process_service, ingest_in_process
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import corpus_rules as rules

DOCS = {
    "guides/deploy.md": "---\ntitle: Déploiement rapide\ntags: [deploy, Ops]\nupdated: 2025-03-02\n---\n"
                        "# Deploy\n\nRoll out the release with kubectl apply and watch the rollout.\n",
    "guides/rollback.md": "---\ntags: ops, incident\ndate: 2024-11-20\n---\n# Rollback\n\n"
                          "Roll back a bad release with kubectl rollout undo.\n",
    "reference/cli.rst": ":tags: cli, reference\n:date: 2023-01-15\n\nCLI reference\n=============\n\n"
                         "The deploy command rolls out a release.\n",
    "notes/ＦＵＬＬ.md": "# Wide notes\n\nRelease notes about the rollout of version two.\n",
    "old/deploy-2022.md": "---\nlifecycle: superseded\nsuperseded_by: guides/deploy.md\ntags: [deploy]\n"
                          "date: 2022-05-01\n---\n# Old deploy\n\nRoll out the release with the old script.\n",
}


@pytest.fixture(scope="module")
def built(fake: FakeOllama, tmp_path_factory: pytest.TempPathFactory) -> Built:
    source = tmp_path_factory.mktemp("filters-source")
    for path, text in DOCS.items():
        (source / path).parent.mkdir(parents=True, exist_ok=True)
        (source / path).write_text(text, encoding="utf-8")
    # notes/ＦＵＬＬ.md has no date of its own: its mtime at ingest is its date.
    os.utime(source / "notes/ＦＵＬＬ.md", ns=(1_700_000_000 * 10**9, 1_700_000_000 * 10**9))  # 2023-11-14
    return build(tmp_path_factory.mktemp("filters"), fake.host, source)


def search(svc: object, **args: object) -> dict:
    is_error, payload = dispatched(svc, "search_corpus", **{"query": "roll out the release", "k": 10, **args})
    assert not is_error, payload
    return payload


def paths(payload: dict) -> list[str]:
    return [hit["path"] for hit in payload["results"]]


@pytest.mark.parametrize("mode", ["hybrid", "keyword", "vector"])
def test_each_filter_admits_exactly_its_documents_in_every_mode(built: Built, mode: str) -> None:
    svc = in_process_service(built)
    assert set(paths(search(svc, mode=mode, tags=["ops"]))) == {"guides/deploy.md", "guides/rollback.md"}
    assert set(paths(search(svc, mode=mode, tags=["CLI", "nothing-like-it"]))) == {"reference/cli.rst"}
    # Title or file name, any case, Unicode form or spacing.
    nfd = unicodedata.normalize("NFD", "  déploiement   RAPIDE ")
    assert set(paths(search(svc, mode=mode, document=nfd))) == {"guides/deploy.md"}
    assert set(paths(search(svc, mode=mode, document="rollback.md"))) == {"guides/rollback.md"}
    assert set(paths(search(svc, mode=mode, document="full"))) == {"notes/ＦＵＬＬ.md"}  # NFKC: full-width letters
    # Dates: the document's own (updated before date), else its mtime when indexed; both ends inclusive.
    assert set(paths(search(svc, mode=mode, modified_after="2024-11-20"))) == {"guides/deploy.md", "guides/rollback.md"}
    assert set(paths(search(svc, mode=mode, modified_before="2023-11-14"))) == {"reference/cli.rst", "notes/ＦＵＬＬ.md"}
    assert set(paths(search(svc, mode=mode, modified_after="2023-06-01", modified_before="2024-12-31"))) == {
        "guides/rollback.md", "notes/ＦＵＬＬ.md"}
    # Combined with each other and with path_prefix: all must hold.
    assert paths(search(svc, mode=mode, tags=["ops"], modified_before="2025-01-01")) == ["guides/rollback.md"]
    assert paths(search(svc, mode=mode, tags=["deploy", "cli"], path_prefix="reference")) == ["reference/cli.rst"]
    # Superseded documents stay hidden unless asked for, filters or not.
    assert set(paths(search(svc, mode=mode, tags=["deploy"], include_superseded=True))) == {
        "guides/deploy.md", "old/deploy-2022.md"}


def test_a_filter_that_matches_nothing_names_the_nearest_titles_or_tags(built: Built) -> None:
    svc = in_process_service(built)
    payload = search(svc, document="Deploiement rapid")
    assert payload["results"] == [] and "Déploiement rapide" in payload["message"]
    payload = search(svc, document="rollbak")  # file names are offered too
    assert payload["results"] == [] and "'rollback.md'" in payload["message"]
    payload = search(svc, tags=["opps"])
    assert payload["results"] == [] and "nearest tags: 'ops'" in payload["message"].lower()
    payload = search(svc, modified_after="2030-01-01")
    assert payload["results"] == [] and "2022-05-01 to 2025-03-02" in payload["message"]
    payload = search(svc, tags=["cli"], modified_after="2025-01-01")
    assert payload["results"] == [] and "together" in payload["message"]
    # Only a superseded document passes: say so, and name what replaces it.
    payload = search(svc, document="Old deploy")
    assert payload["results"] == [] and "include_superseded=true" in payload["message"]
    assert "guides/deploy.md" in payload["message"]
    payload = search(svc, tags=["cli"], path_prefix="guides")
    assert payload["results"] == [] and "matches the document, tags and date filters" in payload["message"]


def test_bad_filter_values_are_refused_at_the_boundary(built: Built) -> None:
    svc = in_process_service(built)
    for args in ({"modified_after": "last week"}, {"modified_after": "2025-02-30"},
                 {"modified_after": "2025-03-01", "modified_before": "2025-01-01"}, {"document": "  "},
                 {"tags": [""]}, {"tags": ["x"] * 21}):
        is_error, payload = dispatched(svc, "search_corpus", query="release", **args)
        assert is_error and payload["error"]["code"] == "invalid_argument", (args, payload)


@settings(max_examples=examples(20), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(k=st.integers(1, 6), mode=st.sampled_from(["hybrid", "keyword", "vector"]),
       filters=st.sampled_from([{"tags": ["ops"]}, {"tags": ["deploy", "cli"]}, {"modified_after": "2023-06-01"},
                                {"document": "cli"}, {"tags": ["deploy"], "include_superseded": True}]))
def test_filters_commute_with_k(built: Built, k: int, mode: str, filters: dict) -> None:
    """Results for k are the first k of those for k + 1, under any filter."""
    svc = in_process_service(built)
    few = paths(search(svc, mode=mode, k=k, context="passage", **filters))
    more = paths(search(svc, mode=mode, k=k + 1, context="passage", **filters))
    assert few == more[:k]


def test_list_documents_shows_tags_and_dates(built: Built) -> None:
    is_error, payload = dispatched(in_process_service(built), "list_documents")
    assert not is_error
    by_path = {doc["path"]: doc for doc in payload["documents"]}
    assert by_path["guides/deploy.md"]["tags"] == ["deploy", "Ops"] and by_path["guides/deploy.md"]["date"] == "2025-03-02"
    assert by_path["reference/cli.rst"]["tags"] == ["cli", "reference"]
    assert by_path["notes/ＦＵＬＬ.md"]["tags"] == [] and by_path["notes/ＦＵＬＬ.md"]["date"] is None


def test_a_tag_filter_over_500_tags(fake: FakeOllama, tmp_path: Path) -> None:
    source = tmp_path / "source"
    source.mkdir()
    for n in range(100):
        tags = ", ".join(f"tag-{(n * 5 + i) % 500}" for i in range(5))
        (source / f"doc{n:03}.md").write_text(f"---\ntags: [{tags}]\n---\n# Doc {n}\n\nrelease note {n}\n")
    svc = in_process_service(build(tmp_path, fake.host, source))
    payload = search(svc, query="release note", tags=["TAG-7", "tag-499"], mode="keyword")
    assert set(paths(payload)) == {"doc001.md", "doc099.md"}


# ---------------------------------------------------------------------------
# The keys, as every format writes them.


def test_tags_and_dates_in_every_format() -> None:
    md = rules.parse_document(b"---\ntags: a, B ,a\nupdated: 2025-01-02T10:00:00Z\ndate: 2020-01-01\n---\n# T\n", "x.md")
    assert md.tags == ("a", "B") and md.dated == "2025-01-02"
    rst = rules.parse_document(b":tags: x, y\n:date: 2024-02-03\n\nT\n=\n", "x.rst")
    assert rst.tags == ("x", "y") and rst.dated == "2024-02-03"
    adoc = rules.parse_document(b"= T\n:keywords: k1, k2\n:revdate: 2023-04-05\n\nText.\n", "x.adoc")
    assert adoc.tags == ("k1", "k2") and adoc.dated == "2023-04-05"
    hugo = rules.parse_document(b"---\nlastmod: 2021-06-07\n---\n# T\n", "x.md")
    assert hugo.dated == "2021-06-07"
    toml = rules.parse_document(b"+++\ntags = ['t']\ndate = 2022-08-09\n+++\n# T\n", "x.md")
    assert toml.tags == ("t",) and toml.dated == "2022-08-09"


def test_unusable_tags_and_dates_are_left_out_with_a_warning() -> None:
    doc = rules.parse_document(b"---\ntags: {a: 1}\ndate: next tuesday\n---\n# T\n", "x.md")
    assert doc.tags == () and doc.dated is None
    assert any("tags must be" in w for w in doc.warnings) and any("YYYY-MM-DD" in w for w in doc.warnings)
    many = rules.parse_document(("---\ntags: [" + ", ".join(f"t{i}" for i in range(80)) + "]\n---\n# T\n").encode(), "x.md")
    assert len(many.tags) == rules.TAGS_MAX and any("more than" in w for w in many.warnings)


@settings(max_examples=examples(200), deadline=None)
@given(st.text(max_size=40))
def test_match_key_ignores_case_form_and_spacing(text: str) -> None:
    key = rules.match_key(text)
    assert rules.match_key(unicodedata.normalize("NFD", text)) == key
    assert rules.match_key(f"  {text.upper()}  ") == rules.match_key(text.upper())
    assert key == key.strip() and "  " not in key


def test_an_older_store_records_the_keys_on_its_next_run(fake: FakeOllama, tmp_path: Path) -> None:
    """A store written before tags and dates were recorded: the next run reads its unchanged files
    again for their keys (embedding nothing again), and the filters find them."""
    source = tmp_path / "source"
    source.mkdir()
    (source / "a.md").write_text("---\ntags: [alpha]\ndate: 2024-01-01\n---\n# A\n\nrelease alpha\n")
    built = build(tmp_path, fake.host, source)
    db = sqlite3.connect(built.index_dir / rules.KEYWORD_DB)
    db.execute("UPDATE documents SET tags = NULL, dated = NULL")
    db.commit()
    db.close()
    embedded = chunk_inputs(fake)
    done = ingest_in_process(fake, built.corpus, built.store)
    assert done.code == 0, done.err
    assert chunk_inputs(fake) == embedded  # read again, not embedded again
    payload = search(in_process_service(built), query="release alpha", tags=["ALPHA"],
                     modified_before=datetime.date(2024, 1, 1).isoformat())
    assert paths(payload) == ["a.md"]
