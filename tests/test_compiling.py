"""compiling.py: compiled functions that never compile on their caller's thread. A call of a kind
not compiled yet runs eagerly and hands a copy of its arguments to the compile thread; once that
has compiled it, calls of that kind run compiled; a compile that fails leaves its kind eager; the
graphs captured before a compile are captured again after it (CPU: the padded eager buckets), and
the graphs they replace are freed once no replay can use them (GraphTable)."""

import gc
import threading
import weakref
from dataclasses import dataclass

import torch

from cosyapp.engine.token2wav.compiling import (
    COMPILER,
    Deferred,
    epoch,
    kind,
    noting_eager_kinds,
    same_strides,
)
from cosyapp.engine.token2wav.fused import fuse_estimator
from cosyapp.engine.token2wav.graph_table import Captured, GraphTable
from cosyapp.engine.token2wav.graphs import GraphedEstimator


def mlp(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    for _ in range(4):
        x = torch.nn.functional.gelu(x @ w) + x
    return x


class Recorder:
    """A torch.compile backend that notes the thread each graph is compiled on and runs it as traced."""

    def __init__(self, fail: bool = False):
        self.threads: list[str] = []
        self.fail = fail

    def __call__(self, graph_module, example_inputs):
        self.threads.append(threading.current_thread().name)
        if self.fail:
            raise RuntimeError("this backend cannot compile")
        return graph_module.forward


def deferred(backend) -> Deferred:
    return Deferred("mlp", mlp, torch.compile(mlp, backend=backend, dynamic=True))


def test_calls_run_eagerly_until_the_compile_thread_has_compiled_their_kind(fresh_compiles):
    backend = Recorder()
    fn = deferred(backend)
    x, w = torch.randn(6, 16), torch.randn(16, 16) / 4
    key = kind((x, w), {})
    torch.testing.assert_close(fn(x, w), mlp(x, w), rtol=0, atol=0)  # eager, whatever the thread does
    assert COMPILER.wait(timeout_s=120)
    assert key in fn.ready and not fn.pending
    assert backend.threads == ["flow-compile"]  # never the caller's thread
    # Now compiled: other sizes of the same kind too (dynamic), and no compile on this thread.
    for rows in (6, 9):
        x = torch.randn(rows, 16)
        torch.testing.assert_close(fn(x, w), mlp(x, w))
    assert backend.threads == ["flow-compile"]
    # Another kind (a dtype) is a compile of its own, on the compile thread again.
    torch.testing.assert_close(fn(x.double(), w.double()), mlp(x.double(), w.double()))
    assert COMPILER.wait(timeout_s=120)
    assert len(fn.ready) == 2 and set(backend.threads) == {"flow-compile"}


def test_calls_made_while_the_compile_thread_is_held_compile_once_every_hold_has_ended(fresh_compiles):
    backend = Recorder()
    fn = deferred(backend)
    x, w = torch.randn(6, 16), torch.randn(16, 16) / 4
    with COMPILER.held():
        with COMPILER.held():  # a start inside another: both must end
            torch.testing.assert_close(fn(x, w), mlp(x, w), rtol=0, atol=0)  # eager
        assert not COMPILER.wait(timeout_s=1.0)  # queued, not compiled
        assert not fn.ready and backend.threads == []
    assert COMPILER.wait(timeout_s=120)
    assert kind((x, w), {}) in fn.ready and backend.threads == ["flow-compile"]


def test_a_kind_whose_compile_fails_stays_eager_and_the_thread_goes_on(fresh_compiles):
    failing, working = deferred(Recorder(fail=True)), deferred(Recorder())
    x, w = torch.randn(5, 8), torch.randn(8, 8)
    want = mlp(x, w)
    torch.testing.assert_close(failing(x, w), want, rtol=0, atol=0)
    assert COMPILER.wait(timeout_s=120)
    assert failing.failed and not failing.ready
    for _ in range(2):  # not submitted again
        torch.testing.assert_close(failing(x, w), want, rtol=0, atol=0)
    assert COMPILER.settled and not failing.pending
    working(x, w)
    assert COMPILER.wait(timeout_s=120) and working.ready


def test_the_kind_tells_apart_what_a_dynamic_compile_specialises():
    x = torch.randn(4, 8)
    assert kind((x,), {}) == kind((torch.randn(7, 8),), {})  # sizes past 1: one dynamic graph
    assert kind((x,), {}) != kind((torch.randn(1, 8),), {})  # size 1 is specialised
    assert kind((x,), {}) != kind((x.t(),), {})  # strides
    assert kind((x, torch.randn(5)), {}) != kind((x, torch.randn(4)), {})  # sizes equal or not (duck sizing)
    assert kind((x,), {"streaming": True}) != kind((x,), {"streaming": False})
    plain = kind((x,), {})
    with torch.inference_mode():
        assert kind((x,), {}) != plain
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert kind((x,), {}) != plain


def test_the_kind_tells_apart_each_thing_it_lists_and_nothing_more():
    x = torch.randn(4, 6, 8)
    same = [
        (torch.randn(5, 7, 9),),  # other sizes past 1
        (torch.randn(8, 6, 8)[:4],),  # a view with the same layout
    ]
    for args in same:
        assert kind(args, {}) == kind((x,), {})
    other = [
        (x.double(),),  # dtype
        (torch.randn(4, 6),),  # rank
        (torch.randn(4, 0, 8),),  # a size of 0
        (torch.randn(4, 1, 8),),  # a size of 1
        (torch.randn(4, 6, 16)[:, :, ::2],),  # not contiguous
        (torch.randn(6, 4, 8).transpose(0, 1),),  # order of strides
        (torch.randn(4, 6, 8).permute(0, 2, 1).contiguous().permute(0, 2, 1),),  # another order
        (torch.randn(4, 6, 8, requires_grad=True),),  # requires grad
        (x, torch.randn(5)),  # one more argument
    ]
    with torch.inference_mode():
        other.append((torch.randn(4, 6, 8),))  # an inference tensor (kind taken outside the mode)
    kinds = [kind(args, {}) for args in other]
    assert len(set(kinds)) == len(kinds) and kind((x,), {}) not in kinds
    # Which sizes equal which, across tensors; 0 and 1 are their own, wherever they come.
    assert kind((x, torch.randn(6)), {}) == kind((torch.randn(3, 7, 5), torch.randn(7)), {})
    assert kind((x, torch.randn(6)), {}) != kind((x, torch.randn(8)), {})
    assert kind((torch.randn(1, 3), torch.randn(0)), {}) != kind((torch.randn(0, 3), torch.randn(1)), {})
    # Modules by type, plain values by value, kwargs whatever their order.
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(3, 3)
    assert kind((a, x), {}) == kind((b, x), {}) != kind((torch.nn.ReLU(), x), {})
    assert kind((x, 3), {}) != kind((x, 4), {}) and kind((x, "a"), {}) != kind((x, None), {})
    flags = {"streaming": True, "all_valid": False}
    assert kind((x,), flags) == kind((x,), dict(reversed(flags.items())))
    plain = kind((x,), {})
    with torch.no_grad():
        assert kind((x,), {}) != plain  # the grad state


def test_the_estimators_graphs_are_captured_again_after_its_compiles(tiny_model, fresh_compiles):
    """A GraphedEstimator over an estimator compiled in the background: the buckets captured at the
    start (here padded eager buckets, as on a CPU) while their kinds ran eagerly are captured again
    once the compile thread has compiled those kinds, and then replay what they did before."""
    import copy

    estimator = copy.deepcopy(tiny_model.flow.decoder.estimator)
    fuse_estimator(estimator, background=True)
    graphed = GraphedEstimator(estimator, row_buckets=(2, 4), frame_buckets=(128,), use_graphs=False)
    with torch.inference_mode():
        graphed.capture_all(torch.device("cpu"), torch.float32)
        before = dict(graphed._graphs.items())
        assert len(before) == 4  # rows 2 and 4, both attention modes
        assert next(iter(before.values())).eager  # the first capture: nothing was compiled yet
        assert COMPILER.wait(timeout_s=600)
        for key, old in before.items():
            now = graphed._graphs[key]
            assert not now.stale
            # Captured again exactly when its capture ran a kind eagerly (a compile that ended before
            # a capture leaves that one compiled already).
            assert (now is not old) == bool(old.eager) and old.stale == bool(old.eager)
        assert graphed.recaptured == sum(bool(old.eager) for old in before.values())
        assert graphed._graphs.retired == 0  # no lookup had found the replaced graphs: freed at once
        assert estimator.forward.ready
        g = torch.Generator().manual_seed(0)
        args = [torch.randn(3, c, 100, generator=g) for c in (80, 80, 80)]
        x, mu, cond = args
        mask, t, spks = torch.ones(3, 1, 100), torch.rand(3, generator=g), torch.randn(3, 80, generator=g)
        want = {s: estimator.forward.eager(x, mask, mu, t, spks, cond, s) for s in (False, True)}
        first = {s: graphed(x, mask, mu, t, spks, cond, s) for s in (False, True)}
        for streaming in (False, True):
            torch.testing.assert_close(first[streaming], want[streaming], rtol=1e-4, atol=1e-5)
            again = graphed(x, mask, mu, t, spks, cond, streaming)
            torch.testing.assert_close(again, want[streaming], rtol=1e-4, atol=1e-5)


def test_the_compile_threads_copy_has_the_callers_layout_so_no_call_compiles_again(fresh_compiles):
    """A slice with gaps and a broadcast axis: the copies keep their strides (a clone would not), so
    the graph compiled on them is the one later calls of that kind pass the guards of."""
    backend = Recorder()
    fn = deferred(backend)
    w = torch.randn(16, 16) / 4
    for t in (torch.randn(6, 32)[:, ::2], torch.randn(1, 16).expand(5, 16), torch.randn(16, 6).t()):
        copy = same_strides(t)
        assert torch.equal(copy, t) and copy.stride() == t.stride()
    gapped = torch.randn(6, 32)[:, ::2]
    fn(gapped, w)
    assert COMPILER.wait(timeout_s=120)
    again = torch.randn(9, 32)[:, ::2]
    torch.testing.assert_close(fn(again, w), mlp(again, w))
    assert backend.threads == ["flow-compile"]  # one graph, compiled there; none on this thread


def test_a_call_whose_copy_fails_still_runs_and_its_kind_stays_eager():
    """copy_args raising (out of memory on a GPU, say) fails neither the call nor a later one."""

    def no_copy(args, kwargs):
        raise RuntimeError("no memory for the copy")

    backend = Recorder()
    fn = Deferred("mlp", mlp, torch.compile(mlp, backend=backend, dynamic=True), no_copy)
    x, w = torch.randn(5, 8), torch.randn(8, 8)
    for _ in range(2):
        torch.testing.assert_close(fn(x, w), mlp(x, w), rtol=0, atol=0)
    assert fn.failed and not fn.pending and not fn.ready and backend.threads == []


class Replays:
    """A graph as GraphTable sees one: a replay()."""

    def __init__(self):
        self.count = 0

    def replay(self):
        self.count += 1


class GPU:
    """A CUDA event's record, query and synchronize on a GPU the test plays: a replay recorded
    runs until the test ends it (``finish``) or a synchronize waits for it."""

    def __init__(self):
        self.running = False
        self.waits = 0

    def record(self):
        self.running = True

    def query(self) -> bool:
        return not self.running

    def synchronize(self):
        self.waits += 1
        self.running = False

    def finish(self):
        self.running = False


@dataclass
class Graph(Captured):
    graph: Replays


class Fn:
    """What a Captured reads of a compiled function: the kinds it has compiled."""

    def __init__(self):
        self.ready: set[str] = set()


def captured(eager: frozenset = frozenset()) -> tuple[Graph, GPU]:
    graph = Graph(Replays(), eager=eager)
    graph.ended = GPU()  # a CUDA graph's event; here the test's
    return graph, graph.ended


def freed(ref: weakref.ref) -> bool:
    gc.collect()
    return ref() is None


def test_a_replaced_graph_is_freed_at_a_later_lookup_once_its_last_replay_has_ended():
    table = GraphTable()
    old, gpu = captured()
    table.put("k", old)
    assert table.lookup("k") is old
    old.replay()
    ref = weakref.ref(old)
    del old
    new, _ = captured()
    table.put("k", new)  # a compile later
    assert table.retired == 1 and not freed(ref)
    assert table.lookup("k") is new
    assert table.retired == 1 and not freed(ref)  # its replay still runs on the GPU
    gpu.finish()
    assert table.lookup("other") is None
    assert table.retired == 0 and freed(ref)


def test_a_graph_found_but_not_replayed_yet_stays_until_a_later_lookup():
    """Replaced between the serving thread's lookup and its replay: nothing recorded on its event
    yet, so only the next lookup tells that the replay has been launched."""
    table = GraphTable()
    old, gpu = captured()
    table.put("k", old)
    found = table.lookup("k")
    ref = weakref.ref(old)
    del old
    table.put("k", captured()[0])  # another thread, meanwhile
    assert gpu.query() and table.retired == 1
    found.replay()  # the serving thread goes on with what it found
    del found
    table.lookup("k")
    assert table.retired == 1 and not freed(ref)  # its replay runs
    gpu.finish()
    table.lookup("k")
    assert freed(ref)


def test_a_replaced_graph_no_lookup_found_is_freed_at_once_and_one_per_key_stays_at_most():
    table = GraphTable()
    first, first_gpu = captured()
    table.put("k", first)
    table.lookup("k").replay()
    second, second_gpu = captured()
    third = captured()[0]
    refs = [weakref.ref(g) for g in (first, second, third)]
    table.put("k", second)
    table.put("k", third)  # before any lookup found the second: it goes, the first stays
    del first, second, third
    assert [freed(r) for r in refs] == [False, True, False] and table.retired == 1
    assert first_gpu.running and first_gpu.waits == 0
    fn = Fn()
    fourth = captured(frozenset({(fn, "kind")}))[0]  # its capture ran fn's "kind" eagerly
    table.lookup("k").replay()  # the third, found and replaying; the first still running
    table.put("k", fourth)  # the first's event is waited for, and the first freed
    assert first_gpu.waits == 1 and [freed(r) for r in refs] == [True, True, False]
    assert table.retired == 1 and table.stale() == []
    fn.ready.add("kind")
    assert table.stale() == [("k", fourth)]
    assert not second_gpu.running


@dataclass(kw_only=True)
class _Graph(Captured):
    graph: None = None


def test_a_compile_makes_stale_only_the_graphs_whose_capture_ran_its_kind_eagerly(fresh_compiles):
    """With --compile-flow an H100 engine captured its 124 whole-clip graphs three times over while
    the compile thread met one kind after another: each compile made every graph stale. A graph is
    stale once a kind its capture ran eagerly is compiled; a kind that fails to compile stays eager,
    so it makes nothing stale; a call of a compiled kind is noted nowhere."""
    snake = Deferred("snake", mlp, torch.compile(mlp, backend=Recorder(), dynamic=True), family="hift")
    failing = deferred(Recorder(fail=True))
    x, w = torch.randn(5, 16), torch.randn(16, 16) / 4
    flow_epoch, hift_epoch = epoch("flow"), epoch("hift")
    with noting_eager_kinds() as ran_snake, noting_eager_kinds() as inner:  # the outer sees the inner's
        snake(x, w)
    with noting_eager_kinds() as ran_failing:
        failing(x.double(), w.double())
    with noting_eager_kinds() as ran_nothing:
        pass
    assert ran_snake == inner == {(snake, kind((x, w), {}))} and len(ran_failing) == 1 and not ran_nothing
    graphs = {
        name: _Graph(eager=frozenset(kinds))
        for name, kinds in [("snake", ran_snake), ("failing", ran_failing), ("nothing", ran_nothing)]
    }
    assert COMPILER.wait(timeout_s=120)
    assert failing.failed and snake.ready
    assert [name for name, g in graphs.items() if g.stale] == ["snake"]
    # Each family's epoch moved on once (its hooks look for stale graphs), the failure's too.
    assert (epoch("hift"), epoch("flow")) == (hift_epoch + 1, flow_epoch + 1)
    with noting_eager_kinds() as ran_compiled:
        snake(x, w)
    assert not ran_compiled  # compiled now: a graph captured now replays compiled kernels
