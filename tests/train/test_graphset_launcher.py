"""GraphSet's launcher path (mamba_rl/graphs.py), with stand-ins for the torch graph and the extension's
GraphLauncher, so it runs on the CPU: which path a replay takes, what the guard checks on each, the re-binding
of a new buffer object over the captured storage, and the fallback to torch's replay. The real launcher on a
GPU: tests/train/test_trainer_cuda.py (the stepper's graph, bit for bit against torch's replay)."""
import pytest
import torch

import mamba_rl.graphs as graphs
from mamba_rl.graphs import GraphSet


class FakeGraph:
    def __init__(self, with_exec=True):
        self.replays = 0
        if with_exec:
            self.raw_cuda_graph_exec = lambda: 1234

    def replay(self):
        self.replays += 1


class FakeLauncher:
    """Records launches; check() compares the held tensors' pointers with those at binding, as the C++ one."""

    def __init__(self, graph, exec_handle, device, buffers):
        self.graph, self.exec, self.device, self.bufs = graph, exec_handle, device, list(buffers)
        self.ptrs = [None if b is None else b.data_ptr() for b in self.bufs]
        self.launches = 0

    def check(self):
        for b, p in zip(self.bufs, self.ptrs):
            if b is not None and b.data_ptr() != p:
                raise RuntimeError("graph launch: a buffer captured by the CUDA graph has moved")

    def launch(self):
        self.check()
        self.launches += 1


class Owner:
    def __init__(self, factory=FakeLauncher, with_exec=True):
        self.a, self.b = torch.zeros(4), torch.ones(3)
        self.gs = GraphSet("Owner", lambda: (self.a, None, self.b), launcher=lambda: factory)
        self.gs._graphs["step"] = FakeGraph(with_exec)


@pytest.fixture(autouse=True)
def _no_cuda_device(monkeypatch):
    monkeypatch.setattr(graphs.torch.cuda, "current_device", lambda: 0)


def test_a_bound_graph_is_launched_from_the_launcher_not_replayed():
    o = Owner()
    o.gs.seal()
    fast = o.gs._launch["step"]
    assert fast.exec == 1234 and fast.device == 0 and fast.bufs[1] is None and fast.bufs[0] is o.a
    for _ in range(3):
        assert o.gs.replay("step")
    assert fast.launches == 3 and o.gs._graphs["step"].replays == 0
    o.gs.check()  # the same objects, the same storage


def test_a_rebound_buffer_is_refused_and_a_storage_swap_in_place_is_seen():
    o = Owner()
    o.gs.seal()
    keep = o.a
    o.a = torch.zeros(4)  # another storage
    with pytest.raises(RuntimeError, match="has moved"):
        o.gs.replay("step")
    with pytest.raises(RuntimeError, match="has moved"):
        o.gs.check()
    o.a = keep
    o.gs.replay("step")
    o.b.data = torch.ones(3)  # the same object, its storage replaced in place
    with pytest.raises(RuntimeError, match="has moved"):
        o.gs.replay("step")
    with pytest.raises(RuntimeError, match="has moved"):
        o.gs.check()
    assert o.gs._launch["step"].launches == 1


def test_a_new_object_over_the_captured_storage_is_accepted_and_then_guarded():
    o = Owner()
    o.gs.seal()
    first = o.gs._launch["step"]
    o.a = o.a.view(4)  # a new object, the same storage
    assert o.gs.replay("step")
    fast = o.gs._launch["step"]
    assert fast is not first and fast.bufs[0] is o.a and fast.launches == 1
    o.a.data = torch.zeros(4)  # now an in-place swap of the new object is what the launcher sees
    with pytest.raises(RuntimeError, match="has moved"):
        o.gs.replay("step")


def test_without_a_launcher_or_the_exec_handle_torch_replays_behind_the_pointer_guard():
    for o in (Owner(factory=None), Owner(with_exec=False)):
        o.gs.seal()
        assert o.gs._launch == {}
        assert o.gs.replay("step") and o.gs._graphs["step"].replays == 1
        o.a = torch.zeros(4)
        with pytest.raises(RuntimeError, match="has moved"):
            o.gs.replay("step")
    o = Owner()
    o.gs.seal()
    o.gs.clear()
    assert o.gs._launch == {} and not o.gs.replay("step")


def test_a_buffer_list_that_grows_or_shrinks_is_refused():
    for before, after in ((1, 2), (2, 1)):
        o = Owner()
        o.n = before
        o.gs = GraphSet("Owner", lambda: (o.a, o.b)[:o.n], launcher=lambda: FakeLauncher)
        o.gs._graphs["step"] = FakeGraph()
        o.gs.seal()
        o.n = after
        with pytest.raises(RuntimeError, match="has moved"):
            o.gs.replay("step")
        with pytest.raises(RuntimeError, match="has moved"):
            o.gs.check()


def test_a_rebind_that_finds_no_launcher_falls_back_to_torchs_replay():
    o = Owner()
    on = [True]
    o.gs._launcher = lambda: FakeLauncher if on[0] else None
    o.gs.seal()
    on[0] = False
    o.a = o.a.view(4)  # a new object over the captured storage: re-bound, now without a launcher
    assert o.gs.replay("step") and o.gs._graphs["step"].replays == 1 and o.gs._launch == {}
    o.a = torch.zeros(4)
    with pytest.raises(RuntimeError, match="has moved"):
        o.gs.replay("step")


def test_a_seal_whose_launcher_fails_drops_the_graphs():
    def broken(graph, exec_handle, device, buffers):
        raise ValueError("graph_launcher: buffer 0: expected a tensor on cuda:0, got cuda:1")

    o = Owner(factory=broken)
    with pytest.raises(ValueError, match="expected a tensor on cuda:0"):
        o.gs.seal()
    assert not o.gs and o.gs._launch == {} and not o.gs.replay("step")


def test_without_a_launcher_no_buffer_is_held():
    import gc
    import weakref

    o = Owner(factory=None)
    o.gs.seal()
    ref = weakref.ref(o.a)
    o.a = torch.zeros(4)
    gc.collect()
    assert ref() is None, "the pointer guard keeps integers, not the owner's tensors"
