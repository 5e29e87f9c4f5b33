"""AsyncTP's copy-engine steps: the chunked paths' transfers, on a stream of their own, each followed
by a flag raised from the stream's front end, and the GEMMs and waits between them. No SM moves data.

On the CPU (the interpreter tests) the peers' copies are plain tensors: data is copied into them and
flags are set by the host, in program order.
"""
from __future__ import annotations

import contextlib

import torch

from .. import runtime
from .config import TPBuffers, TPConfig
from .launches import Launches


class CopyEngine:
    """The copy-engine steps of one AsyncTP. `views`: name -> every rank's copy of that TPBuffers field,
    addressable by this rank (NVLink peer views on a GPU); `stream`: the copy stream (None on the CPU)."""

    def __init__(self, config: TPConfig, buffers: TPBuffers, views: dict[str, list[torch.Tensor]],
                 launches: Launches, stream: torch.cuda.Stream | None):
        self.config, self.buffers, self.views, self.launches, self.stream = config, buffers, views, launches, stream
        if stream is None:
            return
        # Made once, for the host's sake (each costs an eager call tens of us on the GPU hosts' cold caches):
        # the puts and flag writes bound to the copy stream, the addresses they take, and the events that order
        # the two streams (an event may be recorded again once the waits on its last record are issued).
        self._moves = runtime.StreamMoves(stream)
        self._bases = {name: (buffer.data_ptr(), buffer.element_size())
                       for name, buffer in (("gathered", buffers.gathered), ("partials", buffers.partials))}
        self._flags = {name: [view.data_ptr() for view in views[name]] for name in ("shard_flags", "tile_flags")}
        self._started, self._ready, self._done = torch.cuda.Event(), torch.cuda.Event(), torch.cuda.Event()

    # ------------------------------------------------------------------------------------ all-gather GEMM

    def push_shard(self, a_shard: torch.Tensor, own_copy: bool, start: torch.cuda.Event | None = None) -> None:
        """Copy a_shard [rows, K] into every peer's `gathered` (peer r+1 first), raising its flag after
        each copy; into this rank's own too when the gathered A is wanted. The copies follow `start` (an
        event of ``fork``), or without it whatever the current stream holds now."""
        c = self.config
        rows, k = a_shard.shape
        mine = slice(c.rank * rows * k, (c.rank + 1) * rows * k)
        self._follow(start)
        for step in range(1, c.world):
            peer = (c.rank + step) % c.world
            self._put("gathered", mine, a_shard, peer)
            self._raise_flag("shard_flags", peer, c.rank)
        if own_copy:
            with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
                self.buffers.gathered[mine].view(rows, k).copy_(a_shard)

    def ag_gemm_own(self, a_shard: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The chunked all-gather GEMM's first cuBLAS GEMM, the own shard's: out [W * rows, N], its rows
        of this rank filled (``ag_gemm_peers`` fills the rest)."""
        c = self.config
        rows = a_shard.shape[0]
        out = torch.empty((rows * c.world, w.shape[1]), dtype=c.dtype, device=a_shard.device)
        torch.matmul(a_shard, w, out=out[c.rank * rows:(c.rank + 1) * rows])
        return out

    def ag_gemm_peers(self, a_shard: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
        """A cuBLAS GEMM per peer's shard into out (``ag_gemm_own``'s), each once the shard has landed."""
        c = self.config
        rows, k = a_shard.shape
        for step in range(1, c.world):
            shard = (c.rank - step) % c.world
            self.launches.wait_flag("shard_flags", shard)
            a = self.buffers.gathered[shard * rows * k:(shard + 1) * rows * k].view(rows, k)
            torch.matmul(a, w, out=out[shard * rows:(shard + 1) * rows])

    # ------------------------------------------------------------------------------------ GEMM reduce-scatter

    def rs_send(self, a: torch.Tensor, w: torch.Tensor) -> None:
        """cuBLAS computes the rows bound for each peer (rank r+1's first) and the copy engine puts
        them into that peer's `partials[rank]`, raising its flag tile_flags[rank]."""
        c = self.config
        rows, n = a.shape[0] // c.world, w.shape[1]
        mine = slice(c.rank * rows * n, (c.rank + 1) * rows * n)
        for step in range(c.world - 1):
            dest = (c.rank + 1 + step) % c.world
            part = a[dest * rows:(dest + 1) * rows] @ w
            self._follow()
            self._put("partials", mine, part, dest)
            self._raise_flag("tile_flags", dest, c.rank)
            if self.stream is not None:
                part.record_stream(self.stream)

    def rs_reduce(self, a: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
        """The own rows' partial, then, once every peer's partials have landed, one fp32 pass summing
        them into out [M/W, N]."""
        c = self.config
        rows = a.shape[0] // c.world
        own = a[c.rank * rows:(c.rank + 1) * rows] @ w
        for src in range(c.world):
            if src != c.rank:
                self.launches.wait_flag("tile_flags", src)
        self.launches.reduce_partials(own, out)
        self.join()

    # ------------------------------------------------------------------------------------ the stream

    def fork(self) -> torch.cuda.Event | None:
        """An event recorded on the current stream now: where copies issued later may begin (``push_shard``),
        so that the host can queue GPU work ahead of them (None on the CPU). Valid until the next fork."""
        if self.stream is None:
            return None
        self._started.record()
        return self._started

    def join(self) -> None:
        """The current stream waits for the copies issued so far."""
        if self.stream is not None:
            self._done.record(self.stream)
            torch.cuda.current_stream().wait_event(self._done)

    def _follow(self, start: torch.cuda.Event | None = None) -> None:
        """What the copy stream does next follows `start` (an event of ``fork``), or without it the work the
        current stream holds now. The copies and flags below go to the copy stream by name, not by making it
        current (a stream switch and back per peer, host time for nothing)."""
        if self.stream is None:
            return
        if start is None:
            self._ready.record()
            start = self._ready
        self.stream.wait_event(start)

    def _put(self, name: str, where: slice, src: torch.Tensor, peer: int) -> None:
        """Copy src into elements `where` of `peer`'s copy of symmetric buffer `name`, in the copy stream's order."""
        if self.stream is not None:            # src is contiguous: a checked operand, or a GEMM's output
            base, size = self._bases[name]
            self._moves.put(base + where.start * size, src.data_ptr(), src.numel() * src.element_size(), peer)
        else:
            self.views[name][peer][where].copy_(src.flatten())

    def _raise_flag(self, name: str, peer: int, index: int) -> None:
        """Set element `index` of `peer`'s int64 buffer `name` to 1, in the copy stream's order, after a fence."""
        if self.stream is not None:
            self._moves.write(self._flags[name][peer] + 8 * index, 1)
        else:
            self.views[name][peer][index] = 1
