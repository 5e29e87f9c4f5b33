"""Launch a Triton kernel with little host work: bind what never changes once, then call the
compiled kernel's launcher directly.

A plain ``kernel[grid](**kwargs)`` binds every argument, computes the specialization key and
looks the compiled kernel up on every call: tens of microseconds for a kernel with thirty
arguments, more than the kernel itself takes at decode sizes. ``BoundKernel`` does that work
once per specialization of the arguments that change between calls (what Triton specializes
on: the dtype and 16-byte alignment of tensors, whether an int is 1 or a multiple of 16) and
afterwards builds only the argument list, tensors as their addresses (and leaves Triton's launch
hooks out while none is set, ``launch_hooks``):

    send = BoundKernel(dispatch_send_kernel, grid=264, varying=("x_ptr", "num_tokens"),
                       peers=table, timeout_ns=10**10, FP8=True, num_warps=4)
    send(x, x.shape[0])           # first call per specialization: compiles (or finds) the kernel, then
    send(x2, x2.shape[0])         # like every later call, the compiled launcher, on the current stream
    send(x3, 3, programs=40)      # 40 programs (at most the bound grid) for a call with less work

Under the Triton interpreter every call takes the usual path.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
from triton import knobs
from triton.tools.tensor_descriptor import TensorDescriptor

from .shmem import INTERPRETING

# Keyword arguments of a launch that are compile options, not kernel arguments.
OPTIONS = ("num_warps", "num_stages", "num_ctas", "enable_fp_fusion", "extern_libs", "maxnreg", "launch_pdl")


def cdiv(x: int, y: int) -> int:
    """ceil(x / y) for ints, in plain Python: ``triton.cdiv`` is a constexpr function, whose host calls
    take about 1.6 us (unwrapping its arguments) against 0.005, for the launches' per-call arithmetic."""
    return -(-x // y)


def next_power_of_2(n: int) -> int:
    """The least power of 2 >= n (n >= 1), in plain Python, as ``triton.next_power_of_2`` (see ``cdiv``)."""
    return 1 << (n - 1).bit_length()


def _address(value):
    """Tensors travel to the launcher as their addresses: one method call fewer per argument and launch."""
    return value.data_ptr() if isinstance(value, torch.Tensor) else value


def _descriptor_key(value: TensorDescriptor) -> tuple:
    """What a tensor descriptor's compiled kernel may depend on: its dtype, box and padding, and the
    16-byte alignment of its base and strides (more than Triton keys on: a few more entries at most)."""
    return (value.base.dtype, tuple(value.block_shape), getattr(value, "padding", None),
            value.base.data_ptr() % 16 == 0, tuple(stride % 16 == 0 for stride in value.strides))


def resident_programs(compiled, device) -> int:
    """Programs of a compiled kernel that one SM of `device` holds at once: the least of what its
    registers (allocated per warp, in units of 256), shared memory (CUDA reserves 1 KB a block),
    threads and the block limit (32 an SM) allow; where torch does not report a limit, Hopper's."""
    props = torch.cuda.get_device_properties(device)
    warps = compiled.metadata.num_warps
    warp_registers = -(-compiled.n_regs * 32 // 256) * 256
    by_registers = getattr(props, "regs_per_multiprocessor", 65536) // warp_registers // warps
    by_threads = getattr(props, "max_threads_per_multi_processor", 2048) // (32 * warps)
    shared = compiled.metadata.shared
    by_shared = getattr(props, "shared_memory_per_multiprocessor", 233472) // (shared + 1024) if shared else 32
    return min(by_registers, by_threads, by_shared, 32)


def unspecialized(fn) -> set[str]:
    """The arguments of `fn` named in its ``do_not_specialize`` (by name or index): its compiled code is the
    same for every value of those. The interpreter's stand-in keeps the decorator's arguments apart."""
    names = getattr(fn, "do_not_specialize", None)
    if names is None:
        names = getattr(fn, "kwargs", {}).get("do_not_specialize") or ()
    return {fn.arg_names[n] if isinstance(n, int) else n for n in names}


def launch_hooks():
    """Triton's launch hooks (enter, exit), or (None, None) while neither holds a hook. Triton keeps
    them as chains that exist even when empty, and a launch given the chains builds its launch
    metadata and calls both; the compiled launcher skips a hook that is None. Measured on a CPU
    machine, BoundKernel's host time a launch went from 4.8-5.0 to 3.4 us with triton 3.6
    (benchmarks/NOTES.md)."""
    on_enter, on_exit = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    if getattr(on_enter, "calls", on_enter) or getattr(on_exit, "calls", on_exit):
        return on_enter, on_exit
    return None, None


class BoundKernel:
    """`fn` with its 1-D grid, compile options and every argument but `varying` bound once.

    Call it with the values of `varying` (tensors, tensor descriptors or ints), positionally, in that order. With
    `resident_on` SMs given, the grid is cut when the kernel is compiled to what that many SMs hold
    at once (``resident_programs``), for kernels whose programs wait for each other or that run fastest
    in one wave; but not below `fewest` programs (for a kernel whose programs take roles by program id).
    """

    def __init__(self, fn: triton.JITFunction, grid: int, varying: Sequence[str], resident_on: int | None = None,
                 fewest: int = 1, **arguments):
        self.fn, self.grid, self.varying, self.resident_on, self.fewest = fn, grid, tuple(varying), resident_on, fewest
        self.options = {k: arguments.pop(k) for k in OPTIONS if k in arguments}
        self.fixed = arguments
        names = list(fn.arg_names)
        unknown = (set(arguments) | set(self.varying)) - set(names)
        missing = set(names) - set(arguments) - set(self.varying)
        if unknown or missing:
            raise TypeError(f"{fn.__name__}: unknown arguments {sorted(unknown)}, missing {sorted(missing)}")
        self._template = [_address(arguments.get(name)) for name in names]   # self.fixed keeps the tensors alive
        self._positions = [names.index(name) for name in self.varying]
        # whether the compiled kernel depends on each varying value (not for an int in do_not_specialize)
        plain = unspecialized(fn)
        self._keyed = [name not in plain for name in self.varying]
        self._compiled = {}        # specialization key -> (compiled kernel, grid)
        self._device = torch.cuda.current_device() if torch.cuda.is_available() else None

    def __call__(self, *values, programs: int | None = None) -> None:
        """Launch with these values of `varying` on the bound grid, or on `programs` programs if fewer."""
        if INTERPRETING:
            grid = self.grid if programs is None else min(programs, self.grid)
            self.fn[(grid,)](**self.fixed, **dict(zip(self.varying, values)), **self.options)
            return
        args = self._template.copy()
        key = self.key(values, args)
        found = self._compiled.get(key)
        if found is None:
            found = self._compiled[key] = self._compile(dict(zip(self.varying, values)))
        compiled, grid = found
        if programs is not None and programs < grid:
            grid = programs
        stream = torch._C._cuda_getCurrentRawStream(self._device)
        on_enter, on_exit = launch_hooks()
        metadata = compiled.launch_metadata((grid, 1, 1), stream, *args) if on_enter is not None else None
        compiled.run(grid, 1, 1, stream, compiled.function, compiled.packed_metadata, metadata, on_enter, on_exit,
                     *args)

    def prepare(self, *values) -> None:
        """Compile (without launching) what a call with these values of `varying` launches, if it is new:
        for a kernel that links NVSHMEM's device library, whose module NVSHMEM cannot initialize while a
        stream is being captured into a CUDA graph, ahead of a capture that will launch it."""
        if not INTERPRETING:
            key = self.key(values)
            if key not in self._compiled:
                self._compiled[key] = self._compile(dict(zip(self.varying, values)))

    def key(self, values, args: list | None = None) -> tuple:
        """The specialization key a call with these values of `varying` selects: what each value's specialization
        depends on, flat. Given `args` (a copy of the bound argument list), also puts each value in its place
        there as the compiled launcher takes it (a tensor as its address)."""
        key = []
        for position, keyed, value in zip(self._positions, self._keyed, values):
            if value.__class__ is int:                       # the most common value, asked first
                if keyed:
                    key += (value == 1, value % 16 == 0)
            elif isinstance(value, torch.Tensor):
                address = value.data_ptr()
                key += (value.dtype, address % 16 == 0)
                value = address
            elif isinstance(value, TensorDescriptor):        # the compiled launcher unpacks it
                key.append(_descriptor_key(value))
            elif keyed:                                      # another kind of int (a bool, a NumPy int)
                key += (value == 1, value % 16 == 0)
            if args is not None:
                args[position] = value
        return tuple(key)

    def _compile(self, arguments: dict):
        """The compiled kernel for these values of `varying` (compiling it if new), loaded, and its grid."""
        compiled = self.fn.warmup(**self.fixed, **arguments, **self.options, grid=(self.grid,))
        compiled._init_handles()
        if self.resident_on is None:
            return compiled, self.grid
        per_sm = resident_programs(compiled, self._device)
        if per_sm < 1:
            raise RuntimeError(f"{self.fn.__name__} does not fit on an SM ({compiled.n_regs} registers a thread, "
                               f"{compiled.metadata.shared} bytes of shared memory)")
        return compiled, min(self.grid, max(per_sm * self.resident_on, self.fewest))


_SHARED: dict[tuple, BoundKernel] = {}


def shared_kernel(fn: triton.JITFunction, grid: int, varying: Sequence[str], **arguments) -> BoundKernel:
    """The BoundKernel of `fn` on `grid` with these fixed `arguments` (compile-time values and options: ints,
    bools, strings, None; no tensors) on the current GPU, made at its first use and kept for the process:
    for a free function (a grouped GEMM) whose launches vary in their tensors and a few ints, with no object
    of its own to keep its kernels in. Its lookup (a key of the arguments, one dict read) is a fraction of
    the binding and specialization a plain ``fn[grid](...)`` repeats every launch."""
    device = None if INTERPRETING else torch.cuda.current_device()
    key = (fn, grid, device, *varying, *arguments.items())
    kernel = _SHARED.get(key)
    if kernel is None:
        kernel = _SHARED[key] = BoundKernel(fn, grid, varying, **arguments)
    return kernel
