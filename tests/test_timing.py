"""The benchmarks' shared helpers that need no GPU: the heartbeat, the rows' lines and tables, a report's heading
and JSON, a failed call's entry, --tokens and the integer options."""
import argparse
import json
import re
import sys
import time

import pytest

from moe_ep import timing
from moe_ep.timing import (GRAPH_CALLS, Progress, benchmark_args, burst_after_barrier_us, failure, heading,
                           interleaved_median_us, markdown_table, round_order, row_line, token_counts, write_json)


def test_heartbeat_names_a_block_that_runs_long(capsys):
    with Progress("tile loop, a tp2 AG", every=0.1) as p:
        time.sleep(0.25)
        p.step("tma")
        time.sleep(0.3)
    lines = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"\.\.\. still on tile loop, a tp2 AG after \d s", lines[0]), lines
    assert re.fullmatch(r"\.\.\. still on tile loop, a tp2 AG: tma after \d s", lines[-1]), lines
    time.sleep(0.15)
    assert capsys.readouterr().out == "", "the heartbeat must stop with its block"


def test_heartbeat_is_silent_for_a_short_block_and_stops_on_errors(capsys):
    with Progress("quick", every=0.2):
        pass
    with pytest.raises(RuntimeError), Progress("failing", every=0.05):
        raise RuntimeError("a kernel failed")
    time.sleep(0.15)
    assert capsys.readouterr().out == ""


def test_report_prints_the_line_and_its_seconds(capsys):
    with Progress("row", every=10) as p:
        time.sleep(0.05)
    p.report("tokens 128, dispatch_us 19.2")
    out = capsys.readouterr().out
    assert out.startswith("tokens 128, dispatch_us 19.2  [0.") and out.endswith(" s]\n")


def test_row_line_and_table_format_alike():
    row = {"shape": "a tp2 AG", "M": 4096, "cublas_us": 512.345, "tma_us": "ValueError: no"}
    assert row_line(row, ["shape", "M", "cublas_us", "pointer_us", "tma_us"]) == \
        "shape a tp2 AG, M 4096, cublas_us 512, tma_us ValueError: no"
    assert markdown_table([row], ["shape", "cublas_us", "pointer_us"]).splitlines()[-1] == "| a tp2 AG | 512.3 | - |"


def test_heading_and_json_of_a_report(tmp_path):
    meta = {"world": 4, "device": "NVIDIA H200", "date": "2026-11-27 05:00 UTC", "torch": "2.11.0", "triton": "3.6.0"}
    assert heading(meta) == "4x NVIDIA H200, 2026-11-27 05:00 UTC, torch 2.11.0, triton 3.6.0"
    write_json(argparse.Namespace(out=str(tmp_path)), "rows.json", {**meta, "rows": [{"M": 128}]})
    assert json.loads((tmp_path / "rows.json").read_text()) == {**meta, "rows": [{"M": 128}]}


def test_failure_names_the_error_and_its_first_line():
    assert failure(ValueError("M=3 exceeds max_rows\nconstruct it")) == "failed: ValueError: M=3 exceeds max_rows"
    assert failure(RuntimeError()) == "failed: RuntimeError: "


def test_token_counts():
    assert token_counts("128,4096") == (128, 4096)
    assert token_counts("16") == (16,)
    for text in ("", "0", "128,", "a", "-4", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError, match="positive token counts"):
            token_counts(text)


def test_integer_options_show_their_default_and_refuse_other_values(monkeypatch, capsys):
    numbers = {"graph-rows": (512, "rows with CUDA graphs")}
    monkeypatch.setattr(sys, "argv", ["bench_x.py", "--help"])
    with pytest.raises(SystemExit):
        benchmark_args("doc", iters=1, numbers=numbers)
    assert "--graph-rows N rows with CUDA graphs (default: 512)" in " ".join(capsys.readouterr().out.split())
    monkeypatch.setattr(sys, "argv", ["bench_x.py", "--graph-rows", "many"])
    with pytest.raises(SystemExit):
        benchmark_args("doc", iters=1, numbers=numbers)
    assert "argument --graph-rows: invalid int value: 'many'" in capsys.readouterr().err


def test_interleaved_rounds_vary_who_goes_first_and_who_follows_whom():
    n, rounds = 5, 40
    calls = []
    fns = [lambda i=i: calls.append(i) for i in range(n)]
    medians = interleaved_median_us(fns, rounds, warmup=1, time_us=lambda fn: (fn(), float(calls[-1]))[1])
    assert medians == [float(i) for i in range(n)], "each median is of its own callable's times"
    assert calls[:n] == list(range(n)), "the warm-up calls each once, in order"
    orders = [calls[n + r * n: n + (r + 1) * n] for r in range(rounds)]
    assert all(sorted(order) == list(range(n)) for order in orders), "a round calls each once"
    assert orders == [round_order(r, n) for r in range(rounds)], "the same order on every rank: seeded by the round"
    assert {order[0] for order in orders} == set(range(n)), "each goes first in some round"
    followers = {i: {order[order.index(i) + 1] for order in orders if order[-1] != i} for i in range(n)}
    assert all(len(after) > 1 for after in followers.values()), f"none always follows the same one: {followers}"


def test_a_burst_is_its_calls_in_a_row_after_one_barrier_timed_per_call(monkeypatch):
    """burst_after_barrier_us: one barrier, then GRAPH_CALLS calls inside one timed span, over GRAPH_CALLS."""
    seen = []
    monkeypatch.setattr(timing.dist, "barrier", lambda group=None: seen.append(("barrier", group)))
    monkeypatch.setattr(timing, "call_us", lambda fn: (seen.append("timed"), fn(), 70.0)[2])
    assert burst_after_barrier_us(lambda: seen.append("call"), group="g") == 70.0 / GRAPH_CALLS
    assert seen == [("barrier", "g"), "timed"] + ["call"] * GRAPH_CALLS
