import pytest

from cosyapp.modelgen.yaml_template import OFFICIAL, render_yaml
from cosyapp.models.hyperyaml import Tagged, read_hyperyaml


@pytest.fixture
def official_yaml(tmp_path):
    path = tmp_path / "cosyvoice2.yaml"
    path.write_text(render_yaml(OFFICIAL))
    return path


def test_tagged_nodes_become_records_and_nothing_is_imported(official_yaml):
    hp = read_hyperyaml(official_yaml)
    assert hp["flow"].kind == "new" and hp["flow"].target == "cosyvoice.flow.flow.CausalMaskedDiffWithXvec"
    assert hp["__set_seed3"] == Tagged("apply", "torch.manual_seed", {}, [1986])
    assert hp["llm"]["sampling"].kind == "name" and hp["llm"]["sampling"]["top_k"] == 25


def test_refs_resolve_to_values_and_arithmetic(official_yaml):
    hp = read_hyperyaml(official_yaml)
    assert hp["llm"]["llm_input_size"] == 896
    assert hp["hift"]["sampling_rate"] == 24000
    assert hp["flow"]["decoder"]["estimator"]["static_chunk_size"] == 50  # <chunk_size> * <token_mel_ratio>
    assert hp["hifigan"]["generator"] == hp["hift"]
    assert hp["data_pipeline"][1].target == "cosyvoice.dataset.processor.tokenize"


def test_overrides_replace_values_before_references_resolve(official_yaml):
    hp = read_hyperyaml(official_yaml, overrides={"qwen_pretrain_path": "/models/x/CosyVoice-BlankEN"})
    assert hp["llm"]["llm"]["pretrain_path"] == "/models/x/CosyVoice-BlankEN"
    assert hp["get_tokenizer"]["token_path"] == "/models/x/CosyVoice-BlankEN"


def test_string_refs_interpolate(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("root: /data\nsub: !ref <root>/exp\nn: !ref <k> + 1\nk: 4\n")
    assert read_hyperyaml(path) == {"root": "/data", "sub": "/data/exp", "n": 5, "k": 4}


def test_dangling_ref_names_the_key(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("a: !ref <missing_key>\n")
    with pytest.raises(ValueError, match="missing_key"):
        read_hyperyaml(path)


def test_circular_ref_is_an_error(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("a: !ref <b>\nb: !ref <a>\n")
    with pytest.raises(ValueError, match="circular"):
        read_hyperyaml(path)
