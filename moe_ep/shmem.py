"""Triton device library: NVSHMEM device functions, their constants, and a bounded spin-wait.

Each NVSHMEM function is bound twice: a raw ``@core.extern`` whose argument dtypes match
the C prototype exactly (pointers travel as int64, signals as uint64, ``pe``/``sig_op``/
``cmp`` as int32; a mismatch can hang or fault), and a ``@triton.jit`` wrapper of the same
name without the leading underscore that casts whatever it is given. Functions that
return ``void`` in C are declared to return an int32 that nobody reads.

Kernels that call any of these must be launched with
``extern_libs=moe_ep.runtime.device_library()``; ``moe_ep.runtime.init`` makes sure each
such module is initialized (``nvshmemx_cumodule_init``) before it first runs.

Scope: ``_block`` functions are called by every thread of the program (they are
collective over the CTA), ``_warp`` functions by every thread of a warp, i.e. with
``num_warps=1`` in Triton. A scalar extern is executed by every thread, so a
thread-scope put would be issued once per thread: only block and warp variants are bound.

Under the interpreter (CPU) the puts, the signal and fence/quiet that the EP kernels use are emulated
on the symmetric heap of a world simulated in one process (``moe_ep.simulated.SimulatedHeap``).

``wait_until_ge`` / ``wait_all_ge`` need no NVSHMEM at all: they spin on acquire loads of
local flags with a deadline from the global timer and report a timeout instead of hanging.
``wait_live_ge`` waits for the live ones of several flags. ``signal_add`` /
``signal_add_to`` and ``last_to_finish`` are the release side of the same
flag protocol: plain atomics through peer pointers.
"""
import ctypes
import os
import time

import numpy as np
import triton
import triton.language as tl
from triton.language import core

from .simulated import SimulatedHeap

# nvshmem_constants.h / nvshmem_common_transport.h. A jit function may read a module global
# only when it is a tl.constexpr.
SIGNAL_SET = tl.constexpr(9)
SIGNAL_ADD = tl.constexpr(10)
CMP_EQ = tl.constexpr(0)
CMP_NE = tl.constexpr(1)
CMP_GT = tl.constexpr(2)
CMP_LE = tl.constexpr(3)
CMP_LT = tl.constexpr(4)
CMP_GE = tl.constexpr(5)

# Codes written into a status tensor by wait_until_ge: [code, peer, tag, value seen, target].
STATUS_OK = tl.constexpr(0)
STATUS_TIMEOUT = tl.constexpr(1)
STATUS_WORDS = 5

# Kernels run in the Triton interpreter (CPU): helpers then avoid what only a GPU has.
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"

_i32, _i64, _u64 = core.dtype("int32"), core.dtype("int64"), core.dtype("uint64")
_PTR = _i64


def _call(symbol, args, arg_types, ret, semantic, pure=False):
    return core.extern_elementwise("", "", args, {tuple(arg_types): (symbol, ret)},
                                   is_pure=pure, _semantic=semantic)


# ----------------------------------------------------------------------------- raw externs

@core.extern
def _my_pe(_semantic=None):
    return _call("nvshmem_my_pe", [], [], _i32, _semantic, pure=True)


@core.extern
def _n_pes(_semantic=None):
    return _call("nvshmem_n_pes", [], [], _i32, _semantic, pure=True)


def _rma(symbol):
    """void symbol(void *dest, const void *src, size_t nbytes, int pe)."""
    @core.extern
    def fn(dest, source, nbytes, pe, _semantic=None):
        return _call(symbol, [dest, source, nbytes, pe], [_PTR, _PTR, _i64, _i32], _i32, _semantic)
    return fn


def _rma_signal(symbol):
    """void symbol(void *dest, const void *src, size_t nbytes, uint64_t *sig, uint64_t val, int op, int pe)."""
    @core.extern
    def fn(dest, source, nbytes, sig_addr, signal, sig_op, pe, _semantic=None):
        return _call(symbol, [dest, source, nbytes, sig_addr, signal, sig_op, pe],
                     [_PTR, _PTR, _i64, _PTR, _u64, _i32, _i32], _i32, _semantic)
    return fn


_putmem_block = _rma("nvshmemx_putmem_block")
_putmem_warp = _rma("nvshmemx_putmem_warp")
_putmem_nbi_block = _rma("nvshmemx_putmem_nbi_block")
_putmem_nbi_warp = _rma("nvshmemx_putmem_nbi_warp")
_getmem_block = _rma("nvshmemx_getmem_block")
_getmem_nbi_block = _rma("nvshmemx_getmem_nbi_block")
_putmem_signal_block = _rma_signal("nvshmemx_putmem_signal_block")
_putmem_signal_warp = _rma_signal("nvshmemx_putmem_signal_warp")
_putmem_signal_nbi_block = _rma_signal("nvshmemx_putmem_signal_nbi_block")
_putmem_signal_nbi_warp = _rma_signal("nvshmemx_putmem_signal_nbi_warp")


@core.extern
def _signal_op(sig_addr, signal, sig_op, pe, _semantic=None):
    return _call("nvshmemx_signal_op", [sig_addr, signal, sig_op, pe], [_PTR, _u64, _i32, _i32], _i32, _semantic)


@core.extern
def _signal_wait_until(sig_addr, cmp, cmp_value, _semantic=None):
    return _call("nvshmem_signal_wait_until", [sig_addr, cmp, cmp_value], [_PTR, _i32, _u64], _u64, _semantic)


@core.extern
def _uint64_wait_until(ivar, cmp, cmp_value, _semantic=None):
    return _call("nvshmem_uint64_wait_until", [ivar, cmp, cmp_value], [_PTR, _i32, _u64], _i32, _semantic)


@core.extern
def _ptr(dest, pe, _semantic=None):
    return _call("nvshmem_ptr", [dest, pe], [_PTR, _i32], _i64, _semantic, pure=True)


def _no_arg(symbol):
    @core.extern
    def fn(_semantic=None):
        return _call(symbol, [], [], _i32, _semantic)
    return fn


_fence = _no_arg("nvshmem_fence")
_quiet = _no_arg("nvshmem_quiet")
_barrier_all_block = _no_arg("nvshmemx_barrier_all_block")
_sync_all_block = _no_arg("nvshmemx_sync_all_block")


def _int(value) -> int:
    """A scalar the interpreter hands a Python function (a tensor of its, or a Python int), as an int."""
    return int(np.asarray(value.handle.data).reshape(-1)[0]) if hasattr(value, "handle") else int(value)


def _emulated_put(dest, source, nbytes, pe):
    SimulatedHeap.copy(_int(dest), _int(source), _int(nbytes), _int(pe))


def _emulated_signal(sig_addr, signal, sig_op, pe):
    word = ctypes.c_uint64.from_address(SimulatedHeap.translate(_int(sig_addr), _int(pe)))
    word.value = _int(signal) + (word.value if _int(sig_op) == SIGNAL_ADD.value else 0)


def _emulated_put_signal(dest, source, nbytes, sig_addr, signal, sig_op, pe):
    _emulated_put(dest, source, nbytes, pe)
    _emulated_signal(sig_addr, signal, sig_op, pe)


def _in_order():
    """fence and quiet: the interpreter runs one program at a time, and each put lands as it is made."""


if INTERPRETING:
    _putmem_block = _putmem_nbi_block = _emulated_put
    _putmem_signal_block = _putmem_signal_nbi_block = _emulated_put_signal
    _signal_op = _emulated_signal
    _fence = _quiet = _in_order


# ----------------------------------------------------------------------------- jit wrappers

@triton.jit
def my_pe():
    """This PE's number (equals the torch.distributed rank)."""
    return _my_pe()


@triton.jit
def n_pes():
    """Number of PEs."""
    return _n_pes()


@triton.jit
def putmem_block(dest, source, nbytes, pe):
    """Copy `nbytes` from local `source` to `dest` on `pe`; returns when `source` may be reused."""
    _putmem_block(dest.to(tl.int64), source.to(tl.int64), tl.cast(nbytes, tl.int64), tl.cast(pe, tl.int32))


@triton.jit
def putmem_warp(dest, source, nbytes, pe):
    """putmem_block for a program of one warp."""
    _putmem_warp(dest.to(tl.int64), source.to(tl.int64), tl.cast(nbytes, tl.int64), tl.cast(pe, tl.int32))


@triton.jit
def putmem_nbi_block(dest, source, nbytes, pe):
    """Non-blocking put: complete only after quiet() (or a fence for ordering)."""
    _putmem_nbi_block(dest.to(tl.int64), source.to(tl.int64), tl.cast(nbytes, tl.int64), tl.cast(pe, tl.int32))


@triton.jit
def putmem_nbi_warp(dest, source, nbytes, pe):
    """putmem_nbi_block for a program of one warp."""
    _putmem_nbi_warp(dest.to(tl.int64), source.to(tl.int64), tl.cast(nbytes, tl.int64), tl.cast(pe, tl.int32))


@triton.jit
def getmem_block(dest, source, nbytes, pe):
    """Copy `nbytes` from `source` on `pe` into local `dest`; the data is there on return."""
    _getmem_block(dest.to(tl.int64), source.to(tl.int64), tl.cast(nbytes, tl.int64), tl.cast(pe, tl.int32))


@triton.jit
def getmem_nbi_block(dest, source, nbytes, pe):
    """Non-blocking get: the data is there after quiet()."""
    _getmem_nbi_block(dest.to(tl.int64), source.to(tl.int64), tl.cast(nbytes, tl.int64), tl.cast(pe, tl.int32))


@triton.jit
def putmem_signal_block(dest, source, nbytes, sig_addr, signal, sig_op, pe):
    """Put, then update the uint64 `sig_addr` on `pe` with `sig_op` (SIGNAL_SET/ADD) after the data lands."""
    _putmem_signal_block(dest.to(tl.int64), source.to(tl.int64), tl.cast(nbytes, tl.int64),
                         sig_addr.to(tl.int64), tl.cast(signal, tl.uint64), tl.cast(sig_op, tl.int32),
                         tl.cast(pe, tl.int32))


@triton.jit
def putmem_signal_warp(dest, source, nbytes, sig_addr, signal, sig_op, pe):
    """putmem_signal_block for a program of one warp."""
    _putmem_signal_warp(dest.to(tl.int64), source.to(tl.int64), tl.cast(nbytes, tl.int64),
                        sig_addr.to(tl.int64), tl.cast(signal, tl.uint64), tl.cast(sig_op, tl.int32),
                        tl.cast(pe, tl.int32))


@triton.jit
def putmem_signal_nbi_block(dest, source, nbytes, sig_addr, signal, sig_op, pe):
    """Non-blocking put with signal: the signal is updated only after the data has landed."""
    _putmem_signal_nbi_block(dest.to(tl.int64), source.to(tl.int64), tl.cast(nbytes, tl.int64),
                             sig_addr.to(tl.int64), tl.cast(signal, tl.uint64), tl.cast(sig_op, tl.int32),
                             tl.cast(pe, tl.int32))


@triton.jit
def putmem_signal_nbi_warp(dest, source, nbytes, sig_addr, signal, sig_op, pe):
    """putmem_signal_nbi_block for a program of one warp."""
    _putmem_signal_nbi_warp(dest.to(tl.int64), source.to(tl.int64), tl.cast(nbytes, tl.int64),
                            sig_addr.to(tl.int64), tl.cast(signal, tl.uint64), tl.cast(sig_op, tl.int32),
                            tl.cast(pe, tl.int32))


@triton.jit
def signal_op(sig_addr, signal, sig_op, pe):
    """Atomically set or add `signal` to the uint64 at `sig_addr` on `pe`."""
    _signal_op(sig_addr.to(tl.int64), tl.cast(signal, tl.uint64), tl.cast(sig_op, tl.int32), tl.cast(pe, tl.int32))


@triton.jit
def signal_wait_until(sig_addr, cmp, value):
    """Block until the local uint64 signal compares true against `value`; returns the signal."""
    return _signal_wait_until(sig_addr.to(tl.int64), tl.cast(cmp, tl.int32), tl.cast(value, tl.uint64))


@triton.jit
def wait_until(ivar, cmp, value):
    """Block until the local uint64 `ivar` compares true against `value` (nvshmem_uint64_wait_until)."""
    _uint64_wait_until(ivar.to(tl.int64), tl.cast(cmp, tl.int32), tl.cast(value, tl.uint64))


@triton.jit
def fence():
    """Order this thread's earlier puts to each PE before its later ones."""
    _fence()


@triton.jit
def quiet():
    """Complete every outstanding put/get of this thread."""
    _quiet()


@triton.jit
def barrier_all_block():
    """Complete outstanding puts, then wait for every PE to reach the barrier (one program per PE)."""
    _barrier_all_block()


@triton.jit
def sync_all_block():
    """Wait for every PE to reach the barrier, without completing puts (one program per PE)."""
    _sync_all_block()


@triton.jit
def peer_address(addresses, index, dtype: tl.constexpr):
    """The int64 address at `index` of a peer table (every rank's address of a symmetric buffer), as a pointer
    to dtype, declared 16-byte aligned as symmetric buffers are: without that a tile stored through it goes out
    in stores of one element each, which over NVLink move a fraction of the bytes that 16-byte stores do."""
    return tl.multiple_of(tl.load(addresses + index).to(tl.pointer_type(dtype)), 16)


@triton.jit
def remote_ptr(ptr, pe):
    """nvshmem_ptr: the address through which plain loads/stores reach `pe`'s copy of the
    symmetric `ptr` (NVLink), as a pointer of ptr's type; null (0) when `pe` is not reachable."""
    address = _ptr(ptr.to(tl.int64), tl.cast(pe, tl.int32))
    return address.to(ptr.dtype)


# ----------------------------------------------------------------------------- bounded waits

if INTERPRETING:
    @triton.jit
    def now_ns():
        """Host nanoseconds: the interpreter runs kernels on the CPU, without the GPU's timer."""
        return time.monotonic_ns()

    @triton.jit
    def _pause(x):
        return x

    @triton.jit
    def load_acquire(flags):
        """Load int64 flags (a pointer or a block of pointers)."""
        return tl.load(flags)

    @triton.jit
    def any_thread(pred):
        """The interpreter runs a program as one thread: `pred` itself."""
        return pred
else:
    @triton.jit
    def now_ns():
        """Nanoseconds of the GPU's global timer."""
        return tl.extra.cuda.globaltimer()

    @triton.jit
    def _pause(x):
        """Back off ~100 ns between polls, so spinning programs leave the memory system to the writers."""
        return tl.inline_asm_elementwise("nanosleep.u32 100;\n mov.b64 $0, $1;", "=l,l", [x], dtype=tl.int64,
                                         is_pure=False, pack=1)

    @triton.jit
    def load_acquire(flags):
        """Load int64 flags with acquire semantics at system scope: what a writer stored before its
        release is visible after the load. A plain load, unlike an atomic: many programs polling one
        flag are served by the cache instead of queueing one by one at it."""
        return tl.inline_asm_elementwise("ld.acquire.sys.global.b64 $0, [$1];", "=l,l", [flags.to(tl.int64)],
                                         dtype=tl.int64, is_pure=False, pack=1)

    @triton.jit
    def any_thread(pred):
        """Whether the scalar `pred` holds in any thread of the program: a barrier that ORs it over every
        thread (``bar.red.or``), so all threads get the same answer.

        A block of a few lanes is held by every warp, each warp loading its own copy, and a reduction
        over it stays inside the warp: copies of a flag loaded a moment apart can differ, and so can
        what each warp makes of them. A loop or branch with barriers inside (a scalar atomic's result
        goes to every thread through shared memory and a barrier) must turn on one answer for all
        warps, or their barriers pair up wrongly and threads read each other's shared values."""
        return tl.inline_asm_elementwise(
            "{ .reg .pred p, q; setp.ne.s32 p, $1, 0; bar.red.or.pred q, 0, p; selp.s32 $0, 1, 0, q; }",
            "=r,r", [pred.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1) != 0


@triton.jit
def _clock_now(clock):
    """The global timer as the whole program reads it: one thread stores it in the program's `clock` word
    and every thread reads that word (see ``wait_until_ge``)."""
    tl.atomic_xchg(clock, now_ns(), sem="relaxed", scope="cta")
    return tl.atomic_add(clock, 0, sem="relaxed", scope="cta")


@triton.jit
def _clock_tick(clock):
    """A spin loop's step of the shared timer: store the timer in `clock`, return the time stored before
    (one poll behind: the loop leaves at most one poll late, and all its warps in the same one)."""
    return tl.atomic_xchg(clock, now_ns(), sem="relaxed", scope="cta")


@triton.jit
def wait_until_ge(flag, target, timeout_ns, status, peer, tag, clock):
    """Spin until the int64 at `flag` is >= `target`, for at most `timeout_ns` nanoseconds.

    Loads are acquire at system scope, so what the writer stored before its release
    (the data this flag announces) is visible afterwards to the whole program. Returns
    True when the target was reached. On timeout, writes [STATUS_TIMEOUT, peer, tag, value, target]
    into the int32 `status` (host-readable pinned memory in practice) and returns False:
    the caller skips its work and the host raises.

    `clock` is an int64 word private to the program. One thread reads the timer and shares
    it through that word, so that all warps leave the loop in the same iteration: timers
    read by each warp could disagree at the deadline and make the warps miss each other's
    barriers.
    """
    now = _clock_now(clock)
    deadline = now + timeout_ns
    value = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
    while (value < target) & (now < deadline):
        value = tl.atomic_add(_pause(flag.to(tl.int64)).to(flag.dtype), 0, sem="acquire", scope="sys")
        now = _clock_tick(clock)
    if value < target:
        tl.store(status + 1, peer)
        tl.store(status + 2, tag)
        tl.store(status + 3, value.to(tl.int32))
        tl.store(status + 4, tl.cast(target, tl.int32))
        tl.store(status, STATUS_TIMEOUT)
    tl.debug_barrier()
    return value >= target


@triton.jit
def wait_all_ge(flags, count, target, timeout_ns, status, tag, clock, COUNT_PAD: tl.constexpr):
    """Spin until flags[i] >= target for every i < count (int64, local), for at most `timeout_ns`.

    All flags are polled at once, with plain acquire loads (``load_acquire``), so waiting for
    several peers costs one round of polls, not one per peer, and many programs can poll the same
    flags. On timeout, reports the first flag i short of the target as the peer, like
    ``wait_until_ge``, and returns False. Every warp polls for itself; the program leaves the loop
    when no thread saw a flag short (``any_thread``), all warps in the same poll. The closing barrier
    extends every thread's acquire to the whole program.
    """
    i = tl.arange(0, COUNT_PAD)
    live = i < count
    polled = flags + tl.where(live, i, 0)               # padding lanes poll flag 0 again
    values = load_acquire(polled)
    short = tl.sum((live & (values < target)).to(tl.int32), 0)
    waiting = any_thread(short > 0)
    if waiting:                                         # not there yet: start the clock and spin
        now = _clock_now(clock)
        deadline = now + timeout_ns
        while waiting & (now < deadline):
            values = load_acquire(_pause(polled.to(tl.int64)).to(flags.dtype))
            short = tl.sum((live & (values < target)).to(tl.int32), 0)
            waiting = any_thread(short > 0)
            now = _clock_tick(clock)
    if waiting:
        peer = tl.min(tl.where(live & (values < target), i, COUNT_PAD), 0)
        tl.store(status + 1, peer)
        tl.store(status + 2, tag)
        tl.store(status + 3, tl.sum(tl.where(i == peer, values, 0), 0).to(tl.int32))
        tl.store(status + 4, tl.cast(target, tl.int32))
        tl.store(status, STATUS_TIMEOUT)
    tl.debug_barrier()
    return not waiting


@triton.jit
def bits_of(flags):
    """bool [N] -> int64 with bit i set where flags[i]. The reduction stays inside each warp: where
    the warps loaded their own copies of the flags, their answers can differ (see ``any_thread``)."""
    i = tl.arange(0, flags.shape[0])
    return tl.sum(tl.where(flags, 1 << i.to(tl.int64), 0), 0)


@triton.jit
def wait_live_ge(flags, count, target, live, timeout_ns, clock, COUNT_PAD: tl.constexpr):
    """``wait_all_ge`` over the flags i < count whose int32 word live[i] is not 0, re-read on every poll
    (a peer may clear it meanwhile). Returns (reached, late) as int64 bit sets (bit i: flag i): the flags
    at `target`, and the live ones still short of it when `timeout_ns` ran out (none if the wait
    succeeded), both from the same poll. Writes no status: what a late flag means is the caller's to
    decide. Like ``wait_all_ge`` the warps leave in the same poll, but each returns what it saw: the
    bit sets can differ between warps where a flag or a live word changed during that poll."""
    i = tl.arange(0, COUNT_PAD)
    valid = i < count
    polled = flags + tl.where(valid, i, 0)
    reached = bits_of(valid & (load_acquire(polled) >= target))
    alive = bits_of(tl.load(live + i, mask=valid, other=0, volatile=True) != 0)
    short = alive & ~reached
    waiting = any_thread(short != 0)
    if waiting:
        now = _clock_now(clock)
        deadline = now + timeout_ns
        while waiting & (now < deadline):
            reached = bits_of(valid & (load_acquire(_pause(polled.to(tl.int64)).to(flags.dtype)) >= target))
            alive = bits_of(tl.load(live + i, mask=valid, other=0, volatile=True) != 0)
            short = alive & ~reached
            waiting = any_thread(short != 0)
            now = _clock_tick(clock)
    tl.debug_barrier()
    return reached, short


@triton.jit
def signal_add(flag, value):
    """Release-add `value` to an int64 flag (local or through a peer pointer) once per program.

    The barrier first makes every thread's earlier stores part of what the release publishes.
    """
    tl.debug_barrier()
    tl.atomic_add(flag, value, sem="release", scope="sys")


@triton.jit
def signal_add_to(bases, offset, to, value, COUNT_PAD: tl.constexpr):
    """Release-add `value` to int64 word `offset` of the buffers picked by `to` (bool [COUNT_PAD]) at once,
    one thread each: bases[r] is the address of buffer r (rank r's copy of a symmetric int64 array)."""
    r = tl.arange(0, COUNT_PAD)
    flags = tl.load(bases + r, mask=to, other=0).to(tl.pointer_type(tl.int64)) + offset
    tl.debug_barrier()
    tl.atomic_add(flags, value, mask=to, sem="release", scope="sys")


@triton.jit
def last_to_finish(finished, total):
    """Count this program as finished in the int64 counter `finished`; True in the one program
    whose add makes it reach `total`, the last one to finish.

    The barrier puts every thread's earlier stores ahead of the acquire-release add, so whatever
    the last program releases next (a signal to a peer) also publishes every other program's stores.
    """
    tl.debug_barrier()
    return tl.atomic_add(finished, 1, sem="acq_rel", scope="sys") == total - 1
