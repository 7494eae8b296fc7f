"""tools/bench.py --quick keeps running end to end (no timing assertions: machines differ; the
figures that count something, or check that a run went through, must meet their goals)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.heavy, pytest.mark.process]  # a file over a minute of real processes: `pytest --all` only, scheduled first

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "tools" / "bench.py"

# Every figure of issue 6 that --quick measures (at 1k chunks), by the id prefix bench.py gives it.
EXPECTED = (
    "handshake.median_s",
    "stdio.roundtrip_p50_ms",
    "cold.first_search_s@",
    "cold.handshake_s@",
    "cold.first_call_s@",
    "cold.keyword_only@",
    "cold.hybrid_s@",
    "cold.hnsw_load_s@",
    "search.hybrid.p50_ms@",
    "search.hybrid.p95_ms@",
    "search.vector.p50_ms@",
    "search.vector.p95_ms@",
    "search.keyword.p50_ms@",
    "search.keyword.p95_ms@",
    "search.raw_chroma_p50_ms@",
    "search.limit_p50_ms@",
    "ingest.build_s@",
    "ingest.throughput@",
    "reingest.noop_s@",
    "reingest.noop_calls@",
    "memory.server_peak_rss_mb@",
    "memory.ingest_peak_rss_mb@",
    # issue 11: a slow embedder, --watch, a no-op re-ingest with scope rules
    "slow.failures@",
    "slow.build_s@",
    "slow.chunks_per_s@",
    "slow.embed_calls@",
    "slow.largest_call@",
    # issue 30: embedding calls in flight, on one host of S slots and on two hosts
    "slots.chunks_per_s_1@",
    "slots.chunks_per_s_2@",
    "slots.chunks_per_s_4@",
    "slots.chunks_per_s_8@",
    "slots.chunks_per_s_2_hosts@",
    "watch.latency_p50_s@",
    "watch.latency_p95_s@",
    "watch.sigint_exit@",
    "reingest.noop_rules_s@",
    # issue 14: each distinct text embedded once
    "reuse.full_embedded@",
    "reuse.edit_embedded@",
    "reuse.rename_embedded@",
    "reuse.rename_s@",
    # issue 12: the HTTP doors and the CLI
    "http.bare_roundtrip_p50_ms",
    "http.bridge.p50_ms@",
    "http.mcp_jsonrpc.p50_ms@",
    "http.mcp_jsonrpc_2026.p50_ms@",
    "http.mcp.p50_ms@",
    "http.health_p50_ms",
    "http.throughput@",
    "http.throughput_serial_embedder@",
    "http.sigterm_exit",
    "cli.search_cold_s@",
)
# Figures compared with a limit measured in the same run carry the limit and the ratio too.
WITH_LIMIT = ("handshake.median_s", "search.hybrid.p50_ms@", "ingest.throughput@", "watch.latency_p50_s@",
              "reingest.noop_rules_s@", "reuse.full_embedded@", "http.bridge.p50_ms@", "http.mcp_jsonrpc.p50_ms@",
              "http.mcp_jsonrpc_2026.p50_ms@", "http.throughput@", "slots.chunks_per_s_2@", "slots.chunks_per_s_8@",
              "slots.chunks_per_s_2_hosts@")
# Goals about counts and outcomes, not speed: they hold on any machine.
MUST_PASS = ("slow.failures@", "watch.sigint_exit@", "reuse.full_embedded@", "reuse.edit_embedded@",
             "reuse.rename_embedded@", "http.sigterm_exit")
# Durations and rates: a zero would mean nothing was timed.
POSITIVE = ("slots.chunks_per_s_1@", "slots.chunks_per_s_2_hosts@", "http.bare_roundtrip_p50_ms", "http.bridge.p50_ms@", "http.mcp_jsonrpc.p50_ms@",
            "http.mcp_jsonrpc_2026.p50_ms@", "http.mcp.p50_ms@",
            "http.health_p50_ms",
            "http.throughput@", "cli.search_cold_s@", "cold.hybrid_s@", "cold.hnsw_load_s@")


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@pytest.mark.skipif(not (ROOT / "server.py").is_file(), reason="server.py is not there yet")
def test_quick_bench_runs_and_reports_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "bench-results.json"
    done = subprocess.run([sys.executable, str(BENCH), "--quick", "--out", str(out)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr[-4000:]}"
    results = json.loads(out.read_text(encoding="utf-8"))
    assert results["quick"] is True and results["error"] is None
    for key in ("nproc", "cpu_model", "ram_gb", "python"):
        assert results["machine"][key], key

    figures = {f["id"]: f for f in results["figures"]}
    for prefix in EXPECTED:
        matches = [f for fid, f in figures.items()
                   if fid == prefix or (prefix.endswith("@") and fid.startswith(prefix))]
        assert matches, f"no figure {prefix!r} in {sorted(figures)}"
        for figure in matches:
            assert _number(figure["value"]), figure
            if prefix in WITH_LIMIT:
                assert _number(figure["limit"]) and figure["limit"] > 0, figure
                assert _number(figure["ratio"]), figure
                assert figure["pass"] in (True, False), figure
            if prefix in MUST_PASS:
                assert figure["pass"] is True, figure
            if prefix in POSITIVE:
                assert figure["value"] > 0, figure
    # --quick measures at 1k chunks, the slow embedders at 200 (at 20 ms per text, 1k would take 20 s).
    assert all(f["size_chunks"] in (None, 200 if f["id"].startswith(("slow.", "slots.")) else 1000)
               for f in figures.values())
    details = results["details"]
    assert details["watch"]["misses"] == 0 and len(details["watch"]["latencies_s"]) == 5, details["watch"]
    assert details["noop_with_rules"]["scope_as_written"] is True, details["noop_with_rules"]
    assert details["slow_embedder"]["largest_call"] > 0, details["slow_embedder"]
    http = details["http"]
    assert http["sigterm_exits"] == [0, 0, 0], http
    assert (http["bridge"]["n"] == http["mcp_jsonrpc"]["n"] == http["mcp_jsonrpc_2026"]["n"] == http["mcp"]["n"] > 0
            and http["health"]["n"] > 0), http
    for rate in (http["throughput"], http["throughput_serial_embedder"]):
        assert rate["single_per_s"] > 0 and rate["concurrent_per_s"] > 0, rate
        assert rate["texts_embedded"] >= rate["searches"], rate  # every search waited for the embedder
    assert len(details["cli"]["walls_s"]) >= 3 and min(details["cli"]["walls_s"]) > 0, details["cli"]

    # The table on stdout shows the same figures, and the machine it ran on.
    assert "| Figure | Value | Limit | Ratio | Goal | Result |" in done.stdout
    assert "Machine:" in done.stdout
    assert done.stdout.count("\n| ") >= len(EXPECTED)


def test_scale_goals_judge_the_largest_size_against_its_own_run() -> None:
    sys.path.insert(0, str(ROOT / "tools"))
    import bench

    def row(chunks: int, p50: float, p95: float, rss: float) -> dict[str, float]:
        return {"chunks": chunks, "hybrid_p50_ms": p50, "hybrid_p95_ms": p95, "keyword_p50_ms": p50 / 2,
                "keyword_p95_ms": p95 / 2, "server_rss_mb": rss}

    assert bench.scale_goals([row(100_000, 10, 20, 300)], 256) == []  # no 1M row: nothing to judge
    judged = dict(bench.scale_goals([row(100_000, 10, 20, 300), row(1_000_000, 12, 50, 1400)], 256))
    assert [met for _, met in judged.items()] == [False, True, True, True, True]
    assert any("hybrid p95 at 1M: 50.0 ms" in what for what in judged)
    flat = dict(bench.scale_goals([row(100_000, 10, 20, 300), row(1_000_000, 13, 30, 1600)], None))
    assert [met for _, met in flat.items()] == [True, True, False, False]  # x1.3 is not flat; no RSS goal without --dims
    with_limits = [{**row(100_000, 10, 20, 300), "limit_p50_ms": 4.0}, {**row(1_000_000, 13, 30, 1600), "limit_p50_ms": 5.4}]
    said = [what for what, _ in bench.scale_goals(with_limits, None) if "p50" in what]
    assert all(what.endswith("(goal: flat, <= x1.25; the limit grew x1.35)") for what in said), said
