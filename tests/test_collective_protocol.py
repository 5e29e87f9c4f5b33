"""The torch.distributed protocol (backend="reference", ``moe_ep.ep.collective``) against the oracle
(``moe_ep.reference``), bit for bit, on fresh random inputs over gloo at 1 to 4 ranks."""
from dataclasses import dataclass, replace

import pytest
import torch

from cases import bits, make_inputs, tensor_scale
from distributed import run
from moe_ep import EPAllToAll, reference
from moe_ep.ep.collective import CollectiveProtocol, RowFormat, index_dtype
from moe_ep.ep.protocol import EPConfig
from moe_ep.formats import FORMATS, format_of


@dataclass(frozen=True)
class Case:
    tokens: tuple[int, ...]          # per rank, repeated to the world size
    hidden: int
    experts: int                     # a multiple of 12: every world of 1 to 4 ranks
    topk: int
    fp8_group: int | None            # None: the payload is x's dtype
    dtype: torch.dtype = torch.bfloat16
    drop: float = 0.0                # share of slots dropped (-1)
    one_expert: int | None = None    # every token picks this expert
    weights_dtype: torch.dtype = torch.float32
    ids_dtype: torch.dtype = torch.int64
    unchecked_ids: bool = False      # validate=False, with ids out of range and repeated within a token
    payload: str | None = None       # a payload format by name, in place of fp8_group


CASES = [
    Case((5, 0, 3, 7), 256, 12, 2, 128),                                         # a rank without tokens
    Case((1, 1, 1, 1), 128, 24, 4, 64, torch.float16, 0.3, weights_dtype=torch.bfloat16, ids_dtype=torch.int32),
    Case((6, 6, 6, 6), 64, 12, 1, None, one_expert=5),                           # every token to one expert
    Case((8, 3, 0, 8), 256, 48, 8, 128, torch.float32, 0.2, 7, torch.float16),   # max_tokens tokens
    Case((4, 7, 2, 5), 64, 24, 3, None, torch.float32, 0.5, ids_dtype=torch.int32),
    Case((3, 9, 1, 6), 64, 12, 2, None, torch.float16, weights_dtype=torch.bfloat16),
    Case((2, 4, 4, 0), 128, 12, 4, 32, drop=1.0),                                # every slot dropped
    Case((5, 2, 6, 3), 64, 24, 6, 64, torch.float16, 0.2, unchecked_ids=True),
    Case((3, 2, 4, 1), 512, 12, 2, None, payload="fp8_ue8m0"),                  # packed UE8M0 scales
    Case((2, 5, 0, 3), 128, 24, 3, None, torch.float16, 0.2, payload="mxfp8"),  # e8m0 scales
    Case((4, 0, 1, 6), 208, 12, 2, None, torch.float32, 0.2, payload="nvfp4"),  # e2m1 pairs, e4m3 scales
    Case((6, 6, 6, 6), 64, 12, 3, None, one_expert=7, payload="nvfp4"),         # every token to one expert
]


def _inputs(case, rank, world, seed):
    tokens = (case.tokens * 4)[:world]
    x, ids, weights = make_inputs(rank, tokens, case.hidden, case.experts, case.topk, seed=seed, dtype=case.dtype,
                                  drop=case.drop, one_expert=case.one_expert)
    if len(x) > 1:                  # a zero token (amax at its floor) and a tiny one
        x[0] = 0
        x[-1] *= 1e-6
    if case.unchecked_ids and len(x):
        ids[:, 1] = ids[:, 0]
        ids[0, 0], ids[-1, -1] = case.experts + 3, -5
    return x, ids.to(case.ids_dtype), weights.to(case.weights_dtype), max(tokens)


def _compare(rank, world, cases, seed):
    """Two dispatches in flight (both slots), then their combines, with and without `out`: every output the
    same bits as the oracle's."""
    for case in cases:
        calls = [_inputs(case, rank, world, seed + call) for call in range(2)]
        max_tokens = calls[0][3]
        ep = EPAllToAll(max_tokens, case.hidden, case.experts, case.topk, dtype=case.dtype,
                        fp8_dispatch=case.fp8_group is not None or case.payload is not None,
                        fp8_group=case.fp8_group or 128,
                        backend="reference", validate=not case.unchecked_ids, payload=case.payload)
        payload = FORMATS[case.payload] if case.payload else None
        scale = tensor_scale(payload)
        assert isinstance(ep.protocol, CollectiveProtocol)
        outs = [ep.dispatch(x, ids, weights, tensor_scale=scale) for x, ids, weights, _ in calls]
        oracles = [reference.dispatch(x, ids, weights, num_experts=case.experts, max_tokens=max_tokens,
                                      fp8_group=case.fp8_group, payload=payload, tensor_scale=scale)
                   for x, ids, weights, _ in calls]
        g = torch.Generator().manual_seed(seed * 31 + rank)
        for (x, *_), (recv_x, recv_scales, recv_count, handle), (r_x, r_scales, r_count, r_handle) in zip(
                calls, outs, oracles):
            assert recv_count.dtype == torch.int32 and torch.equal(recv_count, r_count), case
            assert recv_x.dtype == r_x.dtype and recv_x.shape == r_x.shape
            assert (recv_scales is None) == (r_scales is None) == (case.fp8_group is None and payload is None)
            assert recv_scales is None or recv_scales.dtype == r_scales.dtype
            for e, count in enumerate(recv_count.tolist()):
                assert torch.equal(bits(recv_x[e, :count]), bits(r_x[e, :count])), (case, e)
                if recv_scales is not None:
                    assert torch.equal(bits(recv_scales[e, :count]), bits(r_scales[e, :count])), (case, e)
            assert torch.equal(handle.recv_src, r_handle.recv_src), case

            expert_out = (torch.randn(*r_x.shape[:2], case.hidden, generator=g) * 3).to(case.dtype)
            want = reference.combine(expert_out, r_handle)
            y = ep.combine(expert_out, handle)
            assert y.dtype == x.dtype and y.shape == x.shape
            assert torch.equal(bits(y), bits(want)), case
            out = torch.full_like(x, float("nan"))
            assert ep.combine(expert_out, handle, out=out) is out
            assert torch.equal(bits(out), bits(want)), case
        ep.destroy()


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_matches_the_oracle(world):
    run(_compare, world, CASES, 11 * world)


def test_row_format():
    """Each field comes back as it was packed, at every alignment the narrow index types make."""
    assert [index_dtype(b) for b in (1, 128, 129, 32768, 32769)] == \
        [torch.int8, torch.int8, torch.int16, torch.int16, torch.int32]
    config = EPConfig(world=2, rank=0, max_tokens=300, hidden=64, num_experts=4, topk=3, dtype=torch.bfloat16,
                      payload=format_of(True, 32, torch.bfloat16), timeout_s=1.0, validate=True, timing=False)
    fmt = RowFormat.of(config)
    assert fmt.nbytes == 64 + 2 * 4 + 3 * 4 + 2 + 3
    nvfp4 = RowFormat.of(replace(config, payload=FORMATS["nvfp4"]))
    assert nvfp4.nbytes == 64 // 2 + 64 // 16 + 3 * 4 + 2 + 3           # e2m1 pairs, one e4m3 scale a group
    for rows in (0, 1, 5):
        parts = dict(payload=torch.randn(rows, 64).to(torch.float8_e4m3fn), scales=torch.rand(rows, 2),
                     weights=torch.rand(rows, 3), token=torch.arange(rows) * 50,
                     experts=torch.randint(-1, 2, (rows, 3)))
        packed = fmt.pack(rows, **parts)
        assert packed.dtype == torch.uint8 and packed.shape == (rows, fmt.nbytes)
        for name, got in fmt.unpack(packed).items():
            assert torch.equal(bits(got.reshape(parts[name].shape)), bits(parts[name].to(got.dtype))), name
