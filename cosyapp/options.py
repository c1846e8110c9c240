"""Every serving default of cosyapp, defined once.

The command line (settings.py), the benchmark and the engine builder read their defaults from
``DEFAULTS``; the engine constructors default to its values by reference. Torch-free, so ``--help``
stays fast.
"""

from dataclasses import dataclass
from pathlib import Path

ENGINES = ("auto", "vllm", "torch")
DEFAULT_HOME = Path.home() / ".cache" / "cosyapp"
FLOW_DTYPES = ("float16", "bfloat16", "float32")

# The first hop's bounds. A first chunk of fewer than MIN_FIRST_HOP tokens is shorter, at speed 2.0,
# than HiFT's 8-frame overlap; MAX_HOP is upstream's longest hop, where every stream's schedule ends.
MIN_FIRST_HOP = 10
MAX_HOP = 100


@dataclass(frozen=True)
class ServeOptions:
    """How the one Pipeline of a process serves.

    engine: speech-token LM engine; auto = vLLM when installed and a GPU is present, else PyTorch.
    cache_dir: generated files (the demo model, the vLLM export).
    max_streams / max_waiting: requests synthesised at once / queued behind them.
    gpu_memory_utilization: fraction of the GPU vLLM may take for the LM.
    max_batch: largest token2wav batch (and LM batch of the PyTorch engine).
    first_hop: speech tokens of a stream's first chunk before its alignment pad; 25 is upstream's
        hop, fewer reach the first audio sooner (see ChunkSchedule for what changes).
    max_text_chars: longest text accepted per request.
    slowest_speech_rate: syllables per second; a sentence may make at most its syllables at this rate
        in seconds of audio (at least 2 s), so a generation that does not stop is cut (engine/budget.py);
        0: no such limit (upstream's 20 speech tokens per text token only).
    max_request_audio_s: seconds of audio one request may make in all.
    flow_dtype: one of FLOW_DTYPES to run the flow in; None = float16 autocast on CUDA (as upstream's
        fp16 mode), float32 on CPU.
    kv_cache_memory_bytes: vLLM's KV cache on a CPU (on a GPU the utilisation sizes it).
    cuda_graphs: replay the flow estimator from CUDA graphs on a GPU, captured at start-up.
    flow_cache_gb: memory for the incremental streaming flow (a chunk computes only its new frames,
        engine/token2wav/cached.py); None = 70 % of the GPU memory free once the LM engine has
        started (off on a CPU); 0 recomputes every chunk's prefix, as upstream.
    chunked_final: with the flow cache, compute a stream's last chunk with the streaming masks too
        instead of upstream's full attention over the whole sentence (docs/model.md §8.7).
    flow_cache_inputs: the flow cache keeps each attention's normalised input instead of its keys
        and values: four times the frames per byte at full size, for a key/value projection over
        each stream's past in every call; the same audio (engine/token2wav/pages.py). On by default
        (measured: docs/benchmarks/README.md); False keeps keys and values.
    flow_step_graphs: with cuda_graphs, each incremental flow bucket's CUDA graph is one Euler step,
        replayed once per step, instead of the whole call (engine/token2wav/incremental_graphs.py):
        a tenth of the kernels to run and capture per bucket (on an H100 8.8-9.4x cheaper captures),
        ten launches a call; cheap enough that the first call of each row size has every bucket of
        that size captured, so the start's warm-up leaves none to capture while serving. A benchmark
        variant field; off until measured in the engine.
    compile_flow: compile the flow estimator with torch.compile (engine/token2wav/fused.py): its
        forward whole (the recompute path), its transformer blocks for the incremental flow (with a
        pool of attention inputs; else its memory-bound pieces); the first start compiles them
        (minutes on a GPU, serving eagerly meanwhile), later starts read them from cache_dir/inductor.
        None (the default): where the model is on a GPU (measured there: docs/benchmarks/README.md,
        "The LM held for first chunks; the compiled flow in the engine").
    compile_hift: run each of HiFT's Snake activations as one kernel compiled by torch.compile
        (engine/token2wav/fused.py fuse_hift) instead of five; cached as compile_flow's. None (the
        default): where the model is on a GPU (measured there: docs/benchmarks/README.md).
    text_lanes: texts prepared at once (engine/text_workers.py: a thread and a wetext process each);
        0 = one per 4 CPU cores, 1 to 4.
    gather_ms: how long the token2wav worker, woken from an empty queue, waits for jobs to stop
        coming before it takes its step (at most 20 ms; engine/token2wav/scheduler.py): the chunks
        that come due together at one LM step then share one flow call; 0 takes the first at once.
    expect_ms: how long a token2wav step waits, at most, for the chunks of streams a token or two
        short of theirs (engine/token2wav/scheduler.py): a stream one LM step ahead of the others then
        shares their flow call instead of holding them back by a whole call; 0 = none (at most 50).
    fill_ms: how long a token2wav step that holds no urgent job (a first chunk, a whole clip, a
        stream about to run dry) waits for more, so that the flow runs fuller steps and leaves the
        LM more of the GPU (engine/token2wav/scheduler.py); 0 = never (at most 500).
    overlap_hift: on a GPU, run HiFT on its own thread and CUDA stream beside the next flow step
        (engine/token2wav/worker.py); False runs the two stages in turn on one thread.
    step_frames_per_row: a token2wav step's flow calls stay within max_batch x this many padded frames
        (engine/token2wav/scheduler.py): 250, the widest incremental chunk (5 s), so a step of
        max_batch streaming chunks never splits, while sentence-long jobs share steps sparingly and a
        step (the wait of a new stream's first chunk) stays short; more lets whole clips and last
        chunks share larger calls (at 256 whole clips of 10.4 s an H100 ran calls of 23). A benchmark
        variant field.
    whole_step_frames_per_row: the same bound for a step while no stream streams (only whole clips
        wait; none ended in the last second, as between a request's sentences): larger calls are
        then cheaper per clip and keep no listener waiting (the compiled forward alone: 15.1 ms a
        clip at 64 clips, 19.6 at 16, on an H100). A new stream's first chunk may wait for one such
        step. 250: as step_frames_per_row. A benchmark variant field.
    late_step_frames_per_row: the same bound for a step whose most urgent job is a stream's that has
        been dry for a second (engine/token2wav/scheduler.py): its listener hears a gap whatever the
        step does, so larger calls that get more work through sooner serve every stream better (the
        last chunks' recomputes ran in calls of 23 at 256 streams on an H100). 0: as
        step_frames_per_row. A benchmark variant field.
    max_batch_per_call: max_batch bounds the rows of each of a step's flow calls (its incremental
        call, each recompute call) instead of the step's jobs in all (engine/token2wav/scheduler.py):
        at 256 streams on an H100 most flow calls had 21-33 rows with four times the served padded
        bound, where calls of 64 cost less per row. A benchmark variant field.
    flow_overlap: on a GPU, a token2wav step's incremental flow call on a CUDA stream of its own beside
        the step's recompute calls (engine/token2wav/worker.py ``_flow``). Off: on an H100 it removed
        the 64-stream underruns but gave 15 % less audio at 128 streams (docs/benchmarks/README.md).
    hift_first: on a GPU, HiFT's CUDA stream one priority above the flow's, so a step's HiFT kernels
        run before the next flow call's when both wait (engine/token2wav/worker.py): its audio goes
        out without waiting for that call; False gives both the same priority. With --lm-in-process
        and token2wav_priority 0, HiFT's kernels also go before the LM's.
    token2wav_priority: CUDA stream priority of the flow and HiFT threads on a GPU, 0 (as the LM's) or
        -1 (their kernels are scheduled before the LM's when both wait).
    hift_graphs: on a GPU, replay HiFT calls from CUDA graphs, one per batch bucket and length
        (engine/token2wav/hift_graphs.py); the same audio, its random draws made ahead per stream.
    lm_yield_ms: on a GPU, the longest a token2wav step that makes some stream's first chunk holds the
        LM's decode steps and the next flow call, so its flow and HiFT calls have the GPU alone
        (engine/token2wav/yielding.py, engine/lm/gate.py); a hold ends early where streams already
        playing would run short; 0 = never.
    lm_in_process: step vLLM's engine core on a thread of this process (engine/lm/inproc.py), so its
        kernels overlap the flow's instead of taking turns with them; False: its own process.
    lm_stream_interval: speech tokens vLLM gathers into each output it hands this process (its
        ``stream_interval``; a request's first and last tokens come at once): 1 hands on every token
        as decoded; more cuts the host work per token (an output object, a queue and the wake-up of
        each consumer) at many streams, and a chunk waits at most that many - 1 decode steps more.
    lm_sampler_graphs: on a GPU, replay the vLLM engine's RAS draw of each decode step from a CUDA
        graph per batch bucket (engine/lm/ras_graphs.py); the same tokens, one launch instead of ~40.
        On by default: on an H100 vLLM's decode alone ran 1.8-2.3x faster with it at 1-256 requests
        (docs/benchmarks/README.md, "The levers compared in one warm state; the LM's sampler
        graphs").

    Raises OptionError for a value outside its range.
    """

    engine: str = "auto"
    cache_dir: Path = DEFAULT_HOME
    max_streams: int = 64
    max_waiting: int = 256
    gpu_memory_utilization: float = 0.3
    max_batch: int = 64
    first_hop: int = 25
    max_text_chars: int = 5000
    # Normal speech reads 4-5 syllables a second; 1.5 leaves room for slow voices and long pauses.
    slowest_speech_rate: float = 1.5
    # 30 minutes: a text of the longest length read at a normal pace (5,000 Chinese characters,
    # about 20 minutes) fits.
    max_request_audio_s: float = 1800.0
    flow_dtype: str | None = None
    kv_cache_memory_bytes: int = 256 << 20
    cuda_graphs: bool = True
    flow_cache_gb: float | None = None
    chunked_final: bool = False
    flow_step_graphs: bool = False
    flow_cache_inputs: bool = True
    compile_flow: bool | None = None
    compile_hift: bool | None = None
    gather_ms: float = 2.0
    expect_ms: float = 20.0
    fill_ms: float = 0.0
    text_lanes: int = 0
    overlap_hift: bool = True
    step_frames_per_row: int = 250
    whole_step_frames_per_row: int = 250
    late_step_frames_per_row: int = 0
    max_batch_per_call: bool = False
    flow_overlap: bool = False
    token2wav_priority: int = 0
    hift_first: bool = True
    hift_graphs: bool = False
    lm_yield_ms: float = 400.0
    lm_in_process: bool = False
    lm_stream_interval: int = 1
    lm_sampler_graphs: bool = True

    def __post_init__(self) -> None:
        rules = [
            ("engine", self.engine in ENGINES, f"must be one of {', '.join(ENGINES)}"),
            ("max_streams", self.max_streams >= 1, "must be at least 1"),
            ("max_waiting", self.max_waiting >= 0, "must not be negative"),
            (
                "gpu_memory_utilization",
                0.05 <= self.gpu_memory_utilization <= 0.95,
                "must be between 0.05 and 0.95",
            ),
            ("max_batch", self.max_batch >= 1, "must be at least 1"),
            (
                "first_hop",
                MIN_FIRST_HOP <= self.first_hop <= MAX_HOP,
                f"must be between {MIN_FIRST_HOP} and {MAX_HOP}",
            ),
            ("max_text_chars", self.max_text_chars >= 1, "must be at least 1"),
            ("slowest_speech_rate", self.slowest_speech_rate >= 0, "must not be negative"),
            ("max_request_audio_s", self.max_request_audio_s >= 1, "must be at least 1"),
            ("flow_cache_gb", self.flow_cache_gb is None or self.flow_cache_gb >= 0, "must not be negative"),
            ("gather_ms", 0 <= self.gather_ms <= 20, "must be between 0 and 20"),
            ("expect_ms", 0 <= self.expect_ms <= 50, "must be between 0 and 50"),
            ("fill_ms", 0 <= self.fill_ms <= 500, "must be between 0 and 500"),
            ("lm_yield_ms", 0 <= self.lm_yield_ms <= 1000, "must be between 0 and 1000"),
            ("step_frames_per_row", 50 <= self.step_frames_per_row <= 4000, "must be between 50 and 4000"),
            (
                "whole_step_frames_per_row",
                50 <= self.whole_step_frames_per_row <= 4000,
                "must be between 50 and 4000",
            ),
            (
                "late_step_frames_per_row",
                self.late_step_frames_per_row == 0 or 50 <= self.late_step_frames_per_row <= 4000,
                "must be 0 or between 50 and 4000",
            ),
            ("text_lanes", 0 <= self.text_lanes <= 16, "must be between 0 (one per 4 cores) and 16"),
            ("token2wav_priority", self.token2wav_priority in (-1, 0), "must be 0 or -1"),
            ("lm_stream_interval", 1 <= self.lm_stream_interval <= 25, "must be between 1 and 25"),
            ("flow_dtype", self.flow_dtype in (None, *FLOW_DTYPES), f"must be one of {FLOW_DTYPES}"),
        ]
        for name, ok, rule in rules:
            if not ok:
                raise OptionError(name, rule)


class OptionError(ValueError):
    """A serving option outside its range: ``name`` (the field) ``rule`` (what it must be)."""

    def __init__(self, name: str, rule: str):
        super().__init__(f"{name} {rule}")
        self.name, self.rule = name, rule

    def flag(self) -> str:
        """The message as the command line says it: ``--first-hop must be between 10 and 100``."""
        return f"--{self.name.replace('_', '-')} {self.rule}"


DEFAULTS = ServeOptions()
