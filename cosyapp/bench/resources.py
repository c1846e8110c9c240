"""Where a level's time went on the host and the GPU: CPU seconds per thread and per child process,
and how busy the GPU was.

The engine's stages share one interpreter (the event loop, the flow and HiFT threads, vLLM's output
handling) and, without MPS, one GPU with vLLM's engine-core process. A level's counters say how long
each stage ran, not whether it waited for the CPU or for the GPU; these numbers tell the two apart:
a thread whose CPU seconds come near the level's wall time was bound by its own Python and kernel
launches (or by the other threads holding the interpreter lock), and a GPU busy well below 100 % while
requests wait means the host did not keep it fed.

Threads are named as Python names them (``token2wav``, ``token2wav-hift``, ``MainThread``...), other
threads by their OS name (CUDA's, torch's), each summed over threads of one name. The GPU's busy share
is NVML's utilization (the share of each driver sample period in which a kernel ran, on any process),
polled every ``period`` seconds; None where NVML or a CUDA device is missing.
"""

import importlib
import logging
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import psutil

log = logging.getLogger(__name__)


class ResourceSampler:
    """CPU time per thread of this process and per child process, and the GPU's utilization, between
    ``start`` and ``stop``."""

    def __init__(self, period: float = 0.1):
        self.period = period
        self._process = psutil.Process()
        self._read_gpu = _gpu_utilization()
        self._gpu: list[float] = []
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None
        self._threads0: dict[str, float] = {}
        self._children0: dict[str, float] = {}
        self._process0 = 0.0
        self._wall0 = 0.0

    def start(self) -> None:
        self._threads0, self._children0 = _thread_seconds(self._process), _child_seconds(self._process)
        self._process0 = _cpu_seconds(self._process.cpu_times())
        self._wall0 = time.perf_counter()
        if self._read_gpu is not None:
            self._poller = threading.Thread(target=self._poll_gpu, name="bench-gpu-poll", daemon=True)
            self._poller.start()

    def stop(self) -> dict:
        """The level's numbers: ``{"resources": {...}}``: CPU seconds of the process, per thread name and
        per child process, and the GPU's mean utilization (0-1) with its samples in percent."""
        wall = time.perf_counter() - self._wall0
        self._stop.set()
        if self._poller is not None:
            self._poller.join()
        threads = _deltas(self._threads0, _thread_seconds(self._process))
        children = _deltas(self._children0, _child_seconds(self._process))
        process = _cpu_seconds(self._process.cpu_times()) - self._process0
        gpu = self._gpu
        return {
            "resources": {
                "wall_s": round(wall, 3),
                "process_cpu_s": round(process, 3),
                "threads_cpu_s": threads,
                "children_cpu_s": children,
                "gpu_util_mean": round(sum(gpu) / len(gpu) / 100, 3) if gpu else None,
                "gpu_util_samples": [round(x) for x in gpu],
            }
        }

    def _poll_gpu(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self._gpu.append(self._read_gpu())
            except Exception:  # the level goes on; its mean comes from the samples taken
                log.warning("NVML stopped answering; GPU utilization sampling ends", exc_info=True)
                return


def busiest(resources: dict, n: int = 3) -> list[tuple[str, float]]:
    """The ``n`` threads (or child processes) with the most CPU time, as (name, share of the wall)."""
    wall = resources["wall_s"] or 1.0
    every = {**resources["threads_cpu_s"], **resources["children_cpu_s"]}
    top = sorted(every.items(), key=lambda item: -item[1])[:n]
    return [(name, seconds / wall) for name, seconds in top]


def _gpu_utilization() -> Callable[[], float] | None:
    """A reader of the current CUDA device's NVML utilization in percent, or None without a CUDA
    device or NVML. NVML comes from nvidia-ml-py where installed, else from the copy vLLM ships (vLLM
    does not install nvidia-ml-py, so torch.cuda.utilization cannot be relied on)."""
    import torch

    if not torch.cuda.is_available():
        return None
    nvml = _nvml_module()
    if nvml is None:
        return None
    try:
        nvml.nvmlInit()
        entry = nvml_device(torch.cuda.current_device(), os.environ.get("CUDA_VISIBLE_DEVICES"))
        if isinstance(entry, int):
            handle = nvml.nvmlDeviceGetHandleByIndex(entry)
        else:
            handle = nvml.nvmlDeviceGetHandleByUUID(entry)
        nvml.nvmlDeviceGetUtilizationRates(handle)
    except Exception:  # no driver library, a name NVML does not know: measure without the GPU's share
        log.warning("the GPU's utilization is not measured: NVML did not answer", exc_info=True)
        return None
    return lambda: float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)


def _nvml_module():
    for name in ("pynvml", "vllm.third_party.pynvml"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return None


def nvml_device(cuda_index: int, visible: str | None) -> int | str:
    """NVML's name for CUDA device ``cuda_index`` under CUDA_VISIBLE_DEVICES ``visible``: its NVML
    index, or the UUID the variable lists for it."""
    if not visible:
        return cuda_index
    entry = [part.strip() for part in visible.split(",")][cuda_index]
    return int(entry) if entry.isdigit() else entry


def _cpu_seconds(times) -> float:
    return float(times.user + times.system)


def _thread_seconds(process: psutil.Process) -> dict[str, float]:
    """CPU seconds so far of each thread name of ``process`` (threads of one name summed)."""
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    seconds: dict[str, float] = defaultdict(float)
    for thread in process.threads():
        name = names.get(thread.id) or _os_thread_name(process.pid, thread.id)
        seconds[name] += thread.user_time + thread.system_time
    return dict(seconds)


def _os_thread_name(pid: int, tid: int) -> str:
    try:
        return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip() or f"thread {tid}"
    except OSError:
        return f"thread {tid}"


def _child_seconds(process: psutil.Process) -> dict[str, float]:
    """CPU seconds so far of each child process (vLLM's engine core, its workers), by name and pid."""
    seconds = {}
    for child in process.children(recursive=True):
        try:
            seconds[f"{child.name()} ({child.pid})"] = _cpu_seconds(child.cpu_times())
        except psutil.Error:  # ended meanwhile
            continue
    return seconds


def _deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """after - before per name (a name new since ``before`` counts from 0), largest first, > 0 only."""
    changed = {name: after[name] - before.get(name, 0.0) for name in after}
    return {name: round(s, 3) for name, s in sorted(changed.items(), key=lambda item: -item[1]) if s > 0}
