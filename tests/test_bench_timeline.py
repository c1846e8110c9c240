"""The benchmark's GPU timeline: a trace's device work summed up per stream and launching thread."""

import threading
import time

import pytest

from cosyapp.bench.__main__ import parse_args
from cosyapp.bench.gil import holders
from cosyapp.bench.report import gil_line, timeline_line, where_line
from cosyapp.bench.run import level_timeline
from cosyapp.bench.timeline import Timeline, category, summarise, thread_names


def _runtime(tid: int, correlation: int, ts: float, name: str = "cudaLaunchKernel", dur: float = 5) -> dict:
    return {"ph": "X", "cat": "cuda_runtime", "name": name, "tid": tid, "ts": ts, "dur": dur,
            "args": {"correlation": correlation}}  # fmt: skip


def _kernel(name: str, stream: int, correlation: int, ts: float, dur: float, cat: str = "kernel") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": f"stream {stream}", "ts": ts, "dur": dur,
            "args": {"stream": stream, "correlation": correlation}}  # fmt: skip


def test_streams_threads_overlap_and_gaps():
    # Microseconds: the flow thread's stream runs 0-4000 and 4500-6000, the HiFT thread's 3000-5000 (a
    # copy at its end); nothing runs 6000-30000 (a 24 ms gap), then one kernel of an unnamed thread.
    events = [
        _runtime(11, 1, 0),
        _runtime(11, 2, 10),
        _runtime(22, 3, 20),
        _runtime(22, 4, 30),
        _runtime(22, 6, 35, "cudaMalloc", 2000),  # a long allocation among the HiFT thread's launches
        _runtime(99, 5, 40),
        _kernel("ampere_fp16_s16816gemm_fp16_128x128", 7, 1, 0, 4000),
        _kernel("void at::native::vectorized_elementwise_kernel", 7, 2, 4500, 1500),
        _kernel("fmha_cutlassF_f16_aligned_64x64", 13, 3, 3000, 1500),
        _kernel("Memcpy DtoH (Device -> Pinned)", 13, 4, 4500, 500, cat="gpu_memcpy"),
        _kernel("layer_norm_kernel", 7, 5, 30000, 1000),
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "tid": 11, "ts": 0, "dur": 50},  # not device work
    ]
    got = summarise(events, {11: "token2wav", 22: "token2wav-hift"})
    assert got["window_s"] == 0.031
    assert got["kernels"] == 5
    # Covered: 0-6000 and 30000-31000 = 7 ms of 31; two at once: 3000-4000 and 4500-5000 = 1.5 ms.
    assert got["busy_share"] == round(7000 / 31000, 4)
    assert got["overlap_share"] == round(1500 / 31000, 4)
    flow, hift = got["streams"]["7"], got["streams"]["13"]
    assert flow["busy_s"] == 0.0065 and flow["kernels"] == 3
    assert flow["threads"] == {"token2wav": 2, "thread 99": 1}
    assert flow["categories_s"] == {"gemm": 0.004, "elementwise": 0.0015, "layer_norm": 0.001}
    assert hift["threads"] == {"token2wav-hift": 2}
    assert hift["categories_s"] == {"attention": 0.0015, "memcpy": 0.0005}
    assert list(got["streams"]) == ["7", "13"]  # busiest first
    assert got["gaps"]["20-100 ms"] == {"count": 1, "s": 0.024}
    assert sum(g["count"] for g in got["gaps"].values()) == 1
    assert got["host_calls"]["token2wav"] == {
        "calls": 2, "s": 1e-05, "longest_ms": 0.005, "api_s": {"cudaLaunchKernel": 1e-05},
        "api_longest_ms": {"cudaLaunchKernel": 0.005},
    }  # fmt: skip
    hift_calls = got["host_calls"]["token2wav-hift"]
    assert hift_calls["longest_ms"] == 2.0
    assert hift_calls["api_longest_ms"] == {"cudaMalloc": 2.0, "cudaLaunchKernel": 0.005}
    assert list(got["host_calls"])[0] == "token2wav-hift"  # the most seconds first
    assert set(got["host_calls"]) == {
        "token2wav",
        "token2wav-hift",
        "thread 99",
    }  # 4000-4500 is covered by the HiFT stream
    line = timeline_line(got)
    assert "busy 23 %" in line and "token2wav 21 %" in line and "token2wav-hift 6 %" in line
    assert "token2wav-hift 0.00 s (longest 2.0 ms, cudaMalloc)" in line


def test_no_device_work():
    assert summarise([_runtime(1, 1, 0)], {}) == {"kernels": 0, "window_s": None}
    assert timeline_line({"kernels": 0, "window_s": None}) == "GPU timeline: no kernels in the window"


def test_thread_names_cover_every_id():
    names = thread_names()
    me = threading.current_thread()
    low = me.ident & 0xFFFFFFFF
    signed = low - (1 << 32) if low >= 1 << 31 else low
    assert names[me.native_id] == names[me.ident] == names[low] == names[signed] == me.name


def _spin(stop: threading.Event) -> None:
    """Python that never lets go of the interpreter lock of its own accord."""
    n = 0
    while not stop.is_set():
        n += 1


def _sleep(stop: threading.Event) -> None:
    """A thread that waits without the interpreter lock nearly all the time."""
    while not stop.is_set():
        time.sleep(0.01)


def test_without_cuda_the_window_samples_the_lock():
    """No trace without CUDA, but py-spy's samples of this process: a thread running pure Python
    holds the lock most of the window, in its own function."""
    stop = threading.Event()
    spinner = threading.Thread(target=_spin, args=(stop,), name="spinner")
    sleeper = threading.Thread(target=_sleep, args=(stop,), name="sleeper")
    spinner.start()
    sleeper.start()
    try:
        timeline = Timeline(start_s=0.0, window_s=1.5)
        timeline.start()
        time.sleep(2.0)
        timeline.finish()
    finally:
        stop.set()
        spinner.join()
        sleeper.join()
    got = timeline.summary()
    assert got["error"] == "no CUDA device: nothing to trace"
    gil = got["gil"]
    assert gil["window_s"] >= 1.5 and gil["expected"] >= 300
    held = gil["threads"]["spinner"]
    assert held["share"] > 0.5 and held["share"] == max(t["share"] for t in gil["threads"].values())
    assert next(iter(held["top"])) == "_spin (test_bench_timeline.py)"
    assert "interpreter lock held" in timeline_line(got) and "spinner" in timeline_line(got)
    # The sleeper never holds the lock, but the window's stacks find it, in its own function, in
    # nearly every sample, as they find the spinner.
    assert gil["threads"].get("sleeper", {"share": 0.0})["share"] < 0.05
    stacks = got["stacks"]
    assert stacks["window_s"] >= 1.5 and "held_share" not in stacks
    for name, leaf in (("sleeper", "_sleep"), ("spinner", "_spin")):
        assert stacks["threads"][name]["share"] > 0.5
        assert next(iter(stacks["threads"][name]["top"])) == f"{leaf} (test_bench_timeline.py)"


def test_a_level_that_ends_first():
    """The window's thread, stopped before its start (CUDA or not: the wait comes first)."""
    timeline = Timeline(start_s=5.0, window_s=1.0)
    timeline.finish()
    timeline._record()
    assert timeline.summary() == {
        "error": "the level ended before its window began",
        "gil": {"error": "not started"},
        "stacks": {"error": "not started"},
    }


def test_lock_holders_from_raw_samples():
    raw = "\n".join([
        "thread (101): token2wav;run (threading.py:1010);work (cached.py:119);past_and_new (inc.py:140) 30",
        "thread (101): token2wav;run (threading.py:1010);work (cached.py:119);past_and_new (inc.py:141) 10",
        "thread (101): token2wav;run (threading.py:1010);plan (cosyapp/steps.py:57);cat (torch/x.py:3) 20",
        "thread (7);select (selectors.py:415) 5",
        "a line py-spy does not write",
    ])  # fmt: skip
    got = holders(raw, expected=100)
    assert got == {
        "samples": 65,
        "expected": 100,
        "held_share": 0.65,
        "threads": {
            "token2wav": {
                "share": 0.6,
                "top": {"past_and_new (inc.py)": 0.4, "cat (torch/x.py)": 0.2},
                "own": {"plan (cosyapp/steps.py:57)": 0.2},
            },
            "thread 7": {"share": 0.05, "top": {"select (selectors.py)": 0.05}, "own": {}},
        },
    }  # fmt: skip
    line = gil_line(got | {"window_s": 5.0})
    assert line == (
        "; interpreter lock held 65 % of 5.0 s: token2wav 60 % (past_and_new (inc.py)), "
        "thread 7 5 % (select (selectors.py))"
    )
    assert gil_line({"error": "py-spy not found"}) == "; interpreter lock: py-spy not found"
    # where the worker's threads were: the flow thread's innermost line of the project's code
    assert where_line(got) == "; where: token2wav plan (cosyapp/steps.py:57) 20 %"
    assert where_line({"error": "py-spy not found"}) == ""


def test_options():
    args = parse_args(["--clients", "1,64,256", "--timeline", "64,stream:256", "--timeline-window", "2,1.5"])
    assert args.timeline == [(None, 64), ("stream", 256)] and args.timeline_window == (2.0, 1.5)
    assert parse_args([]).timeline == []
    # which levels get a window: 64 in either mode, 256 only streaming
    levels = [(m, c) for m in ("stream", "whole") for c in (1, 64, 256)]
    traced = {level for level in levels if level_timeline(args, *level) is not None}
    assert traced == {("stream", 64), ("whole", 64), ("stream", 256)}
    for bad in (["--timeline-window", "2"], ["--timeline", "x"], ["--timeline", "live:64"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


@pytest.mark.parametrize(
    ("kernel", "expected"),
    [  # names from the H100 profiles in docs/benchmarks/ (flow_profile.py, hift_speed.py), shortened
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x64", "attention"),
        ("sm90_xmma_fprop_implicit_gemm_f16f16_f16f32_f32_nhwckrsc_nhwc_tilesize128x128x64", "convolution"),
        ("nvjet_sm90_hsh_128x128_64x6_2x4_h_bz_bias_TNT", "gemm"),
        (
            "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float, false>",
            "layer_norm",
        ),
        (
            "void at::native::(anonymous namespace)::CatArrayBatchedCopy<OpaqueType<2u>, unsigned int, 4>",
            "copy_index",
        ),
        (
            "void at::native::elementwise_kernel<128, 4, gpu_kernel_impl<CUDAFunctor_add<float> > >",
            "elementwise",
        ),
        ("Memset (Device)", "other"),
    ],
)
def test_kernel_categories(kernel, expected):
    assert category(kernel) == expected
