"""The EP kernels, all ranks in one process, in the Triton interpreter (CPU).

Each simulated rank is an EPAllToAll whose "symmetric" buffers are plain CPU tensors
(EPAllToAll.simulated); the peer tables hold every rank's addresses, which is all the kernels
see of NVSHMEM. Sends run for every rank before any receive (receive hooks; one rank per call
calls without them, after the others' sends), so no wait ever spins. Ranks take different
dispatch modes in the same call. Everything is compared bit for bit, FP8 bytes included
(moe_ep.kernels.quant.to_fp8 rounds exactly there).
"""
import dataclasses
import os

import pytest
import torch

from cases import bits, expected_combine, expected_dispatch, expert_fn, make_inputs, tensor_scale
from moe_ep import CommTimeoutError, EPAllToAll, launcher
from moe_ep.ep import low_latency, protocol
from moe_ep.ep.protocol import MODES
from moe_ep.formats import FORMATS, PayloadFormat

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="runs the kernels in the Triton interpreter, on CPU-only machines")


def simulated_world(world, max_tokens, hidden, experts, topk, group, timing=False, puts="auto", nodes=1):
    """group: the FP8 group (None: no FP8) or a PayloadFormat, as ``cases.quantize`` takes it."""
    if isinstance(group, PayloadFormat):
        return EPAllToAll.simulated(world, max_tokens, hidden, experts, topk, timing=timing, puts=puts, nodes=nodes,
                                    payload=group)
    return EPAllToAll.simulated(world, max_tokens, hidden, experts, topk, fp8_dispatch=group is not None,
                                fp8_group=group or 128, timing=timing, puts=puts, nodes=nodes)


# world, tokens per rank (three calls), hidden, experts, topk, fp8 group, drop, one expert
CASES = [
    (2, [(3, 5), (0, 4), (6, 6)], 256, 8, 2, 128, 0.0, None),
    (2, [(4, 1), (2, 0), (5, 5)], 64, 4, 1, None, 0.0, None),
    (3, [(2, 0, 3), (4, 4, 1), (0, 0, 2)], 128, 6, 4, 64, 0.25, None),
    (3, [(3, 3, 3), (1, 2, 3), (3, 0, 1)], 200, 9, 3, None, 0.2, 4),
    (2, [(17, 9), (0, 20), (20, 1)], 128, 4, 2, 32, 0.1, None),
    (4, [(3, 0, 5, 2), (4, 4, 1, 0), (2, 5, 0, 5)], 128, 8, 3, 64, 0.1, None),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_kernels_in_the_interpreter(case):
    check_calls(*CASES[case])


@pytest.mark.parametrize("case,chunk_ids", [(2, 4), (4, 4), (4, 1024)])
def test_layout_in_sorted_chunks(case, chunk_ids, monkeypatch):
    """The layout of large calls (sorted chunks of ids, summed up by the last layout program) on small ones:
    in chunks of 4 ids a call's hits of an expert span chunks and the last layout program sums many chunks
    up, while calls of one token or none, whose ids fit one chunk, compare them with the experts on the
    same slots; in chunks of 1024 every call compares, on an object whose layout could sort."""
    monkeypatch.setattr(low_latency, "COMPARE_IDS", 0)
    monkeypatch.setattr(low_latency, "LAYOUT_IDS", chunk_ids)
    check_calls(*CASES[case])


@pytest.mark.parametrize("case,puts,nodes", [(0, "all", 1), (1, "all", 1), (2, "all", 1), (4, "all", 1),
                                              (5, "all", 1), (5, "auto", 2), (5, "auto", 4)])
def test_put_path_in_the_interpreter(case, puts, nodes):
    """Peers reached through puts (emulated: simulated.SimulatedHeap): every peer (puts="all"), or the ranks of
    other nodes (a node of two ranks in a world of four: each rank reaches one peer through a pointer and
    two through puts; nodes of one rank: every peer through puts), in the same calls."""
    check_calls(*CASES[case], puts=puts, nodes=nodes)


@pytest.mark.parametrize("case,nodes", [(2, 3), (5, 2)])
def test_put_path_in_sorted_chunks(case, nodes, monkeypatch):
    """The put path with the layout of large calls: offsets per chunk of ids go with the call's metadata."""
    monkeypatch.setattr(low_latency, "COMPARE_IDS", 0)
    monkeypatch.setattr(low_latency, "LAYOUT_IDS", 4)
    check_calls(*CASES[case], nodes=nodes)


def test_peer_paths_and_a_put_peer_that_never_sends():
    """peer_paths says how each rank is reached; a rank that waits for a put peer that never sends ends in
    CommTimeoutError naming it, within timeout_s."""
    ranks = EPAllToAll.simulated(4, 4, 128, 8, 2, fp8_dispatch=False, timeout_s=0.5, nodes=2)
    assert [ep.peer_paths for ep in ranks] == [["local", "nvlink", "put", "put"], ["nvlink", "local", "put", "put"],
                                              ["put", "put", "local", "nvlink"], ["put", "put", "nvlink", "local"]]
    assert EPAllToAll.simulated(2, 4, 128, 8, 2, puts="all")[1].peer_paths == ["put", "local"]
    with pytest.raises(ValueError, match="puts must be one of"):
        EPAllToAll.simulated(2, 4, 128, 8, 2, puts="none")
    with pytest.raises(ValueError, match="puts='all' needs backend='nvshmem' and elastic=False"):
        EPAllToAll.simulated(2, 4, 128, 8, 2, puts="all", elastic=True)
    with pytest.raises(ValueError, match="elastic mode needs every peer reached through a peer pointer"):
        EPAllToAll.simulated(2, 4, 128, 8, 2, elastic=True, nodes=2)
    inputs = make_inputs(0, [4, 4, 4, 4], 128, 8, 2, seed=0)
    *_, hook = ranks[0].dispatch(*inputs, return_recv_hook=True)
    for ep in ranks[1:3]:                              # rank 3, reached by puts, never sends
        ep.dispatch(*make_inputs(ep.rank, [4, 4, 4, 4], 128, 8, 2, seed=0), return_recv_hook=True)
    hook()
    with pytest.raises(CommTimeoutError, match="rank 0: dispatch .* waiting for rank 3"):
        ranks[0].check()


# world, tokens per rank (three calls), hidden, experts, topk, drop: the worlds every payload format runs in
FORMAT_WORLDS = [(2, [(3, 5), (0, 4), (6, 6)], 8, 2, 0.0), (3, [(2, 0, 3), (4, 4, 1), (0, 0, 2)], 6, 4, 0.25)]


@pytest.mark.parametrize("name", ["bf16", "fp8", "fp8_ue8m0", "mxfp8", "nvfp4"])
@pytest.mark.parametrize("world", range(len(FORMAT_WORLDS)))
def test_payload_formats_in_the_interpreter(name, world):
    """Each payload format dispatch applies (EPAllToAll(payload=...)): payload and scales bytes, and the
    combine of experts fed with the format's dequantize, bit for bit against the oracle's (PayloadFormat's
    torch quantize; nvfp4's under the calibrated tensor scale of ``cases.tensor_scale``, which every rank
    passes). H is the least the format allows above 128 (512 for fp8_ue8m0: four groups an int32)."""
    fmt = FORMATS[name]
    world, calls, experts, topk, drop = FORMAT_WORLDS[world]
    check_calls(world, calls, max(256, fmt.hidden_multiple), experts, topk, fmt, drop, None)


@pytest.mark.parametrize("name,decode,prefill", [("fp8", 16, 32), ("mxfp8", 64, 128), ("nvfp4", 128, 128)])
def test_work_items_hold_at_most_128_groups(name, decode, prefill):
    """Each format's work items at H 7168: the decode and prefill tiles' scale groups (BLOCK_GROUPS), nvfp4's
    prefill tile held to the 128 groups that matched the reference on a GPU (low_latency.MAX_ITEM_GROUPS)."""
    protocol = simulated_world(1, 4, 7168, 8, 2, FORMATS[name])[0].protocol
    assert protocol._dispatch[0].fixed["BLOCK_GROUPS"] == decode
    assert protocol._dispatch_send[0].fixed["BLOCK_GROUPS"] == decode
    assert protocol._prefill[0][0].fixed["BLOCK_GROUPS"] == protocol._prefill[1][0].fixed["BLOCK_GROUPS"] == prefill
    assert protocol._items["dispatch_send_prefill"] == -(-7168 // (prefill * FORMATS[name].group))


@pytest.mark.parametrize("name,columns,hidden,most_groups", [("mxfp8", 64, 256, 128), ("fp8_ue8m0", 512, 2048, 128),
                                                             ("nvfp4", 32, 208, 128), ("nvfp4", 32, 208, 2)])
def test_payload_formats_over_column_chunks_and_puts(name, columns, hidden, most_groups, monkeypatch):
    """The scaled formats with rows cut into several work items (decode tiles of `columns` columns, prefill
    tiles of twice that, or of `columns` where `most_groups` groups a work item hold them there: each chunk's
    payload and scales items land at their own place; nvfp4's rows of 208 columns, 104 bytes, end in a partial
    chunk of either tiles) and every peer reached by puts (rows put per chunk, their payload items counted in
    bytes; their scales put with the call's metadata, items of their storage type). Combine's send takes work
    items of `columns` columns too: its sums stored and put chunk by chunk, the last one partial for nvfp4."""
    monkeypatch.setattr(low_latency, "CHUNK_COLUMNS", columns)
    monkeypatch.setattr(low_latency, "COMBINE_COLUMNS", columns)
    monkeypatch.setattr(low_latency, "PREFILL_CHUNK_COLUMNS", 2 * columns)
    monkeypatch.setattr(low_latency, "MAX_ITEM_GROUPS", most_groups)
    world, calls, experts, topk, drop = FORMAT_WORLDS[1]
    check_calls(world, calls, hidden, experts, topk, FORMATS[name], drop, None, puts="all")


@pytest.mark.parametrize("hits", [1, 2, 4])
@pytest.mark.parametrize("whole_rows", [False, True])
def test_combine_loads_a_token_s_hits_in_several_loads(hits, whole_rows, monkeypatch):
    """Combine's send with loads of fewer expert rows than a token has local hits (low_latency.combine_hits):
    the second, third, ... load of a token add its next hits in k order, bit for bit the reference's sums;
    a token whose hits fill a load exactly reads one more load of none. Top-4 of 8 experts on 2 ranks: up
    to 4 local hits a token, and every token of one call on expert 0 (one_expert). Rows of 4 column chunks,
    taken chunk by chunk as work items, or whole (COMBINE_WHOLE_ROWS 0: at any number of rows a program)."""
    monkeypatch.setattr(low_latency, "combine_hits", lambda topk, world: hits)
    monkeypatch.setattr(low_latency, "COMBINE_COLUMNS", 32)
    monkeypatch.setattr(low_latency, "COMBINE_WHOLE_ROWS", 0 if whole_rows else 2**20)
    check_calls(2, [(5, 3), (4, 6)], 128, 8, 4, None, 0.25, None)
    check_calls(2, [(3, 4)], 128, 8, 4, 64, 0.0, 0)


@pytest.mark.parametrize("name", ["fp8_ue8m0", "mxfp8", "nvfp4"])
@pytest.mark.parametrize("puts,nodes", [("auto", 1), ("auto", 2)])
def test_payload_formats_at_the_edges(name, puts, nodes):
    """Calls of no tokens on any rank, of one token on one rank or on each, and every token to one expert
    (on the last rank), through pointers and through puts (nodes of one rank), bit for bit."""
    fmt = FORMATS[name]
    calls = [(0, 0), (1, 0), (1, 1), (6, 3)]
    check_calls(2, calls, max(256, fmt.hidden_multiple), 4, 2, fmt, 0.0, 3, puts=puts, nodes=nodes)


def test_nvfp4_round_trip_through_dispatch():
    """nvfp4's error against the bf16 tokens, through dispatch, under a per-tensor scale calibrated to the
    tokens' amax over every rank (what a checkpoint's input scale is): each received element within the bound
    of the moe_ep.formats docstring, |x_hat - x| <= max(2^-2 |x|, 2^-2 d, 6 t 2^-10) + 2^-22 |x| (d = s * t,
    the factor of its group), and the rows' relative RMS error near e2m1's: under 12% (9.6% here, 9.5% on
    Gaussian rows of 7168 columns)."""
    fmt, world, tokens, hidden, experts, topk = FORMATS["nvfp4"], 2, [7, 5], 256, 4, 2
    inputs = [make_inputs(r, tokens, hidden, experts, topk, seed=5) for r in range(world)]
    scale = torch.stack([fmt.tensor_scale_of(x) for x, _, _ in inputs]).max().reshape(1)
    ranks = simulated_world(world, max(tokens), hidden, experts, topk, fmt)
    outs = [ep.dispatch(*inputs[r], return_recv_hook=True, tensor_scale=scale) for r, ep in enumerate(ranks)]
    for *_, hook in outs:
        hook()
    errors, norms = 0.0, 0.0
    for recv_x, recv_scales, recv_count, handle, _ in outs:
        for e, count in enumerate(recv_count.tolist()):
            got = fmt.dequantize(recv_x[e, :count], recv_scales[e, :count], scale)
            src = handle.recv_src[e, :count].long() // topk
            x = torch.stack([inputs[s][0][t] for s, t in zip((src // max(tokens)).tolist(),
                                                             (src % max(tokens)).tolist())]).float()
            d = (recv_scales[e, :count].float() * scale).repeat_interleave(fmt.group, dim=-1)
            bound = torch.maximum(torch.maximum(x.abs() / 4, d / 4), 6 * scale / 2**10) + x.abs() / 2**22
            assert ((got - x).abs() <= bound).all(), (e, ((got - x).abs() - bound).max())
            errors += float(((got - x) ** 2).sum())
            norms += float((x ** 2).sum())
    assert (errors / norms) ** 0.5 < 0.12, (errors / norms) ** 0.5


def test_payload_format_refusals():
    """A format dispatch does not apply (its scales and packing apart from DISPATCH_SCALES) is refused by name
    with the formats dispatch supports; a payload and fp8 flags that disagree name both; an unscaled format
    must be x's dtype; hidden must hold whole scales items."""
    odd = dataclasses.replace(FORMATS["nvfp4"], name="e4m3/16", element="e4m3", payload_dtype=torch.float8_e4m3fn,
                              element_pack=1)
    with pytest.raises(ValueError, match="payload format 'e4m3/16' is not supported by dispatch; supported: "
                                         "bf16, fp16, fp32, fp8, fp8_ue8m0, mxfp8, nvfp4"):
        simulated_world(2, 4, 256, 4, 2, odd)
    with pytest.raises(ValueError, match="payload='mxfp8' disagrees with fp8_dispatch=False, fp8_group=128"):
        EPAllToAll.simulated(2, 4, 256, 4, 2, fp8_dispatch=False, payload="mxfp8")
    with pytest.raises(ValueError, match="payload='fp8' disagrees with fp8_dispatch=True, fp8_group=64"):
        EPAllToAll.simulated(2, 4, 256, 4, 2, fp8_group=64, payload="fp8")
    with pytest.raises(ValueError, match="payload must be one of"):
        EPAllToAll.simulated(2, 4, 256, 4, 2, payload="int8")
    with pytest.raises(ValueError, match="payload format 'fp32' sends x as it is, and dtype is torch.bfloat16"):
        EPAllToAll.simulated(2, 4, 256, 4, 2, payload="fp32")
    with pytest.raises(ValueError, match="format 'fp8_ue8m0': hidden=256 is not a multiple of 512"):
        EPAllToAll.simulated(2, 4, 256, 4, 2, payload="fp8_ue8m0")
    with pytest.raises(ValueError, match="format 'nvfp4': hidden=200 is not a multiple of 16"):
        EPAllToAll.simulated(2, 4, 200, 4, 2, payload="nvfp4")
    ep = EPAllToAll.simulated(1, 4, 256, 4, 2, fp8_dispatch=False, payload="bf16")[0]   # flags that agree
    assert ep.payload is FORMATS["bf16"] and ep.fp8_group is None
    ep = EPAllToAll.simulated(1, 4, 256, 4, 2, fp8_group=32, payload="mxfp8")[0]
    assert ep.payload is FORMATS["mxfp8"] and ep.fp8_group == 32
    assert EPAllToAll.simulated(1, 4, 256, 4, 2)[0].payload is FORMATS["fp8"]


def test_tensor_scale_refusals():
    """dispatch's tensor_scale is checked before anything launches: nvfp4 needs one, float32 [1] or [] on the
    object's device, and a format without a per-tensor scale takes none; after the refusals a call with a
    scale of shape [] runs."""
    nvfp4, fp8 = (simulated_world(1, 4, 256, 4, 2, FORMATS[name])[0] for name in ("nvfp4", "fp8"))
    x, ids, weights = make_inputs(0, [3], 256, 4, 2, seed=0)
    refusals = [(None, r"payload format 'nvfp4' needs tensor_scale: its per-tensor scale, float32 \[1\] on cpu"),
                (0.01, "tensor_scale must be a torch.Tensor, got float"),
                (torch.tensor([0.01], dtype=torch.float64), "tensor_scale has dtype torch.float64, expected "
                                                             "torch.float32"),
                (torch.tensor([0.01, 0.02]), r"tensor_scale has shape \(2,\), expected \(1,\) or \(\)"),
                (torch.empty(1, device="meta"), "tensor_scale is on meta, expected cpu")]
    for scale, message in refusals:
        with pytest.raises(ValueError, match=message):
            nvfp4.dispatch(x, ids, weights, tensor_scale=scale)
    with pytest.raises(ValueError, match="payload format 'fp8' has no per-tensor scale: pass no tensor_scale"):
        fp8.dispatch(x, ids, weights, tensor_scale=torch.ones(1))
    assert nvfp4._dispatches == fp8._dispatches == 0
    scale = torch.tensor(0.005)
    recv_x, recv_scales, recv_count, handle = nvfp4.dispatch(x, ids, weights, tensor_scale=scale)
    expected = expected_dispatch(0, 1, [(x, ids, weights)], 4, 4, None)
    assert recv_count.tolist() == [len(rows) for rows in expected]
    payload, scales = FORMATS["nvfp4"].quantize(x, scale)
    for e, rows in enumerate(expected):
        for i, (_, _, source) in enumerate(rows):
            t = source // 2
            assert torch.equal(recv_x[e, i], payload[t]) and torch.equal(bits(recv_scales[e, i]), bits(scales[t]))


def check_calls(world, calls, hidden, experts, topk, group, drop, one_expert, puts="auto", nodes=1):
    """Dispatch and combine of every call in `calls` (tokens per rank), each rank's results bit for bit
    against the oracle's."""
    max_tokens = max(max(c) for c in calls)
    ranks = simulated_world(world, max_tokens, hidden, experts, topk, group, puts=puts, nodes=nodes)
    for call, tokens in enumerate(calls):
        inputs = [make_inputs(r, tokens, hidden, experts, topk, seed=call, drop=drop, one_expert=one_expert)
                  for r in range(world)]
        # Rank `whole` calls without a receive hook (both phases at once) after the others' sends and before
        # their receives; the others take the receive hook. Each rank picks its own mode.
        whole = call % world
        others = [r for r in range(world) if r != whole]
        modes = [MODES[(call + r) % len(MODES)] for r in range(world)]
        scale = tensor_scale(group)
        outs = [ep.dispatch(*inputs[r], return_recv_hook=True, mode=modes[r], tensor_scale=scale)
                for r, ep in enumerate(ranks) if r != whole]
        outs.insert(whole, ranks[whole].dispatch(*inputs[whole], mode=modes[whole], tensor_scale=scale))
        for r in others:
            outs[r][-1]()
        expert_outs = []
        for r, (recv_x, recv_scales, recv_count, handle, *_) in enumerate(outs):
            expected = expected_dispatch(r, world, inputs, experts, max_tokens, group)
            assert recv_count.tolist() == [len(rows) for rows in expected], (call, r)
            for e, rows in enumerate(expected):
                for i, (payload, scales, source) in enumerate(rows):
                    assert torch.equal(recv_x[e, i].view(torch.uint8), payload.view(torch.uint8)), (call, r, e, i)
                    if scales is not None:
                        assert torch.equal(recv_scales[e, i].view(torch.uint8), scales.view(torch.uint8))
                    assert int(handle.recv_src[e, i]) == source, (call, r, e, i)
            expert_outs.append(expert_fn(recv_x, recv_scales, group, torch.bfloat16))
        given = [None if call % 2 else torch.full(inputs[r][0].shape, 7.0, dtype=torch.bfloat16)
                 for r in range(world)]   # out= on even calls; a view of the object's buffer on odd ones
        combined = [ep.combine(expert_outs[r], outs[r][3], return_recv_hook=True, out=given[r])
                    for r, ep in enumerate(ranks) if r != whole]
        combined.insert(whole, (ranks[whole].combine(expert_outs[whole], outs[whole][3], out=given[whole]), None))
        for r in others:
            combined[r][1]()
        for r, (y, _) in enumerate(combined):
            assert torch.equal(y, expected_combine(r, world, inputs, experts, group, torch.bfloat16)), (call, r)
            owned = ranks[r].protocol.combine_buffers.out                   # [SLOTS, T_max, H]
            assert y is given[r] if given[r] is not None else \
                y.untyped_storage().data_ptr() == owned.untyped_storage().data_ptr()
    for ep in ranks:
        assert not ep._status.any()


@pytest.mark.parametrize("hook", [False, True])
def test_dispatch_modes_on_the_same_slots(hook, monkeypatch):
    """One rank, every mode, with or without a receive hook, alternating on the same slots. Without a hook
    "decode" runs in one launch, with one as the send and the receive kernel; "prefill" runs the send and
    receive kernels bound with the prefill tiles; "auto" is decode up to one_launch_tokens tokens, prefill
    above and while a CUDA graph is being captured (stood in for here). Combine runs in one launch without
    a hook. Results, stamps and use counts are the same
    whichever kernels ran."""
    tokens, hidden, experts, topk, group = 6, 256, 8, 2, 128
    ep = simulated_world(1, tokens, hidden, experts, topk, group, timing=True)[0]
    ep.protocol.one_launch_tokens = 3
    launched = []
    launch = launcher.BoundKernel.__call__

    def recorded(kernel, *values, programs=None):
        launched.append((kernel.fn.__name__, kernel.fixed.get("BLOCK_GROUPS")))
        launch(kernel, *values, programs=programs)

    monkeypatch.setattr(launcher.BoundKernel, "__call__", recorded)
    with pytest.raises(ValueError, match="mode must be one of"):
        ep.dispatch(*make_inputs(0, [2], hidden, experts, topk, seed=0), mode="bulk")
    assert not launched and ep._dispatches == 0
    decode, prefill = (ep.protocol._columns[tiles] // group for tiles in ("decode", "prefill"))   # groups an item
    calls = [(5, "auto", False), (0, "prefill", False), (6, "decode", False), (1, "auto", False),
             (3, "prefill", False), (4, "auto", False), (2, "decode", False), (6, "auto", False), (1, "auto", True),
             (2, "decode", True)]
    for call, (t, mode, captured) in enumerate(calls):
        monkeypatch.setattr(protocol, "capturing", lambda device, captured=captured: captured)
        inputs = [make_inputs(0, [t], hidden, experts, topk, seed=call)]
        launched.clear()
        recv_x, recv_scales, recv_count, handle, *hooks = ep.dispatch(*inputs[0], return_recv_hook=hook, mode=mode)
        for receive in hooks:
            receive()
        tiles = prefill if mode == "prefill" or (mode == "auto" and (t > 3 or captured)) else decode
        assert launched == ([("dispatch_kernel", decode)] if tiles == decode and not hook else
                            [("dispatch_send_kernel", tiles), ("dispatch_recv_kernel", tiles)]), (call, launched)
        expected = expected_dispatch(0, 1, inputs, experts, tokens, group)
        assert recv_count.tolist() == [len(rows) for rows in expected], call
        launched.clear()
        y = ep.combine(expert_fn(recv_x, recv_scales, group, torch.bfloat16), handle, return_recv_hook=hook)
        if hook:
            y, receive = y
            receive()
        assert [name for name, _ in launched] == (["combine_send_kernel", "combine_recv_kernel"] if hook else
                                                  ["combine_kernel"]), call
        assert torch.equal(y, expected_combine(0, 1, inputs, experts, group, torch.bfloat16)), call
        phases = ep.breakdown()                     # every kind of launch stamps the same rows
        assert phases["dispatch_total_us"] > 0 and phases["combine_total_us"] > 0 and min(phases.values()) >= 0
    assert ep.protocol.uses.tolist() == [[len(calls) // 2] * 2] * 4
    assert not ep._status.any()


def test_back_to_back_dispatches_and_two_in_flight():
    """Dispatches without combines between them (credits alone keep the slots apart), then two in flight."""
    world, tokens, hidden, experts, topk = 2, 12, 128, 4, 2
    ranks = simulated_world(world, tokens, hidden, experts, topk, None)
    for call in range(6):
        inputs = [make_inputs(r, [tokens] * world, hidden, experts, topk, seed=call) for r in range(world)]
        outs = [ep.dispatch(*inputs[r], return_recv_hook=True) for r, ep in enumerate(ranks)]
        for *_, hook in outs:
            hook()
        for r, (recv_x, _, recv_count, _, _) in enumerate(outs):
            expected = expected_dispatch(r, world, inputs, experts, tokens, None)
            assert recv_count.tolist() == [len(rows) for rows in expected], call
    first = [ep.dispatch(*make_inputs(r, [tokens] * world, hidden, experts, topk, seed=10), return_recv_hook=True)
             for r, ep in enumerate(ranks)]
    second = [ep.dispatch(*make_inputs(r, [tokens] * world, hidden, experts, topk, seed=11), return_recv_hook=True)
              for r, ep in enumerate(ranks)]
    for *_, hook in first + second:
        hook()
    for outs, seed in ((first, 10), (second, 11)):
        inputs = [make_inputs(r, [tokens] * world, hidden, experts, topk, seed=seed) for r in range(world)]
        for r, (recv_x, _, recv_count, _, _) in enumerate(outs):
            expected = expected_dispatch(r, world, inputs, experts, tokens, None)
            for e, rows in enumerate(expected):
                for i, (payload, _, _) in enumerate(rows):
                    assert torch.equal(recv_x[e, i], payload), (seed, r, e, i)
    for ep in ranks:
        assert not ep._status.any()


@pytest.mark.parametrize("chunk_ids", [None, 2])
def test_bad_expert_ids_are_dropped_and_reported_by_the_next_call(chunk_ids, monkeypatch):
    """validate=True: an id outside [-1, E) is found on the device, dropped like -1, and the next call
    raises a ValueError naming the call, the slot and the value of the first (with the layout in sorted
    chunks of 2 ids too, the two bad ids in different chunks); the object stays usable."""
    if chunk_ids:
        monkeypatch.setattr(low_latency, "COMPARE_IDS", 0)
        monkeypatch.setattr(low_latency, "LAYOUT_IDS", chunk_ids)
    world, tokens, hidden, experts, topk = 2, 4, 128, 4, 2
    ranks = simulated_world(world, tokens, hidden, experts, topk, 64, timing=True)
    inputs = [make_inputs(r, [tokens] * world, hidden, experts, topk, seed=3) for r in range(world)]
    bad = [(x, ids.clone(), w) for x, ids, w in inputs]
    bad[1][1][2, 1] = experts + 5
    bad[1][1][3, 0] = -7
    outs = [ep.dispatch(*bad[r], return_recv_hook=True) for r, ep in enumerate(ranks)]
    for *_, hook in outs:
        hook()
    dropped = [(x, ids.masked_fill((ids >= experts) | (ids < -1), -1), w) for x, ids, w in bad]
    for r, (recv_x, recv_scales, recv_count, _, _) in enumerate(outs):
        expected = expected_dispatch(r, world, dropped, experts, tokens, 64)
        assert recv_count.tolist() == [len(rows) for rows in expected]
    assert ranks[1].breakdown()["dispatch_total_us"] > 0
    assert not ranks[0]._status.any()
    with pytest.raises(ValueError, match=rf"rank 1: dispatch call 1 had topk_ids\[2, 1\] = {experts + 5}"):
        ranks[1].dispatch(*inputs[1])
    outs = [ep.dispatch(*inputs[r], return_recv_hook=True) for r, ep in enumerate(ranks)]   # usable again
    for *_, hook in outs:
        hook()
    for r, (_, _, recv_count, _, _) in enumerate(outs):
        assert recv_count.tolist() == [len(rows) for rows in expected_dispatch(r, world, inputs, experts, tokens, 64)]


def test_measure_crossover_refuses_while_a_dispatch_is_in_flight():
    """A dispatch whose receive hook was not called yet is refused first; after the hook, the CPU device is."""
    ep = simulated_world(1, 4, 128, 4, 2, None)[0]
    *_, hook = ep.dispatch(*make_inputs(0, [3], 128, 4, 2, seed=0), return_recv_hook=True)
    with pytest.raises(ValueError, match="a dispatch or combine is in flight: call its receive hook before"):
        ep.measure_crossover()
    hook()
    with pytest.raises(ValueError, match="CUDA device"):
        ep.measure_crossover()
    assert ep._dispatches == 1
