"""Find, download and load a CosyVoice2 model folder in the official layout (docs/model.md §1.1).

The networks are built from the folder's ``cosyvoice2.yaml`` (read, never executed) and
``CosyVoice-BlankEN/config.json``, on the meta device, and the official ``llm.pt``, ``flow.pt`` and
``hift.pt`` are then loaded into them strictly, as they are: no conversion step.
"""

from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import Qwen2Config

from cosyapp.models.cosyvoice2 import CosyVoice2
from cosyapp.models.flow import CausalConditionalCFM, CausalMaskedDiffWithXvec
from cosyapp.models.flow_encoder import UpsampleConformerEncoder
from cosyapp.models.flow_estimator import CausalConditionalDecoder
from cosyapp.models.hift import ConvRNNF0Predictor, HiFTGenerator
from cosyapp.models.hyperyaml import Tagged, read_hyperyaml
from cosyapp.models.lm import Qwen2Encoder, Qwen2LM
from cosyapp.models.sampling import SamplingParams

YAML_NAME = "cosyvoice2.yaml"
BACKBONE_DIR = "CosyVoice-BlankEN"
NETWORK_FILES = (YAML_NAME, "llm.pt", "flow.pt", "hift.pt", f"{BACKBONE_DIR}/config.json")
LAYOUT = f"""\
  <model folder>/
    {YAML_NAME}               hyperparameters (HyperPyYAML)
    llm.pt  flow.pt  hift.pt      network weights (state dicts)
    campplus.onnx                 speaker embedding network
    speech_tokenizer_v2.onnx      speech tokenizer
    {BACKBONE_DIR}/           Qwen2 config.json + tokenizer files
    spk2info.pt                   (optional) ready-made speakers"""


class ModelFolderError(RuntimeError):
    """The model folder is absent, incomplete, or describes a model cosyapp does not implement."""


class CheckpointMismatchError(RuntimeError):
    """A weight file's tensor names or shapes differ from the network built from the yaml."""


def resolve_model_dir(source: str | Path) -> Path:
    """A local model folder for ``source``: a folder path, or a hub repo id downloaded with progress.

    Raises ``ModelFolderError`` when the folder lacks a network file, or when a repo id is neither
    cached nor downloadable (e.g. offline); the message shows the expected folder layout.
    """
    path = Path(source).expanduser()
    if path.is_dir():
        check_layout(path)
        return path
    if path.exists() or not _looks_like_repo_id(str(source)):
        raise ModelFolderError(f"{source} is not a model folder. Provide a folder laid out as:\n{LAYOUT}")
    return _download(str(source))


def check_layout(model_dir: Path) -> None:
    """Raise ``ModelFolderError`` naming every network file missing from ``model_dir``."""
    missing = [name for name in NETWORK_FILES if not (model_dir / name).is_file()]
    if missing:
        raise ModelFolderError(f"{model_dir} lacks {', '.join(missing)}. Expected layout:\n{LAYOUT}")


def _looks_like_repo_id(text: str) -> bool:
    parts = text.split("/")
    return len(parts) == 2 and all(parts) and not text.startswith((".", "~"))


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = Path(snapshot_download(repo_id, local_files_only=True))
        check_layout(path)
        return path
    except (LocalEntryNotFoundError, ModelFolderError):
        pass  # not (completely) cached yet: download it
    try:
        path = Path(snapshot_download(repo_id))
    except Exception as e:
        raise ModelFolderError(
            f"could not download {repo_id} ({type(e).__name__}: {e}). Without network access, download "
            f"it elsewhere and pass its folder, laid out as:\n{LAYOUT}"
        ) from e
    check_layout(path)
    return path


def read_hparams(model_dir: Path) -> dict[str, Any]:
    """The yaml's values, with ``qwen_pretrain_path`` pointing into the folder as upstream overrides it."""
    return read_hyperyaml(
        model_dir / YAML_NAME, overrides={"qwen_pretrain_path": str(model_dir / BACKBONE_DIR)}
    )


def _node(parent: Any, key: str, cls_name: str) -> Tagged:
    node = parent[key]
    if not isinstance(node, Tagged) or node.target.rsplit(".", 1)[-1] != cls_name:
        found = node.target if isinstance(node, Tagged) else type(node).__name__
        raise ModelFolderError(f"yaml key {key!r} builds {found}; cosyapp implements CosyVoice2's {cls_name}")
    return node


def _require(node: Tagged, key: str, supported: Any) -> None:
    if node.get(key, supported) != supported:
        raise ModelFolderError(
            f"{node.target}: {key}={node.get(key)!r} is not supported (only {supported!r})"
        )


def build_lm(hparams: dict[str, Any], backbone: Qwen2Config) -> Qwen2LM:
    """The text-speech LM described by the yaml's ``llm`` node and the backbone config."""
    node = _node(hparams, "llm", "Qwen2LM")
    _node(node, "llm", "Qwen2Encoder")
    ras = _node(node, "sampling", "ras_sampling")
    sampling = SamplingParams(
        **{k: ras[k] for k in ("top_p", "top_k", "win_size", "tau_r") if k in ras.kwargs}
    )
    return Qwen2LM(
        llm_input_size=node["llm_input_size"],
        llm_output_size=node["llm_output_size"],
        speech_token_size=node["speech_token_size"],
        llm=Qwen2Encoder(backbone),
        sampling=sampling,
    )


def build_flow(hparams: dict[str, Any]) -> CausalMaskedDiffWithXvec:
    """The flow-matching token-to-mel model described by the yaml's ``flow`` node."""
    node = _node(hparams, "flow", "CausalMaskedDiffWithXvec")
    enc = _node(node, "encoder", "UpsampleConformerEncoder")
    for key, value in [
        ("input_layer", "linear"),
        ("pos_enc_layer_type", "rel_pos_espnet"),
        ("selfattention_layer_type", "rel_selfattn"),
        ("use_cnn_module", False),
        ("macaron_style", False),
        ("normalize_before", True),
    ]:
        _require(enc, key, value)
    cfm = _node(node, "decoder", "CausalConditionalCFM")
    est = _node(cfm, "estimator", "CausalConditionalDecoder")
    _require(est, "act_fn", "gelu")
    cfm_params = cfm["cfm_params"]
    cfm_params = cfm_params.get("content", {}) if isinstance(cfm_params, Tagged) else cfm_params
    for key, value in [("solver", "euler"), ("t_scheduler", "cosine")]:
        if cfm_params.get(key, value) != value:
            raise ModelFolderError(f"CausalConditionalCFM: {key}={cfm_params[key]!r} is not supported")
    encoder = UpsampleConformerEncoder(
        input_size=enc["input_size"],
        output_size=enc["output_size"],
        attention_heads=enc["attention_heads"],
        linear_units=enc["linear_units"],
        num_blocks=enc["num_blocks"],
        # Without the key upstream runs the encoder without chunk masks (docs/model.md §6.7).
        static_chunk_size=enc.get("static_chunk_size", 0),
        pre_lookahead_len=node["pre_lookahead_len"],
        upsample_stride=node["token_mel_ratio"],
    )
    estimator = CausalConditionalDecoder(
        in_channels=est["in_channels"],
        out_channels=est["out_channels"],
        channels=tuple(est["channels"]),
        attention_head_dim=est["attention_head_dim"],
        n_blocks=est["n_blocks"],
        num_mid_blocks=est["num_mid_blocks"],
        num_heads=est["num_heads"],
        static_chunk_size=est.get("static_chunk_size", 0),
    )
    return CausalMaskedDiffWithXvec(
        input_size=node["input_size"],
        output_size=node["output_size"],
        spk_embed_dim=node["spk_embed_dim"],
        vocab_size=node["vocab_size"],
        token_mel_ratio=node["token_mel_ratio"],
        pre_lookahead_len=node["pre_lookahead_len"],
        encoder=encoder,
        decoder=CausalConditionalCFM(estimator, inference_cfg_rate=cfm_params.get("inference_cfg_rate", 0.7)),
    )


def build_hift(hparams: dict[str, Any]) -> HiFTGenerator:
    """The HiFT vocoder described by the yaml's ``hift`` node."""
    node = _node(hparams, "hift", "HiFTGenerator")
    f0 = _node(node, "f0_predictor", "ConvRNNF0Predictor")
    plain = [
        "in_channels", "base_channels", "nb_harmonics", "sampling_rate", "nsf_alpha", "nsf_sigma",
        "nsf_voiced_threshold", "upsample_rates", "upsample_kernel_sizes", "resblock_kernel_sizes",
        "resblock_dilation_sizes", "source_resblock_kernel_sizes", "source_resblock_dilation_sizes",
        "lrelu_slope", "audio_limit",
    ]  # fmt: skip
    return HiFTGenerator(
        **{k: node[k] for k in plain if k in node.kwargs},
        istft_n_fft=node["istft_params"]["n_fft"],
        istft_hop_len=node["istft_params"]["hop_len"],
        f0_predictor=ConvRNNF0Predictor(**f0.kwargs),
    )


def build_networks(
    model_dir: Path,
) -> tuple[Qwen2LM, CausalMaskedDiffWithXvec, HiFTGenerator, dict[str, Any]]:
    """Build the three networks of ``model_dir`` with uninitialised (meta) weights, plus the hparams."""
    hparams = read_hparams(model_dir)
    backbone = Qwen2Config.from_pretrained(model_dir / BACKBONE_DIR)
    with torch.device("meta"):
        return build_lm(hparams, backbone), build_flow(hparams), build_hift(hparams), hparams


def load_weights(module: nn.Module, path: Path, strip: str | None = None) -> None:
    """Load ``path`` into ``module`` with strict names and shapes, keeping the file's tensors (mmap).

    ``strip`` is a substring removed from every key first (upstream removes ``generator.`` from HiFT
    keys). Raises ``CheckpointMismatchError`` naming missing, unexpected and mis-shaped tensors.
    """
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    if strip:
        state = {k.replace(strip, ""): v for k, v in state.items()}
    expected = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    found = {k: tuple(v.shape) for k, v in state.items()}
    problems = [f"missing: {k} {list(s)}" for k, s in expected.items() if k not in found]
    problems += [f"unexpected: {k} {list(s)}" for k, s in found.items() if k not in expected]
    problems += [
        f"shape mismatch: {k} file {list(found[k])} vs model {list(s)}"
        for k, s in expected.items()
        if k in found and found[k] != s
    ]
    if problems:
        shown = "\n  ".join(problems[:40]) + (
            f"\n  ... and {len(problems) - 40} more" if len(problems) > 40 else ""
        )
        raise CheckpointMismatchError(f"{path} does not match the network built from the yaml:\n  {shown}")
    module.load_state_dict(state, strict=True, assign=True)


def pick_device(requested: str | None = None) -> torch.device:
    """``requested`` if given, else CUDA when available, else CPU."""
    if requested:
        return torch.device(requested)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_model(source: str | Path, device: str | None = None, dtype: torch.dtype | None = None) -> CosyVoice2:
    """Load a CosyVoice2 model from a folder or hub repo id, ready for inference.

    ``dtype`` applies to the LM and the flow (default float32, as upstream); HiFT always runs in
    float32 as upstream. Raises ``ModelFolderError`` or ``CheckpointMismatchError``.
    """
    model_dir = resolve_model_dir(source)
    lm, flow, hift, hparams = build_networks(model_dir)
    load_weights(lm, model_dir / "llm.pt")
    lm.llm.tie_text_embedding()
    load_weights(flow, model_dir / "flow.pt")
    load_weights(hift, model_dir / "hift.pt", strip="generator.")
    target = pick_device(device)
    dtype = dtype or torch.float32
    lm.llm.place(target, dtype)
    lm.to(target, dtype).eval()
    flow.to(target, dtype).eval()
    hift.to(target, torch.float32).eval()
    return CosyVoice2(lm=lm, flow=flow, hift=hift, hparams=hparams, model_dir=model_dir)
