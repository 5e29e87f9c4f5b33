"""The reference backend (torch.distributed all_to_all_single) against a token-by-token oracle, on gloo."""
import pytest
import torch
import torch.distributed as dist

from cases import expected_combine, expected_dispatch, expert_fn, make_inputs
from distributed import run
from moe_ep import EPAllToAll, reference
from moe_ep.formats import FORMATS

# (tokens per rank, hidden, experts, topk, fp8 group or None, drop, one_expert)
CASES = [
    ((5, 0, 3, 7), 256, 8, 2, 128, 0.0, None),
    ((4, 4, 4, 4), 64, 16, 4, None, 0.25, None),
    ((1, 6, 0, 2), 128, 8, 1, 64, 0.0, 3),
    ((6, 6, 6, 6), 128, 32, 8, 128, 0.1, 17),
    ((0, 3, 2, 0), 128, 8, 2, 128, 0.0, None),     # ranks without tokens, one FP8 group a row
]


def _round_trip(rank, world, case):
    tokens, hidden, experts, topk, group, drop, one_expert = case
    tokens = (tokens * 2)[:world]
    max_tokens = max(tokens) + 1
    inputs = [make_inputs(r, tokens, hidden, experts, topk, seed=7, drop=drop, one_expert=one_expert)
              for r in range(world)]
    ep = EPAllToAll(max_tokens, hidden, experts, topk, fp8_dispatch=group is not None, fp8_group=group or 128,
                    backend="reference")
    x, ids, weights = inputs[rank]
    recv_x, recv_scales, recv_count, handle = ep.dispatch(x, ids, weights)

    expected = expected_dispatch(rank, world, inputs, experts, max_tokens, group)
    assert recv_count.tolist() == [len(rows) for rows in expected]
    for e, rows in enumerate(expected):
        for i, (payload, scales, source) in enumerate(rows):
            assert torch.equal(recv_x[e, i].view(torch.uint8), payload.view(torch.uint8)), (e, i)
            if group:
                assert torch.equal(recv_scales[e, i], scales), (e, i)
            assert int(handle.recv_src[e, i]) == source
        assert (handle.recv_src[e, len(rows):] == -1).all()
    assert (recv_scales is None) == (group is None)

    y = ep.combine(expert_fn(recv_x, recv_scales, group, x.dtype), handle)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert torch.equal(y, expected_combine(rank, world, inputs, experts, group, x.dtype))


def _round_trips(rank, world, cases):
    for case in cases:
        _round_trip(rank, world, case)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_reference_round_trip(world, case):
    run(_round_trips, world, [CASES[case]])


def test_reference_round_trips_at_8_ranks():
    run(_round_trips, 8, CASES)              # one job for every case: starting 8 processes is the slow part


def test_dispatch_refuses_a_tensor_scale_it_would_not_use():
    """A tensor_scale without a payload (fp8_group or none) or with a format without a per-tensor scale is
    refused before any collective (there is no process group here)."""
    x, ids, weights = make_inputs(0, [3], 256, 8, 2, seed=0)
    for kwargs, why in ((dict(fp8_group=128), r"without a payload \(fp8_group=128\) dispatch takes none"),
                        (dict(), r"without a payload \(fp8_group=None\) dispatch takes none"),
                        (dict(payload=FORMATS["fp8"]), "payload 'fp8' has none"),
                        (dict(payload=FORMATS["bf16"]), "payload 'bf16' has none")):
        with pytest.raises(ValueError, match=r"tensor_scale is for a payload format with a per-tensor scale "
                                             r"\(nvfp4\); " + why):
            reference.dispatch(x, ids, weights, num_experts=8, max_tokens=4, tensor_scale=torch.ones(1), **kwargs)


def _collectives(rank, world):
    """moe_ep.reference's collectives against the results they must give (gloo, CPU tensors)."""
    x = torch.arange(4, dtype=torch.float32) + 10 * rank
    total = x.clone()
    reference.all_reduce(total)
    assert torch.equal(total, sum(torch.arange(4, dtype=torch.float32) + 10 * r for r in range(world)))
    biggest = x.clone()
    reference.all_reduce(biggest, op=dist.ReduceOp.MAX)
    assert torch.equal(biggest, torch.arange(4, dtype=torch.float32) + 10 * (world - 1))
    gathered = torch.empty(world * 4)
    reference.all_gather_into_tensor(gathered, x)
    assert torch.equal(gathered, torch.cat([torch.arange(4, dtype=torch.float32) + 10 * r for r in range(world)]))
    rows = torch.arange(world * 2, dtype=torch.float32) * (rank + 1)
    mine = torch.empty(2)
    reference.reduce_scatter_tensor(mine, rows)
    assert torch.equal(mine, torch.arange(rank * 2, rank * 2 + 2, dtype=torch.float32) * sum(range(1, world + 1)))
    sent = torch.full((world,), float(rank))
    received = torch.empty(world)
    reference.all_to_all_single(received, sent)
    assert torch.equal(received, torch.arange(world, dtype=torch.float32))


def test_collectives():
    run(_collectives, 3)
