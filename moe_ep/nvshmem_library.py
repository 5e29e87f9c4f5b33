"""NVSHMEM's device library cut to what ``moe_ep.shmem`` can call, for kernels that link it.

Triton links a kernel's extern libraries in its llir stage (``llvm.link_extern_libs``: parse each file, link the
functions the kernel declares and what they call, LinkOnlyNeeded) on every compile. NVSHMEM's device bitcode is
31 MB (nvidia-nvshmem-cu13 3.4.5's ``libnvshmem_device.bc``), and parsing it took 2.7-3.0 of the 3.0-7.5 s that
each put-path kernel took to compile for sm_90 with triton 3.6 on a CPU machine (benchmarks/NOTES.md, "Compile
time of the EP kernels"). ``pruned`` links the library once into a module that only declares DEVICE_FUNCTIONS
and keeps the result, as LLVM IR text (300 KB), with those functions' linkage made external again: a kernel
linked against it gets the same functions and globals under the same names, and its cubin came out byte for byte
the same for every EP put kernel (scripts/ep_compile_times.py, the cubins' sha1). The text is kept beside
Triton's cache, named by a hash of the library's contents, DEVICE_FUNCTIONS and Triton's version; ranks that
write it at once each write their own file and rename it into place.
"""
from __future__ import annotations

import hashlib
import os
import re
import tempfile

# Every NVSHMEM device function moe_ep.shmem calls (tests/test_ep_checks.py checks the list against its source).
DEVICE_FUNCTIONS = (
    "nvshmem_my_pe", "nvshmem_n_pes", "nvshmem_ptr", "nvshmem_fence", "nvshmem_quiet", "nvshmem_signal_wait_until",
    "nvshmem_uint64_wait_until", "nvshmemx_barrier_all_block", "nvshmemx_sync_all_block", "nvshmemx_getmem_block",
    "nvshmemx_getmem_nbi_block", "nvshmemx_putmem_block", "nvshmemx_putmem_warp", "nvshmemx_putmem_nbi_block",
    "nvshmemx_putmem_nbi_warp", "nvshmemx_putmem_signal_block", "nvshmemx_putmem_signal_warp",
    "nvshmemx_putmem_signal_nbi_block", "nvshmemx_putmem_signal_nbi_warp", "nvshmemx_signal_op",
)


def prune(library: str, out: str, functions=DEVICE_FUNCTIONS) -> None:
    """Write to `out` (LLVM IR text) what linking `functions` from the bitcode (or IR) file `library` pulls in:
    those functions, external, and the functions and globals they use, as the library has them."""
    from triton._C.libtriton import ir, llvm

    context = ir.context()
    ir.load_dialects(context)
    with tempfile.TemporaryDirectory() as folder:
        stub = os.path.join(folder, "stub.mlir")
        with open(stub, "w") as f:
            f.write("module {\n" + "".join(f"  llvm.func @{name}()\n" for name in functions) + "}\n")
        module = ir.parse_mlir_module(stub, context)
    llvm_context = llvm.context()
    linked = llvm.to_module(module, llvm_context)
    llvm.link_extern_libs(linked, [library])      # makes every linked function internal
    text = str(linked)
    for name in functions:
        text, found = re.subn(rf"^define internal (.*@{name}\()", r"define \1", text, flags=re.M)
        if found != 1:
            raise ValueError(f"{library} defines {name} {found} times, not once")
    folder = os.path.dirname(out) or "."
    os.makedirs(folder, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=folder, suffix=".tmp", delete=False) as f:
        f.write(text)
    os.replace(f.name, out)


def pruned(library: str) -> str:
    """The path of `library` pruned to DEVICE_FUNCTIONS (``prune``), made once per machine and Triton cache."""
    import triton
    from triton import knobs

    digest = hashlib.sha256()
    with open(library, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    digest.update(repr((DEVICE_FUNCTIONS, triton.__version__)).encode())
    out = os.path.join(knobs.cache.dir, "moe_ep_nvshmem", f"libnvshmem_device_{digest.hexdigest()[:16]}.ll")
    if not os.path.exists(out):
        prune(library, out)
    return out
