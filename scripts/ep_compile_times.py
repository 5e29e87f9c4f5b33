"""Which EP kernel variants an EPAllToAll compiles for bench_all_to_all.py's settings, and how long each takes
to compile for sm_90 on this machine (no GPU needed), stage by stage.

    PYTHONPATH=/path/to/triton-3.6 python scripts/ep_compile_times.py [--worlds 2,4] [--tokens 16,128,512,4096]
        [--paths pointers,puts] [--bitcode libnvshmem_device.bc] [--list] [--jobs N]

Each setting builds ``EPAllToAll.simulated`` objects (world ranks in this process, on the CPU) the way the
benchmark builds its objects (H 7168, 256 experts, top-8, FP8 with groups of 128, bf16 combine; max_tokens =
tokens), and replays the benchmark's calls with BoundKernel's compiles recorded instead of run: what a first
dispatch compiles eagerly (``KernelProtocol._ready_dispatch``), the graphs' dispatches of modes "auto",
"decode" and "prefill", and the combines. A variant is what Triton's compile cache keys on (the kernel, its
constexprs, the specialization of its arguments, the compile options); the put path links NVSHMEM's device
bitcode (``--bitcode``, the file ``runtime.device_library()`` names on the GPU hosts: nvidia-nvshmem-cu13's
``lib/libnvshmem_device*.bc``; without it the put path is listed, not compiled). Each distinct variant is
compiled once (a fresh cache), in the order a benchmark run first meets it, and timed per stage: "ast" is
Triton's code generation from the Python source (unrolled static_range loops included), then ttir, ttgir, llir
(which links the extern libraries and runs LLVM's O3), ptx and cubin (ptxas).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

os.environ["TRITON_INTERPRET"] = "0"
os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="ep_compile_cache_"))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from moe_ep import EPAllToAll  # noqa: E402
from moe_ep.ep import protocol as protocol_module  # noqa: E402
from moe_ep.launcher import BoundKernel  # noqa: E402

HIDDEN, EXPERTS, TOPK, GROUP = 7168, 256, 8, 128
SM90 = GPUTarget("cuda", 90, 32)
BACKEND = make_backend(SM90)
BITCODE = ["libnvshmem_device.bc"]       # the put path's extern library (the runtime asks nvshmem4py for it)
protocol_module.device_library = lambda: {"libnvshmem_device": BITCODE[0]}
STAGES = ("ast", "ttir", "ttgir", "llir", "ptx", "cubin")
LLIR_PARTS = ("link_extern_libs", "optimize_module")      # inside llir: the extern libraries' link, LLVM's O3


class Recorder:
    """BoundKernel's compiles, recorded: (kernel, its Triton binding) per launch and prepare, in order."""

    def __init__(self):
        self.calls = []

    def install(self):
        recorder = self

        def record(self, *values, programs=None):
            recorder.calls.append((self, values))

        BoundKernel.__call__ = record
        BoundKernel.prepare = record


def variant(bound: BoundKernel, values) -> tuple:
    """(key, name, constexprs, compile arguments) of the compile a launch of `bound` with `values` needs: the key
    is Triton's (the binder's specialization and the options)."""
    fn = bound.fn
    binder = _binders.get(fn)
    if binder is None:
        binder = _binders[fn] = create_function_from_signature(fn.signature, fn.params, BACKEND)
    kwargs = {**bound.fixed, **dict(zip(bound.varying, values)), **bound.options}
    kwargs.pop("launch_pdl", None)          # a launch attribute: the same code
    bound_args, specialization, options = binder(**kwargs)
    options_, signature, constexprs, attrs = fn._pack_args(BACKEND, kwargs, bound_args, specialization, options)
    key = (fn.__name__, tuple(specialization), tuple(sorted((k, str(v)) for k, v in options_.__dict__.items())))
    names = [p.name for p in fn.params]
    shown = {names[path[0]]: value for path, value in constexprs.items() if fn.params[path[0]].is_constexpr}
    return key, fn.__name__, shown, (signature, constexprs, attrs, options_.__dict__)


_binders = {}


def benchmark_calls(world: int, tokens: int, puts: bool, rank: int = 0, slots: int = 2):
    """The launches and prepares of the benchmark's calls of one setting on rank `rank`'s object (the pointer
    path's object, or the put path's)."""
    recorder = Recorder()
    recorder.install()
    zeros = torch.zeros

    def lazy_zeros(*shape, dtype=None, device=None, **kw):
        """Large buffers left unwritten (their pages never touched): only their addresses matter here."""
        t = torch.empty(*shape, dtype=dtype, device=device, **kw)
        return t if t.numel() * t.element_size() > 1 << 20 else t.zero_()

    torch.zeros = lazy_zeros
    try:
        ep = EPAllToAll.simulated(world, tokens, HIDDEN, EXPERTS, TOPK, fp8_group=GROUP,
                                  puts="all" if puts else "auto")[rank]
    finally:
        torch.zeros = zeros
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, HIDDEN, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(tokens)])
    weights = torch.rand(tokens, TOPK, generator=g)
    expert_out = torch.empty(ep.experts_per_rank, world * tokens, HIDDEN, dtype=torch.bfloat16)
    p = ep.protocol
    modes = ("auto", "decode", "prefill") if not puts else ("auto",)
    for mode in modes:
        for slot in range(slots):
            p.dispatch(slot, x, ids, weights, slot + 1, mode)
    for slot in range(slots):
        p.combine(slot, slot, expert_out, None, ids, tokens)
    return recorder.calls


def _time_one(args):
    """Compile one variant for sm_90 in this process; seconds per stage."""
    fn_module, fn_name, signature, constexprs, attrs, options = args
    import importlib
    fn = getattr(importlib.import_module(fn_module), fn_name)
    times = {}
    original = ASTSource.make_ir

    def make_ir(self, *a, **k):
        start = time.perf_counter()
        try:
            return original(self, *a, **k)
        finally:
            times["ast"] = time.perf_counter() - start

    ASTSource.make_ir = make_ir
    add_stages = type(BACKEND).add_stages

    def timed_stages(self, stages, options, language):
        add_stages(self, stages, options, language)
        for name, stage in list(stages.items()):
            def wrapped(src, metadata, stage=stage, name=name):
                start = time.perf_counter()
                try:
                    return stage(src, metadata)
                finally:
                    times[name] = time.perf_counter() - start
            stages[name] = wrapped

    type(BACKEND).add_stages = timed_stages
    from triton._C.libtriton import llvm
    originals = {name: getattr(llvm, name) for name in ("link_extern_libs", "optimize_module")}
    for name, function in originals.items():
        def timed(*a, function=function, name=name, **k):
            start = time.perf_counter()
            try:
                return function(*a, **k)
            finally:
                times[name] = times.get(name, 0) + time.perf_counter() - start
        setattr(llvm, name, timed)
    start = time.perf_counter()
    compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=SM90, options=options)
    total = time.perf_counter() - start
    ASTSource.make_ir = original
    type(BACKEND).add_stages = add_stages
    for name, function in originals.items():
        setattr(llvm, name, function)
    import hashlib
    digest = hashlib.sha1(compiled.asm["cubin"]).hexdigest()[:10]
    return total, times, _registers(compiled.asm["cubin"]), len(compiled.asm.get("ptx", "")), digest


def _registers(cubin: bytes):
    """Registers a thread, from cuobjdump --dump-resource-usage on the cubin (Triton's own cuobjdump)."""
    import re
    import subprocess
    from triton.backends.nvidia.compiler import get_ptxas
    tool = os.path.join(os.path.dirname(get_ptxas(90).path), "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+)", text)
    return int(found.group(1)) if found else None


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--tokens", default="16,128,512,4096")
    parser.add_argument("--paths", default="pointers,puts")
    parser.add_argument("--bitcode", default=None, help="NVSHMEM's device bitcode, for the put path")
    parser.add_argument("--prune", action="store_true",
                        help="link the bitcode pruned as runtime.device_library does (nvshmem_library.pruned)")
    parser.add_argument("--list", action="store_true", help="list the variants without compiling")
    parser.add_argument("--jobs", type=int, default=1, help="compile this many variants at once (processes)")
    parser.add_argument("--slots", type=int, default=2, help="replay the calls of this many slots (1: slot 0's)")
    parser.add_argument("--only", default=None, help="compile only kernels whose name contains this")
    args = parser.parse_args()
    BITCODE[0] = args.bitcode or BITCODE[0]
    if args.bitcode and args.prune:
        from moe_ep.nvshmem_library import pruned
        BITCODE[0] = pruned(args.bitcode)
    seen, order = {}, []          # key -> (name, constants, compile arguments); first meeting order
    for world in map(int, args.worlds.split(",")):
        for tokens in map(int, args.tokens.split(",")):
            for path in args.paths.split(","):
                puts = path == "puts"
                fresh = []
                for bound, values in benchmark_calls(world, tokens, puts, slots=args.slots):
                    key, name, shown, compile_args = variant(bound, values)
                    if key not in seen:
                        seen[key] = (name, shown, compile_args)
                        order.append((world, tokens, path, key))
                        fresh.append(name)
                print(f"world {world}, {tokens:4} tokens, {path:8}: {len(fresh)} new variants {fresh}", flush=True)
    print(f"{len(order)} variants in all", flush=True)
    if args.list:
        for world, tokens, path, key in order:
            name, shown, _ = seen[key]
            print(world, tokens, path, name, shown)
        return
    todo = []
    for world, tokens, path, key in order:
        name, shown, (signature, constexprs, attrs, options) = seen[key]
        if args.only and args.only not in name:
            continue
        if path == "puts" and not args.bitcode:
            print(f"skip (no --bitcode): world {world} {tokens} {path} {name}")
            continue
        todo.append(((world, tokens, path, name, shown), ("moe_ep.kernels.all_to_all", name, signature, constexprs,
                                                         attrs, options)))
    print("world tokens path kernel | total s | " + " ".join(STAGES) + " (link, O3) | regs | ptx KB | cubin sha1 | constexprs", flush=True)
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for (label, _), result in zip(todo, pool.map(_time_one, [job for _, job in todo])):
            world, tokens, path, name, shown = label
            total, times, regs, ptx, digest = result
            stages = " ".join(f"{times.get(s, 0):.1f}" for s in STAGES)
            stages += " (link {:.1f}, O3 {:.1f})".format(*(times.get(s, 0) for s in LLIR_PARTS))
            interesting = {k: v for k, v in shown.items() if k in (
                "BLOCK_GROUPS", "COMPARE", "CHUNK_IDS", "EXPERTS_BLOCK", "NUM_BINS", "SCAN_CHUNKS", "SCAN_EXPERTS",
                "WORLD_PAD", "PUTS", "BLOCK_H", "RECV_BLOCK_H")}
            print(f"{world} {tokens} {path} {name} | {total:.1f} | {stages} | {regs} | {ptx // 1024} | {digest} | {interesting}",
                  flush=True)


if __name__ == "__main__":
    main()
