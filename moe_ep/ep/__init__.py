"""Expert-parallel dispatch/combine: one front over protocol objects.

    front.py        EPAllToAll: validation, buffer slots, handles, receive hooks; PROTOCOLS, the registry
                    that names the protocol of each backend
    protocol.py     EPConfig (the layer's shape), EPResources (what the front hands a protocol),
                    EPProtocol (what a protocol offers), KernelProtocol (the machinery of the protocols
                    that run Triton kernels: program state, stamps, peer tables, bound launches)
    low_latency.py  backend "nvshmem": NVLink peer-pointer stores, over kernels/all_to_all.py
    collective.py   backend "reference": all_to_all_single of moe_ep.collectives, each token packed once per
                    destination rank (any device and group: CPU with gloo, GPU with NCCL)

A protocol owns its buffers (dataclasses, one comment per field), its bound launches and its status
words, and declares its slots, kernels and timing stamps; the front never branches on which one it
holds. The next protocol, inter-node puts say, is two new files and one registry line (and a line in
kernels/status.py for each wait of its own):

    kernels/all_to_all_internode.py   the kernels: each phase puts with a signal (shmem.putmem_signal_nbi_block)
                                      from a local staging buffer, and waits, bounded, on the signals
    ep/internode.py                   class Internode(KernelProtocol): its buffers and grids in __init__, its
                                      launches bound in connect(), and reported()/raise_reported() where it
                                      adds status words of its own
    ep/front.py                       PROTOCOLS = {..., "nvshmem_internode": Internode}

and EPAllToAll(..., backend="nvshmem_internode") runs it, with every check, hook and handle as before.
"""
from .front import EPAllToAll, EPHandle, check_config

__all__ = ["EPAllToAll", "EPHandle", "check_config"]
