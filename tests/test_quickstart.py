"""tools/quickstart.py as a first-time user runs it: a real process, the loopback fake Ollama, a real
ingest into a temporary store. The environment step is given this test's interpreter (--python) so
that no network install runs; creating .venv is what `.ci/run` itself does on every CI run."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import tomllib
from pathlib import Path
from typing import Any

import pytest
from fake_ollama import FakeOllama
from helpers import chunk_calls

pytestmark = pytest.mark.process  # real processes (servers, ingest, Chroma): only in `pytest --all` (tests/README.md)

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "tools" / "quickstart.py"


def quickstart(host: str, *args: str, path: str | None = None, home: Path | None = None) -> subprocess.CompletedProcess[str]:
    """The quick start as a user runs it, in a home of its own (its default stores and the clients'
    registrations it reads live there): this test's temporary one unless given."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAG_")}
    env.update(OLLAMA_HOST=host, ANONYMIZED_TELEMETRY="False",
               HOME=str(home or Path(tempfile.mkdtemp(prefix="quickstart-home-"))))
    if path is not None:
        env["PATH"] = path
    return subprocess.run([sys.executable, str(QUICKSTART), "--python", sys.executable, *args], env=env,
                          capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)


def codex_table(out: str) -> dict[str, object]:
    """The config.toml block as printed: one indentation throughout, the table Codex reads."""
    block = out.split("config.toml:\n", 1)[1].split("\n\n", 1)[0]
    assert len({line[:len(line) - len(line.lstrip())] for line in block.splitlines()}) == 1, block
    return tomllib.loads(textwrap.dedent(block))["mcp_servers"]["local-rag"]


def load_quickstart() -> Any:
    spec = importlib.util.spec_from_file_location("quickstart", QUICKSTART)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_codex_block_without_variables_is_valid_toml() -> None:
    assert codex_table(load_quickstart().registration(Path("/venv/bin/python"), {})) == {
        "command": "/venv/bin/python", "args": [str(ROOT / "server.py")], "startup_timeout_sec": 30}


def test_indexes_and_prints_registration_commands_with_absolute_paths(tmp_path: Path) -> None:
    store = tmp_path / "store"
    with FakeOllama() as fake:
        done = quickstart(fake.host, "--store", str(store))
    assert done.returncode == 0, done.stderr
    current = json.loads((store / "CURRENT.json").read_text(encoding="utf-8"))
    assert current["stamp"]["files"] == 6 and current["corpus_dir"] == str(ROOT / "sample-corpus")
    out = done.stdout
    server = str(ROOT / "server.py")
    # -e must follow the server's name (claude's -e takes several values).
    assert f"claude mcp add -s user local-rag -e RAG_STORE_DIR={store} -- {sys.executable} {server}" in out
    assert f"codex mcp add --env RAG_STORE_DIR={store} local-rag -- {sys.executable} {server}" in out
    assert "claude mcp list" in out
    assert "add -e RAG_WATCH=1 (Codex: --env RAG_WATCH=1)" in out  # a server that keeps its index fresh
    assert codex_table(out) == {"command": sys.executable, "args": [server], "env": {"RAG_STORE_DIR": str(store)},
                                "startup_timeout_sec": 30}
    # Again: nothing to do, same answer.
    with FakeOllama() as fake:
        again = quickstart(fake.host, "--store", str(store))
        assert again.returncode == 0, again.stderr
        assert chunk_calls(fake) == 0  # only the model fingerprint probe of a no-op run


def test_own_corpus_gets_its_own_store_and_both_variables(tmp_path: Path) -> None:
    corpus = tmp_path / "my-docs"
    corpus.mkdir()
    (corpus / "a.md").write_text("# Alpha\n\nThe alpha procedure.\n", encoding="utf-8")
    store = tmp_path / "mine"
    with FakeOllama() as fake:
        done = quickstart(fake.host, "--corpus", str(corpus), "--store", str(store))
    assert done.returncode == 0, done.stderr
    # Named after its folder, so it registers beside the sample corpus's `local-rag`.
    assert f"claude mcp add -s user local-rag-my-docs -e RAG_CORPUS_DIR={corpus} -e RAG_STORE_DIR={store} --" in done.stdout
    assert "[mcp_servers.local-rag-my-docs]" in done.stdout
    assert "claude mcp add --transport http -s user local-rag-my-docs http://127.0.0.1:8765/mcp" in done.stdout
    assert json.loads((store / "CURRENT.json").read_text(encoding="utf-8"))["corpus_dir"] == str(corpus)


def test_without_ollama_or_its_model_it_indexes_for_keywords_and_says_how_to_add_vectors(tmp_path: Path) -> None:
    """#28 §2: a machine without Ollama still gets an index and the registration; the output says
    how to add semantic search, and a run with Ollama up embeds what waits."""
    down = FakeOllama().start()
    host = down.host
    down.stop()
    done = quickstart(host, "--store", str(tmp_path / "s1"))
    assert done.returncode == 1, done.stderr  # as ingest (and the README): not everything is indexed as asked
    assert "Ollama does not answer" in done.stderr and "ollama serve" in done.stderr
    assert "claude mcp add -s user local-rag" in done.stdout
    assert "To add semantic search" in done.stdout and "ollama pull embeddinggemma" in done.stdout
    current = json.loads((tmp_path / "s1" / "CURRENT.json").read_text())
    assert current["stamp"]["vectors_pending"] == current["stamp"]["chunks"] > 0
    again = quickstart(host, "--store", str(tmp_path / "s1"))  # still no Ollama: the index stands
    assert again.returncode == 1 and "nothing new to index" in again.stderr, again.stderr
    assert "claude mcp add" in again.stdout
    with FakeOllama() as fake:
        fake.configure(missing_models=["embeddinggemma"])
        # No `ollama` command on PATH: the user is told the exact pull command.
        done = quickstart(fake.host, "--store", str(tmp_path / "s2"), path=str(Path(sys.executable).parent))
        assert done.returncode == 1 and "run `ollama pull embeddinggemma`" in done.stderr, done.stderr
        fake.configure(missing_models=[])
        done = quickstart(fake.host, "--store", str(tmp_path / "s2"))
    assert done.returncode == 0 and "semantic search" not in done.stdout, done.stdout
    assert json.loads((tmp_path / "s2" / "CURRENT.json").read_text())["stamp"]["vectors_pending"] == 0


def test_an_installed_environment_is_not_installed_again(tmp_path: Path) -> None:
    """A re-run skips pip when this checkout and its dependencies are installed (as in the test's own
    environment, which `pip install -e .` made), and installs into one that lacks them."""
    module = load_quickstart()
    assert module.installed(Path(sys.executable))
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")], check=True, timeout=120)
    assert not module.installed(tmp_path / "bare" / "bin" / "python")


def test_docs_folders_of_two_projects_get_names_and_stores_of_their_own(tmp_path: Path) -> None:
    """Three projects keep their documentation in a folder named docs: each registers and stores
    under its project's name (fastapi-docs, mcp-docs), and a name another corpus already holds in
    a client's registrations (read from ~/.claude.json) is not taken again (issue 41)."""
    home = tmp_path / "home"
    home.mkdir()
    (home / ".claude.json").write_text(json.dumps({"mcpServers": {"local-rag-other-docs": {
        "command": "python", "env": {"RAG_CORPUS_DIR": "/somewhere/else/docs"}}}}), encoding="utf-8")
    folders = [tmp_path / "fastapi" / "docs", tmp_path / "mcp" / "docs", tmp_path / "other" / "docs"]
    for folder in folders:
        folder.mkdir(parents=True)
        (folder / "index.md").write_text(f"# {folder.parent.name}\n\nThe {folder.parent.name} guide.\n", encoding="utf-8")
    outs = []
    with FakeOllama() as fake:
        for folder in folders:
            done = quickstart(fake.host, "--corpus", str(folder), home=home)
            assert done.returncode == 0, done.stderr
            outs.append(done.stdout)
    assert "claude mcp add -s user local-rag-fastapi-docs " in outs[0] and "local-rag-mcp-docs " in outs[1]
    assert "local-rag-other-docs-2 " in outs[2]  # local-rag-other-docs is another corpus's registration
    stores = sorted(p.name for p in (home / ".local-rag-mcp" / "stores").iterdir())
    assert stores == ["fastapi-docs", "mcp-docs", "other-docs-2"]


def test_a_folder_with_nothing_to_index_fails_instead_of_printing_a_registration(tmp_path: Path) -> None:
    corpus = tmp_path / "site"
    corpus.mkdir()
    (corpus / "index.html").write_text("<p>built pages</p>", encoding="utf-8")
    with FakeOllama() as fake:
        done = quickstart(fake.host, "--corpus", str(corpus), home=tmp_path / "home")
    assert done.returncode == 2 and "nothing was indexed" in done.stderr and "claude mcp add" not in done.stdout
    assert ".html: 1 not read" in done.stderr
