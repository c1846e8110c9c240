"""Running where users run cosyapp: defaults sized to the GPU's memory, Spaces (ZeroGPU, CPU hardware),
and vLLM's plugin from a source tree that is not installed."""

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from test_app import clean_env, free_port

from cosyapp.deploy.sizing import CardTooSmall, minimum_gib, size_for_card
from cosyapp.deploy.space import CPU_SPACE_REASON

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def readme_card_rows() -> list[tuple[str, float, float, float, int, float, float]]:
    """(card, lowest GiB, highest GiB, share, streams, lowest and highest flow cache GiB) per row of
    the README's sizing table."""
    rows = re.findall(
        r"^\| (\d+ GB) \([^)]*\) \| ([\d.]+)-([\d.]+) GiB \| ([\d.]+) \| (\d+) \| ([\d.]+)-([\d.]+) GiB \|$",
        README,
        re.MULTILINE,
    )
    return [(c, float(a), float(b), float(s), int(n), float(p), float(q)) for c, a, b, s, n, p, q in rows]


def test_the_readme_documents_24_40_80_and_141_gb_cards():
    assert [row[0] for row in readme_card_rows()] == ["24 GB", "40 GB", "80 GB", "141 GB"]


@pytest.mark.parametrize("row", readme_card_rows(), ids=lambda row: row[0])
def test_memory_derived_defaults_are_what_the_readme_says(row):
    card, low, high, share, streams, pool_low, pool_high = row
    for memory in (low, (low + high) / 2, high):
        sizing = size_for_card("card", memory)
        assert (sizing.gpu_memory_utilization, sizing.max_streams) == (share, streams), (card, memory)
        assert pool_low - 0.05 <= sizing.flow_cache_gib <= pool_high + 0.05, (card, memory)
        assert sizing.sized == ("gpu_memory_utilization", "max_streams")


def test_the_h200_keeps_the_measured_configuration():
    sizing = size_for_card("NVIDIA H200", 139.8)  # what torch reported in docs/benchmarks
    assert (sizing.gpu_memory_utilization, sizing.max_streams) == (0.3, 64)
    assert sizing.flow_cache_gib > 64 * 0.75  # every stream's pages of a 10.4 s sentence


def test_given_options_stay_as_given_and_the_rest_is_sized():
    sizing = size_for_card("NVIDIA L4", 22.0, max_streams=100)
    assert sizing.max_streams == 100 and sizing.gpu_memory_utilization == 0.3
    assert sizing.sized == ("gpu_memory_utilization",)
    assert "up to 100 streams (given)" in sizing.describe()
    smaller_share = size_for_card("NVIDIA L4", 22.0, gpu_memory_utilization=0.5)
    assert smaller_share.max_streams == 8 and smaller_share.sized == ("max_streams",)


def test_without_the_flow_cache_only_activations_bound_the_streams():
    sizing = size_for_card("NVIDIA L4", 22.0, flow_cache_gb=0)
    assert sizing.max_streams == 64 and sizing.flow_cache_gib == 0
    assert "flow cache off" in sizing.describe()


def test_a_small_card_gives_vllm_its_minimum_and_fewer_streams():
    sizing = size_for_card("NVIDIA T4", 14.6)
    assert sizing.gpu_memory_utilization * 14.6 == pytest.approx(6.0)
    assert sizing.max_streams == 8
    assert size_for_card("NVIDIA T4", 14.6, flow_cache_inputs=False).max_streams == 2


@pytest.mark.parametrize(
    "memory, streams", [(22.0, 8), (24.0, 8), (39.0, 16), (40.0, 16), (79.0, 40), (80.0, 40), (139.8, 64)]
)
def test_keys_and_values_hold_a_quarter_of_the_streams_per_page(memory, streams):
    """--no-flow-cache-inputs: a stream's pages are four times the bytes, so they bound the streams."""
    inputs, kv = size_for_card("card", memory), size_for_card("card", memory, flow_cache_inputs=False)
    assert kv.max_streams == streams and kv.flow_cache_gib == inputs.flow_cache_gib
    assert inputs.max_streams >= kv.max_streams


def test_with_attention_inputs_the_activations_bound_a_small_cards_streams():
    from cosyapp.deploy.sizing import ACTIVATIONS_PER_STREAM_GIB, FLOW_CACHE_SHARE, stream_pages_gib

    sizing = size_for_card("NVIDIA L4", 22.0)
    by_pages = sizing.flow_cache_gib / stream_pages_gib()
    rest = sizing.flow_cache_gib / FLOW_CACHE_SHARE * (1 - FLOW_CACHE_SHARE)  # what the pool leaves
    assert by_pages > 30 and sizing.max_streams <= rest / ACTIVATIONS_PER_STREAM_GIB < by_pages


def test_a_card_too_small_for_the_model_says_what_it_needs():
    assert 11.8 < minimum_gib() < 11.9 and 12.6 < minimum_gib(inputs=False) < 12.8
    size_for_card("card", minimum_gib() + 0.01)
    with pytest.raises(CardTooSmall) as error:
        size_for_card("NVIDIA GeForce RTX 3060", 11.8)
    message = str(error.value)
    assert "has 11.8 GiB; cosyapp needs about 11.9 GiB" in message and "--device cpu" in message
    # Both options given: the operator decides, no refusal.
    assert size_for_card("card", 8.0, gpu_memory_utilization=0.3, max_streams=1).max_streams == 1


def test_settings_leave_unset_options_to_the_card_and_keep_given_ones(monkeypatch):
    from cosyapp.settings import parse_settings

    monkeypatch.delenv("COSYAPP_MAX_STREAMS", raising=False)
    monkeypatch.delenv("COSYAPP_GPU_MEMORY_UTILIZATION", raising=False)
    settings = parse_settings([])
    assert settings.card_sized == ("gpu_memory_utilization", "max_streams")
    assert (settings.max_streams, settings.gpu_memory_utilization) == (64, 0.3)  # a CPU keeps these
    monkeypatch.setenv("COSYAPP_MAX_STREAMS", "12")
    settings = parse_settings(["--gpu-memory-utilization", "0.4"])
    assert settings.card_sized == () and (settings.max_streams, settings.gpu_memory_utilization) == (12, 0.4)
    assert settings.serve_options().max_batch == 12  # a batch never holds more than the streams


def test_a_zero_gpu_space_explains_why_it_cannot_run_and_exits_non_zero(tmp_path):
    # What a ZeroGPU Space sets (the spaces package requires both to call itself on ZeroGPU).
    env = clean_env(
        SPACE_ID="user/cosyapp",
        SPACES_ZERO_GPU="true",
        SPACES_ZERO_DEVICE_API_URL="http://127.0.0.1:9/api",
        COSYAPP_CACHE_DIR=str(tmp_path),
    )
    command = [sys.executable, "app.py"]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "cosyapp cannot run on ZeroGPU hardware" in done.stderr
    assert "ZeroGPU lends a GPU to one decorated function call at a time" in done.stderr
    assert "L4 with 24 GB or larger" in done.stderr
    assert not any(tmp_path.iterdir())  # refused before loading anything


def test_a_cpu_space_serves_the_demo_model_with_a_banner_saying_why(tmp_path):
    port = free_port()
    env = clean_env(
        SPACE_ID="user/cosyapp",
        GRADIO_SERVER_NAME="127.0.0.1",  # a Space listens on every interface; the test on loopback
        GRADIO_SERVER_PORT=str(port),
        HF_HUB_OFFLINE="1",
        CUDA_VISIBLE_DEVICES="",
    )
    folders = ["--cache-dir", str(tmp_path / "cache"), "--data-dir", str(tmp_path / "data")]
    log_path = tmp_path / "app.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "app.py", *folders], cwd=REPO, env=env, stdout=log, stderr=log
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert process.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            try:
                health = httpx.get(f"{base}/health", timeout=5)
                if health.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        config = httpx.get(f"{base}/config", timeout=30).text  # the page's components, banner included
    finally:
        process.terminate()
        process.wait(timeout=60)
    body = health.json()
    assert body["demo"] and body["demo_reason"] == CPU_SPACE_REASON
    assert body["device"] == "cpu" and body["sizing"] is None and body["max_streams"] == 64
    assert "tiny-model" in body["model"]
    assert "Demo model: random weights, it speaks noise" in config and CPU_SPACE_REASON in config
    assert f"DEMO MODE ({CPU_SPACE_REASON})" in log_path.read_text()


def test_an_uninstalled_source_tree_gives_vllm_its_plugin_entry_point(tmp_path):
    # A Space's checkout: the source and pyproject.toml, nothing installed from it. -S leaves
    # site-packages (and the installed cosyapp) out. The entry point must reach a child interpreter,
    # as it must reach vLLM's engine process.
    source = tmp_path / "space"
    shutil.copytree(REPO / "cosyapp", source / "cosyapp", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", source)
    code = f"""
import subprocess, sys
sys.path.insert(0, {str(source)!r})
from cosyapp.deploy.plugin import is_installed, provide_vllm_plugin
assert not is_installed()
from pathlib import Path
print(provide_vllm_plugin(Path({str(tmp_path / "plugin")!r})).name)
child = "from importlib.metadata import entry_points; import importlib.util; " \\
    "[ep] = entry_points(group='vllm.general_plugins', name='cosyapp'); " \\
    "print(ep.value, importlib.util.find_spec(ep.module).origin)"
print(subprocess.run([sys.executable, "-S", "-c", child], capture_output=True, text=True, check=True).stdout)
"""
    env = clean_env()
    env.pop("PYTHONPATH", None)
    done = subprocess.run(
        [sys.executable, "-S", "-c", code], cwd=tmp_path, capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [
        "cosyapp-0.1.0.dist-info",
        "cosyapp.engine.lm.vllm_model:register",
        str(source / "cosyapp/engine/lm/vllm_model.py"),
    ]


def test_an_installed_cosyapp_needs_no_extra_plugin_metadata(tmp_path):
    from cosyapp.deploy.plugin import provide_vllm_plugin

    assert provide_vllm_plugin(tmp_path) is None and not any(tmp_path.iterdir())
