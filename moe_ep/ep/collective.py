"""The collective protocol (backend "reference"): dispatch and combine as ``all_to_all_single`` calls of
``moe_ep.collectives``, on any device and group (CPU with gloo, GPU with NCCL, GPU tensors over gloo where
ranks share a GPU), for checking and for machines without NVLink.

What one call moves from each rank to each rank:

    dispatch  counts  int32 [1 + K]: the rows that follow, then per k the slots routed to the receiver's experts
                      (so that combine groups its sums by k without waiting for the host)
              rows    one per (token, receiving rank) the token is routed to, packed as ``RowFormat`` lays it out:
                      the payload (its format's elements and scales, or x's dtype), the token's K weights (fp32), its
                      index and its K expert ids as the receiver numbers its own (-1 for a slot elsewhere), the
                      two in the narrowest integer type that holds them
    combine   rows    one per (token, rank) back: that rank's weighted sum over its experts, in x's dtype

Dispatch waits for the host once, for the counts; every index after that is computed on the device with
sizes the host already holds, and combine does not wait at all. The results are ``moe_ep.reference``'s
contract, bit for bit: the payload format's formula (``PayloadFormat.quantize``), expert-major rows in
(source rank, token, k) order, the expert rank's sums in fp32 in k order cast to x's dtype, and the source's
sums of those in rank order in fp32.

Its sends deliver at once (``receives_at_send``): dispatch returns its outputs received, combine its sums,
and the front hands out receive hooks that do nothing. Expert ids are range-checked on the host before
anything is sent, since this path waits for the host anyway. Its calls are host collectives
(``agrees_on_calls``): before each, the front exchanges every rank's verdict on it, so that a call one
rank refuses is refused on every rank before any rank enters a collective of it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..collectives import all_to_all_single
from .protocol import EPConfig, EPProtocol, EPResources


def index_dtype(bound: int) -> torch.dtype:
    """The narrowest signed integer dtype that holds every value in [-1, bound)."""
    return next(d for d in (torch.int8, torch.int16, torch.int32) if bound <= torch.iinfo(d).max + 1)


@dataclass(frozen=True)
class RowFormat:
    """The bytes of one dispatched row: named fields of `width` elements of `dtype` each, in order. Every rank
    makes it from the settings they agreed on, so a receiver cuts each row where its sender packed it."""
    fields: tuple[tuple[str, torch.dtype, int], ...]

    @classmethod
    def of(cls, config: EPConfig) -> RowFormat:
        c = config
        scales = (("scales", c.scale_dtype, c.groups),) if c.payload.group else ()
        payload = c.payload.payload_shape(1, c.hidden)[1]
        return cls((("payload", c.payload_dtype, payload), *scales, ("weights", torch.float32, c.topk),
                    ("token", index_dtype(c.max_tokens), 1), ("experts", index_dtype(c.experts_per_rank), c.topk)))

    @property
    def nbytes(self) -> int:
        return sum(dtype.itemsize * width for _, dtype, width in self.fields)

    def pack(self, rows: int, **parts: torch.Tensor) -> torch.Tensor:
        """One tensor of `rows` rows per field, by name ([rows, width] or [rows] for a width of 1, any dtype
        that converts to the field's) -> uint8 [rows, nbytes]."""
        return torch.cat([parts[name].to(dtype).reshape(rows, width).view(torch.uint8)
                          for name, dtype, width in self.fields], dim=1)

    def unpack(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """uint8 [N, nbytes] -> {field name: [N, width] of its dtype}, each a tensor of its own."""
        fields, start = {}, 0
        for name, dtype, width in self.fields:
            end = start + dtype.itemsize * width
            fields[name] = rows[:, start:end].clone(memory_format=torch.contiguous_format).view(dtype)   # aligned
            start = end
        return fields


@dataclass
class Routing:
    """What combine needs of one dispatch."""
    send_splits: list[int]         # rows this rank sent to each rank, rank order (the rows combine gets back)
    recv_splits: list[int]         # rows it received from each rank
    send_token: torch.Tensor       # [S] int64: the token of each sent row, rank-major
    by_k: list[tuple[torch.Tensor, ...]]   # per k, of the received rows' local entries: row [n_k], expert
                                           # [n_k], row within the expert [n_k], weight [n_k, 1] fp32


class CollectiveProtocol(EPProtocol):
    """The torch.distributed path of one EPAllToAll: fresh outputs per call, kept per slot as a kernel
    protocol's buffers are, with what combine needs of the dispatch that filled the slot."""

    name = "reference"
    receives_at_send = True
    checks_ids_on_host = True
    agrees_on_calls = True

    def __init__(self, config: EPConfig, resources: EPResources):
        super().__init__(config, resources)
        self.group = resources.group
        self.format = RowFormat.of(config)
        self.ranks = torch.arange(config.world, device=self.device)
        self.outputs: list[tuple | None] = [None] * self.slots
        self._routing: list[Routing | None] = [None] * self.slots

    def check_ids(self, topk_ids: torch.Tensor) -> None:
        low, high = torch.stack([topk_ids.min(), topk_ids.max()]).tolist()
        if low < -1 or high >= self.config.num_experts:
            raise ValueError(f"topk_ids must lie in [-1, {self.config.num_experts}) (-1 = dropped slot), "
                             f"found values in [{low}, {high}]")

    def dispatch(self, slot: int, x, topk_ids, topk_weights, call: int, mode: str, tensor_scale=None) -> None:
        """x [T, H], topk_ids [T, K], topk_weights [T, K] (and the payload's per-tensor scale, float32 [1] or [],
        for nvfp4) -> outputs[slot] = (recv_x [E_loc, W * T_max, H / P] of the payload's payload_dtype, P its
        element_pack, recv_scales [E_loc, W * T_max, G] of its scale_dtype or None, recv_count [E_loc] int32,
        recv_src [E_loc, W * T_max] int32, -1 past each expert's rows), fresh tensors; what combine needs kept
        with them."""
        c, device = self.config, self.device
        per_rank, topk = c.experts_per_rank, c.topk
        ids = topk_ids.long()
        ids = torch.where((ids >= 0) & (ids < c.num_experts), ids, -1)    # unchecked (validate=False): dropped
        dest = torch.where(ids >= 0, ids // per_rank, -1)                     # [T, K] rank of each slot
        slot_to = dest[:, :, None] == self.ranks                              # [T, K, W]
        to_rank = slot_to.any(1)                                              # [T, W]
        counts = torch.cat([to_rank.sum(0)[:, None], slot_to.sum(0).t()], dim=1).int()   # [W, 1 + K]
        peer_counts = torch.empty_like(counts)
        all_to_all_single(peer_counts, counts, group=self.group)
        sizes = torch.cat([counts[:, 0], peer_counts[:, 0], peer_counts[:, 1:].sum(0)]).tolist()   # the one wait
        send_splits, recv_splits, per_k = sizes[:c.world], sizes[c.world:2 * c.world], sizes[2 * c.world:]

        # Send: a row per (rank, token), rank-major, the token's ids renumbered as that rank numbers its experts.
        send_rank, send_token = torch.nonzero_static(to_rank.t(), size=sum(send_splits)).unbind(1)
        mine = dest[send_token] == send_rank[:, None]
        local_ids = torch.where(mine, ids[send_token] - send_rank[:, None] * per_rank, -1)
        if c.payload.group:
            payload, scales = c.payload.quantize(x, tensor_scale)
            scales = scales.view(c.scale_dtype)[send_token]
        else:
            payload, scales = x, None
        sent = self.format.pack(len(send_token), payload=payload[send_token], scales=scales,
                                weights=topk_weights[send_token], token=send_token, experts=local_ids)
        received = torch.empty((sum(recv_splits), self.format.nbytes), dtype=torch.uint8, device=device)
        all_to_all_single(received, sent, recv_splits, send_splits, group=self.group)
        rows = self.format.unpack(received)

        # Expert-major layout: the local entries in (source, token, k) order, grouped by expert.
        experts = rows["experts"].long().flatten()
        entry = torch.nonzero_static(experts >= 0, size=sum(per_k))[:, 0]
        row, k = entry // topk, entry % topk
        expert, order = torch.sort(experts[entry], stable=True)
        row, k = row[order], k[order]
        recv_count = torch.zeros(per_rank, dtype=torch.int64, device=device)
        recv_count.index_add_(0, expert, torch.ones_like(expert))
        position = torch.arange(len(expert), device=device) - (torch.cumsum(recv_count, 0) - recv_count)[expert]
        recv_x = torch.empty((per_rank, *c.payload.payload_shape(c.world * c.max_tokens, c.hidden)),
                             dtype=c.payload_dtype, device=device)
        recv_x[expert, position] = rows["payload"][row]
        recv_scales = None
        if c.payload.group:
            recv_scales = torch.empty((*c.expert_rows[:2], c.groups), dtype=c.scale_dtype, device=device)
            recv_scales[expert, position] = rows["scales"][row]
            recv_scales = recv_scales.view(c.payload.scale_dtype)
        source = torch.repeat_interleave(self.ranks, peer_counts[:, 0], output_size=len(received))
        recv_src = torch.full(c.expert_rows[:2], -1, dtype=torch.int32, device=device)
        recv_src[expert, position] = ((source[row] * c.max_tokens + rows["token"][row, 0]) * topk + k).int()

        weight = rows["weights"][row, k, None]
        by_k = [(row[i], expert[i], position[i], weight[i]) for i in torch.sort(k, stable=True).indices.split(per_k)]
        self.outputs[slot] = (recv_x, recv_scales, recv_count.int(), recv_src)
        self._routing[slot] = Routing(send_splits, recv_splits, send_token, by_k)

    def combine(self, slot: int, dispatch_slot: int, expert_out, out, topk_ids, num_tokens: int) -> torch.Tensor:
        """expert_out [E_loc, W * T_max, H] in the layout of the dispatch in `dispatch_slot` -> y [T, H] in x's
        dtype (`out` when given, else a fresh tensor)."""
        c, device, routing = self.config, self.device, self._routing[dispatch_slot]
        partial = torch.zeros((sum(routing.recv_splits), c.hidden), dtype=torch.float32, device=device)
        for row, expert, position, weight in routing.by_k:          # k order; a row at most once per k
            partial.index_add_(0, row, weight * expert_out[expert, position].float())
        sums = partial.to(c.dtype).view(torch.uint8)
        back = torch.empty((len(routing.send_token), sums.shape[1]), dtype=torch.uint8, device=device)
        all_to_all_single(back, sums, routing.send_splits, routing.recv_splits, group=self.group)
        y = torch.zeros((num_tokens, c.hidden), dtype=torch.float32, device=device)
        for token, rank_rows in zip(routing.send_token.split(routing.send_splits),
                                    back.view(c.dtype).split(routing.send_splits)):   # rank order
            y.index_add_(0, token, rank_rows.float())
        return y.to(c.dtype) if out is None else out.copy_(y)
