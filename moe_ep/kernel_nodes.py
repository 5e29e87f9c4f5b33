"""A CUDA graph's kernels pointed at other tensors between replays, with no copy and no launch.

A graph captured on some tensors replays on other tensors of the same shapes once the captured
addresses among its kernels' arguments are replaced in the executable graph
(cuGraphExecKernelNodeSetParams copies a node's arguments when it is called):

    moved = MovedPointers(graph, [x, out])        # graph: torch.cuda.CUDAGraph(keep_graph=True), instantiated
    moved.point_at([x2, out2]); graph.replay()    # the same kernels, reading x2 and writing out2

An argument is found by its value: 8 bytes equal to a captured tensor's address. What cannot be moved is
refused at construction (ValueError): a kernel that takes an address inside a captured tensor but not at its
start (a view at an offset: every 8-byte word of every argument is looked at, so a tensor descriptor that holds
it counts too), a captured tensor no kernel takes, and a graph with nodes other than kernels and empty ones
(a memcpy or memset node may read or write a captured tensor, a child graph hides its kernels). Empty tensors
are not moved: no kernel can touch their memory.

The new tensors must be laid out like the captured ones, and as aligned: Triton specializes a pointer argument
on 16-byte alignment, so a kernel compiled for an aligned address must not get another (``aligned``).

Driver entry points through ctypes (libcuda, CUDA 12.4 or later for cuFuncGetParamInfo); ``unavailable()``
says why they cannot be used, where they cannot.
"""
from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence

import torch

KERNEL_NODE, EMPTY_NODE = 0, 5          # CUgraphNodeType: CU_GRAPH_NODE_TYPE_KERNEL, CU_GRAPH_NODE_TYPE_EMPTY
INVALID_VALUE = 1                       # CUresult CUDA_ERROR_INVALID_VALUE
ALIGN = 16                              # bytes: the alignment Triton specializes a pointer argument on
_WORD = 8


class _NodeParams(ctypes.Structure):
    """CUDA_KERNEL_NODE_PARAMS_v2."""
    _fields_ = [("func", ctypes.c_void_p), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_bytes", ctypes.c_uint), ("kernel_params", ctypes.POINTER(ctypes.c_void_p)),
                ("extra", ctypes.c_void_p), ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


@functools.cache
def _cuda() -> ctypes.CDLL:
    """libcuda with the prototypes used here (loaded once); OSError or AttributeError where it lacks one."""
    lib = ctypes.CDLL("libcuda.so.1")
    p, size_p = ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)
    for name, args in (("cuGraphGetNodes", (p, ctypes.POINTER(p), size_p)),
                       ("cuGraphNodeGetType", (p, ctypes.POINTER(ctypes.c_int))),
                       ("cuGraphKernelNodeGetParams_v2", (p, ctypes.POINTER(_NodeParams))),
                       ("cuGraphExecKernelNodeSetParams_v2", (p, p, ctypes.POINTER(_NodeParams))),
                       ("cuFuncGetParamInfo", (p, ctypes.c_size_t, size_p, size_p)),
                       ("cuKernelGetParamInfo", (p, ctypes.c_size_t, size_p, size_p))):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    return lib


@functools.cache
def unavailable() -> str | None:
    """Why this process cannot move a graph's pointers (the driver lacks an entry point used here, or torch
    cannot keep a captured graph: ``torch.cuda.CUDAGraph(keep_graph=True)``), or None where it can."""
    try:
        _cuda()
        torch.cuda.CUDAGraph(keep_graph=True)
    except (OSError, AttributeError, TypeError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    missing = [name for name in ("raw_cuda_graph", "raw_cuda_graph_exec") if not hasattr(torch.cuda.CUDAGraph, name)]
    return f"torch.cuda.CUDAGraph has no {' or '.join(missing)}" if missing else None


def aligned(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether every tensor's address is a multiple of ALIGN bytes."""
    return all(t.data_ptr() % ALIGN == 0 for t in tensors)


def _check(result: int, call: str) -> None:
    if result != 0:
        raise ValueError(f"{call} failed (CUresult {result})")


def _arguments(cuda: ctypes.CDLL, params: _NodeParams) -> list[bytes]:
    """The argument values of a kernel node, each as the bytes the kernel gets."""
    if params.func:
        info, handle = cuda.cuFuncGetParamInfo, params.func
    elif params.kern:
        info, handle = cuda.cuKernelGetParamInfo, params.kern
    else:
        raise ValueError("a kernel node names neither a function nor a kernel")
    if not params.kernel_params:
        raise ValueError("a kernel node passes its arguments in a packed buffer, which is not read here")
    values, offset, size = [], ctypes.c_size_t(), ctypes.c_size_t()
    while (result := info(handle, len(values), ctypes.byref(offset), ctypes.byref(size))) == 0:
        values.append(ctypes.string_at(params.kernel_params[len(values)], size.value))
    if result != INVALID_VALUE:      # what the driver answers past the last argument, and only there
        raise ValueError(f"a kernel's argument {len(values)} could not be read (CUresult {result})")
    return values


def pointers_to(values: Sequence[bytes], spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """(argument index, span index) of each argument of a kernel (`values`: its arguments' bytes) that is the
    start of one of `spans` ([start, end) byte addresses of the captured tensors). ValueError where an
    argument holds an address inside a span but not its start as an argument of its own (a view at an
    offset, or an address kept inside a larger argument): such a use could not be moved."""
    moved = []
    for i, value in enumerate(values):
        for word in range(0, len(value) - _WORD + 1, _WORD):
            address = int.from_bytes(value[word:word + _WORD], "little")
            for j, (start, end) in enumerate(spans):
                if address == start and len(value) == _WORD:
                    moved.append((i, j))
                elif start <= address < end:
                    raise ValueError(f"a kernel takes an address inside captured span {j} (argument {i}, "
                                     f"{len(value)} bytes), which is not moved")
    return moved


class _Node:
    """One kernel node whose arguments take a captured address: its parameters with the arguments in
    storage of its own. `moved`: (argument index, index among the moved tensors) of each argument that holds
    a captured address (``pointers_to``); `pointers`: that argument's storage, as an int64, and the index."""

    def __init__(self, handle: int, params: _NodeParams, values: list[bytes], moved: list[tuple[int, int]]):
        self.handle = ctypes.c_void_p(handle)
        self.storage = [ctypes.create_string_buffer(v, len(v)) for v in values]
        self.pointers = [(ctypes.c_uint64.from_buffer(self.storage[i]), j) for i, j in moved]
        self.array = (ctypes.c_void_p * len(values))(*(ctypes.addressof(s) for s in self.storage))
        self.params = _NodeParams.from_buffer_copy(params)
        self.params.kernel_params = ctypes.cast(self.array, ctypes.POINTER(ctypes.c_void_p))
        self.params.extra = None


class MovedPointers:
    """The kernel nodes of `graph` (a ``torch.cuda.CUDAGraph(keep_graph=True)``, captured and instantiated)
    that take the addresses of `tensors`, found once; ``point_at`` points them at other tensors. Needs
    ``unavailable()`` to be None."""

    def __init__(self, graph: torch.cuda.CUDAGraph, tensors: Sequence[torch.Tensor]):
        cuda = _cuda()
        self.exec = ctypes.c_void_p(graph.raw_cuda_graph_exec())
        # An empty tensor has no memory a kernel could touch (and maybe no address): it is not moved.
        self.moving = [j for j, t in enumerate(tensors) if t.numel()]
        spans = [(tensors[j].data_ptr(), tensors[j].data_ptr() + tensors[j].nbytes) for j in self.moving]
        ordered = sorted(spans)
        if any(a[1] > b[0] for a, b in zip(ordered, ordered[1:])):
            raise ValueError("the captured tensors overlap: an address would name two of them")
        self.nodes: list[_Node] = []
        found = [False] * len(spans)
        for handle in self._handles(cuda, ctypes.c_void_p(graph.raw_cuda_graph())):
            kind = ctypes.c_int()
            _check(cuda.cuGraphNodeGetType(handle, ctypes.byref(kind)), "cuGraphNodeGetType")
            if kind.value == EMPTY_NODE:
                continue
            if kind.value != KERNEL_NODE:
                raise ValueError(f"the graph has a node of type {kind.value}: only kernels' pointers are moved")
            params = _NodeParams()
            _check(cuda.cuGraphKernelNodeGetParams_v2(handle, ctypes.byref(params)), "cuGraphKernelNodeGetParams")
            values = _arguments(cuda, params)
            moved = pointers_to(values, spans)
            for _, j in moved:
                found[j] = True
            if moved:
                self.nodes.append(_Node(handle.value, params, values, moved))
        if not all(found):
            raise ValueError(f"no kernel of the graph takes captured tensor {self.moving[found.index(False)]}")
        self._set = cuda.cuGraphExecKernelNodeSetParams_v2

    @staticmethod
    def _handles(cuda: ctypes.CDLL, graph: ctypes.c_void_p) -> list[ctypes.c_void_p]:
        count = ctypes.c_size_t()
        _check(cuda.cuGraphGetNodes(graph, None, ctypes.byref(count)), "cuGraphGetNodes")
        handles = (ctypes.c_void_p * count.value)()
        _check(cuda.cuGraphGetNodes(graph, handles, ctypes.byref(count)), "cuGraphGetNodes")
        return [ctypes.c_void_p(h) for h in handles]

    def point_at(self, tensors: Sequence[torch.Tensor]) -> None:
        """Point the graph's kernels at `tensors` (laid out as the captured ones, ``aligned``) from the next
        replay on. A node whose pointers are where they were is not set again (a set is a driver call: the MoE
        forward's two took 19 us on a GPU machine; a caller's tensors often come back at the same addresses)."""
        addresses = [tensors[j].data_ptr() for j in self.moving]
        for node in self.nodes:
            before = [storage.value for storage, _ in node.pointers]
            if before == [addresses[j] for _, j in node.pointers]:
                continue
            for storage, j in node.pointers:
                storage.value = addresses[j]
            result = self._set(self.exec, node.handle, ctypes.byref(node.params))
            if result != 0:           # the node keeps the addresses it had, and so does its copy here
                for (storage, _), value in zip(node.pointers, before):
                    storage.value = value
                raise RuntimeError(f"cuGraphExecKernelNodeSetParams failed (CUresult {result})")
