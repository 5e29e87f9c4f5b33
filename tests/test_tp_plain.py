"""moe_ep.tp.plain, the production plain path (AsyncTP's "never", its reference backend, the TP layers
without a communicator), against moe_ep.reference, the oracle, on gloo at 1 to 4 ranks.

Both compute the same partials a @ w (one GEMM of the same operands), so what can differ is the sum:

    ag_gemm                  sums nothing across ranks: bit for bit
    sum_dtype=torch.float32  the oracle's contract, the same collectives on the same fp32 partials: bit for bit
    sum_dtype=None           in the dtype, as NCCL reduces: bit for bit in fp32, and for any dtype with at
                             most two ranks (two partials added in fp32 and rounded once, either way); with
                             W >= 3 ranks gloo rounds after each addition: W - 1 roundings in the plain sum
                             and one in the oracle's, each at most u T (u: 2**-8 bf16, 2**-11 fp16;
                             T = the sum over ranks of |a @ w|), and the oracle's fp32 sum (W - 1) 2**-24 T:
                             |out - ref| <= (W + 1) u T
"""
import ast
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from distributed import run
from moe_ep import AsyncTP, CallRefusedError, ColumnParallelLinear, CommTimeoutError, RowParallelLinear, reference
from moe_ep.collectives import all_reduce, reduce_scatter_tensor
from moe_ep.tp import plain

UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# rows per rank, K, N: one row, a few rows, K and N not multiples of anything
SHAPES = [(1, 8, 5), (3, 16, 12), (5, 33, 7)]
PRODUCTION = ["moe_ep/tp", "moe_ep/layers/tp_linear.py"]     # what must not import the oracle


def operands(rank, rows, k, n, dtype, transposed, seed):
    """This rank's a [rows, K] and w [K, N] (contiguous, or an nn.Linear weight seen through .t())."""
    g = torch.Generator().manual_seed(seed * 100 + rank)
    a = torch.randn(rows, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    return a, (w.t() if transposed else w.t().contiguous())


def summed_magnitudes(a, w, op):
    """T: the sum over ranks of |a @ w| (this rank's rows of it for gemm_rs), in fp32."""
    t = (a @ w).float().abs()
    if op == "gemm_ar":
        all_reduce(t)
        return t
    rows = t.new_empty(t.shape[0] // dist.get_world_size(), t.shape[1])
    reduce_scatter_tensor(rows, t)
    return rows


def expect_sum(op, out, ref, a, w, exact, what):
    """out of plain.<op> (sums in the dtype) against the oracle's: bit for bit where `exact`, else within
    (W + 1) u T (the module docstring)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape, what
    if exact:
        assert torch.equal(out, ref), f"{what}: differs from the oracle"
        return
    bound = (dist.get_world_size() + 1) * UNIT_ROUNDOFF[a.dtype] * summed_magnitudes(a, w, op)
    error = (out.float() - ref.float()).abs()
    assert (error <= bound).all(), f"{what}: {int((error > bound).sum())} elements over (W + 1) u T, " \
                                   f"worst {(error - bound).max().item():.3g} over"


def _plain_matches_the_oracle(rank, world):
    for dtype in DTYPES:
        exact = dtype == torch.float32 or world <= 2
        for i, (rows, k, n) in enumerate(SHAPES):
            for transposed in (False, True):
                what = f"W={world} {dtype} rows={rows} K={k} N={n} w{'.t()' if transposed else ''}"
                a, w = operands(rank, rows, k, n, dtype, transposed, seed=2 * i + transposed)
                out, gathered = plain.ag_gemm(a, w, return_gathered=True)
                ref, ref_gathered = reference.ag_gemm(a, w, return_gathered=True)
                assert torch.equal(gathered, ref_gathered) and torch.equal(out, ref), f"ag_gemm {what}"
                assert torch.equal(plain.ag_gemm(a, w), ref), f"ag_gemm {what}"

                a_full, _ = operands(rank, world * rows, k, n, dtype, transposed, seed=50 + i)
                ref = reference.gemm_rs(a_full, w)
                assert torch.equal(plain.gemm_rs(a_full, w, sum_dtype=torch.float32), ref), f"gemm_rs fp32 {what}"
                expect_sum("gemm_rs", plain.gemm_rs(a_full, w), ref, a_full, w, exact, f"gemm_rs {what}")

                ref = reference.gemm_ar(a, w)                  # M = rows: any M, here not a multiple of W
                assert torch.equal(plain.gemm_ar(a, w, sum_dtype=torch.float32), ref), f"gemm_ar fp32 {what}"
                expect_sum("gemm_ar", plain.gemm_ar(a, w), ref, a, w, exact, f"gemm_ar {what}")

    a, w = operands(rank, 4, 16, 8, torch.bfloat16, True, seed=99)
    columns = torch.randn(16, 4).bfloat16().t()                  # a non-contiguous shard is copied first
    assert torch.equal(plain.ag_gemm(columns, w), reference.ag_gemm(columns, w))
    if world > 1:                                                # every rank refuses, before any collective
        for m in (world + 1, 2 * world - 1):
            with pytest.raises(ValueError, match=f"M={m} rows cannot be scattered evenly over {world} ranks"):
                plain.gemm_rs(torch.randn(m, 16).bfloat16(), w)


def _async_tp_takes_the_plain_path(rank, world):
    """AsyncTP's "never" path (overlap="auto" on tiny shapes: taken untimed) and the TP layers without a
    communicator are the plain path, sums in the dtype; the reference backend is the oracle's contract,
    fp32 sums; all bit for bit."""
    dtype, rows, k, n = torch.bfloat16, 3, 16, 12
    never = AsyncTP.simulated(world, world * rows, 16, dtype, overlap="auto")[rank]   # its group: the default
    on_reference = AsyncTP(world * rows, 16, dtype=dtype, backend="reference")
    a, w = operands(rank, rows, k, n, dtype, True, seed=7)
    a_full, _ = operands(rank, world * rows, k, n, dtype, True, seed=8)
    out, gathered = never.ag_gemm(a, w, return_gathered=True)
    expected, expected_gathered = plain.ag_gemm(a, w, return_gathered=True)
    assert torch.equal(out, expected) and torch.equal(gathered, expected_gathered)
    assert torch.equal(never.gemm_rs(a_full, w), plain.gemm_rs(a_full, w))
    assert torch.equal(never.gemm_ar(a, w), plain.gemm_ar(a, w))
    assert {key: c["path"] for key, c in never.choices.items()} == {
        ("ag_gemm", world * rows, k, n): "never", ("gemm_rs", world * rows, k, n): "never",
        ("gemm_ar", rows, k, n): "never"}
    assert all(c["times_us"] == {} for c in never.choices.values())

    assert torch.equal(on_reference.ag_gemm(a, w), reference.ag_gemm(a, w))
    assert torch.equal(on_reference.gemm_rs(a_full, w), reference.gemm_rs(a_full, w))
    assert torch.equal(on_reference.gemm_ar(a, w), reference.gemm_ar(a, w))
    if world > 1:
        for tp in (never, on_reference):
            with pytest.raises(ValueError, match="evenly"):
                tp.gemm_rs(torch.randn(world * rows - 1, k).to(dtype), w)

    torch.manual_seed(0)                                   # the same linears on every rank
    up, down = torch.nn.Linear(k, n * world, dtype=dtype), torch.nn.Linear(n * world, k, dtype=dtype)
    h = torch.randn(world * rows, n).to(dtype)             # this rank's columns of the row-parallel input
    for sequence_parallel in (True, False):                # without a communicator: the plain path
        column = ColumnParallelLinear.from_linear(up, sequence_parallel=sequence_parallel)
        row = RowParallelLinear.from_linear(down, sequence_parallel=sequence_parallel)
        x = a if sequence_parallel else a_full
        gathered = plain.ag_gemm(x, column.weight.t()) if sequence_parallel else x @ column.weight.t()
        reduced = (plain.gemm_rs if sequence_parallel else plain.gemm_ar)(h, row.weight.t())
        assert torch.equal(column(x), gathered + column.bias)
        assert torch.equal(row(h), reduced + row.bias)


def _everything(rank, world):
    _plain_matches_the_oracle(rank, world)
    _async_tp_takes_the_plain_path(rank, world)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_plain_path_matches_the_oracle(world):
    run(_everything, world)


def _operands_of_a_kind_that_passed_are_still_checked(rank, world):
    """AsyncTP remembers the kinds of operands that passed its checks (``AsyncTP._checked``): a later call of
    such a kind skips them, and operands that differ from it in anything the checks read (dtype, device,
    contiguity, shape, strides, the op) are checked again, and refused with the same ValueError at every call.
    What an earlier call left (a timeout, the object destroyed) is raised all the same; on the reference
    backend every call's verdict is still agreed on."""
    dtype, rows, k, n = torch.bfloat16, 4, 16, 8
    tp = AsyncTP.simulated(world, world * rows, k, dtype, overlap="never")[rank]
    a, w = operands(rank, rows, k, n, dtype, True, seed=11)
    a_full, _ = operands(rank, world * rows, k, n, dtype, True, seed=12)
    checked, check = [], tp._check_operands
    tp._check_operands = lambda op, *args: checked.append(op) or check(op, *args)
    for _ in range(2):                                     # checked, then remembered
        assert torch.equal(tp.gemm_ar(a, w), plain.gemm_ar(a, w))
        assert torch.equal(tp.gemm_ar(a, w.contiguous()), plain.gemm_ar(a, w))     # w of other strides
        assert torch.equal(tp.gemm_rs(a_full, w), plain.gemm_rs(a_full, w))
        assert torch.equal(tp.ag_gemm(a, w), plain.ag_gemm(a, w))
    assert checked == ["gemm_ar", "gemm_ar", "gemm_rs", "ag_gemm"]
    refused = [("gemm_ar", a.double(), w, "a has dtype torch.float64"),
               ("gemm_ar", a, w.half(), "w has dtype torch.float16"),
               ("gemm_ar", a.to("meta"), w, "a is on meta, expected cpu"),
               ("gemm_ar", a, w.to("meta"), "w is on meta, expected cpu"),
               ("gemm_ar", a.t().contiguous().t(), w, "a must be contiguous"),
               ("gemm_rs", a_full[1:], w, f"M={world * rows - 1} rows cannot be scattered evenly"),
               ("ag_gemm", a_full, w, f"M={world * world * rows} exceeds this AsyncTP's max_rows={world * rows}")]
    for _ in range(2):
        for op, a_, w_, reason in refused:
            with pytest.raises(ValueError, match=re.escape(reason)) as error:
                getattr(tp, op)(a_, w_)
            assert type(error.value) is ValueError
    assert tp._calls() == {"gemm_ar": 4, "gemm_rs": 2, "ag_gemm": 2}      # refused calls are not counted

    tp._status[0] = 1                                      # a wait of an earlier call timed out
    for _ in range(2):
        with pytest.raises(CommTimeoutError, match="timed out"):
            tp.gemm_ar(a, w)
    tp.destroy()
    with pytest.raises(RuntimeError, match="destroyed"):
        tp.gemm_ar(a, w)

    on_reference = AsyncTP(world * rows, k, dtype=dtype, backend="reference")
    for _ in range(2):
        assert torch.equal(on_reference.gemm_ar(a, w), reference.gemm_ar(a, w))
    with pytest.raises(CallRefusedError, match=r"^gemm_ar refused by rank 0: gemm_ar: a has dtype torch.float64"):
        on_reference.gemm_ar(a.double() if rank == 0 else a, w)


def test_operands_of_a_kind_that_passed_are_still_checked():
    run(_operands_of_a_kind_that_passed_are_still_checked, 2)


def _sums_come_back_in_the_dtype_of_a(rank, world):
    """gemm_ar and gemm_rs return a's dtype whatever dtype the GEMM gave (bfloat16 for float32 operands under
    autocast): the partials summed in that dtype (sum_dtype=None) or in sum_dtype, then cast to a's."""
    a, w = operands(rank, 2 * world, 16, 8, torch.float32, False, seed=5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        partial = a @ w
        results = {sum_dtype: (plain.gemm_ar(a, w, sum_dtype=sum_dtype), plain.gemm_rs(a, w, sum_dtype=sum_dtype))
                   for sum_dtype in (None, torch.float32)}
    assert partial.dtype == torch.bfloat16
    for sum_dtype, (reduced, scattered) in results.items():
        summed = partial.to(sum_dtype or partial.dtype, copy=True)
        all_reduce(summed)
        assert torch.equal(reduced, summed.float()), sum_dtype
        assert torch.equal(scattered, summed.float()[2 * rank:2 * rank + 2]), sum_dtype


def test_sums_come_back_in_the_dtype_of_a():
    run(_sums_come_back_in_the_dtype_of_a, 2)


def test_production_never_imports_the_oracle():
    root = Path(__file__).resolve().parents[1]
    files = [f for path in map(root.joinpath, PRODUCTION) for f in (path.rglob("*.py") if path.is_dir() else [path])]
    assert len(files) > 2
    for file in files:
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [f"{node.module or ''}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            assert not any("reference" in name.split(".") for name in names), \
                f"{file.relative_to(root)} imports the oracle: {names}"
