"""Peers reached by NVSHMEM puts: the staging a kernel protocol needs for them, and its peer tables.

A rank reaches a peer through a peer pointer where NVSHMEM gives one (the GPUs of its NVLink domain), and
through puts and signals where it does not (other nodes: InfiniBand or RoCE through IBGDA or IBRC, UCX,
libfabric; whatever transport NVSHMEM was started with), or for every peer where puts are forced
(``EPAllToAll(puts="all")``, which runs the put path on one node). Both kinds of peer are served by the
same kernels in the same call (``kernels/all_to_all.py``, "Peers reached by puts").

For each buffer a peer writes row blocks of (the peer-table rows ``STAGED``), a put peer's entry in the
peer table points into this rank's staging copy of the buffer, shifted by (peer - rank) row blocks: a
kernel that stores to row block [slot, rank] of "the peer's buffer" stores to row block [slot, peer] of its
own staging, which it then puts to row block [slot, rank] of the peer's buffer, the same offset of a
symmetric buffer. A put peer's entries of the other rows (signal words, the live mask) are 0: the kernels
signal put peers by puts, never through those entries.
"""
from __future__ import annotations

import torch

from .protocol import EPConfig

# The peer-table rows a put peer's rows are staged for, per side ("dispatch", "combine").
STAGED = {"dispatch": ("data", "scales", "ids", "weights", "positions", "offsets", "counts", "tokens"),
          "combine": ("data",)}
MAX_WORLD = 63                 # ranks in an int64 bit set (kernels: `remote`), its sign bit left alone


def put_peers(world: int, rank: int, reaches, puts: str) -> tuple[int, ...]:
    """The ranks `rank` reaches through puts: every other rank with puts="all"; with "auto" those that
    `reaches(r)` (whether NVSHMEM gives a peer pointer to rank r) says no to."""
    return tuple(r for r in range(world) if r != rank and (puts == "all" or not reaches(r)))


class PutPeers:
    """A kernel protocol's put peers: their staging (symmetric copies of the staged buffers, and the echo
    words a signal's put carries), their bits for the kernels, and the peer tables that point into the
    staging. Built by the protocol between its buffers and ``publish``."""

    def __init__(self, config: EPConfig, peers: tuple[int, ...]):
        """Checked before anything is allocated: ValueError where puts cannot serve `config`."""
        if config.world > MAX_WORLD:
            raise ValueError(f"puts reach at most {MAX_WORLD} ranks, and the world has {config.world}")
        if config.elastic:
            raise ValueError(f"elastic mode needs every peer reached through a peer pointer, and rank {config.rank} "
                             f"reaches ranks {list(peers)} through puts")
        self.config, self.peers = config, peers
        self.bits = sum(1 << r for r in peers)

    def allocate(self, symmetric_zeros, buffers: dict) -> None:
        """The staging, from symmetric_zeros(shape, dtype) (collective): a copy of each STAGED buffer of
        `buffers` (side -> the protocol's DispatchBuffers, CombineBuffers), and the echo words."""
        self.staging = {(side, name): symmetric_zeros(tuple(getattr(buffers[side], name).shape),
                                                      getattr(buffers[side], name).dtype)
                        for side, names in STAGED.items() for name in names}
        self.echo = symmetric_zeros((self.config.world,), torch.int64)

    def symmetric(self, protocol: str) -> dict[str, torch.Tensor]:
        """The staging as named symmetric buffers (what the protocol's destroy() frees with the others)."""
        named = {f"{protocol}.{side}.{name}.staged": t for (side, name), t in self.staging.items()}
        named[f"{protocol}.echo"] = self.echo
        return named

    def addresses(self, peer_addresses):
        """peer_addresses (name, buffer) -> every rank's address, with each put peer's entry replaced:
        its row block in this rank's staging of the buffer (see the module docstring), or 0."""
        rank = self.config.rank

        def addresses(name: str, buffer: torch.Tensor) -> list[int | None]:
            row = list(peer_addresses(name, buffer))
            side, _, field = name.partition(".")[2].partition(".")
            staged = self.staging.get((side, field))
            for r in self.peers:
                row[r] = 0 if staged is None else staged.data_ptr() + (r - rank) * staged[0, 0].nbytes
            return row
        return addresses
