import json
import math

import numpy as np
import onnxruntime as ort
import torch
from transformers import AutoTokenizer

from cosyapp.modelgen.tiny import write_tiny_model
from cosyapp.modelgen.yaml_template import OFFICIAL, render_yaml
from cosyapp.models.hyperyaml import Tagged, read_hyperyaml

OFFICIAL_FILES = [
    "cosyvoice2.yaml",
    "llm.pt",
    "flow.pt",
    "hift.pt",
    "campplus.onnx",
    "speech_tokenizer_v2.onnx",
    "CosyVoice-BlankEN/config.json",
    "CosyVoice-BlankEN/model.safetensors",
]


def key_tree(value):
    if isinstance(value, Tagged):
        return (value.kind, value.target, key_tree(value.kwargs))
    if isinstance(value, dict):
        return {k: key_tree(v) for k, v in value.items()}
    return None


def test_tiny_folder_has_the_official_file_names(tiny_model_dir):
    for name in OFFICIAL_FILES:
        assert (tiny_model_dir / name).is_file(), name


def test_tiny_yaml_has_the_official_keys_and_classes(tiny_model_dir, tmp_path):
    (tmp_path / "official.yaml").write_text(render_yaml(OFFICIAL))
    assert key_tree(read_hyperyaml(tiny_model_dir / "cosyvoice2.yaml")) == key_tree(
        read_hyperyaml(tmp_path / "official.yaml")
    )


def test_tiny_backbone_keeps_head_dim_usable_by_vllm_cpu(tiny_model_dir):
    config = json.loads((tiny_model_dir / "CosyVoice-BlankEN/config.json").read_text())
    assert config["hidden_size"] // config["num_attention_heads"] >= 32


def test_same_seed_writes_the_same_model_and_another_seed_does_not(tmp_path):
    a = write_tiny_model(tmp_path / "a", seed=3)
    b = write_tiny_model(tmp_path / "b", seed=3)
    c = write_tiny_model(tmp_path / "c", seed=4)
    for name in ["llm.pt", "flow.pt", "hift.pt"]:
        sa, sb, sc = (torch.load(d / name, weights_only=True) for d in (a, b, c))
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
        assert not all(torch.equal(sa[k], sc[k]) for k in sa)
    for name in ["campplus.onnx", "speech_tokenizer_v2.onnx", "CosyVoice-BlankEN/tokenizer.json"]:
        assert (a / name).read_bytes() == (b / name).read_bytes()


def test_tokenizer_loads_with_autotokenizer_and_round_trips(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir / "CosyVoice-BlankEN")
    for text in ["Hello, world! 42 apples.", "今天天气很好。"]:
        ids = tok(text)["input_ids"]
        assert ids and tok.decode(ids) == text
    assert tok.convert_tokens_to_ids("<|endoftext|>") == tok.eos_token_id


def test_campplus_stand_in_has_the_official_signature(tiny_model_dir):
    sess = ort.InferenceSession(str(tiny_model_dir / "campplus.onnx"), providers=["CPUExecutionProvider"])
    fbank = np.random.default_rng(0).standard_normal((1, 173, 80)).astype(np.float32)
    out = sess.run(None, {sess.get_inputs()[0].name: fbank})[0]
    assert out.shape == (1, 192) and out.dtype == np.float32
    other = sess.run(None, {sess.get_inputs()[0].name: fbank + 1.0})[0]
    assert not np.allclose(out, other)


def test_speech_tokenizer_stand_in_gives_25hz_tokens_in_range(tiny_model_dir):
    sess = ort.InferenceSession(
        str(tiny_model_dir / "speech_tokenizer_v2.onnx"), providers=["CPUExecutionProvider"]
    )
    inputs = sess.get_inputs()
    for frames in [100, 257, 301]:
        feats = np.random.default_rng(frames).standard_normal((1, 128, frames)).astype(np.float32)
        tokens = sess.run(None, {inputs[0].name: feats, inputs[1].name: np.array([frames], np.int32)})[0]
        assert tokens.size == math.ceil(math.ceil(frames / 2) / 2)
        assert tokens.min() >= 0 and tokens.max() <= 6560
    assert len(np.unique(tokens)) > 5


def test_endless_model_decodes_exactly_its_maximum(tmp_path):
    from cosyapp.modelgen.tiny import write_random_model
    from cosyapp.models.checkpoint import load_model

    lm = load_model(write_random_model(tmp_path / "endless", seed=1, endless=True), device="cpu").lm
    text = torch.tensor([5, 6, 7])
    tokens = list(
        lm.generate(torch.tensor([1, 2]), text, torch.tensor([9, 10]), torch.Generator().manual_seed(0))
    )
    assert len(tokens) == lm.sampling.length_limits(len(text))[1] == 60
