"""Elastic EP: a rank stops, the others mask it and go on.

In the Triton interpreter (CPU) every rank lives in one process (EPAllToAll.simulated): a rank "dies"
by making no further call, at one of three points of a call: before its dispatch, after its dispatch's
send (its receive never runs), or after its whole dispatch (before its combine). The survivors' first
call waits timeout_s for it, marks it dead and completes; every call is compared bit for bit with the
oracle of tests/cases.py run without the dead rank's experts (their ids dropped), and handle.lost with
the experts that were on it.
"""
import os
import time

import pytest
import torch

from cases import expected_combine, expected_dispatch, expert_fn, make_inputs
from moe_ep import EPAllToAll
from moe_ep.runtime import CommTimeoutError

INTERPRETED = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="runs the kernels in the Triton interpreter, on CPU-only machines")
HIDDEN, EXPERTS, TOPK, GROUP, TIMEOUT_S = 128, 12, 3, 64, 4.0


def without(inputs, dead, world):
    """The inputs with every expert id on a rank of `dead` dropped (-1): what the survivors' results equal."""
    per_rank = EXPERTS // world
    return [(x, ids.masked_fill((ids >= 0) & torch.isin(ids // per_rank, torch.tensor(sorted(dead))), -1), w)
            for x, ids, w in inputs]


def check(ranks, live, senders, inputs, outs, combined, dead, max_tokens):
    """Every survivor's dispatch (the rows of `senders`) and combine against the oracle; handle.lost against
    the dead ranks' experts."""
    world = len(ranks)
    per_rank = EXPERTS // world
    sent = [inp if r in senders else (inp[0][:0], inp[1][:0], inp[2][:0]) for r, inp in enumerate(inputs)]
    for r in live:
        recv_x, recv_scales, recv_count, handle = outs[r][:4]
        expected = expected_dispatch(r, world, sent, EXPERTS, max_tokens, GROUP)
        assert recv_count.tolist() == [len(rows) for rows in expected], r
        for e, rows in enumerate(expected):
            for i, (payload, scales, source) in enumerate(rows):
                assert torch.equal(recv_x[e, i].view(torch.uint8), payload.view(torch.uint8)), (r, e, i)
                assert torch.equal(recv_scales[e, i], scales) and int(handle.recv_src[e, i]) == source, (r, e, i)
        assert torch.equal(combined[r], expected_combine(r, world, without(inputs, dead, world), EXPERTS, GROUP,
                                                         torch.bfloat16)), r
        ids = inputs[r][1]
        lost = (ids >= 0) & torch.isin(ids // per_rank, torch.tensor(sorted(dead) or [-1]))
        assert torch.equal(handle.lost, lost), r


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
    for n in range(4):
        inputs = [make_inputs(r, [max_tokens, 3, 0, 4][:world], HIDDEN, EXPERTS, TOPK, seed=n, drop=0.2)
                  for r in everyone]
        started = time.monotonic()
        if n == 0:
            outs, combined, senders = call(ranks, everyone, inputs)
        else:
            outs, combined, senders = call(ranks, survivors, inputs, *((victim, point) if n == 1 else ()))
        took = time.monotonic() - started
        check(ranks, survivors if n else everyone, senders, inputs, outs, combined, {victim} if n else set(),
              max_tokens)
        if n == 1:
            assert TIMEOUT_S <= took < TIMEOUT_S + 30, took      # one timeout, plus the interpreter's work
        elif n > 1:                 # the victim is masked on every survivor: nothing waits for it any more
            assert took < TIMEOUT_S, (n, took)
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
        check(ranks, live, senders, inputs, outs, combined, {1} if n else set(), max_tokens)
    assert [ranks[r].live_ranks() for r in range(world)] == [survivors, [0, 1, 2], survivors]


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
    ep = EPAllToAll.simulated(3, 4, HIDDEN, EXPERTS, TOPK, elastic=True)[0]
    for bad, message in (([0], "cannot mask itself"), ([3], "ints in"), (["1"], "ints in")):
        with pytest.raises(ValueError, match=message):
            ep.mask_ranks(bad)
    assert ep.live_ranks() == [0, 1, 2]
