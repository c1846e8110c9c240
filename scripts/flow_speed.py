"""Time the flow on a CUDA device: whole calls eager (fp32, fp16 autocast), one estimator step eager
vs replayed as a CUDA graph, and one step at batch 128 (64 items with CFG). Times in ms.

    PYTHONPATH=$PWD python scripts/flow_speed.py
"""

import json
import time
from collections.abc import Callable

import torch

from cosyapp.models.flow import CausalMaskedDiffWithXvec

DEVICE = "cuda"


def millis(fn: Callable[[], object], repeats: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1000


def graphed(fn: Callable[[], object], dtype: torch.dtype | None) -> Callable[[], None]:
    """``fn`` captured once as a CUDA graph (its inputs are fixed tensors), returned as a replay."""
    with torch.autocast(DEVICE, dtype=dtype or torch.float32, enabled=dtype is not None):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    return graph.replay


@torch.inference_mode()
def main() -> None:
    flow = CausalMaskedDiffWithXvec().to(DEVICE).eval()
    for prompt_len, tokens in [(75, 28), (75, 260)]:
        row = measure(flow, prompt_len, tokens)
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}), flush=True)


def measure(flow: CausalMaskedDiffWithXvec, prompt_len: int, tokens: int) -> dict:
    """Times of one prompt/generated length pair."""
    estimator = flow.decoder.estimator
    tok = torch.randint(0, 6561, (1, tokens), device=DEVICE)
    ptok = torch.randint(0, 6561, (1, prompt_len), device=DEVICE)
    feat = torch.randn(1, 2 * prompt_len, 80, device=DEVICE)
    emb = torch.randn(1, 192, device=DEVICE)

    def length(n: int) -> torch.Tensor:
        return torch.tensor([n], device=DEVICE)

    def whole(streaming: bool = False, finalize: bool = True) -> object:
        return flow.inference(
            tok,
            length(tokens),
            ptok,
            length(prompt_len),
            feat,
            length(2 * prompt_len),
            emb,
            streaming,
            finalize,
        )

    frames = 2 * (prompt_len + tokens)
    args = [
        torch.randn(2, 80, frames, device=DEVICE),
        torch.ones(2, 1, frames, device=DEVICE),
        torch.randn(2, 80, frames, device=DEVICE),
        torch.rand(2, device=DEVICE),
        torch.randn(2, 80, device=DEVICE),
        torch.randn(2, 80, frames, device=DEVICE),
    ]
    big = [a.repeat(64, *([1] * (a.dim() - 1))) for a in args]

    def step() -> object:
        return estimator(*args, False)

    def big_step() -> object:
        return estimator(*big, False)

    row = {"prompt_tokens": prompt_len, "tokens": tokens, "mel_frames": frames}
    row["flow_fp32"] = millis(whole)
    with torch.autocast(DEVICE, dtype=torch.float16):
        row["flow_fp16_autocast"] = millis(whole)
        row["estimator_step_eager_fp16"] = millis(step, 10)
        row["estimator_step_batch128_eager_fp16"] = millis(big_step, 3)
    row["flow_stream_chunk_fp32"] = millis(lambda: whole(True, False))
    embedded = flow.input_embedding(torch.cat([ptok, tok], 1))
    row["encoder"] = millis(lambda: flow.encoder(embedded, length(prompt_len + tokens)), 10)
    row["estimator_step_eager_fp32"] = millis(step, 10)
    row["estimator_step_batch128_eager_fp32"] = millis(big_step, 3)
    row["estimator_step_cuda_graph_fp32"] = millis(graphed(step, None), 20)
    row["estimator_step_cuda_graph_fp16"] = millis(graphed(step, torch.float16), 20)
    return row


if __name__ == "__main__":
    main()
