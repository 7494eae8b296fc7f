"""The search CLI (`python server.py search|get|list`), run as real subprocesses against an index
built by the real `python ingest.py` through the loopback fake Ollama: the --json output is the
tool's structured content (or its error payload) and nothing else, exit codes 0/1/2, the human
view, and the README's CI recipe.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from fake_ollama import FakeOllama
from helpers import ROOT, SERVER, Built, free_port, ingest_index, output_validators, sample_built

import server

pytestmark = pytest.mark.process  # real processes (servers, ingest, Chroma): only in `pytest --all` (tests/README.md)


@pytest.fixture(scope="module")
def built(fake: FakeOllama, indexed_sample: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Built:
    return sample_built(indexed_sample, tmp_path_factory.mktemp("cli"), fake.host)


def run_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, **env}
    full_env.pop("RAG_EMBED_MODEL", None)
    return subprocess.run([sys.executable, str(SERVER), *args], env=full_env, capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL, cwd=str(ROOT.parent))


def json_answer(done: subprocess.CompletedProcess[str], tool: str) -> dict[str, Any]:
    """The one JSON document on stdout, checked against the tool's outputSchema."""
    payload = json.loads(done.stdout)
    assert done.stdout.count("\n") == 1, done.stdout[:500]
    output_validators()[tool].validate(payload)
    return payload


def test_search_json_is_the_tools_structured_content(built: Built, fake: FakeOllama) -> None:
    done = run_cli(built.server_env(fake.host), "search", "declaring a sev-1 incident", "--k", "3", "--json")
    assert done.returncode == 0, done.stderr
    payload = json_answer(done, "search_corpus")
    assert payload["query"] == "declaring a sev-1 incident" and payload["mode"] == "hybrid"
    assert payload["results"][0]["path"] == "oncall/escalation.md" and len(payload["results"]) <= 3


def test_a_query_that_starts_with_dashes_is_a_query_not_an_option(built: Built, fake: FakeOllama) -> None:
    """`--forwarded-allow-ips` is what the README calls identifier-shaped: searched for, options after
    it still read as options (issue 41)."""
    done = run_cli(built.server_env(fake.host), "search", "--forwarded-allow-ips", "--k", "2", "--json")
    assert done.returncode in (0, 1), done.stderr
    payload = json_answer(done, "search_corpus")
    assert payload["query"] == "--forwarded-allow-ips" and len(payload["results"]) <= 2
    assert payload["missing_identifiers"] == ["--forwarded-allow-ips"]
    assert vars(server.parse_args(["search", "--k", "3", "-x", "--mode", "keyword"]))["query"] == "-x"


def test_a_misspelt_variable_is_named_on_stderr_and_stdout_stays_the_answer(built: Built, fake: FakeOllama) -> None:
    done = run_cli({**built.server_env(fake.host), "RAG_STORE": "/meant/here"}, "search", "rollback", "--json")
    assert done.returncode == 0, done.stderr
    assert "RAG_STORE is set but is no variable of local-rag-mcp (did you mean RAG_STORE_DIR?)" in done.stderr
    assert json_answer(done, "search_corpus")["results"]


def test_every_tool_argument_is_a_cli_option() -> None:
    """The sub-commands are built from the tools' input models: nothing to re-declare, nothing to drift."""
    for command, spec in server.CLI_COMMANDS.items():
        usage = subprocess.run([sys.executable, str(SERVER), command, "--help"], capture_output=True, text=True,
                               timeout=60, check=True).stdout
        for name, info in spec.input_model.model_fields.items():
            assert (name if info.is_required() else f"--{name.replace('_', '-')}") in usage, (command, name)


def test_extra_phrasings_reach_the_search(built: Built, fake: FakeOllama) -> None:
    done = run_cli(built.server_env(fake.host), "search", "qqqzzzxxy", "--queries", "who gets paged",
                   "--queries", "declaring an incident", "--k", "10", "--json")
    assert done.returncode == 0, done.stderr
    found_by = {index for hit in json_answer(done, "search_corpus")["results"] for index in hit["phrasings"]}
    assert {1, 2} <= found_by, found_by


def test_search_options_reach_the_tool(built: Built, fake: FakeOllama) -> None:
    done = run_cli(built.server_env(fake.host), "search", "deploy", "--path-prefix", "runbooks/", "--mode", "keyword",
                   "--include-superseded", "--k", "10", "--json")
    assert done.returncode == 0, done.stderr
    payload = json_answer(done, "search_corpus")
    assert payload["mode"] == "keyword"
    paths = {hit["path"] for hit in payload["results"]}
    assert paths and all(path.startswith("runbooks/") for path in paths)
    assert "superseded" in {hit["lifecycle"] for hit in payload["results"]}
    active_only = json_answer(run_cli(built.server_env(fake.host), "search", "deploy", "--path-prefix",
                                      "runbooks/", "--mode", "keyword", "--k", "10", "--json"), "search_corpus")
    assert {hit["lifecycle"] for hit in active_only["results"]} == {"active"}


def test_search_that_finds_nothing_exits_1(built: Built, fake: FakeOllama) -> None:
    nothing = run_cli(built.server_env(fake.host), "search", "qqqzzzxxy", "--mode", "keyword", "--json")
    assert nothing.returncode == 1, nothing.stderr
    assert json_answer(nothing, "search_corpus")["results"] == []
    too_strict = run_cli(built.server_env(fake.host), "search", "sev-1", "--min-score", "0.999")
    assert too_strict.returncode == 1
    assert "nothing scored at least min_score=0.999" in too_strict.stdout


def test_human_view_shows_rank_location_heading_score_and_first_lines(built: Built, fake: FakeOllama) -> None:
    done = run_cli(built.server_env(fake.host), "search", "declaring a sev-1 incident", "--k", "2")
    assert done.returncode == 0, done.stderr
    first = done.stdout.splitlines()[0]
    assert re.fullmatch(r"1\. oncall/escalation\.md:\d+-\d+  On-call escalation policy > Declaring a sev-1  "
                        r"\(score 0\.\d{3}\)", first), first
    assert done.stdout.splitlines()[1].startswith("   ## Declaring a sev-1")
    assert re.search(r"^2\. \S+:\d+-\d+  ", done.stdout, re.MULTILINE)
    assert done.stderr == ""


def test_get_prints_the_lines_and_list_the_documents(built: Built, fake: FakeOllama) -> None:
    env = built.server_env(fake.host)
    lines = run_cli(env, "get", "oncall/escalation.md", "--start-line", "3", "--end-line", "6", "--json")
    assert lines.returncode == 0, lines.stderr
    payload = json_answer(lines, "get_file")
    on_disk = (built.corpus / "oncall" / "escalation.md").read_text().split("\n")
    assert payload["text"] == "\n".join(on_disk[2:6]) and (payload["start_line"], payload["end_line"]) == (3, 6)
    plain = run_cli(env, "get", "oncall/escalation.md", "--start-line", "3", "--end-line", "6")
    assert plain.returncode == 0 and plain.stdout == payload["text"] + "\n"

    listing = run_cli(env, "list", "--json")
    documents = json_answer(listing, "list_documents")["documents"]
    assert {doc["path"] for doc in documents} >= {"oncall/escalation.md", "runbooks/deploy.md"}
    under = run_cli(env, "list", "--path-prefix", "runbooks/")
    assert under.returncode == 0 and under.stdout.splitlines()
    assert all(line.startswith("runbooks/") for line in under.stdout.splitlines()), under.stdout
    paged = json_answer(run_cli(env, "list", "--limit", "2", "--json"), "list_documents")
    assert len(paged["documents"]) == 2 and paged["next_offset"] == 2


@pytest.mark.parametrize(("args", "code"), [
    (("get", "../../etc/passwd"), "path_rejected"),
    (("get", "no/such/page.md"), "not_indexed"),
    (("search", "x", "--k", "0"), "invalid_argument"),
    (("search", "   "), "invalid_argument"),
    (("get", "oncall/escalation.md", "--start-line", "9", "--end-line", "3"), "invalid_argument"),
])
def test_errors_exit_2_with_message_and_hint_on_stderr(built: Built, fake: FakeOllama, args: tuple[str, ...],
                                                       code: str) -> None:
    as_json = run_cli(built.server_env(fake.host), *args, "--json")
    assert as_json.returncode == 2, as_json.stdout
    payload = json.loads(as_json.stdout)
    assert set(payload) == {"error"} and payload["error"]["code"] == code, payload
    plain = run_cli(built.server_env(fake.host), *args)
    assert plain.returncode == 2 and plain.stdout == ""
    message, hint = plain.stderr.strip().splitlines()[-2:]
    assert message == f"{code}: {payload['error']['message']}"
    assert hint == f"next: {payload['error']['hint']}"


def test_missing_index_is_an_error_and_creates_nothing(tmp_path: Path, fake: FakeOllama) -> None:
    store = tmp_path / "no-store"
    done = run_cli({"RAG_STORE_DIR": str(store), "RAG_CORPUS_DIR": str(tmp_path), "OLLAMA_HOST": fake.host},
                   "search", "anything", "--json")
    assert done.returncode == 2
    assert json.loads(done.stdout)["error"]["code"] == "index_missing"
    assert "ingest.py" in done.stderr
    assert not store.exists()


def test_embedder_down_degrades_hybrid_and_fails_vector(built: Built) -> None:
    env = built.server_env(f"http://127.0.0.1:{free_port()}")
    hybrid = run_cli(env, "search", "sev-1 escalation")
    assert hybrid.returncode == 0, hybrid.stderr
    assert "(score -)" in hybrid.stdout and "keyword results only" in hybrid.stdout
    vector = run_cli(env, "search", "sev-1 escalation", "--mode", "vector", "--json")
    assert vector.returncode == 2 and json.loads(vector.stdout)["error"]["code"] == "embedder_unavailable"


def test_usage_errors_exit_2() -> None:
    for args in (("search",), ("search", "x", "--mode", "fuzzy"), ("search", "x", "--k", "many"), ("frobnicate",)):
        done = subprocess.run([sys.executable, str(SERVER), *args], capture_output=True, text=True, timeout=60,
                              stdin=subprocess.DEVNULL)
        assert done.returncode == 2 and "usage:" in done.stderr and done.stdout == "", (args, done.stderr)


def readme_ci_example() -> str:
    text = (ROOT / "README.md").read_text()
    found = re.search(r"<!-- ci-example -->\s*```(?:bash|sh)\n(.*?)```", text, re.DOTALL)
    assert found, "README.md lost its CI example (marked <!-- ci-example -->)"
    return found.group(1)


def test_readme_ci_example_fails_the_job_when_the_passage_is_gone(sample_index: tuple[Path, Path],
                                                                  fake: FakeOllama) -> None:
    """The README's CI recipe, run as written: passes on the sample corpus, fails once the
    passage it guards is deleted and the corpus re-indexed."""
    built = Built(*sample_index, fake.host)
    env = {**os.environ, **built.server_env(fake.host)}
    env.pop("RAG_EMBED_MODEL", None)

    def ci_job() -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", "-euo", "pipefail", "-c", readme_ci_example()], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)

    passing = ci_job()
    assert passing.returncode == 0, passing.stdout + passing.stderr
    runbook = built.corpus / "runbooks" / "deploy.md"
    text = runbook.read_text()
    start = text.index("## Rollback")
    end = text.index("\nTroubleshooting\n", start)
    runbook.write_text(text[:start] + text[end + 1:])
    assert ingest_index(built.corpus, built.store, fake.host).returncode == 0
    failing = ci_job()
    assert failing.returncode != 0, failing.stdout


@pytest.mark.parametrize("raw", ["{host} ", "{host},127.0.0.1:9"])
def test_a_pasted_ollama_host_with_a_trailing_space_searches_as_written(built: Built, fake: FakeOllama, raw: str) -> None:
    """`import ollama` parses the raw variable itself and raised on the space inside every search
    (and would on a comma list, whose hosts the server asks in order)."""
    done = run_cli({**built.server_env(fake.host), "OLLAMA_HOST": raw.format(host=fake.host)}, "search", "sev-1",
                   "--json")
    assert done.returncode == 0, done.stderr
    payload = json_answer(done, "search_corpus")
    assert payload.get("degraded") is None and payload["results"], payload


@pytest.mark.parametrize("host", ["127.0.0.1:xx", ":99999", "ftp://127.0.0.1:11434"])
def test_an_ollama_host_that_does_not_parse_is_a_configuration_error_everywhere(built: Built, host: str,
                                                                                tmp_path: Path) -> None:
    env = {**os.environ, "OLLAMA_HOST": host, "ANONYMIZED_TELEMETRY": "False"}
    for argv in ([str(ROOT / "ingest.py"), "--corpus", str(built.corpus), "--store", str(tmp_path / "s")],
                 [str(ROOT / "ingest.py"), "--corpus", str(built.corpus), "--store", str(tmp_path / "s"), "--dry-run"],
                 [str(SERVER), "search", "sev-1"]):
        done = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=120,
                              stdin=subprocess.DEVNULL)
        assert done.returncode == 2, (argv, done.stderr)
        assert "configuration error: OLLAMA_HOST=" in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_the_human_view_says_what_the_agent_is_told_before_the_hits(built: Built, fake: FakeOllama) -> None:
    """A plausible-looking answer to an identifier no document holds is flagged first, as the
    tool's confidence and missing_identifiers flag it to the agent."""
    env = built.server_env(fake.host)
    payload = json_answer(run_cli(env, "search", "OLLAMA_KEEP_ALIVE_SECONDS", "--json"), "search_corpus")
    assert payload["confidence"] == "low" and payload["missing_identifiers"] == ["OLLAMA_KEEP_ALIVE_SECONDS"]
    lines = run_cli(env, "search", "OLLAMA_KEEP_ALIVE_SECONDS").stdout.splitlines()
    assert lines[0] == f"(low confidence: {payload['confidence_reason']})", lines[:3]
    assert "OLLAMA_KEEP_ALIVE_SECONDS" in lines[0] and lines[1].startswith("1. "), lines[:3]
    sure = run_cli(env, "search", "declaring a sev-1 incident", "--k", "1").stdout.splitlines()
    assert re.fullmatch(r"\(confidence (high|medium): [-0-9.]+\)", sure[-1]), sure


def test_a_store_of_another_corpus_is_a_warning_and_the_hint_names_a_command_that_works(
        built: Built, fake: FakeOllama, tmp_path: Path) -> None:
    """The stdio server warns at start when RAG_CORPUS_DIR is not the indexed folder; the CLI says
    the same, and the staleness hint asks for --replace-corpus, not a plain ingest that would refuse."""
    other = tmp_path / "other-docs"
    shutil.copytree(built.corpus, other)
    (other / "oncall" / "escalation.md").write_text("# Changed\n\nSomething else.\n", encoding="utf-8")
    done = run_cli({**built.server_env(fake.host), "RAG_CORPUS_DIR": str(other)}, "search", "sev-1", "--json")
    assert done.returncode == 0, done.stderr
    assert done.stderr.startswith("warning: RAG_CORPUS_DIR") and "was built from" in done.stderr, done.stderr
    answer = json_answer(done, "search_corpus")
    hint = answer["staleness"]["hint"]
    assert "--replace-corpus" in hint and "changed on disk" not in hint, hint
    # a file get_file would refuse gives its hit no section: the passage, and the search answers
    assert answer["results"] and all(hit["context"] == "passage" for hit in answer["results"]), answer["results"]


def test_the_human_view_says_why_a_search_is_thin_and_what_replaces_a_superseded_hit(
        built: Built, fake: FakeOllama) -> None:
    env = built.server_env(fake.host)
    query = "kubectl-deploy push --all-at-once"
    hidden = run_cli(env, "search", query)
    assert hidden.returncode == 0, hidden.stderr
    message = json_answer(run_cli(env, "search", query, "--json"), "search_corpus")["message"]
    assert hidden.stdout.splitlines()[-1] == f"({message})"
    # the superseded runbook would come first (issue 41 §8)
    assert ("'runbooks/deploy-2023.md' would come first: pass include_superseded=true to see it, replaced by "
            "'runbooks/deploy.md')") in hidden.stdout
    shown = run_cli(env, "search", query, "--include-superseded").stdout
    assert "[superseded by runbooks/deploy.md]" in shown.splitlines()[0], shown
    listed = run_cli(env, "list", "--path-prefix", "oncal")
    assert listed.stdout.startswith("(no indexed document under path_prefix 'oncal'; nearest indexed folders: 'oncall'")
