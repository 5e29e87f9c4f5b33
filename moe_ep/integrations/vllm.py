"""vLLM: moe_ep's dispatch/combine as a prepare/finalize of vLLM's modular MoE kernel.

    prepare_finalize = make_prepare_finalize(moe_config, quant_config, group=ep_group)
    kernel = FusedMoEKernel(prepare_finalize, GroupedGemmExperts(moe_config, quant_config, ...))
    out = kernel.apply(hidden_states, w13, w2, topk_weights, topk_ids, ...)

or, serving a model: ``vllm serve MODEL --enable-expert-parallel --data-parallel-size N --all2all-backend
moe_ep`` with moe_ep installed into vLLM's environment (``pip install --no-deps -e .``): the
``vllm.general_plugins`` entry point runs ``register()`` in every vLLM process. Then every MoE layer
vLLM builds (FusedMoEFactory: its quantization method, the kernel oracle, FusedMoEKernel) gets a
MoeEpPrepareAndFinalize over the EPAllToAll of its shape on vLLM's EP group, with the backend
BACKEND_VARIABLE names ("nvshmem" unless set; "reference": torch.distributed, for checking), and the
experts vLLM's oracle picks for the batched format.

The layout is vLLM's "batched experts" format, which is EPAllToAll's: prepare returns
recv_x [E_loc, W * max_tokens, H] (FP8 e4m3 with fp32 scales [E_loc, W * max_tokens, H / 128], payload
"fp8", when the quantization config asks for activations in 128-wide blocks, the activations' dtype
otherwise) and the per-expert counts (recv_count). Experts that take packed UE8M0 activation scales
(``supports_packed_ue8m0_act_scales()``: DeepGEMM on Blackwell) get payload "fp8_ue8m0" instead, as DeepEP's
low-latency prepare/finalize gives them use_ue8m0: the scales are int32 [E_loc, W * max_tokens, H / 512], four
power-of-two scales packed in each, MN-major (strides (W * max_tokens * H / 512, 1, W * max_tokens)), and H a
multiple of 512; finalize combines the experts' output into
vLLM's output tensor, applying the router weights on the way. Prepare and finalize both have an
async form (the receive runs in the returned hook), and each of vLLM's two micro-batches keeps its
own dispatch handle; under dual-batch overlap finalize first runs the receive hook the other
micro-batch left pending (vLLM's contract, as DeepEP's low-latency prepare/finalize keeps it).
The plugin pads a layer's hidden size to a multiple of 128 (FP8_BLOCK), as vLLM pads it for DeepEP,
so FP8 dispatch takes any hidden size (2880 -> 2944); vLLM pads the weights and activations.

What it cannot honour raises ValueError when the engine builds it: expert placements other than
rank r holding experts [r * E_loc, (r + 1) * E_loc) (EPLB, round-robin), packed UE8M0 scales over a hidden
size that is not a multiple of 512, activation quantization other than 128-wide FP8 blocks (the error names
the format asked for: "mxfp8", "nvfp4", ...), monolithic experts, an unquantized input dtype
other than the layer's, an all-to-all whose payload needs a per-tensor scale ("nvfp4", handed to
MoeEpPrepareAndFinalize: prepare does not carry one through yet), and apply_router_weight_on_input with
top-k > 1; finalize refuses router weights other than those its prepare sent (the combine applies those on
the experts' ranks).

Elastic mode (EPAllToAll's ``elastic=True``: a rank that stops answering is masked and the others' calls
complete without its experts): ``make_prepare_finalize(..., elastic=True)`` builds the all-to-all so, and
the prepare/finalize offers ``live_ranks()``, ``mask_ranks(ranks)`` and ``lost(micro_batch)``, each
micro-batch's [T, K] report of the experts its last finalize went without. vLLM's modular kernel has no
place for that report: an engine wrapper reads it there. vLLM's place for a rank mask is its fault
tolerance (``--enable-fault-tolerance``): the EP group's all2all manager answers ``query_active_mask`` and
``query_fault``, which the model runner polls with each step's output (under async scheduling); on a
fault vLLM aborts the running requests and waits for a ``retry``. With that option the plugin builds
every layer's all-to-all elastic (nvshmem backend only), makes its manager a MoeEpAll2AllManager, which
answers those queries from the all-to-alls' live masks, and adds moe_ep to the backends vLLM's fault
tolerance accepts. A retry after a lost rank is refused (clean_buffers raises): vLLM's retry resumes with
every rank, and NVSHMEM cannot take a rank back into the job it started with.

Written against vLLM 0.33.0 (VLLM_VERSION); PATCH_POINTS names every engine attribute the plugin replaces.
"""
from __future__ import annotations

import importlib
import inspect
import os
from collections.abc import Callable

import torch
import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.distributed.device_communicators.all2all import AgRsAll2AllManager
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig, FusedMoEQuantConfig
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceDelegate
from vllm.v1.worker.ubatching import dbo_current_ubatch_id, dbo_maybe_run_recv_hook

from ..ep import EPAllToAll
from ..kernels.grouped_gemm import gated_mlp
from ..formats import FORMATS, PayloadFormat
from . import FP8_BLOCK, all_to_all, check_local_experts, elastic_all_to_alls, live_mask, mn_major

VLLM_VERSION = "0.33.0"
BACKEND_NAME = "moe_ep"            # the value of --all2all-backend
BACKEND_VARIABLE = "MOE_EP_VLLM_BACKEND"   # the EPAllToAll backend of the layers vLLM builds (default nvshmem)
MICRO_BATCHES = 2                  # vLLM's dual-batch overlap runs two micro-batches, each with its own handle
_FUSED_MOE = "vllm.model_executor.layers.fused_moe"
# Where vLLM decides on the all-to-all backend and what follows from it, as ("module:attribute", the vLLM
# version it was read from); register() wraps each. vLLM has no registry of all-to-all backends to use instead.
PATCH_POINTS = {
    "backend names": ("vllm.config.parallel:ParallelConfig.all2all_backend", "0.33.0"),   # a Literal of names
    "communicator": ("vllm.distributed.device_communicators.cuda_communicator:CudaCommunicator.__init__",
                     "0.33.0"),
    "batched format": (f"{_FUSED_MOE}.config:FusedMoEParallelConfig.use_batched_activation_format", "0.33.0"),
    "hidden size": (f"{_FUSED_MOE}.all2all_utils:maybe_roundup_layer_hidden_size", "0.33.0"),
    "prepare/finalize": (f"{_FUSED_MOE}.all2all_utils:maybe_make_prepare_finalize", "0.33.0"),
    "fault-tolerant backends": ("vllm.v1.worker.sentinel.gpu_worker_sentinel:FT_BACKEND_SET", "0.33.0"),
}
# The modules that import maybe_make_prepare_finalize by name (in vLLM 0.33.0): their copy is replaced too.
PREPARE_FINALIZE_USERS = tuple(f"vllm.model_executor.layers.{m}" for m in (
    "fused_moe.eep_reconfigure", "fused_moe.oracle.unquantized", "fused_moe.oracle.fp8", "fused_moe.oracle.int8",
    "fused_moe.oracle.nvfp4", "fused_moe.oracle.mxfp4", "fused_moe.oracle.w4a8", "fused_moe.oracle.w4a8_int8",
    "quantization.modelopt_block_quant", "quantization.utils.humming.moe"))

def dispatch_payload(quant_config: FusedMoEQuantConfig | None) -> str | None:
    """The payload format dispatch sends for the experts of `quant_config`: "fp8" when they take FP8 e4m3
    activations in 1 x 128 blocks (post_init_setup makes it "fp8_ue8m0", before the all-to-all is built, for
    experts that take the scales packed); None for unquantized activations (the layer's dtype); ValueError
    naming the format asked for otherwise ("mxfp8", "nvfp4", FP8 per token or per tensor, int8, ...)."""
    if quant_config is None or quant_config.quant_dtype is None:
        return None
    dtype, block = quant_config.quant_dtype, quant_config.block_shape
    if dtype == torch.float8_e4m3fn and block is not None and block[1] == FP8_BLOCK:
        return "fp8"
    asked = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    raise ValueError(f"moe_ep dispatches unquantized activations or FP8 e4m3 in blocks of {FP8_BLOCK} ('fp8', "
                     f"'fp8_ue8m0'); the quantization config asks for {asked!r} activations with block shape "
                     f"{block}")


def make_prepare_finalize(moe: FusedMoEConfig, quant_config: FusedMoEQuantConfig | None,
                          routing_tables=None, group=None, backend: str = "nvshmem",
                          placement: str = "linear", input_dtype: torch.dtype | None = None,
                          use_monolithic: bool = False, elastic: bool = False) -> MoeEpPrepareAndFinalize:
    """The prepare/finalize of one vLLM MoE layer over the EPAllToAll of its shape on `group` (the
    engine's EP group), elastic when `elastic` (nvshmem backend only), of the payload post_init_setup settles
    once vLLM has chosen the experts, built then (or at first use). input_dtype (vLLM's factory
    argument: the all-to-all carries unquantized activations of that dtype, the experts quantize) must be
    the layer's dtype. routing_tables (EPLB's physical/logical maps), a placement other than "linear" and
    monolithic experts are refused."""
    parallel = moe.moe_parallel_config
    if routing_tables is not None or parallel.enable_eplb:
        raise ValueError("moe_ep does not support EPLB (expert load balancing): rank r holds experts "
                         "[r * E_loc, (r + 1) * E_loc); run without --enable-eplb")
    if placement != "linear":
        raise ValueError(f"moe_ep supports the linear expert placement only, got {placement!r} "
                         "(--expert-placement-strategy linear)")
    if use_monolithic:
        raise ValueError("moe_ep's prepare/finalize feeds modular experts; the MoE backend vLLM chose has "
                         "monolithic experts only: pick another with --moe-backend")
    if input_dtype is not None and input_dtype != moe.in_dtype:
        raise ValueError(f"moe_ep dispatches the layer's activations ({moe.in_dtype}) unquantized or in FP8; "
                         f"these experts ask for {input_dtype}")
    check_local_experts(moe.num_experts, moe.num_local_experts, group)
    payload = dispatch_payload(quant_config) if input_dtype is None else None

    def of_payload(payload: str | None) -> EPAllToAll:
        return all_to_all(moe.max_num_tokens, moe.hidden_dim, moe.num_experts, moe.experts_per_token,
                          moe.in_dtype, group=group, backend=backend, elastic=elastic, payload=payload)
    return MoeEpPrepareAndFinalize(of_payload=of_payload, payload=payload, moe=moe)


class MoeEpPrepareAndFinalize(mk.FusedMoEPrepareAndFinalizeModular):
    """vLLM's prepare/finalize over one EPAllToAll (batched experts format, output reduced).

    prepare: a1 [T, H], topk_ids / topk_weights [T, K] -> (recv_x [E_loc, W * T_max, H], recv_scales
    [E_loc, W * T_max, H / 128] fp32 ("fp8"), [E_loc, W * T_max, H / 512] int32 MN-major ("fp8_ue8m0": a copy,
    integrations.mn_major) or None, ExpertTokensMetadata(recv_count [E_loc] int32), None, None).
    finalize: the experts' output [E_loc, W * T_max, H] -> output [T, H], written in place: the sum over
    k of topk_weights[t, k] times the row of (t, k), in fp32. The dispatch outputs stay valid until the
    dispatch after next, so both micro-batches' can be in use at once.
    Over an elastic EPAllToAll the sum leaves out the experts of lost ranks, without renormalizing: lost()
    says which, live_ranks() and mask_ranks() are the all-to-all's.
    Over `ep`, or over of_payload(payload): the all-to-all of this layer's shape (that of `moe`) dispatching a
    payload format (make_prepare_finalize's, by name), built by post_init_setup once the experts are chosen (or
    at first use), so that a layer builds only the one it dispatches over: "fp8_ue8m0" for experts that want
    packed UE8M0 scales. Without of_payload such experts are refused. A payload with a per-tensor scale
    ("nvfp4") is refused here: prepare passes dispatch no tensor_scale.
    """

    def __init__(self, ep: EPAllToAll | None = None, of_payload: Callable[[str | None], EPAllToAll] | None = None,
                 payload: str | None = None, moe: FusedMoEConfig | None = None):
        super().__init__()
        if ep is None and (of_payload is None or moe is None):
            raise ValueError("MoeEpPrepareAndFinalize takes an EPAllToAll, or of_payload and the layer's moe config")
        self._ep = ep
        self.of_payload = of_payload
        _check_carried(FORMATS.get(payload) if ep is None else ep.payload)
        if ep is not None:                          # the format's name; None: the layer's dtype, unquantized
            payload = ep.payload.name if ep.payload.group else None
        self.payload = payload
        self.max_tokens, self.hidden, self.world = ((moe.max_num_tokens, moe.hidden_dim,
                                                     moe.num_experts // moe.num_local_experts) if ep is None else
                                                    (ep.max_tokens, ep.hidden, ep.world))
        self.handles = [None] * MICRO_BATCHES
        self.weights = [None] * MICRO_BATCHES       # the router weights each micro-batch's prepare sent
        self._checked_maps: set[int] = set()        # data_ptr of expert maps found linear

    @property
    def ep(self) -> EPAllToAll:
        """The EPAllToAll this layer dispatches over (built on first use when the constructor had none)."""
        return self._build()

    @ep.setter
    def ep(self, ep: EPAllToAll) -> None:
        _check_carried(ep.payload)
        self._ep = ep

    @property
    def activation_format(self) -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.BatchedExperts

    def topk_indices_dtype(self) -> torch.dtype | None:
        return None                                 # int32 and int64 both dispatch as they are

    def max_num_tokens_per_rank(self) -> int | None:
        return self.max_tokens                      # asked before post_init_setup: builds nothing

    def num_dispatchers(self) -> int:
        return self.world

    def output_is_reduced(self) -> bool:
        return True

    def supports_async(self) -> bool:
        return True

    def live_ranks(self) -> list[int]:
        """The ranks the all-to-all counts live (a sync: EPAllToAll.live_ranks)."""
        return self.ep.live_ranks()

    def mask_ranks(self, ranks) -> None:
        """Count `ranks` dead in this layer shape's all-to-all from its next call on (elastic; collective over
        the survivors, between the same two calls: EPAllToAll.mask_ranks)."""
        self.ep.mask_ranks(ranks)

    def lost(self, micro_batch: int = 0) -> torch.Tensor | None:
        """[T, K] bool of `micro_batch`'s last prepare: True where expert k of token t was on a rank its
        finalize went without, whose contribution is missing from the output. Valid once that finalize's
        hook ran, until the all-to-all's dispatch after next (the layers of one shape share it: read it
        before the next layer's prepare). None unless elastic, or before any prepare."""
        handle = self.handles[micro_batch]
        return None if handle is None else handle.lost

    def post_init_setup(self, fused_experts: mk.FusedMoEExperts) -> None:
        """vLLM's hook once the experts are chosen: settles the payload and builds the all-to-all of this layer's
        shape and payload (collective; shared with the layers of the same, as integrations.all_to_all makes
        them). Over payload "fp8", experts that want packed UE8M0 activation scales
        (supports_packed_ue8m0_act_scales) get payload "fp8_ue8m0" instead; no "fp8" all-to-all is built for
        them. ValueError naming "fp8_ue8m0" where it cannot: no of_payload, or H not a multiple of 512."""
        if self.payload == "fp8" and fused_experts.supports_packed_ue8m0_act_scales():
            wants = f"{type(fused_experts).__name__} wants packed UE8M0 activation scales (payload 'fp8_ue8m0')"
            if self.of_payload is None:
                raise ValueError(f"{wants}; this prepare/finalize has its 'fp8' all-to-all only: build it with "
                                 "make_prepare_finalize")
            try:
                FORMATS["fp8_ue8m0"].check_hidden(self.hidden)
            except ValueError as error:
                raise ValueError(f"{wants}: {error} (four scales of 128 columns per int32)") from None
            self.payload, self._ep = "fp8_ue8m0", None
        self._build()                               # while vLLM builds the model, not in its first forward

    def _build(self) -> EPAllToAll:
        """The all-to-all of this layer's shape and payload: of_payload(payload), built now (collective, shared
        per shape and payload: integrations.all_to_all) unless it is already."""
        if self._ep is None:
            self._ep = self.of_payload(self.payload)
        return self._ep

    def prepare_async(self, a1: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                      expert_map: torch.Tensor | None, apply_router_weight_on_input: bool,
                      quant_config: FusedMoEQuantConfig, defer_input_quant: bool = False
                      ) -> tuple[Callable, mk.ReceiverType]:
        """Issue the dispatch; returns (hook, receiver): the hook receives, the receiver returns prepare's tuple."""
        if defer_input_quant and self.ep.fp8_group:
            raise ValueError("moe_ep quantizes in the dispatch: experts that quantize their inputs themselves "
                             "(defer_input_quant) need the layer built with their input_dtype")
        if num_experts != self.ep.num_experts:
            raise ValueError(f"this layer has {num_experts} experts, its EPAllToAll {self.ep.num_experts}")
        if expert_map is not None:
            self._check_expert_map(expert_map)
        micro_batch = dbo_current_ubatch_id()
        self.weights[micro_batch] = topk_weights
        if apply_router_weight_on_input:
            if topk_ids.shape[1] != 1:
                raise ValueError(f"apply_router_weight_on_input needs top-k 1 (a token is sent once per rank, "
                                 f"not once per expert), got top-k {topk_ids.shape[1]}")
            a1 = a1 * topk_weights.to(a1.dtype)
            topk_weights = torch.ones_like(topk_weights)
        recv_x, recv_scales, recv_count, handle, hook = self.ep.dispatch(
            a1.contiguous(), topk_ids.contiguous(), topk_weights.contiguous(), return_recv_hook=True)
        self.handles[micro_batch] = handle
        meta = mk.ExpertTokensMetadata(expert_num_tokens=recv_count, expert_num_tokens_cpu=None)
        if self.ep.payload.name == "fp8_ue8m0":          # DeepGEMM takes packed scales MN-major (after the hook)
            return hook, lambda: (recv_x, mn_major(recv_scales), meta, None, None)
        return hook, lambda: (recv_x, recv_scales, meta, None, None)

    def prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map, apply_router_weight_on_input,
                quant_config, defer_input_quant: bool = False) -> mk.PrepareResultType:
        hook, receiver = self.prepare_async(a1, topk_weights, topk_ids, num_experts, expert_map,
                                            apply_router_weight_on_input, quant_config, defer_input_quant)
        hook()
        return receiver()

    def finalize_async(self, output: torch.Tensor, fused_expert_output: torch.Tensor, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor, apply_router_weight_on_input: bool,
                       weight_and_reduce_impl: mk.TopKWeightAndReduce) -> tuple[Callable, Callable]:
        """Run the receive hook the other micro-batch left pending (dual-batch overlap), then issue the
        combine into `output`; returns (hook, receiver): output is valid after the hook. topk_weights
        must be those given to prepare (the combine applies them where the experts ran; ones with
        apply_router_weight_on_input): ValueError otherwise."""
        if not isinstance(weight_and_reduce_impl, TopKWeightAndReduceDelegate):
            raise ValueError(f"moe_ep applies the router weights in the combine; experts that reduce themselves "
                             f"({type(weight_and_reduce_impl).__name__}) are not supported")
        micro_batch = dbo_current_ubatch_id()
        handle, sent = self.handles[micro_batch], self.weights[micro_batch]
        if handle is None:
            raise ValueError("finalize without a prepare on this micro-batch")
        if topk_weights is not sent and not torch.equal(topk_weights, sent):
            raise ValueError("finalize's topk_weights differ from those its prepare sent; moe_ep's combine "
                             "applies the prepare's on the experts' ranks, before the sums return")
        dbo_maybe_run_recv_hook()
        _, hook = self.ep.combine(fused_expert_output, handle, return_recv_hook=True, out=output)
        return hook, _nothing

    def finalize(self, output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input,
                 weight_and_reduce_impl) -> None:
        hook, _ = self.finalize_async(output, fused_expert_output, topk_weights, topk_ids,
                                      apply_router_weight_on_input, weight_and_reduce_impl)
        hook()

    def _check_expert_map(self, expert_map: torch.Tensor) -> None:
        """ValueError unless expert_map [E] (global id -> local id, -1 elsewhere) is the linear placement."""
        if expert_map.data_ptr() in self._checked_maps:
            return
        ep = self.ep
        linear = torch.full((ep.num_experts,), -1, dtype=expert_map.dtype, device=expert_map.device)
        first = ep.rank * ep.experts_per_rank
        linear[first:first + ep.experts_per_rank] = torch.arange(ep.experts_per_rank, device=expert_map.device,
                                                                 dtype=expert_map.dtype)
        if not torch.equal(expert_map, linear):
            raise ValueError(f"moe_ep needs rank {ep.rank} to hold experts [{first}, {first + ep.experts_per_rank}) "
                             f"in order; this expert map places others (EPLB or round-robin placement)")
        self._checked_maps.add(expert_map.data_ptr())


def _check_carried(fmt: PayloadFormat | None) -> None:
    """ValueError for a payload format whose dispatch takes a per-tensor scale per call (tensor_scale: "nvfp4"),
    which prepare does not pass yet; None (a name FORMATS lacks) passes, for EPAllToAll to judge."""
    if fmt is not None and fmt.tensor_scale:
        raise ValueError(f"payload format {fmt.name!r} needs a per-tensor scale at each dispatch (tensor_scale), "
                         "which moe_ep does not carry through vLLM's prepare yet")


def _nothing() -> None:
    """finalize_async's receiver: the combine's hook already wrote the output."""


class GroupedGemmExperts(mk.FusedMoEExpertsModular):
    """Gated-MLP experts on the batched format as two masked grouped GEMMs (moe_ep.kernels.grouped_gemm's
    gated_mlp: the kernels on CUDA, their plain-torch reference elsewhere): w1 [E_loc, 2I, H] (gate rows,
    then up), w2 [E_loc, H, I], unquantized; rows are FP8 with per-128 scales or the activations' dtype.
    Only rows below the counts are computed; act(gate) * up (silu, gelu) by a kernel between the GEMMs."""

    ACTIVATIONS = {MoEActivation.SILU: "silu", MoEActivation.GELU: "gelu"}

    @staticmethod
    def activation_format() -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.BatchedExperts

    @staticmethod
    def _supports_current_device() -> bool:
        return True

    @staticmethod
    def _supports_no_act_and_mul() -> bool:
        return False

    @staticmethod
    def _supports_quant_scheme(weight_key, activation_key) -> bool:
        return weight_key is None

    @staticmethod
    def _supports_activation(activation: MoEActivation) -> bool:
        return activation in GroupedGemmExperts.ACTIVATIONS

    @staticmethod
    def _supports_parallel_config(moe_parallel_config) -> bool:
        return True

    def finalize_weight_and_reduce_impl(self) -> mk.TopKWeightAndReduce:
        return TopKWeightAndReduceDelegate()

    def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta,
                         activation) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        return (0,), (0,), (local_num_experts, M, K)          # the GEMMs allocate their own intermediate

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input) -> None:
        if activation not in self.ACTIVATIONS:
            raise ValueError(f"GroupedGemmExperts supports {[a.value for a in self.ACTIVATIONS]}, got {activation}")
        gated_mlp(hidden_states, w1, w2, expert_tokens_meta.expert_num_tokens, a1q_scale, FP8_BLOCK,
                  self.ACTIVATIONS[activation], out=output)


# ------------------------------------------------------------------------------------ the plugin

def register() -> None:
    """The ``vllm.general_plugins`` entry point: makes ``--all2all-backend moe_ep`` a backend of the
    running vLLM by wrapping the PATCH_POINTS (idempotent: vLLM may load plugins more than once)."""
    from vllm.config import parallel
    if BACKEND_NAME in _backend_names(parallel.ParallelConfig):
        return
    _accept_backend_name(parallel.ParallelConfig)
    _wrap_communicator()
    _wrap_batched_format()
    _wrap_hidden_size()
    _wrap_prepare_finalize_factory()
    _accept_fault_tolerance()


def _backend_names(config_class) -> tuple[str, ...]:
    return getattr(config_class.__dataclass_fields__["all2all_backend"].type, "__args__", ())


def _accept_backend_name(config_class) -> None:
    """Add BACKEND_NAME to the Literal of ParallelConfig.all2all_backend and rebuild its validator (the
    command line's choices are read from the same Literal)."""
    from typing import Literal

    import pydantic
    names = Literal[(*_backend_names(config_class), BACKEND_NAME)]
    config_class.__annotations__["all2all_backend"] = names
    config_class.__dataclass_fields__["all2all_backend"].type = names
    pydantic.dataclasses.rebuild_dataclass(config_class, force=True)


def _wrap_communicator() -> None:
    """CudaCommunicator builds an all-to-all manager per backend name and refuses unknown names: for
    moe_ep it builds the all-gather/reduce-scatter one (used outside the MoE layers), then records moe_ep;
    under --enable-fault-tolerance the manager is a MoeEpAll2AllManager."""
    from vllm.distributed.device_communicators import cuda_communicator
    original = cuda_communicator.CudaCommunicator.__init__

    def __init__(self, *args, **kwargs):
        from vllm.config import get_current_vllm_config
        parallel = get_current_vllm_config().parallel_config
        if parallel.all2all_backend != BACKEND_NAME:
            return original(self, *args, **kwargs)
        object.__setattr__(parallel, "all2all_backend", "allgather_reducescatter")
        try:
            original(self, *args, **kwargs)
        finally:
            object.__setattr__(parallel, "all2all_backend", BACKEND_NAME)
        self.all2all_backend = BACKEND_NAME
        if self.all2all_manager is not None and parallel.enable_fault_tolerance:
            arguments = inspect.signature(original).bind(self, *args, **kwargs).arguments
            self.all2all_manager = MoeEpAll2AllManager(self.cpu_group, arguments.get("tcp_store_group"))
    cuda_communicator.CudaCommunicator.__init__ = __init__


def _uses_moe_ep(parallel) -> bool:
    """True for a layer's FusedMoEParallelConfig that runs expert-parallel all-to-all over moe_ep."""
    return parallel.all2all_backend == BACKEND_NAME and parallel.use_all2all_kernels


def _wrap_batched_format() -> None:
    """vLLM's kernel oracles pick experts for the batched format where use_batched_activation_format
    holds (DeepEP low-latency and NIXL EP in vLLM 0.33.0): it holds for moe_ep layers too."""
    from vllm.model_executor.layers.fused_moe.config import FusedMoEParallelConfig
    original = FusedMoEParallelConfig.use_batched_activation_format

    def use_batched_activation_format(self) -> bool:
        return _uses_moe_ep(self) or original.fget(self)
    FusedMoEParallelConfig.use_batched_activation_format = property(use_batched_activation_format)


def _wrap_hidden_size() -> None:
    """maybe_roundup_layer_hidden_size pads a moe_ep layer's hidden size to a multiple of FP8_BLOCK, which
    FP8 dispatch needs (vLLM pads the weights and activations to it, as for DeepEP)."""
    from vllm.model_executor.layers.fused_moe import all2all_utils
    original = all2all_utils.maybe_roundup_layer_hidden_size

    def maybe_roundup_layer_hidden_size(hidden_size, act_dtype, moe_parallel_config):
        if _uses_moe_ep(moe_parallel_config):
            return -(-hidden_size // FP8_BLOCK) * FP8_BLOCK
        return original(hidden_size, act_dtype, moe_parallel_config)
    all2all_utils.maybe_roundup_layer_hidden_size = maybe_roundup_layer_hidden_size


def _wrap_prepare_finalize_factory() -> None:
    """maybe_make_prepare_finalize returns MoeEpPrepareAndFinalize for moe_ep layers that run expert
    parallel all-to-all, on vLLM's EP group, elastic under --enable-fault-tolerance; other layers and
    backends go to vLLM's own."""
    from vllm.model_executor.layers.fused_moe import all2all_utils
    original = all2all_utils.maybe_make_prepare_finalize

    def maybe_make_prepare_finalize(moe, quant_config, routing_tables=None, allow_new_interface=False,
                                    use_monolithic=False, all2all_manager=None, input_dtype=None):
        if not _uses_moe_ep(moe.moe_parallel_config):
            return original(moe, quant_config, routing_tables, allow_new_interface, use_monolithic,
                            all2all_manager, input_dtype)
        from vllm.config import get_current_vllm_config
        from vllm.distributed import get_ep_group
        parallel = get_current_vllm_config().parallel_config
        backend = os.environ.get(BACKEND_VARIABLE, "nvshmem")
        if parallel.enable_fault_tolerance and backend != "nvshmem":
            raise ValueError(f"--enable-fault-tolerance needs moe_ep's elastic all-to-all, which only the nvshmem "
                             f"backend has; {BACKEND_VARIABLE} names {backend!r}")
        return make_prepare_finalize(moe, quant_config, routing_tables, group=get_ep_group().device_group,
                                     backend=backend, placement=parallel.expert_placement_strategy,
                                     input_dtype=input_dtype, use_monolithic=use_monolithic,
                                     elastic=parallel.enable_fault_tolerance)
    for name in (all2all_utils.__name__, *PREPARE_FINALIZE_USERS):
        module = importlib.import_module(name)
        if getattr(module, "maybe_make_prepare_finalize", None) is original:
            module.maybe_make_prepare_finalize = maybe_make_prepare_finalize


def _accept_fault_tolerance() -> None:
    """vLLM's fault tolerance refuses all2all backends outside FT_BACKEND_SET (those whose kernels mask a
    rank that times out): moe_ep's elastic all-to-alls do, so the set takes BACKEND_NAME."""
    from vllm.v1.worker.sentinel import gpu_worker_sentinel
    gpu_worker_sentinel.FT_BACKEND_SET = gpu_worker_sentinel.FT_BACKEND_SET | {BACKEND_NAME}


class MoeEpAll2AllManager(AgRsAll2AllManager):
    """The EP group's all2all manager under --enable-fault-tolerance: vLLM's all-gather/reduce-scatter one
    (used outside the MoE layers), answering vLLM's fault-tolerance queries from the live masks of the
    elastic all-to-alls the plugin built in this process."""

    def __init__(self, cpu_group, tcp_store_group=None):
        super().__init__(cpu_group, tcp_store_group)
        self.support_fault_tolerance = True

    def query_active_mask(self) -> torch.Tensor:
        """int32 [W], vLLM's convention: 1 for each rank some elastic all-to-all lost or masked, 0 for the
        others (on their device, no sync; all 0, on the CPU, before the first one is built)."""
        built = elastic_all_to_alls()
        if not built:
            return torch.zeros(self.world_size, dtype=torch.int32)
        return 1 - live_mask(built)

    def query_fault(self) -> torch.Tensor:
        """bool scalar: True once a rank is lost (a mask moe_ep never clears, so the baseline is every rank)."""
        return self.query_active_mask().any()

    def clean_buffers(self) -> None:
        """vLLM's retry, after a fault: nothing to clean between calls while every rank is live; after a lost
        rank, RuntimeError (the retry resumes with every rank, which moe_ep cannot)."""
        built = elastic_all_to_alls()
        lost = [r for r, alive in enumerate(live_mask(built).tolist()) if not alive] if built else []
        if lost:
            raise RuntimeError(f"moe_ep lost EP ranks {lost} for good: NVSHMEM cannot take a rank back into the "
                               "job it started with, so the all-to-alls cannot resume with every rank as vLLM's "
                               "retry asks; restart the deployment")
