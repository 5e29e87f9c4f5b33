"""EPMoE: an expert-parallel MoE block, framework-free.

    layer = EPMoE(hidden=7168, intermediate=2048, num_experts=256, topk=8, router=my_router)
    y = layer(x)                                   # x [..., H]: route, dispatch, local experts, combine

Each rank holds only its experts (rank r: experts [r*E/W, (r+1)*E/W)) as gated MLPs in the layout
transformers uses: gate_up_proj [E_loc, 2*I, H] (gate rows first, then up), down_proj [E_loc, H, I].
The experts run as two masked grouped GEMMs over dispatch's expert-major rows, whose work follows
the received counts: the first writes packed rows, a kernel applies act(gate) * up to them, the
second writes the capacity layout combine reads. FP8 rows are dequantized as the GEMM loads them,
or, with fp8_experts=True, multiplied as they are by FP8 weights on FP8 tensor cores (and
act(gate) * up is quantized for the second GEMM's).

With ``elastic=True`` (nvshmem backend only) the layer's all-to-all goes on without a rank that stops
answering (EPAllToAll's elastic mode). What y then means, per token t:

    y[t] = sum over k with not lost[t, k] of topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t])   (+ shared experts)

the lost experts' terms left out, the other weights not scaled up to make up for them. ``layer.lost``
[T, K] says which experts each token lost; renormalizing by the weights left, routing again or dropping
the token is the caller's choice, and the layer makes none of them.

``moe_ep.integrations.transformers`` builds these layers from a transformers model's MoE blocks.
"""
from __future__ import annotations

import math
import warnings
from collections import OrderedDict

import torch
import torch.distributed as dist
from torch import nn

from .. import graphs, kernel_nodes, runtime
from ..ep import EPAllToAll, check_config
from ..graphs import Replay, Scratch
from ..kernels.grouped_gemm import ACTIVATIONS, DECODE_ROWS, WEIGHT_BLOCK, GatedMLP, gated_mlp
from ..kernels.quant import quantize_weights_fp8


MAX_PLANS = 8     # run_experts' plans a layer keeps (its all-to-all's two slots in two tile classes take four)
MAX_FORWARDS = 32  # eager forwards' graphs a layer keeps, the least recently used dropped (16 token counts)


class EPMoE(nn.Module):
    """Expert-parallel gated-MLP experts behind a router.

    The layer holds this rank's experts only: gate_up_proj [E_loc, 2I, H] and down_proj [E_loc, H, I],
    experts [first_expert, first_expert + experts_per_rank) of the E. They start as PyTorch initialises
    an nn.Linear's weight (``reset_parameters``: uniform in +-1/sqrt(fan_in), H for gate_up_proj and I for
    down_proj), drawn from this rank's torch RNG: a trained model's experts are loaded into them, this
    rank's slice of each (``gate_up[layer.first_expert:layer.first_expert + layer.experts_per_rank]``
    copied into ``layer.gate_up_proj``, or ``load_state_dict``), as ``swap_moe`` copies them from the block
    it replaces.

    The all-to-all (EPAllToAll, collective) is built at the first forward on the device the weights are
    on then; every rank must run every forward, with its own tokens (zero tokens too). Every option is
    checked here: a value EPAllToAll would refuse, or backend="nvshmem" in a process without a usable GPU
    or nvshmem4py, raises ValueError at construction (elastic=True with the reference backend: at the first
    forward).

    Args:
        hidden, intermediate: H and I of every expert.
        num_experts, topk: E (a multiple of the world size) and K.
        group: the process group the experts are spread over (default: the world).
        activation: "silu", "gelu", or a callable applied to the gate projection.
        router: module mapping tokens [T, H] to (logits, topk_weights [T, K], topk_ids [T, K]);
            without one, forward needs topk_ids and topk_weights.
        shared_experts: module mapping tokens [T, H] to an output added to the experts' sum.
        routed_scaling_factor: the experts' weighted sum is multiplied by it (applied to the weights).
        max_tokens: most tokens one forward may carry per rank.
        fp8_dispatch, fp8_group, backend: passed to EPAllToAll (backend "nvshmem": the NVSHMEM kernels on
            this process's GPU; "reference": torch.distributed collectives, on any device, CPU too). FP8
            dispatch quantizes each token in groups of fp8_group columns: keep tokens finite (an inf makes
            its whole group NaN).
        fp8_experts: run the experts on FP8 tensor cores: this rank's weights are quantized once, at
            the first forward (128 x 128 blocks, ``quantize_weights_fp8``; call ``quantize_experts()``
            again after changing them), FP8 rows from dispatch are used as they come, the
            intermediate is quantized per 128 columns as the second GEMM loads it. H and I must be
            multiples of 128.
        elastic: passed to EPAllToAll (nvshmem backend only; the reference backend refuses it at the first
            forward): the layer goes on without lost ranks, y leaves out their experts without
            renormalizing (see the module's docstring), and after each forward ``lost`` is its [T, K] bool
            report over the flattened tokens, valid until the forward after next (None unless elastic).
        replay: an eager forward on a GPU (nvshmem backend, not elastic) replays CUDA graphs of its launches
            (``moe_ep.graphs``): one host call where their Python takes longer than the kernels at decode
            sizes. The second forward of a token count on a slot of the all-to-all's buffers (and a stream)
            captures its dispatch, experts and combine as one graph, which later forwards replay after
            copying the tokens, ids and weights in (``MAX_FORWARDS`` such graphs a layer), up to the
            all-to-all's ``one_launch_tokens`` tokens (128, or what its measure_crossover() measured: where
            launches' host time outweighs the GPU's work); where a forward launches (its first, larger
            ones, and where no whole forward can be captured), the local experts' three launches are
            replayed from a graph of their own, captured at the second forward on the same buffers. What
            the graphs write lives in one allocation per GPU and stream, shared by every such
            layer and held while they live, as large as the largest layer's intermediates and output at
            capacity (E_loc x W * max_tokens rows: 86 MB at Qwen3-30B-A3B's shape on 4 ranks and
            max_tokens=128) and a forward's tokens, ids, weights and output; a layer whose buffers would take
            more than ``graphs.MAX_BYTES`` (1 GiB) launches. False launches everything at every forward. A
            forward captured by the caller (a CUDA graph of the model) launches either way. An out-of-range
            expert id in a replayed forward is reported under the number of the dispatch the graph captured.
        dtype, device: of the weights (and so of the tokens the layer takes).
    """

    def __init__(self, hidden: int, intermediate: int, num_experts: int, topk: int, group=None,
                 activation="silu", router: nn.Module | None = None, shared_experts: nn.Module | None = None,
                 routed_scaling_factor: float = 1.0,
                 max_tokens: int = 4096, fp8_dispatch: bool = True, fp8_group: int = 128, backend: str = "nvshmem",
                 fp8_experts: bool = False, elastic: bool = False, replay: bool = True,
                 dtype: torch.dtype = torch.bfloat16, device=None):
        super().__init__()
        world = dist.get_world_size(group)
        if isinstance(activation, str) and activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)} or a callable, got {activation!r}")
        if not callable(activation) and not isinstance(activation, str):
            raise ValueError(f"activation must be a name or a callable, got {type(activation).__name__}")
        if not isinstance(intermediate, int) or intermediate < 1:
            raise ValueError(f"intermediate must be a positive int, got {intermediate!r}")
        check_config(max_tokens, hidden, num_experts, topk, world, dtype, fp8_dispatch, fp8_group, backend)
        if backend == "nvshmem" and (unavailable := runtime.nvshmem_unavailable()):
            raise ValueError(f"backend='nvshmem' cannot run in this process: {unavailable}; use backend='reference' "
                             "(torch.distributed collectives, CPU too)")
        device = runtime.checked_device(device)
        self.hidden, self.intermediate, self.num_experts, self.topk = hidden, intermediate, num_experts, topk
        self.group, self.max_tokens, self.backend, self.elastic = group, max_tokens, backend, elastic
        self.replay = replay
        self.lost: torch.Tensor | None = None      # elastic: the last forward's [T, K] lost-expert report
        if fp8_experts and (hidden % WEIGHT_BLOCK.value or intermediate % WEIGHT_BLOCK.value):
            raise ValueError(f"fp8_experts needs hidden and intermediate multiples of {WEIGHT_BLOCK.value}, "
                             f"got {hidden} and {intermediate}")
        self.fp8_dispatch, self.fp8_group, self.fp8_experts = fp8_dispatch, fp8_group, fp8_experts
        self._fp8_weights: tuple | None = None     # (gate_up, its scales, down, its scales) once quantized
        self.experts_per_rank = num_experts // world
        self.first_expert = dist.get_rank(group) * self.experts_per_rank
        self.activation = ACTIVATIONS[activation] if isinstance(activation, str) else activation
        self._kernel_activation = _kernel_activation(activation)   # gated_activation's kernel; None: torch
        self.router, self.shared_experts, self.routed_scaling_factor = router, shared_experts, routed_scaling_factor
        self.gate_up_proj = nn.Parameter(torch.empty(self.experts_per_rank, 2 * intermediate, hidden,
                                                     dtype=dtype, device=device))
        self.down_proj = nn.Parameter(torch.empty(self.experts_per_rank, hidden, intermediate,
                                                  dtype=dtype, device=device))
        self._all_to_all: EPAllToAll | None = None
        self._plans: dict[tuple, _Planned] = {}    # run_experts' launches, by the operands they were planned on
        self._forwards: OrderedDict[tuple, _Forward] = OrderedDict()   # eager forwards' graphs, by _forward_key
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each expert's weights as nn.Linear initialises its weight (kaiming_uniform_ with a = sqrt(5)):
        uniform in [-1/sqrt(fan_in), 1/sqrt(fan_in)], fan_in = H for gate_up_proj and I for down_proj (the
        features each of their rows multiplies). nn.init's own fan_in of a 3-D tensor would count the
        expert dimension's neighbours too, so the bound is applied directly."""
        with torch.no_grad():
            for weight, fan_in in ((self.gate_up_proj, self.hidden), (self.down_proj, self.intermediate)):
                bound = 1 / math.sqrt(fan_in)
                weight.uniform_(-bound, bound)
        self._fp8_weights = None
        self._forwards.clear()                     # their graphs read the FP8 weights quantized before

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor | None = None,
                topk_weights: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., H] -> [..., H]; routes with the router unless topk_ids/topk_weights [T, K] are given."""
        if x.shape[-1] != self.hidden:
            raise ValueError(f"x has hidden size {x.shape[-1]}, this layer has {self.hidden}")
        if topk_ids is None and self.router is None:
            raise ValueError("this EPMoE has no router: pass topk_ids and topk_weights")
        tokens = x.reshape(-1, self.hidden).contiguous()
        return self._forward(tokens, topk_ids, topk_weights, self._ep()).reshape(x.shape)

    def _forward(self, tokens, topk_ids, topk_weights, ep: EPAllToAll, fp8_experts: bool | None = None):
        if topk_ids is None:
            _, topk_weights, topk_ids = self.router(tokens)
        if self.routed_scaling_factor != 1.0:
            topk_weights = topk_weights * self.routed_scaling_factor
        topk_ids, topk_weights = topk_ids.contiguous(), topk_weights.contiguous()
        key = None if fp8_experts is not None else self._forward_key(tokens, topk_ids, topk_weights, ep)
        forward = None if key is None else self._forwards.get(key)
        y = None if forward is None else forward(ep, tokens, topk_ids, topk_weights)
        if y is None:
            y, plan = self._launched(tokens, topk_ids, topk_weights, ep, fp8_experts)
            if key is not None and forward is None and plan is not None:
                self._forwards[key] = _Forward(plan)
                if len(self._forwards) > MAX_FORWARDS:
                    self._forwards.popitem(last=False)
        else:
            self._forwards.move_to_end(key)
        if self.shared_experts is not None:
            y = y + self.shared_experts(tokens)
        return y

    def _launched(self, tokens, topk_ids, topk_weights, ep: EPAllToAll, fp8_experts):
        """A forward's dispatch, experts and combine, launched (the experts replayed where they have a graph):
        (y, the experts' plan, or None where torch ran them)."""
        recv_x, recv_scales, recv_count, handle = ep.dispatch(tokens, topk_ids, topk_weights)
        rows_per_expert = tokens.shape[0] * ep.world * self.topk / self.num_experts   # expected, for the tile shapes
        plan = self._plan(recv_x, recv_scales, recv_count, rows_per_expert, fp8_experts)
        # A tensor of its own: the layer's output outlives the all-to-all's buffers (reused two calls later).
        expert_out = self._gated_mlp(recv_x, recv_scales, recv_count, rows_per_expert, fp8_experts) if plan is None \
            else plan(self.replay)
        y = ep.combine(expert_out, handle, out=torch.empty_like(tokens))
        self.lost = handle.lost
        return y, plan

    def _forward_key(self, tokens, topk_ids, topk_weights, ep: EPAllToAll) -> tuple | None:
        """What an eager forward's graph (``_Forward``) is captured for: the token count, the all-to-all's slots,
        the stream, the ids' and weights' dtypes and the experts' weights; None where the forward launches
        (replay off, elastic, the reference backend, more tokens than the all-to-all's ``one_launch_tokens``,
        inside a caller's capture, or a dispatch that would not pass its checks as it is: the launch's checks
        then say what is wrong). Above ``one_launch_tokens`` the GPU's work hides the launches' host time: at 4
        ranks and 2048 tokens the whole replay (its inputs and output then copied in and out) took 37-52 us more
        than launching with the experts replayed, at 128 tokens 26-88 us less (benchmarks/NOTES.md)."""
        if not self.replay or self.elastic or self.backend != "nvshmem" or tokens.shape[0] > ep.one_launch_tokens \
                or graphs.capturing(tokens.is_cuda):
            return None
        slots = ep.replay_slots(tokens, topk_ids, topk_weights)
        if slots is None:
            return None
        return (tokens.shape[0], slots, graphs.current_stream(tokens.device), topk_ids.dtype, topk_weights.dtype,
                self.fp8_experts, self.gate_up_proj.data_ptr(), self.down_proj.data_ptr())

    def run_experts(self, recv_x, recv_scales, recv_count, rows_per_expert: float | None = None,
                    fp8_experts: bool | None = None, kernels: bool | None = None) -> torch.Tensor:
        """The local gated MLPs on dispatch's layout: recv_x [E_loc, R, H] (FP8 with recv_scales
        [E_loc, R, H / fp8_group], or the weights' dtype), recv_count [E_loc] int32 -> [E_loc, R, H].

        Only rows below the counts are read or written (rows past them hold garbage combine never
        reads); the intermediate act(gate) * up is packed: [R * min(K, E_loc), I], the most rows
        dispatch can deliver. rows_per_expert (expected) picks the GEMM tile shapes; fp8_experts
        (default: the layer's) picks the FP8 weights; kernels (default: recv_x on CUDA) the grouped GEMM
        kernels over their plain-torch form (kernels.grouped_gemm.gated_mlp). The result is a tensor of its own.
        """
        return self._experts(recv_x, recv_scales, recv_count, rows_per_expert, fp8_experts, kernels)

    def _experts(self, recv_x, recv_scales, recv_count, rows_per_expert, fp8_experts, kernels=None) -> torch.Tensor:
        """run_experts: the kernels' plan launched, or gated_mlp where there is none."""
        plan = self._plan(recv_x, recv_scales, recv_count, rows_per_expert, fp8_experts, kernels)
        if plan is not None:
            return plan(False)
        return self._gated_mlp(recv_x, recv_scales, recv_count, rows_per_expert, fp8_experts, kernels)

    def _gated_mlp(self, recv_x, recv_scales, recv_count, rows_per_expert, fp8_experts, kernels=None) -> torch.Tensor:
        """The experts where they have no plan (``_plan``): kernels.grouped_gemm.gated_mlp, torch's form of them
        where `kernels` says so or the activation is one only torch applies."""
        gate_up, gate_up_scales, down, down_scales = self._expert_weights(fp8_experts)
        return gated_mlp(recv_x, gate_up, down, recv_count, recv_scales, self.fp8_group,
                         self._kernel_activation or self.activation, gate_up_scales, down_scales,
                         out_dtype=self.gate_up_proj.dtype, packed_rows=recv_x.shape[1] * min(self.topk, len(recv_x)),
                         rows_per_expert=rows_per_expert, kernels=kernels)

    def _expert_weights(self, fp8_experts) -> tuple:
        """(gate_up, its scales, down, its scales): the FP8 weights (quantized at the first use) with
        fp8_experts (default: the layer's), else the parameters and no scales."""
        if not (self.fp8_experts if fp8_experts is None else fp8_experts):
            return self.gate_up_proj, None, self.down_proj, None
        if self._fp8_weights is None or self._fp8_weights[0].device != self.gate_up_proj.device:
            self.quantize_experts()
        return self._fp8_weights

    def _plan(self, recv_x, recv_scales, recv_count, rows_per_expert, fp8_experts, kernels=None) -> _Planned | None:
        """The kernels planned on these operands (GatedMLP, made once per slot of the all-to-all's buffers and
        tile class: a forward's host time at decode sizes is mostly what gated_mlp would check and describe
        again); None where torch runs the experts (not on the kernels, or an activation only torch applies)."""
        if not (recv_x.is_cuda if kernels is None else kernels) or self._kernel_activation is None:
            return None
        gate_up, gate_up_scales, down, down_scales = self._expert_weights(fp8_experts)
        decode = (recv_x.shape[1] if rows_per_expert is None else rows_per_expert) <= DECODE_ROWS
        key = (recv_x.data_ptr(), recv_x.shape, recv_x.dtype, None if recv_scales is None else recv_scales.data_ptr(),
               recv_count.data_ptr(), gate_up.data_ptr(), down.data_ptr(), decode)
        plan = self._plans.get(key)
        if plan is None:                       # plans on other weights (replaced, moved) are dropped
            self._plans = {k: p for k, p in self._plans.items() if k[5:7] == key[5:7]}
            if len(self._plans) >= MAX_PLANS:
                self._plans.clear()
            packed_rows = recv_x.shape[1] * min(self.topk, len(recv_x))
            plan = self._plans[key] = _Planned(GatedMLP(recv_x, gate_up, down, recv_count, recv_scales, self.fp8_group,
                                                        self._kernel_activation, gate_up_scales, down_scales,
                                                        self.gate_up_proj.dtype, packed_rows, rows_per_expert))
        return plan

    def quantize_experts(self) -> tuple:
        """Quantize this rank's expert weights to FP8 (128 x 128 blocks) for fp8_experts; returns and
        keeps (gate_up [E_loc, 2I, H] fp8, its scales, down [E_loc, H, I] fp8, its scales)."""
        with torch.no_grad():
            self._fp8_weights = (*quantize_weights_fp8(self.gate_up_proj.detach(), WEIGHT_BLOCK.value),
                                 *quantize_weights_fp8(self.down_proj.detach(), WEIGHT_BLOCK.value))
        self._plans.clear()                        # they hold the weights they were planned on
        self._forwards.clear()
        return self._fp8_weights

    def destroy(self) -> None:
        """Free the layer's all-to-all (collective, as building it at the first forward was; idempotent).
        A later forward builds a new one."""
        self._plans.clear()                        # they hold views of the all-to-all's buffers
        self._forwards.clear()
        if self._all_to_all is not None:
            self._all_to_all.destroy()
            self._all_to_all = None

    def _ep(self) -> EPAllToAll:
        """The layer's all-to-all, built at the first forward on the device the weights are on then (a
        model swapped on the CPU and moved to its GPU afterwards gets it there). A reference one follows
        the weights when they move; an nvshmem one stays on this process's GPU."""
        device = self.gate_up_proj.device
        if self._all_to_all is None or (self.backend == "reference" and self._all_to_all.device != device):
            self._plans.clear()
            self._forwards.clear()
            self._all_to_all = EPAllToAll(self.max_tokens, self.hidden, self.num_experts, self.topk, group=self.group,
                                          dtype=self.gate_up_proj.dtype, fp8_dispatch=self.fp8_dispatch,
                                          fp8_group=self.fp8_group, backend=self.backend, device=device,
                                          elastic=self.elastic)
        return self._all_to_all


class _Planned:
    """run_experts' kernels on one set of operands (GatedMLP) and, for the layer's forwards, their CUDA graph on
    each stream (moe_ep.graphs.Replay): captured at the first call that may replay once the kernels have been
    launched (and so compiled and loaded, which a capture cannot do), and again when its stream's scratch was
    replaced by a larger one. Launched instead: inside a caller's own capture, where the buffers would take more
    than graphs.MAX_BYTES, and on a stream where a capture failed (with a warning)."""

    def __init__(self, mlp: GatedMLP):
        self.mlp, self.ran = mlp, False
        self.replays: dict[int, Replay | bool] = {}     # stream -> its graph, or False: launch there
        self.replayable = Scratch.size(mlp.made) <= graphs.MAX_BYTES

    def __call__(self, replay: bool) -> torch.Tensor:
        if replay and self.replayable and not graphs.capturing(True):
            stream = graphs.current_stream(self.mlp.device)
            graph = self.replays.get(stream)
            if graph is None or (graph is not False and not graph.current):
                graph = self.replays[stream] = self._capture(stream) if self.ran else None
            if graph:
                return graph()[-1]
        self.ran = True
        return self.mlp()

    def _capture(self, stream: int) -> Replay | bool:
        try:
            return Replay(self.mlp.launch, self.mlp.made, self.mlp.device, stream)
        except RuntimeError as e:    # a capture CUDA refused, or no memory for the scratch: launch, and go on
            _not_captured("the experts' CUDA graph", e, "they are launched at every forward on this stream")
            return False


class _Forward:
    """The eager forwards of one ``EPMoE._forward_key`` (a token count, a pair of the all-to-all's slots, a
    stream): the plan of the experts that ran at the first, which launched; from the second on, the dispatch,
    those experts and the combine captured as one CUDA graph (moe_ep.graphs.Replay) on the forward's tokens,
    ids, weights and output, the experts' buffers carved from the stream's scratch as their own graph's. A
    call points the graph's kernels at its own tokens, ids and weights and at a new output, and replays: no
    copy in or out, and one launch, the graph's (each launch is host time before the GPU starts, 15-25 us on
    the GPU machines: benchmarks/NOTES.md). None where the forward must launch: operands not 16-byte aligned
    (the graph's kernels were compiled for aligned ones), the experts' buffers past graphs.MAX_BYTES, or a
    graph that could not be captured or pointed elsewhere (with a warning, once). Captured again when its
    stream's scratch was replaced by a larger one."""

    def __init__(self, plan: _Planned):
        self.plan = plan
        self.graph: Replay | bool | None = None      # None: not captured yet; False: launch

    def __call__(self, ep: EPAllToAll, tokens, topk_ids, topk_weights) -> torch.Tensor | None:
        graph = self.graph
        if graph is False or not kernel_nodes.aligned((tokens, topk_ids, topk_weights)):
            return None
        operands = (tokens, topk_ids, topk_weights, torch.empty_like(tokens))
        captured = graph is None or not graph.current
        if captured:
            graph = self.graph = self._capture(ep, operands)    # the capture counts the calls it records
            if not graph:
                return None
        graph(*operands)
        if not captured:
            ep.replayed()
        return operands[-1]

    def _capture(self, ep: EPAllToAll, operands) -> Replay | bool:
        mlp = self.plan.mlp
        if not self.plan.replayable:
            return False

        def launch(x, ids, weights, out, *experts):
            *_, handle = ep.dispatch(x, ids, weights)       # into the slot's buffers, which the plan was made on
            ep.combine(mlp.launch(*experts), handle, out=out)

        calls = ep.calls
        try:
            return Replay(launch, mlp.made, operands[0].device, graphs.current_stream(operands[0].device), operands)
        except (RuntimeError, ValueError) as e:    # as _Planned's; the calls the capture counted never ran
            ep.rewind(calls)
            _not_captured(f"the CUDA graph of a forward of {operands[0].shape[0]} tokens", e,
                          "those forwards launch on this stream")
            return False


def _not_captured(what: str, error: Exception, then: str) -> None:
    """Warn that `what` could not be captured (the first line of `error`) and what happens `then`."""
    first_line = (str(error).splitlines() or [""])[0]
    warnings.warn(f"EPMoE: {what} could not be captured ({type(error).__name__}: {first_line}); {then}",
                  RuntimeWarning, stacklevel=5)


def _kernel_activation(activation) -> str | None:
    """The kernels' name for `activation` ("silu", "gelu"), or None if only torch can apply it."""
    if isinstance(activation, str):
        return activation
    silu = activation is nn.functional.silu or isinstance(activation, nn.SiLU) \
        or type(activation).__name__ == "SiLUActivation"                       # transformers' SiLU
    gelu = activation is nn.functional.gelu or (isinstance(activation, nn.GELU) and activation.approximate == "none") \
        or type(activation).__name__ == "GELUActivation"                       # transformers' exact GELU
    return "silu" if silu else "gelu" if gelu else None
