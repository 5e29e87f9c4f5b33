"""BoundKernel's compiled path and resident_programs, on any machine: the compiled kernel, its
launcher and the device's properties are stand-ins, so what is checked is the host side alone:
which arguments reach the launcher, when a call compiles, and how far a grid is cut."""
from types import SimpleNamespace

import pytest
import torch
import triton
import triton.language as tl

from moe_ep import launcher

H100 = SimpleNamespace(regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048,
                       shared_memory_per_multiprocessor=233472)


def compiled(registers: int, warps: int = 4, shared: int = 0):
    return SimpleNamespace(n_regs=registers, metadata=SimpleNamespace(num_warps=warps, shared=shared))


@pytest.mark.parametrize("registers,warps,shared,programs", [
    (124, 4, 0, 4),         # registers: 124 x 32 rounds up to 3968 a warp, 16 warps of 65536
    (80, 4, 0, 6),          # 2560 a warp: 25 warps
    (32, 4, 0, 16),         # threads: 2048 / 128
    (32, 1, 0, 32),         # the block limit
    (32, 4, 100_000, 2),    # shared memory: 233472 / (100000 + 1024)
    (255, 8, 0, 1),
])
def test_resident_programs(registers, warps, shared, programs, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: H100)
    assert launcher.resident_programs(compiled(registers, warps, shared), 0) == programs


@triton.jit
def _kernel(x_ptr, n, peers, scale, BLOCK: tl.constexpr):
    pass


class Compiled:
    """A compiled kernel's stand-in: records each launch (grid, stream, arguments, launch metadata and
    hooks)."""

    def __init__(self, registers):
        self.n_regs, self.metadata = registers, SimpleNamespace(num_warps=4, shared=0)
        self.function, self.packed_metadata, self.launches = object(), object(), []

    def _init_handles(self):
        pass

    def launch_metadata(self, grid, stream, *args):
        return {"grid": grid, "stream": stream}

    def run(self, grid_x, grid_y, grid_z, stream, function, packed_metadata, metadata, enter, exit, *args):
        assert (grid_y, grid_z, function, packed_metadata) == (1, 1, self.function, self.packed_metadata)
        self.launches.append((grid_x, stream, args, metadata, enter, exit))


def compiled_path(monkeypatch, kernel) -> list:
    """BoundKernel's compiled path on an H100 stand-in, stream 7, with `kernel`'s compilations recorded
    (each a Compiled of 124 registers: 4 programs an SM); returns the list they are appended to."""
    monkeypatch.setattr(launcher, "INTERPRETING", False)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: H100)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 7, raising=False)
    compilations = []

    def warmup(**arguments):
        compilations.append(arguments)
        return Compiled(registers=124)

    monkeypatch.setattr(kernel, "warmup", warmup)
    return compilations


def test_bound_kernel_launches_through_the_compiled_launcher(monkeypatch):
    """Fixed arguments once (tensors as addresses), the varying ones per call; one compilation per
    specialization (dtype and 16-byte alignment of a tensor, an int being 1 or a multiple of 16); a
    resident grid cut to what the SMs hold."""
    compilations = compiled_path(monkeypatch, _kernel)
    peers = torch.arange(4, dtype=torch.int64)
    kernel = launcher.BoundKernel(_kernel, 1000, ("x_ptr", "n"), resident_on=10, peers=peers, scale=3,
                                  BLOCK=64, num_warps=4)
    x = torch.zeros(64)
    kernel(x, 5)
    kernel(torch.zeros(64), 6)
    assert len(compilations) == 1
    assert compilations[0]["grid"] == (1000,) and compilations[0]["num_warps"] == 4
    assert compilations[0]["x_ptr"] is x and compilations[0]["peers"] is peers
    kernel(x, 1)                                      # n == 1: another specialization
    kernel(x[1:], 5)                                  # not 16-byte aligned: another
    kernel(x.double(), 5)                             # another dtype: another
    assert len(compilations) == 4
    launches = [launch for c in {id(c): c for c in kernel._compiled.values()}.values() for launch in c[0].launches]
    assert {launch[:2] for launch in launches} == {(40, 7)}             # 4 programs an SM x 10 SMs
    first = kernel._compiled[torch.float32, True, False, False][0].launches[0]
    assert first[2] == (x.data_ptr(), 5, peers.data_ptr(), 3, 64)
    assert first[3:] == (None, None, None)                            # no launch hook set: none passed


@triton.jit(do_not_specialize=["n"])
def _unspecialized(x_ptr, n, peers, scale, BLOCK: tl.constexpr):
    pass


def test_bound_kernel_takes_fewer_programs_per_call_and_keys_only_what_triton_specializes(monkeypatch):
    """programs= launches that many programs, never more than the (resident) grid; an int in the kernel's
    do_not_specialize takes no part in the specialization key, so its values share one compilation."""
    compilations = compiled_path(monkeypatch, _unspecialized)
    kernel = launcher.BoundKernel(_unspecialized, 1000, ("x_ptr", "n"), resident_on=10, peers=torch.zeros(1),
                                  scale=3, BLOCK=64)
    x = torch.zeros(64)
    for n, programs in ((1, None), (16, 12), (5, 39), (7, 41), (0, 1)):
        kernel(x, n, programs=programs)
    assert len(compilations) == 1
    launches = kernel._compiled[torch.float32, True][0].launches
    assert [(grid, args[1]) for grid, _, args, *_ in launches] == [(40, 1), (12, 16), (39, 5), (40, 7), (1, 0)]


def test_bound_kernel_cuts_its_grid_no_lower_than_fewest(monkeypatch):
    """A grid cut to one wave keeps `fewest` programs where the SMs hold fewer (a kernel whose programs take
    roles by program id needs one of each), and never more than the bound grid."""
    compiled_path(monkeypatch, _kernel)
    x = torch.zeros(64)
    for grid, fewest, launched in ((1000, 50, 50), (1000, 30, 40), (45, 50, 45)):
        kernel = launcher.BoundKernel(_kernel, grid, ("x_ptr", "n"), resident_on=10, fewest=fewest,
                                      peers=torch.zeros(1), scale=3, BLOCK=64)
        kernel(x, 5)
        kernel(x, 5, programs=1000)
        assert [launch[0] for launch in kernel._compiled[torch.float32, True, False, False][0].launches] == \
            [launched, launched]


def test_bound_kernel_passes_launch_hooks_once_one_is_set(monkeypatch):
    monkeypatch.setattr(launcher, "INTERPRETING", False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 7, raising=False)
    compiled = Compiled(registers=32)
    monkeypatch.setattr(_kernel, "warmup", lambda **arguments: compiled)
    kernel = launcher.BoundKernel(_kernel, 8, ("x_ptr", "n"), peers=torch.zeros(1), scale=1, BLOCK=16)
    on_enter, on_exit = launcher.knobs.runtime.launch_enter_hook, launcher.knobs.runtime.launch_exit_hook
    assert launcher.launch_hooks() == (None, None)
    hook = lambda metadata: None                      # noqa: E731
    on_enter.add(hook)
    try:
        assert launcher.launch_hooks() == (on_enter, on_exit)
        kernel(torch.zeros(4), 3)
    finally:
        on_enter.remove(hook)
    assert compiled.launches[-1][3:] == ({"grid": (8, 1, 1), "stream": 7}, on_enter, on_exit)
    kernel(torch.zeros(4), 3)
    assert compiled.launches[-1][3:] == (None, None, None)


def test_bound_kernel_refuses_a_kernel_that_does_not_fit(monkeypatch):
    monkeypatch.setattr(launcher, "INTERPRETING", False)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(**{**vars(H100), "regs_per_multiprocessor": 2048}))
    monkeypatch.setattr(_kernel, "warmup", lambda **arguments: Compiled(registers=255))
    kernel = launcher.BoundKernel(_kernel, 8, ("x_ptr", "n"), resident_on=4, peers=torch.zeros(1), scale=1, BLOCK=16)
    with pytest.raises(RuntimeError, match="does not fit on an SM"):
        kernel(torch.zeros(4), 3)


def test_bound_kernel_names_unknown_and_missing_arguments():
    with pytest.raises(TypeError, match=r"unknown arguments \['bogus'\], missing \['scale'\]"):
        launcher.BoundKernel(_kernel, 8, ("x_ptr", "n"), peers=torch.zeros(1), bogus=1, BLOCK=16)


def test_shared_kernel_is_made_once_per_grid_and_compile_time_arguments(monkeypatch):
    """shared_kernel keeps one BoundKernel per (kernel, grid, varying names, fixed arguments, GPU): the same
    arguments find it again, any other one makes another; the launches go through it."""
    compilations = compiled_path(monkeypatch, _kernel)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(launcher, "_SHARED", {})
    fixed = dict(peers=None, scale=3, BLOCK=64, num_warps=4)
    first = launcher.shared_kernel(_kernel, 8, ("x_ptr", "n"), **fixed)
    assert launcher.shared_kernel(_kernel, 8, ("x_ptr", "n"), **fixed) is first
    others = [launcher.shared_kernel(_kernel, 16, ("x_ptr", "n"), **fixed),
              launcher.shared_kernel(_kernel, 8, ("x_ptr", "n"), **{**fixed, "BLOCK": 128}),
              launcher.shared_kernel(_kernel, 8, ("x_ptr", "n"), **{**fixed, "num_warps": 8})]
    assert len({id(k) for k in [first, *others]}) == 4
    first(torch.zeros(64), 5)
    assert len(compilations) == 1 and compilations[0]["grid"] == (8,) and compilations[0]["BLOCK"] == 64


def test_host_arithmetic_agrees_with_triton():
    """cdiv and next_power_of_2, the plain-Python forms the launches use per call, give Triton's values."""
    for n in range(1, 3000):
        assert launcher.next_power_of_2(n) == triton.next_power_of_2(n)
        for d in (1, 3, 16, 128):
            assert launcher.cdiv(n, d) == triton.cdiv(n, d)
    assert launcher.cdiv(0, 64) == 0
