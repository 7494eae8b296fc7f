"""Installed by name and run anywhere (issue 28 §1), as real processes.

- The wheel: built from the project's files alone, installed non-editable into a fresh venv,
  its console scripts run from a folder outside the checkout with no RAG_CORPUS_DIR (a
  configuration error), then on a fixture corpus through the loopback fake Ollama:
  `local-rag-ingest`, `local-rag-mcp search --json` and a stdio handshake. The fresh venv
  borrows this environment's libraries through a .pth line (no download: CI may be offline);
  a directory added that way has its own .pth files ignored, so this environment's editable
  install of the project is not seen and the wheel's copy is what runs (the test checks).
- A Python without the project's libraries (the base interpreter, as a user's bare `python3`):
  `python ingest.py` and `python server.py` say which Python is running and which one has the
  project, not "failed unexpectedly ... report it".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest
from fake_ollama import FakeOllama
from helpers import INGEST, ROOT, SERVER

import corpus_rules as rules

pytestmark = pytest.mark.process  # real processes (pip, ingest, the server): only in `pytest --all` (tests/README.md)

TIMEOUT_S = 180


def run(args: list[str | Path], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(arg) for arg in args], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=TIMEOUT_S, stdin=subprocess.DEVNULL)


def build_wheel(tmp_path: Path) -> Path:
    """The wheel of a copy holding only what the build reads: pyproject.toml, README.md, LICENSE
    and the py-modules it names (a module missing from that list is missing from the wheel)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    source = tmp_path / "source"
    source.mkdir()
    modules = [f"{name}.py" for name in project["tool"]["setuptools"]["py-modules"]]
    for name in ["pyproject.toml", "README.md", "LICENSE", *modules]:
        (source / name).write_bytes((ROOT / name).read_bytes())
    done = run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", tmp_path / "dist", source],
               dict(os.environ), tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("local_rag_mcp-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        entry_points = archive.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert sorted(n for n in names if "/" not in n) == sorted(modules), names
    assert f"{rules.SERVER_SCRIPT} = server:main" in entry_points and f"{rules.INGEST_SCRIPT} = ingest:main" in entry_points
    return wheel


def fresh_venv(tmp_path: Path, wheel: Path) -> Path:
    venv = tmp_path / "venv"
    done = run([sys.executable, "-m", "venv", "--without-pip", venv], dict(os.environ), tmp_path)
    assert done.returncode == 0, done.stderr
    python = venv / "bin" / "python"
    done = run([sys.executable, "-m", "pip", "--python", python, "install", "--quiet", "--no-deps", wheel],
               dict(os.environ), tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    purelib = run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], {}, tmp_path).stdout.strip()
    (Path(purelib) / "borrowed-libraries.pth").write_text(sysconfig.get_path("purelib") + "\n", encoding="utf-8")
    return venv


def test_the_wheel_installs_and_runs_by_name_outside_the_checkout(fake: FakeOllama, tmp_path: Path) -> None:
    venv = fresh_venv(tmp_path, build_wheel(tmp_path))
    bin_dir = venv / "bin"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {"PATH": f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin", "HOME": str(tmp_path / "home"),
           "OLLAMA_HOST": fake.host, "ANONYMIZED_TELEMETRY": "False", "PYTHONUNBUFFERED": "1"}
    where = run([bin_dir / "python", "-c", "import corpus_rules, server; print(server.__file__, corpus_rules.IN_CHECKOUT)"],
                env, elsewhere)
    assert where.stdout.split() == [str(venv / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
                                        / "site-packages" / "server.py"), "False"], where.stderr

    unset = run([rules.INGEST_SCRIPT], env, elsewhere)
    assert unset.returncode == 2, unset.stderr[-3000:]
    assert "configuration error: RAG_CORPUS_DIR is not set" in unset.stderr and "set RAG_CORPUS_DIR" in unset.stderr
    assert "resolved configuration" not in unset.stderr  # no default corpus beside an installed copy to show
    no_index = run([rules.SERVER_SCRIPT, "search", "rollback"], env, elsewhere)
    assert no_index.returncode == 2 and "set RAG_CORPUS_DIR" in no_index.stderr, no_index.stderr[-3000:]
    assert f"then run `{rules.INGEST_SCRIPT}`" in no_index.stderr, "the console script, by name: PATH finds it"
    assert not (tmp_path / "home" / ".local-rag-mcp").exists(), "nothing is written by a failed start"

    corpus = tmp_path / "docs"
    corpus.mkdir()
    (corpus / "rollback.md").write_text("# Rollback\n\nTo roll back a deploy, run `deployctl rollback --to PREVIOUS` "
                                        "and page the release captain.\n", encoding="utf-8")
    (corpus / "oncall.md").write_text("# On-call\n\nThe primary on-call answers pages within five minutes.\n",
                                      encoding="utf-8")
    env.update(RAG_CORPUS_DIR=str(corpus), RAG_STORE_DIR=str(tmp_path / "store"))
    ingested = run([rules.INGEST_SCRIPT, "--json"], env, elsewhere)
    assert ingested.returncode == 0, ingested.stderr[-3000:]
    assert json.loads(ingested.stdout.splitlines()[-1])["added"] == 2

    found = run([rules.SERVER_SCRIPT, "search", "how do I roll back a deploy", "--json"], env, elsewhere)
    assert found.returncode == 0, found.stderr[-3000:]
    assert json.loads(found.stdout)["results"][0]["path"] == "rollback.md"

    version = run([rules.SERVER_SCRIPT, "--version"], env, elsewhere)
    assert version.stdout.strip() == f"{rules.SERVER_SCRIPT} {rules.TOOL_VERSION}"

    stdio = subprocess.Popen([str(bin_dir / rules.SERVER_SCRIPT)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=env, cwd=elsewhere)
    messages = [{"jsonrpc": "2.0", "id": 1, "method": "initialize",
                 "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "0"}}},
                {"jsonrpc": "2.0", "method": "notifications/initialized"},
                {"jsonrpc": "2.0", "id": 2, "method": "tools/list", "params": {}}]
    assert stdio.stdin is not None and stdio.stdout is not None
    for message in messages:
        stdio.stdin.write(json.dumps(message).encode() + b"\n")
        stdio.stdin.flush()
    answers = [json.loads(stdio.stdout.readline()) for _ in range(2)]
    stdio.stdin.close()
    assert stdio.wait(timeout=60) == 0
    assert answers[0]["result"]["serverInfo"]["version"] == rules.TOOL_VERSION
    assert {tool["name"] for tool in answers[1]["result"]["tools"]} == {"search_corpus", "get_file", "list_documents"}


def python_without_the_project() -> str:
    """The interpreter this environment was made from: a user's `python3` outside the venv."""
    base = getattr(sys, "_base_executable", "") or sys.executable
    probe = subprocess.run([base, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('chromadb') "
                            "is not None)"], capture_output=True, timeout=60)
    if probe.returncode != 0:
        pytest.skip(f"{base} has the project's libraries: no Python without them to run")
    return base


def expected_hint(program: Path) -> str:
    if rules.CLONE_PYTHON.is_file():
        return f"run it with the clone's environment: {rules.CLONE_PYTHON} {program}"
    return "install the project into this Python: "


def test_a_python_without_the_libraries_says_which_python_has_them(tmp_path: Path) -> None:
    python = python_without_the_project()
    env = {key: value for key, value in os.environ.items() if key not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env.update(PYTHONNOUSERSITE="1", RAG_STORE_DIR=str(tmp_path / "store"))
    ingested = run([python, INGEST, "--corpus", ROOT / "sample-corpus"], env, tmp_path)
    assert ingested.returncode == 2, ingested.stderr[-3000:]
    assert f"configuration error: the Python running ingest.py ({python}) cannot import" in ingested.stderr
    assert expected_hint(INGEST) in ingested.stderr and "report it" not in ingested.stderr, ingested.stderr[-3000:]
    assert "Traceback" not in ingested.stderr

    served = subprocess.run([python, str(SERVER)], input=b"", env=env, cwd=tmp_path, capture_output=True,
                            timeout=TIMEOUT_S)
    err = served.stderr.decode()
    assert served.returncode == 2 and served.stdout == b"", err[-3000:]
    assert f"the Python running server.py ({python}) cannot import" in err and expected_hint(SERVER) in err, err[-3000:]
    assert "Traceback" not in err
