"""moe_ep.kernel_nodes' parts that need no driver, on CPU: which kernel arguments hold a captured tensor's address
(pointers_to) and which uses of one are refused, the alignment a graph's operands need (aligned), and that
unavailable() says why where libcuda is missing. Pointing a captured graph's kernels elsewhere runs on GPUs, in
the MoE layer's eager forwards (tests/test_moe_layer.py)."""
import ctypes

import pytest
import torch

from moe_ep import kernel_nodes
from moe_ep.kernel_nodes import aligned, pointers_to

A, B = (0x7F0000001000, 0x7F0000001400), (0x7F0000100000, 0x7F0000100040)   # [start, end) of two tensors


def word(value: int, nbytes: int = 8) -> bytes:
    """An argument's bytes, as a kernel gets them (little-endian)."""
    return value.to_bytes(nbytes, "little")


def test_an_argument_at_a_spans_start_is_found():
    """An 8-byte argument equal to a span's start is (argument index, span index)."""
    assert pointers_to([word(A[0])], [A]) == [(0, 0)]
    assert pointers_to([word(3, 4), word(B[0])], [A, B]) == [(1, 1)]


def test_several_spans_and_several_arguments_of_one_kernel():
    """Each argument at a span's start is found, in argument order, a span taken twice as often as it is."""
    values = [word(B[0]), word(64, 4), word(A[0]), word(0), word(B[0])]
    assert pointers_to(values, [A, B]) == [(0, 1), (2, 0), (4, 1)]


@pytest.mark.parametrize("inside", [A[0] + 1, A[0] + 16, A[1] - 1])
def test_an_address_inside_a_span_is_refused(inside):
    """A kernel taking an address inside a span but not its start (a view at an offset) could not be moved."""
    with pytest.raises(ValueError, match="inside captured span 0 .argument 1, 8 bytes"):
        pointers_to([word(A[0]), word(inside)], [A, B])


@pytest.mark.parametrize("at", range(0, 128, 8))
def test_a_span_start_inside_a_larger_argument_is_refused(at):
    """A 128-byte argument (a TMA descriptor) holding a span's start in any aligned 8-byte word is refused: the
    address in it would not follow the tensor."""
    descriptor = bytearray(word(0x1234_5678, 128))
    descriptor[at:at + 8] = word(B[0])
    with pytest.raises(ValueError, match="inside captured span 1 .argument 0, 128 bytes"):
        pointers_to([bytes(descriptor), word(A[0])], [A, B])


def test_small_arguments_and_other_values_are_ignored():
    """4-byte arguments (even equal to a span's start) and 8-byte values outside every span (0, a span's end,
    just below its start) are not pointers to move."""
    low = (0x1000, 0x1100)                          # a span whose start fits in 4 bytes
    values = [word(low[0], 4), word(0), word(low[1]), word(low[0] - 1), word(A[1]), word(7, 4), word(1 << 63)]
    assert pointers_to(values, [low, A]) == []
    assert pointers_to([word(low[0], 4), word(low[0])], [low]) == [(1, 0)]


def test_aligned_needs_every_tensor_at_16_bytes():
    """Fresh tensors are aligned; a view 4 or 8 bytes into one is not, nor is a list holding such a view; a view
    16 bytes in is."""
    fresh = [torch.zeros(2, 3), torch.zeros(2, 2, dtype=torch.long), torch.ones(5, dtype=torch.bfloat16)]
    assert aligned(fresh) and aligned([])
    assert not aligned([torch.zeros(7)[1:7].view(2, 3)])
    assert not aligned([torch.zeros(5, dtype=torch.long)[1:]])
    assert not aligned([*fresh, torch.zeros(8)[1:]])
    assert aligned([torch.zeros(8)[4:]])


def test_unavailable_says_why_without_libcuda():
    """Without libcuda, unavailable() gives a reason (a string), not None."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        pass
    else:
        pytest.skip("libcuda.so.1 loads here")
    reason = kernel_nodes.unavailable()
    assert isinstance(reason, str) and "libcuda" in reason


def test_the_node_parameters_are_laid_out_as_the_driver_s():
    """_NodeParams is CUDA_KERNEL_NODE_PARAMS_v2: a function, grid and block (3 unsigned each), shared bytes,
    then the arguments' array at byte 40, extra, a kernel and a context: 72 bytes on a 64-bit host."""
    params = kernel_nodes._NodeParams
    assert ctypes.sizeof(params) == 72
    assert [(name, getattr(params, name).offset) for name in ("func", "grid", "block", "shared_bytes",
                                                               "kernel_params", "extra", "kern", "ctx")] == \
        [("func", 0), ("grid", 8), ("block", 20), ("shared_bytes", 32), ("kernel_params", 40), ("extra", 48),
         ("kern", 56), ("ctx", 64)]


def moved_pointers(results: list[int]) -> tuple:
    """A MovedPointers over one kernel node of two arguments, the second captured at A's start, without a
    driver: its set answers each call with the next of `results` (0: done) and records the address it saw."""
    values = [word(5), word(A[0])]
    node = kernel_nodes._Node(0x1234, kernel_nodes._NodeParams(), values, pointers_to(values, [A]))
    moved, seen = object.__new__(kernel_nodes.MovedPointers), []

    def set_params(exec_, handle, params):
        seen.append(node.pointers[0][0].value)
        return results.pop(0)

    moved.exec, moved.moving, moved.nodes, moved._set = None, [0], [node], set_params
    return moved, node, seen


class At:
    """A tensor's stand-in for point_at: its address."""

    def __init__(self, address):
        self.address = address

    def data_ptr(self):
        return self.address


def test_point_at_sets_a_node_only_where_its_pointers_moved():
    """A node is set when an address changes, not again for the same address; its copy follows."""
    moved, node, seen = moved_pointers([0, 0])
    moved.point_at([At(A[0])])                     # where it was captured: nothing to set
    moved.point_at([At(B[0])])
    moved.point_at([At(B[0])])
    moved.point_at([At(A[0])])
    assert seen == [B[0], A[0]] and node.pointers[0][0].value == A[0]


def test_a_failed_set_leaves_the_node_as_it_was():
    """A set the driver refuses raises, and the node's copy keeps the addresses the graph still has: a later
    call at the new address sets it again."""
    moved, node, seen = moved_pointers([700, 0])
    with pytest.raises(RuntimeError, match="cuGraphExecKernelNodeSetParams failed .CUresult 700"):
        moved.point_at([At(B[0])])
    assert node.pointers[0][0].value == A[0]
    moved.point_at([At(B[0])])
    assert seen == [B[0], B[0]] and node.pointers[0][0].value == B[0]
