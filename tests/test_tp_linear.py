"""Tensor-parallel linears and AsyncTP on the reference backend (gloo) against unsharded modules and torch."""
import contextlib
import itertools
import re
import time
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn

from cases import llama_mlp
from distributed import run
from moe_ep import TPMLP, AsyncTP, CallRefusedError, ColumnParallelLinear, RowParallelLinear, reference, timing
from moe_ep.ep.protocol import capturing
from moe_ep.layers import tp_linear
from moe_ep.timing import GRAPH_CALLS
from moe_ep.tp import autotune
from moe_ep.tp.autotune import MEASURE_ROUNDS, MEASURE_WARMUP, Autotuner
from moe_ep.tp.config import TPConfig
from moe_ep.tp.cost import MARGIN, candidate_paths, measured_choice, predicted_us


def _layers_match(rank, world):
    torch.manual_seed(0)                                  # the same full modules on every rank
    m, hidden, inner = 4 * world, 32, 16 * world
    x = torch.randn(m, hidden)
    mine = slice(rank * m // world, (rank + 1) * m // world)

    column = nn.Linear(hidden, inner)
    tp_column = ColumnParallelLinear.from_linear(column)
    width = inner // world
    torch.testing.assert_close(tp_column(x[mine]), column(x)[:, rank * width:(rank + 1) * width])

    row = nn.Linear(inner, hidden)
    tp_row = RowParallelLinear.from_linear(row)
    h = torch.randn(m, inner)
    torch.testing.assert_close(tp_row(h[:, rank * width:(rank + 1) * width]), row(h)[mine], rtol=1e-5, atol=1e-5)

    mlp = llama_mlp(hidden, inner)
    tp_mlp = TPMLP.from_mlp(mlp)
    torch.testing.assert_close(tp_mlp(x[mine].reshape(2, -1, hidden)).reshape(-1, hidden), mlp(x)[mine],
                               rtol=1e-5, atol=1e-5)

    with pytest.raises(ValueError, match="multiple"):
        ColumnParallelLinear(hidden, inner + 1)
    with pytest.raises(ValueError, match="multiple"):
        tp_row(torch.randn(m + 1, width))
    with pytest.raises(ValueError, match="features"):
        tp_column(torch.randn(2, hidden + 1))
    with pytest.raises(ValueError, match="AsyncTP"):
        RowParallelLinear(inner, hidden, comm="nccl")
    with pytest.raises(ValueError, match="one nn.Linear"):
        RowParallelLinear.from_linears([row, row])
    with pytest.raises(ValueError, match="Llama-style"):
        TPMLP.from_mlp(nn.Linear(4, 4))


@pytest.mark.parametrize("world", [2, 4])
def test_tp_layers_match_unsharded(world):
    run(_layers_match, world)


def _backward(module, x, grad_out, needs_x=True):
    """x.grad (None unless needs_x) after (module(x) * grad_out).sum().backward(); x is detached first."""
    x = x.detach().clone().requires_grad_(needs_x)
    (module(x) * grad_out).sum().backward()
    return x.grad


def _gradients_match(rank, world, use_comm):
    """Input, weight and bias gradients of the sharded layers against the unsharded modules (fp32).
    Weights require grad (from_linear outside torch.no_grad); each layer is also run with a frozen
    weight, and with an input that needs no gradient."""
    torch.manual_seed(0)                                  # the same full modules and inputs on every rank
    m, hidden, inner = 4 * world, 32, 16 * world
    width = inner // world
    mine, cols = slice(rank * m // world, (rank + 1) * m // world), slice(rank * width, (rank + 1) * width)
    comm = AsyncTP(m, max(hidden, inner), dtype=torch.float32, backend="reference") if use_comm else None
    tight = dict(rtol=1e-5, atol=1e-5)

    column, row, mlp = nn.Linear(hidden, inner), nn.Linear(inner, hidden), llama_mlp(hidden, inner)
    x, g_hidden = torch.randn(m, hidden), torch.randn(m, hidden)
    h, g_inner = torch.randn(m, inner), torch.randn(m, inner)
    x_grad, h_grad, mlp_x_grad = _backward(column, x, g_inner), _backward(row, h, g_hidden), _backward(mlp, x, g_hidden)

    for needs_x, needs_w in ((True, True), (True, False), (False, True)):
        tp_column = ColumnParallelLinear.from_linear(column, comm=comm).requires_grad_(needs_w)
        grad = _backward(tp_column, x[mine], g_inner[:, cols], needs_x)
        if needs_x:
            torch.testing.assert_close(grad, x_grad[mine], **tight)
        if needs_w:
            torch.testing.assert_close(tp_column.weight.grad, column.weight.grad[cols], **tight)
            torch.testing.assert_close(tp_column.bias.grad, column.bias.grad[cols], **tight)

        tp_row = RowParallelLinear.from_linear(row, comm=comm).requires_grad_(needs_w)
        grad = _backward(tp_row, h[:, cols], g_hidden[mine], needs_x)
        if needs_x:
            torch.testing.assert_close(grad, h_grad[:, cols], **tight)
        if needs_w:
            torch.testing.assert_close(tp_row.weight.grad, row.weight.grad[:, cols], **tight)
            bias_grad = tp_row.bias.grad.clone()          # this rank's rows' share of the replicated bias
            dist.all_reduce(bias_grad)
            torch.testing.assert_close(bias_grad, row.bias.grad, **tight)

    tp_mlp = TPMLP.from_mlp(mlp, comm=comm)
    grad = _backward(tp_mlp, x[mine].reshape(2, -1, hidden), g_hidden[mine])    # output rows flattened
    torch.testing.assert_close(grad.reshape(-1, hidden), mlp_x_grad[mine], **tight)
    gate_up = torch.cat([mlp.gate_proj.weight.grad[cols], mlp.up_proj.weight.grad[cols]])
    torch.testing.assert_close(tp_mlp.gate_up_proj.weight.grad, gate_up, **tight)
    torch.testing.assert_close(tp_mlp.down_proj.weight.grad, mlp.down_proj.weight.grad[:, cols], **tight)


@pytest.mark.parametrize("use_comm", [False, True], ids=["group", "asynctp"])
@pytest.mark.parametrize("world", [2, 4])
def test_tp_gradients_match_unsharded(world, use_comm):
    run(_gradients_match, world, use_comm)


def _without_sequence_parallelism(rank, world, use_comm):
    """sequence_parallel=False: every rank holds all rows (M not a multiple of tp); outputs and the
    gradients of inputs, weights and biases against the unsharded modules (fp32)."""
    torch.manual_seed(0)
    m, hidden, inner = 3, 32, 16 * world
    cols = slice(rank * inner // world, (rank + 1) * inner // world)
    comm = AsyncTP(4 * world, max(hidden, inner), dtype=torch.float32, backend="reference") if use_comm else None
    tight = dict(rtol=1e-5, atol=1e-5)
    column, row, mlp = nn.Linear(hidden, inner), nn.Linear(inner, hidden), llama_mlp(hidden, inner)
    x, g_hidden = torch.randn(m, hidden), torch.randn(m, hidden)
    h, g_inner = torch.randn(m, inner), torch.randn(m, inner)

    tp_column = ColumnParallelLinear.from_linear(column, comm=comm, sequence_parallel=False)
    torch.testing.assert_close(tp_column(x), column(x)[:, cols], **tight)
    torch.testing.assert_close(_backward(tp_column, x, g_inner[:, cols]), _backward(column, x, g_inner), **tight)
    torch.testing.assert_close(tp_column.weight.grad, column.weight.grad[cols], **tight)
    torch.testing.assert_close(tp_column.bias.grad, column.bias.grad[cols], **tight)

    tp_row = RowParallelLinear.from_linear(row, comm=comm, sequence_parallel=False)
    torch.testing.assert_close(tp_row(h[:, cols]), row(h), **tight)
    torch.testing.assert_close(_backward(tp_row, h[:, cols], g_hidden), _backward(row, h, g_hidden)[:, cols], **tight)
    torch.testing.assert_close(tp_row.weight.grad, row.weight.grad[:, cols], **tight)
    torch.testing.assert_close(tp_row.bias.grad, row.bias.grad, **tight)     # replicated output: the whole gradient

    tp_mlp = TPMLP.from_mlp(mlp, comm=comm, sequence_parallel=False)
    torch.testing.assert_close(tp_mlp(x), mlp(x), **tight)
    torch.testing.assert_close(_backward(tp_mlp, x, g_hidden), _backward(mlp, x, g_hidden), **tight)
    torch.testing.assert_close(tp_mlp.down_proj.weight.grad, mlp.down_proj.weight.grad[:, cols], **tight)
    gate_up = torch.cat([mlp.gate_proj.weight.grad[cols], mlp.up_proj.weight.grad[cols]])
    torch.testing.assert_close(tp_mlp.gate_up_proj.weight.grad, gate_up, **tight)


@pytest.mark.parametrize("use_comm", [False, True], ids=["group", "asynctp"])
@pytest.mark.parametrize("world", [2, 4])
def test_tp_layers_without_sequence_parallelism(world, use_comm):
    run(_without_sequence_parallelism, world, use_comm)


def _untracked_calls_skip_autograd(rank, world):
    """Where autograd records nothing (torch.no_grad, or no input or weight requiring grad) the layers without a
    communicator call plain's ops directly, not through the autograd functions (whose apply alone took 2-3 us of
    host time a call): the same outputs, bit for bit, as the recorded calls, with and without sequence
    parallelism."""
    torch.manual_seed(0)
    m, hidden, inner = 4 * world, 32, 16 * world
    x = torch.randn(m, hidden)
    mine = slice(rank * m // world, (rank + 1) * m // world)
    mlp = llama_mlp(hidden, inner)
    layers = {sp: TPMLP.from_mlp(mlp, sequence_parallel=sp) for sp in (True, False)}
    inputs = {True: x[mine], False: x}
    recorded = {sp: layer(inputs[sp]) for sp, layer in layers.items()}
    assert all(y.requires_grad for y in recorded.values())
    functions = [tp_linear.AllGatherGemm, tp_linear.AllReduceGrad, tp_linear.GemmAllReduce,
                 tp_linear.GemmReduceScatter]
    with contextlib.ExitStack() as patches:
        for function in functions:
            patches.enter_context(mock.patch.object(function, "apply", side_effect=AssertionError(function.__name__)))
        with torch.no_grad():
            for sp, layer in layers.items():
                assert torch.equal(layer(inputs[sp]), recorded[sp]), sp
        for sp, layer in layers.items():
            layer.requires_grad_(False)
            assert torch.equal(layer(inputs[sp]), recorded[sp]), sp


@pytest.mark.parametrize("world", [2])
def test_untracked_calls_skip_autograd(world):
    run(_untracked_calls_skip_autograd, world)


def _async_tp_on_the_reference_backend(rank, world):
    torch.manual_seed(rank)
    rows, k, n = 3, 16, 8
    tp = AsyncTP(max_rows=world * rows, max_features=16, dtype=torch.float32, backend="reference")
    a, w = torch.randn(rows, k), torch.randn(n, k).t()          # w as nn.Linear's weight.t()
    out, gathered = tp.ag_gemm(a, w, return_gathered=True)
    assert gathered.shape == (world * rows, k) and torch.equal(gathered[rank * rows:(rank + 1) * rows], a)
    torch.testing.assert_close(out, gathered @ w)
    a_full = torch.randn(world * rows, k)
    parts = [torch.empty(world * rows, n) for _ in range(world)]
    dist.all_gather(parts, a_full @ w)
    torch.testing.assert_close(tp.gemm_rs(a_full, w), sum(parts)[rank * rows:(rank + 1) * rows])
    torch.testing.assert_close(tp.gemm_ar(a_full, w), sum(parts))

    a_grad = a.clone().requires_grad_()                  # differentiable; the gathered A is not
    out, gathered = tp.ag_gemm(a_grad, w, return_gathered=True)
    assert out.requires_grad and not gathered.requires_grad and torch.equal(gathered[rank * rows:(rank + 1) * rows], a)
    out.sum().backward()
    expected = tp.gemm_rs(torch.ones(world * rows, n), w.t())
    torch.testing.assert_close(a_grad.grad, expected)

    with pytest.raises(ValueError, match="dtype"):
        tp.ag_gemm(a.double(), w)
    with pytest.raises(ValueError, match=f"M={world * (rows + 1)} exceeds .* max_rows={world * rows}"):
        tp.ag_gemm(torch.randn(rows + 1, k), w)
    with pytest.raises(ValueError, match="N=17 exceeds .* max_features=16"):
        tp.gemm_rs(torch.randn(world * rows, k), torch.randn(k, 17))
    with pytest.raises(ValueError, match="evenly"):
        tp.gemm_rs(torch.randn(world * rows - 1, k), w)
    with pytest.raises(ValueError, match="columns"):
        tp.gemm_rs(torch.randn(world * rows, k + 1), w)
    with pytest.raises(ValueError, match="N=17 exceeds .* max_features=16"):
        tp.gemm_ar(torch.randn(world * rows, k), torch.randn(k, 17))
    with pytest.raises(ValueError, match="dtype"):
        tp.gemm_ar(a_full.double(), w)
    with pytest.raises(ValueError, match="2-D"):
        tp.ag_gemm(a[None], w)
    with pytest.raises(ValueError, match="contiguous"):
        tp.ag_gemm(torch.randn(k, rows).t(), w)
    bad_options = [(dict(overlap="sometimes"), "overlap"), (dict(backend="mpi"), "backend"),
                   (dict(max_rows=world * rows + 1), "multiple"), (dict(dtype=torch.int8), "dtype"),
                   (dict(max_rows=2**16 * world, max_features=2**15), "32-bit")]
    for bad, match in bad_options:
        with pytest.raises(ValueError, match=match):
            AsyncTP(**{"max_rows": world * rows, "max_features": 16, "backend": "reference", **bad})
    with pytest.raises(ValueError, match=r"AsyncTP: the ranks of the group were built with different settings, .*: "
                                         r"max_features \(16 on rank 0, 32 on ranks? 1"):
        AsyncTP(max_rows=world * rows, max_features=16 if rank == 0 else 32, backend="reference")
    with pytest.raises(ValueError, match=r"AsyncTP refused by rank 1: overlap must be one of"):
        AsyncTP(max_rows=world * rows, max_features=16, backend="reference", overlap="never" if rank != 1 else "x")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU is usable here"):
            AsyncTP(max_rows=world * rows, max_features=16, backend="reference", device="cuda")


@pytest.mark.parametrize("world", [2, 4])
def test_async_tp_reference_backend_and_checks(world):
    run(_async_tp_on_the_reference_backend, world)


def _refused_calls_end_on_every_rank(rank, world):
    """A call that one rank refuses (the reference backend) raises CallRefusedError naming that rank and its
    reason on every rank, at once, and leaves nothing behind: the next call runs as if it never happened."""
    rows, k, n = 4, 16, 8
    tp = AsyncTP(max_rows=world * rows, max_features=16, dtype=torch.float32, backend="reference", timeout_s=30.0)
    g = torch.Generator().manual_seed(rank)
    a, a_full, w = torch.randn(rows, k, generator=g), torch.randn(world * rows, k, generator=g), torch.randn(k, n)
    started = time.monotonic()
    with pytest.raises(CallRefusedError, match=rf"^ag_gemm refused by rank 0: ag_gemm: M={world * (rows + 1)} "
                                               rf"exceeds this AsyncTP's max_rows={world * rows}") as refused:
        tp.ag_gemm(torch.randn(rows + 1, k) if rank == 0 else a, w)
    assert refused.value.refusals.keys() == {0}
    with pytest.raises(CallRefusedError, match=rf"^gemm_rs refused by rank 1: gemm_rs: M={world * rows - 1} rows "
                                               rf"cannot be scattered evenly over {world} ranks$"):
        tp.gemm_rs(a_full[1:] if rank == 1 else a_full, w)
    with pytest.raises(CallRefusedError, match=r"^gemm_ar refused by rank 0: gemm_ar: a has dtype torch.float64, "
                                               r"expected torch.float32; rank 1: gemm_ar: w is on meta, expected cpu$"):
        tp.gemm_ar(a.double() if rank == 0 else a, w.to("meta") if rank == 1 else w)
    assert time.monotonic() - started < 10, "a refusal is known to every rank at once, not after a timeout"
    assert torch.equal(tp.ag_gemm(a, w), reference.ag_gemm(a, w))


def test_a_call_one_rank_refuses_fails_on_every_rank():
    run(_refused_calls_end_on_every_rank, 2)


def test_the_fast_operand_checks_pass_only_what_every_check_passes():
    """AsyncTP's per-call operand checks in one expression (the common case, cheap on the host) pass only
    operands that the checks one at a time pass, with the same (M, K, N); the rest fall through to those
    checks, which name what is wrong."""
    tp = AsyncTP.simulated(2, max_rows=8, max_features=16)[0]        # float32, every rank in this process
    w = torch.randn(16, 8)
    good = [("gemm_ar", torch.randn(4, 16), w, (4, 16, 8)), ("ag_gemm", torch.randn(4, 16), w, (8, 16, 8)),
            ("gemm_rs", torch.randn(8, 16), torch.randn(8, 16).t(), (8, 16, 8)),
            ("gemm_rs", torch.randn(8, 4), torch.randn(4, 16), (8, 4, 16)),
            ("gemm_ar", torch.randn(0, 16), w, (0, 16, 8))]
    for op, a, w_, sizes in good:
        assert tp._operands_pass(op, a, w_) == tp._check_each_operand(op, a, w_) == sizes
        assert tp._check_operands(op, a, w_) == sizes
    bad = [("gemm_ar", torch.randn(4, 16).double(), w, "a has dtype torch.float64"),
           ("gemm_ar", torch.randn(4, 16), w.half(), "w has dtype torch.float16"),
           ("gemm_ar", torch.randn(4, 16), w.to("meta"), "w is on meta"),
           ("gemm_ar", torch.randn(1, 4, 16), w, "a must be 2-D"),
           ("gemm_ar", torch.randn(4, 16), w[0], "w must be 2-D"),
           ("gemm_ar", [[1.0] * 16], w, "a must be a torch.Tensor"),
           ("gemm_ar", torch.randn(16, 4).t(), w, "a must be contiguous"),
           ("gemm_ar", torch.randn(4, 12), w, "a's columns must equal w's rows"),
           ("ag_gemm", torch.randn(5, 16), w, "M=10 exceeds this AsyncTP's max_rows=8"),
           ("ag_gemm", torch.randn(4, 32), torch.randn(32, 8), "K=32 exceeds"),
           ("gemm_rs", torch.randn(8, 16), torch.randn(16, 32), "N=32 exceeds"),
           ("gemm_rs", torch.randn(7, 16), w, "cannot be scattered evenly")]
    for op, a, w_, reason in bad:
        assert tp._operands_pass(op, a, w_) is None
        with pytest.raises(ValueError, match=re.escape(reason)):
            tp._check_operands(op, a, w_)
    # a w spanning 2**31 elements (strides only: no such storage here) is not the fast path's either
    wide = SimpleNamespace(shape=torch.Size([16, 8]), dtype=torch.float32, device=torch.device("cpu"),
                           stride=lambda: (2**28, 1))
    assert tp._operands_pass("gemm_ar", torch.randn(4, 16), wide) is None


def test_each_timed_call_begins_after_a_barrier_of_the_group(monkeypatch):
    """The tuner's default clock: a barrier of the group, then the call timed alone (on the GPU only)."""
    seen = []
    monkeypatch.setattr(timing.dist, "barrier", lambda group=None: seen.append(("barrier", group)))
    monkeypatch.setattr(timing, "call_us", lambda fn: fn() or 2.5)
    config = TPConfig(2, 0, 16, 16, torch.bfloat16, "nvshmem", "auto", 1.0, "pointer")
    assert Autotuner(config, "group", torch.device("cuda")).time_us(lambda: seen.append("call")) == 2.5
    assert seen == [("barrier", "group"), "call"]
    with pytest.raises(RuntimeError, match="on the CPU name a path"):
        Autotuner(config, "group", torch.device("cpu")).time_us(lambda: None)


def _everything_at(rank, world):
    _layers_match(rank, world)
    _async_tp_on_the_reference_backend(rank, world)


def test_tp_at_8_ranks():
    run(_everything_at, 8)                  # one job: starting 8 processes is the slow part


def test_cost_model():
    for op in ("ag_gemm", "gemm_rs"):                     # small: launches and the barrier cost more than they hide
        times = predicted_us(op, 256, 4096, 4096, world=2)
        assert times["never"] < min(times["fused"], times["chunked"])
    times = predicted_us("ag_gemm", 16384, 8192, 4096, world=2)   # the (16384, 8192, 8192) at tp 2
    assert times["never"] / times["chunked"] > 1.2


def test_candidates_of_the_measured_choice():
    assert candidate_paths("ag_gemm", 4, 128, 128, world=2) == ["never"]      # overhead rules overlap out
    assert candidate_paths("ag_gemm", 16384, 8192, 4096, world=2) == ["chunked", "fused", "never"]
    # a decode step's row-parallel GEMM (16 rows, 235 MB of weights) streams its weights for about 80 us, which
    # hides the fused path's overhead: it is timed (its FLOPs alone, 5 us, left it out untimed)
    assert predicted_us("gemm_ar", 16, 14336, 8192, world=2)["never"] > 75
    assert candidate_paths("gemm_ar", 16, 14336, 8192, world=2) == ["never", "fused"]


def _measured_choice_agrees_and_is_cached(rank, world):
    # rank 0 alone finds "chunked" fastest; on their slowest rank "never" wins: every rank takes it
    mine = [50.0 if rank == 0 else 200.0, 150.0, 100.0 + rank]
    path, times = measured_choice(["chunked", "fused", "never"], mine, None, torch.device("cpu"))
    assert path == "never" and times == {"chunked": 200.0, "fused": 150.0, "never": 100.0 + world - 1}
    # an overlapped path barely faster than "never" is noise that may be a loss: "never" keeps the shape
    for fused_us, chosen in ((MARGIN * 100.0 + 0.5, "never"), (MARGIN * 100.0, "fused")):
        assert measured_choice(["fused", "never"], [fused_us, 100.0], None, torch.device("cpu"))[0] == chosen

    config = TPConfig(world, rank, 16384, 8192, torch.bfloat16, "nvshmem", "auto", 1.0, "pointer")
    tp = Autotuner(config, None, torch.device("cpu"))   # the nvshmem backend's choice logic, no buffers
    # Each candidate's timed bursts in turn (GRAPH_CALLS calls each, so its times over GRAPH_CALLS), the same
    # every shape: by its first burst "chunked" wins, by the means "never" (the outlier of "fused"), by the
    # medians "fused" (22 on rank 1, where "never" alone wins). In graphs (a replay's time, GRAPH_CALLS calls)
    # "chunked" wins: 19 us a call on its slowest rank.
    per_call = {"chunked": [5.0, 30.0, 30.0, 30.0, 40.0, 40.0, 40.0],
                "fused": [20.0 + 2 * rank, 20.0 + 2 * rank, 1000.0, *[20.0 + 2 * rank] * 4],
                "never": [25.0 - 10 * rank] * 7,
                "graph chunked": [18.0 + rank] * 7, "graph fused": [21.0] * 7, "graph never": [20.0] * 7}
    clock = {path: [GRAPH_CALLS * t for t in times] for path, times in per_call.items()}
    assert MEASURE_ROUNDS == 7                     # one time a round
    clock = {path: itertools.cycle(times) for path, times in clock.items()}
    ran, timed, failing = [], [], {}

    def fake_us(fn):                               # a fake clock: the next time of the candidate that just ran
        fn()
        timed.append(ran[-1])
        return next(clock[ran[-1]])

    def fake_capture(fn):                          # a fake graph: one call captured, its replay logged
        fn()
        path = ran[-1]
        ran[-1] = f"capture {path}"
        if rank in failing.get(path, ()):
            raise RuntimeError(f"{path} cannot be captured")
        return lambda: ran.append(f"graph {path}")

    tp.time_us, tp.capture = fake_us, fake_capture
    assert tp.path("ag_gemm", 16384, 8192, 4096, ran.append) == "fused"
    paths = ["chunked", "fused", "never"]
    warmup, rounds = len(paths) * MEASURE_WARMUP, [i for r in range(MEASURE_ROUNDS) for i in timing.round_order(r, 3)]
    bursts = len(paths) * (MEASURE_WARMUP + MEASURE_ROUNDS)
    eager_calls = bursts * GRAPH_CALLS
    calls = eager_calls + len(paths) + bursts      # the eager bursts' calls, a capture of each, the replays
    # bursts of GRAPH_CALLS calls of one candidate, warmed up first, then round r times each candidate's burst
    # once, in the round's order (the same on every rank); then each captured, in the candidates' order, and
    # the replays warmed up and timed likewise
    eager, graphs = ran[:eager_calls], ran[eager_calls:]
    assert eager == [path for path in eager[::GRAPH_CALLS] for _ in range(GRAPH_CALLS)] and len(ran) == calls
    assert eager[:warmup * GRAPH_CALLS:GRAPH_CALLS] == paths * MEASURE_WARMUP
    assert graphs[:len(paths)] == [f"capture {p}" for p in paths]
    assert graphs[len(paths):len(paths) + warmup] == [f"graph {p}" for p in paths] * MEASURE_WARMUP
    assert timed == eager[warmup * GRAPH_CALLS::GRAPH_CALLS] + graphs[len(paths) + warmup:] == [
        paths[i] for i in rounds] + [f"graph {paths[i]}" for i in rounds]
    choice = tp.choices[("ag_gemm", 16384, 8192, 4096)]
    assert choice["times_us"] == {"chunked": 30.0, "fused": 22.0, "never": 25.0} and choice["first_call_ms"] > 0
    # the graphs' choice is its own, by its replays' times over GRAPH_CALLS, on their slowest rank
    assert choice["graph_path"] == "chunked" and choice["graph_failed"] == {}
    assert choice["graph_times_us"] == {"chunked": 19.0, "fused": 21.0, "never": 20.0}
    assert tp.path("ag_gemm", 16384, 8192, 4096, ran.append) == "fused" and len(ran) == calls        # cached
    autotune.capturing = lambda cuda: True          # a call made while its stream is being captured
    assert tp.path("ag_gemm", 16384, 8192, 4096, ran.append) == "chunked" and len(ran) == calls
    with pytest.raises(RuntimeError, match="make one eager call of this shape first"):
        tp.path("gemm_rs", 8192, 8192, 4096, ran.append)      # a first call to time: not inside a capture
    assert ("gemm_rs", 8192, 8192, 4096) not in tp.choices and len(ran) == calls
    assert tp.path("gemm_rs", 4, 128, 128, ran.append) == "never" and len(ran) == calls            # untimed
    autotune.capturing = capturing

    # "chunked" cannot be captured on rank 1: left out of the graphs' choice on every rank, and never replayed
    failing["chunked"] = {1}
    before = len(ran)
    assert tp.path("gemm_rs", 16384, 8192, 4096, ran.append) == "fused"          # a new shape, timed eagerly as before
    assert len(ran) == before + calls - (MEASURE_WARMUP + MEASURE_ROUNDS)         # one graph fewer replayed
    choice = tp.choices[("gemm_rs", 16384, 8192, 4096)]
    assert choice["graph_path"] == "never" and choice["graph_times_us"] == {"fused": 21.0, "never": 20.0}
    assert choice["graph_failed"] == {"chunked": "failed: RuntimeError: chunked cannot be captured"
                                      + ("" if rank == 1 else " (rank 1)")}
    assert "graph chunked" not in ran[before:]
    # where "never" cannot be captured, nothing weighs the others: "never", untimed, nothing replayed
    failing["never"] = {0}
    before = len(ran)
    assert tp.path("gemm_ar", 16384, 8192, 4096, ran.append) == "fused"
    choice = tp.choices[("gemm_ar", 16384, 8192, 4096)]
    assert choice["graph_path"] == "never" and choice["graph_times_us"] == {}
    assert list(choice["graph_failed"]) == ["never"]
    assert not [call for call in ran[before:] if call.startswith("graph")]
    decisions = [None] * world
    dist.all_gather_object(decisions, {key: (c["path"], c["graph_path"], c["times_us"], c["graph_times_us"])
                                       for key, c in tp.choices.items()})
    assert all(d == decisions[0] for d in decisions), decisions

    shapes = len(ran)
    assert tp.path("ag_gemm", 4, 128, 128, ran.append) == "never" and len(ran) == shapes             # untimed
    untimed = tp.choices[("ag_gemm", 4, 128, 128)]
    assert untimed["path"] == untimed["graph_path"] == "never"
    assert untimed["times_us"] == untimed["graph_times_us"] == {}
    config.overlap = "chunked"
    assert tp.path("ag_gemm", 16384, 8192, 4096, ran.append) == "chunked" and len(ran) == shapes


def test_measured_choice_agrees_across_ranks_and_is_cached():
    run(_measured_choice_agrees_and_is_cached, 2)
