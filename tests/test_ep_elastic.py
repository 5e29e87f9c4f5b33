"""Elastic EP: a rank stops, the others mask it and go on.

In the Triton interpreter (CPU) every rank lives in one process (EPAllToAll.simulated): a rank "dies"
by making no further call, at one of three points of a call: before its dispatch, after its dispatch's
send (its receive never runs), or after its whole dispatch (before its combine). The survivors' first
call waits timeout_s for it, marks it dead and completes; every call is compared bit for bit with the
oracle of tests/cases.py run without the dead rank's experts (their ids dropped), and handle.lost with
the experts that were on it.

On GPUs (4 ranks) ranks die for real, with os._exit, one after another: before a dispatch, between a
dispatch and its combine, and in the middle of a kernel (its receive waits for peers that hold back).
Eager calls, and replays of CUDA graphs captured while every rank was alive. The survivors' first call
after each death returns within timeout_s + 1 s, and the 100 calls after it are bit-exact against the
oracle. On one GPU (shared-GPU mode) a process that exits while a kernel of its own is still running
takes the others down with it: CUDA MPS then fails every client's next call ("an illegal memory access
was encountered", seen on an H200 with a plain torch.cuda._sleep kernel and no NVSHMEM), so there the
third rank dies between its dispatch's two kernels instead (its send ran, its receive never does).
"""
import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from cases import expected_combine, expected_dispatch, expert_fn, make_inputs
from distributed import GPUS, die, run, waited_once
from moe_ep import EPAllToAll, runtime
from moe_ep.runtime import CommTimeoutError

INTERPRETED = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="runs the kernels in the Triton interpreter, on CPU-only machines")
HIDDEN, EXPERTS, TOPK, GROUP, TIMEOUT_S = 128, 12, 3, 64, 4.0


def on_dead(ids, dead, per_rank):
    """bool, like ids: the ids of experts on a rank of `dead` (each rank holding `per_rank` experts)."""
    return (ids >= 0) & torch.isin(ids // per_rank, torch.tensor(sorted(dead) or [-1]))


def check(rank, world, experts, max_tokens, out, y, inputs, senders, dead):
    """One survivor's dispatch outputs `out` (recv_x, recv_scales, recv_count, handle) against the oracle fed
    the rows of `senders`; its combine's y against the oracle without the experts of `dead`; handle.lost
    against those experts."""
    per_rank = experts // world
    recv_x, recv_scales, recv_count = (t.cpu() for t in out[:3])
    handle = out[3]
    sent = [inp if r in senders else (inp[0][:0], inp[1][:0], inp[2][:0]) for r, inp in enumerate(inputs)]
    expected = expected_dispatch(rank, world, sent, experts, max_tokens, GROUP)
    assert recv_count.tolist() == [len(rows) for rows in expected], rank
    sources = handle.recv_src.cpu()
    for e, rows in enumerate(expected):
        for i, (payload, scales, source) in enumerate(rows):
            assert torch.equal(recv_x[e, i].view(torch.uint8), payload.view(torch.uint8)), (rank, e, i)
            assert torch.equal(recv_scales[e, i], scales) and int(sources[e, i]) == source, (rank, e, i)
    def combined(gone):
        survived = [(x, ids.masked_fill(on_dead(ids, gone, per_rank), -1), w) for x, ids, w in inputs]
        return expected_combine(rank, world, survived, experts, GROUP, torch.bfloat16)

    y = y.cpu()
    if not torch.equal(y, combined(dead)):
        rows = (y != combined(dead)).any(1).nonzero().flatten().tolist()
        candidates = [dead | {r} for r in range(world)] + [dead - {r} for r in dead]
        like = [sorted(gone) for gone in candidates if torch.equal(y, combined(gone))]
        raise AssertionError(f"rank {rank}: y differs in rows {rows} (the ranks lost: {sorted(dead)}; y is what "
                             f"losing {like or 'no other set'} gives; lost {handle.lost.int().tolist()})")
    assert torch.equal(handle.lost.cpu(), on_dead(inputs[rank][1], dead, per_rank)), rank


def call(ranks, live, inputs, victim=None, point=None):
    """One dispatch and combine of the ranks in `live`, all sends before any receive (the interpreter runs one
    program at a time); the first live rank calls without receive hooks, after the others' sends: both phases
    in one launch. `victim` (not in live) stops at `point`: "before dispatch" (it makes no call), "after
    send" (its dispatch's send, not its receive) or "before combine" (its whole dispatch). Returns the
    dispatches' outputs, the combines' y and the ranks whose dispatch sent."""
    senders = live + ([victim] if point in ("after send", "before combine") else [])
    whole, others = live[0], senders[1:]
    outs = {r: ranks[r].dispatch(*inputs[r], return_recv_hook=True) for r in others}
    outs[whole] = ranks[whole].dispatch(*inputs[whole])
    for r in others:
        if r != victim or point == "before combine":
            outs[r][-1]()
    experts = {r: expert_fn(outs[r][0], outs[r][1], GROUP, torch.bfloat16) for r in live}
    combined = {r: ranks[r].combine(experts[r], outs[r][3], return_recv_hook=True) for r in live[1:]}
    combined[whole] = (ranks[whole].combine(experts[whole], outs[whole][3]), None)
    for r in live[1:]:
        combined[r][1]()
    return outs, {r: y for r, (y, _) in combined.items()}, senders


@INTERPRETED
@pytest.mark.parametrize("world, victim, point", [(3, 2, "before dispatch"), (4, 1, "after send"),
                                                  (3, 0, "before combine")])
def test_survivors_go_on(world, victim, point):
    """A rank stops at `point` of call 1; the survivors' call 1 completes within about one timeout, their
    later calls wait for nothing, and every result equals the oracle without the victim's experts."""
    max_tokens = 5
    ranks = EPAllToAll.simulated(world, max_tokens, HIDDEN, EXPERTS, TOPK, fp8_group=GROUP, timeout_s=TIMEOUT_S,
                                 elastic=True)
    everyone = list(range(world))
    survivors = [r for r in everyone if r != victim]
    took = []
    for n in range(4):
        inputs = [make_inputs(r, [max_tokens, 3, 0, 4][:world], HIDDEN, EXPERTS, TOPK, seed=n, drop=0.2)
                  for r in everyone]
        started = time.monotonic()
        if n == 0:
            outs, combined, senders = call(ranks, everyone, inputs)
        else:
            outs, combined, senders = call(ranks, survivors, inputs, *((victim, point) if n == 1 else ()))
        took.append(time.monotonic() - started)
        for r in survivors if n else everyone:
            check(r, world, EXPERTS, max_tokens, outs[r], combined[r], inputs, senders, {victim} if n else set())
    waited_once(took, TIMEOUT_S)       # the victim is masked on every survivor: nothing waits for it twice
    for r in survivors:
        assert ranks[r].live_ranks() == survivors
        assert not ranks[r]._status.any()
    # marked dead in its own mask too: a late call of its own finds out and raises
    ranks[victim].dispatch(*make_inputs(victim, [2] * world, HIDDEN, EXPERTS, TOPK, seed=9), return_recv_hook=True)
    with pytest.raises(CommTimeoutError, match=f"rank {victim} was masked by its peers"):
        ranks[victim].check()
    with pytest.raises(RuntimeError, match=rf"ranks \[{victim}\] are lost"):
        ranks[survivors[0]].destroy()


@INTERPRETED
def test_mask_ranks_on_purpose():
    """Every survivor masks rank 1 between the same two calls: no wait times out, results exclude its experts."""
    world, max_tokens = 3, 4
    ranks = EPAllToAll.simulated(world, max_tokens, HIDDEN, EXPERTS, TOPK, fp8_group=GROUP, timeout_s=30.0,
                                 elastic=True)
    survivors = [0, 2]
    for n in range(3):
        inputs = [make_inputs(r, [max_tokens] * world, HIDDEN, EXPERTS, TOPK, seed=20 + n) for r in range(world)]
        if n == 1:
            for r in survivors:
                ranks[r].mask_ranks([1])
        live = list(range(world)) if n == 0 else survivors
        started = time.monotonic()
        outs, combined, senders = call(ranks, live, inputs)
        assert time.monotonic() - started < 30.0
        for r in live:
            check(r, world, EXPERTS, max_tokens, outs[r], combined[r], inputs, senders, {1} if n else set())
    assert [ranks[r].live_ranks() for r in range(world)] == [survivors, [0, 1, 2], survivors]
    assert ranks[0].live_mask.tolist() == [1, 0, 1]


def test_elastic_arguments_are_checked():
    """The reference backend refuses elastic mode; mask_ranks checks its ranks before touching the mask."""
    from moe_ep.ep.front import check_config
    with pytest.raises(ValueError, match="elastic=True needs backend='nvshmem'"):
        check_config(4, 128, 8, 2, 2, torch.bfloat16, True, 128, "reference", elastic=True)
    with pytest.raises(ValueError, match="at most 32 ranks"):
        check_config(4, 128, 64, 2, 64, torch.bfloat16, True, 128, "nvshmem", elastic=True)
    plain = EPAllToAll.simulated(2, 4, HIDDEN, EXPERTS, TOPK)[0]
    assert plain.live_ranks() == [0, 1]
    with pytest.raises(ValueError, match="needs EPAllToAll"):
        plain.mask_ranks([1])
    with pytest.raises(ValueError, match="needs EPAllToAll"):
        plain.live_mask
    ep = EPAllToAll.simulated(3, 4, HIDDEN, EXPERTS, TOPK, elastic=True)[0]
    for bad, message in (([0], "cannot mask itself"), ([3], "ints in"), (["1"], "ints in")):
        with pytest.raises(ValueError, match=message):
            ep.mask_ranks(bad)
    assert ep.live_ranks() == [0, 1, 2]


# ------------------------------------------------------------------------------------------------ GPU

GPU_WORLD = 4 if GPUS in (1, 4) or GPUS > 4 else GPUS    # on one GPU: shared-GPU mode (MPS) at 4 ranks
POINTS = ("before dispatch", "between dispatch and combine", "after send" if GPUS == 1 else "mid kernel")
AFTER = 100                                            # calls checked after each death
GPU_TOKENS, GPU_HIDDEN, GPU_EXPERTS, GPU_TOPK = 16, 512, 16, 4
# On a shared GPU a live rank's kernels can wait for SMs that other processes' spinning waits hold: in a quick
# suite whose lanes' shares added up to more than the GPU, a survivor counted a live, starved peer dead at 3 s,
# 63 calls after a death. Each death costs the survivors one timeout either way.
GPU_TIMEOUT_S = 6.0 if GPUS == 1 else 3.0


def deaths(world):
    """(call, victim, point) of each death: ranks world-1, ..., 1 die in turn, AFTER calls apart."""
    return [(3 + i * (AFTER + 1), world - 1 - i, POINTS[i % len(POINTS)]) for i in range(world - 1)]


def _elastic(rank, world, graphed, folder):
    """The calls of the schedule, timed; their results kept on the host and checked after the last call, so
    that no rank falls timeout_s behind the others between two calls (a peer would count it dead)."""
    shape = dict(max_tokens=GPU_TOKENS, hidden=GPU_HIDDEN, num_experts=GPU_EXPERTS, topk=GPU_TOPK, fp8_group=GROUP,
                 elastic=True)
    warm = EPAllToAll(**shape, timeout_s=60.0)       # compiles both tile sets (compile times differ by rank)
    for mode in ("decode", "prefill"):
        x, ids, weights = make_inputs(rank, [GPU_TOKENS] * world, GPU_HIDDEN, GPU_EXPERTS, GPU_TOPK, seed=0,
                                      device="cuda")
        *out, hook = warm.dispatch(x, ids, weights, return_recv_hook=True, mode=mode)
        hook()
        warm.combine(expert_fn(out[0], out[1], GROUP, torch.bfloat16), out[3])
    warm.destroy()
    ep = EPAllToAll(**shape, timeout_s=GPU_TIMEOUT_S)
    schedule = {call: (victim, point) for call, victim, point in deaths(world)}
    tokens = [GPU_TOKENS - r for r in range(world)]
    static = [t.cuda() for t in make_inputs(rank, tokens, GPU_HIDDEN, GPU_EXPERTS, GPU_TOPK, seed=0)]

    hooks = []

    def send():
        *out, hook = ep.dispatch(*static, return_recv_hook=True)
        hooks.append(hook)
        return out

    def receive(out):
        hooks.pop()()
        return expert_fn(out[0], out[1], GROUP, torch.bfloat16)

    if graphed:         # captured while every rank is alive, replayed across the deaths: no recapture
        graphs = [torch.cuda.CUDAGraph() for _ in range(3)]
        out = send()
        ep.combine(receive(out), out[3])
        with torch.cuda.graph(graphs[0]):
            out = send()
        with torch.cuda.graph(graphs[1]):
            experts = receive(out)
        with torch.cuda.graph(graphs[2]):
            y = ep.combine(experts, out[3])
    runtime.barrier()
    dead, last, first_calls, results = set(), max(schedule) + AFTER + 1, [], []
    for n in range(last):
        victim, point = schedule.get(n, (None, None))
        if rank == victim and point == "before dispatch":
            die()
        for dst, src in zip(static, make_inputs(rank, tokens, GPU_HIDDEN, GPU_EXPERTS, GPU_TOPK, seed=n, drop=0.1)):
            dst.copy_(src)
        if point == "mid kernel" and rank != victim:
            time.sleep(1.0)      # the victim's receive is waiting for this rank when the victim dies
        started = time.monotonic()
        if graphed:
            graphs[0].replay()
        else:
            out = send()
        if rank == victim and point == "after send":
            torch.cuda.synchronize()
            die()
        if graphed:
            graphs[1].replay()
        else:
            experts = receive(out)
        if rank == victim:
            if point == "mid kernel":
                time.sleep(0.3)
            else:
                torch.cuda.synchronize()
            die()
        if graphed:
            graphs[2].replay()
        else:
            y = ep.combine(experts, out[3])
        torch.cuda.synchronize()
        took = time.monotonic() - started
        senders = [r for r in range(world) if r not in dead and (r != victim or point != "before dispatch")]
        if victim is not None:
            dead.add(victim)
            assert took < GPU_TIMEOUT_S + 1, (n, took)
            first_calls.append(round(took, 3))
        elif n > 0:
            assert took < GPU_TIMEOUT_S, (n, took)          # nothing waits for a dead rank twice
        results.append((n, [t.cpu() for t in out[:3]], SimpleNamespace(recv_src=out[3].recv_src.cpu(),
                                                                       lost=out[3].lost.cpu()),
                        y.cpu(), senders, set(dead)))
    for n, out, handle, y, senders, gone in results:
        inputs = [make_inputs(r, tokens, GPU_HIDDEN, GPU_EXPERTS, GPU_TOPK, seed=n, drop=0.1) for r in range(world)]
        try:
            check(rank, world, GPU_EXPERTS, GPU_TOKENS, out + [handle], y, inputs, senders, gone)
        except AssertionError as error:
            raise AssertionError(f"call {n}: {error}") from error
    assert ep.live_ranks() == sorted(set(range(world)) - dead)
    (Path(folder) / f"rank{rank}.json").write_text(json.dumps({"first_calls_s": first_calls, "calls": last}))


@pytest.mark.gpu
@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graph"])
def test_ranks_die_and_the_survivors_go_on(graphed, tmp_path):
    world, schedule = GPU_WORLD, deaths(GPU_WORLD)
    run(_elastic, world, graphed, str(tmp_path), gpu=True, timeout=300, lost=[victim for _, victim, _ in schedule])
    reports = {int(f.stem[4:]): json.loads(f.read_text()) for f in tmp_path.glob("rank*.json")}
    assert sorted(reports) == [0]                     # rank 0 alone went through every call
    for call, victim, point in schedule:
        print(f"{'graph' if graphed else 'eager'}, {world} ranks: rank {victim} died {point} (call {call})")
    print(f"the survivors' first calls after each death took {reports[0]['first_calls_s']} s (timeout_s = "
          f"{GPU_TIMEOUT_S}); rank 0 completed {reports[0]['calls']} calls, {AFTER} after the last death")


def _back_to_back(rank, world):
    """Elastic mode with every rank alive, calls back to back at a decode shape, the ranks in step (a
    barrier before each call, inputs made beforehand), so that receives spin while the peers' signals
    land; fresh inputs every call, so that a row left over from a slot's earlier call shows. Each call
    bit-exact against the oracle, checked after the last."""
    tokens, hidden, experts, topk, calls = 128, 2048, 8 * world, 4, 24
    ep = EPAllToAll(tokens, hidden, experts, topk, fp8_group=GROUP, elastic=True, timeout_s=60.0)
    inputs = [[make_inputs(r, [tokens] * world, hidden, experts, topk, seed=n, drop=0.1) for r in range(world)]
              for n in range(calls)]
    mine = [[t.cuda() for t in call[rank]] for call in inputs]
    results = []
    for n in range(calls):
        dist.barrier()
        *out, handle = ep.dispatch(*mine[n])
        y = ep.combine(expert_fn(out[0], out[1], GROUP, torch.bfloat16), handle)
        results.append(([t.clone() for t in out], handle.recv_src.clone(), handle.lost.clone(), y.clone()))
    for n, (out, recv_src, lost, y) in enumerate(results):
        handle = SimpleNamespace(recv_src=recv_src.cpu(), lost=lost.cpu())
        try:
            check(rank, world, experts, tokens, [t.cpu() for t in out] + [handle], y, inputs[n], range(world), set())
        except AssertionError as error:
            raise AssertionError(f"call {n}: {error}") from error
    ep.destroy()


@pytest.mark.gpu
def test_every_row_read_in_calls_back_to_back():
    """Every warp of a receive reads the same ranks: a wait's warps used to leave their spin loop in
    different polls when a signal landed between their loads, so that a scalar's shared-memory hand-over
    later paired the wrong barriers and some warps skipped their part of a few rows (on one H200, 4
    ranks: this test failed at its first call)."""
    run(_back_to_back, GPU_WORLD, gpu=True, timeout=300)
