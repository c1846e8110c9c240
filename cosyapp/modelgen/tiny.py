"""Write a tiny random-weight CosyVoice2 model folder in the official layout.

Same file names and yaml keys as CosyVoice2-0.5B, small sizes, deterministic from a seed, written in
a few seconds. Tests and the ``--demo`` mode load it through the same loader as the real weights.

    python -m cosyapp.modelgen.tiny OUT_DIR [--seed N] [--full-size [--device cuda]]
"""

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from transformers import Qwen2Config

from cosyapp.modelgen.pace import shape_pace
from cosyapp.modelgen.yaml_template import OFFICIAL, TINY, NetworkSizes, render_yaml
from cosyapp.models.checkpoint import BACKBONE_DIR, YAML_NAME, build_flow, build_hift, build_lm, read_hparams
from cosyapp.models.sampling import STOP_TOKENS

QWEN_BASE_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

OFFICIAL_QWEN = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 896,
    "initializer_range": 0.02,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "max_window_layers": 24,
    "model_type": "qwen2",
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

# head_dim 32: the smallest head size vLLM's CPU attention accepts.
TINY_QWEN = OFFICIAL_QWEN | {
    "bos_token_id": 0,  # <|endoftext|> comes first in the tiny vocabulary
    "eos_token_id": 0,
    "hidden_size": TINY.llm_size,
    "intermediate_size": 128,
    "max_window_layers": 2,
    "num_attention_heads": 2,
    "num_hidden_layers": 2,
    "num_key_value_heads": 1,
    "vocab_size": 512,
}

_CORPUS = [
    "Hello, this is a tiny test model for speech synthesis.",
    "The quick brown fox jumps over the lazy dog. What time is it? It is 3:45 pm!",
    "Numbers like 1, 2, 3, 42 and 2026 are spelled out; prices such as $9.99 too.",
    "She sells sea shells by the sea shore; the shells she sells are surely sea shells.",
    "今天天气很好，我们一起去公园散步吧。你好，欢迎使用语音合成。",
    "收到朋友从远方寄来的生日礼物，那份意外的惊喜让我心中充满了甜蜜的快乐。",
]


def write_tokenizer(out_dir: Path, vocab_size: int = 400) -> None:
    """A small byte-level BPE tokenizer folder that ``transformers.AutoTokenizer`` loads."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=QWEN_BASE_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>", model_max_length=32768
    )
    fast.save_pretrained(out_dir)


def write_campplus(path: Path, rng: np.random.Generator) -> None:
    """Stand-in for ``campplus.onnx``: fbank (1, T, 80) -> (1, 192) via time-mean and a projection."""
    from onnx import TensorProto, helper, numpy_helper, save

    weight = numpy_helper.from_array(rng.standard_normal((80, 192)).astype(np.float32) * 0.1, "proj")
    graph = helper.make_graph(
        [
            helper.make_node("ReduceMean", ["feats"], ["pooled"], axes=[1], keepdims=0),
            helper.make_node("MatMul", ["pooled", "proj"], ["hidden"]),
            helper.make_node("Tanh", ["hidden"], ["embedding"]),
        ],
        "campplus_tiny",
        [helper.make_tensor_value_info("feats", TensorProto.FLOAT, [1, "T", 80])],
        [helper.make_tensor_value_info("embedding", TensorProto.FLOAT, [1, 192])],
        [weight],
    )
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))


def write_speech_tokenizer(path: Path, rng: np.random.Generator, width: int = 16) -> None:
    """Stand-in for ``speech_tokenizer_v2.onnx``: whisper log-mel (1, 128, T) + int32 [T] -> tokens.

    Two stride-2 convolutions (k3, p1) give ceil(ceil(T/2)/2) tokens at 25 Hz, as the real tokenizer;
    an arg-max over 6561 codes makes each token a deterministic function of the audio.
    """
    from onnx import TensorProto, helper, numpy_helper, save

    inits = [
        numpy_helper.from_array(rng.standard_normal((width, 128, 3)).astype(np.float32) * 0.1, "w1"),
        numpy_helper.from_array(rng.standard_normal((width, width, 3)).astype(np.float32) * 0.3, "w2"),
        numpy_helper.from_array(rng.standard_normal((width, 6561)).astype(np.float32), "codes"),
    ]
    conv = {"kernel_shape": [3], "strides": [2], "pads": [1, 1]}
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["feats", "w1"], ["h1"], **conv),
            helper.make_node("Tanh", ["h1"], ["a1"]),
            helper.make_node("Conv", ["a1", "w2"], ["h2"], **conv),
            helper.make_node("Transpose", ["h2"], ["frames"], perm=[0, 2, 1]),
            helper.make_node("MatMul", ["frames", "codes"], ["scores"]),
            helper.make_node("ArgMax", ["scores"], ["ids"], axis=2, keepdims=0),
            helper.make_node("Cast", ["ids"], ["tokens"], to=TensorProto.INT32),
        ],
        "speech_tokenizer_tiny",
        [
            helper.make_tensor_value_info("feats", TensorProto.FLOAT, [1, 128, "T"]),
            helper.make_tensor_value_info("feats_length", TensorProto.INT32, [1]),
        ],
        [helper.make_tensor_value_info("tokens", TensorProto.INT32, [1, "N"])],
        inits,
    )
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))


def write_config_files(out_dir: Path, sizes: NetworkSizes, qwen: dict) -> None:
    """``cosyvoice2.yaml`` and ``CosyVoice-BlankEN/config.json`` (no weights, no tokenizer)."""
    (out_dir / BACKBONE_DIR).mkdir(parents=True, exist_ok=True)
    (out_dir / YAML_NAME).write_text(render_yaml(sizes), encoding="utf-8")
    (out_dir / BACKBONE_DIR / "config.json").write_text(json.dumps(qwen, indent=2), encoding="utf-8")


def write_random_model(
    out_dir: str | Path,
    seed: int = 0,
    sizes: NetworkSizes = TINY,
    qwen: dict | None = None,
    endless: bool = False,
    device: str = "cpu",
) -> Path:
    """Write a complete model folder (official layout) with random weights from ``seed``; returns it.

    The LM stops at about 3 speech tokens per text token, with variation (``pace.shape_pace``);
    ``endless`` instead makes its stop tokens unreachable (their head bias at -1e4), so every sentence
    decodes exactly its maximum of 20 tokens per text token: reproducible load for benchmarks.
    ``device`` is where the networks are initialised (a GPU makes full-size weights quick).
    """
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    qwen = TINY_QWEN if qwen is None else qwen
    write_config_files(out_dir, sizes, qwen)
    write_tokenizer(out_dir / BACKBONE_DIR)
    hparams = read_hparams(out_dir)
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        lm = build_lm(hparams, Qwen2Config(**qwen))
        flow = build_flow(hparams)
        hift = build_hift(hparams)
    if endless:
        with torch.no_grad():
            lm.llm_decoder.bias[list(STOP_TOKENS)] = -1e4
    else:
        shape_pace(lm)
    for module, name in [(lm, "llm.pt"), (flow, "flow.pt"), (hift, "hift.pt")]:
        torch.save({k: v.cpu() for k, v in module.state_dict().items()}, out_dir / name)
    backbone = {
        f"model.{k}": v.detach().cpu().contiguous() for k, v in lm.llm.model.model.state_dict().items()
    }
    save_file(backbone, out_dir / BACKBONE_DIR / "model.safetensors")
    rng = np.random.default_rng(seed)
    write_campplus(out_dir / "campplus.onnx", rng)
    write_speech_tokenizer(out_dir / "speech_tokenizer_v2.onnx", rng)
    return out_dir


def write_tiny_model(out_dir: str | Path, seed: int = 0) -> Path:
    """Write a complete tiny model folder (official layout, random weights from ``seed``); returns it."""
    return write_random_model(out_dir, seed)


def write_full_size_model(
    out_dir: str | Path, seed: int = 0, endless: bool = True, device: str = "cpu"
) -> Path:
    """CosyVoice2-0.5B's architecture with random weights (for speed measurements; it speaks noise)."""
    return write_random_model(out_dir, seed, OFFICIAL, OFFICIAL_QWEN, endless=endless, device=device)


def write_official_configs(out_dir: str | Path) -> Path:
    """The yaml and backbone config of CosyVoice2-0.5B (for folders of full-size random weights)."""
    out_dir = Path(out_dir)
    write_config_files(out_dir, OFFICIAL, OFFICIAL_QWEN)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--full-size", action="store_true", help="CosyVoice2-0.5B sizes, stop tokens disabled"
    )
    parser.add_argument("--device", default="cpu", help="where to initialise the weights (default cpu)")
    args = parser.parse_args()
    if args.full_size:
        print(write_full_size_model(args.out_dir, args.seed, device=args.device))
    else:
        print(write_tiny_model(args.out_dir, args.seed))


if __name__ == "__main__":
    main()
