"""moe_ep.graphs: the scratch that replayed graphs write into (how it is carved and replaced), and when the MoE
layer's plans and forwards launch, capture, replay or capture again (with CUDA's calls faked on CPU); the
capture and replay themselves run on GPUs, in the MoE layer's eager forwards (tests/test_moe_layer.py)."""
import gc
from types import SimpleNamespace

import pytest
import torch

from moe_ep import graphs
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


@pytest.fixture
def fake_cuda(monkeypatch):
    """graphs' CUDA calls on CPU: the stream in `state["stream"]`, capturing while `state["capturing"]`, and a
    capture that records the launch and replays it by calling it again (or raises `state["fail"]`)."""
    state = {"stream": 1000, "capturing": False, "fail": None, "captures": 0}

    def capture(launch, *args):
        if state["fail"]:
            raise state["fail"]
        state["captures"] += 1
        return SimpleNamespace(replay=lambda: launch(*args))

    monkeypatch.setattr(graphs, "capture", capture)
    monkeypatch.setattr(graphs, "capturing", lambda cuda: state["capturing"])
    monkeypatch.setattr(graphs, "current_stream", lambda device: state["stream"])
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
    """A forward's tokens [2, 3] (all `value`), ids and weights [2, 2]."""
    return torch.full((2, 3), value), torch.zeros(2, 2, dtype=torch.long), torch.ones(2, 2)


def test_a_forward_is_captured_then_replayed_on_copies_of_its_inputs(fake_cuda):
    experts, ep = FakeExperts(), FakeEP()
    forward = _Forward(_Planned(experts))
    first = forward(ep, *forward_inputs(10))         # captured, then replayed on the inputs copied in
    assert fake_cuda["captures"] == 1 and first.eq(11).all() and ep.calls == (4, 4)
    scratch = graphs._SCRATCH[experts.device, fake_cuda["stream"]]
    assert first.untyped_storage().data_ptr() != scratch.memory.untyped_storage().data_ptr()   # a tensor of its own
    second = forward(ep, *forward_inputs(20))        # replayed: the all-to-all counts its calls
    assert fake_cuda["captures"] == 1 and second.eq(22).all() and first.eq(11).all() and ep.calls == (5, 5)
    Scratch.of(experts.device, fake_cuda["stream"], 1 << 20)    # a larger layer's graph replaced the scratch
    assert forward(ep, *forward_inputs(30)).eq(33).all() and fake_cuda["captures"] == 2 and ep.calls == (5, 5)


def test_a_forward_whose_capture_fails_rewinds_the_calls_and_launches(fake_cuda):
    ep, forward = FakeEP(), _Forward(_Planned(FakeExperts()))
    fake_cuda["fail"] = RuntimeError("operation not permitted when stream is capturing\nmore")
    with pytest.warns(RuntimeWarning, match="forward of 2 tokens could not be captured .RuntimeError: operation not"):
        assert forward(ep, *forward_inputs(1)) is None
    assert ep.rewound == (4, 4) and forward.graph is False
    fake_cuda["fail"] = None
    assert forward(ep, *forward_inputs(1)) is None and fake_cuda["captures"] == 0


def test_a_forward_past_the_cap_launches(fake_cuda, monkeypatch):
    monkeypatch.setattr(graphs, "MAX_BYTES", Scratch.size(FakeExperts().made))   # the experts fit, its inputs not
    forward = _Forward(_Planned(FakeExperts()))
    assert forward(FakeEP(), *forward_inputs(1)) is None and forward.graph is False and fake_cuda["captures"] == 0
