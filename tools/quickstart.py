#!/usr/bin/env python3
"""From a fresh clone to a registered search server in one command (needs Python 3.11+; Ollama for semantic search).

    python3 tools/quickstart.py                      # the sample corpus
    python3 tools/quickstart.py --corpus ~/my-docs   # your own docs folder (Markdown, MDX, rST, AsciiDoc, PDF), in its own store

It creates .venv next to the code (unless it exists), installs local-rag-mcp into it (skipped
when it is installed there), checks that Ollama answers and has the embedding model (pulling it
with the `ollama` command when it is missing), indexes the corpus with ingest.py, and prints the
exact commands that register the server with Claude Code and Codex, with absolute paths. Without
Ollama (or its model) it still indexes and registers: searches answer from the keyword index, and
it says how to add semantic search (a later run embeds only the passages that wait for it).
Standard library only: it runs before anything is installed. Safe to run again: ingest only
indexes what changed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

PROJECT_DIR = Path(__file__).resolve().parent.parent
DEFAULT_STORE = Path("~/.local-rag-mcp/store").expanduser()


def say(text: str) -> None:
    print(f"quickstart: {text}", file=sys.stderr, flush=True)


def fail(text: str, status: int = 2) -> int:
    say(text)
    return status


# Run by the environment's interpreter (-I: not the checkout's own build metadata in the cwd):
# exit 0 when this checkout is installed there (editable) with every dependency pyproject.toml
# names (their versions are pip's business on a reinstall).
INSTALLED = r"""
import importlib.metadata as metadata, json, pathlib, sys
checkout, *needed = sys.argv[1:]
dist = metadata.distribution("local-rag-mcp")
url = json.loads(dist.read_text("direct_url.json") or "{}")
assert url.get("dir_info", {}).get("editable") and url.get("url") == pathlib.Path(checkout).as_uri()
for name in needed:
    metadata.version(name)
"""


def dependency_names() -> list[str]:
    """The distribution names pyproject.toml depends on (without versions or markers)."""
    import tomllib  # Python 3.11+, checked in main() before anything is imported from it

    project = tomllib.loads((PROJECT_DIR / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    return [re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0] for requirement in project["dependencies"]]


def installed(interpreter: Path) -> bool:
    done = subprocess.run([str(interpreter), "-I", "-c", INSTALLED, str(PROJECT_DIR), *dependency_names()],
                          capture_output=True, check=False)
    return done.returncode == 0


def environment(python: str | None) -> Path:
    """The interpreter of the project's environment: the one given, or .venv (created when missing,
    installed into unless this checkout and its dependencies already are)."""
    if python:
        return Path(python).absolute()  # printed in the registration: it must work from any folder
    venv = PROJECT_DIR / ".venv"
    interpreter = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    if not interpreter.exists():
        say(f"creating the environment {venv}")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    elif installed(interpreter):
        say(f"the environment {venv} is installed already")
        return interpreter
    say("installing local-rag-mcp and its dependencies (a minute or two the first time)")
    subprocess.run([str(interpreter), "-m", "pip", "install", "-qq", "--upgrade", "pip"], check=True)
    subprocess.run([str(interpreter), "-m", "pip", "install", "-qq", "-e", str(PROJECT_DIR)], check=True)
    return interpreter


def ollama_models(host: str) -> list[str] | None:
    """Model names Ollama has (`GET /api/tags`), or None when it does not answer."""
    try:
        with urllib.request.urlopen(host.rstrip("/") + "/api/tags", timeout=5) as response:
            return [str(m.get("name", "")) for m in json.loads(response.read()).get("models", [])]
    except (OSError, ValueError, urllib.error.URLError):
        return None


def has_model(names: list[str], model: str) -> bool:
    wanted = model if ":" in model.rsplit("/", 1)[-1] else model + ":latest"
    return any(name == wanted or name == model for name in names)


def openai_models(url: str, key: str | None) -> list[str] | None:
    """Model ids an OpenAI-compatible server lists (`GET <url>/models`; [] where it has no such
    route), or None when it does not answer (or refuses the key)."""
    request = urllib.request.Request(url.rstrip("/") + "/models",
                                     headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return [str(m.get("id", "")) for m in json.loads(response.read()).get("data", [])]
    except urllib.error.HTTPError as exc:
        return [] if exc.code == 404 else None
    except (OSError, ValueError, AttributeError):
        return None


def ensure_embedder(settings: Any) -> str | None:
    """None when the embedding server answers (and, for Ollama, has the model); otherwise what the
    user must do."""
    host, model = settings.ollama_host, settings.embed_model
    if settings.embed_api == "ollama":
        return ensure_model(host, model)
    if openai_models(host, settings.embed_api_key) is None:
        return (f"the embedding server at {host} does not answer (or refuses RAG_EMBED_API_KEY): start it with "
                f"{model!r} loaded, or set RAG_EMBED_URL to its base URL (e.g. http://127.0.0.1:1234/v1)")
    return None


# The embedding variables a registered server needs as ingest had them (the key as a reference to
# the shell's variable: never printed).
EMBED_VARIABLES = ("RAG_EMBED_API", "RAG_EMBED_URL", "OLLAMA_HOST", "RAG_EMBED_MODEL", "RAG_EMBED_PREFIXES",
                   "RAG_EMBED_DIMENSIONS")
KEY_VARIABLE = "RAG_EMBED_API_KEY"


def ensure_model(host: str, model: str) -> str | None:
    """None when Ollama answers and has the model; otherwise what the user must do."""
    names = ollama_models(host)
    if names is None:
        return (f"Ollama does not answer at {host}: start it (`ollama serve`, or the Ollama app) and run "
                f"`ollama pull {model}`, or set OLLAMA_HOST to where it runs")
    if has_model(names, model):
        return None
    if shutil.which("ollama") is None:
        return f"Ollama at {host} does not have {model!r}: run `ollama pull {model}`"
    say(f"pulling {model} into Ollama (once; a few hundred MB)")
    if subprocess.run(["ollama", "pull", model]).returncode != 0 or not has_model(ollama_models(host) or [], model):
        return f"`ollama pull {model}` did not succeed: run it yourself"
    return None


# Folder names that say nothing of whose documentation they hold: such a corpus is named with its
# parent too (~/src/fastapi/docs: fastapi-docs), so three projects' docs/ do not collide.
GENERIC_FOLDERS = frozenset({"docs", "doc", "documentation", "site", "website", "content", "pages", "src", "source",
                             "book", "manual", "wiki", "guide", "guides", "md", "markdown"})


def slug_of(*names: str) -> str:
    return "-".join(part for name in names if (part := re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")))[:40].strip("-")


def corpus_names(corpus: Path) -> list[str]:
    """The names a corpus may take, best first: its folder's (with its parent's when the folder's
    name is generic), then with its parent's, then numbered."""
    parent = corpus.parent.name if corpus.parent not in (Path.home(), Path(corpus.anchor)) else ""
    own = slug_of(corpus.name) or "docs"
    with_parent = slug_of(parent, corpus.name) or own
    first = with_parent if corpus.name.lower() in GENERIC_FOLDERS else own
    return list(dict.fromkeys([first, with_parent, *(f"{with_parent}-{n}" for n in range(2, 10))]))


def registered_corpora() -> dict[str, set[str]]:
    """The corpus folder (RAG_CORPUS_DIR, "" for none) of every server registered under each name in
    the clients' configurations this user can read: Claude Code's ~/.claude.json (user and
    project scopes) and Codex's ~/.codex/config.toml. What cannot be read counts as nothing."""
    import tomllib

    found: dict[str, set[str]] = {}

    def note(servers: object) -> None:
        for name, entry in (servers or {}).items() if isinstance(servers, dict) else ():
            env = entry.get("env") if isinstance(entry, dict) else None
            found.setdefault(str(name), set()).add(str((env or {}).get("RAG_CORPUS_DIR", "")) if isinstance(env, dict) else "")

    try:
        claude = json.loads((Path.home() / ".claude.json").read_text(encoding="utf-8"))
        note(claude.get("mcpServers"))
        for project in (claude.get("projects") or {}).values():
            note(project.get("mcpServers") if isinstance(project, dict) else None)
    except (OSError, ValueError, AttributeError):
        pass
    try:
        note(tomllib.loads((Path.home() / ".codex" / "config.toml").read_text(encoding="utf-8")).get("mcp_servers"))
    except (OSError, ValueError, AttributeError):
        pass
    return found


def corpus_name(corpus: Path, stores: Path, registered: dict[str, set[str]]) -> str:
    """The first of corpus_names that neither another corpus's store nor another corpus's
    registration (local-rag-<name>) already holds."""
    def free(name: str) -> bool:
        current = stores / name / "CURRENT.json"
        try:
            held = json.loads(current.read_text(encoding="utf-8")).get("corpus_dir") if current.is_file() else None
        except (OSError, ValueError, AttributeError):
            held = "?"
        others = registered.get(f"local-rag-{name}", set()) - {str(corpus)}
        return held in (None, str(corpus)) and not others

    names = corpus_names(corpus)
    return next((name for name in names if free(name)), names[-1])


def registration(python: Path, env: dict[str, str], name: str = "local-rag") -> str:
    server = PROJECT_DIR / "server.py"
    command = [str(python), str(server)]
    def shell(k: str, v: str) -> str:  # the key stays in the shell's variable, never on the screen
        return f'{k}="${k}"' if k == KEY_VARIABLE else shlex.quote(f"{k}={v}")

    claude_env = "".join(f" -e {shell(k, v)}" for k, v in env.items())
    codex_env = "".join(f" --env {shell(k, v)}" for k, v in env.items())
    toml_env = ""
    if env:
        pairs = ", ".join(f"{k} = {json.dumps(v if k != KEY_VARIABLE else '<your ' + k + '>')}" for k, v in env.items())
        toml_env = f"    env = {{ {pairs} }}\n"
    quoted = " ".join(shlex.quote(part) for part in command)
    http_env = "".join(f"{shell(k, v)} " for k, v in env.items())
    return (
        f"Register the server (stdio) with your agent, as {name}:\n\n"
        "  Claude Code (every directory: -s user; -e goes after the name):\n"
        f"    claude mcp add -s user {name}{claude_env} -- {quoted}\n"
        f"    claude mcp list        # expect: {name}: ... - ✔ Connected\n\n"
        "  Codex:\n"
        f"    codex mcp add{codex_env} {name} -- {quoted}\n"
        "  or in ~/.codex/config.toml:\n"
        f"    [mcp_servers.{name}]\n"
        f"    command = {json.dumps(str(python))}\n"
        f"    args = [{json.dumps(str(server))}]\n"
        f"{toml_env}"
        "    startup_timeout_sec = 30\n\n"
        "  Or over HTTP, one server for several clients (for a team's network, see the README):\n"
        f"    {http_env}{quoted} --http\n"
        f"    claude mcp add --transport http -s user {name} http://127.0.0.1:8765/mcp\n\n"
        "Then ask your agent something the documents answer; it calls search_corpus.\n"
        f"Re-index after editing the documents: {shlex.quote(str(python))} {shlex.quote(str(PROJECT_DIR / 'ingest.py'))}"
        + "".join(f" --{'corpus' if k == 'RAG_CORPUS_DIR' else 'store'} {shlex.quote(v)}" for k, v in env.items()
                  if k in ("RAG_CORPUS_DIR", "RAG_STORE_DIR"))
        + "\nOr let the server keep it fresh by itself: add -e RAG_WATCH=1 (Codex: --env RAG_WATCH=1) to the "
        "registration, or --watch after server.py.\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", help="docs folder to index (default: the sample corpus)")
    parser.add_argument("--store", help="where the index lives (default: ~/.local-rag-mcp/store for the sample "
                                        "corpus, ~/.local-rag-mcp/stores/<folder name> for your own)")
    parser.add_argument("--python", help="use this Python environment instead of creating .venv")
    args = parser.parse_args(argv)
    if sys.version_info < (3, 11):  # noqa: UP036 - run by any python3 on PATH, before anything is installed
        return fail(f"Python 3.11 or newer is needed; this is {sys.version.split()[0]}")
    # The settings as ingest and the server will read them (corpus_rules imports nothing installed).
    sys.path.insert(0, str(PROJECT_DIR))
    import corpus_rules

    try:
        settings = corpus_rules.load_settings()
    except corpus_rules.RagError as exc:
        return fail(f"{exc.message} ({exc.hint})")

    python = environment(args.python)
    without_ollama = ensure_embedder(settings)
    if without_ollama:
        say(f"{without_ollama}. Meanwhile the documents are indexed for keyword search only.")
    env: dict[str, str] = {}
    if settings.embed_api != "ollama":  # the registered server embeds queries where ingest did
        env = {name: os.environ[name].strip() for name in EMBED_VARIABLES if os.environ.get(name, "").strip()}
        if settings.embed_api_key:
            env[KEY_VARIABLE] = "(from the shell)"
    ingest = [str(python), str(PROJECT_DIR / "ingest.py")]
    name = "local-rag"
    if args.corpus:
        corpus = Path(args.corpus).expanduser().resolve()
        # One store and one registered name per corpus: the default store belongs to the sample corpus.
        slug = corpus_name(corpus, DEFAULT_STORE.parent / "stores", registered_corpora())
        name = f"local-rag-{slug}"
        store = Path(args.store).expanduser().resolve() if args.store else DEFAULT_STORE.parent / "stores" / slug
        env = {"RAG_CORPUS_DIR": str(corpus), "RAG_STORE_DIR": str(store), **env}
        ingest += ["--corpus", str(corpus), "--store", str(store)]
    elif args.store:
        env = {"RAG_STORE_DIR": str(Path(args.store).expanduser().resolve()), **env}
        ingest += ["--store", env["RAG_STORE_DIR"]]
    say("indexing: " + " ".join(shlex.quote(part) for part in ingest))
    code = subprocess.run(ingest).returncode
    store = Path(env.get("RAG_STORE_DIR", settings.store_dir))
    if code not in (0, 1, 2):  # stopped (130: Ctrl-C or SIGTERM) or killed (a negative signal)
        return fail(f"ingest was stopped (exit {code}); what it committed is kept: run this again to finish",
                    code if code > 0 else 1)
    if code == 2 and without_ollama and (store / "CURRENT.json").is_file():
        say("nothing new to index without Ollama; the index already built answers keyword searches")
    elif code == 2:
        return fail("ingest did nothing (see its message above); fix that and run this again")
    if nothing_indexed(store):
        return fail("nothing was indexed (ingest said what the folder holds, above): point --corpus at the "
                    "documentation folder, or set RAG_FORMATS, and run this again")
    if code == 1 and not without_ollama:
        say("some files failed to index (listed above); the rest is searchable")
    print(registration(python, env, name))
    if without_ollama:
        print(f"Searches answer from the keyword index for now. To add semantic search: {without_ollama}; then "
              "run this again (or the re-index command above): it embeds only the waiting passages.")
    # As ingest: 1 when not everything is indexed as asked (a file failed, or no Ollama for vectors).
    return 1 if code == 1 or without_ollama else 0


def nothing_indexed(store: Path) -> bool:
    """The store's live index holds no document (what a search would answer index_empty on)."""
    try:
        return json.loads((store / "CURRENT.json").read_text(encoding="utf-8"))["stamp"]["files"] == 0
    except (OSError, ValueError, KeyError, TypeError):
        return False


if __name__ == "__main__":
    sys.exit(main())
