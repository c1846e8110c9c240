"""--compile-hift: HiFT's Snake activations compiled by inductor give the eager audio (tiny model,
CPU, float32), one compiled graph serves every Snake, and the option reaches the engine from the
command line."""

import copy
import threading

import pytest
import torch
from test_fused_flow import built_copy

from cosyapp.engine.build import compiles_hift
from cosyapp.engine.token2wav import fused as fused_module
from cosyapp.engine.token2wav.compiling import COMPILER, Deferred
from cosyapp.engine.token2wav.fused import fuse_hift
from cosyapp.engine.token2wav.hift_graphs import CAPTURE_AT, HiFTRunner
from cosyapp.models.hift import Snake, snake
from cosyapp.options import ServeOptions


@pytest.fixture(scope="module")
def fused(tiny_model_dir, tmp_path_factory):
    """A second copy of the tiny model, its HiFT fused by build_pipeline."""
    with built_copy(tiny_model_dir, tmp_path_factory.mktemp("serving-cache"), compile_hift=True) as model:
        yield model


def vocode(hift, mel, cache=None):
    generators = [torch.Generator().manual_seed(i) for i in range(mel.size(0))]
    with torch.inference_mode():
        return hift(mel, cache, generators=generators)


def compiled_graphs() -> int:
    return len(torch._dynamo.eval_frame._debug_get_cache_entry_list(snake.__code__))


@pytest.mark.parametrize("frames, with_cache", [(40, False), (73, True)])
def test_the_compiled_snakes_give_the_eager_audio(tiny_model, fused, frames, with_cache, compile_threads):
    g = torch.Generator().manual_seed(frames)
    mel = torch.randn(2, 80, frames, generator=g) * 2 - 5
    cache = torch.randn(2, 1, 3840, generator=g) * 0.1 if with_cache else None
    vocode(fused.hift, mel, cache)  # eager while the compile thread compiles the kinds it met
    assert COMPILER.wait(timeout_s=600)
    got_speech, got_source = vocode(fused.hift, mel, cache)
    assert set(compile_threads) <= {"flow-compile"}  # a copy laid out as the call: no compile here
    want_speech, want_source = vocode(tiny_model.hift, mel, cache)
    assert torch.equal(got_source, want_source)  # the source module has no Snake
    assert got_speech.shape == want_speech.shape
    torch.testing.assert_close(got_speech, want_speech, rtol=1e-4, atol=1e-5)


def test_every_snake_runs_compiled_and_one_graph_serves_them_all(tiny_model, fused):
    snakes = [m for m in fused.hift.modules() if isinstance(m, Snake)]
    # the stages differ in channels, so a graph per shape would show as several
    assert len(snakes) > 6 and len({m.alpha.numel() for m in snakes}) > 1
    assert all("forward" in vars(m) for m in snakes)
    assert not any("forward" in vars(m) for m in tiny_model.hift.modules() if isinstance(m, Snake))
    for frames in (30, 47):
        vocode(fused.hift, torch.randn(2, 80, frames) - 5)
    assert COMPILER.wait(timeout_s=600)
    assert compiled_graphs() == 1  # every stage's channels, both lengths
    vocode(fused.hift, torch.randn(1, 80, 30) - 5)
    assert COMPILER.wait(timeout_s=600)
    assert compiled_graphs() == 2  # and one for a batch of one (dynamo's size-1 specialisation)


class Gate:
    """A torch.compile backend that holds the compile thread until the test opens it."""

    def __init__(self):
        self.open = threading.Event()

    def __call__(self, graph_module, example_inputs):
        self.open.wait(timeout=300)
        return graph_module.forward


def negate(x: torch.Tensor) -> torch.Tensor:
    return -x


def test_hift_graphs_are_captured_again_once_the_snakes_are_compiled(tiny_model):
    """--hift-graphs beside a HiFT compiled in the background: a shape captured while its Snakes ran
    eagerly is captured again at its first call after their compiles (CPU: the padded eager graphs),
    and the old one freed."""
    hift = copy.deepcopy(tiny_model.hift)
    fused_module._deferred_snake.cache_clear()  # a new compiled Snake: its kinds compile now
    fuse_hift(hift, background=True)
    gate = Gate()  # the compile thread waits here, so the Snakes' kinds stay eager through the capture
    Deferred("gate", negate, torch.compile(negate, backend=gate, dynamic=True), family="hift")(torch.ones(3))
    runner = HiFTRunner(hift, graphs=True, capture=False)
    mel = torch.randn(2, 80, 36, generator=torch.Generator().manual_seed(1)) - 5
    want, _ = vocode(tiny_model.hift, mel)

    def call():
        return runner(mel, None, [torch.Generator().manual_seed(i) for i in range(2)])[0]

    with torch.inference_mode():
        first = [call() for _ in range(CAPTURE_AT)]  # the last one captures, the Snakes eager
        [(key, graph)] = runner._graphs.items()
        assert graph.eager and not graph.stale
        gate.open.set()
        assert COMPILER.wait(timeout_s=600) and graph.stale
        again = call()  # captures the shape again, with the compiled Snakes
    new = runner._graphs[key]
    assert new is not graph and not new.stale and not new.eager
    assert runner._graphs.retired == 0  # the replaced graph is freed: no lookup had found it since
    for got in (*first, again):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_the_default_compiles_hift_on_a_gpu_and_a_choice_wins_anywhere():
    """The rule build_pipeline follows; a CUDA device object needs no GPU to exist."""
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert compiles_hift(gpu, ServeOptions()) and not compiles_hift(cpu, ServeOptions())
    assert not compiles_hift(gpu, ServeOptions(compile_hift=False))
    assert compiles_hift(cpu, ServeOptions(compile_hift=True))


def test_by_default_hift_is_compiled_on_a_gpu_only(tiny_model_dir, tmp_path):
    """compile_hift None (the default) on this CPU: the Snakes stay eager; False anywhere too."""
    for choice in (None, False):
        with built_copy(tiny_model_dir, tmp_path, compile_hift=choice) as model:
            assert not any("forward" in vars(m) for m in model.hift.modules() if isinstance(m, Snake))
