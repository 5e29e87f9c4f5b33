"""What the engine integrations rely on, without any engine: combine(..., out=), the shared all-to-alls'
teardown, the elastic ones' live mask and the package layout.

combine writes the caller's tensor when given one (the engines' output), after checking it, and the
result is the one combine returns without out; destroy_all_to_alls destroys what all_to_all shared, and
destroy() may be called again; all_to_all builds elastic all-to-alls apart from plain ones and one per
payload format (fp8=True is payload "fp8"), refusing a payload dispatch does not apply, and live_mask
reads their masks together, and mask_inactive masks in an all-to-all the ranks an engine's mask counts
inactive; mn_major lays scales out MN-major; `import moe_ep` pulls in no engine.
"""
import os
import subprocess
import sys
import time

import pytest
import torch

from cases import expected_combine, expert_fn, make_inputs, on_ranks
from distributed import run
from moe_ep import EPAllToAll, integrations, random_topk
from moe_ep.integrations import all_to_all, destroy_all_to_alls, elastic_all_to_alls, live_mask, mn_major

INTERPRETED = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="runs the kernels in the Triton interpreter, on CPU-only machines")


def _combine_into_out(rank, world):
    ep = EPAllToAll(max_tokens=4, hidden=16, num_experts=4, topk=2, dtype=torch.float32, fp8_dispatch=False,
                    backend="reference")
    for tokens in (3, 0, 1):
        x = torch.randn(tokens, 16)
        ids, weights = random_topk(tokens, 4, 2)
        if tokens:
            ids[0, 1] = -1                                       # a dropped slot
        recv_x, _, _, handle = ep.dispatch(x, ids, weights)
        expected = ep.combine(recv_x * 2, handle)
        recv_x, _, _, handle = ep.dispatch(x, ids, weights)
        out = torch.full((tokens, 16), float("nan"))
        y, hook = ep.combine(recv_x * 2, handle, return_recv_hook=True, out=out)
        hook()
        assert y is out
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
    recv_x, _, _, handle = ep.dispatch(x, ids, weights)
    for bad, message in ((torch.empty(1, 16, dtype=torch.bfloat16), "out has dtype"),
                         (torch.empty(2, 16), r"out has shape \(2, 16\), expected \(1, 16\)"),
                         (torch.empty(1, 32)[:, ::2], "out must be contiguous")):
        with pytest.raises(ValueError, match=message):
            ep.combine(recv_x, handle, out=bad)
    ep.destroy()


def test_combine_writes_out():
    run(_combine_into_out, 2)


def _shared_all_to_alls_are_destroyed(rank, world):
    shared = all_to_all(4, 16, 4, 2, torch.float32, False, backend="reference")
    assert all_to_all(4, 16, 4, 2, torch.float32, False, backend="reference") is shared
    destroy_all_to_alls()
    destroy_all_to_alls()
    with pytest.raises(RuntimeError, match="was destroyed"):
        shared.dispatch(torch.randn(1, 16), *random_topk(1, 4, 2))
    shared.destroy()                                             # again: nothing left to free
    assert all_to_all(4, 16, 4, 2, torch.float32, False, backend="reference") is not shared
    destroy_all_to_alls()


def test_shared_all_to_alls_are_destroyed():
    run(_shared_all_to_alls_are_destroyed, 2)


def test_elastic_all_to_alls_and_their_live_mask(monkeypatch):
    """all_to_all keys elastic mode apart; elastic_all_to_alls lists the elastic ones (this rank of simulated
    worlds here); live_mask is 0 where any of them masked a rank, read on the device."""
    monkeypatch.setattr(integrations, "_ALL_TO_ALLS", {})
    monkeypatch.setattr(integrations, "EPAllToAll", lambda max_tokens, hidden, num_experts, topk, elastic, **kwargs:
                        EPAllToAll.simulated(3, max_tokens, hidden, num_experts, topk, elastic=elastic)[0])
    first = all_to_all(4, 128, 6, 2, torch.bfloat16, True, elastic=True)
    plain = all_to_all(4, 128, 6, 2, torch.bfloat16, True)
    second = all_to_all(4, 256, 6, 2, torch.bfloat16, True, elastic=True)
    assert not plain.elastic and all_to_all(4, 128, 6, 2, torch.bfloat16, True, elastic=True) is first
    assert elastic_all_to_alls() == [first, second]
    assert live_mask([first, second]).tolist() == [1, 1, 1]
    second.mask_ranks([2])
    assert live_mask([first, second]).tolist() == [1, 1, 0] and first.live_ranks() == [0, 1, 2]


def test_all_to_all_takes_a_payload(monkeypatch):
    """all_to_all keys the payload format apart (this rank of simulated worlds here): fp8=True is payload "fp8",
    neither is the activation dtype's; fp8=True with another payload is refused naming it."""
    monkeypatch.setattr(integrations, "_ALL_TO_ALLS", {})
    monkeypatch.setattr(integrations, "EPAllToAll", lambda max_tokens, hidden, num_experts, topk, **kwargs:
                        EPAllToAll.simulated(2, max_tokens, hidden, num_experts, topk, dtype=kwargs["dtype"],
                                             fp8_dispatch=kwargs["fp8_dispatch"], fp8_group=kwargs["fp8_group"],
                                             payload=kwargs["payload"])[0])
    shape = (4, 512, 4, 2, torch.bfloat16)
    fp8 = all_to_all(*shape, True)
    assert fp8.payload.name == "fp8" and all_to_all(*shape, payload="fp8") is fp8
    assert all_to_all(*shape).payload.name == "bf16"
    for name in ("fp8_ue8m0", "mxfp8", "nvfp4"):
        ep = all_to_all(*shape, payload=name)
        assert ep.payload.name == name and ep is not fp8 and all_to_all(*shape, payload=name) is ep
    with pytest.raises(ValueError, match="fp8=True asks for payload 'fp8', payload asks for 'mxfp8'"):
        all_to_all(*shape, True, payload="mxfp8")


def test_mn_major():
    """mn_major keeps the values of [E, M, G] and lays them out with strides (M * G, 1, M), G = 1 included."""
    for groups in (1, 3):
        scales = torch.arange(2 * 5 * groups, dtype=torch.int32).view(2, 5, groups)
        laid = mn_major(scales)
        assert torch.equal(laid, scales) and laid.stride() == (5 * groups, 1, 5)


@INTERPRETED
def test_a_rank_the_engine_marks_inactive_is_not_waited_for():
    """An engine's mask of active ranks (SGLang's active_ranks) says rank 2 of a simulated world of 3 is gone
    before it fails any wait: after mask_inactive the survivors' call completes at once, without rank 2's
    experts (handle.lost names them), and the engine's mask is left as it was. While a call is in flight
    mask_inactive does nothing; keep_ranks itself refuses then, and off elastic all-to-alls."""
    world, tokens, hidden, experts, topk, group = 3, [3, 4, 2], 128, 6, 2, 64
    ranks = EPAllToAll.simulated(world, 4, hidden, experts, topk, fp8_group=group, timeout_s=30.0, elastic=True)
    active = torch.tensor([1, 1, 0], dtype=torch.int32)
    for ep in ranks[:2]:
        integrations.mask_inactive(ep, active)
    assert active.tolist() == [1, 1, 0]
    inputs = [make_inputs(r, tokens, hidden, experts, topk, seed=0) for r in range(world)]
    started = time.monotonic()
    outs = {r: ranks[r].dispatch(*inputs[r], return_recv_hook=True) for r in (0, 1)}
    integrations.mask_inactive(ranks[0], torch.tensor([1, 0, 1], dtype=torch.int32))   # in flight: nothing
    with pytest.raises(ValueError, match="in flight"):
        ranks[0].keep_ranks(torch.tensor([1, 0, 1], dtype=torch.int32))
    for r in (0, 1):
        outs[r][-1]()
    combined = {r: ranks[r].combine(expert_fn(outs[r][0], outs[r][1], group, torch.bfloat16), outs[r][3],
                                    return_recv_hook=True) for r in (0, 1)}
    for r in (0, 1):
        combined[r][1]()
    assert time.monotonic() - started < 30.0, "nobody waited for the rank the engine marked inactive"
    without = [(x, ids.masked_fill(on_ranks(ids, {2}, experts, world), -1), w) for x, ids, w in inputs]
    for r in (0, 1):
        assert torch.equal(combined[r][0], expected_combine(r, world, without, experts, group, torch.bfloat16)), r
        assert torch.equal(outs[r][3].lost, on_ranks(inputs[r][1], {2}, experts, world)), r
        assert ranks[r].live_ranks() == [0, 1]
    plain = EPAllToAll.simulated(1, 4, hidden, experts, topk)[0]
    with pytest.raises(ValueError, match="keep_ranks needs EPAllToAll\\(..., elastic=True\\)"):
        plain.keep_ranks(torch.ones(1, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"live has shape \(2,\), expected \(3,\)"):
        ranks[0].keep_ranks(torch.ones(2, dtype=torch.int32))


def test_import_needs_no_engine():
    code = ("import sys; sys.modules['vllm'] = None; sys.modules['sglang'] = None; import moe_ep, "
            "moe_ep.integrations.transformers; print(moe_ep.swap_moe.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["moe_ep.integrations.transformers"]
