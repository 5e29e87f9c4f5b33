"""EPAllToAll's NVSHMEM kernels against the reference on NCCL (all_to_all_single), on 2+ GPUs
(or 2-4 ranks sharing one GPU).

Dispatch is compared bit for bit (FP8 bytes, scales, counts, row sources); combine too,
since both sum in fp32 in the same order (k order, then rank order) without fused
multiply-adds.
"""
import os
import random

import pytest
import torch
import torch.distributed as dist

from cases import expert_fn, make_inputs, tensor_scale
from distributed import gpu_worlds, refused_on_rank_0, run
from moe_ep import CommTimeoutError, EPAllToAll, reference
from moe_ep.ep.low_latency import ONE_LAUNCH_TOKENS
from moe_ep.ep.protocol import MODES
from moe_ep.routing import random_topk

pytestmark = pytest.mark.gpu
MAX_TOKENS = 160
TOKENS = [0, 1, 7, 128, MAX_TOKENS]
# hidden, topk, experts, fp8
CONFIGS = [(2048, 1, 8, True), (2048, 2, 64, False), (2048, 8, 256, True), (4096, 1, 64, True),
           (4096, 2, 256, True), (4096, 8, 8, False), (7168, 1, 256, False), (7168, 2, 8, True),
           (7168, 8, 64, True), (7168, 8, 256, True)]
# MOE_EP_TEST_QUICK=1 (scripts/gpu_suite.sh quick): the sweep over four of them, still covering hidden
# 2048-7168, top-k 1, 2 and 8, 8 and 256 experts, FP8 and not.
SWEEP = [CONFIGS[i] for i in (0, 4, 5, 9)] if os.environ.get("MOE_EP_TEST_QUICK") == "1" else CONFIGS


def check_call(ep, x, ids, weights, straggle=None, out=False, mode="auto"):
    """One dispatch (of `mode`) + toy experts + combine through `ep` and through the reference (quantizing by
    the object's payload format, nvfp4's under the calibrated tensor scale of ``cases.tensor_scale``); assert
    equal. With out=True combine writes a tensor of the caller's."""
    rank, fmt = dist.get_rank(), ep.payload
    scale = tensor_scale(fmt, x.device)
    if straggle is not None and straggle == rank:
        torch.cuda._sleep(2_000_000)
    recv_x, recv_scales, recv_count, handle = ep.dispatch(x, ids, weights, mode=mode, tensor_scale=scale)
    r_x, r_scales, r_count, r_handle = reference.dispatch(x, ids, weights, num_experts=ep.num_experts,
                                                          max_tokens=ep.max_tokens, payload=fmt, tensor_scale=scale)
    if not torch.equal(recv_count, r_count):
        ep.check()                  # a wait that timed out (its kernel skipped the call) raises, naming the peer
    assert torch.equal(recv_count, r_count), (recv_count, r_count)
    valid = torch.arange(recv_x.shape[1], device=x.device)[None, :] < r_count[:, None].long()
    assert torch.equal(recv_x[valid].view(torch.uint8), r_x[valid].view(torch.uint8)), "dispatched rows differ"
    assert torch.equal(handle.recv_src[valid], r_handle.recv_src[valid]), "row sources differ"
    if fmt.group:
        assert recv_scales.dtype == r_scales.dtype, (recv_scales.dtype, r_scales.dtype)
        assert torch.equal(recv_scales[valid].view(torch.uint8), r_scales[valid].view(torch.uint8)), "scales differ"
    if straggle is not None and straggle != rank:
        torch.cuda._sleep(2_000_000)
    given = torch.empty_like(x) if out else None
    y = ep.combine(expert_fn(recv_x, recv_scales, fmt, x.dtype), handle, out=given)
    assert y is given or not out
    y_ref = reference.combine(expert_fn(r_x, r_scales, fmt, x.dtype), r_handle)
    assert torch.equal(y, y_ref), f"combine differs: max {(y.float() - y_ref.float()).abs().max()}"
    return recv_count


def _sweep(rank, world, configs, max_tokens=MAX_TOKENS, token_counts=TOKENS, puts="auto"):
    rng = random.Random(1)
    for hidden, topk, experts, fp8 in configs:
        ep = EPAllToAll(max_tokens, hidden, experts, topk, fp8_dispatch=fp8, puts=puts)
        seed = hidden + topk + experts
        for i in range(len(token_counts)):                 # token counts differ across ranks
            tokens = [token_counts[(i + r) % len(token_counts)] for r in range(world)]
            inputs = make_inputs(rank, tokens, hidden, experts, topk, seed + i, device="cuda")
            check_call(ep, *inputs, straggle=rng.randrange(world + 1), out=i % 2 == 1)
        tokens = [max_tokens] * world
        one = experts - 1                                 # every token to one expert, on the last rank
        counts = check_call(ep, *make_inputs(rank, tokens, hidden, experts, topk, seed, one_expert=one,
                                             device="cuda"))
        if rank == world - 1:
            assert counts[-1] == world * max_tokens
        check_call(ep, *make_inputs(rank, tokens, hidden, experts, topk, seed, drop=0.3, device="cuda"))
        ep.destroy()


@gpu_worlds
@pytest.mark.parametrize("part", [0, 1])
def test_dispatch_combine_sweep(part, world):
    run(_sweep, world, SWEEP[part::2], gpu=True, timeout=600)


def _back_to_back(rank, world, calls, puts="auto"):
    ep = EPAllToAll(64, 2048, 64, 8, validate=False, puts=puts)
    ep.protocol.one_launch_tokens = 32        # "auto" dispatches of more tokens take the prefill tiles
    g = torch.Generator().manual_seed(rank)
    rng, modes = random.Random(5), random.Random(rank)   # every rank its own mode a call
    for call in range(calls):
        tokens = int(torch.randint(0, 65, (1,), generator=g))
        x = torch.randn(tokens, 2048, device="cuda", dtype=torch.bfloat16)
        ids, weights = random_topk(tokens, 64, 8, device="cuda", generator=g)
        if call % 7 == 0:
            ids[torch.rand(ids.shape, device="cuda") < 0.2] = -1
        check_call(ep, x, ids, weights, straggle=rng.randrange(world) if call % 10 == 0 else None,
                   mode=modes.choice(MODES))
    ep.destroy()


@gpu_worlds
def test_back_to_back_calls(world):
    run(_back_to_back, world, 1000, gpu=True, timeout=600)


def _prefill_sized(rank, world, puts="auto"):
    """Calls of more than ONE_LAUNCH_TOKENS tokens: "auto" and "prefill" take the send and receive kernels
    bound with the prefill tiles (a second, partly masked chunk of a 7168-column row), "decode" the one
    launch at any size; ranks mix the modes in one call. The object's layout sorts chunks of 1024 ids; calls
    of at most 128 tokens compare theirs instead (at 150, ranks of 150 tokens sort, ranks of 50 compare)."""
    max_tokens = 600
    ep = EPAllToAll(max_tokens, 7168, 64, 8, puts=puts)
    for i, tokens in enumerate([max_tokens, 0, ONE_LAUNCH_TOKENS + 1, 17, max_tokens, 300, 150]):
        counts = [max(tokens - 100, 0) if (i + r) % 2 else tokens for r in range(world)]
        check_call(ep, *make_inputs(rank, counts, 7168, 64, 8, seed=i, device="cuda"), out=i % 2 == 1,
                   mode=MODES[(i + rank) % len(MODES)])
    ep.destroy()


@gpu_worlds
def test_prefill_sized_calls(world):
    run(_prefill_sized, world, gpu=True, timeout=300)


def _payload_formats(rank, world, puts="auto"):
    """The UE8M0 and NVFP4 payload formats (EPAllToAll(payload=...)): FP8 rows with power-of-two scales packed
    four to an int32 (fp8_ue8m0) or one E8M0 byte per 32 columns (mxfp8), and e2m1 pairs with an e4m3 scale
    per 16 columns under a calibrated per-tensor scale (nvfp4), bit for bit against the reference quantizing
    by the same format; token counts that differ across ranks, ranks in different modes, every token to one
    expert."""
    for name in ("fp8_ue8m0", "mxfp8", "nvfp4"):
        ep = EPAllToAll(128, 7168, 64, 8, payload=name, puts=puts)
        for i in range(4):
            tokens = [(0, 1, 7, 128)[(i + r) % 4] for r in range(world)]
            check_call(ep, *make_inputs(rank, tokens, 7168, 64, 8, seed=i, device="cuda"), out=i % 2 == 1,
                       mode=MODES[(i + rank) % len(MODES)])
        check_call(ep, *make_inputs(rank, [128] * world, 7168, 64, 8, seed=9, one_expert=63, device="cuda"))
        ep.destroy()


@gpu_worlds
def test_payload_formats(world):
    run(_payload_formats, world, gpu=True, timeout=300)


def _hooks_graphs_and_errors(rank, world, puts="auto"):
    hidden, experts, topk = 2048, 64, 8
    ep = EPAllToAll(32, hidden, experts, topk, puts=puts)
    tokens = [32 - r for r in range(world)]
    a = make_inputs(rank, tokens, hidden, experts, topk, seed=1, device="cuda")
    b = make_inputs(rank, tokens, hidden, experts, topk, seed=2, device="cuda")

    # Two dispatches in flight (the second with the prefill tiles), compute in between, then a third is refused.
    *out_a, hook_a = ep.dispatch(*a, return_recv_hook=True)
    *out_b, hook_b = ep.dispatch(*b, return_recv_hook=True, mode="prefill")
    with pytest.raises(ValueError, match="in flight"):
        ep.dispatch(*a)
    with pytest.raises(ValueError, match="receive"):
        ep.combine(torch.zeros_like(out_a[0], dtype=torch.bfloat16), out_a[3])
    torch.randn(2048, 2048, device="cuda") @ torch.randn(2048, 2048, device="cuda")
    hook_a()
    hook_b()
    with pytest.raises(RuntimeError, match="already"):
        hook_a()
    results = []
    for (x, ids, weights), (recv_x, recv_scales, _, handle) in ((a, out_a), (b, out_b)):
        y, hook = ep.combine(expert_fn(recv_x, recv_scales, 128, x.dtype), handle, return_recv_hook=True)
        results.append((y, hook, x, ids, weights))
    for y, hook, x, ids, weights in results:
        hook()
        r_x, r_scales, _, r_handle = reference.dispatch(x, ids, weights, num_experts=experts, max_tokens=32,
                                                        fp8_group=128)
        assert torch.equal(y, reference.combine(expert_fn(r_x, r_scales, 128, x.dtype), r_handle))

    # Bad input: ValueError before any launch, earlier results untouched, the next call fine.
    recv_x, _, recv_count, _ = ep.dispatch(*a)
    kept, calls = recv_x.clone(), (ep._dispatches, ep._combines)
    bad_inputs = {"x has dtype torch.float32": (a[0].float(), a[1], a[2]),
                  "x is on cpu": (a[0].cpu(), a[1], a[2]),
                  r"topk_ids has shape \(\d+, 1\)": (a[0], a[1][:, :1].contiguous(), a[2])}
    for message, bad in bad_inputs.items():
        with pytest.raises(ValueError, match=message):
            ep.dispatch(*bad)
    torch.cuda.synchronize()
    assert torch.equal(recv_x.view(torch.uint8), kept.view(torch.uint8)) and (ep._dispatches, ep._combines) == calls
    check_call(ep, *b)

    # Out-of-range ids are found by the dispatch kernel: dropped like -1, reported by check() (or the next call).
    bad_ids = a[1].clone()
    bad_ids[0, 1] = experts + rank
    dropped = bad_ids.masked_fill(bad_ids >= experts, -1)
    _, _, recv_count, _ = ep.dispatch(a[0], bad_ids, a[2])
    _, _, r_count, _ = reference.dispatch(a[0], dropped, a[2], num_experts=experts, max_tokens=32, fp8_group=128)
    assert torch.equal(recv_count, r_count)
    call = ep._dispatches
    with pytest.raises(ValueError, match=rf"rank {rank}: dispatch call {call} had topk_ids\[0, 1\] = {experts + rank}"):
        ep.check()
    check_call(ep, *b)

    # A CUDA graph of dispatch -> experts -> combine, replayed with fresh inputs.
    static = [t.clone() for t in a]
    check_call(ep, *static)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_x, g_scales, g_count, g_handle = ep.dispatch(*static)
        g_y = ep.combine(expert_fn(g_x, g_scales, 128, torch.bfloat16), g_handle)
    for replay in range(10):
        fresh = make_inputs(rank, tokens, hidden, experts, topk, seed=100 + replay, device="cuda")
        for dst, src in zip(static, fresh):
            dst.copy_(src)
        graph.replay()
        r_x, r_scales, r_count, r_handle = reference.dispatch(*fresh, num_experts=experts, max_tokens=32,
                                                              fp8_group=128)
        assert torch.equal(g_count, r_count)
        assert torch.equal(g_y, reference.combine(expert_fn(r_x, r_scales, 128, torch.bfloat16), r_handle))
    check_call(ep, *b)                                    # eager again after the replays
    ep.destroy()


@gpu_worlds
def test_hooks_graphs_and_bad_input(world):
    run(_hooks_graphs_and_errors, world, gpu=True, timeout=300)


def _timeout(rank, world):
    ep = EPAllToAll(8, 256, 8, 2, timeout_s=0.5)
    if rank == 0:                                         # nobody else dispatches
        ep.dispatch(*make_inputs(0, [8] * world, 256, 8, 2, seed=3, device="cuda"))
        with pytest.raises(CommTimeoutError, match=r"rank 0: dispatch .* waiting for rank [1-9]"):
            ep.check()
        with pytest.raises(CommTimeoutError):
            ep.dispatch(*make_inputs(0, [8] * world, 256, 8, 2, seed=3, device="cuda"))
    ep.destroy()


@gpu_worlds
def test_timeout_raises(world):
    run(_timeout, world, gpu=True, timeout=120)


def _refused_on_rank_0(refuse, call, message: str) -> None:
    """On a fresh object (timeout_s=2, its kernels compiled by a first call): rank 0 refuses a call
    (refuse(ep, inputs)) that rank 1 makes (call(ep, inputs)), which ends on rank 1 in CallRefusedError
    matching `message` within a bound (``distributed.refused_on_rank_0``)."""
    ep = EPAllToAll(8, 256, 8, 2, timeout_s=2.0)
    inputs = make_inputs(ep.rank, [8, 6], 256, 8, 2, seed=6, device="cuda")
    check_call(ep, *inputs)
    refused_on_rank_0(ep, lambda: refuse(ep, inputs), lambda: call(ep, inputs), message)


def _refusals(rank, world):
    """Rank 0 refuses a dispatch (a token too many), then on another object a combine (expert_out of the
    wrong shape); rank 1's call of each ends in CallRefusedError naming rank 0 and why."""
    too_many = make_inputs(0, [9], 256, 8, 2, seed=7, device="cuda")
    _refused_on_rank_0(lambda ep, inputs: ep.dispatch(*too_many), lambda ep, inputs: ep.dispatch(*inputs),
                       r"^dispatch call 2 refused by rank 0: 9 tokens is more than max_tokens=8$")

    def combine(ep, inputs, rows=None):
        recv_x, recv_scales, _, handle = ep.dispatch(*inputs)
        expert_out = expert_fn(recv_x, recv_scales, ep.fp8_group, torch.bfloat16)
        ep.combine(expert_out if rows is None else expert_out[:, :rows].contiguous(), handle)

    _refused_on_rank_0(lambda ep, inputs: combine(ep, inputs, rows=8), combine,
                       r"^combine call 2 refused by rank 0: expert_out has shape \(4, 8, 256\)")


def test_a_refused_call_fails_on_every_rank():
    run(_refusals, 2, gpu=True, timeout=300)


def _never_synchronizes(rank, world):
    """Eager dispatch and combine, with validation and hooks, never wait for the GPU."""
    ep = EPAllToAll(32, 2048, 64, 8, validate=True)
    inputs = make_inputs(rank, [32] * world, 2048, 64, 8, seed=4, device="cuda")
    expert_out = torch.randn(ep.experts_per_rank, world * 32, 2048, device="cuda", dtype=torch.bfloat16)
    check_call(ep, *inputs)                              # compiles every kernel first: one launch per op,
    check_call(ep, *inputs, mode="prefill")              # the prefill tiles,
    *_, handle, hook = ep.dispatch(*inputs, return_recv_hook=True)   # and the send and receive kernels
    hook()
    ep.combine(expert_out, handle, return_recv_hook=True)[1]()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="synchroniz"):   # the mode is on: a host read of the GPU fails
            expert_out.sum().item()
        for _ in range(3):
            *_, handle = ep.dispatch(*inputs)
            ep.combine(expert_out, handle)
            *_, handle = ep.dispatch(*inputs, mode="prefill")
            *_, handle, hook = ep.dispatch(*inputs, return_recv_hook=True)
            hook()
            _, hook = ep.combine(expert_out, handle, return_recv_hook=True)
            hook()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ep.check()
    ep.destroy()


@gpu_worlds
def test_eager_calls_never_synchronize(world):
    run(_never_synchronizes, world, gpu=True, timeout=300)
