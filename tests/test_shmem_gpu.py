"""Every wrapper of moe_ep.shmem exercised by a kernel on 2+ ranks, and the runtime's lifetime."""
import time

import pytest
import torch
import torch.distributed as dist
import triton
import triton.language as tl

from cases import expert_fn, make_inputs
from distributed import gpu_worlds, run
from moe_ep import EPAllToAll, reference, runtime, shmem

pytestmark = pytest.mark.gpu
N = 4096                                               # float32 elements per buffer


@triton.jit
def pe_info_kernel(out):
    tl.store(out, shmem.my_pe())
    tl.store(out + 1, shmem.n_pes())


@triton.jit(do_not_specialize=["nbytes", "peer"])
def put_kernel(dst, src, nbytes, peer, MODE: tl.constexpr):
    """MODE 0/1: putmem(_nbi)_block, 2/3: putmem(_nbi)_warp (launched with one warp); then quiet."""
    if MODE == 0:
        shmem.putmem_block(dst, src, nbytes, peer)
    elif MODE == 1:
        shmem.putmem_nbi_block(dst, src, nbytes, peer)
    elif MODE == 2:
        shmem.putmem_warp(dst, src, nbytes, peer)
    else:
        shmem.putmem_nbi_warp(dst, src, nbytes, peer)
    shmem.quiet()


@triton.jit(do_not_specialize=["nbytes", "peer", "value", "expect"])
def put_signal_kernel(dst, src, nbytes, sig, value, peer, expect, MODE: tl.constexpr, OP: tl.constexpr,
                      CMP: tl.constexpr):
    """Put with signal to `peer` (MODE: block, warp, nbi block, nbi warp), then wait for my own signal."""
    if MODE == 0:
        shmem.putmem_signal_block(dst, src, nbytes, sig, value, OP, peer)
    elif MODE == 1:
        shmem.putmem_signal_warp(dst, src, nbytes, sig, value, OP, peer)
    elif MODE == 2:
        shmem.putmem_signal_nbi_block(dst, src, nbytes, sig, value, OP, peer)
    else:
        shmem.putmem_signal_nbi_warp(dst, src, nbytes, sig, value, OP, peer)
    shmem.signal_wait_until(sig, CMP, expect)


@triton.jit(do_not_specialize=["nbytes", "peer"])
def get_kernel(dst, src, nbytes, peer, NBI: tl.constexpr):
    if NBI:
        shmem.getmem_nbi_block(dst, src, nbytes, peer)
        shmem.quiet()
    else:
        shmem.getmem_block(dst, src, nbytes, peer)


@triton.jit(do_not_specialize=["nbytes", "peer", "value"])
def fence_kernel(data, src, nbytes, flag, flag_src, value, peer, out, BLOCK: tl.constexpr):
    """Data, fence, flag: whoever sees the flag must see the data. Copies what it sees to `out`."""
    shmem.putmem_nbi_block(data, src, nbytes, peer)
    shmem.fence()
    shmem.putmem_nbi_block(flag, flag_src, 8, peer)
    shmem.wait_until(flag, shmem.CMP_EQ, value)
    offs = tl.arange(0, BLOCK)
    tl.store(out + offs, tl.load(data + offs, volatile=True))
    shmem.quiet()


@triton.jit(do_not_specialize=["value", "peer", "rank", "prev"])
def barrier_kernel(buf, out, sig, value, peer, rank, prev):
    """A store through nvshmem_ptr + barrier_all; a signal_op + quiet + sync_all. Reads what `prev` wrote."""
    tl.store(shmem.remote_ptr(buf + rank, peer), value)
    shmem.barrier_all_block()
    tl.store(out, tl.load(buf + prev, volatile=True))
    shmem.signal_op(sig, value, shmem.SIGNAL_SET, peer)
    shmem.quiet()
    shmem.sync_all_block()
    tl.store(out + 1, tl.load(sig, volatile=True).to(tl.int32))


@triton.jit(do_not_specialize=["target", "timeout_ns", "peer", "tag"])
def wait_kernel(flag, target, timeout_ns, status_addr, peer, tag, out, clock):
    ok = shmem.wait_until_ge(flag, target, timeout_ns, status_addr.to(tl.pointer_type(tl.int32)), peer, tag,
                             clock + tl.program_id(0))
    tl.store(out, ok.to(tl.int32))


def _wrappers(rank, world):
    runtime.init()
    libs = runtime.device_library()
    peer, prev = (rank + 1) % world, (rank - 1) % world
    info = torch.zeros(2, dtype=torch.int32, device="cuda")
    pe_info_kernel[(1,)](info, extern_libs=libs)
    assert info.tolist() == [rank, world]

    src = torch.arange(N, dtype=torch.float32, device="cuda") + 1000 * rank
    dst = runtime.symmetric_zeros((N,), torch.float32)
    expected_from_prev = torch.arange(N, dtype=torch.float32, device="cuda") + 1000 * prev
    for mode in range(4):
        dst.zero_()
        runtime.barrier()
        put_kernel[(1,)](dst, src, N * 4, peer, MODE=mode, num_warps=1 if mode >= 2 else 4, extern_libs=libs)
        runtime.barrier()
        assert torch.equal(dst, expected_from_prev), f"put mode {mode}"

    sig = runtime.symmetric_zeros((1,), torch.uint64)
    for mode in range(4):
        for op, rounds in ((shmem.SIGNAL_SET, 1), (shmem.SIGNAL_ADD, 2)):
            dst.zero_()
            sig.zero_()
            runtime.barrier()
            for i in range(rounds):
                value = 7 + mode if op == shmem.SIGNAL_SET else 1
                expect = value if op == shmem.SIGNAL_SET else i + 1
                cmp = shmem.CMP_EQ if op == shmem.SIGNAL_SET else shmem.CMP_GE
                put_signal_kernel[(1,)](dst, src, N * 4, sig, value, peer, expect, MODE=mode, OP=op, CMP=cmp,
                                        num_warps=1 if mode in (1, 3) else 4, extern_libs=libs)
            torch.cuda.synchronize()
            assert torch.equal(dst, expected_from_prev), f"put_signal mode {mode} op {op}"
            assert int(sig.view(torch.int64)) == (7 + mode if op == shmem.SIGNAL_SET else 2)
            runtime.barrier()

    src_sym = runtime.symmetric_empty((N,), torch.float32)
    src_sym.copy_(src)
    runtime.barrier()
    for nbi in (False, True):
        local = torch.zeros(N, dtype=torch.float32, device="cuda")
        get_kernel[(1,)](local, src_sym, N * 4, peer, NBI=nbi, extern_libs=libs)
        torch.cuda.synchronize()
        assert torch.equal(local, src + 1000 * (peer - rank)), f"get nbi={nbi}"

    flag = runtime.symmetric_zeros((1,), torch.uint64)
    out = torch.zeros(N, dtype=torch.float32, device="cuda")
    flag_src = torch.full((1,), 5, dtype=torch.uint64, device="cuda")
    dst.zero_()
    runtime.barrier()
    fence_kernel[(1,)](dst, src, N * 4, flag, flag_src, 5, peer, out, BLOCK=N, extern_libs=libs)
    torch.cuda.synchronize()
    assert torch.equal(out, expected_from_prev), "fence ordering"

    buf = runtime.symmetric_zeros((world,), torch.int32)
    seen = torch.zeros(2, dtype=torch.int32, device="cuda")
    sig.zero_()
    runtime.barrier()
    barrier_kernel[(1,)](buf, seen, sig, 100 + rank, peer, rank, prev, extern_libs=libs)
    torch.cuda.synchronize()
    assert seen.tolist() == [100 + prev, 100 + prev]
    assert runtime.peer_ptr(buf, peer) is not None and runtime.peer_ptr(buf, rank) == buf.data_ptr()
    runtime.barrier()
    assert int(runtime.peer_tensor(buf, peer)[rank]) == 100 + rank
    runtime.barrier()


@gpu_worlds
def test_every_wrapper(world):
    run(_wrappers, world, gpu=True, timeout=300)


def _timeout_path(rank, world):
    runtime.init()
    flag = torch.zeros(1, dtype=torch.int64, device="cuda")
    status = torch.zeros(5, dtype=torch.int32, pin_memory=True)
    out = torch.zeros(1, dtype=torch.int32, device="cuda")
    clock = torch.zeros(1, dtype=torch.int64, device="cuda")
    wait_kernel[(1,)](flag, 1, 10**6, status.data_ptr(), 0, 0, out, clock)      # compile and warm up
    torch.cuda.synchronize()
    status.zero_()
    start = time.perf_counter()
    wait_kernel[(1,)](flag, 1, 200 * 10**6, status.data_ptr(), 3, 9, out, clock)   # nobody ever signals
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    assert 0.19 < elapsed < 2.0, elapsed
    assert out.item() == 0 and status[:5].tolist() == [1, 3, 9, 0, 1]
    status.zero_()
    flag.fill_(5)
    wait_kernel[(1,)](flag, 5, 200 * 10**6, status.data_ptr(), 3, 9, out, clock)    # the job goes on
    torch.cuda.synchronize()
    assert out.item() == 1 and not status.any()


def test_spin_wait_times_out():
    run(_timeout_path, 2, gpu=True, timeout=120)


def _lifetime(rank, world):
    info = torch.zeros(2, dtype=torch.int32, device="cuda")
    for _ in range(2):
        runtime.init()
        runtime.init()                                   # idempotent
        kept = runtime.symmetric_zeros((1024,), torch.float32)
        runtime.symmetric_zeros((1 << 20,), torch.bfloat16)   # left for finalize to free
        pe_info_kernel[(1,)](info, extern_libs=runtime.device_library())   # compiled in the first lifetime
        torch.cuda.synchronize()
        assert info.tolist() == [rank, world]
        runtime.free(kept)
        with pytest.raises(ValueError, match="freed already"):
            runtime.free(kept)
        runtime.finalize()
        runtime.finalize()                               # idempotent
        assert not runtime.is_initialized() and not runtime._owned
    runtime.init()
    big = int(1.5 * 2**40)                               # far over any heap: a clear error
    with pytest.raises(RuntimeError, match="NVSHMEM_SYMMETRIC_SIZE"):
        runtime.symmetric_empty((big,), torch.uint8)


def test_init_finalize_twice():
    run(_lifetime, 2, gpu=True, timeout=180)


def _subgroups(rank, world):
    """Each half of the ranks starts an NVSHMEM world of its own (PEs: ranks in the half); EP over a half
    matches the reference on the same subgroup; a group of other ranks is then refused."""
    half = world // 2
    groups = [dist.new_group(list(range(half))), dist.new_group(list(range(half, world)))]
    mine = groups[rank >= half]
    sub_rank, sub_world = dist.get_rank(mine), dist.get_world_size(mine)
    ep = EPAllToAll(32, 256, 8, 2, group=mine)
    info = torch.zeros(2, dtype=torch.int32, device="cuda")
    pe_info_kernel[(1,)](info, extern_libs=runtime.device_library())
    torch.cuda.synchronize()
    assert info.tolist() == [sub_rank, sub_world]
    for seed in range(3):
        x, ids, weights = make_inputs(sub_rank, [32 - r for r in range(sub_world)], 256, 8, 2, seed, drop=0.2,
                                      device="cuda")
        recv_x, recv_scales, recv_count, handle = ep.dispatch(x, ids, weights)
        r_x, r_scales, r_count, r_handle = reference.dispatch(x, ids, weights, num_experts=8, max_tokens=32,
                                                              fp8_group=128, group=mine)
        assert torch.equal(recv_count, r_count)
        valid = torch.arange(recv_x.shape[1], device="cuda")[None, :] < r_count[:, None].long()
        assert torch.equal(recv_x[valid].view(torch.uint8), r_x[valid].view(torch.uint8))
        y = ep.combine(expert_fn(recv_x, recv_scales, 128, x.dtype), handle)
        assert torch.equal(y, reference.combine(expert_fn(r_x, r_scales, 128, x.dtype), r_handle, group=mine))
    with pytest.raises(ValueError, match="same ranks"):
        runtime.init()                                   # the default group: other ranks than NVSHMEM's
    ep.destroy()


@gpu_worlds
def test_nvshmem_over_subgroups(world):
    run(_subgroups, world, gpu=True, timeout=180)
