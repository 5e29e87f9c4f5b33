"""The status words of every op's kernels and the tags of their bounded waits, handed out in one place.

A bounded wait (``shmem.wait_until_ge`` / ``wait_all_ge``) that runs past its deadline writes the timeout
report into the first ``shmem.STATUS_WORDS`` words of its op's int32 status tensor: [code, peer, tag,
value seen, target]. The tag names the wait: every wait of every op has its own, numbered here in one
sequence, so that the host (``runtime.CommObject``) names any of them from one table, ``TAGS``. Words
past the report are an op's own: an EP dispatch's report of an out-of-range expert id.
"""
import triton.language as tl

from ..shmem import STATUS_WORDS

TAGS: dict[int, str] = {}        # tag -> what the wait was for (0: no wait)


def _wait(what: str) -> tl.constexpr:
    """The next tag, for a wait described by `what`."""
    TAGS[len(TAGS) + 1] = what
    return tl.constexpr(len(TAGS))


# expert-parallel dispatch and combine (kernels/all_to_all.py)
TAG_DISPATCH_CREDIT = _wait("dispatch (waiting for the receiver to free its buffer)")
TAG_DISPATCH_ARRIVAL = _wait("dispatch (waiting for the sender's tokens)")
TAG_COMBINE_CREDIT = _wait("combine (waiting for the receiver to free its buffer)")
TAG_COMBINE_ARRIVAL = _wait("combine (waiting for the expert rank's rows)")
# async tensor parallelism (kernels/ag_gemm.py, gemm_rs.py, gemm_ar.py; the barrier of matmul.py)
TAG_AG_SHARD = _wait("all-gather GEMM (waiting for a peer's shard)")
TAG_RS_TILE = _wait("GEMM reduce-scatter (waiting for a peer's partials)")
TAG_AR_TILE = _wait("GEMM all-reduce (waiting for a peer's partials)")
TAG_AR_SUM = _wait("GEMM all-reduce (waiting for a tile's sum from the rank that owns it)")
TAG_TP_BARRIER = _wait("async-TP call's barrier (waiting for a peer to begin the call)")

# EP: after the timeout report, the first out-of-range expert id a dispatch saw (its call number, 0 = none;
# the id; its flat index into topk_ids), then 1 once an elastic rank found itself marked dead by its peers.
STATUS_BAD_CALL = tl.constexpr(STATUS_WORDS)
STATUS_BAD_ID = tl.constexpr(STATUS_WORDS + 1)
STATUS_BAD_INDEX = tl.constexpr(STATUS_WORDS + 2)
STATUS_EVICTED = tl.constexpr(STATUS_WORDS + 3)
EP_STATUS_WORDS = STATUS_WORDS + 4
TP_STATUS_WORDS = STATUS_WORDS   # the timeout report alone
