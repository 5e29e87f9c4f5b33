"""What the engine integrations rely on, without any engine: combine(..., out=), the shared all-to-alls'
teardown, the elastic ones' live mask and the package layout.

combine writes the caller's tensor when given one (the engines' output), after checking it, and the
result is the one combine returns without out; destroy_all_to_alls destroys what all_to_all shared, and
destroy() may be called again; all_to_all builds elastic all-to-alls apart from plain ones, and live_mask
reads their masks together; `import moe_ep` pulls in no engine.
"""
import subprocess
import sys

import pytest
import torch

from distributed import run
from moe_ep import EPAllToAll, integrations, random_topk
from moe_ep.integrations import all_to_all, destroy_all_to_alls, elastic_all_to_alls, live_mask


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


def test_import_needs_no_engine():
    code = ("import sys; sys.modules['vllm'] = None; sys.modules['sglang'] = None; import moe_ep, "
            "moe_ep.integrations.transformers; print(moe_ep.swap_moe.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["moe_ep.integrations.transformers"]
