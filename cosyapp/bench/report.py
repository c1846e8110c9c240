"""What a result file says about where and how it was measured, and the table printed while running."""

import importlib.metadata
import os
import platform
import sys
import time
from pathlib import Path

import torch

PACKAGES = ("torch", "vllm", "transformers", "gradio", "gradio_client", "httpx", "cosyapp")


def versions() -> dict[str, str | None]:
    """Installed versions of the packages that shape the numbers (None: not installed)."""
    found = {}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            # e.g. vLLM unpacked onto PYTHONPATH without its metadata: ask the module once imported
            module = sys.modules.get(name)
            found[name] = getattr(module, "__version__", None)
    return found


def hardware(device: torch.device) -> dict:
    """The accelerator (if any), the CPU and the operating system."""
    gpu = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        gpu = {"name": props.name, "memory_gb": props.total_memory / 2**30, "cuda": torch.version.cuda}
    return {
        "device": str(device),
        "gpu": gpu,
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def _cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S %Z")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def row(level: dict) -> str:
    """One printed line of a level: latency, throughput, underruns, engine batches and stage times."""
    mode = "stream" if level["streaming"] else "whole"
    head = f"{level['driver']:8} {level['text']:6} {mode:6} x{level['clients']:<4}"
    latency = (
        f"TTFA p50/p90/p99 {_ms(level['ttfa_p50'])}/{_ms(level['ttfa_p90'])}/{_ms(level['ttfa_p99'])} ms  "
        f"total p50/p99 {_ms(level['total_p50'])}/{_ms(level['total_p99'])} ms"
    )
    rtf = "-" if level["rtf_aggregate"] is None else f"{level['rtf_aggregate']:.4f}"
    throughput = f"RTF {rtf}  {level['requests_per_s']:.2f} req/s  {level['audio_per_wall_s']:.1f} audio s/s"
    underruns = (
        f"underruns {level['underrun_events']} in {level['streams_with_underruns']} streams "
        f"({level['stall_s_total']:.2f} s)"
    )
    parts = [head, latency, throughput, underruns]
    stages = level.get("stages")
    if stages:
        parts.append(
            f"batch LM<={level['lm_max_batch']} flow<={level['flow_max_batch']} "
            f"HiFT<={level['hift_max_batch']}  flow {stages['flow_s']:.2f} s ({stages['flow_calls']} calls) "
            f"HiFT {stages['hift_s']:.2f} s ({stages['hift_calls']})"
        )
    if level["failed"]:
        parts.append(f"FAILED {level['failed']}: {level['errors'][0]}")
    return "  ".join(parts)
