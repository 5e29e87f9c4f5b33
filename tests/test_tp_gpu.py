"""AsyncTP's kernels and the TP layers (forward and backward) against the reference on NCCL, on 2+ GPUs.

Tolerances: the kernels and cuBLAS accumulate in fp32 in different orders, and the outputs
are rounded to bf16/fp16, so results are compared with rtol = atol = 2e-2 (bf16) / 5e-3 (fp16)
on inputs of unit scale divided by sqrt(K).
"""
import pytest
import torch
import torch.distributed as dist

from cases import llama_mlp
from distributed import gpu_worlds, run
from moe_ep import AsyncTP, CommTimeoutError, TPMLP, reference

pytestmark = pytest.mark.gpu
TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}
# rows per rank (M / W), K, N: small M, M not a multiple of the tile, K not a multiple of BLOCK_K
SHAPES = [(1, 128, 256), (3, 200, 96), (100, 512, 1000), (128, 1024, 2048), (300, 2048, 4096), (1024, 4096, 4096)]


def operands(rank, world, rows, k, n, dtype, transposed, seed):
    g = torch.Generator(device="cuda").manual_seed(seed * 100 + rank)
    a = torch.randn(rows, k, generator=g, device="cuda").to(dtype)
    w = torch.randn(n, k, generator=g, device="cuda").to(dtype) / k ** 0.5
    return a, (w.t() if transposed else w.t().contiguous())


def close(out, expected, dtype, what):
    torch.testing.assert_close(out.float(), expected.float(), rtol=TOL[dtype], atol=TOL[dtype], msg=what)


def _kernels_match_reference(rank, world, path):
    for dtype in (torch.bfloat16, torch.float16):
        tp = AsyncTP(max_rows=world * 1024, max_features=4096, dtype=dtype, overlap=path)
        for i, (rows, k, n) in enumerate(SHAPES):
            for transposed in (False, True):
                seed = 2 * i + transposed
                a, w = operands(rank, world, rows, k, n, dtype, transposed, seed)
                out, gathered = tp.ag_gemm(a, w, return_gathered=True)
                ref, ref_gathered = reference.ag_gemm(a, w, return_gathered=True)
                assert torch.equal(gathered, ref_gathered), "gathered A differs"
                close(out, ref, dtype, lambda m: f"{path} ag_gemm {rows, k, n, dtype, transposed}: {m}")

                a_full, w = operands(rank, world, world * rows, k, n, dtype, transposed, seed)
                close(tp.gemm_rs(a_full, w), reference.gemm_rs(a_full, w), dtype,
                      lambda m: f"{path} gemm_rs {rows, k, n, dtype, transposed}: {m}")

                out = tp.gemm_ar(a, w)           # M = rows: within max_rows / W, where "fused" runs the kernel
                close(out, reference.gemm_ar(a, w), dtype,
                      lambda m: f"{path} gemm_ar {rows, k, n, dtype, transposed}: {m}")
                if path == "fused":              # the kernel sums in the same order on every rank
                    every = out.new_empty((world * out.shape[0], *out.shape[1:]))
                    reference.all_gather_into_tensor(every, out)
                    assert all(torch.equal(o, out) for o in every.view(world, *out.shape)), \
                        "fused gemm_ar: the ranks' sums differ"
        tp.check()
        tp.destroy()


def _repeated_calls_and_the_fallback(rank, world):
    dtype, rows, k, n = torch.bfloat16, 256, 1024, 2048
    paths = {path: AsyncTP(world * rows, 2048, overlap=path) for path in ("fused", "chunked", "never")}
    for call in range(30):                       # fresh inputs each call, buffers and flags reused
        a, w = operands(rank, world, rows, k, n, dtype, call % 2 == 1, seed=1000 + call)
        a_full, _ = operands(rank, world, world * rows, k, n, dtype, False, seed=2000 + call)
        ag_ref, rs_ref, ar_ref = reference.ag_gemm(a, w), reference.gemm_rs(a_full, w), reference.gemm_ar(a, w)
        for path, tp in paths.items():
            if rank == call % world:
                torch.cuda._sleep(1_000_000)     # a straggler must not see stale shards or partials
            out = tp.ag_gemm(a, w)
            if path == "never":
                assert torch.equal(out, ag_ref), "the fallback is the plain path"
            close(out, ag_ref, dtype, lambda m: f"{path} ag_gemm call {call}: {m}")
            close(tp.gemm_rs(a_full, w), rs_ref, dtype, lambda m: f"{path} gemm_rs call {call}: {m}")
            close(tp.gemm_ar(a, w), ar_ref, dtype, lambda m: f"{path} gemm_ar call {call}: {m}")
    for tp in paths.values():
        tp.check()

    auto = AsyncTP(world * 2048, 4096)           # overlap="auto": measured on the first call of a shape
    a, w = operands(rank, world, 4, 256, 512, dtype, False, seed=7)
    close(auto.ag_gemm(a, w), reference.ag_gemm(a, w), dtype, lambda m: f"auto, small: {m}")
    assert auto.choices[("ag_gemm", 4 * world, 256, 512)]["times_us"] == {}, "tiny shapes: the plain path, untimed"
    assert auto.choices[("ag_gemm", 4 * world, 256, 512)]["path"] == "never"
    a, w = operands(rank, world, 2048, 4096, 4096, dtype, True, seed=9)
    a_full, _ = operands(rank, world, world * 2048, 4096, 4096, dtype, True, seed=10)
    for call in range(2):                        # the first call measures, the second reuses the choice
        close(auto.ag_gemm(a, w), reference.ag_gemm(a, w), dtype, lambda m: f"auto ag_gemm, call {call}: {m}")
        close(auto.gemm_rs(a_full, w), reference.gemm_rs(a_full, w), dtype, lambda m: f"auto gemm_rs, call {call}: {m}")
    for op in ("ag_gemm", "gemm_rs"):
        choice = auto.choices[(op, world * 2048, 4096, 4096)]
        assert len(choice["times_us"]) == 3, f"{op}: every path is timed at this shape: {choice}"
        decisions = [None] * world
        dist.all_gather_object(decisions, (choice["path"], choice["times_us"]))
        assert all(d == decisions[0] for d in decisions), f"{op}: the ranks decided differently: {decisions}"

    tp = paths["fused"]                          # bad inputs: w fits each a but for the one size under test
    a, w = operands(rank, world, rows, k, n, dtype, False, seed=8)
    with pytest.raises(ValueError, match="dtype"):
        tp.ag_gemm(a.float(), w)
    with pytest.raises(ValueError, match=f"M={world * (rows + 1)} exceeds .* max_rows={world * rows}"):
        tp.ag_gemm(torch.zeros(rows + 1, k, dtype=dtype, device="cuda"), w)
    with pytest.raises(ValueError, match="evenly"):
        tp.gemm_rs(torch.zeros(world * rows - 1, k, dtype=dtype, device="cuda"), w)
    with pytest.raises(ValueError, match="columns"):
        tp.gemm_rs(torch.zeros(world * rows, k + 1, dtype=dtype, device="cuda"), w)
    for tp in (*paths.values(), auto):
        tp.destroy()


def _timeout_raises(rank, world):
    tp = AsyncTP(world * 64, 256, overlap="fused", timeout_s=0.5)
    a, w = operands(rank, world, 64, 256, 256, torch.bfloat16, False, seed=3)
    if rank == 0:
        tp.launches.ag_gemm(a, w)                # no barrier and no peer pushes: nothing lands
        with pytest.raises(CommTimeoutError, match=r"rank 0: all-gather GEMM .* waiting for rank [1-9]"):
            tp.check()
    dist.barrier()
    tp.destroy()


def grads_close(got, expected, what, tol=2e-2):
    """bf16 gradients against fp32 ones: max |got - expected| <= tol * max |expected| (bf16 rounds
    each activation and product to 2**-8 relative; sums over thousands of rows average it out)."""
    error = (got.float() - expected).abs().max().item()
    assert error <= tol * expected.abs().max().item(), f"{what}: max error {error}, max |expected| " \
        f"{expected.abs().max().item()}"


def _mlp_matches_unsharded(rank, world):
    """Forward and backward of TPMLP (weights requiring grad, as from_mlp leaves them) on every path,
    against the unsharded MLP: outputs against its bf16 forward, gradients against an fp32 copy."""
    torch.manual_seed(0)
    hidden, inner, m = 1024, 2816 * world // 2, 1000 * world
    mlp = llama_mlp(hidden, inner).cuda().to(torch.bfloat16)
    x = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)
    mine = slice(rank * m // world, (rank + 1) * m // world)
    cols = slice(rank * inner // world, (rank + 1) * inner // world)
    with torch.no_grad():
        expected = mlp(x)
    full = llama_mlp(hidden, inner).cuda()
    full.load_state_dict(mlp.state_dict())           # fp32 copy of the same bf16 weights
    x32 = x.float().requires_grad_()
    (full(x32) * g.float()).sum().backward()
    gate_up_grad = torch.cat([full.gate_proj.weight.grad[cols], full.up_proj.weight.grad[cols]])

    comm = AsyncTP(max_rows=m, max_features=max(hidden, inner))
    runs = [(path, TPMLP.from_mlp(mlp, comm=comm)) for path in ("fused", "chunked", "auto")]
    runs.append(("reference", TPMLP.from_mlp(mlp)))
    runs += [(f"{name}, all rows", TPMLP.from_mlp(mlp, comm=c, sequence_parallel=False))   # gemm_ar
             for name, c in (("nvshmem", comm), ("reference", None))]
    for path, tp_mlp in runs:
        comm.overlap = path if path in ("fused", "chunked") else "auto"
        rows = mine if tp_mlp.down_proj.sequence_parallel else slice(None)
        x_in = x[rows].clone().requires_grad_()
        y = tp_mlp(x_in)
        close(y, expected[rows], torch.bfloat16, lambda msg: f"TPMLP ({path}): {msg}")
        (y * g[rows]).sum().backward()
        grads_close(x_in.grad, x32.grad[rows], f"TPMLP ({path}) input gradient")
        grads_close(tp_mlp.gate_up_proj.weight.grad, gate_up_grad, f"TPMLP ({path}) gate/up weight gradient")
        grads_close(tp_mlp.down_proj.weight.grad, full.down_proj.weight.grad[:, cols],
                    f"TPMLP ({path}) down weight gradient")
    comm.check()
    comm.destroy()


@gpu_worlds
@pytest.mark.parametrize("path", ["fused", "chunked"])
def test_kernels_match_reference(path, world):
    run(_kernels_match_reference, world, path, gpu=True)


@pytest.mark.parametrize("body", [_repeated_calls_and_the_fallback, _timeout_raises, _mlp_matches_unsharded],
                         ids=lambda f: f.__name__.strip("_"))
@gpu_worlds
def test_async_tp(body, world):
    run(body, world, gpu=True)
