"""A call that one rank refuses on AsyncTP's nvshmem backend fails on every rank that made it.

In the Triton interpreter (CPU) every rank lives in one process (AsyncTP.simulated). Rank 0 refuses a
call through the public method (a row too many, rows that cannot be scattered, an operand on another
device); rank 1 makes it on an overlapped path, and its call's barrier waits for rank 0 until timeout_s,
then its first wait for rank 0's shard or partials does too: check() then raises CallRefusedError naming
rank 0 and its reason (from the CommTimeoutError) instead of the bare timeout, and the object stays
broken, as after any timeout, with the refusal in its message. (A call through the public methods cannot
complete here: the ranks run one after another, and a rank's barrier waits for the others to begin.)
"""
import os
import time

import pytest
import torch

from distributed import assert_broken_by
from moe_ep import AsyncTP, CallRefusedError, CommTimeoutError

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="runs the kernels in the Triton interpreter, on CPU-only machines")
ROWS, K, N, TIMEOUT_S = 4, 16, 8, 1.0      # rows per rank; max_rows = 2 * ROWS, max_features = K
SLACK_S = 30         # the interpreter's own work, beyond the call's two timeouts (its barrier, its first wait)


def world(path):
    return AsyncTP.simulated(2, 2 * ROWS, K, torch.float32, overlap=path, timeout_s=TIMEOUT_S, tile_loop="pointer")


def operands(op):
    """A good call of `op` (a, w), and rank 0's refused one with the reason it raises."""
    w = torch.randn(K, N)
    if op == "ag_gemm":
        return (torch.randn(ROWS, K), w), (torch.randn(ROWS + 1, K), w), \
            rf"ag_gemm: M={2 * ROWS + 2} exceeds this AsyncTP's max_rows={2 * ROWS}; construct it with max_rows >= " \
            rf"{2 * ROWS + 2}"
    if op == "gemm_rs":
        return (torch.randn(2 * ROWS, K), w), (torch.randn(2 * ROWS - 1, K), w), \
            rf"gemm_rs: M={2 * ROWS - 1} rows cannot be scattered evenly over 2 ranks"
    return (torch.randn(ROWS, K), w), (torch.randn(ROWS, K), w.to("meta")), "gemm_ar: w is on meta, expected cpu"


@pytest.mark.parametrize("op,path", [("ag_gemm", "fused"), ("ag_gemm", "chunked"), ("gemm_rs", "fused"),
                                     ("gemm_rs", "chunked"), ("gemm_ar", "fused")])
def test_a_refused_call_fails_on_the_rank_that_made_it(op, path):
    """Rank 0 refuses a call of `op`; rank 1's call on `path` times out and check() names rank 0 and why,
    once; from then on its object says what broke it."""
    ranks = world(path)
    good, bad, reason = operands(op)
    with pytest.raises(ValueError, match=f"^{reason}$") as own:
        getattr(ranks[0], op)(*bad)
    assert type(own.value) is ValueError                    # the refusing rank's own error, as ever
    started = time.monotonic()
    getattr(ranks[1], op)(*good)
    with pytest.raises(CallRefusedError, match=f"^{op} call 1 refused by rank 0: {reason}$") as refused:
        ranks[1].check()
    assert TIMEOUT_S <= time.monotonic() - started < 2 * TIMEOUT_S + SLACK_S
    assert list(refused.value.refusals) == [0]
    assert isinstance(refused.value.__cause__, CommTimeoutError)
    assert [tp._calls()[op] for tp in ranks] == [0, 1]
    assert not ranks[1]._symmetric[ranks[1].REFUSALS].any()          # the note is consumed
    assert_broken_by(ranks[1], f"{op} call 1", lambda: ranks[1].gemm_ar(*operands("gemm_ar")[0]))


def test_a_note_names_its_call():
    """Rank 0 refuses a gemm_rs while rank 1 makes an ag_gemm (calls out of order): rank 1's timeout is the
    bare CommTimeoutError, and the note, of a call rank 1 has not made, stays on its board."""
    ranks = world("fused")
    with pytest.raises(ValueError, match="evenly"):
        ranks[0].gemm_rs(*operands("gemm_rs")[1])
    ranks[1].ag_gemm(*operands("ag_gemm")[0])
    with pytest.raises(CommTimeoutError, match="rank 1: .* waiting for rank 0") as timeout:
        ranks[1].check()
    assert type(timeout.value) is CommTimeoutError
    assert ranks[1]._symmetric[ranks[1].REFUSALS][0].any()


def test_a_timeout_without_a_refusal_still_breaks_the_object():
    """Rank 0 makes no call and refused none: rank 1's gemm_rs ends in CommTimeoutError, now and later."""
    ranks = world("fused")
    good = operands("gemm_rs")[0]
    ranks[1].gemm_rs(*good)
    with pytest.raises(CommTimeoutError, match="rank 1: .* waiting for rank 0"):
        ranks[1].check()
    with pytest.raises(CommTimeoutError):
        ranks[1].gemm_rs(*good)
