import shutil

import pytest
import torch

from cosyapp.models.checkpoint import (
    CheckpointMismatchError,
    ModelFolderError,
    load_model,
    resolve_model_dir,
)


@pytest.fixture
def model_copy(tiny_model_dir, tmp_path):
    return shutil.copytree(tiny_model_dir, tmp_path / "model")


def test_loaded_weights_are_the_files_tensors(tiny_model, tiny_model_dir):
    for module, name in [
        (tiny_model.lm, "llm.pt"),
        (tiny_model.flow, "flow.pt"),
        (tiny_model.hift, "hift.pt"),
    ]:
        state = torch.load(tiny_model_dir / name, weights_only=True)
        loaded = module.state_dict()
        assert loaded.keys() == state.keys()
        assert all(torch.equal(loaded[k], state[k]) for k in state), name


def test_text_embedding_is_the_lm_head_copy_as_upstream(model_copy):
    state = torch.load(model_copy / "llm.pt", weights_only=True)
    state["llm.model.lm_head.weight"] = torch.randn_like(state["llm.model.lm_head.weight"])
    torch.save(state, model_copy / "llm.pt")
    lm = load_model(model_copy, device="cpu").lm
    assert torch.equal(lm.llm.model.model.embed_tokens.weight, state["llm.model.lm_head.weight"])


def test_hift_keys_from_the_gan_wrapper_load(model_copy, tiny_model):
    state = torch.load(model_copy / "hift.pt", weights_only=True)
    torch.save({f"generator.{k}": v for k, v in state.items()}, model_copy / "hift.pt")
    hift = load_model(model_copy, device="cpu").hift
    assert torch.equal(hift.conv_pre.bias, tiny_model.hift.conv_pre.bias)


def test_dtype_applies_to_lm_and_flow_while_hift_stays_float32(tiny_model_dir):
    model = load_model(tiny_model_dir, device="cpu", dtype=torch.bfloat16)
    assert model.lm.llm_decoder.weight.dtype == torch.bfloat16
    assert model.flow.input_embedding.weight.dtype == torch.bfloat16
    assert model.hift.conv_pre.bias.dtype == torch.float32


def test_mismatched_tensors_are_named(model_copy):
    state = torch.load(model_copy / "flow.pt", weights_only=True)
    state["encoder_proj.weight"] = torch.zeros(80, 7)
    del state["spk_embed_affine_layer.bias"]
    state["extra.weight"] = torch.zeros(3)
    torch.save(state, model_copy / "flow.pt")
    with pytest.raises(CheckpointMismatchError) as err:
        load_model(model_copy, device="cpu")
    message = str(err.value)
    assert "flow.pt" in message
    assert "missing: spk_embed_affine_layer.bias [80]" in message
    assert "unexpected: extra.weight [3]" in message
    assert "shape mismatch: encoder_proj.weight file [80, 7] vs model [80, 32]" in message


def test_missing_file_is_named_with_the_expected_layout(model_copy):
    (model_copy / "hift.pt").unlink()
    with pytest.raises(ModelFolderError, match=r"lacks hift\.pt(.|\n)*speech_tokenizer_v2\.onnx"):
        resolve_model_dir(model_copy)


def test_unknown_network_class_in_yaml_is_refused(model_copy):
    yaml_path = model_copy / "cosyvoice2.yaml"
    yaml_path.write_text(
        yaml_path.read_text().replace("generator.HiFTGenerator", "generator.CausalHiFTGenerator")
    )
    with pytest.raises(ModelFolderError, match="CausalHiFTGenerator"):
        load_model(model_copy, device="cpu")


def test_path_that_is_neither_folder_nor_repo_id_is_refused(tmp_path):
    with pytest.raises(ModelFolderError, match="not a model folder"):
        resolve_model_dir(tmp_path / "no" / "such" / "folder")


def test_repo_id_offline_and_not_cached_explains_the_layout(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    with pytest.raises(
        ModelFolderError, match=r"could not download FunAudioLLM/CosyVoice2-0.5B(.|\n)*llm\.pt"
    ):
        resolve_model_dir("FunAudioLLM/CosyVoice2-0.5B")
