"""What one vLLM decode step costs, and which of the served request's settings pay for it
(CosyVoice2-0.5B sizes, random weights, a GPU). Prints JSON lines and writes them to the file given.

    PYTHONPATH=$PWD python scripts/lm_speed.py [out.json]

One engine as the server starts it (engine/build.py: vLLM with the RAS logits processor, warmed
up), then batches of B requests with a 120-embedding prompt decode exactly N tokens, B from
LM_SPEED_BATCHES (default 1,16,64,256), N = LM_SPEED_TOKENS (default 260), five ways:
- served: as the pipeline sends them, the RAS logits processor drawing each token from the
  request's seed and vLLM taking its argmax (temperature 0);
- vllm_seeded: the same draws, plus a seed for vLLM at temperature 1, as before that change: vLLM's
  sampler then draws every seeded row apart (the token stays the processor's, its logits one-hot);
- plain_seeded: no RAS, vLLM's own temperature-1 sampling, seeded;
- plain: no RAS, unseeded;
- plain_greedy: no RAS, temperature 0 (vLLM's step with the least sampling work).
Reported per variant and batch: wall time, decode steps per second (the tokens of one request per
second), tokens per second over the batch, and the CPU seconds per step of vLLM's processes (the
engine core and any worker, read with psutil), so a step bound by the host shows about one core.
LM_SPEED_PYSPY=DIR samples the engine core's Python stacks with py-spy (when on PATH) during each
extra batch of the sizes in LM_SPEED_PYSPY_BATCHES (default 1,256), one raw file per variant there.
LM_SPEED_SAMPLER_GRAPHS=0 starts the engine with --no-lm-sampler-graphs (1, the default, as served).
LM_SPEED_DEVICE=cpu runs the same on the tiny random model (a check of the script, not a measurement).

    python scripts/lm_speed.py --summarize out.json DIR/*.txt

writes, for each py-spy file, the functions that were on the engine core's stack in the largest
share of its samples (each function once per sample, line numbers dropped).
"""

import asyncio
import collections
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import torch

from cosyapp.bench.load import prepare_model
from cosyapp.engine.build import build_lm_engine
from cosyapp.models.checkpoint import load_model
from cosyapp.options import ServeOptions

BATCHES = tuple(int(b) for b in os.environ.get("LM_SPEED_BATCHES", "1,16,64,256").split(",") if b)
TOKENS = int(os.environ.get("LM_SPEED_TOKENS", "260"))
PROMPT_LEN = 120
VARIANTS = ("served", "vllm_seeded", "plain_seeded", "plain", "plain_greedy")
PROFILED = tuple(int(b) for b in os.environ.get("LM_SPEED_PYSPY_BATCHES", "1,256").split(",") if b)


def sampling_params(variant: str, lm, seed: int):
    from vllm.sampling_params import RequestOutputKind
    from vllm.sampling_params import SamplingParams as VllmSamplingParams

    from cosyapp.engine.lm.vllm_model import ras_extra_args

    ras = variant in ("served", "vllm_seeded")
    return VllmSamplingParams(
        temperature=0.0 if variant in ("served", "plain_greedy") else 1.0,
        min_tokens=0 if ras else TOKENS,
        max_tokens=TOKENS,
        ignore_eos=not ras,
        seed=seed if variant in ("vllm_seeded", "plain_seeded") else None,
        detokenize=False,
        output_kind=RequestOutputKind.DELTA,
        extra_args=ras_extra_args(TOKENS, lm.sampling, seed) if ras else None,
    )


def sampler(processes: list, name: str) -> subprocess.Popen | None:
    """py-spy recording the engine core's stacks into LM_SPEED_PYSPY/NAME.txt (None without py-spy)."""
    folder, spy = os.environ.get("LM_SPEED_PYSPY"), shutil.which("py-spy")
    cores = [p.pid for p in processes if "EngineCore" in p.name() + " ".join(p.cmdline())]
    if not folder or not spy or not cores:
        return None
    Path(folder).mkdir(parents=True, exist_ok=True)
    args = [spy, "record", "--pid", str(cores[0]), "--rate", "200", "--format", "raw", "--nonblocking"]
    return subprocess.Popen([*args, "--output", f"{folder}/{name}.txt"], stdout=subprocess.DEVNULL)


async def decode(lm, variant: str, batch: int, profile: bool = False) -> dict:
    engine = lm.engine
    noise = torch.Generator().manual_seed(batch)
    prompts = [
        {"prompt_embeds": torch.randn(PROMPT_LEN, lm.hidden_size, generator=noise).to(lm.dtype)}
        for _ in range(batch)
    ]
    core = psutil.Process().children(recursive=True)

    def core_cpu() -> float:
        return sum(sum(p.cpu_times()[:2]) for p in core)

    async def one(i: int) -> int:
        count = 0
        params = sampling_params(variant, lm, seed=1000 + i)
        async for out in engine.generate(prompts[i], params, f"{variant}-{uuid.uuid4().hex}"):
            count += len(out.outputs[0].token_ids)
        return count

    spy = sampler(core, f"{variant}-{batch}") if profile else None
    cpu0, start = core_cpu(), time.perf_counter()
    counts = await asyncio.gather(*(one(i) for i in range(batch)))
    wall = time.perf_counter() - start
    cpu = core_cpu() - cpu0
    if spy is not None:
        spy.send_signal(signal.SIGINT)  # py-spy writes its file when interrupted
        await asyncio.to_thread(spy.wait, 30)
    return {
        "variant": variant,
        "profiled": spy is not None,
        "batch": batch,
        "tokens_each": min(counts),
        "wall_s": round(wall, 3),
        "steps_per_s": round(min(counts) / wall, 1),
        "tokens_per_s": round(sum(counts) / wall, 1),
        "ms_per_step": round(wall / max(min(counts), 1) * 1000, 2),
        "vllm_cpu_s": round(cpu, 3) if core else None,
        "vllm_cpu_ms_per_step": round(cpu / max(min(counts), 1) * 1000, 2) if core else None,
    }


async def main(out: Path) -> None:
    device = torch.device(os.environ.get("LM_SPEED_DEVICE", "cuda"))
    full = device.type == "cuda"
    folder = prepare_model(Path("/tmp/bench") / ("full-size" if full else "tiny"), full, device)
    model = load_model(folder, device=str(device))
    graphs = os.environ.get("LM_SPEED_SAMPLER_GRAPHS", "1") == "1"
    cache = Path("/tmp/bench/cache")
    options = ServeOptions(engine="vllm", max_streams=max(BATCHES), cache_dir=cache, lm_sampler_graphs=graphs)
    lm = build_lm_engine(model, options)
    started = time.perf_counter()
    await lm.start()
    rows = [
        {"engine_start_s": round(time.perf_counter() - started, 1), "tokens": TOKENS, "prompt": PROMPT_LEN}
        | {"sampler_graphs": graphs}
    ]
    print(json.dumps(rows[0]), flush=True)
    for batch in BATCHES:
        for variant in VARIANTS:
            await decode(lm, variant, batch)  # once to settle sampler kernels at this batch
            row = await decode(lm, variant, batch)
            print(json.dumps(row), flush=True)
            rows.append(row)
            if batch in PROFILED and os.environ.get("LM_SPEED_PYSPY"):  # apart: the sampling perturbs
                await decode(lm, variant, batch, profile=True)
    await lm.shutdown()
    out.write_text(json.dumps(rows, indent=1) + "\n")


def summarize(out: Path, files: list[str], top: int = 40) -> None:
    result = {}
    for name in files:
        shares, total = collections.Counter(), 0
        for line in Path(name).read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if not stack:
                continue
            total += int(count)
            # "function (path/file.py:line)" -> "function (file.py)", each function once per sample
            frames = {re.sub(r" \((?:.*/)?([^/:]+)(?::\d+)?\)$", r" (\1)", f) for f in stack.split(";")}
            shares.update(dict.fromkeys(frames, int(count)))
        result[Path(name).stem] = {
            "samples": total,
            "share_of_samples": {f: round(n / total, 3) for f, n in shares.most_common(top)},
        }
    out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--summarize"]:
        summarize(Path(sys.argv[2]), sys.argv[3:])
    else:
        asyncio.run(main(Path(sys.argv[1] if len(sys.argv) > 1 else "lm-speed.json")))
