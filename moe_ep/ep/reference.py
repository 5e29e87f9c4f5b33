"""The reference protocol: ``moe_ep.reference``'s dispatch and combine on torch.distributed collectives
(CPU with gloo, GPU with NCCL), run as a backend for checking and for machines without NVLink.

Its sends deliver at once (``receives_at_send``): dispatch returns its outputs received, combine its sums,
and the front hands out receive hooks that do nothing. Expert ids are range-checked on the host before
anything is sent, since this path waits for the host anyway. Its calls are host collectives
(``agrees_on_calls``): before each, the front exchanges every rank's verdict on it, so that a call one
rank refuses is refused on every rank before any rank enters a collective of it.
"""
from __future__ import annotations

import torch

from .. import reference
from .protocol import EPConfig, EPProtocol, EPResources


class ReferenceProtocol(EPProtocol):
    """The reference path of one EPAllToAll: fresh outputs per call, kept per slot as a kernel protocol's
    buffers are, with what combine needs of the dispatch that filled the slot."""

    name = "reference"
    receives_at_send = True
    checks_ids_on_host = True
    agrees_on_calls = True

    def __init__(self, config: EPConfig, resources: EPResources):
        super().__init__(config, resources)
        self.group = resources.group
        self.outputs: list[tuple | None] = [None] * self.slots
        self._handles: list[reference.ReferenceHandle | None] = [None] * self.slots

    def check_ids(self, topk_ids: torch.Tensor) -> None:
        low, high = torch.stack([topk_ids.min(), topk_ids.max()]).tolist()
        if low < -1 or high >= self.config.num_experts:
            raise ValueError(f"topk_ids must lie in [-1, {self.config.num_experts}) (-1 = dropped slot), "
                             f"found values in [{low}, {high}]")

    def dispatch(self, slot: int, x, topk_ids, topk_weights, call: int, mode: str) -> None:
        c = self.config
        recv_x, recv_scales, recv_count, handle = reference.dispatch(
            x, topk_ids, topk_weights, num_experts=c.num_experts, max_tokens=c.max_tokens, fp8_group=c.fp8_group,
            group=self.group)
        self.outputs[slot] = (recv_x, recv_scales, recv_count, handle.recv_src)
        self._handles[slot] = handle

    def combine(self, slot: int, dispatch_slot: int, expert_out, out, topk_ids, num_tokens: int) -> torch.Tensor:
        y = reference.combine(expert_out, self._handles[dispatch_slot], group=self.group)
        return y if out is None else out.copy_(y)
