"""What a result file says about where and how it was measured, the table printed while running, and
its figures, PNG files beside its JSON (``out.json`` -> ``out-latency.png``, ...):

- latency: TTFA and total latency (p50 solid, p99 dashed) against concurrency, one column per text;
- throughput: seconds of audio per wall second against concurrency, baselines as markers;
- stages: flow, HiFT and the rest of each level's wall time, per text and mode (engine statistics).
"""

import importlib.metadata
import os
import platform
import sys
import time
from pathlib import Path

import torch

from cosyapp.bench.resources import busiest
from cosyapp.bench.stats import FIRST_CHUNK_STAGES

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


def timeline_line(traced: dict) -> str:
    """A level's GPU timeline (timeline.py) in one line: the busy and overlapping shares of its
    window, each stream's share with its main launching thread, then the interpreter lock's holders."""
    gil = gil_line(traced.get("gil")) + where_line(traced.get("stacks"))
    if traced.get("error") or not traced.get("kernels"):
        return f"GPU timeline: {traced.get('error') or 'no kernels in the window'}{gil}"
    streams = ", ".join(
        f"{next(iter(s['threads']), '?')} {100 * s['busy_share']:.0f} %" for s in traced["streams"].values()
    )
    host = ", ".join(
        f"{thread} {c['s']:.2f} s (longest {c['longest_ms']:.1f} ms{_longest_api(c)})"
        for thread, c in list(traced.get("host_calls", {}).items())[:3]
    )
    return (
        f"GPU timeline {traced['window_s']:.1f} s: this process busy {100 * traced['busy_share']:.0f} %, "
        f"two streams at once {100 * traced['overlap_share']:.0f} %; by stream: {streams}; "
        f"CUDA calls by thread: {host}{gil}"
    )


# The worker's threads whose whereabouts a level's line names (timeline.py's ``stacks``).
WATCHED = ("token2wav-hift", "token2wav")


def where_line(stacks: dict | None) -> str:
    """Where the worker's threads (WATCHED) were in a timeline's window, as the line's last part: each
    one's three innermost lines of this project's code it was found in most, running or waiting."""
    if not stacks or stacks.get("error"):
        return ""
    found = [(name, stacks["threads"][name]) for name in WATCHED if name in stacks["threads"]]
    parts = [
        f"{name} " + ", ".join(f"{frame} {100 * share:.0f} %" for frame, share in list(t["own"].items())[:3])
        for name, t in found
        if t["own"]
    ]
    return f"; where: {'; '.join(parts)}" if parts else ""


def gil_line(gil: dict | None) -> str:
    """The interpreter lock's holders in a timeline's window (gil.py), as the line's last part: its
    held share, then the three threads that held it most, each with the function it held it most in."""
    if not gil:
        return ""
    if gil.get("error"):
        return f"; interpreter lock: {gil['error']}"
    threads = ", ".join(
        f"{name} {100 * t['share']:.0f} % ({next(iter(t['top']), '?')})"
        for name, t in list(gil["threads"].items())[:3]
    )
    return f"; interpreter lock held {100 * gil['held_share']:.0f} % of {gil['window_s']:.1f} s: {threads}"


def _launches(stages: dict) -> str:
    """HiFT's launches in wall and CPU time, where the level has them (levels before had not)."""
    if "hift_launch_s" not in stages:
        return ""
    return f"; launches {stages['hift_launch_s']:.2f} s, {stages['hift_launch_cpu_s']:.2f} s of CPU"


def _longest_api(calls: dict) -> str:
    """The API of a thread's longest CUDA call, where the trace says which (``api_longest_ms``)."""
    longest = calls.get("api_longest_ms")
    return f", {max(longest, key=longest.get)}" if longest else ""


def row(level: dict) -> str:
    """One printed line of a level: latency, throughput, underruns, engine batches and stage times."""
    mode = "stream" if level["streaming"] else "whole"
    head = f"{level['driver']:8} {level['text']:6} {mode:6} x{level['clients']:<4}"
    if level.get("variant"):
        head = f"[{level['variant']}] {head}"
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
    late = level.get("stall_s_by_chunk")
    if late:
        underruns += " late chunks " + ", ".join(f"#{index} {stall:.1f} s" for index, stall in late.items())
    parts = [head, latency, throughput, underruns]
    stages = level.get("stages")
    if stages:
        parts.append(
            f"batch LM<={level['lm_max_batch']} flow<={level['flow_max_batch']} "
            f"HiFT<={level['hift_max_batch']}  flow {stages['flow_s']:.2f} s ({stages['flow_calls']} calls) "
            f"HiFT {stages['hift_s']:.2f} s ({stages['hift_calls']}" + _launches(stages) + ")"
        )
        last = level.get("stage_last_s") or {}
        if last.get("lm") and stages.get("lm_tokens"):
            parts.append(
                f"LM decoded until {last['lm']:.2f} s of {level['wall_s']:.2f} "
                f"({stages['lm_tokens'] / last['lm']:.0f} tokens/s while it did)"
            )
        if stages.get("incremental_jobs") or stages.get("flow_cache_fallbacks"):
            parts.append(
                f"flow jobs incremental {stages['incremental_jobs']}, recomputed {stages['recompute_jobs']}; "
                f"streams the flow cache could not serve {stages['flow_cache_fallbacks']}, "
                f"fewest pages free {stages.get('flow_cache_least_free')}"
            )
        ran = [
            f"{path} {stages[f'{path}_run_frames'] / stages[f'{path}_frames']:.2f}"
            for path in ("incremental", "recompute")
            if stages.get(f"{path}_frames")
        ]
        if ran:
            parts.append("flow frames run per frame delivered: " + ", ".join(ran))
        if stages.get("eager_flow_calls") or stages.get("graph_captures"):
            parts.append(
                f"eager flow calls {stages['eager_flow_calls']}, graph captures {stages['graph_captures']} "
                f"({stages['graph_capture_s']:.2f} s)"
            )
        if stages.get("fills"):
            parts.append(f"steps that waited to fill {stages['fills']}, {stages['fill_s']:.2f} s")
        if stages.get("lm_holds"):
            parts.append(
                f"LM held {stages['lm_holds']} times, {stages['lm_hold_s']:.2f} s; "
                f"it waited {stages['lm_waited_s']:.2f} s"
            )
    first = level.get("first_chunk_p50")
    if first:
        parts.append("first chunk p50 ms: " + ", ".join(f"{stage} {_ms(s)}" for stage, s in first.items()))
    used = level.get("resources")
    if used:
        gpu = "-" if used["gpu_util_mean"] is None else f"{100 * used['gpu_util_mean']:.0f} %"
        cpu = ", ".join(f"{name} {100 * share:.0f} %" for name, share in busiest(used))
        cores = used["process_cpu_s"] / used["wall_s"]
        parts.append(f"GPU busy {gpu}  CPU: process {cores:.2f} cores; {cpu}")
    allocator = level.get("gpu_allocator")
    if allocator:
        parts.append(
            f"GPU reserved peak {allocator['peak_reserved_gb']:.1f} GB, allocation retries "
            f"{allocator['num_alloc_retries']}, cache flushes {allocator['num_sync_all_streams']}"
        )
    traced = level.get("timeline")
    if traced:
        parts.append(timeline_line(traced))
    if "click_to_sound_p50" in level:
        parts.append(
            f"click to sound p50/p99 {_ms(level['click_to_sound_p50'])}/{_ms(level['click_to_sound_p99'])}"
            " ms "
            f"(server TTFA {_ms(level['server_ttfa_p50'])}/{_ms(level['server_ttfa_p99'])}, "
            f"difference {_ms(level['player_delay_p50'])}/{_ms(level['player_delay_p99'])}: delivery "
            f"{_ms(level['delivery_p50'])}/{_ms(level['delivery_p99'])} + player "
            f"{_ms(level['sound_after_chunk_p50'])}/{_ms(level['sound_after_chunk_p99'])}, "
            f"player underruns {level['player_underruns']})"
        )
    if level["failed"]:
        parts.append(f"FAILED {level['failed']}: {level['errors'][0]}")
    return "  ".join(parts)


FIGURES = ("latency", "throughput", "stages", "first-chunk")


def plot_paths(out: Path) -> dict[str, Path]:
    """Where the figures of the result file ``out`` go."""
    return {name: out.with_name(f"{out.stem}-{name}.png") for name in FIGURES}


def write_plots(result: dict, out: Path) -> None:
    """Draw the figures of ``result`` at ``plot_paths(out)``."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    paths = plot_paths(out)
    levels = result["levels"]
    texts = list(dict.fromkeys(level["text"] for level in levels))
    drawings = (("latency", _latency), ("throughput", _throughput), ("stages", _stages))
    for name, draw in (*drawings, ("first-chunk", _first_chunk)):
        figure = draw(plt, result, texts)
        figure.savefig(paths[name], dpi=110)
        plt.close(figure)


def _series(levels: list[dict], text: str) -> dict[str, list[dict]]:
    """Levels of ``text`` by "driver mode", each sorted by concurrency."""
    series: dict[str, list[dict]] = {}
    for level in levels:
        if level["text"] == text:
            label = f"{level['driver']} {'stream' if level['streaming'] else 'whole'}"
            if level.get("variant"):
                label += f" [{level['variant']}]"
            series.setdefault(label, []).append(level)
    return {label: sorted(group, key=lambda lv: lv["clients"]) for label, group in series.items()}


def _axes(plt, rows: int, columns: int):
    return plt.subplots(
        rows, columns, figsize=(5 * columns + 2, 4 * rows), squeeze=False, layout="constrained"
    )


def _legend(figure, axes) -> None:
    """One legend for the whole figure, right of the plots (series repeat across them); ``axes``: an
    array of axes, or a list."""
    entries = {}
    for ax in getattr(axes, "flat", axes):
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            entries.setdefault(label, handle)
    figure.legend(entries.values(), entries.keys(), loc="outside right upper", fontsize=7)


def _concurrency_axis(ax, clients: list[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(set(clients)), [str(c) for c in sorted(set(clients))])
    ax.minorticks_off()
    ax.set_xlabel("concurrent requests")
    ax.grid(True, alpha=0.3)


def _latency(plt, result: dict, texts: list[str]):
    figure, axes = _axes(plt, 2, len(texts))
    for column, text in enumerate(texts):
        for row, (key, title) in enumerate((("ttfa", "time to first audio"), ("total", "total latency"))):
            ax = axes[row][column]
            for index, (label, group) in enumerate(_series(result["levels"], text).items()):
                color = f"C{index}"
                clients = [lv["clients"] for lv in group]
                for q, style in (("p50", "-"), ("p99", "--")):
                    values = [lv[f"{key}_{q}"] for lv in group]
                    ax.plot(clients, values, style, marker="o", color=color, label=f"{label} {q}")
            _concurrency_axis(ax, [lv["clients"] for lv in result["levels"]])
            ax.set_yscale("log")
            ax.set_ylabel("seconds")
            ax.set_title(f"{title}, text '{text}'")
    _legend(figure, axes)
    return figure


def _throughput(plt, result: dict, texts: list[str]):
    figure, axes = _axes(plt, 1, len(texts))
    for column, text in enumerate(texts):
        ax = axes[0][column]
        for label, group in _series(result["levels"], text).items():
            ax.plot(
                [lv["clients"] for lv in group],
                [lv["audio_per_wall_s"] for lv in group],
                marker="o",
                label=label,
            )
        if result.get("baselines_text") == text:
            for marker, (name, base) in zip("sDv", result["baselines"].items(), strict=False):
                if "audio_per_wall_s" in base:
                    ax.plot(
                        base["clients"], base["audio_per_wall_s"], marker, color="k", label=f"baseline {name}"
                    )
        baseline_clients = [b["clients"] for b in result["baselines"].values() if "clients" in b]
        _concurrency_axis(ax, [lv["clients"] for lv in result["levels"]] + baseline_clients)
        ax.set_yscale("log")
        ax.set_ylabel("seconds of audio per wall second")
        ax.set_title(f"throughput, text '{text}'")
    _legend(figure, axes)
    return figure


def _grid(plt, measured: list[dict], texts: list[str], nothing: str):
    """(figure, cells): a row of axes per mode (streaming first) and a column per text, each cell
    (ax, mode, text, its levels of ``measured`` by concurrency); a figure saying ``nothing`` and no
    cells when nothing was measured."""
    if not measured:
        figure, ax = plt.subplots(figsize=(6, 2))
        ax.axis("off")
        ax.text(0.5, 0.5, nothing, ha="center")
        return figure, []
    modes = sorted({lv["streaming"] for lv in measured}, reverse=True)
    figure, axes = _axes(plt, len(modes), len(texts))
    cells = []
    for row, streaming in enumerate(modes):
        for column, text in enumerate(texts):
            group = [lv for lv in measured if (lv["text"], lv["streaming"]) == (text, streaming)]
            mode = "stream" if streaming else "whole"
            cells.append((axes[row][column], mode, text, sorted(group, key=lambda lv: lv["clients"])))
    return figure, cells


def _titled(figure, cells: list, title: str):
    """``figure`` with its title and one legend for its cells (none for a figure without cells)."""
    if cells:
        figure.suptitle(title, fontsize=10)
        _legend(figure, [cell[0] for cell in cells])
    return figure


def _stages(plt, result: dict, texts: list[str]):
    """Stacked bars per level of the first driver with engine statistics (all drivers share the engine)."""
    measured = [lv for lv in result["levels"] if lv["stages"] is not None and not lv.get("variant")]
    driver = measured[0]["driver"] if measured else None
    measured = [lv for lv in measured if lv["driver"] == driver]
    figure, cells = _grid(plt, measured, texts, "no engine statistics: the server ran in another process")
    for ax, mode, text, group in cells:
        names = [str(lv["clients"]) for lv in group]
        flow = [lv["stages"]["flow_s"] for lv in group]
        hift = [lv["stages"]["hift_s"] for lv in group]
        rest = [max(lv["wall_s"] - f - h, 0.0) for lv, f, h in zip(group, flow, hift, strict=True)]
        ax.bar(names, flow, label="flow")
        ax.bar(names, hift, bottom=flow, label="HiFT")
        ax.bar(names, rest, bottom=[f + h for f, h in zip(flow, hift, strict=True)], label="rest of wall")
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("seconds of the level's wall time")
        ax.set_title(f"{driver} {mode}, text '{text}'", fontsize=9)
    return _titled(figure, cells, "token2wav time per level; the LM decodes beside it")


def _first_chunk(plt, result: dict, texts: list[str]):
    """Stacked bars per level of the in-process driver: the median of each stage of the first chunk's
    way, which add up to about the median time to first audio (drawn as a dot)."""
    measured = [lv for lv in result["levels"] if lv.get("first_chunk_p50") and not lv.get("variant")]
    nothing = "no first-chunk stages: only the in-process driver sees them"
    figure, cells = _grid(plt, measured, texts, nothing)
    for ax, mode, text, group in cells:
        names = [str(lv["clients"]) for lv in group]
        bottom = [0.0] * len(group)
        for index, (stage, _, _) in enumerate(FIRST_CHUNK_STAGES):
            ms = [1000 * lv["first_chunk_p50"][stage] for lv in group]
            ax.bar(names, ms, bottom=bottom, label=stage, color=plt.get_cmap("tab20")(index))  # 11 stages
            bottom = [b + m for b, m in zip(bottom, ms, strict=True)]
        ax.plot(names, [1000 * lv["ttfa_p50"] for lv in group], "ko", label="TTFA p50")
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("ms (medians)")
        ax.set_title(f"first chunk, {mode}, text '{text}'", fontsize=9)
    return _titled(figure, cells, "where the time to first audio goes")
