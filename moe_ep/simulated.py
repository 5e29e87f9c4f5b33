"""A world simulated in one process, on the CPU (``EPAllToAll.simulated``, ``AsyncTP.simulated``): no
torch.distributed, no NVSHMEM, every rank's object in this process (``simulated_ranks``), their symmetric
buffers plain tensors on one ``SimulatedHeap``.

Every simulated rank allocates its symmetric buffers in the same order, as NVSHMEM's collective
allocations do, so that a symmetric address of one rank names the same place in any other's. Under the
Triton interpreter ``moe_ep.shmem`` emulates the kernels' puts and signals through this heap.
"""
import ctypes
import weakref

import torch


class SimulatedHeap:
    """The symmetric memory of a world simulated in one process: every rank allocates the same buffers in the
    same order, so that buffer i of one rank stands for buffer i of every rank. A put or a signal to a PE
    resolves its symmetric address (an address in the calling rank's buffer i) to the same place in the PE's."""

    _heaps: list = []          # weak references to every heap alive

    def __init__(self, world: int):
        self.buffers: list[list[torch.Tensor]] = [[] for _ in range(world)]
        SimulatedHeap._heaps = [ref for ref in SimulatedHeap._heaps if ref() is not None] + [weakref.ref(self)]

    def allocator(self, rank: int):
        """(shape, dtype) -> a zeroed CPU tensor, recorded as rank `rank`'s next symmetric buffer."""
        def zeros(shape, dtype: torch.dtype) -> torch.Tensor:
            t = torch.zeros(shape, dtype=dtype)
            self.buffers[rank].append(t)
            return t
        return zeros

    @classmethod
    def translate(cls, address: int, pe: int) -> int:
        """The address of symmetric `address` (in any simulated rank's buffer) on rank `pe`."""
        for ref in cls._heaps:
            heap = ref()
            for buffers in heap.buffers if heap is not None else ():
                for i, t in enumerate(buffers):
                    base = t.data_ptr()
                    if base <= address < base + t.numel() * t.element_size():
                        return heap.buffers[pe][i].data_ptr() + address - base
        raise ValueError(f"address {address:#x} is in no simulated rank's symmetric memory")

    @classmethod
    def copy(cls, dest: int, source: int, nbytes: int, pe: int) -> None:
        """Copy `nbytes` from address `source` to symmetric address `dest` on rank `pe` (a put, at once)."""
        ctypes.memmove(cls.translate(dest, pe), source, nbytes)

    @classmethod
    def put(cls, dst: torch.Tensor, src: torch.Tensor, pe: int) -> None:
        """``runtime.put_on_stream`` in a simulated world: copy the contiguous `src` into `pe`'s copy of `dst`,
        a view of a simulated rank's symmetric tensor."""
        cls.copy(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size(), pe)


def simulated_ranks(cls, world: int, build) -> list:
    """One object of the ``runtime.CommObject`` subclass `cls` for each rank of a simulated `world`, in rank
    order, without its constructor: each on the CPU, with no process group, its symmetric buffers on one
    SimulatedHeap. ``build(obj, rank, symmetric_zeros)`` configures the object of `rank` and allocates its
    symmetric buffers from ``symmetric_zeros(shape, dtype)``; its refusal board follows them, its notes
    copied between the ranks at once. Connecting the ranks (their peer tables) is the caller's."""
    heap, ranks = SimulatedHeap(world), []
    for rank in range(world):
        comm = cls.__new__(cls)
        comm.group, comm.device, comm._heap = None, torch.device("cpu"), heap   # _heap: keeps it alive (held weakly)
        build(comm, rank, heap.allocator(rank))
        comm._open_refusals(heap.allocator(rank), SimulatedHeap.put)
        ranks.append(comm)
    return ranks
