"""Full-size CosyVoice2-0.5B networks built by our loader against the official checkpoint manifests."""

import pytest
import torch

from cosyapp.modelgen.tiny import write_official_configs, write_tokenizer
from cosyapp.modelgen.yaml_template import OFFICIAL, render_yaml
from cosyapp.models.checkpoint import build_networks, load_model
from cosyapp.models.cosyvoice2 import PromptInputs
from cosyapp.models.hyperyaml import Tagged, read_hyperyaml


def shapes(module: torch.nn.Module, prefix: str = "") -> dict[str, list[int]]:
    return {prefix + k: list(v.shape) for k, v in module.state_dict().items()}


@pytest.fixture(scope="module")
def official_networks(tmp_path_factory):
    """Full-size networks on the meta device, built from the official yaml and backbone config."""
    lm, flow, hift, _ = build_networks(write_official_configs(tmp_path_factory.mktemp("official-config")))
    return lm, flow, hift


def test_lm_has_exactly_the_tensors_of_llm_pt(official_networks, manifest):
    assert shapes(official_networks[0]) == manifest("llm.pt")


def test_backbone_has_exactly_the_tensors_of_blank_en(official_networks, manifest):
    assert shapes(official_networks[0].llm.model.model, prefix="model.") == manifest("CosyVoice-BlankEN")


def test_flow_has_exactly_the_tensors_of_flow_pt(official_networks, manifest):
    assert shapes(official_networks[1]) == manifest("flow.pt")


def test_hift_has_exactly_the_tensors_of_hift_pt(official_networks, manifest):
    assert shapes(official_networks[2]) == manifest("hift.pt")


def mismatches(expected, got, path: str = "") -> list[str]:
    """Where the yaml's values ``got`` differ from the manifest's transcription ``expected``."""
    if isinstance(got, Tagged) and got.target == "omegaconf.DictConfig":
        got = got["content"]
    if not isinstance(expected, dict):
        if isinstance(expected, str) and expected.startswith("<model_dir>"):
            return []  # a path the loader sets
        if isinstance(expected, float) and isinstance(got, str):
            got = float(got)  # YAML 1.1 reads 1e-06 (no dot) as a string; upstream's YAML 1.2 a float
        return [] if got == expected else [f"{path}: {got!r}, manifest {expected!r}"]
    found = []
    for key, value in expected.items():
        if key.startswith("_"):  # notes and values upstream's Python hard-codes: not in the yaml
            continue
        if key in ("class", "function"):
            found += [] if got.target == value else [f"{path}/{key}: {got.target}, manifest {value}"]
        else:
            found += mismatches(value, got[key], f"{path}/{key}")
    return found


@pytest.mark.parametrize("section", ["llm", "flow", "hift", "feat_extractor"])
def test_official_yaml_declares_the_manifests_hyperparameters(section, manifest, tmp_path):
    path = tmp_path / "cosyvoice2.yaml"
    path.write_text(render_yaml(OFFICIAL))
    assert mismatches(manifest("cosyvoice2.yaml")[section], read_hyperyaml(path)[section]) == []


def random_state(names_to_shapes: dict[str, list[int]], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(shape, generator=gen) * 0.02 for k, shape in names_to_shapes.items()}


@pytest.fixture(scope="module")
def official_layout_model(tmp_path_factory, manifest):
    """A folder in the official layout whose weight files hold random tensors named and shaped by the
    manifests (not by our modules), loaded through the user-facing loader."""
    folder = write_official_configs(tmp_path_factory.mktemp("official") / "CosyVoice2-0.5B")
    write_tokenizer(folder / "CosyVoice-BlankEN")
    files = {}
    for seed, name in enumerate(["llm.pt", "flow.pt", "hift.pt"]):
        files[name] = random_state(manifest(name), seed)
        saved = files[name]
        if name == "hift.pt":  # as saved from the GAN training wrapper; the loader strips the prefix
            saved = {f"generator.{k}": v for k, v in saved.items()}
        torch.save(saved, folder / name)
        del saved
    return load_model(folder, device="cpu"), files


def test_official_layout_folder_loads_strictly_with_the_files_values(official_layout_model):
    model, files = official_layout_model
    for module, name in [(model.lm, "llm.pt"), (model.flow, "flow.pt"), (model.hift, "hift.pt")]:
        loaded = module.state_dict()
        for key in list(files[name])[:: max(1, len(files[name]) // 25)]:
            assert torch.equal(loaded[key], files[name][key]), key


def test_full_size_lm_prefill_and_decode_steps_are_finite(official_layout_model):
    lm = official_layout_model[0].lm
    tokens = list(
        lm.generate(torch.arange(10, 30), torch.arange(40, 42), torch.arange(0, 50), torch.Generator())
    )
    assert 0 < len(tokens) <= 20 * 2
    with torch.inference_mode():
        prefix = lm.prompt_embeds(torch.arange(10, 30), torch.arange(40, 52), torch.arange(0, 50))
        logits = lm.llm_decoder(lm.llm(prefix[None])[:, -1])
    assert logits.shape == (1, 6564) and torch.isfinite(logits).all()


def test_full_size_flow_and_hift_on_a_short_input_are_finite(official_layout_model):
    model = official_layout_model[0]
    prompt = PromptInputs(
        text_ids=torch.arange(5),
        speech_tokens=torch.arange(100, 105),
        speech_feat=torch.randn(10, 80) - 4,
        embedding=torch.randn(192),
    )
    mel = model.tokens_to_mel(torch.arange(200, 208), prompt)
    assert mel.shape == (80, 16) and torch.isfinite(mel).all()
    wave = model.mel_to_wave(mel)
    assert wave.shape == (16 * 480,) and torch.isfinite(wave).all() and wave.abs().max() <= 0.99
