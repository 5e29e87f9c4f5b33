"""moe_ep.graphs: the scratch that replayed graphs write into (CPU: how it is carved and replaced); the
capture and replay themselves run on GPUs, in the MoE layer's eager forwards (tests/test_moe_layer.py)."""
import gc

import torch

from moe_ep import graphs
from moe_ep.graphs import ALIGN, Scratch

MADE = [((3, 5), torch.bfloat16), ((7, 0), torch.float32), ((2, 3, 4), torch.float8_e4m3fn), ((9,), torch.float32)]


def test_views_are_aligned_apart_and_of_the_shapes_asked():
    scratch = Scratch(Scratch.size(MADE), "cpu")
    assert Scratch.size(MADE) == 256 + 0 + 256 + 256
    views = scratch.views(MADE)
    base = scratch.memory.data_ptr()
    assert [(tuple(v.shape), v.dtype) for v in views] == [(tuple(s), d) for s, d in MADE]
    assert all(v.is_contiguous() and (v.data_ptr() - base) % ALIGN == 0 for v in views if v.numel())
    for i, view in enumerate(views):               # each view's bytes are its own
        if view.numel():
            scratch.memory.zero_()
            view.view(torch.uint8).fill_(1)
            assert int(scratch.memory.sum()) == view.numel() * view.element_size(), f"view {i}"


def test_a_larger_request_replaces_the_scratch_and_the_old_one_lives_while_held():
    device, stream = torch.device("cpu"), 12345
    first = Scratch.of(device, stream, 1000)
    assert Scratch.of(device, stream, 512) is first                 # large enough: the same
    second = Scratch.of(device, stream, 4096)
    assert second is not first and second.memory.numel() == 4096 and first.memory.numel() == 1000
    assert Scratch.of(device, stream, 10) is second and Scratch.of(device, stream + 1, 10) is not second
    assert Scratch.of(device, stream, 3000).memory.numel() == 4096    # never smaller than the one it replaces
    del second
    gc.collect()
    assert graphs._SCRATCH.get((device, stream)) is None               # nothing holds it: gone
    assert Scratch.of(device, stream, 10).memory.numel() == 10
