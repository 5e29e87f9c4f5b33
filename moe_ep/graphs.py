"""Eager calls replayed as CUDA graphs: a fixed set of launches captured once, replayed in one host call.

At decode sizes an eager MoE forward's time is its host time: on the GPU machines the Python around the
experts' three launches takes two to five times their GPU time, and the all-to-all's around its two as much
again (benchmarks/NOTES.md). Launches whose operands stay where they are (a layer's weights, its
all-to-all's buffers) or are tensors laid out alike at every call (a forward's inputs and output, whose
addresses a call writes into the graph's kernels) and whose work follows what those operands hold (counts
read on the GPU) can be captured once and replayed at every later call:

    replay = Replay(launch, [((P, 2 * I), torch.bfloat16), ((E, R, H), torch.bfloat16)], device, stream)
    gate_up, out = replay()          # launch(gate_up, out) as captured, on what its operands hold now

    replay = Replay(launch, made, device, stream, operands=(x, y))
    replay(x2, y2)                   # launch(x2, y2, *buffers): the same kernels, pointed at x2 and y2

What the launches write lives in the `Scratch` of the device and the stream the graph was captured for:
one allocation, as large as the largest set of buffers asked of it (at most MAX_BYTES: larger sets are not
replayed), shared by every Replay on that stream and held while one does. Work on one stream runs in order,
so whatever reads a replay's buffers (the next kernel on the stream) has read them before another replay on
the stream writes over them: a caller that keeps them past the next replay on the stream copies them first.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch

from . import kernel_nodes

ALIGN = 256          # bytes: each buffer of a Scratch starts at a multiple (TMA descriptors need 16)
# The most one Scratch holds: launches whose buffers take more are launched, not replayed. The experts' buffers
# at decode capacities fit (DeepSeek-V3 at 8 ranks and max_tokens 128: 570 MB; Qwen3-30B-A3B at 4 ranks: 86 MB);
# at EPMoE's default max_tokens (4096) they take GBs, which launching borrows per call instead of holding.
MAX_BYTES = 1 << 30

# (device, stream) -> its Scratch, while a Replay holds it (and held no longer)
_SCRATCH: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class Scratch:
    """One uint8 allocation of `nbytes` on `device`, carved into buffers (``views``). The Scratch of a
    device and stream is replaced by a larger one when a Replay needs more (``Scratch.of``); the Replays
    on the old one keep it alive and are stale (``Replay.current``)."""

    def __init__(self, nbytes: int, device):
        self.memory = torch.empty(nbytes, dtype=torch.uint8, device=device)

    @staticmethod
    def size(made: Sequence[tuple]) -> int:
        """Bytes that ``views(made)`` takes: each (shape, dtype) of `made` rounded up to ALIGN."""
        return sum(_aligned(torch.Size(shape).numel() * dtype.itemsize) for shape, dtype in made)

    @classmethod
    def of(cls, device: torch.device, stream: int, nbytes: int) -> Scratch:
        """The Scratch of `device` and `stream` (its raw handle), made, or made larger, to hold `nbytes`."""
        scratch = _SCRATCH.get((device, stream))
        if scratch is None or scratch.memory.numel() < nbytes:
            held = 0 if scratch is None else scratch.memory.numel()
            scratch = _SCRATCH[device, stream] = cls(max(nbytes, held), device)
        return scratch

    def views(self, made: Sequence[tuple]) -> tuple[torch.Tensor, ...]:
        """Contiguous tensors of these (shape, dtype), one after another from the start of the allocation."""
        views, offset = [], 0
        for shape, dtype in made:
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            views.append(self.memory[offset:offset + nbytes].view(dtype).view(shape))
            offset += _aligned(nbytes)
        return tuple(views)


def capturing(cuda: bool) -> bool:
    """Whether work on the current stream of a caller's device is being captured into a CUDA graph (what
    torch.cuda.is_current_stream_capturing asks, without its wrapper: this runs in every eager call); `cuda`:
    whether that device is a GPU (asked once by the caller: torch.device.type takes 0.2 us a read), False
    where nothing is captured."""
    return cuda and torch._C._cuda_isCurrentStreamCapturing()


def current_stream(device: torch.device) -> int:
    """The raw handle of `device`'s current stream (torch.cuda.current_stream(device).cuda_stream, without
    making the Stream object)."""
    return torch._C._cuda_getCurrentRawStream(device.index)


def capture(launch: Callable, *args, keep_graph: bool = False) -> torch.cuda.CUDAGraph:
    """launch(*args) recorded, not run, into a CUDA graph, on a side stream after the current stream's work,
    and instantiated (keep_graph: the graph kept beside its executable one, for ``kernel_nodes``). The
    launches must allocate nothing and be compiled already (run once before: a capture records launches,
    it cannot load a module for one)."""
    graph = torch.cuda.CUDAGraph(keep_graph=True) if keep_graph else torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            launch(*args)
        finally:
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(side)
    if keep_graph:
        graph.instantiate()
    return graph


class Replay:
    """launch(*operands, *buffers) captured for `device` (the current one) and `stream` (the raw handle of its
    current stream), its buffers (`made`: (shape, dtype) each) carved from that stream's Scratch; a call
    replays it on the current stream, which must be `stream`, and returns the buffers.

    `operands` (none by default) are tensors of the caller's that the launches read or write: a call passes
    tensors laid out like them in their place (``kernel_nodes.aligned`` too), at whose addresses the graph's
    kernels are pointed before the replay (``kernel_nodes.MovedPointers``: no copy, no launch). ValueError at
    construction where the graph's kernels cannot be pointed elsewhere."""

    def __init__(self, launch: Callable, made: Sequence[tuple], device: torch.device, stream: int,
                 operands: Sequence[torch.Tensor] = ()):
        why = kernel_nodes.unavailable() if operands else None
        if why:
            raise ValueError(f"no graph's kernels can be pointed elsewhere here ({why})")
        self.key = (device, stream)
        self.scratch = Scratch.of(*self.key, Scratch.size(made))
        self.buffers = self.scratch.views(made)
        self.graph = capture(launch, *operands, *self.buffers, keep_graph=bool(operands))
        self.moved = kernel_nodes.MovedPointers(self.graph, operands) if operands else None

    @property
    def current(self) -> bool:
        """Whether its Scratch is still its stream's (a larger one replaces it): only then may it replay."""
        return _SCRATCH.get(self.key) is self.scratch

    def __call__(self, *operands: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.moved is not None:
            self.moved.point_at(operands)
        self.graph.replay()
        return self.buffers
