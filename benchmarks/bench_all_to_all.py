"""EP dispatch/combine: moe_ep's NVSHMEM kernels against NCCL, in one run.

    bash launch.sh benchmarks/bench_all_to_all.py --out OUTDIR [--tokens N,N,...] [--sweep] [--breakdown]
                                                  [--crossover] [--one-object] [--puts] [--formats]
                                                  [--num-sms N]
    python benchmarks/bench_all_to_all.py --host-only       # any machine, CPU included

Model: hidden 7168, 256 experts, top-8 (DeepSeek-V3 shape), FP8 dispatch (per-128 scales), bf16
combine. Settings (--tokens, tokens per rank): decode (16, 128, 512) and prefill (4096) by default,
every column below for each; 24 s on one H200 with a warm compile cache (--tokens 128,4096: 23 s warm,
40 s cold; each with the launch). Timings of ours:
  graph     a CUDA graph of 10 back-to-back calls, replayed after a barrier; median time / 10
            (dispatch: of mode "auto", and of "decode" and "prefill" each, where the crossover shows)
  eager     one call after a barrier, CUDA events; median (dispatch: of mode "auto", and of each mode)
  host      CPU time from entering a call to its return, with the GPU busy; median of 200, warm-up excluded
  front     the same with the protocol's launches left out: the front's own share (checks, slot,
            handle, views); host - front is what the launches cost
  kernels   mean device time of our kernels per call (one launch, or send and receive), from the profiler,
            each call after a barrier; across GPUs it holds the wait for the peers' start too
and, in the same process, eager:
  nccl       what a plain PyTorch user writes: quantize, pack each token once per destination rank,
             exchange counts (one host sync), one all_to_all_single of packed rows, index work to
             put rows in expert order (combine: the weighted sums per (token, rank), one
             all_to_all_single back, an index_add)
  reference  moe_ep.reference, the test oracle (all_to_all_single of (token, expert) rows)
Floors: `floor_us` is the time the bytes an op must move through this rank's HBM take at the GPU's
datasheet peak (moe_ep.routing.hbm_bytes, counted from every rank's routing of the setting: x read, rows
staged and read back, each hit's row written to its expert; combine: each hit's expert row read, the
per-rank partial sums staged and read back, y written; timing.floor_us). On several ranks
`link_floor_us` is the time the bytes it must move over this GPU's links take at NVLink's datasheet peak
in one direction (moe_ep.routing.link_bytes: each token once per other rank its experts live on, its FP8
row, scales, ids and weights, or its bf16 partial back; the busier direction; timing.link_floor_us), and
`copy_floor_us` the same at the rate the copy engines reach on this machine, measured first
(peer_copy_GBps: every rank writing to every other at once). `x_floor` = graph time / the larger of
floor_us and link_floor_us (1 would be at the floor). Link GB/s: the link bytes over the graph time.
DeepEP: where bench_deepep.py wrote deepep_<world>ranks.json into the same --out (a job of its own, run
first), its times join each setting's row with ours over them (beside_deepep), in a table of their own.
`--breakdown` reruns the decode
settings (up to 512 tokens) with device timestamps and prints, per rank, where a call spends its time.
`--sweep` also times 32 to 2048 tokens per rank (graph only) and draws latency.png. `--crossover` first
builds an object for the largest --tokens and reports where its eager dispatches of the decode tiles
stop beating the prefill tiles (EPAllToAll.measure_crossover: the bound of mode "auto" it sets).
`--formats` also times dispatch in each payload format (bf16, fp8, fp8 with UE8M0 scales, MXFP8, NVFP4) at
each --tokens, on objects of their own, with a row's bytes on the wire and the bytes leaving each GPU.
`--one-object` times every setting on one object's size, that of the largest --tokens, as an engine
sizes its object for its longest batch and then runs decode calls on it (otherwise each setting has an
object of its own size). `--num-sms N` also times dispatch and combine at each --tokens above the decode
sizes on an object limited to N SMs' worth of programs (num_sms; DeepEP's normal mode runs on 24), graph
and eager, beside DeepEP's normal mode where its JSON is there (<op>_sms_vs_deepep: ours eager over its).
Each setting is printed as it is measured (a line, and '... still on <setting>' every 30 s while one
takes longer); all_to_all_<world>ranks.json is rewritten as they come in, its .md written at the end.
`--host-only` needs no GPU: it prints the host time per call on a simulated one-process world
(EPAllToAll.simulated), launches left out (the front's share), and with every launch through BoundKernel up to
the compiled kernel, which does nothing there (the package's own Python of a call: all of it but Triton's
launcher and the driver), the latter also with the CPU's caches swept before each call (``timing.cold_caches``:
an eager call timed after a barrier on the GPU hosts runs so, benchmarks/bench_host.py). Run it without
TRITON_INTERPRET.
"""
import json
import os
import statistics
import sys
import time
from unittest import mock

import torch
import torch.distributed as dist

from moe_ep import EPAllToAll, link_copies, random_topk, reference, runtime
from moe_ep.formats import FORMATS
from moe_ep.launcher import BoundKernel
from moe_ep.routing import hbm_bytes, link_bytes
from moe_ep.timing import (Progress, benchmark_args, cold_caches, environment, finish, floor_us, heading,
                           link_floor_us, markdown_table, median_us, row_line, write_json, write_report)

HIDDEN, EXPERTS, TOPK, GROUP = 7168, 256, 8, 128
# The default settings take 24 s on one H200 with a warm cache (11 s of it measuring: the launch, NVSHMEM's
# start and the kernels' loads are the rest); a cold cache adds the EP kernels' compiles (tokens are not
# constexpr, so a handful).
DECODE, PREFILL, SWEEP = (16, 128, 512), 4096, (32, 64, 256, 1024, 2048)
LAUNCHES = ("dispatch", "combine", "dispatch_send", "dispatch_recv", "combine_send", "combine_recv")


def inputs(tokens: int, max_tokens: int, experts_per_rank: int):
    """This rank's inputs of a setting, the same in every benchmark that imports this: x [T, H] bf16,
    topk_ids [T, K] int64, topk_weights [T, K] fp32 (router-like) and the experts' outputs
    [E_loc, W * max_tokens, H] bf16 that combine reads. The experts' outputs are drawn on the GPU: at 4096
    tokens per rank they are 7.5e9 samples, about a minute on the one CPU thread a rank has."""
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(tokens, HIDDEN, generator=g).bfloat16().cuda()
    ids, weights = random_topk(tokens, EXPERTS, TOPK, device="cuda", generator=g)
    expert_out = torch.randn(experts_per_rank, world * max_tokens, HIDDEN, device="cuda", dtype=torch.bfloat16,
                             generator=torch.Generator(device="cuda").manual_seed(rank))
    return x, ids, weights, expert_out


def barrier() -> None:
    """Every rank's GPU idle, then every rank at the same point: a call timed after it starts together."""
    torch.cuda.synchronize()
    dist.barrier()


def graph_median(fn, replays: int, per_graph: int = 10) -> float:
    """Median microseconds per call of a CUDA graph holding `per_graph` calls of fn(), replayed after a barrier."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            fn()
    return median_us(graph.replay, replays, 1, before=barrier) / per_graph


def eager_median(fn, iters: int) -> float:
    """Median microseconds of one call after a barrier, CUDA events."""
    return median_us(fn, iters, 1, before=barrier)


def host_median(fn, iters: int = 200, warmup: int = 5) -> float:
    """Median CPU microseconds of fn() while the GPU is still busy with earlier work (no call may wait), over
    `iters` calls after `warmup` untimed ones (warm-up excluded, as for the GPU timings)."""
    barrier()
    torch.cuda._sleep(100_000_000)                 # ~50 ms of GPU work ahead of the calls
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def _no_launch(*args) -> None:
    """A protocol launch left out (front_host_us)."""


def calls_host_us(ep, x, ids, weights, expert_out, iters: int, cold: bool = False) -> dict:
    """Median CPU microseconds of a dispatch and of a combine (of a fresh dispatch's handle), each call timed
    alone, over `iters` calls of each; `cold`: each after the CPU's caches are swept (``timing.cold_caches``), as
    an eager call after a barrier runs on the GPU hosts. Every rank must run it the same number of times (it
    moves the slots on)."""
    out = {}
    for op in ("dispatch", "combine"):
        times = []
        for _ in range(iters):
            *_, handle = ep.dispatch(x, ids, weights)
            if cold:
                cold_caches()
            start = time.perf_counter()
            if op == "dispatch":
                ep.dispatch(x, ids, weights)
            else:
                ep.combine(expert_out, handle)
            times.append((time.perf_counter() - start) * 1e6)
        out[op] = statistics.median(times)
    return out


def front_host_us(ep, x, ids, weights, expert_out, iters: int = 200) -> dict:
    """Median CPU microseconds of dispatch and combine with the protocol's launches left out: the
    front's own share of a call (calls_host_us)."""
    for name in LAUNCHES:
        setattr(ep.protocol, name, _no_launch)
    try:
        return {f"{op}_front_us": us for op, us in calls_host_us(ep, x, ids, weights, expert_out, iters).items()}
    finally:
        for name in LAUNCHES:
            delattr(ep.protocol, name)


class _NoKernel:
    """A compiled kernel whose launch does nothing (bound_host_us): BoundKernel hands it what it would hand
    Triton's launcher."""
    function = packed_metadata = None

    def run(self, *args) -> None:
        pass

    def launch_metadata(self, *args) -> None:
        return None


def bound_host_us(ep, x, ids, weights, expert_out, iters: int = 2000, cold: bool = False) -> dict:
    """Median CPU microseconds of dispatch and combine on a machine without a GPU, every launch through
    BoundKernel (its specialization key, argument list, launch hooks) up to a compiled kernel that does nothing
    (_NoKernel: nothing is compiled, no stream asked for): the package's own Python of a call, all of its host
    time but Triton's launcher and the driver (calls_host_us, with the caches swept before each call if `cold`)."""
    with mock.patch.object(BoundKernel, "_compile", lambda kernel, arguments: (_NoKernel(), kernel.grid)), \
            mock.patch.object(torch._C, "_cuda_getCurrentRawStream", lambda device: 0, create=True):
        times = calls_host_us(ep, x, ids, weights, expert_out, iters, cold)
    return {f"{op}_bound{'_cold' if cold else ''}_us": us for op, us in times.items()}


def host_only() -> None:
    """The host time per call without a GPU: rank 0 of a simulated 2-rank world at the decode sizes, the front's
    share (front_host_us) and the package's whole Python (bound_host_us), the latter also with cold caches (as an
    eager call after a barrier runs on the GPU hosts)."""
    print("host time per call on the CPU, us: front (launches left out) / through BoundKernel (the kernel a no-op) "
          "/ the same from cold caches")
    for tokens in DECODE:
        ep = EPAllToAll.simulated(2, tokens, HIDDEN, EXPERTS, TOPK, fp8_group=GROUP)[0]
        x = torch.randn(tokens, HIDDEN).bfloat16()
        ids, weights = random_topk(tokens, EXPERTS, TOPK)
        expert_out = torch.empty(ep.experts_per_rank, 2 * tokens, HIDDEN, dtype=torch.bfloat16)
        times = {**front_host_us(ep, x, ids, weights, expert_out), **bound_host_us(ep, x, ids, weights, expert_out),
                 **bound_host_us(ep, x, ids, weights, expert_out, iters=200, cold=True)}
        print(f"  {tokens:4} tokens: " + ", ".join(
            f"{op} {times[f'{op}_front_us']:.1f} / {times[f'{op}_bound_us']:.1f} / {times[f'{op}_bound_cold_us']:.1f}"
            for op in ("dispatch", "combine")))


def kernel_time(fn, names, iters: int = 20) -> float:
    """Mean device microseconds per call of the kernels whose names contain one of `names`, each call after a
    barrier (a rank whose profiler starts late would otherwise hold its peers' kernels waiting for it). Across
    GPUs a kernel still waits for its peers' to start, and that wait counts: not a kernel's own time there."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            barrier()
            fn()
        torch.cuda.synchronize()
    total = 0.0
    for avg in prof.key_averages():
        if any(n in avg.key for n in names):
            total += getattr(avg, "device_time_total", None) or avg.cuda_time_total
    return total / iters


# ----------------------------------------------------------------------------------------- NCCL

def nccl_dispatch(x, ids, weights, experts_per_rank, max_tokens):
    """Each token once per destination rank over all_to_all_single, then expert-major rows; one host sync
    (the counts), after which every index is computed on the GPU with sizes the host already knows.

    Returns (recv_x [E_loc, W*T_max, H] fp8, recv_scales, recv_count [E_loc], state for combine)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens, device = x.shape[0], x.device
    q, scales = reference.quantize_fp8(x, GROUP)
    dest = torch.where(ids >= 0, ids // experts_per_rank, -1)
    to_rank = (dest[:, :, None] == torch.arange(world, device=device)).any(1)             # [T, W]
    hits = torch.zeros(EXPERTS + 1, dtype=torch.int64, device=device)
    hits.index_add_(0, (ids + 1).flatten(), torch.ones_like(ids).flatten())               # [0]: dropped slots
    send = torch.cat([to_rank.sum(0)[:, None], hits[1:].view(world, experts_per_rank)], 1)   # [W, 1 + E_loc]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    counts = torch.cat([send[:, 0], recv[:, 0], recv[:, 1:].sum()[None]]).tolist()       # the one host sync
    send_splits, recv_splits, local_hits = counts[:world], counts[world:2 * world], counts[-1]
    token_of = torch.nonzero_static(to_rank.t().reshape(-1), size=sum(send_splits))[:, 0] % tokens   # by rank
    rows = torch.cat([q.view(torch.uint8), scales.view(torch.uint8), ids.int().view(torch.uint8),
                      weights.float().view(torch.uint8)], 1)[token_of]
    received = rows.new_empty(sum(recv_splits), rows.shape[1])
    dist.all_to_all_single(received, rows, recv_splits, send_splits)
    h, g = HIDDEN, HIDDEN // GROUP
    r_ids = received[:, h + 4 * g:h + 4 * g + 4 * TOPK].contiguous().view(torch.int32)
    local = (r_ids >= 0) & (r_ids // experts_per_rank == rank)
    flat = torch.nonzero_static(local.reshape(-1), size=local_hits)[:, 0]                  # (source, token, k) order
    row_of, k_of = flat // TOPK, flat % TOPK
    expert = (r_ids.reshape(-1)[flat] - rank * experts_per_rank).long()
    expert, order = torch.sort(expert, stable=True)
    row_of, k_of = row_of[order], k_of[order]
    recv_count = recv[:, 1:].sum(0)
    slot = torch.arange(local_hits, device=device) - (torch.cumsum(recv_count, 0) - recv_count)[expert]
    recv_x = torch.empty(experts_per_rank, world * max_tokens, h, dtype=torch.uint8, device=device)
    recv_scales = torch.empty(experts_per_rank, world * max_tokens, g, dtype=torch.float32, device=device)
    recv_x[expert, slot] = received[row_of, :h]
    recv_scales[expert, slot] = received[row_of, h:h + 4 * g].contiguous().view(torch.float32)
    r_weights = received[:, h + 4 * g + 4 * TOPK:].contiguous().view(torch.float32)
    state = ((send_splits, recv_splits), token_of, row_of, k_of, expert, slot, r_weights, received.shape[0])
    return recv_x.view(torch.float8_e4m3fn), recv_scales, recv_count.int(), state


def nccl_combine(expert_out, state, num_tokens):
    """Per (token, rank) weighted sums in fp32, one all_to_all_single back, summed at the source."""
    splits, token_of, row_of, k_of, expert, slot, r_weights, rows = state
    partial = torch.zeros(rows, expert_out.shape[-1], dtype=torch.float32, device=expert_out.device)
    partial.index_add_(0, row_of, expert_out[expert, slot].float() * r_weights[row_of, k_of, None])
    partial = partial.to(expert_out.dtype)
    back = partial.new_empty(len(token_of), partial.shape[1])
    dist.all_to_all_single(back, partial, splits[0], splits[1])
    y = torch.zeros(num_tokens, partial.shape[1], dtype=torch.float32, device=partial.device)
    return y.index_add_(0, token_of, back.float()).to(expert_out.dtype)


# ----------------------------------------------------------------------------------------- measuring

def breakdown(ep, x, ids, weights, expert_out, iters: int) -> dict:
    """Median per-phase microseconds over `iters` eager calls after a barrier (ep built with timing=True)."""
    samples = []
    for _ in range(iters):
        barrier()
        *_, handle = ep.dispatch(x, ids, weights)
        ep.combine(expert_out, handle)
        samples.append(ep.breakdown())
    return {key: statistics.median(s[key] for s in samples) for key in samples[0]}


def crossover(max_tokens: int, iters: int) -> int:
    """EPAllToAll.measure_crossover on an object built for `max_tokens` tokens per rank: the most tokens at
    which its eager dispatches of mode "auto" take the decode tiles."""
    ep = EPAllToAll(max_tokens, HIDDEN, EXPERTS, TOPK, fp8_dispatch=True, fp8_group=GROUP)
    tokens = ep.measure_crossover(iters=iters)
    ep.destroy()
    return tokens


def second_object(ep: EPAllToAll, x, ids, weights, expert_out, iters: int, eager: bool = True) -> dict:
    """The setting's calls on another object `ep` (destroyed after): {"<op>_<how>_us": us} for dispatch and
    combine in graphs (iters // 4 replays) and, with `eager`, eager (iters calls); each combine takes the handle
    of a dispatch just before it (a graph's dispatches move the slots on)."""
    dispatch = lambda: ep.dispatch(x, ids, weights)                 # noqa: E731
    combine = lambda: ep.combine(expert_out, handle)                # noqa: E731
    times = {"dispatch_graph_us": graph_median(dispatch, iters // 4)}
    if eager:
        times["dispatch_eager_us"] = eager_median(dispatch, iters)
    *_, handle = dispatch()
    times["combine_graph_us"] = graph_median(combine, iters // 4)
    if eager:
        *_, handle = dispatch()
        times["combine_eager_us"] = eager_median(combine, iters)
    ep.destroy()
    return times


def put_path(out: dict, x, ids, weights, expert_out, max_tokens: int, iters: int, full: bool) -> None:
    """The same calls (the setting's `inputs`) with every peer reached through NVSHMEM puts (puts="all") into
    `out`, as put_<time> beside the pointer path's <time>, and their ratio puts_over_pointers_<op>_<how>."""
    ep = EPAllToAll(max_tokens, HIDDEN, EXPERTS, TOPK, fp8_dispatch=True, fp8_group=GROUP, puts="all")
    for key, us in second_object(ep, x, ids, weights, expert_out, iters, eager=full).items():
        out[f"put_{key}"] = us
        out[f"puts_over_pointers_{key.removesuffix('_us')}"] = us / out[key]


def few_sms(out: dict, x, ids, weights, expert_out, max_tokens: int, num_sms: int, iters: int) -> None:
    """Dispatch and combine on an object limited to `num_sms` SMs' worth of programs, graph and eager,
    into out as <op>_sms_<how>_us."""
    ep = EPAllToAll(max_tokens, HIDDEN, EXPERTS, TOPK, fp8_dispatch=True, fp8_group=GROUP, num_sms=num_sms)
    out["num_sms"] = num_sms
    for key, us in second_object(ep, x, ids, weights, expert_out, iters).items():
        out[key.replace("_", "_sms_", 1)] = us


def measure(tokens: int, max_tokens: int, iters: int, full: bool, with_breakdown: bool, copy_GBps: float | None,
            puts: bool, num_sms: int, progress: Progress) -> dict:
    """One setting: calls of `tokens` tokens per rank on objects for `max_tokens`; `copy_GBps` is
    peer_copy_GBps(), for the floor at the machine's copy rate; with `puts`, the put path too (put_path);
    with `num_sms`, an object on that many SMs too (few_sms)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ours = EPAllToAll(max_tokens, HIDDEN, EXPERTS, TOPK, fp8_dispatch=True, fp8_group=GROUP)
    x, ids, weights, expert_out = inputs(tokens, max_tokens, ours.experts_per_rank)
    *_, handle = ours.dispatch(x, ids, weights)
    dispatch = lambda: ours.dispatch(x, ids, weights)             # noqa: E731
    combine = lambda: ours.combine(expert_out, handle)            # noqa: E731

    out = {"tokens": tokens, "max_tokens": max_tokens, "programs": dict(ours.protocol.grid),
           "sms": torch.cuda.get_device_properties(0).multi_processor_count}
    progress.step("graphs")
    out["dispatch_graph_us"] = graph_median(dispatch, iters // 4)
    for mode in ("decode", "prefill"):
        call = lambda mode=mode: ours.dispatch(x, ids, weights, mode=mode)    # noqa: E731
        out[f"dispatch_{mode}_graph_us"] = graph_median(call, iters // 4)
    *_, handle = ours.dispatch(x, ids, weights)                    # the graph's dispatches moved the slots on
    out["combine_graph_us"] = graph_median(combine, iters // 4)
    *_, handle = ours.dispatch(x, ids, weights)
    if full:
        progress.step("profiler")
        out["dispatch_kernel_us"] = kernel_time(dispatch, ["dispatch_"])
        *_, handle = ours.dispatch(x, ids, weights)
        out["combine_kernel_us"] = kernel_time(combine, ["combine_"])
        progress.step("NCCL baseline")
        *_, state = nccl_dispatch(x, ids, weights, ours.experts_per_rank, tokens)
        out["nccl_dispatch_us"] = eager_median(lambda: nccl_dispatch(x, ids, weights, ours.experts_per_rank, tokens),
                                               iters // 2)
        out["nccl_combine_us"] = eager_median(lambda: nccl_combine(expert_out, state, tokens), iters // 2)
        progress.step("reference")
        ref = EPAllToAll(max_tokens, HIDDEN, EXPERTS, TOPK, fp8_group=GROUP, validate=False, backend="reference")
        out["reference_dispatch_us"] = eager_median(lambda: ref.dispatch(x, ids, weights), iters // 4)
        *_, ref_handle = ref.dispatch(x, ids, weights)
        out["reference_combine_us"] = eager_median(lambda: ref.combine(expert_out, ref_handle), iters // 4)
        recv_count = ours.dispatch(x, ids, weights)[2]
        assert torch.equal(recv_count, nccl_dispatch(x, ids, weights, ours.experts_per_rank, tokens)[2]), \
            "the NCCL baseline routes differently"
        progress.step("eager, host and front")
        out["dispatch_eager_us"] = eager_median(dispatch, iters)
        for mode in ("decode", "prefill"):              # the crossover of eager calls, for mode "auto"
            call = lambda mode=mode: ours.dispatch(x, ids, weights, mode=mode)    # noqa: E731
            out[f"dispatch_{mode}_eager_us"] = eager_median(call, iters)
        *_, handle = ours.dispatch(x, ids, weights)
        out["combine_eager_us"] = eager_median(combine, iters)
        out["dispatch_host_us"] = host_median(dispatch)
        *_, handle = ours.dispatch(x, ids, weights)
        out["combine_host_us"] = host_median(combine)
        torch.cuda.synchronize()
        out.update(front_host_us(ours, x, ids, weights, expert_out))
    ours.destroy()
    if puts:
        progress.step("put path")
        put_path(out, x, ids, weights, expert_out, max_tokens, iters, full)
    if num_sms:
        progress.step(f"{num_sms} SMs")
        few_sms(out, x, ids, weights, expert_out, max_tokens, num_sms, iters)
    if with_breakdown:
        progress.step("breakdown")
        timed = EPAllToAll(max_tokens, HIDDEN, EXPERTS, TOPK, fp8_dispatch=True, fp8_group=GROUP, timing=True)
        per_rank = [None] * world
        dist.all_gather_object(per_rank, breakdown(timed, x, ids, weights, expert_out, iters // 2))
        out["breakdown"] = per_rank
        timed.destroy()
    per_rank_copies, per_expert_copies = link_copies(ids, EXPERTS // world, rank, world)
    token_bytes = HIDDEN + HIDDEN // GROUP * 4
    out["dispatch_link_MB_one_copy_per_expert"] = per_expert_copies * token_bytes / 1e6
    every_rank = [torch.empty_like(ids) for _ in range(world)]
    dist.all_gather(every_rank, ids)
    hbm = hbm_bytes(every_rank, rank, EXPERTS // world, HIDDEN, torch.bfloat16, GROUP)
    link = link_bytes(every_rank, rank, EXPERTS // world, HIDDEN, torch.bfloat16, GROUP)
    for op, hbm_op, link_op in zip(("dispatch", "combine"), hbm, link):
        out[f"{op}_hbm_MB"], out[f"{op}_link_MB"] = hbm_op / 1e6, link_op / 1e6
        out[f"{op}_link_GBps"] = link_op / 1e3 / out[f"{op}_graph_us"]
        floors = [floor_us(0, hbm_op)]
        if world > 1:
            floors.append(link_floor_us(link_op))
            out[f"{op}_link_floor_us"] = floors[-1]
            if copy_GBps:
                out[f"{op}_copy_floor_us"] = link_floor_us(link_op, copy_GBps)
        out[f"{op}_floor_us"] = floors[0]
        if None not in floors:
            out[f"{op}_x_floor"] = out[f"{op}_graph_us"] / max(floors)
        if f"nccl_{op}_us" in out:
            out[f"{op}_speedup_vs_nccl"] = out[f"nccl_{op}_us"] / out[f"{op}_eager_us"]
    return out


def payload_formats(tokens: int, iters: int, copy_GBps: float | None, progress: Progress) -> list[dict]:
    """Dispatch of `tokens` tokens per rank in each payload format of FORMAT_NAMES, on an object of its own:
    graph and eager medians, a row's bytes on the wire, the bytes leaving this GPU (link_bytes: the busier
    direction), their link floor and the time over fp8's (the format of every other column). nvfp4 dispatches
    under one per-tensor scale for every rank, the largest rank's tensor_scale_of its tokens."""
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(tokens, HIDDEN, generator=g).bfloat16().cuda()
    ids, weights = random_topk(tokens, EXPERTS, TOPK, device="cuda", generator=g)
    every_rank = [torch.empty_like(ids) for _ in range(world)]
    dist.all_gather(every_rank, ids)
    rows = []
    for name in FORMAT_NAMES:
        progress.step(f"{name}, {tokens} tokens")
        fmt = FORMATS[name]
        ep = EPAllToAll(tokens, HIDDEN, EXPERTS, TOPK, payload=name)
        scale = None
        if fmt.tensor_scale:
            scale = fmt.tensor_scale_of(x).reshape(1)
            dist.all_reduce(scale, op=dist.ReduceOp.MAX)
        dispatch = lambda: ep.dispatch(x, ids, weights, tensor_scale=scale)       # noqa: E731
        link = link_bytes(every_rank, rank, EXPERTS // world, HIDDEN, row_bytes=fmt.row_bytes(HIDDEN))[0]
        row = {"tokens": tokens, "format": name, "row_bytes": fmt.row_bytes(HIDDEN), "link_MB": link / 1e6,
               "dispatch_graph_us": graph_median(dispatch, iters // 4),
               "dispatch_eager_us": eager_median(dispatch, iters // 2)}
        if world > 1:
            row["link_floor_us"] = link_floor_us(link)
            if copy_GBps:
                row["copy_floor_us"] = link_floor_us(link, copy_GBps)
        rows.append(row)
        ep.destroy()
    fp8 = next(row for row in rows if row["format"] == "fp8")
    for row in rows:
        for how in ("graph", "eager"):
            row[f"{how}_over_fp8"] = row[f"dispatch_{how}_us"] / fp8[f"dispatch_{how}_us"]
    return rows


def deepep_tables(rows: list[dict]) -> str:
    """The table beside DeepEP (where ``beside_deepep`` merged its rows) and the fewer-SMs table (where the
    rows have --num-sms times), as the benchmark's .md and RESULTS.md show them."""
    text = ""
    if any("deepep_mode" in row for row in rows):
        text += ("\nBeside DeepEP (the same inputs and timing, each library in a job of its own; *_vs_deepep is ours "
                 f"over DeepEP's, below 1 where ours is faster):\n\n{markdown_table(rows, DEEPEP_COLUMNS, '.2f')}\n")
    few = [row for row in rows if "num_sms" in row]
    if few:
        text += ("\nOn fewer SMs (num_sms: at most that many SMs' worth of programs a kernel), beside DeepEP's normal "
                 "mode on its 24 (sms_vs_deepep: ours eager over DeepEP's eager):\n\n"
                 f"{markdown_table(few, SMS_COLUMNS, '.2f')}\n")
    return text


def put_and_format_tables(rows: list[dict], formats: list[dict] | None) -> str:
    """The put path's table (where the rows have its times) and the payload formats' (where there are
    any), as the benchmark's .md and RESULTS.md show them."""
    text = ""
    if any("put_dispatch_graph_us" in row for row in rows):
        text += ("\nThe put path (every peer through NVSHMEM puts, puts='all') beside the pointer path, us, and its "
                 f"time over theirs:\n\n{markdown_table(rows, PUT_COLUMNS, '.2f')}\n")
    if formats:
        text += ("\nDispatch per payload format (a row's bytes on the wire, MB leaving this GPU, its link floors; "
                 f"times over fp8's):\n\n{markdown_table(formats, FORMAT_COLUMNS, '.2f')}\n")
    return text


def peer_copy_GBps(mb_per_peer: int = 64, iters: int = 10) -> float | None:
    """GB/s leaving this GPU while every rank copies `mb_per_peer` MB to every other rank at once on the
    copy engines (a stream per peer, after a barrier; median): the rate a link-bound op can hope for on
    this machine. None on one rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if world == 1:
        return None
    size = mb_per_peer << 20
    runtime.init()
    landing = runtime.symmetric_empty((world, size), torch.uint8)
    source = torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda")
    views = [runtime.peer_tensor(landing, peer)[rank] for peer in range(world) if peer != rank]
    streams = [torch.cuda.Stream() for _ in views]

    def copy():
        main = torch.cuda.current_stream()
        for stream, view in zip(streams, views):
            stream.wait_stream(main)
            with torch.cuda.stream(stream):
                view.copy_(source, non_blocking=True)
            main.wait_stream(stream)

    us = median_us(copy, iters, 2, before=barrier)
    runtime.barrier()
    runtime.free(landing)
    return (world - 1) * size / us / 1e3


COLUMNS = ["tokens", "max_tokens", "dispatch_graph_us", "dispatch_floor_us", "dispatch_link_floor_us",
           "dispatch_copy_floor_us", "dispatch_x_floor", "dispatch_decode_graph_us", "dispatch_prefill_graph_us",
           "dispatch_eager_us", "dispatch_decode_eager_us", "dispatch_prefill_eager_us", "dispatch_host_us",
           "dispatch_front_us", "dispatch_kernel_us", "nccl_dispatch_us", "reference_dispatch_us",
           "dispatch_speedup_vs_nccl", "combine_graph_us", "combine_floor_us", "combine_link_floor_us",
           "combine_copy_floor_us", "combine_x_floor", "combine_eager_us", "combine_host_us", "combine_front_us",
           "combine_kernel_us", "nccl_combine_us", "reference_combine_us", "combine_speedup_vs_nccl",
           "dispatch_link_MB", "dispatch_link_GBps", "combine_link_MB", "combine_link_GBps"]
PUT_COLUMNS = ["tokens"] + [f"{name}{op}_{how}{unit}" for op in ("dispatch", "combine") for how in ("graph", "eager")
                            for name, unit in (("", "_us"), ("put_", "_us"), ("puts_over_pointers_", ""))]
FORMAT_NAMES = ("bf16", "fp8", "fp8_ue8m0", "mxfp8", "nvfp4")    # the payload formats dispatch takes (moe_ep.formats)
FORMAT_COLUMNS = ["tokens", "format", "row_bytes", "link_MB", "link_floor_us", "copy_floor_us", "dispatch_graph_us",
                  "graph_over_fp8", "dispatch_eager_us", "eager_over_fp8"]
DEEPEP_COLUMNS = ["tokens", "deepep_mode"] + [f"{op}_{how}_{who}" for op in ("dispatch", "combine")
                                             for how in ("graph", "eager") for who in ("us", "deepep_us", "vs_deepep")]
SMS_COLUMNS = ["tokens", "num_sms", "deepep_mode"] + [
    f"{op}_{what}" for op in ("dispatch", "combine")
    for what in ("sms_graph_us", "sms_eager_us", "eager_deepep_us", "sms_vs_deepep")]


def beside_deepep(rows: list[dict], path: str) -> str:
    """Merge DeepEP's rows (bench_deepep.py's JSON at `path`: the same inputs and timing, a job of its own)
    into ours by tokens per rank: each of its times as <op>_<how>_deepep_us, and ours over it as
    <op>_<how>_vs_deepep (below 1: ours is faster). Returns a line that says what was merged, or why
    nothing was."""
    if not os.path.exists(path):
        return f"DeepEP left out: no {path} (benchmarks/bench_deepep.py writes it; run it first, into the same --out)"
    with open(path) as f:
        data = json.load(f)
    if "unavailable" in data:
        return f"DeepEP left out: {data['unavailable']}"
    theirs = {row["tokens"]: row for row in data["settings"]}
    for row in rows:
        other = theirs.get(row["tokens"], {})
        if "mode" in other:
            row["deepep_mode"] = other["mode"]
        for key, value in other.items():
            if key.endswith("_us") and isinstance(value, float):
                row[key.replace("_us", "_deepep_us")] = value
                if isinstance(row.get(key), float):
                    row[key.replace("_us", "_vs_deepep")] = row[key] / value
        for op in ("dispatch", "combine"):
            if f"{op}_sms_eager_us" in row and f"{op}_eager_deepep_us" in row:
                row[f"{op}_sms_vs_deepep"] = row[f"{op}_sms_eager_us"] / row[f"{op}_eager_deepep_us"]
    return f"DeepEP {data['version']} beside us ({data['world']}x {data['device']}, {data['date']}): its time " \
           f"in *_deepep_us, ours over it in *_vs_deepep"


PHASES = ("send", "signal", "wait", "recv")


def breakdown_lines(row) -> list[str]:
    lines = []
    for rank, phases in enumerate(row.get("breakdown") or []):
        parts = [f"{op}: " + " + ".join(f"{p} {phases[f'{op}_{p}_us']:.1f}" for p in PHASES)
                 + f" = {phases[f'{op}_total_us']:.1f} us" for op in ("dispatch", "combine")]
        lines.append(f"{row['tokens']} tokens, rank {rank}: " + "; ".join(parts))
    return lines


def crossover_line(found: dict) -> str:
    return (f"Eager crossover (EPAllToAll.measure_crossover, an object for {found['max_tokens']} tokens per rank): "
            f"mode \"auto\" takes the decode tiles up to {found['one_launch_tokens']} tokens")


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = sorted(rows, key=lambda r: r["tokens"])
    tokens = [r["tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, label, style in (("dispatch_graph_us", "moe_ep dispatch (graph)", "o-"),
                              ("dispatch_decode_graph_us", "moe_ep dispatch, decode mode (graph)", "^:"),
                              ("dispatch_prefill_graph_us", "moe_ep dispatch, prefill mode (graph)", "v:"),
                              ("combine_graph_us", "moe_ep combine (graph)", "s-")):
        ax.plot(tokens, [r[key] for r in rows], style, label=label)
    for key, label, style in (("nccl_dispatch_us", "NCCL dispatch (eager)", "o--"),
                              ("nccl_combine_us", "NCCL combine (eager)", "s--")):
        points = [(r["tokens"], r[key]) for r in rows if key in r]
        if points:
            ax.plot(*zip(*points), style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens per rank")
    ax.set_ylabel("latency per call (us)")
    ax.set_title(f"EP all-to-all, {dist.get_world_size()}x {torch.cuda.get_device_name()}, H=7168, E=256, top-8, FP8")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    if "--host-only" in sys.argv:
        host_only()
        return
    args = benchmark_args(__doc__, iters=100, tokens=(*DECODE, PREFILL),
                          sweep="also time 32 to 2048 tokens per rank (graph only) and draw latency.png",
                          breakdown="time each phase of the decode settings with device timestamps",
                          crossover="measure the eager crossover of the decode and prefill tiles on an object for "
                                    "the largest --tokens (EPAllToAll.measure_crossover)",
                          formats="also time dispatch in each payload format (bf16, fp8, fp8_ue8m0, mxfp8, nvfp4) "
                                  "at each --tokens, with the bytes that leave each GPU",
                          puts="also time the put path (every peer through NVSHMEM puts: puts='all') beside the "
                               "pointer path (on 2+ ranks)",
                          numbers={"num-sms": (0, "also time the settings above the decode sizes on an object of "
                                                  "num_sms=N, beside DeepEP's normal mode (0: not)")},
                          **{"one-object": "time every setting on objects sized for the largest --tokens"})
    rank, world = dist.get_rank(), dist.get_world_size()
    meta = {**environment(), "model": {"hidden": HIDDEN, "experts": EXPERTS, "topk": TOPK, "fp8_group": GROUP}}
    results = {"settings": []}
    with Progress("peer copies") as p:
        meta["peer_copy_GBps"] = peer_copy_GBps()
    if meta["peer_copy_GBps"]:
        p.report(f"copy engines, every rank to every other at once: {meta['peer_copy_GBps']:.0f} GB/s leave each GPU")
    if args.crossover:
        largest = max(args.tokens)
        with Progress(f"crossover, up to {largest} tokens per rank") as p:
            results["crossover"] = {"max_tokens": largest, "one_launch_tokens": crossover(largest, args.iters)}
        torch.cuda.empty_cache()
        p.report(crossover_line(results["crossover"]))
    plan = [(t, args.iters if t <= DECODE[-1] else args.iters // 4, True, args.breakdown and t <= DECODE[-1])
            for t in args.tokens]
    if args.sweep:
        plan += [(t, args.iters // 2, False, False) for t in SWEEP if t not in args.tokens]
    for tokens, iters, full, with_breakdown in plan:   # results are written as they come: a cut run keeps them
        with Progress(f"{tokens} tokens per rank") as p:
            max_tokens = max(tokens, *args.tokens) if args.one_object else tokens
            row = measure(tokens, max_tokens, iters, full, with_breakdown, meta["peer_copy_GBps"],
                          args.puts and world > 1, args.num_sms if tokens > DECODE[-1] else 0, p)
        results["settings"].append(row)
        torch.cuda.empty_cache()              # the prefill setting's expert rows are large
        write_json(args, f"all_to_all_{world}ranks.json", {**meta, **results})
        if rank == 0:
            p.report("\n".join([row_line(row, COLUMNS, ".1f"), *breakdown_lines(row)]))
    if args.formats:
        results["formats"] = []
        for tokens in sorted(args.tokens):
            with Progress(f"payload formats, {tokens} tokens per rank") as p:
                results["formats"] += payload_formats(tokens, args.iters, meta["peer_copy_GBps"], p)
            torch.cuda.empty_cache()
    if rank == 0:
        rows = sorted(results["settings"], key=lambda r: r["tokens"])
        deepep = beside_deepep(rows, os.path.join(args.out, f"deepep_{world}ranks.json"))
        write_json(args, f"all_to_all_{world}ranks.json", {**meta, **results, "deepep": deepep})
        text = (f"{heading(meta)}\n\n"
                f"Times in us (rank 0); speedups are NCCL eager over ours eager; floors: HBM at its peak, the link at "
                f"its peak and at the measured copy rate ({meta['peer_copy_GBps'] or 0:.0f} GB/s); x_floor is graph "
                f"time over the larger of HBM's and the link's peak floor:\n\n{markdown_table(rows, COLUMNS)}\n"
                f"\n{deepep}\n")
        text += deepep_tables(rows) + put_and_format_tables(rows, results.get("formats"))
        if args.crossover:
            text += f"\n{crossover_line(results['crossover'])}.\n"
        lines = [line for row in rows for line in breakdown_lines(row)]
        if lines:
            text += "\nBreakdown (device timestamps, medians):\n\n" + "\n".join(f"    {line}" for line in lines) + "\n"
        if args.sweep:
            plot(rows, os.path.join(args.out, f"latency_{world}ranks.png"))
        write_report(args, f"all_to_all_{world}ranks.md", text)
    finish(args)


if __name__ == "__main__":
    main()
