"""moe_ep.graphs: the scratch that replayed graphs write into (how it is carved and replaced), and when the MoE
layer's plans and forwards launch, capture, replay or capture again (with CUDA's calls, and the pointing of a
graph's kernels at other tensors, faked on CPU); the capture and replay themselves run on GPUs, in the MoE
layer's eager forwards (tests/test_moe_layer.py), and kernel_nodes' pure parts in tests/test_kernel_nodes.py."""
import gc
import warnings

import pytest
import torch

from moe_ep import graphs, kernel_nodes
from moe_ep.graphs import ALIGN, Scratch
from moe_ep.layers.moe import _Forward, _Planned

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
    other = Scratch.of(device, stream + 1, 10)                        # another stream's: apart from this one's
    assert Scratch.of(device, stream, 10) is second and Scratch.of(device, stream + 1, 5) is other
    assert Scratch.of(device, stream, 3000).memory.numel() == 4096    # never smaller than the one it replaces
    del second
    gc.collect()
    assert graphs._SCRATCH.get((device, stream)) is None               # nothing holds it: gone
    assert Scratch.of(device, stream, 10).memory.numel() == 10


class FakeExperts:
    """What _Planned uses of a GatedMLP: its device, the buffers a call writes (`made`), launch(*buffers) and a
    call that launches into new buffers. A launch writes its ordinal into out."""

    def __init__(self, rows=4):
        self.device, self.launches = torch.device("cpu"), 0
        self.made = (((rows, 3), torch.float32), ((rows,), torch.float32))

    def launch(self, scratch_rows, out):
        self.launches += 1
        return out.fill_(self.launches)

    def __call__(self):
        return self.launch(*(torch.empty(shape, dtype=dtype) for shape, dtype in self.made))


class FakeGraph:
    """A captured graph on CPU: launch and the args it was captured on (a list: FakeMoved points it elsewhere),
    and whether it was kept (keep_graph); a replay calls launch on them."""

    def __init__(self, launch, args, kept):
        self.launch, self.args, self.kept = launch, list(args), kept

    def replay(self):
        self.launch(*self.args)


class FakeMoved:
    """kernel_nodes.MovedPointers on CPU: point_at(tensors) replaces the first len(tensors) args of the graph,
    so the next replay runs on them; raises `state["move_fail"]` at construction where set."""
    state: dict = {}

    def __init__(self, graph, tensors):
        if self.state["move_fail"]:
            raise self.state["move_fail"]
        assert graph.kept, "MovedPointers reads the captured graph: capture(..., keep_graph=True)"
        self.graph = graph
        assert all(a is b for a, b in zip(tensors, graph.args, strict=False))   # captured on the operands, first

    def point_at(self, tensors):
        self.graph.args[:len(tensors)] = tensors


@pytest.fixture
def fake_cuda(monkeypatch):
    """graphs' CUDA calls on CPU: the stream in `state["stream"]`, capturing while `state["capturing"]`, a
    capture that records the launch and its args and replays it by calling it again (or raises
    `state["fail"]`), kernel_nodes.unavailable() giving `state["unavailable"]`, and pointers that are moved by
    FakeMoved (or cannot be: `state["move_fail"]`)."""
    state = {"stream": 1000, "capturing": False, "fail": None, "captures": 0, "unavailable": None,
             "move_fail": None}

    def capture(launch, *args, keep_graph=False):
        if state["fail"]:
            raise state["fail"]
        state["captures"] += 1
        return FakeGraph(launch, args, keep_graph)

    monkeypatch.setattr(graphs, "capture", capture)
    monkeypatch.setattr(graphs, "capturing", lambda cuda: state["capturing"])
    monkeypatch.setattr(graphs, "current_stream", lambda device: state["stream"])
    monkeypatch.setattr(kernel_nodes, "unavailable", lambda: state["unavailable"])
    monkeypatch.setattr(FakeMoved, "state", state)
    monkeypatch.setattr(kernel_nodes, "MovedPointers", FakeMoved)
    return state


def test_a_plan_launches_first_then_replays_on_the_stream_scratch(fake_cuda):
    experts = FakeExperts()
    plan = _Planned(experts)
    first = plan(True)                               # the first call launches: compiles and loads the kernels
    assert fake_cuda["captures"] == 0 and first.eq(1).all()
    second = plan(True)                              # captured, replayed: out is the scratch's
    scratch = graphs._SCRATCH[experts.device, fake_cuda["stream"]]
    assert fake_cuda["captures"] == 1 and second.eq(2).all()
    assert second.untyped_storage().data_ptr() == scratch.memory.untyped_storage().data_ptr()
    third = plan(True)
    assert fake_cuda["captures"] == 1 and third is second and third.eq(3).all()
    launched = plan(False)                           # run_experts: a tensor of its own
    assert launched is not second and launched.eq(4).all() and second.eq(3).all()
    fake_cuda["capturing"] = True                    # inside the caller's capture: launched
    assert plan(True) is not second and fake_cuda["captures"] == 1


def test_a_plan_captures_again_on_another_stream_and_after_its_scratch_is_replaced(fake_cuda):
    experts = FakeExperts()
    plan = _Planned(experts)
    plan(True)
    out = plan(True)
    fake_cuda["stream"] += 1                         # another stream: a graph and a scratch of its own
    other = plan(True)
    assert fake_cuda["captures"] == 2 and len(plan.replays) == 2
    assert other.untyped_storage().data_ptr() != out.untyped_storage().data_ptr()
    fake_cuda["stream"] -= 1
    larger = Scratch.of(experts.device, fake_cuda["stream"], 1 << 20)   # a larger layer's replay replaced it
    again = plan(True)
    assert fake_cuda["captures"] == 3
    assert again.untyped_storage().data_ptr() == larger.memory.untyped_storage().data_ptr()
    assert plan(True) is again and fake_cuda["captures"] == 3


def test_a_failed_capture_warns_once_and_the_stream_launches(fake_cuda):
    experts = FakeExperts()
    plan = _Planned(experts)
    plan(True)
    fake_cuda["fail"] = RuntimeError("operation not permitted when stream is capturing\nmore")
    with pytest.warns(RuntimeWarning, match="could not be captured .RuntimeError: operation not permitted"):
        assert plan(True).eq(2).all()                # launched: the forward goes on
    fake_cuda["fail"] = None
    assert plan(True).eq(3).all() and fake_cuda["captures"] == 0 and plan.replays == {fake_cuda["stream"]: False}


def test_buffers_past_the_cap_are_launched(fake_cuda, monkeypatch):
    monkeypatch.setattr(graphs, "MAX_BYTES", Scratch.size(FakeExperts().made) - 1)
    plan = _Planned(FakeExperts())
    assert [int(plan(True)[0]) for _ in range(3)] == [1, 2, 3] and fake_cuda["captures"] == 0


class FakeEP:
    """What _Forward uses of an EPAllToAll: a dispatch whose handle is the tokens, a combine writing tokens + the
    experts' first row into `out`, its calls (the capture's own counting is CUDA's: faked, nothing counts),
    replayed() and rewind()."""

    def __init__(self):
        self.calls, self.rewound = (4, 4), None

    def dispatch(self, x, ids, weights):
        return None, None, None, x

    def combine(self, expert_out, handle, out):
        return out.copy_(handle + expert_out[0])

    def replayed(self):
        self.calls = (self.calls[0] + 1, self.calls[1] + 1)

    def rewind(self, calls):
        self.calls = self.rewound = calls


def forward_inputs(value: float) -> tuple:
    """A forward's tokens [2, 3] (all `value`), ids and weights [2, 2]: new tensors, 16-byte aligned."""
    return torch.full((2, 3), float(value)), torch.zeros(2, 2, dtype=torch.long), torch.ones(2, 2)


def storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_a_forward_is_captured_then_replayed_on_the_callers_own_tensors(fake_cuda):
    """The first call captures and replays, each later one replays: on the caller's tokens, ids and weights
    themselves (no copy in), into a new output each call that is returned as it is (no copy out, not the
    scratch's); the all-to-all counts each replay's calls; a replaced scratch is captured again."""
    experts, ep = FakeExperts(), FakeEP()
    forward = _Forward(_Planned(experts))
    inputs = forward_inputs(10)
    first = forward(ep, *inputs)                     # captured, then replayed: the capture counted its calls
    assert fake_cuda["captures"] == 1 and first.eq(11).all() and ep.calls == (4, 4)
    graph = forward.graph.graph
    assert all(a is b for a, b in zip(graph.args, (*inputs, first))) and len(graph.args) == 4 + len(experts.made)
    scratch = graphs._SCRATCH[experts.device, fake_cuda["stream"]]
    assert storage(first) != storage(scratch.memory) and first.shape == (2, 3) and first.dtype == torch.float32
    inputs = forward_inputs(20)
    second = forward(ep, *inputs)                    # replayed on these: the all-to-all counts its calls
    assert fake_cuda["captures"] == 1 and second.eq(22).all() and ep.calls == (5, 5)
    assert all(a is b for a, b in zip(graph.args, (*inputs, second)))
    assert storage(second) not in (storage(first), storage(scratch.memory)) and first.eq(11).all()
    third = forward(ep, *forward_inputs(-5))
    assert third.eq(-2).all() and second.eq(22).all() and first.eq(11).all() and ep.calls == (6, 6)
    larger = Scratch.of(experts.device, fake_cuda["stream"], 1 << 20)   # a larger layer's graph replaced the scratch
    assert forward(ep, *forward_inputs(30)).eq(34).all() and fake_cuda["captures"] == 2 and ep.calls == (6, 6)
    assert forward.graph.scratch is larger and forward.graph.graph is not graph
    assert forward(ep, *forward_inputs(40)).eq(45).all() and fake_cuda["captures"] == 2 and ep.calls == (7, 7)


def test_a_forward_whose_capture_fails_rewinds_the_calls_and_launches(fake_cuda):
    """A capture CUDA refuses warns once, rewinds the all-to-all's calls, and the forward launches from then on."""
    ep, forward = FakeEP(), _Forward(_Planned(FakeExperts()))
    fake_cuda["fail"] = RuntimeError("operation not permitted when stream is capturing\nmore")
    with pytest.warns(RuntimeWarning, match="forward of 2 tokens could not be captured .RuntimeError: operation not"):
        assert forward(ep, *forward_inputs(1)) is None
    assert ep.rewound == (4, 4) and forward.graph is False
    fake_cuda["fail"] = None
    with warnings.catch_warnings():
        warnings.simplefilter("error")               # warned once
        assert forward(ep, *forward_inputs(1)) is None and fake_cuda["captures"] == 0


def test_a_forward_whose_pointers_cannot_be_moved_warns_and_launches(fake_cuda):
    """A graph captured whose kernels cannot be pointed at other tensors (MovedPointers' ValueError) is dropped:
    a warning, once, the all-to-all's calls rewound, and the forward launches from then on, captured no more."""
    ep, forward = FakeEP(), _Forward(_Planned(FakeExperts()))
    fake_cuda["move_fail"] = ValueError("a kernel takes an address inside captured span 0 (argument 3, 8 bytes)")
    with pytest.warns(RuntimeWarning, match="forward of 2 tokens could not be captured .ValueError: a kernel takes"):
        assert forward(ep, *forward_inputs(1)) is None
    assert ep.rewound == (4, 4) and ep.calls == (4, 4) and forward.graph is False and fake_cuda["captures"] == 1
    fake_cuda["move_fail"] = None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert forward(ep, *forward_inputs(1)) is None and forward(ep, *forward_inputs(2)) is None
    assert fake_cuda["captures"] == 1 and ep.calls == (4, 4)


@pytest.mark.parametrize("unaligned", range(3))
def test_unaligned_inputs_launch_without_capturing(fake_cuda, unaligned):
    """Tokens, ids or weights not 16-byte aligned (views at an offset): launched (None), nothing captured, no
    warning; the next aligned forward is captured and replayed."""
    ep, forward = FakeEP(), _Forward(_Planned(FakeExperts()))
    offset = (torch.zeros(7)[1:7].view(2, 3), torch.zeros(5, dtype=torch.long)[1:5].view(2, 2),
              torch.zeros(5)[1:5].view(2, 2))
    inputs = list(forward_inputs(1))
    inputs[unaligned] = offset[unaligned]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert forward(ep, *inputs) is None
    assert fake_cuda["captures"] == 0 and forward.graph is None and ep.rewound is None
    assert forward(ep, *forward_inputs(3)).eq(4).all() and fake_cuda["captures"] == 1
    assert forward(ep, *inputs) is None and ep.calls == (4, 4)          # unaligned again, even once captured
    assert forward(ep, *forward_inputs(5)).eq(7).all() and fake_cuda["captures"] == 1 and ep.calls == (5, 5)


def test_a_forward_past_the_cap_launches(fake_cuda, monkeypatch):
    """Only the experts' buffers count against graphs.MAX_BYTES (the forward's own tensors are the caller's):
    past it the forward launches, at it the forward is captured."""
    monkeypatch.setattr(graphs, "MAX_BYTES", Scratch.size(FakeExperts().made) - 1)
    forward = _Forward(_Planned(FakeExperts()))
    assert forward(FakeEP(), *forward_inputs(1)) is None and forward.graph is False and fake_cuda["captures"] == 0
    monkeypatch.setattr(graphs, "MAX_BYTES", Scratch.size(FakeExperts().made))  # the experts fit, not their inputs too
    forward = _Forward(_Planned(FakeExperts()))
    assert forward(FakeEP(), *forward_inputs(1)).eq(2).all() and fake_cuda["captures"] == 1


def test_a_forward_launches_where_pointers_cannot_be_moved_here(fake_cuda):
    """Where kernel_nodes.unavailable() gives a reason (no libcuda, an older torch), the forward warns once
    with it, captures nothing and launches."""
    ep, forward = FakeEP(), _Forward(_Planned(FakeExperts()))
    fake_cuda["unavailable"] = "OSError: libcuda.so.1: cannot open shared object file"
    with pytest.warns(RuntimeWarning, match="could not be captured .ValueError: .*OSError: libcuda.so.1: cannot"):
        assert forward(ep, *forward_inputs(1)) is None
    assert forward.graph is False and fake_cuda["captures"] == 0 and ep.rewound == (4, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert forward(ep, *forward_inputs(1)) is None and fake_cuda["captures"] == 0
