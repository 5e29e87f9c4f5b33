"""A call that one rank refuses on the nvshmem backend fails on every rank that made it.

In the Triton interpreter (CPU) every rank lives in one process (EPAllToAll.simulated). Rank 0 refuses a
call (a bad argument, or the out-of-range id its previous dispatch saw); rank 1 makes it, and its wait for
rank 0 ends at timeout_s: check() then raises CallRefusedError naming rank 0 and its reason (from the
CommTimeoutError) instead of the bare timeout, and the object stays broken, as after any timeout, with the
refusal in its message. Calls before the refusal are compared bit for bit with the oracle of tests/cases.py.
"""
import os
import time

import pytest
import torch

from cases import expected_combine, expected_dispatch, expert_fn, make_inputs
from distributed import assert_broken_by
from moe_ep import CallRefusedError, CommTimeoutError, EPAllToAll

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="runs the kernels in the Triton interpreter, on CPU-only machines")
TOKENS, HIDDEN, EXPERTS, TOPK, GROUP, TIMEOUT_S = 4, 128, 4, 2, 64, 2.0
SLACK_S = 30         # the interpreter's own work, beyond the one timeout


def world():
    return EPAllToAll.simulated(2, TOKENS, HIDDEN, EXPERTS, TOPK, fp8_group=GROUP, timeout_s=TIMEOUT_S)


def inputs(seed):
    return [make_inputs(r, [TOKENS, TOKENS - 1], HIDDEN, EXPERTS, TOPK, seed=seed) for r in range(2)]


def dispatch(ranks, given):
    """Rank 0 sends (receive hook), rank 1 dispatches in one launch, then rank 0 receives: each rank's outputs
    against the oracle. Returns them."""
    first = ranks[0].dispatch(*given[0], return_recv_hook=True)
    outs = [first[:4], ranks[1].dispatch(*given[1])]
    first[4]()
    for r, (recv_x, recv_scales, recv_count, handle) in enumerate(outs):
        expected = expected_dispatch(r, 2, given, EXPERTS, TOKENS, GROUP)
        assert recv_count.tolist() == [len(rows) for rows in expected], r
        for e, rows in enumerate(expected):
            for i, (payload, scales, source) in enumerate(rows):
                assert torch.equal(recv_x[e, i].view(torch.uint8), payload.view(torch.uint8)), (r, e, i)
                assert torch.equal(recv_scales[e, i], scales) and int(handle.recv_src[e, i]) == source, (r, e, i)
    return outs


def combine(ranks, given, outs):
    """Both ranks' combines (rank 0's with a receive hook, after rank 1's) against the oracle."""
    expert_outs = [expert_fn(out[0], out[1], GROUP, torch.bfloat16) for out in outs]
    y0, hook = ranks[0].combine(expert_outs[0], outs[0][3], return_recv_hook=True)
    ys = [y0, ranks[1].combine(expert_outs[1], outs[1][3])]
    hook()
    for r, y in enumerate(ys):
        assert torch.equal(y, expected_combine(r, 2, given, EXPERTS, GROUP, torch.bfloat16)), r


def broken_by(ep, what):
    """assert_broken_by with a later dispatch of `ep`."""
    assert_broken_by(ep, what, lambda: ep.dispatch(*inputs(seed=9)[ep.rank]))


def test_a_refused_dispatch_fails_on_the_rank_that_made_it():
    """Rank 0 passes one token too many; rank 1's dispatch times out and check() names rank 0 and why, once;
    from then on its object says what broke it."""
    ranks = world()
    given = inputs(seed=0)
    too_many = make_inputs(0, [TOKENS + 1], HIDDEN, EXPERTS, TOPK, seed=1)
    with pytest.raises(ValueError, match=f"{TOKENS + 1} tokens is more than max_tokens={TOKENS}") as own:
        ranks[0].dispatch(*too_many)
    assert type(own.value) is ValueError                    # the refusing rank's own error, as ever
    started = time.monotonic()
    ranks[1].dispatch(*given[1])
    with pytest.raises(CallRefusedError, match=rf"^dispatch call 1 refused by rank 0: {TOKENS + 1} tokens is more "
                                               rf"than max_tokens={TOKENS}$") as refused:
        ranks[1].check()
    assert TIMEOUT_S <= time.monotonic() - started < TIMEOUT_S + SLACK_S
    assert refused.value.refusals == {0: f"{TOKENS + 1} tokens is more than max_tokens={TOKENS}"}
    assert isinstance(refused.value.__cause__, CommTimeoutError)
    assert [ep._dispatches for ep in ranks] == [0, 1]
    assert not ranks[1]._symmetric[ranks[1].REFUSALS].any()          # the note is consumed
    broken_by(ranks[1], "dispatch call 1")


@pytest.mark.parametrize("hook", [False, True])
def test_a_refused_combine_fails_on_the_rank_that_made_it(hook):
    """After a dispatch of both ranks, rank 0 refuses its combine (expert_out of the wrong shape); rank 1's
    combine (in one launch, or its send and then its receive hook) times out and check() names rank 0 and
    why."""
    ranks = world()
    given = inputs(seed=2)
    outs = dispatch(ranks, given)
    wrong = torch.zeros(EXPERTS // 2, TOKENS, HIDDEN, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="expert_out has shape"):
        ranks[0].combine(wrong, outs[0][3])
    started = time.monotonic()
    expert_out = expert_fn(outs[1][0], outs[1][1], GROUP, torch.bfloat16)
    if hook:
        ranks[1].combine(expert_out, outs[1][3], return_recv_hook=True)[1]()
    else:
        ranks[1].combine(expert_out, outs[1][3])
    with pytest.raises(CallRefusedError, match=r"^combine call 1 refused by rank 0: expert_out has shape "
                                               rf"\({EXPERTS // 2}, {TOKENS}, {HIDDEN}\)"):
        ranks[1].check()
    assert TIMEOUT_S <= time.monotonic() - started < TIMEOUT_S + SLACK_S
    broken_by(ranks[1], "combine call 1")


def test_an_out_of_range_id_refuses_the_next_call_on_every_rank():
    """validate=True: rank 0's dispatch drops an id outside [-1, E) and its next dispatch raises the ValueError
    naming it; rank 1's next dispatch (its send, then its receive hook) then names rank 0 and that reason
    (raised by its next call, which does not run)."""
    ranks = world()
    given = inputs(seed=4)
    bad = [(x, ids.clone(), w) for x, ids, w in given]
    bad[0][1][1, 0] = EXPERTS + 3
    dropped = [(x, ids.masked_fill(ids >= EXPERTS, -1), w) for x, ids, w in bad]
    outs = [ep.dispatch(*bad[r], return_recv_hook=True) for r, ep in enumerate(ranks)]
    for *_, receive in outs:
        receive()
    for r, (_, _, recv_count, _, _) in enumerate(outs):
        assert recv_count.tolist() == [len(rows) for rows in expected_dispatch(r, 2, dropped, EXPERTS, TOKENS, GROUP)]
    reason = rf"rank 0: dispatch call 1 had topk_ids\[1, 0\] = {EXPERTS + 3}, outside \[-1, {EXPERTS}\)"
    with pytest.raises(ValueError, match=reason):
        ranks[0].dispatch(*given[0])
    started = time.monotonic()
    *_, receive = ranks[1].dispatch(*given[1], return_recv_hook=True)
    receive()
    with pytest.raises(CallRefusedError, match="^dispatch call 2 refused by rank 0: " + reason):
        ranks[1].dispatch(*given[1])
    assert TIMEOUT_S <= time.monotonic() - started < TIMEOUT_S + SLACK_S
    broken_by(ranks[1], "dispatch call 2")


def test_a_timeout_without_a_refusal_still_breaks_the_object():
    """Rank 0 makes no call and refused none: rank 1's dispatch ends in CommTimeoutError, now and later."""
    ranks = world()
    ranks[1].dispatch(*inputs(seed=5)[1])
    with pytest.raises(CommTimeoutError, match="rank 1: dispatch .* waiting for rank 0"):
        ranks[1].check()
    with pytest.raises(CommTimeoutError):
        ranks[1].dispatch(*inputs(seed=5)[1])
