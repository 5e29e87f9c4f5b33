"""NVSHMEM lifetime for a torch.distributed job: init, symmetric tensors, peer pointers, finalize.

One process owns one NVSHMEM processing element (PE) on one GPU; PE numbers equal the ranks of
the process group NVSHMEM was started on (the default group unless the first object that starts
it names another). A job may run more ranks than GPUs (shared-GPU mode: rank r on GPU r % GPUs,
gloo for the host group, CUDA MPS underneath; ``moe_ep.mps``). Everything here is host code and
imports nothing else from the package but ``mps`` (standard library only), ``refusals`` (torch.distributed
and ``collectives``, its collectives for tensors on any device) and ``nvshmem_library`` (Triton's LLVM
bindings).

    import torch.distributed as dist
    from moe_ep import runtime

    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    runtime.init()                              # UID bootstrap over the process group, no MPI
    buf = runtime.symmetric_zeros((1024,), torch.float32)   # collective: same call on every rank
    peer = runtime.peer_ptr(buf, (rank + 1) % world)         # NVLink address of the peer's copy
    ...
    runtime.finalize()                          # frees what is still allocated, then NVSHMEM

Kernels that call NVSHMEM device functions (``moe_ep.shmem``) are launched with
``extern_libs=runtime.device_library()``; a Triton post-compile hook installed by
``init`` runs ``nvshmemx_cumodule_init`` on every such module before its first launch.

Host-side moves that use no SM: ``put_on_stream`` (copy engine) and ``stream_write_value``
(a flag written by the stream itself), and ``StreamMoves``, the two bound to one stream for host paths that
make several a call. ``CommObject`` is the base of the objects that own
symmetric buffers (EPAllToAll, AsyncTP): destroy(), check(), CommTimeoutError, and (``moe_ep.refusals``)
the exchanges by which every rank of a group learns that some rank refused a call (CallRefusedError) or was
built differently.
"""
from __future__ import annotations

import importlib.util
import math
import os
import warnings

import torch
import torch.distributed as dist

from . import mps
from .refusals import CallRefusedError, Refusals

__all__ = [
    "NvshmemUnavailable", "ranks_per_gpu", "usable_sms", "init_distributed", "finalize_distributed", "init",
    "heap_size", "finalize", "is_initialized", "symmetric_empty", "symmetric_zeros", "free", "peer_ptr",
    "peer_tensor", "device_library", "barrier", "CommTimeoutError", "CallRefusedError", "nvshmem_unavailable",
    "stream_write_value", "put_on_stream", "StreamMoves", "CommObject",
]

HEAP_VARIABLE = "NVSHMEM_SYMMETRIC_SIZE"
DEFAULT_HEAP = 1 << 30                 # NVSHMEM's own default


def heap_size() -> int:
    """Bytes of the symmetric heap per GPU, from NVSHMEM_SYMMETRIC_SIZE (e.g. 4G, 512M, 1073741824)."""
    text = os.environ.get(HEAP_VARIABLE, "").strip().upper()
    if not text:
        return DEFAULT_HEAP
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    if text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


class NvshmemUnavailable(RuntimeError):
    """NVSHMEM cannot be used in this process (package missing, no GPU, ...)."""


class CommTimeoutError(RuntimeError):
    """A device-side wait ran past its bound; the object that raised it cannot be used again."""


class CommObject(Refusals):
    """What the host objects (EPAllToAll, AsyncTP) share: symmetric buffers that destroy() frees,
    the status of their kernels' bounded waits, which check() turns into CommTimeoutError, and
    (``refusals.Refusals``) the checks of each call, with the exchanges by which every rank learns
    that some rank refused it.

    Subclasses set `_symmetric` (name -> symmetric tensor), their status words (``_watch_status``),
    `_broken` (None), `rank`, `world`, `backend`, `timeout_s`, and TAGS (status tag -> what was waited for).
    """

    TAGS: dict[int, str] = {}
    REPORT_WORDS = 5         # _status's timeout report: [code, peer, tag, value seen, target] (shmem.STATUS_WORDS)

    @staticmethod
    def _place(group, backend: str, device=None) -> torch.device | None:
        """Where the caller's tensors live, checked before anything starts (no collective): `device` (a
        torch.device or a name), else the default below; ValueError where the backend cannot run there.

        The reference backend takes any device (CPU tensors on an NCCL group and GPU tensors on a gloo
        group cross it as copies); without one, this process's GPU when the group is NCCL or ranks share a
        GPU, else the CPU. The nvshmem backend runs on this process's GPU only: None (that GPU, once
        NVSHMEM has started), or that GPU given."""
        device = checked_device(device)
        if backend == "reference":
            on_gpu = dist.get_backend(group) == "nccl" or ranks_per_gpu() > 1
            return device or (_this_gpu() if on_gpu else torch.device("cpu"))
        if torch.cuda.device_count() == 0:
            raise ValueError(f"the nvshmem backend needs this process's GPU, and {nvshmem_unavailable()}: "
                             "use backend='reference'")
        if device is not None and (device.type != "cuda" or device != _this_gpu()):
            raise ValueError(f"the nvshmem backend runs on this process's GPU ({_this_gpu()}), and the tensors it "
                             f"was built for are on {device}: move them (the model) there first, or use "
                             "backend='reference'")
        return device

    def _open(self, group, backend: str, device=None) -> int | None:
        """Set `group` and `device` (``_place``'s). For the nvshmem backend, start NVSHMEM and return the
        smallest SM count in the group (grids must be the same on every rank); None for the reference
        backend."""
        self.group, self.device = group, self._place(group, backend, device)
        if backend == "reference":
            return None
        init(group)
        self.device = _this_gpu()
        on = self.device if dist.get_backend(group) == "nccl" else "cpu"   # gloo with several ranks per GPU
        sms = torch.tensor([usable_sms(self.device)], device=on)
        dist.all_reduce(sms, op=dist.ReduceOp.MIN, group=group)
        return int(sms.item())

    def destroy(self) -> None:
        """Free the symmetric buffers (collective). The object cannot be used afterwards. Idempotent, and
        a no-op for the buffers once ``finalize`` has freed them with the rest of NVSHMEM."""
        if self._symmetric and _state["initialized"]:
            barrier()
            for buf in self._symmetric.values():
                free(buf)
        self._symmetric.clear()
        self._broken = "destroyed"

    def check(self) -> None:
        """Wait for the device, then raise CommTimeoutError if a wait of this object timed out."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._raise_if_failed()

    def _context(self) -> str:
        """What to add to a timeout message (e.g. call counts)."""
        return ""

    def _watch_status(self, status: torch.Tensor | None) -> None:
        """Take `status` as this object's status words (int32 in host memory, written by the kernels: the
        timeout report of moe_ep.shmem first; None where no kernel reports), with a memoryview of them: every
        call reads the first word (``_raise_if_failed``), 0.015 us a word through it (a Python int), 0.03 us
        through NumPy (a NumPy scalar), 1 us indexing the tensor."""
        self._status = status
        self._words = None if status is None else memoryview(status.numpy())

    def _raise_if_failed(self) -> None:
        """Raise if destroyed, or if the status [code, peer, tag, value seen, target] reports a timeout
        (CallRefusedError where peers' notes say they refused the call: ``_raise_refused``). Every call asks
        this first, so the common answer, nothing to raise, is one test."""
        if self._broken or (self._words is not None and self._words[0]):
            self._raise_failure()

    def _raise_failure(self) -> None:
        """``_raise_if_failed``'s raise, once its test found something."""
        if self._broken == "destroyed":
            raise RuntimeError(f"this {type(self).__name__} was destroyed")
        if self._broken:
            raise CommTimeoutError(self._broken)
        _, peer, tag, seen, target = self._status.tolist()[:self.REPORT_WORDS]
        timeout = self._break(f"rank {self.rank}: {self.TAGS.get(tag, 'wait')} timed out after {self.timeout_s}s "
                              f"waiting for rank {peer} (signal count {seen}, expected {target}){self._context()}")
        self._raise_refused(timeout)
        raise timeout

    def _break(self, reason: str) -> CommTimeoutError:
        """Break this object for `reason` (every later call raises it); the CommTimeoutError to raise now."""
        self._broken = reason
        return CommTimeoutError(reason)

    def _expect(self, name: str, t, dtypes, dim=None, shape=None, contiguous: bool = True) -> None:
        """ValueError unless `t` is a tensor on this object's device with one of `dtypes` (and the
        given dim, shape, contiguity): checked before any launch."""
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in dtypes:
            raise ValueError(f"{name} has dtype {t.dtype}, expected {' or '.join(map(str, dtypes))}")
        if t.device != self.device:
            raise ValueError(f"{name} is on {t.device}, expected {self.device}")
        if dim is not None and t.dim() != dim:
            raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
        if contiguous and not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")


_state = {"initialized": False, "hook_installed": False, "ranks": (), "group": None,   # group: NVSHMEM's ranks
          "probe": None}                                                              # reaches()'s word
_owned: dict[int, torch.Tensor] = {}   # data_ptr -> symmetric tensor this module allocated
_modules: list[int] = []               # CUmodule handles of compiled kernels that link NVSHMEM


def _this_gpu() -> torch.device:
    """This process's GPU (torch.cuda.current_device, which init_distributed sets)."""
    return torch.device("cuda", torch.cuda.current_device())


def checked_device(device) -> torch.device | None:
    """`device` (a torch.device, a string like "cuda:1", or None) as a torch.device, "cuda" without an index
    meaning this process's GPU; ValueError for a name torch does not know, a CUDA device on a machine (or a
    build of torch) without one, or an index past the GPUs visible."""
    if device is None:
        return None
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device must be a torch.device or a device name such as 'cpu' or 'cuda:0', got {device!r}") \
            from error
    if device.type == "cuda":
        if torch.cuda.device_count() == 0:
            raise ValueError(f"device {device}: no CUDA GPU is usable here (torch {torch.__version__}, "
                             f"{torch.cuda.device_count()} GPUs visible); use device='cpu'")
        if device.index is None:
            return _this_gpu()
        if device.index >= torch.cuda.device_count():
            raise ValueError(f"device {device}: only {torch.cuda.device_count()} CUDA GPUs are visible")
    return device


def check_timeout(timeout_s) -> None:
    """ValueError unless `timeout_s` is a positive, finite number of seconds (the bound of the waits)."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < math.inf:
        raise ValueError(f"timeout_s must be a positive, finite number of seconds, got {timeout_s!r}")


def nvshmem_unavailable() -> str | None:
    """Why the nvshmem backend cannot run in this process (no usable CUDA GPU, nvshmem4py not installed), or
    None; asks without starting CUDA or NVSHMEM."""
    if torch.cuda.device_count() == 0:
        return f"no CUDA GPU is usable here (torch {torch.__version__}, {torch.cuda.device_count()} GPUs visible)"
    if importlib.util.find_spec("nvshmem") is None:
        return "nvshmem4py is not installed (pip install 'moe-ep[nvshmem]', package nvshmem4py-cu13)"
    return None


def _nvshmem():
    try:
        import nvshmem.core as core
        import nvshmem.bindings as bindings
    except ImportError as e:
        raise NvshmemUnavailable(
            "nvshmem4py is not installed: pip install 'moe-ep[nvshmem]' (package nvshmem4py-cu13), "
            "or use backend='reference'") from e
    return core, bindings


def init_distributed(init_method: str | None = None) -> torch.device:
    """Start torch.distributed from torchrun's environment and return this process's device: with a
    GPU per rank, NCCL and GPU LOCAL_RANK; with more ranks than GPUs (shared-GPU mode), gloo (NCCL
    refuses ranks that share a GPU) and GPU LOCAL_RANK % GPUs; without GPUs, gloo on the CPU.
    `init_method` (e.g. a file:// store) replaces torchrun's rendezvous; RANK and WORLD_SIZE still
    come from the environment. A script started without a launcher (``python script.py``: no RANK in the
    environment, no `init_method`) runs as a world of one process, rank 0, with a warning that says how
    to start more (``bash launch.sh script.py``, or torchrun).

    torch.distributed.nn is imported first, while no group exists: its functions take
    ``group=group.WORLD`` as a default argument, so imported later (transformers does, when it
    builds a model) they would keep the default group alive after destroy_process_group, and
    with it gloo's worker threads, which then can abort the process as Python exits.
    """
    import torch.distributed.nn  # noqa: F401  (see above)

    if "RANK" in os.environ:
        meet = {} if init_method is None else dict(init_method=init_method, rank=int(os.environ["RANK"]),
                                                   world_size=int(os.environ["WORLD_SIZE"]))
    elif init_method is None:
        warnings.warn("RANK is not set (the script was not started by launch.sh or torchrun): running as a world of "
                      "one process; `bash launch.sh script.py` starts one process per GPU (two CPU processes "
                      "without a GPU)", stacklevel=2)
        meet = dict(store=dist.HashStore(), rank=0, world_size=1)
    else:
        raise ValueError(f"init_method={init_method!r} needs RANK and WORLD_SIZE in the environment")
    gpus = torch.cuda.device_count()     # counted without starting CUDA, so the share set below still applies
    if gpus == 0:
        if not dist.is_initialized():
            dist.init_process_group("gloo", **meet)
        return torch.device("cpu")
    per_gpu = ranks_per_gpu()
    shared = per_gpu > 1
    if shared:   # read when CUDA starts in this process (launch.sh sets it before the process starts)
        os.environ.setdefault(mps.SHARE_VARIABLE, str(mps.share_percent(per_gpu)))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % gpus)
    torch.cuda.set_device(device)
    if not dist.is_initialized():
        if shared:
            dist.init_process_group("gloo", **meet)
        else:
            dist.init_process_group("nccl", device_id=device, **meet)
    return device


def ranks_per_gpu() -> int:
    """Ranks of this node that share each visible GPU: 1 with a GPU per rank (or none visible); more in
    shared-GPU mode, when LOCAL_WORLD_SIZE (torchrun's; else the default group's size) exceeds the GPUs."""
    gpus = torch.cuda.device_count()
    fallback = dist.get_world_size() if dist.is_initialized() else 1
    return mps.ranks_per_gpu(int(os.environ.get("LOCAL_WORLD_SIZE", fallback)), gpus)


def usable_sms(device=None) -> int:
    """SMs this process's kernels may hold at once: the device's, or in shared-GPU mode this process's
    share (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, which init_distributed sets to 1 / ranks_per_gpu() unless
    given, and which the device count then reflects; without it, the count over ranks_per_gpu()).
    Persistent grids are sized from this, so that the programs of one rank spinning on a peer's
    signal can never hold the SMs that the peer's senders need."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    per_gpu = ranks_per_gpu()
    if per_gpu == 1 or mps.SHARE_VARIABLE in os.environ:
        return sms         # under MPS the device reports the share this process's CUDA context started with
    return max(1, sms // per_gpu)


def is_initialized() -> bool:
    return _state["initialized"]


def init(group: dist.ProcessGroup | None = None) -> None:
    """Start NVSHMEM over the ranks of `group` (default: the default group); collective over them,
    idempotent. PE numbers are ranks in that group. One NVSHMEM world per process: every later call
    (every object on the nvshmem backend) must name a group of the same ranks.

    The unique id is made on the group's first rank and broadcast over torch.distributed; each
    process uses ``torch.cuda.current_device()`` (``init_distributed`` sets it). With several ranks
    per GPU, the CUDA MPS control daemon must be running (``moe_ep.mps``).
    """
    if not dist.is_initialized():
        raise RuntimeError("moe_ep.runtime.init() needs torch.distributed to be initialized first")
    ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
    if _state["initialized"]:
        if ranks != _state["ranks"]:
            raise ValueError(f"NVSHMEM already spans ranks {list(_state['ranks'])}, and this process group has ranks "
                             f"{list(ranks)}: every NVSHMEM object of a process must use a group of the same ranks")
        return
    if not torch.cuda.is_available():
        raise NvshmemUnavailable("NVSHMEM needs CUDA GPUs; none is visible (use backend='reference' on CPU)")
    per_gpu = ranks_per_gpu()
    if per_gpu > 1 and not mps.listening():
        raise NvshmemUnavailable(f"{per_gpu} ranks share each GPU here, which NVSHMEM can do only under CUDA MPS, "
                                 f"and no MPS control daemon listens at {mps.pipe_directory()}: {mps.HOW_TO_START}")
    core, _ = _nvshmem()
    from cuda.core import Device

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    device = Device(torch.cuda.current_device())
    device.set_current()
    uid = [core.get_unique_id(empty=rank != 0)]
    dist.broadcast_object_list(uid, src=ranks[0], group=group)
    core.init(device=device, uid=uid[0], rank=rank, nranks=world, initializer_method="uid")
    _state.update(initialized=True, ranks=ranks, group=group)
    _install_compile_hook()
    for module in _modules:   # modules compiled before a finalize/init cycle
        _cumodule_init(module)


def finalize() -> None:
    """Free every symmetric tensor still owned, then stop NVSHMEM (collective, idempotent)."""
    if not _state["initialized"]:
        return
    core, _ = _nvshmem()
    torch.cuda.synchronize()
    for t in list(_owned.values()):
        free(t)
    core.finalize()
    _state.update(initialized=False, ranks=(), group=None, probe=None)


def finalize_distributed() -> None:
    """The end of an init_distributed job (collective): NVSHMEM finalized if it was started, a
    barrier, so that no rank tears down while a peer still talks to it, then the process group
    destroyed (its gloo threads with it: a gloo thread alive as Python exits can abort the process)."""
    finalize()
    dist.barrier()
    dist.destroy_process_group()


def barrier() -> None:
    """Device-synchronize, then a host barrier over the ranks NVSHMEM spans."""
    torch.cuda.synchronize()
    dist.barrier(group=_state["group"])


def symmetric_empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """A tensor on the NVSHMEM symmetric heap (collective: same shape and dtype on every rank)."""
    if not _state["initialized"]:
        raise RuntimeError("call moe_ep.runtime.init() before allocating symmetric memory")
    core, _ = _nvshmem()
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    used = sum(t.numel() * t.element_size() for t in _owned.values())
    message = (f"symmetric allocation of {nbytes / 2**20:.1f} MiB with {used / 2**20:.1f} MiB in use does not fit "
               f"the symmetric heap of {heap_size() / 2**20:.0f} MiB: raise {HEAP_VARIABLE} (launch.sh --heap) "
               "before the job starts")
    if used + nbytes > heap_size():        # checked here: NVSHMEM's own failure can take the process down
        raise RuntimeError(message)
    try:
        t = core.tensor(tuple(shape), dtype=dtype)
    except Exception as e:
        raise RuntimeError(f"{message} ({e})") from e
    _owned[t.data_ptr()] = t
    return t


def symmetric_zeros(shape, dtype: torch.dtype) -> torch.Tensor:
    t = symmetric_empty(shape, dtype)
    t.zero_()
    return t


def free(t: torch.Tensor) -> None:
    """Give a symmetric tensor back (collective). The tensor must not be used afterwards."""
    core, _ = _nvshmem()
    if _owned.pop(t.data_ptr(), None) is None:
        raise ValueError("not a symmetric tensor owned by moe_ep.runtime (or freed already)")
    core.free_tensor(t)


def peer_ptr(t: torch.Tensor, pe: int) -> int | None:
    """Address through which this GPU loads/stores `pe`'s copy of `t` (NVLink), or None."""
    _, bindings = _nvshmem()
    address = bindings.ptr(t.data_ptr(), pe)
    return int(address) or None


def reaches(pe: int) -> bool:
    """Whether NVSHMEM gives this GPU a peer pointer to `pe` (NVLink, or the same GPU): asked of a
    symmetric word allocated once, at the first call (collective then), and freed by finalize."""
    if _state.get("probe") is None:
        _state["probe"] = symmetric_zeros((1,), torch.int64)
    return peer_ptr(_state["probe"], pe) is not None


def peer_tensor(t: torch.Tensor, pe: int) -> torch.Tensor:
    """A torch view of `pe`'s copy of symmetric tensor `t` (needs a peer pointer)."""
    core, _ = _nvshmem()
    if peer_ptr(t, pe) is None:
        raise ValueError(f"rank {pe} has no peer pointer from rank {dist.get_rank()} (not NVLink/P2P reachable)")
    return core.get_peer_tensor(t, pe)


class StreamMoves:
    """Moves that use no SM, issued to one stream: a copy to a peer through NVSHMEM (the copy engine between
    NVLink peers) and a 64-bit value written by the stream's front end. What each would otherwise make again
    per call (the modules, the stream's handles, the driver's argument objects) is made once here, and a put
    takes addresses unchecked: a host path that makes several a call (AsyncTP's copy engine: a copy and a
    flag per peer) pays a few microseconds each on the GPU hosts' cold caches instead of about a dozen
    (benchmarks/NOTES.md)."""

    def __init__(self, stream: torch.cuda.Stream):
        from cuda.bindings import driver

        self._bindings = None                         # NVSHMEM's, at the first put (writes need only the driver)
        self._driver, self._handle = driver, stream.cuda_stream
        self._stream = driver.CUstream(self._handle)
        self._pointers: dict[int, object] = {}        # address -> its CUdeviceptr
        self._values: dict[int, object] = {}          # value -> its cuuint64_t

    def put(self, dst_address: int, src_address: int, nbytes: int, pe: int) -> None:
        """Copy `nbytes` from device `src_address` to `pe`'s copy of the symmetric memory at `dst_address` (this
        rank's address of it), in stream order."""
        if self._bindings is None:
            _, self._bindings = _nvshmem()
        self._bindings.putmem_on_stream(dst_address, src_address, nbytes, pe, self._handle)

    def write(self, address: int, value: int) -> None:
        """Write the 64-bit `value` at device `address` (local, or a peer pointer) from the stream's front end
        once its earlier work is done, behind a memory fence (cuStreamWriteValue64)."""
        driver = self._driver
        pointer = self._pointers.get(address)
        if pointer is None:
            pointer = self._pointers[address] = driver.CUdeviceptr(address)
        number = self._values.get(value)
        if number is None:
            number = self._values[value] = driver.cuuint64_t(value)
        (err,) = driver.cuStreamWriteValue64(self._stream, pointer, number, 0)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuStreamWriteValue64 failed: {err}")


def stream_write_value(address: int, value: int, stream: torch.cuda.Stream | None = None) -> None:
    """Write the 64-bit `value` at device `address` (local, or a peer pointer) from `stream`'s front
    end once the stream's earlier work is done, behind a memory fence (cuStreamWriteValue64).

    No SM takes part: a persistent kernel that holds every SM and waits for this flag cannot
    keep the write from happening, as it could keep a flag-setting kernel from starting.
    """
    StreamMoves(stream or torch.cuda.current_stream()).write(address, value)


def put_on_stream(dst: torch.Tensor, src: torch.Tensor, pe: int, stream: torch.cuda.Stream | None = None) -> None:
    """Copy contiguous `src` into `pe`'s copy of `dst` (a view of a symmetric tensor, named by its
    local address), in `stream` order. Between NVLink peers NVSHMEM moves it with the copy engine."""
    _nvshmem()
    if not (dst.is_contiguous() and src.is_contiguous()) or dst.numel() * dst.element_size() != \
            src.numel() * src.element_size():
        raise ValueError("put_on_stream needs contiguous tensors of the same size in bytes")
    StreamMoves(stream or torch.cuda.current_stream()).put(dst.data_ptr(), src.data_ptr(),
                                                            src.numel() * src.element_size(), pe)


_libraries: dict[str, str] = {}       # NVSHMEM's device bitcode -> what kernels link (``device_library``)


def device_library() -> dict[str, str]:
    """``extern_libs`` for kernels that call ``moe_ep.shmem`` device functions: NVSHMEM's device bitcode cut to
    the functions moe_ep.shmem calls (``nvshmem_library.pruned``: the same cubins, without parsing 31 MB of
    bitcode on every compile), or the whole bitcode where it cannot be cut."""
    core, _ = _nvshmem()
    library = core.find_device_bitcode_library()
    if library not in _libraries:
        from .nvshmem_library import pruned
        try:
            _libraries[library] = pruned(library)
        except Exception as e:      # noqa: BLE001 (any failure: link the whole library, as before)
            warnings.warn(f"linking all of {library}: it could not be cut to moe_ep.shmem's functions ({e!r})")
            _libraries[library] = library
    return {"libnvshmem_device": _libraries[library]}


# -- module init for kernels that link NVSHMEM -------------------------------------------------------

def _cumodule_init(module: int) -> None:
    _, bindings = _nvshmem()
    status = bindings.cumodule_init(module)
    if status:
        raise RuntimeError(f"nvshmemx_cumodule_init failed with status {status}")


def _init_nvshmem_module(*args, **kwargs):
    """Triton jit_post_compile_hook: run nvshmemx_cumodule_init on modules that link NVSHMEM.

    The filter is the compile options' extern_libs (a text search of the PTX would be
    fooled by file names); the module handle comes from the freshly cached kernel.
    """
    options = kwargs["compile"]
    if "libnvshmem_device" not in dict(options.get("extern_libs") or ()):
        return
    kernel = kwargs["fn"].jit_function.device_caches[options["device"]][0][kwargs["key"]]
    kernel._init_handles()
    module = int(kernel.module)
    if module not in _modules:
        _modules.append(module)
        if _state["initialized"]:
            _cumodule_init(module)


def _install_compile_hook() -> None:
    if _state["hook_installed"]:
        return
    import triton

    previous = triton.knobs.runtime.jit_post_compile_hook

    def hook(*args, **kwargs):
        result = previous(*args, **kwargs) if previous is not None else None
        _init_nvshmem_module(*args, **kwargs)
        return result

    triton.knobs.runtime.jit_post_compile_hook = hook
    _state["hook_installed"] = True
