"""Triton kernels compiled for sm_90 on any machine (Triton's PTX and ptxas; no GPU needed), so that a run
without a GPU sees what a GPU would compile.

The CPU tests run in the interpreter, which a kernel takes on when it is defined, so compilations run in a
Python process of their own: ``run_without_interpreter(script)``, a script that calls ``compile_for_sm90``
(this directory is on its import path).
"""
import os
import subprocess
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

SM90 = GPUTarget("cuda", 90, 32)
POINTER_TYPES = {torch.bfloat16: "*bf16", torch.float8_e4m3fn: "*fp8e4nv", torch.int32: "*i32", torch.int64: "*i64",
                 torch.float32: "*fp32", torch.int8: "*i8", torch.uint8: "*u8"}


def triton_type(value) -> str:
    """The signature type of a kernel argument: a tensor's pointer type, i32 for an int (i64 past 32 bits)."""
    if isinstance(value, torch.Tensor):
        return POINTER_TYPES[value.dtype]
    return "i64" if abs(value) >= 2**31 else "i32"


def compile_for_sm90(fn, types: dict, constants: dict, aligned: tuple[str, ...] = (), **options):
    """Compile the @triton.jit `fn` to a cubin for sm_90 with the compile `options` (num_warps, ...); the compiled
    kernel (its PTX: ``.asm["ptx"]``). `constants`: the value of each constexpr argument, and of any other argument
    held constant (None for a descriptor a variant does not take); `types`: the signature type of each other
    argument ("*bf16", "tensordesc<bf16[64, 128]>", ...), "i32" where it names none; `aligned`: the arguments a
    launch would find divisible by 16 (pointers 16-byte aligned, sizes and strides multiples of 16), as Triton's
    launcher marks them."""
    signature = {p.name: "constexpr" if p.is_constexpr or p.name in constants else types.get(p.name, "i32")
                 for p in fn.params}
    constants = {(i,): constants[p.name] for i, p in enumerate(fn.params) if p.name in constants}
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(fn.params) if p.name in aligned}
    return triton.compile(ASTSource(fn, signature, constants, attrs), target=SM90, options=options)


def run_without_interpreter(script: str, timeout: int) -> str:
    """Run the Python `script` outside the interpreter, in a process of its own with this process's import path
    and this directory's modules; its stdout. Fails the calling test (its stderr's end) if the script fails."""
    path = os.pathsep.join([os.path.dirname(os.path.abspath(__file__)), *sys.path])
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": path}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout
