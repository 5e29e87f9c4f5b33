"""AsyncTP's kernels and the TP layers (forward and backward) against the reference on NCCL, on 2+ GPUs.

Tolerances follow from what is summed, for every world size W. u is the dtype's unit roundoff
(2**-8 bf16, 2**-11 fp16), gamma = K * 2**-24 bounds an fp32 sum of K products relative to the sum
of their magnitudes S = |a| @ |w| (fp32; summed over ranks for the reductions), and T = the sum over
ranks of |a @ w|, the partials' magnitudes. cuBLAS runs with fp32 reductions throughout (no
reduced-precision split-K), as the kernels do, so:

    ag_gemm          both sides round one fp32 product, accumulated in different orders:
                     |out - ref| <= 2 gamma S + 2 u |ref|
    gemm_rs/gemm_ar  each rank's partial is accumulated in another order (2 gamma S_r apart) and
                     rounded to the dtype on both sides (2 u |partial_r| more), the plain path sums
                     the W partials in the dtype as NCCL does (W - 1 roundings, each at most u T),
                     the others in fp32; the result is rounded once more on each side:
                     |out - ref| <= 2 gamma S + (W + 1) u T + 2 u |ref|

A lost partial or a stale tile is off by |partial_r|, about T / W: over the bound at most elements.
"""
import pytest
import torch
import torch.distributed as dist

from cases import llama_mlp
from distributed import gpu_worlds, refused_on_rank_0, run
from moe_ep import AsyncTP, CommTimeoutError, TPMLP, reference
from moe_ep.collectives import all_reduce, reduce_scatter_tensor
from moe_ep.kernels.matmul import fused_tile_config
from moe_ep.tp.cost import candidate_paths

pytestmark = pytest.mark.gpu
UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
# rows per rank (M / W), K, N: small M, M not a multiple of the tile, K not a multiple of BLOCK_K
SHAPES = [(1, 128, 256), (3, 200, 96), (100, 512, 1000), (128, 1024, 2048), (300, 2048, 4096), (1024, 4096, 4096)]


def fp32_reductions() -> None:
    """cuBLAS GEMMs in half precision accumulate and reduce in fp32, as the tolerances assume."""
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False


def operands(rank, world, rows, k, n, dtype, transposed, seed):
    g = torch.Generator(device="cuda").manual_seed(seed * 100 + rank)
    a = torch.randn(rows, k, generator=g, device="cuda").to(dtype)
    w = torch.randn(n, k, generator=g, device="cuda").to(dtype) / k ** 0.5
    return a, (w.t() if transposed else w.t().contiguous())


def bound(expected, s, k, dtype, t=None):
    """The elementwise tolerance of the module's docstring: `s` is S, `t` is T for the reductions (None
    for ag_gemm, which sums nothing across ranks); W is the group's size."""
    u, gamma = UNIT_ROUNDOFF[dtype], k * 2.0 ** -24
    summed = 0 if t is None else (dist.get_world_size() + 1) * u * t
    return 2 * gamma * s + summed + 2 * u * expected.float().abs()


def close(out, expected, tolerance, what):
    """|out - expected| <= tolerance everywhere (NaN never passes)."""
    error = (out.float() - expected.float()).abs()
    over = ~(error <= tolerance)
    if over.any():
        worst = torch.argmax(torch.where(over, error - tolerance, 0)).item()
        at = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), out.shape))
        raise AssertionError(what(f"{int(over.sum())} / {out.numel()} elements over their bound; at {at}: "
                                  f"{out.flatten()[worst].item()} against {expected.flatten()[worst].item()}, "
                                  f"bound {tolerance.flatten()[worst].item():.3g}"))


def expect(tp, op, out, a, w, what, expected=None):
    """`out` of tp.<op>(a, w) against reference.<op>(a, w) (or `expected`, when already computed), within
    the op's bound, once tp.check() has passed: a wait that timed out says so, instead of the garbage its
    call left in `out` failing the comparison."""
    tp.check()
    if expected is None:
        expected = getattr(reference, op)(a, w)
    s = getattr(reference, op)(a.float().abs(), w.float().abs())      # the op on magnitudes, in fp32
    t = None
    if op != "ag_gemm":                                                 # the partials' magnitudes, summed
        t = (a @ w).float().abs()
        if op == "gemm_rs":
            t_all, t = t, t.new_empty(t.shape[0] // dist.get_world_size(), t.shape[1])
            reduce_scatter_tensor(t, t_all)
        else:
            all_reduce(t)
    close(out, expected, bound(expected, s, a.shape[1], a.dtype, t), what)


def same_on_every_rank(out: torch.Tensor) -> bool:
    """Whether every rank holds `out` bit for bit (collective)."""
    every = out.new_empty((dist.get_world_size() * out.shape[0], *out.shape[1:]))
    reference.all_gather_into_tensor(every, out)
    return all(torch.equal(o, out) for o in every.view(-1, *out.shape))


def _kernels_match_reference(rank, world, path):
    fp32_reductions()
    for dtype in (torch.bfloat16, torch.float16):
        tp = AsyncTP(max_rows=world * 1024, max_features=4096, dtype=dtype, overlap=path)
        for i, (rows, k, n) in enumerate(SHAPES):
            for transposed in (False, True):
                seed = 2 * i + transposed
                a, w = operands(rank, world, rows, k, n, dtype, transposed, seed)
                out, gathered = tp.ag_gemm(a, w, return_gathered=True)
                tp.check()                       # a wait that timed out says so, before its output is compared
                ref, ref_gathered = reference.ag_gemm(a, w, return_gathered=True)
                assert torch.equal(gathered, ref_gathered), "gathered A differs"
                expect(tp, "ag_gemm", out, a, w, lambda m: f"{path} ag_gemm {rows, k, n, dtype, transposed}: {m}", ref)

                a_full, w = operands(rank, world, world * rows, k, n, dtype, transposed, seed)
                out = tp.gemm_rs(a_full, w)
                expect(tp, "gemm_rs", out, a_full, w, lambda m: f"{path} gemm_rs {rows, k, n, dtype, transposed}: {m}")

                out = tp.gemm_ar(a, w)           # M = rows: within max_rows / W, where "fused" runs the kernel
                expect(tp, "gemm_ar", out, a, w, lambda m: f"{path} gemm_ar {rows, k, n, dtype, transposed}: {m}")
                if path == "fused":              # the kernel sums in the same order on every rank
                    assert same_on_every_rank(out), "fused gemm_ar: the ranks' sums differ"
        tp.check()
        tp.destroy()


def _repeated_calls_and_the_fallback(rank, world):
    fp32_reductions()
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
            expect(tp, "ag_gemm", out, a, w, lambda m: f"{path} ag_gemm call {call}: {m}", ag_ref)
            out = tp.gemm_rs(a_full, w)
            expect(tp, "gemm_rs", out, a_full, w, lambda m: f"{path} gemm_rs call {call}: {m}", rs_ref)
            expect(tp, "gemm_ar", tp.gemm_ar(a, w), a, w, lambda m: f"{path} gemm_ar call {call}: {m}", ar_ref)
    for tp in paths.values():
        tp.check()

    auto = AsyncTP(world * 2048, 4096)           # overlap="auto": measured on the first call of a shape
    a, w = operands(rank, world, 4, 256, 512, dtype, False, seed=7)
    expect(auto, "ag_gemm", auto.ag_gemm(a, w), a, w, lambda m: f"auto, small: {m}")
    assert auto.choices[("ag_gemm", 4 * world, 256, 512)]["times_us"] == {}, "tiny shapes: the plain path, untimed"
    assert auto.choices[("ag_gemm", 4 * world, 256, 512)]["path"] == "never"
    a, w = operands(rank, world, 2048, 4096, 4096, dtype, True, seed=9)
    a_full, _ = operands(rank, world, world * 2048, 4096, 4096, dtype, True, seed=10)
    for call in range(2):                        # the first call measures, the second reuses the choice
        expect(auto, "ag_gemm", auto.ag_gemm(a, w), a, w, lambda m: f"auto ag_gemm, call {call}: {m}")
        expect(auto, "gemm_rs", auto.gemm_rs(a_full, w), a_full, w, lambda m: f"auto gemm_rs, call {call}: {m}")
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


GRAPH_REPLAYS = 3        # replays of each captured call, each on fresh inputs


def captured(tp, op, a, w):
    """A CUDA graph of tp.<op>(a, w) on the static inputs a and w, captured after one eager call (which compiles
    and loads the kernels and, under overlap="auto", chooses the shape's paths), and the output it writes."""
    getattr(tp, op)(a, w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = getattr(tp, op)(a, w)
    return graph, out


def replays_match(rank, world, tp, op, shape, seed, what):
    """tp.<op> captured on static inputs of `shape` (rows per rank, K, N), then replayed GRAPH_REPLAYS times,
    fresh inputs copied into the static ones before each replay (a straggler rank before some: it must not see
    stale shards or partials): each replay's output against the reference on those inputs."""
    rows, k, n = shape
    m = world * rows if op == "gemm_rs" else rows
    static = operands(rank, world, m, k, n, tp.dtype, True, seed)
    graph, out = captured(tp, op, *static)
    for replay in range(GRAPH_REPLAYS):
        a, w = operands(rank, world, m, k, n, tp.dtype, True, seed + 1 + replay)
        for dst, src in zip(static, (a, w)):
            dst.copy_(src)
        if rank == replay % world:
            torch.cuda._sleep(1_000_000)
        graph.replay()
        expect(tp, op, out, a, w, lambda msg: f"{what} {op}, replay {replay} of its CUDA graph: {msg}")


def _graphs_replay_fresh_inputs(rank, world):
    """Each op on each of its paths, and on overlap="auto" (whose captured call takes the graphs' choice), in a
    CUDA graph replayed on fresh inputs (``replays_match``). gloo (shared-GPU mode) crosses host copies, which no
    graph holds: there the plain path is not captured, and auto's graphs' choice is the plain path, untimed."""
    fp32_reductions()
    nccl = dist.get_backend() == "nccl"
    shape = (100, 512, 1000)                     # M not a multiple of the tile, K of BLOCK_K, N of BLOCK_N
    ops = {"fused": ("ag_gemm", "gemm_rs", "gemm_ar"), "chunked": ("ag_gemm", "gemm_rs")}   # gemm_ar: "never"
    if nccl:
        ops["never"] = ("ag_gemm", "gemm_rs", "gemm_ar")
    for i, (path, path_ops) in enumerate(ops.items()):
        tp = AsyncTP(world * shape[0], max(shape[1:]), overlap=path)
        for j, op in enumerate(path_ops):
            replays_match(rank, world, tp, op, shape, seed=100 * i + 10 * j, what=path)
        tp.check()
        tp.destroy()

    rows, k, n = 512, 4096, 4096                 # a shape where auto times paths
    auto = AsyncTP(world * rows, max(k, n))      # overlap="auto"
    key = ("ag_gemm", world * rows, k, n)
    assert len(candidate_paths(*key, world)) > 1, f"auto takes {key} untimed"
    taken, path_of = [], auto.tuner.path

    def recorded(*args):                         # the path each call takes
        taken.append(path_of(*args))
        return taken[-1]

    auto.tuner.path = recorded
    if nccl:
        replays_match(rank, world, auto, "ag_gemm", (rows, k, n), seed=500, what="auto")
    else:
        a, w = operands(rank, world, rows, k, n, auto.dtype, True, seed=500)
        expect(auto, "ag_gemm", auto.ag_gemm(a, w), a, w, lambda msg: f"auto ag_gemm: {msg}")
    choice = auto.choices[key]
    assert set(choice["times_us"]) == set(candidate_paths(*key, world)), choice
    if nccl:                                     # the eager call took the eager choice, the captured one the graphs'
        assert taken == [choice["path"], choice["graph_path"]], (taken, choice)
        assert set(choice["graph_times_us"]) == set(choice["times_us"]) and not choice["graph_failed"], choice
    else:
        assert taken == [choice["path"]] and choice["graph_path"] == "never" and "never" in choice["graph_failed"], \
            (taken, choice)
    decisions = [None] * world
    dist.all_gather_object(decisions, (choice["path"], choice["graph_path"]))
    assert all(d == decisions[0] for d in decisions), f"the ranks decided differently: {decisions}"
    auto.check()
    auto.destroy()


def _pipelines(rank, world):
    """The fused GEMM all-reduce and the fused reduce-scatter over all rows where every program has several
    tiles (448 tiles of 128 x 128 over [128, 57344], twice a decode step's N, for at most 132 programs), so that their
    pipelines' steps overlap: publish, sum (and the all-reduce's gather) of different tiles in one step, the
    all-reduce's owners rotating along a program's tiles, the reduce-scatter's tiles each holding several
    ranks' rows. Three calls of each on fresh inputs against the reference; the all-reduce's sum the same on
    every rank bit for bit."""
    fp32_reductions()
    rows, k, n = 128, 256, 57344
    tp = AsyncTP(world * rows, n, overlap="fused")
    for call in range(3):
        a, w = operands(rank, world, rows, k, n, torch.bfloat16, True, seed=40 + call)
        out = tp.gemm_ar(a, w)
        expect(tp, "gemm_ar", out, a, w, lambda m: f"fused gemm_ar, call {call}: {m}")
        assert same_on_every_rank(out), "fused gemm_ar: the ranks' sums differ"
        expect(tp, "gemm_rs", tp.gemm_rs(a, w), a, w, lambda m: f"fused gemm_rs over all rows, call {call}: {m}")
    config = tp.launches.rs_rows(rows, n, 2)
    assert config == fused_tile_config(rows, n, 2, tp.launches.programs), \
        "M = 128 is a decode step's: the reduce-scatter over all rows"
    tiles = tp.launches.all_rows_tiles(rows, n, config)
    assert tiles > 3 * tp.launches.programs, f"{tiles} tiles for {tp.launches.programs} programs"
    tp.check()
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


def _refusal(rank, world):
    """Rank 0 refuses an ag_gemm (a row too many) that rank 1 makes, on the fused path (its kernels compiled by
    a first call of both): rank 1's call times out in its barrier, then in its wait for rank 0's shard, and
    check() raises CallRefusedError naming rank 0 and why (``distributed.refused_on_rank_0``)."""
    tp = AsyncTP(world * 64, 256, overlap="fused", timeout_s=2.0)
    a, w = operands(rank, world, 64, 256, 256, torch.bfloat16, False, seed=4)
    expect(tp, "ag_gemm", tp.ag_gemm(a, w), a, w, lambda m: f"before the refusal: {m}")
    too_many = torch.zeros(65, 256, dtype=torch.bfloat16, device="cuda")
    refused_on_rank_0(tp, lambda: tp.ag_gemm(too_many, w), lambda: tp.ag_gemm(a, w),
                      rf"^ag_gemm call 2 refused by rank 0: ag_gemm: M={world * 65} exceeds this AsyncTP's "
                      rf"max_rows={world * 64}")


def grads_close(got, expected, what, tol=2e-2):
    """bf16 gradients against fp32 ones: max |got - expected| <= tol * max |expected| (bf16 rounds
    each activation and product to 2**-8 relative; sums over thousands of rows average it out)."""
    error = (got.float() - expected).abs().max().item()
    assert error <= tol * expected.abs().max().item(), f"{what}: max error {error}, max |expected| " \
        f"{expected.abs().max().item()}"


def mlp_bound(mlp32, x, expected, world):
    """The forward's tolerance: the module's bounds carried through gate and up (K = hidden), SiLU and
    the product (each rounded on both sides; |SiLU'| <= 1.1) and down (K = inner, W partials summed).
    mlp32: the fp32 copy of the bf16 MLP; x [M, hidden] bf16; expected [M, hidden] the bf16 MLP's output."""
    u, gamma = UNIT_ROUNDOFF[torch.bfloat16], x.shape[1] * 2.0 ** -24
    with torch.no_grad():
        xf = x.float()
        w_gate, w_up, w_down = (p.weight for p in (mlp32.gate_proj, mlp32.up_proj, mlp32.down_proj))
        gate, up = xf @ w_gate.t(), xf @ w_up.t()
        act = torch.nn.functional.silu(gate)
        h = act * up
        d_gate = 2 * gamma * (xf.abs() @ w_gate.abs().t()) + 2 * u * gate.abs()
        d_up = 2 * gamma * (xf.abs() @ w_up.abs().t()) + 2 * u * up.abs()
        d_h = 1.1 * d_gate * up.abs() + act.abs() * d_up + 4 * u * h.abs()
        partials = sum((h[:, cols] @ w_down[:, cols].t()).abs()
                       for cols in torch.arange(h.shape[1], device=h.device).chunk(world))
        return d_h @ w_down.abs().t() + bound(expected, h.abs() @ w_down.abs().t(), h.shape[1], torch.bfloat16,
                                               partials)


def _mlp_matches_unsharded(rank, world):
    """Forward and backward of TPMLP (weights requiring grad, as from_mlp leaves them) on every path,
    against the unsharded MLP: outputs against its bf16 forward, gradients against an fp32 copy."""
    fp32_reductions()
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
    tolerance = mlp_bound(full, x, expected, world)

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
        close(y, expected[rows], tolerance[rows], lambda msg: f"TPMLP ({path}): {msg}")
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


@pytest.mark.parametrize("body", [_repeated_calls_and_the_fallback, _graphs_replay_fresh_inputs, _pipelines,
                                  _timeout_raises, _mlp_matches_unsharded],
                         ids=lambda f: f.__name__.strip("_"))
@gpu_worlds
def test_async_tp(body, world):
    run(body, world, gpu=True)


def test_a_refused_call_fails_on_every_rank():
    run(_refusal, 2, gpu=True, timeout=300)
