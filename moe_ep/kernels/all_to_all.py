"""Low-latency EP dispatch and combine over NVLink peer pointers, and NVSHMEM puts where no pointer reaches.

Four kernels, two per direction, each launched by the low-latency protocol of ``moe_ep.EPAllToAll``
(``moe_ep.ep.low_latency``), and a one-launch kernel per direction that runs both (below):

dispatch_send   (on every rank, for its own tokens)
    programs [0, L)       "layout" (``_dispatch_layout``): program b sorts chunk b of this rank's
                          topk ids by expert and writes, on the rank that owns each expert e, the
                          place of each hit among the chunk's hits for e; the last layout program
                          to finish sends each chunk's offset per expert (the hits of e in the
                          chunks before it), the rows per expert and the token count. Where a call
                          has few ids (one chunk), program b instead compares every id with a block
                          of experts, which takes one step.
    programs [L, grid)    "tokens" (``_dispatch_tokens``): one work item = (token, column chunk).
                          The chunk is quantized once (``quant.quantize_groups``: the constexprs
                          SCALE_KIND, SCALE_PACK and GROUP, the payload format's
                          ``kernel_constants``; ELEMENT_PACK elements a payload item, 2 for
                          nvfp4's packed e2m1, whose rows are H / 2 bytes) and stored once to
                          every rank that owns at least one of the token's experts; the token's
                          expert ids go to every rank, its weights to those ranks.
    The last program to finish release-adds 1 to every receiver's arrival counter (slot, me).

dispatch_recv   (on every rank)
    Waits until every sender's arrival counter has reached this call, then fans each received
    token out, in local HBM, to the rows of its local experts:
    row = (rows of this expert from lower ranks) + (the chunk's offset) + (place in the chunk),
    so rows come in (source rank, token, k) order, the reference's order. It keeps what
    combine needs in local memory (per token its local hits first, in k order: their rows and
    weights); its last program to finish frees the slot on every sender (credit counter (slot, me)).

combine_send    (on every expert rank)
    One work item = (source rank, token, column chunk), or with many tokens a program the
    token's whole row: sum_k w[k] * expert_out[row(k)] over the token's local experts, in fp32,
    in k order, cast to the output dtype, stored once into the source rank's combine buffer;
    the last program signals every source.

combine_recv    (on every source rank)
    Waits for every rank's signal, adds the per-rank rows in rank order in fp32 for the ranks
    each token was routed to, casts; the last program frees the slot on every expert rank.

One launch per op. ``dispatch_kernel`` and ``combine_kernel`` run both kernels of an op, one
after the other, in one launch: for calls without a receive hook, which then cost one launch of
host time instead of two. Between the phases every program waits for the peers' signals, which
the last program to finish the send phase gives; so all programs must be on the GPU at once: the
grid is cut to what the SMs hold (``launcher.resident_programs``). With several ranks on one GPU
(shared-GPU mode) CUDA MPS gives no such guarantee across the ranks' kernels (on one H200, at 2
and 4 ranks, waits between the phases timed out with grids cut to each rank's share of SMs), so
there every call takes the two kernels. Both phases keep the split kernels' counters (``uses``,
``finished``) and stamps, rows 2i and 2i + 1, so calls of either kind can follow each other on
the same slots.

Each item's ids one item ahead. Where few programs run (``EPAllToAll(num_sms=...)`` below the GPU's
SMs: one or two programs an SM), an op's time is each program's chain of round trips per work item,
and the receives' items began with a load of the token's expert ids, which every later load of the
item waits for. Each receive program loads the next item's ids during the item before it (a
loop-carried load, waited for only where the next item uses it), so an item's chain starts at its
rows. On 2 x H200 at 4096 tokens on 24 SMs' worth, dispatch's receive phase went from about 203 to 178
us and combine's stayed at 220 (benchmarks/NOTES.md: its items were not waiting on their ids).
Combine's send keeps loading its items' hits in the item: held from one item to the next, the hits'
[HITS] rows took the one-launch combine from 90 to 110-143 registers a thread at 2 ranks (ptxas, sm_90),
a fifth to a third of the programs an SM.

The protocol. Every buffer a peer writes exists in ``NUM_SLOTS`` copies: call n uses slot
n % NUM_SLOTS, so a rank can start the next call's sends while the previous call's outputs are
still being read. Counters only grow: each side of an op (send, receive) keeps its uses of each
slot in a local word (``uses[slot]``: every program reads it when it starts, the last program
to finish records the new count), and a receiver waits until a sender's counter for the slot
reaches that use count, so a stale signal can never pass for a fresh one. One signal per (call,
peer): every program counts itself finished in a local counter (``finished[slot]``) and the
last one, which by then has seen every other program's stores, releases them all with one
atomic per peer, all peers at once. Before writing into a slot a sender waits for the
receivers' credits for that slot's previous use. Every wait is bounded (``wait_all_ge``): a
timeout writes the status words and the host raises.

Elastic mode (ELASTIC, ``EPAllToAll(elastic=True)``): every rank keeps a live mask, int32 [world] in
symmetric memory (the peer table ``live_peers``). Waits are over the live ranks; a rank that runs past
the timeout is marked dead in every rank's mask (``_wait``), nothing is sent or signalled to a dead
rank, and a receive reads the ranks whose signal reached its use count, the same set in every program
of the launch (``_agree``). Rows from rank r land in row blocks only r writes, so what a dying rank
writes late lands where nobody reads again. Combine's receive reports, per token, the experts on ranks
it did not read (``lost``).

Buffers a kernel reaches on peers come in one peer table per direction: int64 [rows, world],
``peers[ROW * world + r]`` = rank r's address of buffer ROW (the ``DISPATCH_PEERS`` /
``COMBINE_PEERS`` rows).

Peers reached by puts (PUTS; ``moe_ep.ep.puts``): a peer without a peer pointer (another node), or
every peer where puts are forced, is reached through NVSHMEM's puts and signals, which go over
whatever transport NVSHMEM was started with. Its peer-table entries point into this rank's own
staging copy of each buffer (shifted so that the same offsets land in row block [slot, peer]), so
the kernels store for it exactly as for a pointer peer; then each work item puts the rows it staged
(``_put_span``: non-blocking, one put per row chunk and peer; the rows' scales go with the call's
metadata), every program completes its puts
(``quiet``) before it counts itself finished, and the last one puts the call's small metadata
(``_put_call_layout``), fences, and signals each such peer with a put whose signal adds 1
(``_signal_by_puts``): NVSHMEM delivers the signal after its own put, and the fence orders the
earlier puts to that peer before it. Credits go back the same way. A put peer's receiver reads
its own buffers as ever: nothing on the receiving side knows which path rows came by.

With ``TIMING`` on, each kernel records four global-timer stamps per call into its row of an
int64 [4, 4] array (``STAMPS``): when its first program started, when its waits returned, when
its last store was issued, when its signal went out; ``EPAllToAll.breakdown`` reads them.
"""
import triton
import triton.language as tl

from ..shmem import (INTERPRETING, SIGNAL_ADD, any_thread, bits_of, fence, last_to_finish, now_ns, peer_address,
                     putmem_nbi_block, putmem_signal_nbi_block, quiet, signal_add_to, wait_all_ge, wait_live_ge)
from .quant import SCALE_E4M3, SCALE_FP32, SCALE_NONE, cast_rn, quantize_groups
from .status import (STATUS_BAD_CALL, STATUS_BAD_ID, STATUS_BAD_INDEX, STATUS_EVICTED, TAG_COMBINE_ARRIVAL,
                     TAG_COMBINE_CREDIT, TAG_DISPATCH_ARRIVAL, TAG_DISPATCH_CREDIT)

NUM_SLOTS = 2                # double buffering: call n uses slot n % 2

# Rows of the peer tables.
D_DATA, D_SCALES, D_IDS, D_WEIGHTS, D_POSITIONS, D_OFFSETS, D_COUNTS, D_TOKENS, D_ARRIVED, D_FREED = (
    tl.constexpr(i) for i in range(10))
DISPATCH_PEERS = ("data", "scales", "ids", "weights", "positions", "offsets", "counts", "tokens", "arrived", "freed")
C_DATA, C_ARRIVED, C_FREED = (tl.constexpr(i) for i in range(3))
COMBINE_PEERS = ("data", "arrived", "freed")

# The dispatch send's layout scratch, int32 per slot (``_dispatch_layout``): its layout blocks finished, the
# index of the first out-of-range id (NO_BAD_ID: none), then per chunk of ids its hits per expert [E].
LAYOUT_FINISHED, LAYOUT_FIRST_BAD, LAYOUT_COUNTS = (tl.constexpr(i) for i in range(3))
NO_BAD_ID = tl.constexpr(2**31 - 1)

# Timing stamps per kernel (TIMING): rows of the int64 [4, 4] stamp array, then its columns.
KERNELS = ("dispatch_send", "dispatch_recv", "combine_send", "combine_recv")
STAMPS = ("started", "waited", "worked", "signaled")
STAMP_STARTED, STAMP_WAITED, STAMP_WORKED, STAMP_SIGNALED = (tl.constexpr(i) for i in range(4))
# The one-launch kernels' receive rows: of the [2, NUM_SLOTS] counters and of the [2, 4] stamps.
RECV_COUNTERS, RECV_STAMPS = tl.constexpr(NUM_SLOTS), tl.constexpr(len(STAMPS))

# Run-time ints: no specialization on their values (an int equal to 1 would become a constexpr), so one
# compiled kernel serves every max_tokens. hidden stays specialized: its divisibility by 16 is what lets
# row loads and stores vectorize.
_INTS = ["call", "slot", "rank", "world", "max_tokens", "topk", "experts_per_rank", "timeout_ns", "remote"]


if INTERPRETING:
    @triton.jit
    def _start_receiver():
        pass
else:
    @triton.jit
    def _start_receiver():
        """Let the receive kernel, launched next with programmatic dependent launch, start now: it reads
        nothing this kernel writes locally, and spinning on the peers' signals early hides its launch."""
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _peer(peers, row, r, world, dtype: tl.constexpr):
    """Rank r's copy of peer-table buffer `row`, as a pointer to dtype (``peer_address``)."""
    return peer_address(peers, row * world + r, dtype)


@triton.jit
def _use(uses, slot):
    """This launch's use count of `slot`: one more than the uses recorded by the last launch that
    touched it (``_retire``). Every program reads it before the last program of this launch can
    finish, so all programs agree."""
    return tl.load(uses + slot, volatile=True) + 1


@triton.jit
def _clock(clocks):
    """This program's clock word for the bounded waits."""
    return clocks + tl.program_id(0)


@triton.jit
def _retire(finished, uses, use):
    """Count this program finished; True in the last one, which records `use` as the slot's uses
    (word `uses`, read by the next launch) and rearms `finished` for the next launch."""
    last = last_to_finish(finished, tl.num_programs(0))
    if last:
        tl.store(finished, 0)
        tl.store(uses, use)
    return last


@triton.jit
def _stamp(stamps, which: tl.constexpr, TIMING: tl.constexpr):
    """Record the global timer in stamps[which]: the earliest start, the latest of the other stamps."""
    if TIMING:
        if which == STAMP_STARTED:
            tl.atomic_min(stamps + which, now_ns(), sem="relaxed")
        else:
            tl.atomic_max(stamps + which, now_ns(), sem="relaxed")


@triton.jit
def _bit(bits, r):
    """Whether rank r (a scalar or a block of ranks) is in the int64 rank set `bits` (rank r: bit r)."""
    return ((bits >> r) & 1) != 0


@triton.jit
def _live(live_peers, rank, world, WORLD_PAD: tl.constexpr, ELASTIC: tl.constexpr):
    """The ranks this one counts live (its copy of the live mask), as bits; every rank without ELASTIC."""
    if ELASTIC:
        r = tl.arange(0, WORLD_PAD)
        live = tl.load(_peer(live_peers, 0, rank, world, tl.int32) + r, mask=r < world, other=0, volatile=True)
        bits = bits_of(live != 0)
    else:
        bits = tl.full([], -1, tl.int64)
    return bits


@triton.jit
def _wait(flags, world, target, live_peers, rank, timeout_ns, status, tag, clock, WORLD_PAD: tl.constexpr,
          ELASTIC: tl.constexpr):
    """Wait until flags[r] >= target for every rank r. Returns (ok, reached): False if the wait failed,
    and the ranks whose flag reached the target, as bits.

    Without ELASTIC a timeout fails the wait (``wait_all_ge`` reports it). With ELASTIC the wait is over
    the ranks still live; a rank that times out is marked dead, in the live mask of every rank, itself
    included (``_mark_dead``), and the wait succeeds without it. It fails only when this rank finds
    itself marked dead: it answered too late, and its peers went on without it."""
    if ELASTIC:
        live = _peer(live_peers, 0, rank, world, tl.int32)
        reached, late = wait_live_ge(flags, world, target, live, timeout_ns, clock, WORLD_PAD)
        _mark_dead(live_peers, late, world, WORLD_PAD)
        ok = not any_thread(tl.load(live + rank, volatile=True) == 0)
        if not ok:
            tl.store(status + STATUS_EVICTED, 1)
    else:
        ok = wait_all_ge(flags, world, target, timeout_ns, status, tag, clock, WORLD_PAD)
        reached = tl.full([], -1, tl.int64)
    return ok, reached


@triton.jit
def _mark_dead(live_peers, late, world, WORLD_PAD: tl.constexpr):
    """Clear the live word of each `late` rank (bits) on every rank."""
    r = tl.arange(0, WORLD_PAD)
    words = tl.load(live_peers + r, mask=r < world, other=0).to(tl.pointer_type(tl.int32))
    tl.store(words[:, None] + r[None, :], 0, mask=(r < world)[:, None] & _bit(late, r)[None, :])


@triton.jit
def _agree(word, use, reached, ELASTIC: tl.constexpr):
    """The ranks whose rows a receive launch reads: with ELASTIC, the `reached` of its first program to
    get here (of its first thread), kept in its slot's word as (use << 32) | bits, so that every program
    and every warp reads the same ranks even where a late rank's signal lands between their waits."""
    if ELASTIC:
        mine = (use.to(tl.int64) << 32) | reached
        seen = tl.atomic_add(word, 0, sem="acquire", scope="gpu")
        if (seen >> 32) != use:
            old = tl.atomic_cas(word, seen, mine, sem="acq_rel", scope="gpu")
            seen = tl.where(old == seen, mine, old)
        reached = seen & 0xFFFFFFFF
    return reached


@triton.jit
def _begin(stamps, uses, slot, clocks, status_addr, flags, live_peers, rank, world, behind, timeout_ns, tag,
           EARLY: tl.constexpr, WORLD_PAD: tl.constexpr, ELASTIC: tl.constexpr, TIMING: tl.constexpr):
    """A launch's start, stamped: with EARLY it lets the receive kernel start (``_start_receiver``);
    then this launch's use of `slot` and the wait until flags[slot * world + r] >= use - behind for
    every rank r (``_wait``). Returns the status pointer (pinned host memory: the host reads it without a
    sync), the use, and the wait's (ok, reached)."""
    _stamp(stamps, STAMP_STARTED, TIMING)
    if EARLY:
        _start_receiver()
    status = status_addr.to(tl.pointer_type(tl.int32))
    use = _use(uses, slot)
    ok, reached = _wait(flags + slot * world, world, use - behind, live_peers, rank, timeout_ns, status, tag,
                        _clock(clocks), WORLD_PAD, ELASTIC)
    _stamp(stamps, STAMP_WAITED, TIMING)
    return status, use, ok, reached


@triton.jit
def _await_peers(ok, stamps, flags, slot, live_peers, rank, world, use, timeout_ns, status, tag, clocks,
                 WORLD_PAD: tl.constexpr, ELASTIC: tl.constexpr, TIMING: tl.constexpr):
    """A one-launch kernel's receive phase starts, stamped in its row `stamps`: unless an earlier wait
    failed (`ok` False), wait until flags[slot * world + r] >= use for every rank r. Returns (ok, reached)."""
    _stamp(stamps, STAMP_STARTED, TIMING)
    reached = tl.full([], 0, tl.int64)
    if ok:
        ok, reached = _wait(flags + slot * world, world, use, live_peers, rank, timeout_ns, status, tag,
                            _clock(clocks), WORLD_PAD, ELASTIC)
    _stamp(stamps, STAMP_WAITED, TIMING)
    return ok, reached


@triton.jit
def _finish(finished, uses, use, ok, peers, row, offset, live_peers, rank, world, remote, echo_addr, stamps,
            WORLD_PAD: tl.constexpr, ELASTIC: tl.constexpr, TIMING: tl.constexpr, PUTS: tl.constexpr):
    """Count this program finished; the last one adds 1 to word `offset` of buffer `row` on every rank
    (with ELASTIC: on every live rank, and on none where this rank's wait failed): through a pointer, or
    for the ranks of `remote` (bits) by a put (``_signal_by_puts``)."""
    far = _finish_pointers(finished, uses, use, ok, peers, row, offset, live_peers, rank, world, remote, stamps,
                           WORLD_PAD, ELASTIC, TIMING, PUTS)
    if PUTS:
        _signal_by_puts(peers, row, offset, far, echo_addr, rank, world, stamps, TIMING)


@triton.jit
def _finish_pointers(finished, uses, use, ok, peers, row, offset, live_peers, rank, world, remote, stamps,
                     WORLD_PAD: tl.constexpr, ELASTIC: tl.constexpr, TIMING: tl.constexpr, PUTS: tl.constexpr):
    """``_finish`` up to the ranks a pointer reaches. Returns the ranks of `remote` (bits) the last program
    must still signal by puts, none in the other programs. With PUTS every program first completes its puts."""
    if PUTS:
        quiet()
    _stamp(stamps, STAMP_WORKED, TIMING)
    far = tl.full([], 0, tl.int64)
    if _retire(finished, uses, use):
        r = tl.arange(0, WORLD_PAD)
        ranks = world
        if ELASTIC:
            ranks = tl.where(ok, world, 0)
        to = (r < ranks) & _bit(_live(live_peers, rank, world, WORLD_PAD, ELASTIC), r)
        signal_add_to(peers + row * world, offset, to & ~_bit(remote, r), 1, WORLD_PAD)
        far = bits_of(to) & remote
        _stamp(stamps, STAMP_SIGNALED, TIMING)
    return far


@triton.jit
def _put_span(peers, row, rank, r, world, offset, count, dtype: tl.constexpr):
    """Put `count` elements of buffer `row` from `offset` on: from this rank's staging for rank r (its
    peer-table entry) to the same place of rank r's buffer (this rank's own address of it: symmetric)."""
    source = _peer(peers, row, r, world, dtype) + offset
    putmem_nbi_block(_peer(peers, row, rank, world, dtype) + offset, source, count * (dtype.primitive_bitwidth // 8), r)


@triton.jit
def _signal_by_puts(peers, row, offset, far, echo_addr, rank, world, stamps, TIMING: tl.constexpr):
    """Add 1 to word `offset` of buffer `row` on each rank of `far` (bits), after everything this rank
    put to it before: a put of this rank's echo word (a symmetric int64 [world] nobody reads) with a signal.
    One call for the program: a signal alone (signal_op) would be made by every thread."""
    echo = echo_addr.to(tl.pointer_type(tl.int64)) + rank
    flag = _peer(peers, row, rank, world, tl.int64) + offset
    for r in range(world):
        if _bit(far, r):
            putmem_signal_nbi_block(echo, echo, 8, flag, 1, SIGNAL_ADD, r)
    _stamp(stamps, STAMP_SIGNALED, TIMING)


@triton.jit
def _put_call_layout(peers, stage, far, num_tokens, rank, world, max_tokens, hidden, topk, experts_per_rank,
                     layout_chunks, SCALE_KIND: tl.constexpr, SCALE_PACK: tl.constexpr, GROUP: tl.constexpr,
                     CHUNK_IDS: tl.constexpr):
    """Dispatch's metadata of a call, staged for each rank of `far` (bits), put to it (the rows went with
    their work items): the scales of the call's rows, items of their storage type (one put, where a put per
    row chunk would be a message of a few dozen bytes), ids, weights, positions and offsets of the call's ids,
    counts, token count; then a fence, which orders them before the signal that follows."""
    ids = num_tokens * topk
    meta = stage.to(tl.int64) * max_tokens * topk
    groups = hidden // GROUP
    for r in range(world):
        if _bit(far, r):
            if ids > 0:
                if SCALE_KIND != SCALE_NONE:
                    items = groups // SCALE_PACK
                    _put_span(peers, D_SCALES, rank, r, world, stage.to(tl.int64) * max_tokens * items,
                              num_tokens * items, _scale_item(SCALE_KIND, SCALE_PACK))
                _put_span(peers, D_IDS, rank, r, world, meta, ids, tl.int32)
                _put_span(peers, D_WEIGHTS, rank, r, world, meta, ids, tl.float32)
                _put_span(peers, D_POSITIONS, rank, r, world, meta, ids, tl.int32)
                _put_span(peers, D_OFFSETS, rank, r, world, stage * layout_chunks * experts_per_rank,
                          tl.cdiv(ids, CHUNK_IDS) * experts_per_rank, tl.int32)
            _put_span(peers, D_COUNTS, rank, r, world, stage * experts_per_rank, experts_per_rank, tl.int32)
            _put_span(peers, D_TOKENS, rank, r, world, stage, 1, tl.int32)
    fence()


@triton.jit
def _dispatch_sent(finished, uses, use, ok, peers, stage, live_peers, rank, world, remote, echo_addr, stamps,
                   num_tokens, max_tokens, hidden, topk, experts_per_rank, layout_chunks, SCALE_KIND: tl.constexpr,
                   SCALE_PACK: tl.constexpr, GROUP: tl.constexpr, CHUNK_IDS: tl.constexpr, WORLD_PAD: tl.constexpr,
                   ELASTIC: tl.constexpr, TIMING: tl.constexpr, PUTS: tl.constexpr):
    """The end of dispatch's send phase: ``_finish`` signals the ranks a pointer reaches; with PUTS its last
    program then puts the call's metadata to the others and signals them."""
    far = _finish_pointers(finished, uses, use, ok, peers, D_ARRIVED, stage, live_peers, rank, world, remote,
                           stamps, WORLD_PAD, ELASTIC, TIMING, PUTS)
    if PUTS:
        _put_call_layout(peers, stage, far, num_tokens, rank, world, max_tokens, hidden, topk, experts_per_rank,
                         layout_chunks, SCALE_KIND, SCALE_PACK, GROUP, CHUNK_IDS)
        _signal_by_puts(peers, D_ARRIVED, stage, far, echo_addr, rank, world, stamps, TIMING)


@triton.constexpr_function
def _scale_item(SCALE_KIND, SCALE_PACK):
    """The storage type of a scales item (``PayloadFormat.scale_storage``): a float32 scale (SCALE_FP32), an
    e4m3 one (SCALE_E4M3), or UE8M0 exponent bytes, four in an int32 with SCALE_PACK 4 ("fp8_ue8m0"), one
    with 1 ("mxfp8")."""
    if SCALE_KIND == SCALE_FP32:
        return tl.float32
    if SCALE_KIND == SCALE_E4M3:
        return tl.float8e4nv
    return tl.int32 if SCALE_PACK == 4 else tl.uint8


@triton.jit
def _scale_items(chunk, hidden, GROUP: tl.constexpr, BLOCK_GROUPS: tl.constexpr, SCALE_PACK: tl.constexpr):
    """Chunk `chunk`'s scales items (SCALE_PACK groups' scales each) [BLOCK_GROUPS // SCALE_PACK], and the
    items of a row of `hidden` columns (a multiple of GROUP * SCALE_PACK)."""
    items = chunk * (BLOCK_GROUPS // SCALE_PACK) + tl.arange(0, BLOCK_GROUPS // SCALE_PACK)
    return items, hidden // (GROUP * SCALE_PACK)


@triton.jit
def _chunk(chunk, width, GROUP: tl.constexpr, BLOCK_GROUPS: tl.constexpr):
    """Chunk `chunk` of BLOCK_GROUPS scale groups of a row of `width` items, GROUP items a group (x's
    columns; or payload items: hidden / ELEMENT_PACK a row, GROUP / ELEMENT_PACK a group): its items
    [BLOCK_GROUPS, GROUP] and their mask."""
    g = chunk * BLOCK_GROUPS + tl.arange(0, BLOCK_GROUPS)
    cols = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    return cols, cols < width


@triton.jit
def _pick(values, index, k):
    """values[k] of a short vector, as a scalar."""
    return tl.sum(tl.where(index == k, values, 0), axis=0)


@triton.jit
def _send_token_count(peers, stage, num_tokens, world, live):
    """This rank's token count, to row block `stage` of every rank in `live` (bits)."""
    for r in range(world):
        if _bit(live, r):
            tl.store(_peer(peers, D_TOKENS, r, world, tl.int32) + stage, num_tokens)


@triton.jit
def _report_bad_id(status, ids_ptr, index, call):
    """Dispatch call `call`'s first id outside [-1, E), topk_ids[index], into the status words."""
    tl.store(status + STATUS_BAD_ID, tl.load(ids_ptr + index).to(tl.int32))
    tl.store(status + STATUS_BAD_INDEX, index)
    tl.store(status + STATUS_BAD_CALL, call)


@triton.jit
def _layout_by_compare(ids_ptr, peers, status, block, stage, num_tokens, call, world, max_tokens, topk,
                       experts_per_rank, num_experts, live, EXPERTS_BLOCK: tl.constexpr, BLOCK_I: tl.constexpr,
                       VALIDATE: tl.constexpr):
    """For experts [block * EXPERTS_BLOCK, ...) at once: the place of each of this rank's (token, k) hits
    of each expert among its rows, in (t, k) order (every id compared with every expert of the block, a
    cumsum along the ids), and their count, written to the owner's positions [T_max, K] and counts
    [E_loc] of row block `stage`. Block 0 also sends the token count, and with VALIDATE reports the first
    id outside [-1, E) in the status words. Owners outside `live` (bits) get nothing."""
    experts = block * EXPERTS_BLOCK + tl.arange(0, EXPERTS_BLOCK)
    owner = tl.where(experts < num_experts, experts // experts_per_rank, 0)
    real = (experts < num_experts) & _bit(live, owner)
    positions = tl.load(peers + D_POSITIONS * world + owner).to(tl.pointer_type(tl.int32))
    positions += stage * max_tokens * topk
    found = tl.zeros((EXPERTS_BLOCK,), tl.int32)
    n = num_tokens * topk
    first_bad = n
    for i0 in range(0, n, BLOCK_I):
        i = i0 + tl.arange(0, BLOCK_I)
        ids = tl.load(ids_ptr + i, mask=i < n, other=-1)
        hit = ((ids[None, :] == experts[:, None]) & real[:, None]).to(tl.int32)   # [EXPERTS_BLOCK, BLOCK_I]
        tl.store(positions[:, None] + i[None, :], found[:, None] + tl.cumsum(hit, 1) - 1, mask=hit > 0)
        found += tl.sum(hit, 1)
        if VALIDATE:
            bad = (i < n) & ((ids < -1) | (ids >= num_experts))
            first_bad = tl.minimum(first_bad, tl.min(tl.where(bad, i, n), 0))
    if VALIDATE:
        if (block == 0) & (first_bad < n):
            _report_bad_id(status, ids_ptr, first_bad, call)
    counts = tl.load(peers + D_COUNTS * world + owner).to(tl.pointer_type(tl.int32)) + stage * experts_per_rank
    tl.store(counts + experts - owner * experts_per_rank, found, mask=real)
    if block == 0:
        _send_token_count(peers, stage, num_tokens, world, live)


@triton.jit
def _layout_chunk(ids_ptr, peers, layout, chunk, stage, num_tokens, world, max_tokens, topk, experts_per_rank,
                  num_experts, live, CHUNK_IDS: tl.constexpr, NUM_BINS: tl.constexpr, VALIDATE: tl.constexpr):
    """Chunk `chunk` of this rank's topk ids, ids [chunk * CHUNK_IDS, ...) in (token, k) order: each hit's
    place among the chunk's hits of its expert, written to the owner's positions [T_max, K] of row block
    `stage`, and the chunk's hits per expert to layout[LAYOUT_COUNTS + chunk * E, ...) for
    ``_layout_offsets``. Hits on owners outside `live` (bits) count nowhere. With VALIDATE, the index of
    the chunk's first id outside [-1, E) lowers layout[LAYOUT_FIRST_BAD].

    O(CHUNK_IDS log^2 CHUNK_IDS) work: the chunk is sorted by (expert, index), so that the hits of an
    expert lie side by side in (t, k) order; the first of them sits at the expert's exclusive prefix of
    the chunk's histogram, and each hit's place is its distance from there."""
    n = num_tokens * topk
    j = tl.arange(0, CHUNK_IDS)
    i = chunk * CHUNK_IDS + j
    ids = tl.load(ids_ptr + i, mask=i < n, other=-1)
    in_range = (ids >= 0) & (ids < num_experts)
    if VALIDATE:
        first_bad = tl.min(tl.where((i < n) & ~in_range & (ids != -1), i, n), 0)
        if first_bad < n:
            tl.atomic_min(layout + LAYOUT_FIRST_BAD, first_bad)
    hit = in_range & _bit(live, tl.where(in_range, ids // experts_per_rank, 0))
    bins = tl.where(hit, ids, num_experts).to(tl.int32)        # misses in bin E
    hits = tl.histogram(bins, NUM_BINS)
    keys = tl.sort(bins * CHUNK_IDS + j)
    expert = keys // CHUNK_IDS
    place = j - tl.gather(tl.cumsum(hits, 0) - hits, expert, 0)
    found = expert < num_experts
    owner = tl.where(found, expert // experts_per_rank, 0)
    positions = tl.load(peers + D_POSITIONS * world + owner).to(tl.pointer_type(tl.int32))
    tl.store(positions + stage * max_tokens * topk + chunk * CHUNK_IDS + keys % CHUNK_IDS, place, mask=found)
    e = tl.arange(0, NUM_BINS)
    tl.store(layout + LAYOUT_COUNTS + chunk * num_experts + e, hits, mask=e < num_experts)


@triton.jit
def _layout_offsets(ids_ptr, peers, layout, status, stage, num_tokens, call, world, topk, experts_per_rank,
                    num_experts, layout_chunks, live, CHUNK_IDS: tl.constexpr, SCAN_CHUNKS: tl.constexpr,
                    SCAN_EXPERTS: tl.constexpr, VALIDATE: tl.constexpr):
    """After every chunk's ``_layout_chunk`` (by the last layout program to finish): per expert, each chunk's
    first place among this rank's rows (the hits in the chunks before it), written to the owner's
    offsets [layout_chunks, E_loc] of row block `stage`, and the rows in all, to its counts [E_loc]; the
    token count to every live rank. SCAN_CHUNKS chunks x SCAN_EXPERTS experts a step. With VALIDATE,
    reports the first id outside [-1, E) in the status words and rearms layout[LAYOUT_FIRST_BAD]."""
    n = num_tokens * topk
    chunks = tl.cdiv(n, CHUNK_IDS)
    for e0 in range(0, num_experts, SCAN_EXPERTS):
        e = e0 + tl.arange(0, SCAN_EXPERTS)
        owner = tl.where(e < num_experts, e // experts_per_rank, 0)
        real = (e < num_experts) & _bit(live, owner)
        local = e - owner * experts_per_rank
        offsets = tl.load(peers + D_OFFSETS * world + owner).to(tl.pointer_type(tl.int32))
        offsets += stage * layout_chunks * experts_per_rank + local
        before = tl.zeros((SCAN_EXPERTS,), tl.int32)      # hits in the chunks summed so far
        for c0 in range(0, chunks, SCAN_CHUNKS):
            c = c0 + tl.arange(0, SCAN_CHUNKS)
            both = (c < chunks)[:, None] & real[None, :]
            hits = tl.load(layout + LAYOUT_COUNTS + c[:, None] * num_experts + e[None, :], mask=both, other=0)
            tl.store(offsets[None, :] + c[:, None] * experts_per_rank, before[None, :] + tl.cumsum(hits, 0) - hits,
                     mask=both)
            before += tl.sum(hits, 0)
        counts = tl.load(peers + D_COUNTS * world + owner).to(tl.pointer_type(tl.int32))
        tl.store(counts + stage * experts_per_rank + local, before, mask=real)
    _send_token_count(peers, stage, num_tokens, world, live)
    if VALIDATE:
        first_bad = tl.load(layout + LAYOUT_FIRST_BAD)
        if first_bad < n:
            _report_bad_id(status, ids_ptr, first_bad, call)
            tl.store(layout + LAYOUT_FIRST_BAD, NO_BAD_ID)


@triton.jit
def _dispatch_layout(ok, ids_ptr, peers, layout, status, block, stage, num_tokens, call, world, max_tokens, topk,
                     experts_per_rank, num_experts, layout_blocks, layout_chunks, live, COMPARE: tl.constexpr,
                     CHUNK_IDS: tl.constexpr, EXPERTS_BLOCK: tl.constexpr, NUM_BINS: tl.constexpr,
                     SCAN_CHUNKS: tl.constexpr, SCAN_EXPERTS: tl.constexpr, VALIDATE: tl.constexpr):
    """Layout block `block` of `layout_blocks` (the host picks the count per call, ``low_latency.layout_blocks``).
    Where the call's ids fit one chunk of CHUNK_IDS (always with COMPARE: a call of max_tokens has that few),
    a block of EXPERTS_BLOCK experts compared with every id (``_layout_by_compare``): one step, and chunk 0's
    offsets are 0 whichever way they were written. Otherwise one block per chunk of the call's ids
    (``_layout_chunk``); the last block to finish sums the chunks up (``_layout_offsets``) and rearms the
    count of finished blocks. Where this program's wait failed (`ok` False) it only counts itself finished,
    so that the count stays right for the next launch."""
    if COMPARE or num_tokens * topk <= CHUNK_IDS:
        if ok:
            _layout_by_compare(ids_ptr, peers, status, block, stage, num_tokens, call, world, max_tokens, topk,
                               experts_per_rank, num_experts, live, EXPERTS_BLOCK, CHUNK_IDS, VALIDATE)
    else:
        if ok & (block < tl.cdiv(num_tokens * topk, CHUNK_IDS)):
            _layout_chunk(ids_ptr, peers, layout, block, stage, num_tokens, world, max_tokens, topk,
                          experts_per_rank, num_experts, live, CHUNK_IDS, NUM_BINS, VALIDATE)
        if last_to_finish(layout + LAYOUT_FINISHED, layout_blocks):
            if ok:
                _layout_offsets(ids_ptr, peers, layout, status, stage, num_tokens, call, world, topk,
                                experts_per_rank, num_experts, layout_chunks, live, CHUNK_IDS, SCAN_CHUNKS,
                                SCAN_EXPERTS, VALIDATE)
            tl.store(layout + LAYOUT_FINISHED, 0)


@triton.jit
def _dispatch_tokens(x_ptr, ids_ptr, w_ptr, tensor_scale_ptr, peers, item0, items_step, stage, num_tokens, rank,
                     world, max_tokens, hidden, topk, experts_per_rank, live, remote, SCALE_KIND: tl.constexpr,
                     SCALE_PACK: tl.constexpr, GROUP: tl.constexpr, ELEMENT_PACK: tl.constexpr,
                     BLOCK_GROUPS: tl.constexpr, K_PAD: tl.constexpr, PUTS: tl.constexpr):
    """Work items item0, item0 + items_step, ... of (token, chunk of BLOCK_GROUPS * GROUP columns):
    quantize the chunk once as the payload format says (SCALE_KIND, SCALE_PACK, GROUP: its
    ``kernel_constants``; SCALE_NONE sends x as it is; SCALE_E4M3 multiplies by the float32 at
    tensor_scale_ptr, loaded once), store its payload items (ELEMENT_PACK elements each: a row is
    hidden / ELEMENT_PACK items) and its scales (items of their storage type) to every rank that owns one of
    the token's experts; with the first chunk, the token's ids to every rank and its weights to those ranks.
    Ranks outside `live` (bits) get nothing. With PUTS, the chunk staged for a rank of `remote` (bits) is put
    to it at once (its scales, ids and weights go with the call's metadata: ``_put_call_layout``)."""
    kk = tl.arange(0, K_PAD)
    chunks = tl.cdiv(hidden, BLOCK_GROUPS * GROUP)
    width = hidden // ELEMENT_PACK                       # payload items a row
    ITEM_GROUP: tl.constexpr = GROUP // ELEMENT_PACK     # payload items a scale group
    tensor_scale = 1.0
    if SCALE_KIND == SCALE_E4M3:
        tensor_scale = tl.load(tensor_scale_ptr)
    for item in range(item0, num_tokens * chunks, items_step):
        t = item // chunks
        chunk = item % chunks
        ids = tl.load(ids_ptr + t * topk + kk, mask=kk < topk, other=-1).to(tl.int32)
        dest = tl.where(ids >= 0, ids // experts_per_rank, -1)
        row = stage.to(tl.int64) * max_tokens + t
        if chunk == 0:
            weights = tl.load(w_ptr + t * topk + kk, mask=kk < topk, other=0.0).to(tl.float32)
            for r in range(world):
                if _bit(live, r):
                    tl.store(_peer(peers, D_IDS, r, world, tl.int32) + row * topk + kk, ids, mask=kk < topk)
                if (tl.max((dest == r).to(tl.int32), 0) > 0) & _bit(live, r):
                    tl.store(_peer(peers, D_WEIGHTS, r, world, tl.float32) + row * topk + kk, weights,
                             mask=kk < topk)
        cols, mask = _chunk(chunk, hidden, GROUP, BLOCK_GROUPS)
        x = tl.load(x_ptr + t.to(tl.int64) * hidden + cols, mask=mask, other=0.0)
        if SCALE_KIND == SCALE_NONE:
            payload = x
        else:
            payload, scales = quantize_groups(x.to(tl.float32), tensor_scale, SCALE_KIND, SCALE_PACK)
            items, num_items = _scale_items(chunk, hidden, GROUP, BLOCK_GROUPS, SCALE_PACK)
        out_cols, out_mask = _chunk(chunk, width, ITEM_GROUP, BLOCK_GROUPS)
        for r in range(world):
            if (tl.max((dest == r).to(tl.int32), 0) > 0) & _bit(live, r):
                tl.store(_peer(peers, D_DATA, r, world, payload.dtype) + row * width + out_cols, payload,
                         mask=out_mask)
                if SCALE_KIND != SCALE_NONE:
                    tl.store(_peer(peers, D_SCALES, r, world, scales.dtype) + row * num_items + items, scales,
                             mask=items < num_items)
                if PUTS:
                    if _bit(remote, r):
                        first = chunk * BLOCK_GROUPS * ITEM_GROUP
                        _put_span(peers, D_DATA, rank, r, world, row * width + first,
                                  tl.minimum(width - first, BLOCK_GROUPS * ITEM_GROUP), payload.dtype)


@triton.jit
def _dispatch_recv_counts(tokens_ptr, count_ptr, recv_count_ptr, kept_tokens_ptr, stage, world, experts_per_rank,
                          reached):
    """Receive's once-per-call part: the token count of each source, and the rows per local expert, over
    the sources in `reached` (bits; the others count 0 tokens)."""
    for src in range(world):
        tl.store(kept_tokens_ptr + src, tl.where(_bit(reached, src), tl.load(tokens_ptr + stage + src), 0))
    for e0 in range(0, experts_per_rank, 128):
        e = e0 + tl.arange(0, 128)
        total = tl.zeros((128,), tl.int32)
        for src in range(world):
            counts = tl.load(count_ptr + (stage + src) * experts_per_rank + e, mask=e < experts_per_rank, other=0)
            total += tl.where(_bit(reached, src), counts, 0)
        tl.store(recv_count_ptr + e, total, mask=e < experts_per_rank)


@triton.jit
def _longest(tokens_ptr, ranks, world, WORLD_PAD: tl.constexpr):
    """The most tokens any rank in `ranks` (bits) sent, of the counts tokens_ptr[0:world] (int32): work
    items walk that many rows of each source, not max_tokens (a decode call on an object sized for prefill
    would step through every empty row)."""
    r = tl.arange(0, WORLD_PAD)
    return tl.max(tl.load(tokens_ptr + r, mask=(r < world) & _bit(ranks, r), other=0), 0)


@triton.jit
def _source_row(item, chunks, longest, max_tokens):
    """Work item `item` of (source, row, chunk), `longest` rows a source (``_longest``): its source, its
    row t, and src * max_tokens + t, the row's place in buffers of max_tokens rows a source."""
    src = item // chunks // longest
    t = item // chunks % longest
    return src, t, src * max_tokens + t


@triton.jit
def _combine_item(item, chunks, max_tokens, rank, world):
    """Work item `item` of combine's send, of (row, column chunk, source) with the source fastest and this
    rank's next first: its source, its row t, src * max_tokens + t, and its chunk. At every moment each
    rank's programs store to every source alike. With the source slowest every rank stored into rank 0,
    then into rank 1, ...: one GPU's incoming links carried every row at once (at 4 ranks a third of each
    sender's link), and at 2 ranks each rank sent during half of the send only."""
    src = (item + rank + 1) % world
    rest = item // world
    t = rest // chunks
    return src, t, src * max_tokens + t, rest % chunks


@triton.jit
def _staged_ids(ids_ptr, item, end, stage, chunks, longest, max_tokens, topk, K_PAD: tl.constexpr):
    """The staged expert ids [K_PAD] of work item `item`'s row (``_source_row``) in row blocks `stage` on,
    where item < end; else -1s."""
    _, _, src_row = _source_row(item, chunks, tl.maximum(longest, 1), max_tokens)
    kk = tl.arange(0, K_PAD)
    return tl.load(ids_ptr + (stage * max_tokens + src_row) * topk + kk, mask=kk < tl.where(item < end, topk, 0),
                   other=-1)


@triton.jit
def _dispatch_recv_items(data_ptr, scale_ptr, ids_ptr, w_ptr, pos_ptr, offset_ptr, count_ptr, tokens_ptr,
                         recv_x_ptr, recv_scale_ptr, recv_src_ptr, kept_w_ptr, kept_row_ptr, item0,
                         items_step, stage, rank, world, max_tokens, hidden, topk, experts_per_rank,
                         layout_chunks, reached, SCALE_KIND: tl.constexpr, SCALE_PACK: tl.constexpr,
                         GROUP: tl.constexpr, ELEMENT_PACK: tl.constexpr, BLOCK_GROUPS: tl.constexpr,
                         K_PAD: tl.constexpr, CHUNK_IDS: tl.constexpr, WORLD_PAD: tl.constexpr):
    """Work items item0, item0 + items_step, ... of (source row, chunk) of the sources in `reached` (bits):
    fan the received chunk's payload items (hidden / ELEMENT_PACK a row) and its scales (items of their
    storage type), copied unchanged, out to the rows of its local experts; with the first chunk, keep what
    combine needs."""
    rows_per_expert = world * max_tokens
    kk = tl.arange(0, K_PAD)
    chunks = tl.cdiv(hidden, BLOCK_GROUPS * GROUP)
    width = hidden // ELEMENT_PACK                       # payload items a row
    longest = _longest(tokens_ptr + stage, reached, world, WORLD_PAD)
    end = world * longest * chunks
    following = _staged_ids(ids_ptr, item0, end, stage, chunks, longest, max_tokens, topk, K_PAD)
    for item in range(item0, end, items_step):
        src, t, src_row = _source_row(item, chunks, longest, max_tokens)
        chunk = item % chunks
        ids = following                                   # loaded during the item before (ids one ahead)
        following = _staged_ids(ids_ptr, item + items_step, end, stage, chunks, longest, max_tokens, topk, K_PAD)
        if (t < tl.load(tokens_ptr + stage + src)) & _bit(reached, src):
            meta = (stage * max_tokens + src_row) * topk + kk
            local = (kk < topk) & (ids >= 0) & (ids // experts_per_rank == rank)
            expert = tl.where(local, ids - rank * experts_per_rank, 0)
            any_local = tl.max(local.to(tl.int32), 0) > 0
            cols, mask = _chunk(chunk, width, GROUP // ELEMENT_PACK, BLOCK_GROUPS)
            staged = stage.to(tl.int64) * max_tokens + src_row
            # the chunk's loads go out before the rows are worked out, and are in flight meanwhile
            payload = tl.load(data_ptr + staged * width + cols, mask=cols < tl.where(any_local, width, 0))
            if SCALE_KIND != SCALE_NONE:
                items, num_items = _scale_items(chunk, hidden, GROUP, BLOCK_GROUPS, SCALE_PACK)
                scales = tl.load(scale_ptr + staged * num_items + items, mask=items < tl.where(any_local, num_items, 0))
            row = tl.load(pos_ptr + meta, mask=local, other=0)
            id_chunk = (t * topk + kk) // CHUNK_IDS            # the layout chunk of each hit
            row += tl.load(offset_ptr + ((stage + src) * layout_chunks + id_chunk) * experts_per_rank + expert,
                           mask=local, other=0)
            for s in range(src):
                counts = tl.load(count_ptr + (stage + s) * experts_per_rank + expert, mask=local, other=0)
                row += tl.where(_bit(reached, s), counts, 0)
            row = tl.where(local, row, -1)
            if chunk == 0:
                # for combine's send: the token's local hits first, in k order (their place among them), each
                # as its row of recv_x's [E_loc * R] and its weight; -1 in the places after them
                kept = src_row * topk
                place = tl.cumsum(local.to(tl.int32), 0) - 1
                hits = tl.sum(local.to(tl.int32), 0)
                tl.store(kept_row_ptr + kept + place, expert * rows_per_expert + row, mask=local)
                tl.store(kept_w_ptr + kept + place, tl.load(w_ptr + meta, mask=local), mask=local)
                tl.store(kept_row_ptr + kept + kk, -1, mask=(kk >= hits) & (kk < topk))
                tl.store(recv_src_ptr + expert * rows_per_expert + row, kept + kk, mask=local)
            if any_local:
                for k in tl.static_range(K_PAD):
                    row_k = _pick(row, kk, k)
                    if row_k >= 0:
                        dst = _pick(expert, kk, k).to(tl.int64) * rows_per_expert + row_k
                        tl.store(recv_x_ptr + dst * width + cols, payload, mask=mask)
                        if SCALE_KIND != SCALE_NONE:
                            tl.store(recv_scale_ptr + dst * num_items + items, scales, mask=items < num_items)


@triton.jit
def _add_rows(acc, y_ptr, rows, w_ptr, cols, mask, hidden):
    """acc [BLOCK_H] (fp32) + w[j] * y[rows[j], cols] for j in order over the rows >= 0 (rows [N] of y [*, hidden],
    their weights at w_ptr[0:N]), all N rows in one [N, BLOCK_H] load; the rows < 0 add +0."""
    jj = tl.arange(0, rows.shape[0])
    local = rows >= 0
    weights = tl.load(w_ptr + jj, mask=local, other=0.0)
    y = tl.load(y_ptr + tl.where(local, rows, 0).to(tl.int64)[:, None] * hidden + cols[None, :],
                mask=local[:, None] & mask[None, :], other=0.0)
    terms = weights[:, None] * y.to(tl.float32)
    # The sum in order, row by row: the sum of a column of `terms` with -0 in every row but j is its row j
    # exactly (x + -0 = x), whatever order tl.sum adds in; adding a +0 term leaves the running sum as it was
    # (it starts at +0, so it is never -0).
    for j in tl.static_range(rows.shape[0]):
        acc += tl.sum(tl.where(jj[:, None] == j, terms, -0.0), 0)
    return acc


@triton.jit
def _combine_chunk(y_ptr, kept_w_ptr, kept_row_ptr, kept_tokens_ptr, peers, src, t, src_row, chunk, slot, rank,
                   world, max_tokens, hidden, topk, live, remote, BLOCK_H: tl.constexpr, K_PAD: tl.constexpr,
                   HITS: tl.constexpr, PUTS: tl.constexpr):
    """Column chunk `chunk` of row t of source `src` (where the source is in `live`, bits, and sent a row t): its
    token's weighted sum over this rank's experts, in fp32, k order, stored into the source rank's combine
    buffer (and, with PUTS, put to a source of `remote`, bits).

    Dispatch's receive kept each token's local hits first, in k order: a load of HITS expert rows
    ([HITS, BLOCK_H], all in flight at once) holds them all but where a token has more, which take another
    load each HITS. A load per row (masked, into a running sum) compiled to loads issued one after another,
    each waiting for the one before; a load of all K_PAD rows, masked where k's expert is on another rank,
    held (world - 1) / world of its registers at zeros (benchmarks/NOTES.md)."""
    hh = tl.arange(0, HITS)
    kept = src_row * topk
    sent = (t < tl.load(kept_tokens_ptr + src)) & _bit(live, src)
    rows = tl.load(kept_row_ptr + kept + hh, mask=hh < tl.where(sent, topk, 0), other=-1)
    if tl.max(rows, 0) >= 0:
        cols = chunk * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = cols < hidden
        acc = _add_rows(tl.zeros((BLOCK_H,), tl.float32), y_ptr, rows, kept_w_ptr + kept, cols, mask, hidden)
        for more in tl.static_range(HITS, K_PAD, HITS):
            if tl.min(rows, 0) >= 0:                     # every row of the last load was a hit
                rows = tl.load(kept_row_ptr + kept + more + hh, mask=more + hh < topk, other=-1)
                acc = _add_rows(acc, y_ptr, rows, kept_w_ptr + kept + more, cols, mask, hidden)
        out = _peer(peers, C_DATA, src, world, y_ptr.dtype.element_ty)
        row = (slot * world + rank).to(tl.int64) * max_tokens + t
        tl.store(out + row * hidden + cols, cast_rn(acc, y_ptr.dtype.element_ty), mask=mask)
        if PUTS:
            if _bit(remote, src):
                first = chunk * BLOCK_H
                _put_span(peers, C_DATA, rank, src, world, row * hidden + first, tl.minimum(hidden - first, BLOCK_H),
                          y_ptr.dtype.element_ty)


@triton.jit
def _combine_send_items(y_ptr, kept_w_ptr, kept_row_ptr, kept_tokens_ptr, peers, item0, items_step, slot, rank,
                        world, max_tokens, hidden, topk, live, remote, BLOCK_H: tl.constexpr, K_PAD: tl.constexpr,
                        HITS: tl.constexpr, WHOLE_ROWS: tl.constexpr, WORLD_PAD: tl.constexpr, PUTS: tl.constexpr):
    """Combine's send over work items item0, item0 + items_step, ... of the rows the sources in `live` (bits)
    sent, the source fastest (``_combine_item``): per row, its token's weighted sum over this rank's experts
    (``_combine_chunk``), stored once into the source rank's combine buffer.

    A work item is a (row, column chunk), or where there are WHOLE_ROWS rows a program or more, a whole row, its
    chunks one after another. A program works a chunk at a time (the load of the token's hits, then of their
    expert rows, then the sum), so where it has many, its chunks of one row find the hits in its L1 cache after
    the first; below, rows cut in chunks keep more programs busy."""
    chunks = tl.cdiv(hidden, BLOCK_H)
    rows_sent = world * _longest(kept_tokens_ptr, live, world, WORLD_PAD)
    if rows_sent >= WHOLE_ROWS * items_step:
        for item in range(item0, rows_sent, items_step):
            src, t, src_row, _ = _combine_item(item, 1, max_tokens, rank, world)
            for chunk in range(chunks):
                _combine_chunk(y_ptr, kept_w_ptr, kept_row_ptr, kept_tokens_ptr, peers, src, t, src_row, chunk, slot,
                               rank, world, max_tokens, hidden, topk, live, remote, BLOCK_H, K_PAD, HITS, PUTS)
    else:
        for item in range(item0, rows_sent * chunks, items_step):
            src, t, src_row, chunk = _combine_item(item, chunks, max_tokens, rank, world)
            _combine_chunk(y_ptr, kept_w_ptr, kept_row_ptr, kept_tokens_ptr, peers, src, t, src_row, chunk, slot,
                           rank, world, max_tokens, hidden, topk, live, remote, BLOCK_H, K_PAD, HITS, PUTS)


@triton.jit
def _token_ids(ids_ptr, item, end, chunks, topk, K_PAD: tl.constexpr):
    """The expert ids [K_PAD] of combine work item `item`'s token (topk_ids [T, K]) where item < end; else -1s."""
    kk = tl.arange(0, K_PAD)
    return tl.load(ids_ptr + item // chunks * topk + kk, mask=kk < tl.where(item < end, topk, 0), other=-1)


@triton.jit
def _combine_recv_items(out_ptr, ids_ptr, data_ptr, lost_ptr, item0, items_step, num_tokens, slot, world, max_tokens,
                        hidden, topk, experts_per_rank, reached, BLOCK_H: tl.constexpr, K_PAD: tl.constexpr,
                        WORLD_PAD: tl.constexpr, ELASTIC: tl.constexpr):
    """Work items item0, item0 + items_step, ... of (token, column chunk): the ranks' rows added in rank
    order, in fp32, for the ranks the token was routed to that are in `reached` (bits). With ELASTIC the
    first chunk also writes lost [T, K] (int8): 1 where the token's expert k is on a rank not reached.

    Each item's ids are loaded during the item before (the module's docstring: ids one item ahead)."""
    chunks = tl.cdiv(hidden, BLOCK_H)
    kk = tl.arange(0, K_PAD)
    items = num_tokens * chunks
    following = _token_ids(ids_ptr, item0, items, chunks, topk, K_PAD)
    for item in range(item0, items, items_step):
        t = item // chunks
        cols = (item % chunks) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = cols < hidden
        ids = following.to(tl.int32)
        following = _token_ids(ids_ptr, item + items_step, items, chunks, topk, K_PAD)
        dest = tl.where(ids >= 0, ids // experts_per_rank, -1)
        if ELASTIC:                                     # experts on ranks not reached count as dropped
            lost = (dest >= 0) & ~_bit(reached, tl.maximum(dest, 0))
            if item % chunks == 0:
                tl.store(lost_ptr + t * topk + kk, lost.to(tl.int8), mask=kk < topk)
            dest = tl.where(lost, -1, dest)
        acc = tl.zeros((BLOCK_H,), tl.float32)
        for r in tl.static_range(WORLD_PAD):            # rank order
            routed = tl.max((dest == r).to(tl.int32), 0) > 0
            row = (slot * world + r).to(tl.int64) * max_tokens + t
            part = tl.load(data_ptr + row * hidden + cols, mask=cols < tl.where(routed, hidden, 0), other=0.0)
            acc = tl.where(routed, acc + part.to(tl.float32), acc)
        tl.store(out_ptr + t.to(tl.int64) * hidden + cols, cast_rn(acc, out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=_INTS + ["num_tokens", "num_experts", "layout_blocks", "layout_chunks"])
def dispatch_send_kernel(
    x_ptr, ids_ptr, w_ptr,                                   # [T, H], [T, K], [T, K]
    tensor_scale_ptr,                                        # float32 [1]: the per-tensor scale of SCALE_E4M3
    peers,                                                   # int64 [DISPATCH_PEERS, world]
    freed_ptr,                                               # my credit counters [SLOTS, world]
    finished_ptr, uses_ptr, clock_ptr, status_addr, stamps_ptr,
    live_peers, agreed_ptr,                                  # int64 [world]: every rank's live mask; [SLOTS]
    layout_ptr,                                              # int32 layout scratch of this slot (LAYOUT_*)
    num_tokens, call, slot, rank, world, max_tokens, hidden, topk, experts_per_rank, num_experts, timeout_ns,
    layout_blocks, layout_chunks,                            # layout programs; chunks of T_max * K ids
    remote, echo_addr,                                       # ranks reached by puts (bits); echo int64 [world]
    SCALE_KIND: tl.constexpr, SCALE_PACK: tl.constexpr, GROUP: tl.constexpr, ELEMENT_PACK: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr, K_PAD: tl.constexpr,
    COMPARE: tl.constexpr, CHUNK_IDS: tl.constexpr, EXPERTS_BLOCK: tl.constexpr, NUM_BINS: tl.constexpr,
    SCAN_CHUNKS: tl.constexpr, SCAN_EXPERTS: tl.constexpr,
    WORLD_PAD: tl.constexpr, VALIDATE: tl.constexpr, ELASTIC: tl.constexpr, TIMING: tl.constexpr,
    PUTS: tl.constexpr,
):
    """Staging on rank r, per slot and source rank s: data [T_max, H / ELEMENT_PACK] (e4m3; x's dtype with
    SCALE_NONE; e2m1 pairs, uint8, with SCALE_E4M3), scales [T_max, H / GROUP / SCALE_PACK] (f32 with
    SCALE_FP32; with SCALE_UE8M0 int32, four exponent bytes each, for SCALE_PACK 4, one byte for 1; e4m3 with
    SCALE_E4M3), ids/weights/positions [T_max, K] i32/f32/i32, offsets [layout_chunks, E/world] i32, counts
    [E/world] i32, tokens [] i32; arrived and freed counters [SLOTS, world] i64."""
    status_ptr, use, ok, _ = _begin(stamps_ptr, uses_ptr, slot, clock_ptr, status_addr, freed_ptr, live_peers, rank,
                                    world, 1, timeout_ns, TAG_DISPATCH_CREDIT, True, WORLD_PAD, ELASTIC, TIMING)
    pid = tl.program_id(0)
    stage = slot * world + rank                              # my row block on every receiver
    live = _live(live_peers, rank, world, WORLD_PAD, ELASTIC)
    if pid < layout_blocks:
        _dispatch_layout(ok, ids_ptr, peers, layout_ptr, status_ptr, pid, stage, num_tokens, call, world, max_tokens,
                         topk, experts_per_rank, num_experts, layout_blocks, layout_chunks, live, COMPARE, CHUNK_IDS,
                         EXPERTS_BLOCK, NUM_BINS, SCAN_CHUNKS, SCAN_EXPERTS, VALIDATE)
    elif ok:
        _dispatch_tokens(x_ptr, ids_ptr, w_ptr, tensor_scale_ptr, peers, pid - layout_blocks,
                         tl.num_programs(0) - layout_blocks, stage, num_tokens, rank, world, max_tokens, hidden, topk,
                         experts_per_rank, live, remote, SCALE_KIND, SCALE_PACK, GROUP, ELEMENT_PACK, BLOCK_GROUPS,
                         K_PAD, PUTS)
    _dispatch_sent(finished_ptr + slot, uses_ptr + slot, use, ok, peers, stage, live_peers, rank, world, remote,
                   echo_addr, stamps_ptr, num_tokens, max_tokens, hidden, topk, experts_per_rank, layout_chunks,
                   SCALE_KIND, SCALE_PACK, GROUP, CHUNK_IDS, WORLD_PAD, ELASTIC, TIMING, PUTS)


@triton.jit(do_not_specialize=_INTS + ["layout_chunks"])
def dispatch_recv_kernel(
    data_ptr, scale_ptr, ids_ptr, w_ptr, pos_ptr, offset_ptr, count_ptr, tokens_ptr, arrived_ptr,   # my staging
    peers,                                                   # int64 [DISPATCH_PEERS, world]: the senders' credits
    recv_x_ptr, recv_scale_ptr, recv_count_ptr, recv_src_ptr,   # [E_loc, R, H / ELEMENT_PACK], [E_loc, R, H/G],
                                                                #   [E_loc], [E_loc, R]
    kept_w_ptr, kept_row_ptr, kept_tokens_ptr,               # [world, T_max, K] x2, [world]
    finished_ptr, uses_ptr, clock_ptr, status_addr, stamps_ptr, live_peers, agreed_ptr,
    slot, rank, world, max_tokens, hidden, topk, experts_per_rank, timeout_ns, layout_chunks, remote, echo_addr,
    SCALE_KIND: tl.constexpr, SCALE_PACK: tl.constexpr, GROUP: tl.constexpr, ELEMENT_PACK: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr, K_PAD: tl.constexpr,
    CHUNK_IDS: tl.constexpr, WORLD_PAD: tl.constexpr, ELASTIC: tl.constexpr, TIMING: tl.constexpr,
    PUTS: tl.constexpr,
):
    """R = world * max_tokens rows per local expert."""
    status_ptr, use, ok, reached = _begin(stamps_ptr, uses_ptr, slot, clock_ptr, status_addr, arrived_ptr, live_peers,
                                          rank, world, 0, timeout_ns, TAG_DISPATCH_ARRIVAL, False, WORLD_PAD, ELASTIC,
                                          TIMING)
    stage = slot * world                                   # first source row block of this slot
    if ok:
        reached = _agree(agreed_ptr + slot, use, reached, ELASTIC)
        if tl.program_id(0) == 0:
            _dispatch_recv_counts(tokens_ptr, count_ptr, recv_count_ptr, kept_tokens_ptr, stage, world,
                                  experts_per_rank, reached)
        _dispatch_recv_items(data_ptr, scale_ptr, ids_ptr, w_ptr, pos_ptr, offset_ptr, count_ptr, tokens_ptr,
                             recv_x_ptr, recv_scale_ptr, recv_src_ptr, kept_w_ptr, kept_row_ptr,
                             tl.program_id(0), tl.num_programs(0), stage, rank, world, max_tokens, hidden, topk,
                             experts_per_rank, layout_chunks, reached, SCALE_KIND, SCALE_PACK, GROUP, ELEMENT_PACK,
                             BLOCK_GROUPS, K_PAD, CHUNK_IDS, WORLD_PAD)
    _finish(finished_ptr + slot, uses_ptr + slot, use, ok, peers, D_FREED, slot * world + rank, live_peers, rank,
            world, remote, echo_addr, stamps_ptr, WORLD_PAD, ELASTIC, TIMING, PUTS)


@triton.jit(do_not_specialize=_INTS)
def combine_send_kernel(
    y_ptr,                                                   # expert_out [E_loc, R, H]
    kept_w_ptr, kept_row_ptr, kept_tokens_ptr,               # from the dispatch slot of the handle
    peers,                                                   # int64 [COMBINE_PEERS, world]
    freed_ptr, finished_ptr, uses_ptr, clock_ptr, status_addr, stamps_ptr, live_peers, agreed_ptr,
    slot, rank, world, max_tokens, hidden, topk, experts_per_rank, timeout_ns, remote, echo_addr,
    BLOCK_H: tl.constexpr, K_PAD: tl.constexpr, HITS: tl.constexpr, WHOLE_ROWS: tl.constexpr, WORLD_PAD: tl.constexpr,
    ELASTIC: tl.constexpr, TIMING: tl.constexpr, PUTS: tl.constexpr,
):
    """Combine staging on each source rank: data [SLOTS, world, T_max, H] (output dtype);
    arrived and freed counters [SLOTS, world] i64."""
    status_ptr, use, ok, _ = _begin(stamps_ptr, uses_ptr, slot, clock_ptr, status_addr, freed_ptr, live_peers, rank,
                                    world, 1, timeout_ns, TAG_COMBINE_CREDIT, True, WORLD_PAD, ELASTIC, TIMING)
    if ok:
        _combine_send_items(y_ptr, kept_w_ptr, kept_row_ptr, kept_tokens_ptr, peers, tl.program_id(0),
                            tl.num_programs(0), slot, rank, world, max_tokens, hidden, topk,
                            _live(live_peers, rank, world, WORLD_PAD, ELASTIC), remote, BLOCK_H, K_PAD, HITS,
                            WHOLE_ROWS, WORLD_PAD, PUTS)
    _finish(finished_ptr + slot, uses_ptr + slot, use, ok, peers, C_ARRIVED, slot * world + rank, live_peers, rank,
            world, remote, echo_addr, stamps_ptr, WORLD_PAD, ELASTIC, TIMING, PUTS)


@triton.jit(do_not_specialize=_INTS + ["num_tokens"])
def combine_recv_kernel(
    out_ptr, ids_ptr,                                        # y [T, H], this rank's topk ids [T, K]
    lost_ptr,                                                # int8 [T, K]: experts lost (ELASTIC)
    data_ptr, arrived_ptr,                                   # my combine staging, arrival counters
    peers,                                                   # int64 [COMBINE_PEERS, world]: the expert ranks' credits
    finished_ptr, uses_ptr, clock_ptr, status_addr, stamps_ptr, live_peers, agreed_ptr,
    num_tokens, slot, rank, world, max_tokens, hidden, topk, experts_per_rank, timeout_ns, remote, echo_addr,
    RECV_BLOCK_H: tl.constexpr, K_PAD: tl.constexpr, WORLD_PAD: tl.constexpr,
    ELASTIC: tl.constexpr, TIMING: tl.constexpr, PUTS: tl.constexpr,
):
    status_ptr, use, ok, reached = _begin(stamps_ptr, uses_ptr, slot, clock_ptr, status_addr, arrived_ptr, live_peers,
                                          rank, world, 0, timeout_ns, TAG_COMBINE_ARRIVAL, False, WORLD_PAD, ELASTIC,
                                          TIMING)
    if ok:
        _combine_recv_items(out_ptr, ids_ptr, data_ptr, lost_ptr, tl.program_id(0), tl.num_programs(0), num_tokens,
                            slot, world, max_tokens, hidden, topk, experts_per_rank,
                            _agree(agreed_ptr + slot, use, reached, ELASTIC), RECV_BLOCK_H, K_PAD, WORLD_PAD,
                            ELASTIC)
    _finish(finished_ptr + slot, uses_ptr + slot, use, ok, peers, C_FREED, slot * world + rank, live_peers, rank,
            world, remote, echo_addr, stamps_ptr, WORLD_PAD, ELASTIC, TIMING, PUTS)


@triton.jit(do_not_specialize=_INTS + ["num_tokens", "num_experts", "layout_blocks", "layout_chunks"])
def dispatch_kernel(
    x_ptr, ids_ptr, w_ptr, tensor_scale_ptr,                 # as in dispatch_send_kernel
    peers, freed_ptr,                                        # as in dispatch_send_kernel
    data_ptr, scale_ptr, staged_ids_ptr, staged_w_ptr, pos_ptr, offset_ptr, count_ptr, tokens_ptr,   # my staging
    arrived_ptr,
    recv_x_ptr, recv_scale_ptr, recv_count_ptr, recv_src_ptr,   # as in dispatch_recv_kernel
    kept_w_ptr, kept_row_ptr, kept_tokens_ptr,
    finished_ptr, uses_ptr,                                  # [2, SLOTS] each: the send row, then the receive row
    clock_ptr, status_addr, stamps_ptr,                      # stamps [2, 4]: send, receive
    live_peers, agreed_ptr,                                  # agreed [2, SLOTS] like finished
    layout_ptr,                                              # as in dispatch_send_kernel
    num_tokens, call, slot, rank, world, max_tokens, hidden, topk, experts_per_rank, num_experts, timeout_ns,
    layout_blocks, layout_chunks, remote, echo_addr,
    SCALE_KIND: tl.constexpr, SCALE_PACK: tl.constexpr, GROUP: tl.constexpr, ELEMENT_PACK: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr, K_PAD: tl.constexpr,
    COMPARE: tl.constexpr, CHUNK_IDS: tl.constexpr, EXPERTS_BLOCK: tl.constexpr, NUM_BINS: tl.constexpr,
    SCAN_CHUNKS: tl.constexpr, SCAN_EXPERTS: tl.constexpr,
    WORLD_PAD: tl.constexpr, VALIDATE: tl.constexpr, ELASTIC: tl.constexpr, TIMING: tl.constexpr,
    PUTS: tl.constexpr,
):
    """dispatch_send_kernel then dispatch_recv_kernel in one launch: every program takes layout blocks
    and token items by program id, then all wait for the peers' rows and fan them out."""
    status_ptr, use, ok, _ = _begin(stamps_ptr, uses_ptr, slot, clock_ptr, status_addr, freed_ptr, live_peers, rank,
                                    world, 1, timeout_ns, TAG_DISPATCH_CREDIT, False, WORLD_PAD, ELASTIC, TIMING)
    pid, programs = tl.program_id(0), tl.num_programs(0)
    stage = slot * world + rank                              # my row block on every receiver
    live = _live(live_peers, rank, world, WORLD_PAD, ELASTIC)
    for block in range(pid, layout_blocks, programs):
        _dispatch_layout(ok, ids_ptr, peers, layout_ptr, status_ptr, block, stage, num_tokens, call, world, max_tokens,
                         topk, experts_per_rank, num_experts, layout_blocks, layout_chunks, live, COMPARE, CHUNK_IDS,
                         EXPERTS_BLOCK, NUM_BINS, SCAN_CHUNKS, SCAN_EXPERTS, VALIDATE)
    if ok:
        _dispatch_tokens(x_ptr, ids_ptr, w_ptr, tensor_scale_ptr, peers, pid, programs, stage, num_tokens, rank,
                         world, max_tokens, hidden, topk, experts_per_rank, live, remote, SCALE_KIND, SCALE_PACK,
                         GROUP, ELEMENT_PACK, BLOCK_GROUPS, K_PAD, PUTS)
    _dispatch_sent(finished_ptr + slot, uses_ptr + slot, use, ok, peers, stage, live_peers, rank, world, remote,
                   echo_addr, stamps_ptr, num_tokens, max_tokens, hidden, topk, experts_per_rank, layout_chunks,
                   SCALE_KIND, SCALE_PACK, GROUP, CHUNK_IDS, WORLD_PAD, ELASTIC, TIMING, PUTS)

    recv_stamps = stamps_ptr + RECV_STAMPS
    ok, reached = _await_peers(ok, recv_stamps, arrived_ptr, slot, live_peers, rank, world, use, timeout_ns,
                               status_ptr, TAG_DISPATCH_ARRIVAL, clock_ptr, WORLD_PAD, ELASTIC, TIMING)
    if ok:
        reached = _agree(agreed_ptr + RECV_COUNTERS + slot, use, reached, ELASTIC)
        if pid == 0:
            _dispatch_recv_counts(tokens_ptr, count_ptr, recv_count_ptr, kept_tokens_ptr, slot * world, world,
                                  experts_per_rank, reached)
        _dispatch_recv_items(data_ptr, scale_ptr, staged_ids_ptr, staged_w_ptr, pos_ptr, offset_ptr, count_ptr,
                             tokens_ptr, recv_x_ptr, recv_scale_ptr, recv_src_ptr, kept_w_ptr, kept_row_ptr,
                             pid, programs, slot * world, rank, world, max_tokens, hidden, topk,
                             experts_per_rank, layout_chunks, reached, SCALE_KIND, SCALE_PACK, GROUP, ELEMENT_PACK,
                             BLOCK_GROUPS, K_PAD, CHUNK_IDS, WORLD_PAD)
    _finish(finished_ptr + RECV_COUNTERS + slot, uses_ptr + RECV_COUNTERS + slot, use, ok, peers, D_FREED, stage,
            live_peers, rank, world, remote, echo_addr, recv_stamps, WORLD_PAD, ELASTIC, TIMING, PUTS)


@triton.jit(do_not_specialize=_INTS + ["num_tokens"])
def combine_kernel(
    y_ptr,                                                   # expert_out [E_loc, R, H]
    kept_w_ptr, kept_row_ptr, kept_tokens_ptr,               # from the dispatch slot of the handle
    out_ptr, ids_ptr, lost_ptr,                              # y [T, H], this rank's topk ids [T, K], lost [T, K]
    data_ptr, arrived_ptr, freed_ptr,                        # my combine staging, arrival and credit counters
    peers,                                                   # int64 [COMBINE_PEERS, world]
    finished_ptr, uses_ptr,                                  # [2, SLOTS] each: the send row, then the receive row
    clock_ptr, status_addr, stamps_ptr,                      # stamps [2, 4]: send, receive
    live_peers, agreed_ptr,                                  # agreed [2, SLOTS] like finished
    num_tokens, slot, rank, world, max_tokens, hidden, topk, experts_per_rank, timeout_ns, remote, echo_addr,
    BLOCK_H: tl.constexpr, RECV_BLOCK_H: tl.constexpr, K_PAD: tl.constexpr, HITS: tl.constexpr,
    WHOLE_ROWS: tl.constexpr, WORLD_PAD: tl.constexpr,
    ELASTIC: tl.constexpr, TIMING: tl.constexpr, PUTS: tl.constexpr,
):
    """combine_send_kernel then combine_recv_kernel in one launch, work by program id."""
    status_ptr, use, ok, _ = _begin(stamps_ptr, uses_ptr, slot, clock_ptr, status_addr, freed_ptr, live_peers, rank,
                                    world, 1, timeout_ns, TAG_COMBINE_CREDIT, False, WORLD_PAD, ELASTIC, TIMING)
    pid, programs = tl.program_id(0), tl.num_programs(0)
    stage = slot * world + rank
    if ok:
        _combine_send_items(y_ptr, kept_w_ptr, kept_row_ptr, kept_tokens_ptr, peers, pid, programs, slot, rank,
                            world, max_tokens, hidden, topk, _live(live_peers, rank, world, WORLD_PAD, ELASTIC),
                            remote, BLOCK_H, K_PAD, HITS, WHOLE_ROWS, WORLD_PAD, PUTS)
    _finish(finished_ptr + slot, uses_ptr + slot, use, ok, peers, C_ARRIVED, stage, live_peers, rank, world,
            remote, echo_addr, stamps_ptr, WORLD_PAD, ELASTIC, TIMING, PUTS)

    recv_stamps = stamps_ptr + RECV_STAMPS
    ok, reached = _await_peers(ok, recv_stamps, arrived_ptr, slot, live_peers, rank, world, use, timeout_ns,
                               status_ptr, TAG_COMBINE_ARRIVAL, clock_ptr, WORLD_PAD, ELASTIC, TIMING)
    if ok:
        _combine_recv_items(out_ptr, ids_ptr, data_ptr, lost_ptr, pid, programs, num_tokens, slot, world, max_tokens,
                            hidden, topk, experts_per_rank, _agree(agreed_ptr + RECV_COUNTERS + slot, use, reached,
                                                                   ELASTIC),
                            RECV_BLOCK_H, K_PAD, WORLD_PAD, ELASTIC)
    _finish(finished_ptr + RECV_COUNTERS + slot, uses_ptr + RECV_COUNTERS + slot, use, ok, peers, C_FREED, stage,
            live_peers, rank, world, remote, echo_addr, recv_stamps, WORLD_PAD, ELASTIC, TIMING, PUTS)
