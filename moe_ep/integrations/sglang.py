"""SGLang: moe_ep's dispatch/combine as the token dispatcher of SGLang's MoE layers.

    dispatcher = make_dispatcher(moe_runner_config, group=ep_group)      # one per MoE layer
    dispatch_output = dispatcher.dispatch(hidden_states=x, topk_output=topk_output)
    combine_input = run_experts(dispatch_output)       # SGLang's MoE runner, DeepEP low-latency format
    y = dispatcher.combine(combine_input=combine_input)

or, serving a model: ``pip install --no-deps -e .`` (from the checkout) into SGLang's environment, then
``MOE_EP_SGLANG=nvshmem python -m sglang.launch_server --model-path MODEL --tp N --ep N --moe-a2a-backend
deepep --deepep-mode low_latency``. The ``sglang.srt.plugins`` entry point runs ``register()`` in every
SGLang process; it hooks SGLang's dispatcher factory (PATCH_POINTS) so that, with MOE_EP_SGLANG set to
a backend of EPAllToAll ("nvshmem", or "reference": torch.distributed, for checking), every MoE layer
that would get DeepEP's dispatcher gets a MoeEpDispatcher on the MoE EP group instead. All else stays
SGLang's DeepEP low-latency path: the runners that read its output, CUDA graphs, two-batch overlap.

The output is SGLang's DeepEPLLDispatchOutput, whose layout is EPAllToAll's: hidden_states
[E_loc, W * max_tokens, H], FP8 e4m3 with hidden_states_scale [E_loc, W * max_tokens, H / 128] fp32
when SGLang's choice of DeepEP's dispatch dtype (get_deepep_output_dtype) is FP8 (payload "fp8"), the
layer's dtype when it is bf16; where DeepGEMM takes UE8M0 scales (deep_gemm_wrapper.DEEPGEMM_SCALE_UE8M0),
FP8 is payload "fp8_ue8m0" and hidden_states_scale is int32 [E_loc, W * max_tokens, H / 512], four UE8M0
scales packed in each, MN-major (strides (W * max_tokens * H / 512, 1, W * max_tokens)), as DeepEP's
use_ue8m0 dispatch hands them to DeepGEMM; masked_m [E_loc] int32 (the rows per local expert, recv_count);
expected_m as DeepEP computes it; topk_ids and topk_weights as given. Combine takes SGLang's DeepEPLLCombineInput (the
experts' output in that layout, with the ids and weights the dispatch returned) and returns [T, H]:
sum over k of topk_weights[t, k] times the row of (t, k), in fp32. dispatch_a / dispatch_b and
combine_a / combine_b split each into the send and the receive, for two-batch overlap; each sub-batch
(tbo_subbatch_index) keeps its own handle. max_tokens is SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK,
as for DeepEP.

What it cannot honour raises ValueError when SGLang builds the layer, or, for the dispatch dtype,
when the quantization method sets it after the weights load: DeepEP's normal mode (--deepep-mode
normal or auto), single-batch overlap, fused shared experts, experts not spread evenly over the group,
top-k or hidden sizes EPAllToAll refuses (a multiple of 512 for "fp8_ue8m0"), and dispatch dtypes other
than bf16 and FP8 in 128-wide blocks (int8, NVFP4, MXFP4, and MXFP8: SGLang's MXFP8 experts read DeepEP's
low-latency output, which has no MXFP8 on GPUs, so payload "mxfp8" is refused rather than guessed at).

Elastic mode (EPAllToAll's ``elastic=True``: a rank that stops answering is masked and the others' calls
complete without its experts) follows SGLang's elastic EP (``--elastic-ep-backend``): SGLang keeps the
ranks it counts active in ElasticEPStateManager's ``active_ranks`` (int32 on the device, 1 = active),
which its elastic dispatchers clear where a rank times out; after a forward in which that mask changed,
it re-places the experts on the active ranks (EPLB, with --enable-eplb and its elasticity-aware
algorithm) and runs the forward again. Under that option make_dispatcher builds the all-to-all elastic
(nvshmem backend only; without --enable-eplb it refuses, since SGLang then has nothing to re-place the
experts with after a loss), after every combine the dispatcher clears in ``active_ranks`` the ranks the
all-to-all lost, and before every dispatch it masks in the all-to-all the ranks ``active_ranks`` counts
inactive (``integrations.mask_inactive``: a rank SGLang marked inactive is not waited for), both on the
device (no sync; CUDA graphs keep it). What SGLang's elastic EP does beyond that
is refused: a process joining a running deployment (--elastic-ep-join-mode: recovering a lost rank, or
scaling up) and room for more ranks than the group has (--max-ep-size), since NVSHMEM's ranks are fixed
when the first all-to-all is built. The dispatcher also offers ``live_ranks()``, ``mask_ranks(ranks)``
and ``lost(tbo_subbatch_index)``, each sub-batch's [T, K] report of the experts its last combine went
without: SGLang has no place for it (the forward it runs again, once the experts are re-placed, has none
lost); an engine wrapper reads it there. ``MoeEpDispatcher(..., elastic=True)`` outside SGLang's elastic
EP builds the same all-to-all and leaves SGLang's state alone.

Written against SGLang 0.5.23 (SGLANG_VERSION); PATCH_POINTS names every engine function the plugin hooks.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
from sglang.srt.elastic_ep.elastic_ep import ElasticEPStateManager
from sglang.srt.environ import envs
from sglang.srt.eplb.expert_distribution import get_global_expert_distribution_recorder
from sglang.srt.layers import deep_gemm_wrapper
from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig
from sglang.srt.layers.moe.token_dispatcher.base import BaseDispatcher, CombineInputFormat
from sglang.srt.layers.moe.token_dispatcher.deepep import DeepEPLLCombineInput, DeepEPLLDispatchOutput
from sglang.srt.layers.moe.topk import TopKOutput, TopKOutputChecker
from sglang.srt.layers.moe.utils import (DeepEPMode, DispatcherOutputDtype, get_deepep_mode,
                                         get_deepep_output_dtype, get_moe_a2a_backend, is_sbo_enabled)
from sglang.srt.runtime_context import get_exec, get_parallel

from ..ep import EPAllToAll, EPHandle, check_config
from . import FP8_BLOCK, all_to_all, check_local_experts, live_mask, mask_inactive, mn_major

SGLANG_VERSION = "0.5.23"
ENABLE_VARIABLE = "MOE_EP_SGLANG"  # an EPAllToAll backend: DeepEP's dispatchers become MoeEpDispatchers on it
# Where SGLang 0.5.23 builds a MoE layer's dispatcher, as a HookRegistry target; register() hooks it (AROUND).
PATCH_POINTS = {
    "dispatcher factory": "sglang.srt.layers.moe.fused_moe_triton.layer.create_moe_dispatcher",
}
_registered: set[str] = set()      # the PATCH_POINTS register() has hooked in this process


def make_dispatcher(config: MoeRunnerConfig, group=None, backend: str = "nvshmem") -> MoeEpDispatcher:
    """The dispatcher of the SGLang MoE layer `config` over EPAllToAll on `group` (the MoE EP group),
    under SGLang's published DeepEP settings; ValueError for what moe_ep cannot honour."""
    mode = get_deepep_mode()
    if not mode.is_low_latency():
        raise ValueError(f"moe_ep replaces DeepEP's low-latency mode only; --deepep-mode {mode.value} also runs "
                         "its normal mode: run with --deepep-mode low_latency")
    if is_sbo_enabled():
        raise ValueError("single-batch overlap signals DeepEP's combine from inside the experts' GEMM; moe_ep "
                         "has no such signal: run without --enable-single-batch-overlap")
    if config.num_fused_shared_experts:
        raise ValueError(f"moe_ep routes to the {config.num_experts} routed experts only; this layer fuses "
                         f"{config.num_fused_shared_experts} shared experts into them: run with "
                         "--disable-shared-experts-fusion")
    elastic = get_exec().moe.elastic_ep_backend is not None
    if elastic:
        _check_elastic_ep(group)
    return MoeEpDispatcher(config.num_experts, config.num_local_experts, config.hidden_size, config.top_k,
                           config.params_dtype, group=group,
                           max_tokens=envs.SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK.get(),
                           runner_backend=config.runner_backend, backend=backend, elastic=elastic)


def _check_elastic_ep(group=None) -> None:
    """ValueError for what SGLang's published elastic EP settings ask and moe_ep cannot honour: elastic EP
    without EPLB (after a loss SGLang re-places the experts through its EPLB manager, which exists only with
    --enable-eplb), this process joining a running deployment, or room for more ranks than `group` has.
    NVSHMEM's ranks are fixed when the first all-to-all is built: a lost rank is masked for good, and no
    rank joins later."""
    if not get_exec().moe.enable_eplb:
        raise ValueError("elastic EP (--elastic-ep-backend) needs --enable-eplb: after a rank is lost SGLang "
                         "re-places its experts on the ranks left through the EPLB manager, which only "
                         "--enable-eplb creates")
    join = get_exec().moe.ep_join_mode
    if join is not None:
        raise ValueError(f"moe_ep cannot take a rank into a running job (--elastic-ep-join-mode {join}): NVSHMEM's "
                         "ranks are fixed when the first all-to-all is built; restart the deployment instead")
    capacity, world = get_parallel().max_ep_size, dist.get_world_size(group)
    if capacity is not None and capacity > world:
        raise ValueError(f"moe_ep cannot scale up to --max-ep-size {capacity} from {world} ranks: NVSHMEM's ranks "
                         "are fixed when the first all-to-all is built")


class MoeEpDispatcher(BaseDispatcher):
    """SGLang's token dispatcher over one EPAllToAll, in DeepEP's low-latency format.

    dispatch(hidden_states [T, H], topk_output: StandardTopKOutput, topk_ids [T, K] (-1 = dropped slot)
    and topk_weights [T, K]) -> DeepEPLLDispatchOutput(hidden_states [E_loc, W * T_max, H] FP8 or the
    layer's dtype, hidden_states_scale [E_loc, W * T_max, H / 128] fp32 ("fp8"), [E_loc, W * T_max, H / 512]
    int32 MN-major ("fp8_ue8m0") or None, topk_ids, topk_weights, masked_m [E_loc] int32, expected_m).
    payload: the format dispatch sends (a name of ``moe_ep.formats.FORMATS``; None: the layer's dtype).
    combine(DeepEPLLCombineInput(hidden_states [E_loc, W * T_max, H] layer dtype, topk_ids, topk_weights))
    -> [T, H] layer dtype. The halves: dispatch_a sends, dispatch_b receives and returns the output;
    combine_a sends, combine_b receives and returns the tokens; per sub-batch, in that order. A
    dispatch's outputs stay valid until the dispatch after next (two sub-batches in flight).
    elastic: build the all-to-all elastic (nvshmem backend only): combine's sum leaves out the experts of
    lost ranks, without renormalizing; lost() says which, and SGLang's elastic EP state, where there is
    one, learns which ranks were lost, and its inactive ranks are masked before each dispatch.
    """

    dispatch_mode = DeepEPMode.LOW_LATENCY      # what get_deepep_output_dtype reads for mode-specific dtypes

    def __init__(self, num_experts: int, num_local_experts: int, hidden_size: int, top_k: int,
                 params_dtype: torch.dtype, group=None, max_tokens: int = 128, runner_backend=None,
                 backend: str = "nvshmem", elastic: bool = False):
        super().__init__()
        self.runner_backend = runner_backend
        self.world = check_local_experts(num_experts, num_local_experts, group)
        self.max_tokens, self.hidden, self.num_experts, self.topk = max_tokens, hidden_size, num_experts, top_k
        self.dtype, self.group, self.backend, self.elastic = params_dtype, group, backend, elastic
        self.payload = self._dispatch_payload()
        self._ep: EPAllToAll | None = None
        self._stages: dict[int, tuple[str, tuple]] = {}   # sub-batch -> (stage, what the next half needs)
        self._handles: dict[int, EPHandle] = {}           # sub-batch -> the handle of its last dispatch
        self._members: torch.Tensor | None = None         # the group's global ranks (its rows of active_ranks),
                                                          # made with the all-to-all, outside any CUDA graph

    # ------------------------------------------------------------------------------------ configuration

    def set_quant_config(self, quant_config: dict) -> None:
        """SGLang's quantization methods name the dispatch dtype here, after the weights load."""
        super().set_quant_config(quant_config)
        self.payload = self._dispatch_payload()
        self._ep = None

    @property
    def fp8(self) -> bool:
        """True where dispatch sends FP8 e4m3 rows with scales ("fp8" or "fp8_ue8m0")."""
        return self.payload is not None

    def _dispatch_payload(self) -> str | None:
        """The payload format of SGLang's choice of DeepEP's low-latency dispatch dtype for this layer: None
        for the layer's dtype (bf16); for FP8 "fp8" (128-wide blocks, fp32 scales), or "fp8_ue8m0" where
        DeepGEMM takes UE8M0 scales (deep_gemm_wrapper.DEEPGEMM_SCALE_UE8M0: SGLang's DeepEP dispatch then
        rounds the scales up to powers of two and packs them). ValueError naming the format for what moe_ep
        cannot send: MXFP8 ("mxfp8", by dispatch dtype or by use_mxfp8 experts), and any other dtype."""
        dtype = get_deepep_output_dtype(self)
        mxfp8 = dtype is DispatcherOutputDtype.MXFP8 or (dtype is DispatcherOutputDtype.FP8
                                                         and self.quant_config.get("use_mxfp8"))
        if mxfp8:
            raise ValueError("these MXFP8 experts ask for payload 'mxfp8' (e4m3, a UE8M0 scale per 32 columns); "
                             "SGLang's MXFP8 experts read DeepEP's low-latency output, which has no MXFP8 on "
                             "GPUs, so moe_ep does not send it to them: run with --deepep-dispatcher-output-dtype "
                             "bf16")
        if dtype not in (DispatcherOutputDtype.BF16, DispatcherOutputDtype.FP8):
            raise ValueError(f"moe_ep dispatches the layer's dtype or FP8 e4m3 in blocks of {FP8_BLOCK}; this "
                             f"layer's dispatch dtype is {dtype.value} (--deepep-dispatcher-output-dtype)")
        payload = None
        if dtype is DispatcherOutputDtype.FP8:
            payload = "fp8_ue8m0" if deep_gemm_wrapper.DEEPGEMM_SCALE_UE8M0 else "fp8"
        check_config(self.max_tokens, self.hidden, self.num_experts, self.topk, self.world, self.dtype,
                     payload is not None, FP8_BLOCK, self.backend, elastic=self.elastic, payload=payload)
        return payload

    def all_to_all(self, device: torch.device) -> EPAllToAll:
        """The EPAllToAll of this layer's shape for tokens on `device`, shared with the other layers of that
        shape (collective when the first of them dispatches)."""
        if self._ep is None or self._ep.device != device:
            self._ep = all_to_all(self.max_tokens, self.hidden, self.num_experts, self.topk, self.dtype,
                                  group=self.group, backend=self.backend, device=device, elastic=self.elastic,
                                  payload=self.payload)
            ranks = dist.get_process_group_ranks(self.group) if self.group is not None else range(self.world)
            self._members = torch.tensor(list(ranks), device=device)
        return self._ep

    def _take(self, half: str, subbatch: int | None, expected: str) -> tuple:
        """What sub-batch `subbatch` holds at stage `expected`; ValueError if it is at another stage."""
        current, held = self._stages.get(subbatch or 0, ("idle", ()))
        if current != expected:
            raise ValueError(f"{half} on sub-batch {subbatch or 0} needs it {expected}, it is {current} "
                             "(the order is dispatch_a, dispatch_b, combine_a, combine_b)")
        return held

    def _put(self, subbatch: int | None, stage: str, held: tuple = ()) -> None:
        self._stages[subbatch or 0] = (stage, held)

    # ------------------------------------------------------------------------------------ dispatch

    def dispatch(self, hidden_states: torch.Tensor, topk_output: TopKOutput,
                 tbo_subbatch_index: int | None = None) -> DeepEPLLDispatchOutput:
        self.dispatch_a(hidden_states, topk_output, tbo_subbatch_index)
        return self.dispatch_b(tbo_subbatch_index)

    def dispatch_a(self, hidden_states: torch.Tensor, topk_output: TopKOutput,
                   tbo_subbatch_index: int | None = None) -> None:
        """Send this sub-batch's tokens [T, H] to the ranks of their experts."""
        if not TopKOutputChecker.format_is_standard(topk_output):
            raise ValueError(f"moe_ep dispatches by the router's top-k ids and weights (StandardTopKOutput), "
                             f"got {type(topk_output).__name__}")
        self._take("dispatch_a", tbo_subbatch_index, "idle")
        topk_ids, topk_weights = topk_output.topk_ids, topk_output.topk_weights
        ep = self.all_to_all(hidden_states.device)
        if self.elastic:
            state = ElasticEPStateManager.instance()
            if state is not None:
                mask_inactive(ep, state.active_ranks[self._members])
        *received, hook = ep.dispatch(
            hidden_states.contiguous(), topk_ids.contiguous(), topk_weights.contiguous(), return_recv_hook=True)
        tokens = hidden_states.shape[0]
        expected_m = (tokens * self.world * self.topk + self.num_experts) // self.num_experts   # DeepEP's hint
        self._put(tbo_subbatch_index, "dispatching", (*received, hook, topk_ids, topk_weights, expected_m))

    def dispatch_b(self, tbo_subbatch_index: int | None = None) -> DeepEPLLDispatchOutput:
        """Receive this rank's experts' rows of the sub-batch's dispatch."""
        recv_x, recv_scales, recv_count, handle, hook, topk_ids, topk_weights, expected_m = self._take(
            "dispatch_b", tbo_subbatch_index, "dispatching")
        hook()
        self._handles[tbo_subbatch_index or 0] = handle
        self._put(tbo_subbatch_index, "dispatched", (handle, topk_ids, topk_weights))
        get_global_expert_distribution_recorder().on_deepep_dispatch_low_latency(recv_count)
        if self.payload == "fp8_ue8m0":
            recv_scales = mn_major(recv_scales)
        return DeepEPLLDispatchOutput(recv_x, recv_scales, topk_ids, topk_weights, recv_count, expected_m)

    # ------------------------------------------------------------------------------------ combine

    def combine(self, combine_input: DeepEPLLCombineInput, tbo_subbatch_index: int | None = None) -> torch.Tensor:
        self.combine_a(combine_input, tbo_subbatch_index)
        return self.combine_b(tbo_subbatch_index)

    def combine_a(self, combine_input: DeepEPLLCombineInput, tbo_subbatch_index: int | None = None) -> None:
        """Send the experts' rows back to their tokens' ranks, weighted by the dispatch's top-k weights."""
        if combine_input.format != CombineInputFormat.DEEPEP_LL:
            raise ValueError(f"moe_ep combines DeepEP low-latency inputs, got {combine_input.format.value}")
        handle, topk_ids, topk_weights = self._take("combine_a", tbo_subbatch_index, "dispatched")
        for name, sent, given in (("topk_ids", topk_ids, combine_input.topk_ids),
                                  ("topk_weights", topk_weights, combine_input.topk_weights)):
            if given is not sent and not torch.equal(given, sent):
                raise ValueError(f"the combine input's {name} differ from those of its dispatch; moe_ep sends "
                                 "the dispatch's with the tokens and applies them in the combine")
        # A tensor of its own: layers of one shape share the EPAllToAll, whose combine buffers return two calls later.
        out = torch.empty((handle.num_tokens, self.hidden), dtype=self.dtype, device=combine_input.hidden_states.device)
        y, hook = self._ep.combine(combine_input.hidden_states, handle, return_recv_hook=True, out=out)
        self._put(tbo_subbatch_index, "combining", (y, hook))

    def combine_b(self, tbo_subbatch_index: int | None = None) -> torch.Tensor:
        """Receive the sub-batch's tokens [T, H]: the sum over their experts of weight times output."""
        y, hook = self._take("combine_b", tbo_subbatch_index, "combining")
        hook()
        self._put(tbo_subbatch_index, "idle")
        if self.elastic:
            state = ElasticEPStateManager.instance()
            if state is not None:
                self._clear_lost_ranks(state.active_ranks)
        return y

    # ------------------------------------------------------------------------------------ elastic

    def _clear_lost_ranks(self, active_ranks: torch.Tensor) -> None:
        """Clear in SGLang's active_ranks (int32 [at least the job's ranks], 1 = active, by global rank) the
        ranks of this group the all-to-all lost or masked, on the device."""
        active_ranks[self._members] = active_ranks[self._members] * live_mask([self._ep])

    def live_ranks(self) -> list[int]:
        """The ranks of the group the all-to-all counts live (a sync: EPAllToAll.live_ranks); every rank
        before the first dispatch, which builds it."""
        return list(range(self.world)) if self._ep is None else self._ep.live_ranks()

    def mask_ranks(self, ranks) -> None:
        """Count `ranks` (of the group) dead in this layer shape's all-to-all from its next call on (elastic;
        collective over the survivors, between the same two calls: EPAllToAll.mask_ranks)."""
        if self._ep is None:
            raise ValueError("mask_ranks needs the all-to-all, which the first dispatch builds")
        self._ep.mask_ranks(ranks)

    def lost(self, tbo_subbatch_index: int | None = None) -> torch.Tensor | None:
        """[T, K] bool of the sub-batch's last dispatch: True where expert k of token t was on a rank its
        combine went without, whose contribution is missing from the tokens combine_b returned. Valid once
        that combine_b ran, until the all-to-all's dispatch after next (the layers of one shape share it:
        read it before the next layer's dispatch). None unless elastic, or before any dispatch."""
        handle = self._handles.get(tbo_subbatch_index or 0)
        return None if handle is None else handle.lost


# ------------------------------------------------------------------------------------ the plugin

def register() -> None:
    """The ``sglang.srt.plugins`` entry point: hooks the PATCH_POINTS (SGLang applies the hooks once
    every plugin has run; idempotent)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    target = PATCH_POINTS["dispatcher factory"]
    if target not in _registered:
        HookRegistry.register(target, _create_moe_dispatcher, HookType.AROUND)
        _registered.add(target)


def _create_moe_dispatcher(original, moe_runner_config: MoeRunnerConfig, *args, **kwargs) -> BaseDispatcher:
    """create_moe_dispatcher, hooked: where SGLang would build DeepEP's dispatcher and MOE_EP_SGLANG names a
    backend, a MoeEpDispatcher on the MoE EP group with that backend; SGLang's own dispatcher otherwise."""
    backend = os.environ.get(ENABLE_VARIABLE, "")
    if not backend or not get_moe_a2a_backend().is_deepep():
        return original(moe_runner_config, *args, **kwargs)
    return make_dispatcher(moe_runner_config, group=get_parallel().moe_ep_group.device_group, backend=backend)
