"""The benchmark program: the --smoke run end to end (tiny model, CPU, every driver, both modes, the
baselines) and the pieces whose numbers can be checked by hand."""

import itertools
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from cosyapp.bench.__main__ import parse_args
from cosyapp.bench.load import TOKENS_PER_SECOND, bench_voice, write_speaker
from cosyapp.bench.resources import ResourceSampler, busiest, nvml_device
from cosyapp.bench.stats import FIRST_CHUNK_STAGES, playback_underruns, stalls_by_chunk

REPO = Path(__file__).resolve().parents[1]
PNG = b"\x89PNG\r\n\x1a\n"
SAMPLE_RATE = 24_000
# Packages the GPU machine lacks: the in-process benchmark must run without them.
NOT_ON_GPU_MACHINE = (
    "gradio",
    "gradio_client",
    "uvicorn",
    "fastapi",
    "starlette",
    "soundfile",
    "librosa",
)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """(result JSON, output folder, work folder) of one --smoke run."""
    folder = tmp_path_factory.mktemp("bench")
    out = folder / "smoke.json"
    command = [sys.executable, "-m", "cosyapp.bench", "--smoke", "--workdir", str(folder / "work")]
    done = subprocess.run(
        [*command, "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text()), folder, folder / "work"


def test_smoke_measures_every_driver_mode_and_level_once(smoke):
    result, _, _ = smoke
    settings = [(lv["driver"], lv["text"], lv["streaming"], lv["clients"]) for lv in result["levels"]]
    expected = itertools.product(["pipeline", "openai", "gradio"], ["short"], [True, False], [1, 2])
    assert sorted(settings) == sorted(expected)
    for level in result["levels"]:
        assert level["requests"] == level["clients"] and level["failed"] == 0, level["errors"]


def test_smoke_records_where_and_how_it_ran(smoke):
    result, _, _ = smoke
    assert result["engine"] == "TorchSpeechLM" and result["server"] == "own server, this process"
    assert result["hardware"]["device"] == "cpu" and result["hardware"]["cpu_count"] >= 1
    assert result["versions"]["torch"] == torch.__version__
    assert result["versions"]["gradio"] and result["versions"]["gradio_client"]
    assert result["command"].startswith("python -m cosyapp.bench --smoke")
    assert result["options"]["clients"] == [1, 2] and result["options"]["modes"] == ["stream", "whole"]
    assert result["options"]["baselines"] is True
    assert result["engine_options"]["first_hop"] == "25"
    # the start's phases, in order (no warm-up on a CPU); the phases fit in the whole start
    phases = result["startup_phases_s"]
    assert list(phases) == ["lm", "text_workers", "flow_graphs"] and min(phases.values()) >= 0
    assert sum(phases.values()) <= result["startup_s"]


def test_every_driver_received_exactly_the_audio_the_text_decodes(smoke, tmp_path):
    """Endless model: each request of the short text decodes 3 speech tokens per text token, so every
    driver must deliver exactly that much audio (HTTP bytes and gradio's reported samples included)."""
    from cosyapp.frontend.text import TextFrontend
    from cosyapp.models.checkpoint import BACKBONE_DIR

    result, _, work = smoke
    short = result["texts"]["short"]
    sentences = TextFrontend(work / "tiny" / BACKBONE_DIR).prepare(short["text"])
    text_tokens = sum(len(s.ids) for s in sentences)
    assert (short["text_tokens"], short["sentences"]) == (text_tokens, len(sentences))
    assert short["speech_tokens_per_text_token"] == 3
    assert short["speech_tokens"] == 3 * text_tokens and short["chars"] == len(short["text"]) < 30
    for level in result["levels"]:
        expected = level["clients"] * short["speech_tokens"] / TOKENS_PER_SECOND
        assert level["audio_s"] == pytest.approx(expected), (level["driver"], level["streaming"])


def test_latency_and_throughput_fields_are_consistent(smoke):
    result, _, _ = smoke
    for level in result["levels"]:
        assert 0 < level["ttfa_p50"] <= level["ttfa_p90"] <= level["ttfa_p99"] <= level["wall_s"]
        assert 0 < level["total_p50"] <= level["total_p90"] <= level["total_p99"] <= level["wall_s"]
        assert level["ttfa_p50"] <= level["total_p99"]
        assert level["rtf_aggregate"] == pytest.approx(level["wall_s"] / level["audio_s"])
        assert level["requests_per_s"] == pytest.approx(level["requests"] / level["wall_s"])
        assert level["audio_per_wall_s"] == pytest.approx(level["audio_s"] / level["wall_s"])
        if not level["streaming"]:  # a whole clip of one sentence arrives at once
            assert level["ttfa_p99"] == pytest.approx(level["total_p99"], abs=0.05)


def test_underrun_fields_are_counts_and_seconds(smoke):
    result, _, _ = smoke
    for level in [*result["levels"], result["baselines"]["b_engine_lm_serial_token2wav"]]:
        events, streams, stall = (
            level["underrun_events"],
            level["streams_with_underruns"],
            level["stall_s_total"],
        )
        assert isinstance(events, int) and isinstance(streams, int)
        assert 0 <= streams <= min(events, level["clients"])
        assert (stall > 0) == (events > 0) and stall < level["wall_s"]


def test_batch_histograms_sum_to_their_samples_and_stage_times_are_counted(smoke):
    result, _, _ = smoke
    for level in result["levels"]:
        for stage in ("lm", "flow", "hift"):
            histogram = {int(size): n for size, n in level["batch_hist"][stage].items()}
            assert sum(histogram.values()) == level["batch_samples"][stage] >= 1
            assert level[f"{stage}_max_batch"] == max(histogram)
        assert 1 <= level["lm_max_batch"] <= level["clients"]
        stages = level["stages"]
        assert stages["flow_calls"] >= 1 and stages["hift_calls"] >= 1
        assert 0 < stages["flow_s"] + stages["hift_s"] <= level["wall_s"]
        assert stages["flow_ms_per_call"] == pytest.approx(1000 * stages["flow_s"] / stages["flow_calls"])
        # HiFT's launches: inside its calls, and the launching thread's CPU time inside the launches
        # (on a CPU a launch computes, so it used CPU; a thread's CPU time never passes its wall time)
        assert 0 < stages["hift_launch_cpu_s"] <= stages["hift_launch_s"] + 0.001 * stages["hift_calls"]
        assert stages["hift_launch_s"] <= stages["hift_s"]
        assert stages["lm_tokens"] == level["clients"] * result["texts"]["short"]["speech_tokens"]
        # each stage's last progress lies inside the level, the LM's before the vocoder's last call
        last = level["stage_last_s"]
        assert 0 < last["lm"] <= last["hift"] <= level["wall_s"] + 0.05
        assert level["gpu_peak_allocated_gb"] is None and level["gpu_allocator"] is None  # a CPU run
        assert stages["flow_cache_least_free"] == 0  # no page pool on a CPU
        # No CUDA graphs on a CPU: nothing runs eagerly for want of one, nothing is captured.
        assert (stages["eager_flow_calls"], stages["graph_captures"], stages["graph_capture_s"]) == (0, 0, 0)


def test_the_first_chunks_stages_add_up_to_its_ttfa(smoke):
    result, _, _ = smoke
    for level in result["levels"]:
        stages = level["first_chunk_p50"]
        if level["driver"] != "pipeline":  # over HTTP the client sees no stages
            assert stages is None
            continue
        assert list(stages) == [stage for stage, _, _ in FIRST_CHUNK_STAGES]
        assert all(seconds >= 0 for seconds in stages.values()), stages
        assert stages["flow"] > 0 and stages["lm_first_tokens"] > 0
        assert stages["hift_launch"] > 0  # a CPU runs HiFT as it launches it: hift_wait is ~0 here
        if level["clients"] == 1:  # one request: its stages telescope to its TTFA (two clocks)
            assert sum(stages.values()) == pytest.approx(level["ttfa_p50"], abs=0.002)
        assert stages["lm_chunk_tokens"] > 0  # the chunk's (or, whole, every) token after the first


def test_each_level_says_which_threads_used_the_cpu(smoke):
    result, _, _ = smoke
    for level in result["levels"]:
        used = level["resources"]
        threads = used["threads_cpu_s"]
        assert used["wall_s"] == pytest.approx(level["wall_s"], abs=0.05)
        # the flow and HiFT ran on the worker's thread (no HiFT thread of its own on a CPU)
        assert threads["token2wav"] > 0 and "token2wav-hift" not in threads
        # each thread's time and the process's are counted in 10 ms ticks
        assert 0 < sum(threads.values()) <= used["process_cpu_s"] + 0.01 * len(threads)
        assert used["gpu_util_mean"] is None and used["gpu_util_samples"] == []  # a CPU run


SPIN_THEN_WAIT = """
import sys, time
end = time.process_time() + 0.5
while time.process_time() < end:
    pass
print("spun", flush=True)
sys.stdin.read()
"""


def test_nvml_is_asked_for_the_gpu_that_cuda_visible_devices_names():
    assert nvml_device(0, None) == 0 and nvml_device(1, "") == 1
    assert nvml_device(1, "3, 5") == 5
    uuid = "GPU-8e0f4a1c-5d2b-4f7e-9a3c-1b2d3e4f5a6b"
    assert nvml_device(0, f"{uuid},GPU-0") == uuid


def test_resources_count_a_threads_and_a_child_processs_own_cpu_time():
    spun, release = threading.Event(), threading.Event()

    def spin(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass
        spun.set()
        release.wait()

    sampler = ResourceSampler()
    sampler.start()
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE}
    child = subprocess.Popen([sys.executable, "-c", SPIN_THEN_WAIT], **pipes)
    spinner = threading.Thread(target=spin, args=(0.5,), name="bench-test-spin")
    spinner.start()
    try:
        assert spun.wait(60) and child.stdout.readline() == b"spun\n"
        used = sampler.stop()["resources"]  # while both still run (an ended thread or child is not seen)
    finally:
        release.set()
        spinner.join()
        child.communicate(b"", timeout=60)
    threads, children = used["threads_cpu_s"], used["children_cpu_s"]
    # the kernel counts thread time in clock ticks (10 ms): 0.5 s of spinning reads 0.49 to 0.51
    assert 0.47 <= threads["bench-test-spin"] < 0.5 + used["wall_s"]
    assert threads["bench-test-spin"] <= used["process_cpu_s"]
    # started after the sampler: all its CPU time is the level's
    assert len(children) == 1 and next(iter(children)).endswith(f"({child.pid})")
    assert next(iter(children.values())) >= 0.47
    assert busiest(used, 1)[0][0] in ("bench-test-spin", *children)


def test_the_engine_log_is_written_beside_the_json(smoke):
    _, folder, _ = smoke
    log = (folder / "smoke-engine.log").read_text()
    # The engine's INFO records of the run, e.g. the LM engine it chose for the local pipeline.
    assert " INFO cosyapp." in log and "speech-token LM engine" in log


def test_baselines_ran_on_the_same_load_and_their_ratios_match(smoke):
    result, _, _ = smoke
    baselines = result["baselines"]
    assert set(baselines) == {"a_sequential_reference", "b_engine_lm_serial_token2wav", "c_torch_engine"}
    assert "PyTorch" in baselines["c_torch_engine"]["same_as"]  # the smoke run's engine is that one
    reference = result["baselines_reference"]
    assert reference == {"driver": "pipeline", "text": "short", "streaming": True, "clients": 2}
    (d,) = [lv for lv in result["levels"] if all(lv[k] == v for k, v in reference.items())]
    audio = result["texts"]["short"]["audio_s"]
    for name, clients in (("a_sequential_reference", 2), ("b_engine_lm_serial_token2wav", 2)):
        base = baselines[name]
        assert base["requests"] == base["clients"] == clients and base["failed"] == 0
        assert base["audio_s"] == pytest.approx(clients * audio)
        assert 0 < base["ttfa_p50"] <= base["ttfa_p90"] <= base["ttfa_p99"] <= base["wall_s"]
        assert base["cosyapp_throughput_ratio"] == pytest.approx(
            d["audio_per_wall_s"] / base["audio_per_wall_s"]
        )
    serial = baselines["b_engine_lm_serial_token2wav"]
    assert serial["flow_max_batch"] == serial["hift_max_batch"] == 1
    assert serial["cosyapp_ttfa_p50_ratio"] == pytest.approx(serial["ttfa_p50"] / d["ttfa_p50"])


def test_plots_are_png_files_next_to_the_json(smoke):
    result, folder, _ = smoke
    assert set(result["plots"]) == {"latency", "throughput", "stages", "first-chunk"}
    for name, path in result["plots"].items():
        assert Path(path) == folder / f"smoke-{name}.png"
        assert Path(path).read_bytes()[:8] == PNG and Path(path).stat().st_size > 10_000


def test_playback_underruns_count_each_gap_and_its_stall():
    # Plays from 1.0: first chunk to 1.5; second (1.4) in time, to 2.0; third arrives 2.5: a 0.5 s stall,
    # plays to 3.5; fourth (3.0) in time.
    chunks = [(1.0, 0.5), (1.4, 0.5), (2.5, 1.0), (3.0, 0.2)]
    assert playback_underruns(chunks) == (1, pytest.approx(0.5))
    assert playback_underruns([(0.2, 0.1), (0.5, 0.1), (0.9, 0.1)]) == (2, pytest.approx(0.5))
    assert playback_underruns([]) == (0, 0.0)
    # By the late chunk's index, over requests: the third chunk above (0.5 s), the second and third below.
    by_chunk = stalls_by_chunk([chunks, [(0.2, 0.1), (0.5, 0.1), (0.9, 0.1)]])
    assert by_chunk == {"1": pytest.approx(0.2), "2": pytest.approx(0.8)}


def test_the_bench_voice_is_offered_by_name_from_the_model_folder(tiny_model_dir, tmp_path):
    """A server of the folder finds the voice the in-process driver uses, by name, unchanged."""
    import shutil

    from cosyapp.frontend.text import TextFrontend
    from cosyapp.frontend.voice import VoiceFrontend
    from cosyapp.frontend.voices import VoiceLibrary
    from cosyapp.models.checkpoint import BACKBONE_DIR

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    text = TextFrontend(folder / BACKBONE_DIR)
    write_speaker(folder, text)
    library = VoiceLibrary(tmp_path / "data", VoiceFrontend(folder), spk2info=folder / "spk2info.pt")
    mine = bench_voice(text)
    served = library.get(mine.info.id)
    assert mine.info.id in {info.id for info in library.list_voices()}
    assert served.prompt_ids == mine.prompt_ids and len(mine.prompt_ids) > 0
    for name in ("speech_tokens", "speech_feat", "embedding"):
        assert torch.equal(getattr(served.features, name), getattr(mine.features, name))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--baselines", "--drivers", "openai"], "--baselines compares against the pipeline driver"),
        (["--texts", "tokens", "--tokens", "250.5"], "invalid int value"),
        (["--texts", "tokens", "--tokens", "30"], "--tokens must be a positive multiple of 20"),
        (["--drivers", "pipeline,grpc"], "--drivers: unknown 'grpc'"),
        (["--clients", "1,x"], "--clients takes whole numbers"),
        (["--variant", "a:engine=vllm"], "'engine' is not one of first_hop"),
        (["--variant", "a:overlap_hift=maybe"], "overlap_hift takes true or false"),
        (["--variant", "a:first_hop=x"], "first_hop takes a number"),
        (["--variant", "a:first_hop=2"], "first_hop must be between"),
        (["--variant", "hop15"], "--variant takes NAME:FIELD=VALUE"),
        (["--variant", "a:first_hop=15", "--drivers", "openai"], "--variant measures the pipeline driver"),
    ],
)
def test_bad_options_stop_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_options_keep_the_earlier_flags_and_add_first_hop_and_eager_flow():
    args = parse_args(
        ["--full-size", "--engine", "vllm", "--tokens", "260", "--modes", "stream,whole",
         "--clients", "1,16,64", "--no-cuda-graphs", "--workdir", "work", "--out", "b.json",
         "--max-batch", "32", "--gpu-memory-utilization", "0.5", "--first-hop", "12",
         "--drivers", "pipeline"]
    )  # fmt: skip
    assert (args.full_size, args.engine, args.tokens, args.modes) == (True, "vllm", 260, ["stream", "whole"])
    assert (args.clients, args.cuda_graphs, args.max_batch, args.first_hop) == ([1, 16, 64], False, 32, 12)
    assert args.drivers == ["pipeline"] and args.gpu_memory_utilization == 0.5
    assert parse_args([]).cuda_graphs


@pytest.mark.parametrize("field", ["compile_flow", "compile_hift"])
def test_compiling_reaches_the_serve_options(field):
    flag = "--" + field.replace("_", "-")
    assert getattr(parse_args([flag]).serve, field)
    assert not getattr(parse_args([]).serve, field)  # compile_hift: None, on a GPU only


def test_the_in_process_benchmark_imports_nothing_the_gpu_machine_lacks():
    blocked = ", ".join(repr(name) for name in NOT_ON_GPU_MACHINE)
    code = (
        f"import sys\nfor name in ({blocked}):\n    sys.modules[name] = None\n"
        "from cosyapp.bench.__main__ import parse_args\n"
        "from cosyapp.bench import run\n"
        "args = parse_args(['--drivers', 'pipeline', '--baselines'])\n"
        "print(args.drivers)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['pipeline']"
