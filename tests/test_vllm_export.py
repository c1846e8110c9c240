"""export_for_vllm: the folder vLLM loads (speech head and embedding as an untied Qwen2), its
fingerprint, reuse and rebuild, and two processes exporting at once."""

import json
import os
import shutil
import threading

import pytest
import torch
from safetensors.torch import load_file

from cosyapp.engine.lm.vllm_engine import export_for_vllm, export_lock


@pytest.fixture
def model_copy(tiny_model_dir, tmp_path):
    return shutil.copytree(tiny_model_dir, tmp_path / "model")


def test_export_writes_the_speech_head_and_embedding_as_an_untied_qwen2(tiny_model, model_copy, tmp_path):
    folder = export_for_vllm(tiny_model.lm, model_copy, tmp_path / "cache", dtype=torch.float32)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["CosyVoice2ForCausalLM"]
    assert (config["vocab_size"], config["tie_word_embeddings"]) == (6564, False)
    assert "bos_token_id" not in config and "eos_token_id" not in config
    tensors = load_file(folder / "model.safetensors")
    lm = tiny_model.lm
    assert torch.equal(tensors["model.embed_tokens.weight"], lm.speech_embedding.weight)
    assert torch.equal(tensors["lm_head.weight"], lm.llm_decoder.weight)
    assert torch.equal(tensors["lm_head.bias"], lm.llm_decoder.bias)
    backbone = lm.llm.model.model.state_dict()
    assert set(tensors) == {f"model.{k}" for k in backbone} | {"lm_head.weight", "lm_head.bias"}
    assert torch.equal(
        tensors["model.layers.1.mlp.down_proj.weight"], backbone["layers.1.mlp.down_proj.weight"]
    )


def test_export_defaults_to_bfloat16(tiny_model, model_copy, tmp_path):
    folder = export_for_vllm(tiny_model.lm, model_copy, tmp_path / "cache")
    assert {t.dtype for t in load_file(folder / "model.safetensors").values()} == {torch.bfloat16}


def test_export_reuses_an_up_to_date_folder(tiny_model, model_copy, tmp_path):
    first = export_for_vllm(tiny_model.lm, model_copy, tmp_path / "cache", dtype=torch.float32)
    before = (first / "model.safetensors").stat()
    second = export_for_vllm(tiny_model.lm, model_copy, tmp_path / "cache", dtype=torch.float32)
    after = (second / "model.safetensors").stat()
    assert second == first
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_an_export_waits_while_another_process_writes_the_same_folder(tiny_model, model_copy, tmp_path):
    cache = tmp_path / "cache"
    folder = export_for_vllm(tiny_model.lm, model_copy, cache, dtype=torch.float32)
    shutil.rmtree(folder)
    with export_lock(folder):  # as another replica on this node holds it while it writes
        waiting = threading.Thread(
            target=export_for_vllm, args=(tiny_model.lm, model_copy, cache), kwargs={"dtype": torch.float32}
        )
        waiting.start()
        waiting.join(timeout=1.0)
        assert waiting.is_alive() and not folder.exists()  # neither writing beside it nor replacing it
    waiting.join(timeout=120)
    assert not waiting.is_alive() and json.loads((folder / "source.json").read_text())["dtype"] == "float32"


def test_export_rebuilds_when_llm_pt_changes(tiny_model, model_copy, tmp_path):
    cache = tmp_path / "cache"
    first = export_for_vllm(tiny_model.lm, model_copy, cache, dtype=torch.float32)
    before = (first / "model.safetensors").stat()
    llm_pt = (model_copy / "llm.pt").stat()
    os.utime(model_copy / "llm.pt", ns=(llm_pt.st_atime_ns, llm_pt.st_mtime_ns + 10**9))
    second = export_for_vllm(tiny_model.lm, model_copy, cache, dtype=torch.float32)
    assert second == first
    assert (second / "model.safetensors").stat().st_ino != before.st_ino
    folders = sorted(p.name for p in cache.iterdir() if p.is_dir())
    assert folders == [first.name]  # no temporary or stale folder left
