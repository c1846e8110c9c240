"""One options object: the command line, the benchmark and the engine constructors share its defaults."""

import importlib
import inspect
import os
from dataclasses import replace
from pathlib import Path

import pytest

from cosyapp.options import DEFAULTS, OptionError, ServeOptions


@pytest.fixture(autouse=True)
def no_cosyapp_environment(monkeypatch):
    for name in [n for n in os.environ if n.startswith("COSYAPP_")]:
        monkeypatch.delenv(name)


def test_the_command_line_defaults_are_the_options_defaults():
    from cosyapp.settings import Settings, parse_settings

    assert Settings().serve_options() == DEFAULTS
    assert parse_settings([]).serve_options() == DEFAULTS


@pytest.mark.parametrize("field", ["compile_flow", "compile_hift"])
def test_the_compile_flags_and_their_variables_turn_compiling_on_and_off(monkeypatch, field):
    """The default None means: where the model is on a GPU (engine/build.py)."""
    from cosyapp.settings import parse_settings

    assert getattr(DEFAULTS, field) is None
    assert getattr(parse_settings([]).serve_options(), field) is None
    assert getattr(parse_settings(["--" + field.replace("_", "-")]).serve_options(), field) is True
    monkeypatch.setenv("COSYAPP_" + field.upper(), "1")
    assert getattr(parse_settings([]).serve_options(), field) is True
    flag = "--no-" + field.replace("_", "-")
    assert getattr(parse_settings([flag]).serve_options(), field) is False
    monkeypatch.setenv("COSYAPP_" + field.upper(), "0")
    assert getattr(parse_settings([]).serve_options(), field) is False


def test_the_command_line_choices_reach_the_options():
    from cosyapp.settings import parse_settings

    argv = ["--engine", "torch", "--max-streams", "8", "--gpu-memory-utilization", "0.5", "--first-hop", "15"]
    argv += ["--max-text-chars", "900", "--cache-dir", "cache"]
    argv += ["--lm-in-process", "--token2wav-priority", "-1", "--text-lanes", "2"]
    argv += ["--expect-ms", "5", "--no-hift-first"]
    assert parse_settings(argv).serve_options() == replace(
        DEFAULTS,
        engine="torch",
        max_streams=8,
        max_batch=8,  # a batch never holds more than the admitted streams
        gpu_memory_utilization=0.5,
        first_hop=15,
        max_text_chars=900,
        cache_dir=Path("cache"),
        lm_in_process=True,
        token2wav_priority=-1,
        text_lanes=2,
        expect_ms=5.0,
        hift_first=False,
    )


def test_the_benchmark_defaults_are_the_options_defaults():
    from cosyapp.bench.__main__ import parse_args

    args = parse_args(["--clients", str(DEFAULTS.max_streams)])
    # Except the sentence budget: the bench's load decodes set token counts, far past a spoken pace.
    assert args.serve == replace(DEFAULTS, slowest_speech_rate=0)


@pytest.mark.parametrize(
    ("constructor", "parameter", "option"),
    [
        ("cosyapp.engine.token2wav.worker:Token2Wav", "max_batch", "max_batch"),
        ("cosyapp.engine.token2wav.worker:Token2Wav", "first_hop", "first_hop"),
        ("cosyapp.engine.token2wav.worker:Token2Wav", "stream_priority", "token2wav_priority"),
        ("cosyapp.engine.token2wav.worker:Token2Wav", "expect_ms", "expect_ms"),
        ("cosyapp.engine.token2wav.worker:Token2Wav", "fill_ms", "fill_ms"),
        ("cosyapp.engine.pipeline:Pipeline", "max_streams", "max_streams"),
        ("cosyapp.engine.pipeline:Pipeline", "max_waiting", "max_waiting"),
        ("cosyapp.engine.pipeline:Pipeline", "text_lanes", "text_lanes"),
        ("cosyapp.engine.lm.torch_engine:TorchSpeechLM", "max_batch", "max_batch"),
        ("cosyapp.engine.lm.vllm_engine:VllmSpeechLM", "gpu_memory_utilization", "gpu_memory_utilization"),
        ("cosyapp.engine.lm.vllm_engine:VllmSpeechLM", "max_num_seqs", "max_streams"),
        ("cosyapp.engine.lm.vllm_engine:VllmSpeechLM", "in_process", "lm_in_process"),
        ("cosyapp.frontend.text:TextFrontend", "max_chars", "max_text_chars"),
    ],
)
def test_engine_constructors_default_to_the_options(constructor, parameter, option):
    module, name = constructor.split(":")
    cls = getattr(importlib.import_module(module), name)
    default = inspect.signature(cls).parameters[parameter].default
    assert default == getattr(DEFAULTS, option)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"engine": "onnx"}, "engine must be one of auto, vllm, torch"),
        ({"max_streams": 0}, "max_streams must be at least 1"),
        ({"gpu_memory_utilization": 0.99}, "gpu_memory_utilization must be between 0.05 and 0.95"),
        ({"first_hop": 9}, "first_hop must be between 10 and 100"),
        ({"first_hop": 101}, "first_hop must be between 10 and 100"),
        ({"max_batch": 0}, "max_batch must be at least 1"),
        ({"flow_dtype": "int8"}, "flow_dtype must be one of"),
        ({"token2wav_priority": 1}, "token2wav_priority must be 0 or -1"),
        ({"expect_ms": 60}, "expect_ms must be between 0 and 50"),
        ({"fill_ms": 501}, "fill_ms must be between 0 and 500"),
        ({"text_lanes": -1}, "text_lanes must be between 0"),
    ],
)
def test_an_option_out_of_range_is_refused_with_its_rule(change, message):
    with pytest.raises(OptionError, match=message):
        ServeOptions(**change)


def test_the_command_line_names_the_flag_of_a_bad_option(capsys):
    from cosyapp.settings import parse_settings

    with pytest.raises(SystemExit):
        parse_settings(["--gpu-memory-utilization", "0.01"])
    assert "--gpu-memory-utilization must be between 0.05 and 0.95" in capsys.readouterr().err


def test_the_benchmark_names_the_flag_of_a_bad_option(capsys):
    from cosyapp.bench.__main__ import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--max-batch", "0"])
    assert "--max-batch must be at least 1" in capsys.readouterr().err


def test_the_step_size_and_the_fill_reach_the_worker_s_queue(tiny_model):
    from cosyapp.engine.build import build_token2wav

    options = ServeOptions(max_batch=4, step_frames_per_row=500, whole_step_frames_per_row=1000, fill_ms=150)
    worker = build_token2wav(tiny_model, options)
    assert worker.step_frames == 2000 and worker._queue.step_frames == 2000
    assert worker._queue.whole_step_frames == 4000
    assert worker._queue.fill_s == 0.15
    assert build_token2wav(tiny_model, DEFAULTS).step_frames == DEFAULTS.max_batch * 250


def test_what_only_a_gpu_gains_from_is_on_there_and_off_on_a_cpu():
    import torch

    from cosyapp.engine.build import token2wav_settings

    gpu_only = {"flow_cache_graphs": True, "overlap_hift": True, "hift_first": True, "lm_yield_ms": 400.0}
    gpu = token2wav_settings(torch.device("cuda"), DEFAULTS)
    cpu = token2wav_settings(torch.device("cpu"), DEFAULTS)
    assert {k: gpu[k] for k in gpu_only} == gpu_only and DEFAULTS.lm_yield_ms == 400.0
    assert {k: cpu[k] for k in gpu_only} == {k: False for k in gpu_only} | {"lm_yield_ms": 0.0}
    assert gpu["autocast_dtype"] == torch.float16 and cpu["autocast_dtype"] is None
    # Asked for, the GPU's levers stay off elsewhere; turned off, they are off on a GPU too.
    asked = replace(DEFAULTS, flow_overlap=True, hift_graphs=True)
    assert not any(token2wav_settings(torch.device("cpu"), asked)[k] for k in ("flow_overlap", "hift_graphs"))
    assert all(token2wav_settings(torch.device("cuda"), asked)[k] for k in ("flow_overlap", "hift_graphs"))
    off = replace(DEFAULTS, overlap_hift=False, lm_yield_ms=0.0)
    assert not token2wav_settings(torch.device("cuda"), off)[
        "hift_first"
    ]  # its own stream only with the thread
    assert token2wav_settings(torch.device("cuda"), off)["lm_yield_ms"] == 0.0
