"""Write a tiny random-weight Whisper model folder in the layout of a hub repo such as
``openai/whisper-large-v3-turbo``: ``config.json``, ``model.safetensors``, ``generation_config.json``,
``preprocessor_config.json`` and the tokenizer files, loaded by the same code as the real model.

Its vocabulary is the 256 byte tokens and Whisper's special tokens (all 100 language tokens of
large-v3, Cantonese included). Its generation config lets it write lowercase letters and spaces
only, and never stop early, so its transcript is meaningless text of a steady length, about
4-9 syllables a second of audio: a transcript the voice checks accept. Offline and in demo mode
the app transcribes with it, marking what it writes as demo output.

    python -m cosyapp.modelgen.tiny_asr OUT_DIR [--seed N]
"""

import argparse
from pathlib import Path

import torch
from transformers import (
    GenerationConfig,
    WhisperConfig,
    WhisperFeatureExtractor,
    WhisperForConditionalGeneration,
    WhisperProcessor,
    WhisperTokenizer,
)
from transformers.convert_slow_tokenizer import bytes_to_unicode
from transformers.models.whisper.tokenization_whisper import LANGUAGES

MEL_BINS = 128  # large-v3's log-mel bands
TASKS = ["<|translate|>", "<|transcribe|>"]
AFTER_TASKS = ["<|startoflm|>", "<|startofprev|>", "<|nospeech|>", "<|notimestamps|>"]
# Small enough to write and run in a second on a CPU; 30 s of features still fit (1500 positions).
TINY = {
    "d_model": 32,
    "encoder_layers": 1,
    "decoder_layers": 1,
    "encoder_attention_heads": 2,
    "decoder_attention_heads": 2,
    "encoder_ffn_dim": 64,
    "decoder_ffn_dim": 64,
    "max_target_positions": 448,
    "max_source_positions": 1500,
    "num_mel_bins": MEL_BINS,
}


def special_tokens() -> list[str]:
    """Whisper's special tokens in their order after the byte tokens."""
    languages = [f"<|{code}|>" for code in LANGUAGES]
    return ["<|endoftext|>", "<|startoftranscript|>", *languages, *TASKS, *AFTER_TASKS]


def write_tiny_asr_model(out_dir: str | Path, seed: int = 0) -> Path:
    """Write the tiny Whisper folder at ``out_dir`` (created) and return it."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    byte_tokens = list(bytes_to_unicode().values())
    vocab = {token: i for i, token in enumerate(byte_tokens)}
    specials = special_tokens()
    tokenizer = WhisperTokenizer(vocab=vocab, merges=[])
    tokenizer.add_tokens(specials[1:], special_tokens=True)  # <|endoftext|> is the eos, already there
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in specials}
    assert ids["<|endoftext|>"] == len(byte_tokens), ids["<|endoftext|>"]
    processor = WhisperProcessor(WhisperFeatureExtractor(feature_size=MEL_BINS), tokenizer)
    processor.save_pretrained(out_dir)

    vocab_size = len(tokenizer)
    eot, sot = ids["<|endoftext|>"], ids["<|startoftranscript|>"]
    config = WhisperConfig(
        vocab_size=vocab_size,
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
        decoder_start_token_id=sot,
        begin_suppress_tokens=None,  # the generation config's apply
        suppress_tokens=None,
        **TINY,
    )
    torch.manual_seed(seed)
    WhisperForConditionalGeneration(config).save_pretrained(out_dir)
    _generation_config(ids, vocab_size).save_pretrained(out_dir)
    return out_dir


def _generation_config(ids: dict[str, int], vocab_size: int) -> GenerationConfig:
    """Whisper's generation settings for this vocabulary; only letters and spaces may be written."""
    writable = {bytes_to_unicode()[b] for b in b" abcdefghijklmnopqrstuvwxyz"}
    byte_tokens = list(bytes_to_unicode().values())
    unwritable = [i for i, token in enumerate(byte_tokens) if token not in writable]
    eot = ids["<|endoftext|>"]
    return GenerationConfig(
        decoder_start_token_id=ids["<|startoftranscript|>"],
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
        max_length=448,
        is_multilingual=True,
        lang_to_id={f"<|{code}|>": ids[f"<|{code}|>"] for code in LANGUAGES},
        task_to_id={"translate": ids["<|translate|>"], "transcribe": ids["<|transcribe|>"]},
        no_timestamps_token_id=ids["<|notimestamps|>"],
        prev_sot_token_id=ids["<|startofprev|>"],
        begin_suppress_tokens=[eot],
        no_repeat_ngram_size=2,  # letters in a changing order rather than one letter repeated
        # Never the end token: random weights would stop at a random length, often at once.
        suppress_tokens=sorted({*unwritable, eot, *range(len(byte_tokens) + 1, vocab_size)}),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(write_tiny_asr_model(args.out_dir, seed=args.seed))


if __name__ == "__main__":
    main()
