"""Expert-parallel dispatch/combine: one front over protocol objects.

    front.py        EPAllToAll: validation, buffer slots, handles, receive hooks; PROTOCOLS, the registry
                    that names the protocol of each backend
    protocol.py     EPConfig (the layer's shape), EPResources (what the front hands a protocol),
                    EPProtocol (what a protocol offers), KernelProtocol (the machinery of the protocols
                    that run Triton kernels: program state, stamps, peer tables, bound launches)
    low_latency.py  backend "nvshmem": stores through NVLink peer pointers, over kernels/all_to_all.py, and
                    NVSHMEM puts and signals for the peers no pointer reaches (other nodes), in the same kernels
    puts.py         the put peers: which ranks take puts, their staging, the peer tables that point into it
    collective.py   backend "reference": all_to_all_single of moe_ep.collectives, each token packed once per
                    destination rank (any device and group: CPU with gloo, GPU with NCCL)

A protocol owns its buffers (dataclasses, one comment per field), its bound launches and its status
words, and declares its slots, kernels and timing stamps; the front never branches on which one it
holds. Another protocol is a file of its own (its class: buffers and grids in __init__, launches bound in
connect(), reported()/raise_reported() where it adds status words), its kernels, a line in kernels/status.py
for each wait of its own, and one line in front.PROTOCOLS; EPAllToAll(..., backend=<its name>) then runs it,
with every check, hook and handle as before.
"""
from .front import EPAllToAll, EPHandle, check_config

__all__ = ["EPAllToAll", "EPHandle", "check_config"]
