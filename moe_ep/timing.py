"""Measuring on the GPU, for the benchmarks, the tutorials, EPAllToAll.measure_crossover and AsyncTP's
choice of path: medians of CUDA-event times (warm-up excluded; interleaved where callables are compared),
the same in CUDA graphs of back-to-back calls, the options and setup every benchmark shares, where it ran,
its rows as they come (with a heartbeat while one takes long) and its table; and, for host time measured on a
CPU, caches made cold as a GPU host's are for an eager call (``cold_caches``)."""
import argparse
import datetime
import functools
import json
import os
import random
import statistics
import sys
import threading
import time

import numpy as np
import torch
import torch.distributed as dist
import triton

from . import runtime

SWEEP_BYTES = 96 << 20      # what cold_caches writes through: three times a 32 MB last-level cache


def call_us(fn) -> float:
    """Microseconds of one call of fn(), timed alone with CUDA events (start, the call, end, synchronize)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3


def call_after_barrier_us(fn, group=None) -> float:
    """``call_us(fn)`` begun on every rank of `group` together: after a barrier of the group (host-blocking,
    so no rank's clock starts while another still runs its last call)."""
    dist.barrier(group=group)
    return call_us(fn)


@functools.cache
def _sweep() -> np.ndarray:
    return np.ones(SWEEP_BYTES, dtype=np.uint8)


def cold_caches() -> None:
    """Evict this CPU's caches (a write to every 64-byte line of SWEEP_BYTES), so that the host work that follows
    runs from memory, as an eager call timed alone after a barrier does on the GPU hosts: there the same Python
    takes 8-10x its time in a tight loop (benchmarks/bench_host.py, benchmarks/NOTES.md)."""
    _sweep()[::64] += 1


def median_us(fn, iters: int = 50, warmup: int = 5, before=None) -> float:
    """Median microseconds of fn(), each call timed alone with CUDA events after `warmup` calls;
    `before()`, if given, runs ahead of each timed call, outside the timing (a barrier, say)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if before is not None:
            before()
        times.append(call_us(fn))
    return statistics.median(times)


def interleaved_median_us(fns: list, rounds: int, warmup: int = 1, time_us=call_us) -> list[float]:
    """Median microseconds of each of `fns` (results dropped), timed interleaved so that drift (clocks, a
    collective's first calls of a size, host jitter) falls on all of them alike instead of deciding between
    them: `warmup` untimed calls of each, then `rounds` rounds of one call of each, every call timed alone
    by `time_us(fn)` -> us, in ``round_order(r, len(fns))``: none always goes first, and none always
    follows the same one (whatever state a call leaves, the next call's time does not always carry it)."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times = [[] for _ in fns]
    for r in range(rounds):
        for i in round_order(r, len(fns)):
            times[i].append(time_us(fns[i]))
    return [statistics.median(t) for t in times]


def round_order(r: int, n: int) -> list[int]:
    """The order of round `r` of n interleaved callables: a permutation drawn from a generator seeded by r,
    the same on every rank (callables that are collectives must run in one order everywhere)."""
    return random.Random(r).sample(range(n), n)


GRAPH_CALLS = 10            # back-to-back calls in each CUDA graph of graph_times (and of AsyncTP's graph timings)


def failure(e: Exception) -> str:
    """What a benchmark's column records for a call that raised: 'failed: <type>: <its message's first line>'."""
    return f"failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:80]}"


def in_a_row(fn, calls: int = GRAPH_CALLS) -> None:
    """`calls` calls of fn() back to back, results dropped."""
    for _ in range(calls):
        fn()


def capture(fn, calls: int = GRAPH_CALLS) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `calls` back-to-back calls of fn(). Where the capture fails, the device is synchronized
    and the exception of the call that spoiled the capture is raised (not the capture's end's, which follows it)."""
    graph, error = torch.cuda.CUDAGraph(), None
    try:
        with torch.cuda.graph(graph):
            try:
                in_a_row(fn, calls)
            except Exception as e:
                error = e
                raise
    except Exception as ended:
        torch.cuda.synchronize()
        raise error or ended
    return graph


def failed_on_any_rank(failed: dict, group=None) -> dict:
    """What failed on any rank of `group` (name -> why: this rank's `failed`, and every rank's, gathered; this
    rank's reasons as they are, another rank's with '(rank R)'), the same names on every rank. Collective."""
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, failed, group=group)
    merged = dict(failed)
    for rank, theirs in enumerate(everyone):
        for name, why in theirs.items():
            merged.setdefault(name, f"{why} (rank {rank})")
    return merged


def graph_times(timed: list, iters: int) -> dict:
    """`<x>_graph_us` of each (`<x>_us`, fn) of `timed` (warmed up): a CUDA graph of GRAPH_CALLS back-to-back
    calls of fn() captured for each (``capture``), on every rank in the same order, the replays timed as the
    eager calls (interleaved, each after a barrier), each median over GRAPH_CALLS. A column whose capture failed
    on any rank is not replayed: it holds the failure (another rank's with '(rank R)'). The graphs are freed on
    return."""
    graphs, failed = {}, {}
    for key, fn in timed:
        name = key.removesuffix("_us") + "_graph_us"
        try:
            graphs[name] = capture(fn)
        except Exception as e:            # a path that cannot be captured is reported, not fatal
            failed[name] = failure(e)
        dist.barrier()                    # every rank after every capture: the collectives stay in step
    failed = failed_on_any_rank(failed)
    graphs = {name: graph for name, graph in graphs.items() if name not in failed}
    medians = interleaved_median_us([graph.replay for graph in graphs.values()], iters, 1, call_after_barrier_us)
    return {**failed, **{name: t / GRAPH_CALLS for name, t in zip(graphs, medians)}}


def burst_after_barrier_us(fn, group=None) -> float:
    """Microseconds a call of GRAPH_CALLS calls of fn() made back to back (``in_a_row``), begun on every rank of
    `group` together (after a barrier), one pair of CUDA events around them all: how calls in a row run (a
    training step's, a model's eager layers), the host ahead of the GPU wherever a call's host time is below its
    GPU time."""
    dist.barrier(group=group)
    return call_us(functools.partial(in_a_row, fn)) / GRAPH_CALLS


def benchmark_args(doc: str, iters: int, tokens: tuple[int, ...] | None = None,
                   numbers: dict[str, tuple[int, str]] | None = None, **flags: str) -> argparse.Namespace:
    """Parse --out DIR, --iters N (default `iters`), --tokens N,N,... (token counts per rank, default
    `tokens`; no such option when None), the integer options `numbers` (name -> (default, help)) and the
    boolean `flags` (name -> help), make --out, and start torch.distributed with one GPU per process; exit
    when no GPU is visible or when ranks share a GPU.
    args.started: when this was called (``finish`` prints the wall time since)."""
    started = time.perf_counter()
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/out")
    parser.add_argument("--iters", type=int, default=iters)
    if tokens is not None:
        parser.add_argument("--tokens", type=token_counts, default=tokens, metavar="N,N,...",
                            help=f"token counts per rank (default: {','.join(map(str, tokens))})")
    for name, (default, text) in (numbers or {}).items():
        parser.add_argument(f"--{name}", type=int, default=default, metavar="N", help=f"{text} (default: {default})")
    for name, text in flags.items():
        parser.add_argument(f"--{name}", action="store_true", help=text)
    args = parser.parse_args()
    args.started = started
    name = os.path.basename(sys.argv[0])
    if not torch.cuda.is_available():
        raise SystemExit(f"{name} needs GPUs")
    skipped = why_untimed(torch.device("cuda"))
    if skipped is not None:
        raise SystemExit(f"{name} refuses shared-GPU mode: {skipped}; run one rank per GPU")
    runtime.init_distributed()
    os.makedirs(args.out, exist_ok=True)
    return args


def token_counts(text: str) -> tuple[int, ...]:
    """'128,4096' -> (128, 4096): positive integers, comma-separated (the type of --tokens)."""
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected positive token counts like 128,4096, got {text!r}")
    return counts


def write_json(args: argparse.Namespace, name: str, data: dict) -> None:
    """`data` written to `name` under --out by rank 0 (the only process when torch.distributed is not started;
    the other ranks write nothing). The benchmarks rewrite their JSON as rows come in: a cut run keeps them."""
    if on_rank0():
        with open(os.path.join(args.out, name), "w") as f:
            json.dump(data, f, indent=1)


def heading(meta: dict) -> str:
    """A report's first words, from ``environment``'s dict: '<W>x <device>, <date>, torch <v>, triton <v>'."""
    return f"{meta['world']}x {meta['device']}, {meta['date']}, torch {meta['torch']}, triton {meta['triton']}"


def write_report(args: argparse.Namespace, name: str, text: str) -> None:
    """A benchmark's report `text` (its tables) written to `name` under --out and printed (by the rank that
    calls it: rank 0 of a distributed run)."""
    with open(os.path.join(args.out, name), "w") as f:
        f.write(text)
    print(text)


def finish(args: argparse.Namespace) -> None:
    """Rank 0 prints the benchmark's wall time since ``benchmark_args``; then torch.distributed ends."""
    if on_rank0():
        print(f"{os.path.basename(sys.argv[0])}: done in {time.perf_counter() - args.started:.0f} s", flush=True)
    runtime.finalize_distributed()


def on_rank0() -> bool:
    """Whether this process prints: rank 0, or the only process when torch.distributed is not started."""
    return not dist.is_initialized() or dist.get_rank() == 0


HEARTBEAT_S = 30.0     # a block that runs longer than this says what it is on, this often


class Progress:
    """``with Progress(label) as p:`` around one row's measurement. While the block runs, rank 0 prints
    '... still on <label> after N s' every `every` seconds (flushed, from a daemon thread), so that a
    slow compile or a hung kernel names itself. ``p.step(name)`` names the part the block is on (the
    heartbeat then says '<label>: <name>'); ``p.report(text)`` prints a finished row's line (or a few
    rows' lines) on rank 0 with the seconds the block took."""

    def __init__(self, label: str, every: float = HEARTBEAT_S):
        self.label, self.on, self.every = label, label, every
        self.started = time.perf_counter()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True)

    def _beat(self) -> None:
        while not self._done.wait(self.every):
            print(f"... still on {self.on} after {self.seconds:.0f} s", flush=True)

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.started

    def step(self, name: str) -> None:
        self.on = f"{self.label}: {name}"

    def report(self, text: str) -> None:
        if on_rank0():
            print(f"{text}  [{self.seconds:.1f} s]", flush=True)

    def __enter__(self) -> "Progress":
        if on_rank0():
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()


def why_untimed(device: torch.device) -> str | None:
    """Why timings taken on `device` in this job would mislead, or None when they would not."""
    if device.type != "cuda":
        return "gloo on CPU says nothing about GPU speed"
    per_gpu = runtime.ranks_per_gpu()
    if per_gpu > 1:
        return f"{per_gpu} ranks share each GPU, so times say nothing about NVLink or one GPU's speed"
    return None


def environment() -> dict:
    """Where and how a benchmark ran: device, world size, date, torch and triton versions, its command line."""
    return {"device": torch.cuda.get_device_name(), "world": dist.get_world_size(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "torch": torch.__version__, "triton": triton.__version__,
            "command": " ".join([os.path.relpath(sys.argv[0]), *sys.argv[1:]])}


# Dense peaks of the GPUs the benchmarks quote floors for, by a word of the device's name: bf16 and FP8
# tensor-core TFLOP/s (no sparsity), HBM TB/s and NVLink GB/s in each direction (18 links of 25 GB/s),
# from NVIDIA's H100 SXM and H200 datasheets.
PEAKS = {"H200": dict(bf16=989.0, fp8=1979.0, hbm=4.8, nvlink=450.0),
         "H100": dict(bf16=989.0, fp8=1979.0, hbm=3.35, nvlink=450.0)}


def _peaks() -> dict | None:
    name = torch.cuda.get_device_name()
    return next((p for word, p in PEAKS.items() if word in name), None)


def floor_us(flops: float, moved_bytes: float, precision: str = "bf16") -> float | None:
    """The least time this GPU can take for `flops` tensor-core operations in `precision` ("bf16" or
    "fp8") and `moved_bytes` of HBM traffic, each at its datasheet peak: the larger of the two, in us.
    None on a GPU PEAKS does not list."""
    peaks = _peaks()
    if peaks is None:
        return None
    return max(flops / peaks[precision] / 1e6, moved_bytes / peaks["hbm"] / 1e6)


def link_floor_us(link_bytes: float, rate_GBps: float | None = None) -> float | None:
    """The least time `link_bytes` take over this GPU's links in one direction, in us: at `rate_GBps`, or
    at the datasheet's NVLink peak (None on a GPU PEAKS does not list)."""
    if rate_GBps is None:
        peaks = _peaks()
        if peaks is None:
            return None
        rate_GBps = peaks["nvlink"]
    return link_bytes / rate_GBps / 1e3


def cell(value, fmt: str) -> str:
    """One entry of a table or a row's line: a float as `fmt`, anything else as str."""
    return format(value, fmt) if isinstance(value, float) else str(value)


def markdown_table(rows: list[dict], cols: list[str], fmt: str = ".1f") -> str:
    """A markdown table of `cols` of every row; floats as `fmt`, missing entries as '-'."""
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in rows:
        lines.append("| " + " | ".join(cell(row.get(c, "-"), fmt) for c in cols) + " |")
    return "\n".join(lines)


def row_line(row: dict, cols: list[str], fmt: str = ".3g") -> str:
    """A row as one readable line, 'col value, ...' over those of `cols` it has (floats as `fmt`): what a
    benchmark prints as each row is measured."""
    return ", ".join(f"{c} {cell(row[c], fmt)}" for c in cols if c in row)
