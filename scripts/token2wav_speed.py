"""Token2wav on a CUDA device, CosyVoice2-0.5B sizes with random weights: what each serving choice
costs and changes. Prints JSON lines and writes them to the file given (default token2wav-speed.json).

    PYTHONPATH=$PWD python scripts/token2wav_speed.py [out.json]

- accuracy: mel of the flow with the CUDA-graphed estimator against eager (both fp16 autocast), and
  fp16 autocast against fp32 (mel, and the HiFT audio made from it), streaming chunk and whole call;
- speed per batch size: flow calls eager fp16 / graphed fp16 (encoder share), HiFT with the
  weight-norm parametrization and fused, for a first streaming chunk (3 s prompt + 28 tokens) and a
  whole clip (3 s prompt + 260 tokens, 10.4 s).
"""

import copy
import json
import sys
import time
from collections.abc import Callable

import torch

from cosyapp.engine.token2wav.graphs import GraphedEstimator
from cosyapp.models.flow import CausalMaskedDiffWithXvec
from cosyapp.models.hift import HiFTGenerator

DEVICE = torch.device("cuda")
PROMPT = 75


def millis(fn: Callable[[], object], repeats: int = 3) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1000


def flow_args(batch: int, tokens: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    full = lambda n: torch.full((batch,), n, device=DEVICE)  # noqa: E731
    return dict(
        token=torch.randint(0, 6561, (batch, tokens), generator=g).to(DEVICE),
        token_len=full(tokens),
        prompt_token=torch.randint(0, 6561, (batch, PROMPT), generator=g).to(DEVICE),
        prompt_token_len=full(PROMPT),
        prompt_feat=(torch.randn(batch, 2 * PROMPT, 80, generator=g) - 5).to(DEVICE),
        prompt_feat_len=full(2 * PROMPT),
        embedding=torch.randn(batch, 192, generator=g).to(DEVICE),
    )


def run_flow(flow, args: dict, streaming: bool, fp16: bool) -> torch.Tensor:
    with torch.inference_mode(), torch.autocast("cuda", dtype=torch.float16, enabled=fp16):
        mel, _ = flow.inference(**args, streaming=streaming, finalize=not streaming)
    return mel


def relative(a: torch.Tensor, b: torch.Tensor) -> dict:
    diff = (a.float() - b.float()).abs()
    return {
        "max_abs": diff.max().item(),
        "rms_rel": (diff.pow(2).mean() / b.float().pow(2).mean()).sqrt().item(),
    }


def snr_db(test: torch.Tensor, ref: torch.Tensor) -> float:
    noise = (test - ref).pow(2).mean().clamp(min=1e-20)
    return (10 * torch.log10(ref.pow(2).mean() / noise)).item()


@torch.inference_mode()
def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else "token2wav-speed.json"
    torch.manual_seed(0)
    flow = CausalMaskedDiffWithXvec().to(DEVICE).eval()
    graphed = copy.deepcopy(flow)
    graphed.decoder.estimator = GraphedEstimator(graphed.decoder.estimator)
    hift = HiFTGenerator().to(DEVICE).eval()
    # A second instance, not a deepcopy: removing a parametrization edits the module's class, which
    # a deepcopy shares with the original.
    fused = HiFTGenerator().to(DEVICE).eval()
    fused.load_state_dict(hift.state_dict())
    fused.fuse_weight_norm()
    rows = []

    def emit(row: dict) -> None:
        row = {k: round(v, 6) if isinstance(v, float) else v for k, v in row.items()}
        print(json.dumps(row), flush=True)
        rows.append(row)

    for streaming, tokens in ((True, 28), (False, 260)):
        args = flow_args(4, tokens)
        eager16 = run_flow(flow, args, streaming, True)
        graph16 = run_flow(graphed, args, streaming, True)
        eager32 = run_flow(flow, args, streaming, False)
        gens = lambda: [torch.Generator(DEVICE).manual_seed(i) for i in range(4)]  # noqa: E731
        audio16, _ = hift(eager16, generators=gens())
        audio32, _ = hift(eager32, generators=gens())
        audio_fused, _ = fused(eager32, generators=gens())
        emit(
            {
                "check": "accuracy",
                "streaming": streaming,
                "tokens": tokens,
                "graph_vs_eager_fp16_mel": relative(graph16, eager16),
                "fp16_vs_fp32_mel": relative(eager16, eager32),
                "fp16_vs_fp32_audio_snr_db": snr_db(audio16, audio32),
                "fused_vs_parametrized_hift_audio": relative(audio_fused, audio32),
            }
        )

    for streaming, tokens in ((True, 28), (False, 260)):
        for batch in (1, 4, 16, 32, 64):
            emit(speed(flow, graphed, hift, fused, streaming, tokens, batch))
    with open(out, "w") as f:
        json.dump(
            {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1
        )


def speed(flow, graphed, hift, fused, streaming: bool, tokens: int, batch: int) -> dict:
    """Times of one (mode, length, batch) setting: flow eager / graphed, encoder, HiFT both ways."""
    args = flow_args(batch, tokens)
    embedded = flow.input_embedding(torch.cat([args["prompt_token"], args["token"]], 1))
    lengths = args["prompt_token_len"] + args["token_len"]
    mel = run_flow(flow, args, streaming, True).float()
    gens = [torch.Generator(DEVICE).manual_seed(i) for i in range(batch)]
    with torch.autocast("cuda", dtype=torch.float16):
        encoder = millis(lambda: flow.encoder(embedded, lengths, streaming=streaming, finalize=not streaming))
    return {
        "check": "speed",
        "streaming": streaming,
        "batch": batch,
        "tokens": tokens,
        "frames": 2 * (PROMPT + tokens),
        "audio_s": batch * mel.shape[2] / 50,
        "flow_eager_fp16_ms": millis(lambda: run_flow(flow, args, streaming, True)),
        "flow_graphed_fp16_ms": millis(lambda: run_flow(graphed, args, streaming, True)),
        "encoder_fp16_ms": encoder,
        "hift_parametrized_ms": millis(lambda: hift(mel, generators=gens)),
        "hift_fused_ms": millis(lambda: fused(mel, generators=gens)),
    }


if __name__ == "__main__":
    main()
