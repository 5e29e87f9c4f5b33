"""EPAllToAll rejects bad configurations and inputs with ValueError before anything runs (gloo, reference),
payload formats its kernels do not apply among them; its kernels compile for the GPU; the routing helpers
count what a call moves; "auto"'s crossover is decided from timings."""
import dataclasses
import re
import time

import pytest
import torch

from distributed import die, run
from moe_ep import CallRefusedError, CommTimeoutError, EPAllToAll, link_copies, random_topk
from moe_ep.ep.front import EPHandle, check_config, dispatchable
from moe_ep.ep.low_latency import BAD_CALL, ONE_LAUNCH_TOKENS
from moe_ep.ep.protocol import crossover_tokens
from moe_ep.formats import FORMATS
from moe_ep.reference import dequantize_fp8
from moe_ep.routing import hbm_bytes
from sm90 import run_without_interpreter

GOOD = dict(max_tokens=8, hidden=256, num_experts=8, topk=2)


def _config_errors(rank, world):
    bad = [(dict(topk=0), r"topk must be an int in \[1, 16\], got 0"),
           (dict(topk=17), r"topk must be an int in \[1, 16\], got 17"),
           (dict(num_experts=7), "num_experts=7 is not a multiple of the world size 2"),
           (dict(max_tokens=0), "max_tokens must be a positive int, got 0"),
           (dict(hidden=200), "hidden=200 is not a multiple of fp8_group=128"),
           (dict(hidden=100, fp8_dispatch=False), "hidden=100 must be a multiple of 8"),
           (dict(fp8_group=96), "fp8_group must be a power of two >= 16, got 96"),
           (dict(dtype=torch.int32), "dtype must be bfloat16, float16 or float32, got torch.int32"),
           (dict(backend="mpi"), "backend must be one of .*, got 'mpi'"),
           (dict(timeout_s=0), "timeout_s must be a positive, finite number of seconds, got 0"),
           (dict(timeout_s=float("inf")), "timeout_s must be a positive, finite number of seconds, got inf"),
           (dict(timeout_s="10"), "timeout_s must be a positive, finite number of seconds, got '10'"),
           (dict(device="tpu:0"), "device must be a torch.device or a device name"),
           (dict(device=3.5), "device must be a torch.device or a device name")]
    for change, message in bad:
        with pytest.raises(ValueError, match=message):
            EPAllToAll(**{**GOOD, **change, "backend": change.get("backend", "reference")})
    for change, message in ((dict(num_sms=0), "num_sms"), (dict(num_sms=2.5), "num_sms")):
        with pytest.raises(ValueError, match=message):
            EPAllToAll(**GOOD, **change, backend="reference")
    if not torch.cuda.is_available():          # a CPU machine, or a CPU build of torch
        for backend in ("reference", "nvshmem"):
            with pytest.raises(ValueError, match="no CUDA GPU is usable here"):
                EPAllToAll(**GOOD, backend=backend, device="cuda")
        with pytest.raises(ValueError, match="nvshmem backend needs this process's GPU.*use backend='reference'"):
            EPAllToAll(**GOOD)


def _input_errors(rank, world):
    ep = EPAllToAll(**GOOD, backend="reference")
    x = torch.randn(4, 256).bfloat16()
    ids, weights = random_topk(4, 8, 2)
    bad_inputs = {
        "dtype": (x.float(), ids, weights),
        "hidden size": (x[:, :128].contiguous(), ids, weights),
        "max_tokens": (torch.randn(9, 256).bfloat16(), *random_topk(9, 8, 2)),
        r"\[-1, 8\)": (x, ids.masked_fill(ids == ids[0, 0], 8), weights),
        r"\[-2": (x, ids.masked_fill(ids == ids[0, 0], -2), weights),
        "shape": (x, ids[:, :1].contiguous(), weights),
        "topk_weights has dtype": (x, ids, weights.long()),
        "contiguous": (x.t().contiguous().t(), ids, weights),
        "torch.Tensor": (x.tolist(), ids, weights),
    }
    for message, args in bad_inputs.items():
        with pytest.raises(ValueError, match=message):
            ep.dispatch(*args)
    with pytest.raises(ValueError, match=r"mode must be one of \('auto', 'decode', 'prefill'\), got 'bulk'"):
        ep.dispatch(x, ids, weights, mode="bulk")
    with pytest.raises(ValueError, match="measure_crossover times kernel tiles, and the reference backend has none"):
        ep.measure_crossover()
    recv_x, recv_scales, _, handle = ep.dispatch(x, ids, weights)    # nothing was consumed by the failures
    assert handle.call == 1
    with pytest.raises(ValueError, match="shape"):
        ep.combine(torch.zeros(4, 8, 256, dtype=torch.bfloat16), handle)
    with pytest.raises(ValueError, match="handle"):
        ep.combine(torch.zeros(4, 16, 256, dtype=torch.bfloat16), "handle")
    expert_out = torch.zeros(4, 16, 256, dtype=torch.bfloat16)
    for out, message in ((torch.zeros(3, 256, dtype=torch.bfloat16), "out has shape"),
                         (torch.zeros(4, 256), "out has dtype"),
                         (torch.zeros(256, 4, dtype=torch.bfloat16).t(), "out must be contiguous")):
        with pytest.raises(ValueError, match=message):
            ep.combine(expert_out, handle, out=out)
    out = torch.empty(4, 256, dtype=torch.bfloat16)
    assert ep.combine(expert_out, handle, out=out) is out
    other = EPAllToAll(**GOOD, backend="reference")
    *_, other_handle = other.dispatch(x, ids, weights)
    with pytest.raises(ValueError, match="a handle of this EPAllToAll's own dispatch, and this one came from another"):
        ep.combine(expert_out, other_handle)
    ep.dispatch(x, ids, weights)
    ep.dispatch(x, ids, weights)
    with pytest.raises(ValueError, match="stale"):
        ep.combine(torch.zeros(4, 16, 256, dtype=torch.bfloat16), handle)


def _checked(ep, op: str, *args):
    """What the checks one at a time make of a call (``_check_call``'s verdict): its return value, or the error
    it raised. The fast checks' verdict is a value, or None where those checks must name what is wrong."""
    check = ep._check_dispatch_args if op == "dispatch" else ep._check_combine_args
    fast = ep._dispatch_passes(*args) if op == "dispatch" else ep._combine_passes(*args) or None
    try:
        return fast, ep._check_call(op, check, *args)
    except (ValueError, RuntimeError) as error:
        return fast, error


def test_the_fast_call_checks_pass_only_what_every_check_passes():
    """EPAllToAll's per-call checks in one expression (the common case, cheap on the host) pass only the
    dispatches and combines that the checks one at a time pass (a dispatch with the same token count); the rest
    fall through to those checks, which name what is wrong: bad arguments, and an object that cannot take
    the call now (an earlier failure, calls in flight, a stale or foreign handle)."""
    ep, peer = EPAllToAll.simulated(2, 8, 256, 8, 2)        # fp8, every rank in this process, nothing launched
    x = torch.randn(4, 256).bfloat16()
    ids, weights = random_topk(4, 8, 2)
    meta = torch.device("meta")
    good = [(x, ids, weights, "auto"), (x, ids.int(), weights.bfloat16(), "decode"),
            (x, ids, weights.half(), "prefill"), (x[:0], ids[:0], weights[:0], "auto"),
            (torch.randn(8, 256).bfloat16(), *random_topk(8, 8, 2), "auto")]
    for x_, ids_, weights_, mode in good:
        assert _checked(ep, "dispatch", x_, ids_, weights_, mode, None) == (x_.shape[0], x_.shape[0])
    bad = [((x.float(), ids, weights, "auto"), "x has dtype torch.float32"),
           ((x[:, :128].contiguous(), ids, weights, "auto"), "x has hidden size 128"),
           ((x[0], ids, weights, "auto"), "x must be 2-D"), ((x[None], ids, weights, "auto"), "x must be 2-D"),
           ((torch.randn(9, 256).bfloat16(), *random_topk(9, 8, 2), "auto"), "9 tokens is more than max_tokens=8"),
           ((x, ids.short(), weights, "auto"), "topk_ids has dtype torch.int16"),
           ((x, ids[:, :1].contiguous(), weights, "auto"), r"topk_ids has shape \(4, 1\), expected \(4, 2\)"),
           ((x, ids[:3], weights, "auto"), r"topk_ids has shape \(3, 2\)"),
           ((x, ids, weights.long(), "auto"), "topk_weights has dtype torch.int64"),
           ((x, ids, weights[None], "auto"), r"topk_weights has shape \(1, 4, 2\)"),
           ((x.t().contiguous().t(), ids, weights, "auto"), "x must be contiguous"),
           ((x, ids.t().contiguous().t(), weights, "auto"), "topk_ids must be contiguous"),
           ((x, ids, weights.t().contiguous().t(), "auto"), "topk_weights must be contiguous"),
           ((x.to(meta), ids, weights, "auto"), "x is on meta"), ((x, ids.to(meta), weights, "auto"), "topk_ids is on"),
           ((x, ids, weights.to(meta), "auto"), "topk_weights is on meta"),
           ((x.tolist(), ids, weights, "auto"), "x must be a torch.Tensor"),
           ((x, ids.tolist(), weights, "auto"), "topk_ids must be a torch.Tensor"),
           ((x, ids, None, "auto"), "topk_weights must be a torch.Tensor"),
           ((x, ids, weights, "bulk"), "mode must be one of"), ((x, ids, weights, None), "mode must be one of")]
    for args, message in bad:
        fast, error = _checked(ep, "dispatch", *args, None)
        assert fast is None and isinstance(error, ValueError) and re.search(message, str(error)), (message, error)
    fast, error = _checked(ep, "dispatch", x, ids, weights, "auto", torch.ones(1))
    assert fast is None and "payload format 'fp8' has no per-tensor scale" in str(error)

    # nvfp4: a per-tensor scale, float32 [1] or [] on the device, and nothing else
    scaled = EPAllToAll.simulated(2, 8, 256, 8, 2, payload="nvfp4")[0]
    for scale in (torch.ones(1), torch.ones(())):
        assert _checked(scaled, "dispatch", x, ids, weights, "auto", scale) == (4, 4)
    for scale, message in ((None, "needs tensor_scale"), (torch.ones(1).double(), "tensor_scale has dtype"),
                           (torch.ones(2), r"tensor_scale has shape \(2,\)"), (torch.ones(1, device=meta), "on meta"),
                           (1.0, "tensor_scale must be a torch.Tensor")):
        fast, error = _checked(scaled, "dispatch", x, ids, weights, "auto", scale)
        assert fast is None and re.search(message, str(error)), (message, error)

    # a combine of the handle of this object's dispatch 1
    ep._dispatches = 1
    handle = EPHandle(0, 1, 4, ids, ep.protocol.outputs[0][3], True, None, ep)
    expert_out = torch.zeros(4, 16, 256, dtype=torch.bfloat16)
    out = torch.empty(4, 256, dtype=torch.bfloat16)
    for given in (None, out):
        assert _checked(ep, "combine", expert_out, handle, given) == (True, None)
    wide = torch.zeros(4, 16, 512, dtype=torch.bfloat16)[:, :, :256]
    bad = [((expert_out.float(), handle, None), "expert_out has dtype"),
           ((expert_out[:, :8], handle, None), r"expert_out has shape \(4, 8, 256\)"),
           ((wide, handle, None), "expert_out must be contiguous"), ((expert_out.to(meta), handle, None), "on meta"),
           ((expert_out.tolist(), handle, None), "expert_out must be a torch.Tensor"),
           ((expert_out, "handle", None), "the handle of a dispatch whose receive has completed"),
           ((expert_out, dataclasses.replace(handle, received=False), None), "whose receive has completed"),
           ((expert_out, dataclasses.replace(handle, owner=peer), None), "came from another EPAllToAll"),
           ((expert_out, dataclasses.replace(handle, call=-1), None), "stale handle"),
           ((expert_out, handle, out.float()), "out has dtype"), ((expert_out, handle, out[:3]), "out has shape"),
           ((expert_out, handle, torch.empty(256, 4, dtype=torch.bfloat16).t()), "out must be contiguous"),
           ((expert_out, handle, out.to(meta)), "out is on meta"),
           ((expert_out, handle, out.tolist()), "out must be a torch.Tensor")]
    for args, message in bad:
        fast, error = _checked(ep, "combine", *args)
        assert fast is None and isinstance(error, ValueError) and re.search(message, str(error)), (message, error)

    # an object that cannot take the call now, whatever its arguments
    dispatch, combine = (x, ids, weights, "auto", None), (expert_out, handle, None)
    for op, args, message in (("dispatch", dispatch, "two dispatches are already in flight"),
                              ("combine", combine, "two combines are already in flight")):
        ep._in_flight[op] = 2
        fast, error = _checked(ep, op, *args)
        ep._in_flight[op] = 0
        assert fast is None and message in str(error)
    for op, args in (("dispatch", dispatch), ("combine", combine)):
        ep.protocol._words[BAD_CALL] = 1                 # an out-of-range id an earlier dispatch saw
        fast, error = _checked(ep, op, *args)
        assert fast is None and isinstance(error, ValueError) and "dispatch call 1 had topk_ids" in str(error)
        assert _checked(ep, op, *args) == ((4, 4) if op == "dispatch" else (True, None))   # reported once
    ep._own_checks = False                               # a protocol that exchanges verdicts or reads ids
    assert _checked(ep, "dispatch", *dispatch) == (None, 4) and _checked(ep, "combine", *combine) == (None, None)
    ep._own_checks = True
    ep._broken = "a wait timed out"
    for op, args in (("dispatch", dispatch), ("combine", combine)):
        fast, error = _checked(ep, op, *args)
        assert fast is None and isinstance(error, CommTimeoutError) and "a wait timed out" in str(error)


def test_replay_slots_are_the_next_calls_and_a_replay_counts_as_calls():
    """A caller's CUDA graph of a dispatch and its combine replays on the slots the next calls would take, if
    that dispatch passes its checks and a combine may start; replayed() counts both calls, rewind() undoes
    what a failed capture counted."""
    ep, _ = EPAllToAll.simulated(2, 8, 256, 8, 2)
    x = torch.randn(4, 256).bfloat16()
    ids, weights = random_topk(4, 8, 2)
    assert ep.replay_slots(x, ids, weights) == (0, 0) and ep.calls == (0, 0)
    ep.rewind((3, 2))
    assert ep.replay_slots(x, ids, weights) == (1, 0)
    ep.replayed()
    assert ep.calls == (4, 3) and ep.replay_slots(x, ids, weights) == (0, 1)
    assert ep.replay_slots(x.float(), ids, weights) is None            # a dispatch its checks refuse
    ep._in_flight["combine"] = 2
    assert ep.replay_slots(x, ids, weights) is None and ep.calls == (4, 3)


def test_bad_configurations_raise():
    run(_config_errors, 2)


def test_a_per_tensor_scale_goes_with_e4m3_scales_only():
    """Every built-in format is one dispatch applies; one with e4m3 scales and no per-tensor scale (the kernels
    would read a constant for it), or with another scale and a per-tensor one, is refused by name before
    anything is built."""
    assert [name for name, fmt in FORMATS.items() if dispatchable(fmt)] == [
        "bf16", "fp16", "fp32", "fp8", "fp8_ue8m0", "mxfp8", "nvfp4"]
    for fmt in (dataclasses.replace(FORMATS["nvfp4"], name="nvfp4-untensored", tensor_scale=False),
                dataclasses.replace(FORMATS["mxfp8"], name="mxfp8-tensored", tensor_scale=True)):
        assert not dispatchable(fmt)
        with pytest.raises(ValueError, match=f"payload format '{fmt.name}' is not supported by dispatch; "
                                             "supported: bf16, fp16, fp32, fp8, fp8_ue8m0, mxfp8, nvfp4"):
            check_config(4, 256, 8, 2, 2, torch.bfloat16, True, 128, "reference", payload=fmt)


def _ranks_that_differ(rank, world):
    """Ranks built with different settings, or one rank's bad argument, end on every rank at construction."""
    for change, message in ((dict(num_experts=8 * (rank + 1)), r"num_experts \(8 on rank 0, 16 on rank 1\)"),
                            (dict(hidden=128 * (rank + 1), fp8_dispatch=rank == 0),
                             r"hidden \(128 on rank 0, 256 on rank 1\); fp8_group \(128 on rank 0, None on rank 1\)"),
                            (dict(topk=2 - rank), r"topk \(2 on rank 0, 1 on rank 1\)")):
        with pytest.raises(ValueError, match="EPAllToAll: the ranks of the group were built with different settings, "
                                             "which must be the same on every rank: " + message):
            EPAllToAll(**{**GOOD, **change}, backend="reference")
    with pytest.raises(CallRefusedError, match=r"EPAllToAll refused by rank 1: topk must be an int in \[1, 16\]"):
        EPAllToAll(**{**GOOD, "topk": 2 if rank == 0 else 0}, backend="reference")
    with pytest.raises(CallRefusedError, match="EPAllToAll refused by rank 0: backend must be one of .*; rank 1: "
                                               "num_experts=7 is not a multiple"):
        EPAllToAll(**{**GOOD, **(dict(backend="mpi") if rank == 0 else dict(num_experts=7))})
    EPAllToAll(**GOOD, backend="reference", timeout_s=5.0 + rank)      # a per-rank option may differ


def test_ranks_that_differ_are_refused_on_every_rank():
    run(_ranks_that_differ, 2)


def _refusals_reach_every_rank(rank, world):
    """A call that one rank refuses (the reference backend) raises CallRefusedError naming that rank and its
    reason on every rank, at once, and leaves nothing behind: the next calls run as if it never happened."""
    ep = EPAllToAll(**GOOD, backend="reference", timeout_s=30.0)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(rank)).bfloat16()
    ids, weights = random_topk(4, 8, 2, generator=torch.Generator().manual_seed(rank))
    too_many = (torch.randn(9, 256).bfloat16(), *random_topk(9, 8, 2))
    out_of_range = (x, ids.masked_fill(ids == ids[0, 0], 8), weights)
    started = time.monotonic()
    for bad, message in ((0, r"dispatch refused by rank 0: 9 tokens is more than max_tokens=8$"),
                         (1, r"dispatch refused by rank 1: topk_ids must lie in \[-1, 8\)")):
        with pytest.raises(CallRefusedError, match=message) as refused:
            ep.dispatch(*((too_many if bad == 0 else out_of_range) if rank == bad else (x, ids, weights)))
        assert list(refused.value.refusals) == [bad]
    with pytest.raises(CallRefusedError, match="dispatch refused by rank 0: 9 tokens .*; rank 1: x has dtype"):
        ep.dispatch(*(too_many if rank == 0 else (x.float(), ids, weights)))
    assert time.monotonic() - started < 10, "a refusal is known to every rank at once, not after a timeout"

    recv_x, recv_scales, _, handle = ep.dispatch(x, ids, weights)
    assert handle.call == 1                                          # the refused calls consumed nothing
    expert_out = dequantize_fp8(recv_x, recv_scales).bfloat16()      # identity experts
    with pytest.raises(CallRefusedError, match=r"combine refused by rank 1: expert_out has shape \(4, 8, 256\)"):
        ep.combine(expert_out[:, :8].contiguous() if rank == 1 else expert_out, handle)
    y = ep.combine(expert_out, handle)
    torch.testing.assert_close(y.float(), x.float(), rtol=0.07, atol=0.07)     # FP8 rounding of x


def test_a_call_one_rank_refuses_fails_on_every_rank():
    run(_refusals_reach_every_rank, 2)


def _a_rank_that_never_calls(rank, world):
    """Rank 1 builds the all-to-all and then makes no call: rank 0's dispatch ends after timeout_s in
    CommTimeoutError, and the object stays broken."""
    ep = EPAllToAll(**GOOD, backend="reference", timeout_s=1.0)
    if rank == 1:
        time.sleep(4)
        die()
    x = torch.randn(4, 256).bfloat16()
    started = time.monotonic()
    with pytest.raises(CommTimeoutError, match="rank 0: dispatch was not agreed by every rank within 1.0s"):
        ep.dispatch(x, *random_topk(4, 8, 2))
    assert 1 <= time.monotonic() - started < 3
    with pytest.raises(CommTimeoutError, match="dispatch was not agreed"):
        ep.dispatch(x, *random_topk(4, 8, 2))


def test_a_call_a_rank_never_makes_times_out():
    run(_a_rank_that_never_calls, 2, lost=(1,))


def test_bad_inputs_raise():
    run(_input_errors, 2)


def test_link_copies_counts_ranks_once():
    ids = torch.tensor([[0, 1, 4, 5], [2, 3, -1, -1], [6, 7, 0, -1]])    # 8 experts, world 2, rank 0
    once_per_rank, once_per_expert = link_copies(ids, experts_per_rank=4, rank=0, world=2)
    assert (once_per_rank, once_per_expert) == (2, 4)


def test_hbm_bytes_by_hand():
    """1 rank, 4 tokens, H = 256 (bf16, 512 B a row), 8 experts, top-2: every token staged and routed once,
    8 hits. FP8 rows with group 128 are 256 + 2 * 4 = 264 B; ids and weights 8 B a slot."""
    ids = [torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])]
    x, meta, staged = 4 * 512, 8 * 4 * 2, 2 * 4 * 2 * 8     # read x; read ids and weights; their staging
    combine = 8 * 512 + 2 * 4 * 512 + 4 * 512               # expert rows read; partials written, read; y
    assert hbm_bytes(ids, 0, 8, 256, fp8_group=128) == (x + meta + 2 * 4 * 264 + staged + 8 * 264, combine)
    assert hbm_bytes(ids, 0, 8, 256, fp8_group=None) == (x + meta + 2 * 4 * 512 + staged + 8 * 512, combine)


def test_hbm_bytes_counts_the_routing_of_every_rank():
    """Rank 0 of 2 (experts 0-3 local), dropped slots: hits 0, 1 from rank 0 and 0, 2, 3 from rank 1 (5);
    staged tokens 0, 2 of rank 0 and 1, 3 of rank 1 (4); rank 0's tokens reach 2 + 1 + 1 ranks (4)."""
    ids = [torch.tensor([[0, 5], [6, 7], [1, -1]]), torch.tensor([[4, 5], [0, 2], [-1, -1], [3, 6]])]
    dispatch = 3 * 512 + 8 * 3 * 2 + 2 * 4 * (264 + 8 * 2) + 5 * 264
    combine = 5 * 512 + 2 * 4 * 512 + 3 * 512
    assert hbm_bytes(ids, 0, 4, 256, fp8_group=128) == (dispatch, combine)


def test_crossover_is_the_largest_size_where_decode_wins():
    sizes = [16, 32, 64, 128]
    assert crossover_tokens(sizes, [10.0, 12.0, 20.0, 40.0], [15.0, 16.0, 18.0, 30.0]) == 32
    assert crossover_tokens(sizes, [10.0, 20.0, 15.0, 40.0], [15.0, 16.0, 18.0, 30.0]) == 64   # not monotonic
    assert crossover_tokens(sizes, [10.0, 12.0, 14.0, 16.0], [11.0, 13.0, 15.0, 17.0]) == 128
    assert crossover_tokens(sizes, [15.0, 16.0, 18.0, 30.0], [15.0, 12.0, 14.0, 16.0]) == 0     # a tie: prefill


def test_device_functions_name_every_nvshmem_call():
    """nvshmem_library.DEVICE_FUNCTIONS (what the pruned device library keeps) names every NVSHMEM function
    moe_ep.shmem calls: a kernel calling one it lacks would not link."""
    import re
    from moe_ep import nvshmem_library, shmem
    with open(shmem.__file__) as f:
        called = set(re.findall(r'"(nvshmemx?_[a-z0-9_]+)"', f.read()))
    assert called == set(nvshmem_library.DEVICE_FUNCTIONS)


def test_pruned_library_keeps_what_the_functions_use(tmp_path):
    """prune keeps the named functions (external, so that a kernel links them), the functions and globals they
    use, and nothing else; the pruned library prunes to itself."""
    from moe_ep.nvshmem_library import prune
    library = tmp_path / "lib.ll"
    library.write_text("""@state = global i32 7
@other = global i32 8
define i32 @helper() {
  %v = load i32, ptr @state
  ret i32 %v
}
define i32 @nvshmem_my_pe() {
  %v = call i32 @helper()
  ret i32 %v
}
define i32 @unused() {
  %v = load i32, ptr @other
  ret i32 %v
}
""")
    prune(str(library), str(tmp_path / "pruned.ll"), functions=("nvshmem_my_pe",))
    text = (tmp_path / "pruned.ll").read_text()
    assert "define i32 @nvshmem_my_pe()" in text and "@helper()" in text and "@state = " in text
    assert "@unused" not in text and "@other" not in text
    prune(str(tmp_path / "pruned.ll"), str(tmp_path / "again.ll"), functions=("nvshmem_my_pe",))
    assert (tmp_path / "again.ll").read_text().split("\n")[1:] == text.split("\n")[1:]   # but the module's name


def _alignments(kernel) -> tuple:
    """What Triton specializes a bound kernel's fixed tensor arguments on: whether each is 16-byte aligned."""
    return tuple((name, value.data_ptr() % 16 == 0) for name, value in sorted(kernel.fixed.items())
                 if isinstance(value, torch.Tensor))


@pytest.mark.parametrize("world, tokens, topk, puts", [(2, 16, 8, "auto"), (2, 5, 6, "all"), (3, 3, 8, "auto"),
                                                       (4, 64, 8, "all")])
def test_slots_bind_alike(world, tokens, topk, puts):
    """Each kernel is bound per slot (and per dispatch slot) to pointers of the same 16-byte alignment, so the
    slots share a compiled kernel: slot blocks of the layout scratch ([S, 2 + C * E] int32), of kept_tokens
    ([S, W]), lost_experts ([S, T, K] int8), ... that are not multiples of 16 bytes once gave slot 1 kernels of
    their own, every dispatch kernel compiled twice (benchmarks/NOTES.md, "Compile time of the EP kernels")."""
    p = EPAllToAll.simulated(world, tokens, 256, 8 * world, topk, puts=puts)[0].protocol
    bound = [p._dispatch_send, p._dispatch_recv, *p._prefill, p._dispatch]
    bound += [[table[s, ds] for s in range(p.slots) for ds in range(p.slots)]
              for table in (p._combine_send, p._combine_recv, p._combine)]
    for kernels in bound:
        assert len({_alignments(kernel) for kernel in kernels}) == 1, kernels[0].fn.__name__
    layout = p.dispatch_buffers.layout
    assert layout.stride(0) * 4 % 16 == 0 and layout.shape == (p.slots, 2 + 8 * world)
    assert all(p.dispatch_buffers.kept_tokens[s].is_contiguous() for s in range(p.slots))


def test_send_grids_follow_the_call():
    """An object for 1024 tokens (H 256: one work item a token, top-4 of 16 experts: 4096 ids, so its layout
    sorts chunks of 1024 ids) on 4 SMs. A call whose ids fit one chunk compares them, a program an expert,
    and one with more takes a program per chunk; the send kernels get those and a program per token (up to 5
    an SM, 10 with the prefill tiles), combine's receive a program per token (up to 8 an SM, at least one).
    Compiled, the send kernels' grids are cut to one wave, but never below the layout programs and a token one."""
    ep = EPAllToAll.simulated(1, 1024, 256, 16, 4, num_sms=4)[0]
    assert ep.protocol.grid["dispatch_send"] == 20 + 16 and ep.protocol.grid["dispatch_send_prefill"] == 40 + 16
    for send in (ep.protocol._dispatch_send[0], ep.protocol._prefill[0][0]):
        assert (send.resident_on, send.fewest) == (4, 16 + 1)
    shapes = {t: tuple(ep.protocol.call_shape(t)) for t in (0, 3, 256, 257, 1024)}
    assert shapes == {0: (16, 16, 16, 1), 3: (16, 19, 19, 3), 256: (16, 36, 56, 32), 257: (2, 22, 42, 32),
                      1024: (4, 24, 44, 32)}


def test_measure_crossover_needs_a_cuda_device():
    ep = EPAllToAll.simulated(1, 8, 256, 8, 2)[0]
    with pytest.raises(ValueError, match="measure_crossover times kernels on a CUDA device; this EPAllToAll runs "
                                         "on cpu"):
        ep.measure_crossover()
    assert ep.protocol.one_launch_tokens == ONE_LAUNCH_TOKENS and ep._dispatches == 0


def test_random_topk_is_a_distinct_softmax_routing():
    ids, weights = random_topk(64, 16, 4, generator=torch.Generator().manual_seed(0))
    assert ids.shape == (64, 4) and ids.min() >= 0 and ids.max() < 16
    assert all(len(set(row.tolist())) == 4 for row in ids)
    torch.testing.assert_close(weights.sum(-1), torch.ones(64))


COMPILE_FOR_SM90 = r"""
import torch
from moe_ep import EPAllToAll
from moe_ep.launcher import BoundKernel
from sm90 import compile_for_sm90, triton_type

def compile_once(self, *values, programs=None):
    arguments = {**self.fixed, **dict(zip(self.varying, values))}
    constants = {p.name: arguments[p.name] for p in self.fn.params if p.is_constexpr}
    types = {name: triton_type(value) for name, value in arguments.items() if name not in constants}
    compile_for_sm90(self.fn, types, constants, **{k: v for k, v in self.options.items() if k != "launch_pdl"})
    print(self.fn.__name__)

BoundKernel.__call__ = compile_once
BoundKernel.prepare = lambda self, *values: None     # loads onto a GPU: each launch below compiles instead
x, y = torch.zeros(64, 7168, dtype=torch.bfloat16), torch.zeros(64, 7168, dtype=torch.bfloat16)
ids, weights = torch.zeros(64, 8, dtype=torch.int64), torch.zeros(64, 8)
expert_out = torch.zeros(128, 128, 7168, dtype=torch.bfloat16)
for elastic in (False, True):
    p = EPAllToAll.simulated(2, 64, 7168, 256, 8, elastic=elastic)[0].protocol
    for mode in ("decode", "prefill"):
        p.dispatch_send(0, x, ids, weights, 1, mode); p.dispatch_recv(0)
    p.combine_send(0, 0, expert_out); p.combine_recv(0, 0, y, ids, 64)
    p.dispatch(0, x, ids, weights, 1, "decode"); p.combine(0, 0, expert_out, y, ids, 64)
p = EPAllToAll.simulated(2, 512, 7168, 256, 8)[0].protocol      # a layout in sorted chunks
p.dispatch_send(0, x, ids, weights, 1, "prefill"); p.dispatch(0, x, ids, weights, 1, "decode")
p, scale = EPAllToAll.simulated(2, 64, 7168, 256, 8, payload="nvfp4")[0].protocol, torch.ones(1)   # e2m1 pairs
for mode in ("decode", "prefill"):
    p.dispatch_send(0, x, ids, weights, 1, mode, scale); p.dispatch_recv(0)
p.dispatch(0, x, ids, weights, 1, "decode", scale)
"""


def test_every_kernel_compiles_for_sm90():
    """Every EP kernel, as bound, plain and elastic, compiles to a cubin for sm_90 (Triton's PTX and ptxas; no
    GPU needed), outside the interpreter, so that CPU-only CI sees what the GPU would compile; the send
    kernels also with the layout of large calls, and the dispatch kernels with the nvfp4 payload (its e4m3
    and e2m1 conversions, its packed rows)."""
    compiled = run_without_interpreter(COMPILE_FOR_SM90, timeout=900).split()
    assert compiled == (["dispatch_send_kernel", "dispatch_recv_kernel"] * 2 + [
        "combine_send_kernel", "combine_recv_kernel", "dispatch_kernel", "combine_kernel"]) * 2 + [
        "dispatch_send_kernel", "dispatch_kernel"] + ["dispatch_send_kernel", "dispatch_recv_kernel"] * 2 + [
        "dispatch_kernel"]
