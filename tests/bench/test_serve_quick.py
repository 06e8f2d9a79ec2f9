"""`python -m bench.serve` end to end on the tiny model, each mode: it starts the real server,
drives it, runs the engine alone on the same workload, and writes a result file whose figures
are consistent with the workload (every token counted, no errors, ratios present)."""

import json
import subprocess
import sys

import pytest


def run(tmp_path, *args: str, new_tokens: int = 12) -> dict:
    out = subprocess.run([sys.executable, "-m", "bench.serve", "--model", "tiny-random", "--prompt-len", "24",
                          "--new-tokens", str(new_tokens), "--out", str(tmp_path), *args],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    (path,) = tmp_path.glob("serve-cpu-tiny-random-*.json")
    return json.loads(path.read_text())


def test_concurrency_mode_counts_every_token_and_compares_with_the_engine(tmp_path):
    # long enough streams that the all-streams-decoding window holds tokens on a slow machine too
    # (chunks coalesce when the client falls behind, and the window needs 8 tokens per stream)
    res = run(tmp_path, "--n", "1", "3", "--max-decode-stall-ms", "200", "--rounds", "2", new_tokens=64)
    assert [r["n"] for r in res["rows"]] == [1, 3]
    assert res["workload"]["max_decode_stall_ms"] == 200
    for row in res["rows"]:
        # two rounds of the engine alone then served: the row's figures are the lower ratio's round
        rounds = row["rounds"]
        assert len(rounds) == 2 and row["served_over_engine_decode_rounds"] == [r["ratio"] for r in rounds]
        for r in rounds:
            assert r["ratio"] == pytest.approx(r["served_decode_tok_s"] / r["engine_decode_tok_s"])
        median = min(rounds, key=lambda r: r["ratio"])
        assert row["served_over_engine_decode"] == median["ratio"]
        assert (row["decode_tok_s"], row["engine"]["decode_tok_s"]) == (median["served_decode_tok_s"],
                                                                        median["engine_decode_tok_s"])
        assert row["errors"] == 0 and row["requests"] == row["n"]
        assert row["output_tokens"] == 64 * row["n"]  # token_ids of every chunk, counted
        assert row["engine"]["decode_tok_s"] > 0 and row["decode_tok_s"] > 0
        assert row["served_over_engine_decode"] == pytest.approx(row["decode_tok_s"] / row["engine"]["decode_tok_s"])
        assert 0 < row["ttft_s"]["p50"] <= row["ttft_s"]["p99"]
        assert row["served_over_engine_ttft"] == pytest.approx(row["ttft_s"]["p50"] / row["engine"]["ttft_p50_s"])
        assert 0 < row["server_ttft_mean_s"] <= row["ttft_s"]["mean"]
        lag = row["event_loop_lag"]
        assert lag["samples"] > 0
        phases = lag["late_by_phase"]
        assert set(phases) == {"arriving", "all_decoding", "ending"}
        assert all(0 <= c["over_25ms"] <= c["over_10ms"] for c in phases.values())


def test_the_median_round_is_the_lower_middle_one():
    from bench.serve import median_round

    def rounds(*ratios):
        return [{"ratio": x, "served_decode_tok_s": 1.0} for x in ratios]

    assert median_round(rounds(1.2, 0.8, 1.0)) == 2
    assert median_round(rounds(0.9, 1.1)) == 0
    assert median_round([{"ratio": None, "served_decode_tok_s": v} for v in (5.0, 3.0, 4.0)]) == 2


def test_session_mode_reuses_each_conversations_history(tmp_path):
    res = run(tmp_path, "--mode", "sessions", "--sessions", "3", "--turns", "3", "--turn-tokens", "10")
    (row,) = res["rows"]
    assert row["errors"] == 0 and row["requests"] == 9
    turns = row["per_turn"]
    assert [t["prompt_tokens_mean"] for t in turns] == [10, 10 + 12 + 10, 10 + 2 * (12 + 10)]
    # everything but the last sampled token of the previous turn is already in the session's row
    assert [t["cached_tokens_mean"] for t in turns] == [0, 10 + 12 - 1, 10 + 2 * (12 + 10) - 11]


def test_late_wake_ups_are_counted_in_the_phase_they_happened():
    from bench.serve import LagWatch

    watch = LagWatch("http://unused", period=1.0)
    # cumulative late samples (> 10 ms, > 25 ms) seen at each poll
    watch.polls = [(0.0, {"0.01": 0, "0.025": 0}), (1.0, {"0.01": 3, "0.025": 1}), (2.0, {"0.01": 3, "0.025": 1}),
                   (3.0, {"0.01": 5, "0.025": 1}), (4.0, {"0.01": 9, "0.025": 4})]
    # the last stream's first token at 1.2 s, the first stream's last at 3.2 s
    streams = [{"error": None, "chunks": [(0.4, 1), (3.2, 1)]}, {"error": None, "chunks": [(1.2, 1), (3.9, 1)]}]
    assert watch.phases(streams) == {"arriving": {"over_10ms": 3, "over_25ms": 1},
                                     "all_decoding": {"over_10ms": 2, "over_25ms": 0},
                                     "ending": {"over_10ms": 4, "over_25ms": 3}}
