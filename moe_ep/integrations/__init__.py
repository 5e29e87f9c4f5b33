"""What ties moe_ep's layers to other people's code, one module per framework.

    transformers   swap_moe: EPMoE into the sparse MoE blocks of a transformers model
    vllm           a prepare/finalize over EPAllToAll for vLLM's modular MoE kernel, and its plugin
    sglang         a token dispatcher over EPAllToAll for SGLang's MoE layers, and its plugin

``vllm`` and ``sglang`` import their engine: import them only where it is installed. Both share
``all_to_all``, the EPAllToAll of one layer shape and payload format, made once per process
(``destroy_all_to_alls`` frees them all at the end of a job), ``check_local_experts``, and for elastic mode
``elastic_all_to_alls`` and ``live_mask``: the ranks the elastic all-to-alls count live, read on the device,
where an engine keeps its own mask of live ranks, and ``mask_inactive``, which masks in an all-to-all the ranks
the engine's mask counts inactive. ``mn_major`` lays packed UE8M0 scales ("fp8_ue8m0") out as DeepGEMM takes them.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..ep import EPAllToAll

FP8_BLOCK = 128                    # columns per FP8 scale: the activation block the engines' FP8 experts take

_ALL_TO_ALLS: dict[tuple, EPAllToAll] = {}


def all_to_all(max_tokens: int, hidden: int, num_experts: int, topk: int, dtype: torch.dtype, fp8: bool = False,
               group=None, backend: str = "nvshmem", device: torch.device | None = None,
               elastic: bool = False, payload: str | None = None) -> EPAllToAll:
    """The EPAllToAll of this shape on `group` dispatching `payload` (a name of ``moe_ep.formats.FORMATS`` that
    dispatch applies: "fp8", "fp8_ue8m0", "mxfp8", "nvfp4", or the activation dtype's; None: "fp8" when `fp8`,
    the activation dtype's otherwise; "fp8" is FP8 in FP8_BLOCK columns), elastic when `elastic`, for tensors on
    `device` (None: EPAllToAll's default), made on first use (collective then) and shared after: an engine's
    MoE layers of one shape and payload share one. ValueError when `fp8` and `payload` disagree, or for a
    payload dispatch does not apply (EPAllToAll's, naming it)."""
    if payload is None:
        payload = "fp8" if fp8 else None
    elif fp8 and payload != "fp8":
        raise ValueError(f"fp8=True asks for payload 'fp8', payload asks for {payload!r}: pass the payload alone")
    key = (max_tokens, hidden, num_experts, topk, dtype, payload, group, backend, device, elastic)
    if key not in _ALL_TO_ALLS:
        _ALL_TO_ALLS[key] = EPAllToAll(max_tokens, hidden, num_experts, topk, group=group, dtype=dtype,
                                       fp8_dispatch=payload is not None, fp8_group=FP8_BLOCK, backend=backend,
                                       device=device, elastic=elastic, payload=payload)
    return _ALL_TO_ALLS[key]


def mn_major(scales: torch.Tensor) -> torch.Tensor:
    """A dispatch's recv_scales [E_loc, M, G] (row-major) -> the same values laid out MN-major, strides
    (M * G, 1, M): how DeepGEMM takes an activation's packed UE8M0 scales (int32, G = H / 512), and how
    DeepEP's use_ue8m0 dispatch returns them. A copy: it stays valid after the all-to-all's next calls."""
    experts, rows, groups = scales.shape
    out = torch.empty((experts, groups, rows), dtype=scales.dtype, device=scales.device).transpose(1, 2)
    return out.copy_(scales)            # strides set explicitly: contiguous() keeps any stride of a size-1 G


def elastic_all_to_alls() -> list[EPAllToAll]:
    """The elastic EPAllToAlls all_to_all has made in this process (one per layer shape), oldest first."""
    return [ep for ep in _ALL_TO_ALLS.values() if ep.elastic]


def live_mask(all_to_alls: list[EPAllToAll]) -> torch.Tensor:
    """int32 [W] on their device: 1 for each rank every one of the elastic `all_to_alls` (at least one, all
    of one group) counts live, 0 where one of them lost or masked it. Read on the device, in stream order:
    no sync, so a CUDA graph can hold it (EPAllToAll.live_ranks reads the same words on the host). Each
    all-to-all finds a lost rank at its own first call after the loss (one timeout each)."""
    mask = all_to_alls[0].live_mask
    for ep in all_to_alls[1:]:
        mask = mask * ep.live_mask
    return mask


def mask_inactive(all_to_all: EPAllToAll, active: torch.Tensor) -> None:
    """Mask in the elastic `all_to_all` every rank an engine counts inactive: `active` is int [W] on its
    device, 1 for each rank of its group the engine counts active. Read on the device, in stream order, with
    no sync (EPAllToAll.keep_ranks); while a call of the all-to-all is in flight (its receive hook not yet
    called) it does nothing, and the next call between two calls masks them."""
    if not all_to_all.in_flight:
        all_to_all.keep_ranks(active)


def destroy_all_to_alls() -> None:
    """Destroy every EPAllToAll all_to_all made, and forget them (collective over their groups, as their
    construction was; idempotent): at the end of a job, before ``runtime.finalize``. The engines' layers
    built over them cannot run afterwards; the next all_to_all call makes a new one."""
    while _ALL_TO_ALLS:
        _ALL_TO_ALLS.popitem()[1].destroy()


def check_local_experts(num_experts: int, num_local_experts: int, group=None) -> int:
    """The world size of `group`; ValueError unless a layer of `num_experts` holding `num_local_experts` on
    this rank spreads them evenly over it (rank r holds [r * E_loc, (r + 1) * E_loc), EPAllToAll's layout)."""
    world = dist.get_world_size(group)
    if num_local_experts * world != num_experts:
        raise ValueError(f"moe_ep needs the {num_experts} experts spread evenly over the {world} ranks of "
                         f"the group, this layer holds {num_local_experts}")
    return world
