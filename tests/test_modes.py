"""Each mode's LM input, built from one voice: which segments are there, their lengths, and where
<|endofprompt|> sits (docs/model.md §4.3); and the rules of a mode's inputs."""

import pytest
import torch

from cosyapp.errors import ParamError
from cosyapp.frontend.modes import (
    CROSS_LINGUAL,
    INSTRUCT,
    MAX_INSTRUCTION_CHARS,
    VOICE_CONVERSION,
    ZERO_SHOT,
    check_mode,
    instruction_prompt,
    lm_prompt,
)
from cosyapp.frontend.tags import ENDOFPROMPT
from cosyapp.frontend.text import TextFrontend
from cosyapp.frontend.voice import VoiceFrontend
from cosyapp.frontend.voices import VoiceLibrary


@pytest.fixture(scope="module")
def inputs(tiny_model, tiny_model_dir, tmp_path_factory):
    """The tiny model's LM, its text frontend, a built-in voice's prompt and one sentence's ids."""
    text = TextFrontend(tiny_model_dir / "CosyVoice-BlankEN")
    voices = VoiceLibrary(tmp_path_factory.mktemp("voices"), VoiceFrontend(tiny_model_dir))
    prompt = voices.get("zh-aishell-w0122").prompt(text)
    [sentence] = text.prepare("Speak this sentence, please.")
    return tiny_model.lm, text, prompt, torch.tensor(sentence.ids)


def rows(lm, ids):
    return lm.llm.model.model.embed_tokens(ids)


@torch.inference_mode()
def layout(lm, mode, prompt, ids, instruction_ids=()):
    p = lm_prompt(mode, prompt, instruction_ids)
    return lm.prompt_embeds(p.text_ids, ids, p.speech_tokens)


@torch.inference_mode()
def test_zero_shot_is_sos_prompt_text_text_task_id_prompt_speech(inputs):
    lm, _, prompt, ids = inputs
    embeds = layout(lm, ZERO_SHOT, prompt, ids)
    np_, nt, p = len(prompt.text_ids), len(ids), len(prompt.speech_tokens)
    assert np_ > 0 and p > 0 and embeds.shape[0] == 1 + np_ + nt + 1 + p
    torch.testing.assert_close(embeds[0], lm.llm_embedding.weight[0])
    torch.testing.assert_close(embeds[1 : 1 + np_], rows(lm, prompt.text_ids))
    torch.testing.assert_close(embeds[1 + np_ : 1 + np_ + nt], rows(lm, ids))
    torch.testing.assert_close(embeds[1 + np_ + nt], lm.llm_embedding.weight[1])
    torch.testing.assert_close(embeds[2 + np_ + nt :], lm.speech_embedding(prompt.speech_tokens))


@torch.inference_mode()
def test_cross_lingual_is_sos_text_task_id_with_no_prompt(inputs):
    lm, _, prompt, ids = inputs
    embeds = layout(lm, CROSS_LINGUAL, prompt, ids)
    assert embeds.shape[0] == 1 + len(ids) + 1
    torch.testing.assert_close(embeds[0], lm.llm_embedding.weight[0])
    torch.testing.assert_close(embeds[1:-1], rows(lm, ids))
    torch.testing.assert_close(embeds[-1], lm.llm_embedding.weight[1])


@torch.inference_mode()
def test_instruct2_puts_the_instruction_and_endofprompt_where_the_prompt_text_was(inputs):
    lm, text, prompt, ids = inputs
    instruction = text.tokenize(instruction_prompt("用四川话说这句话"))
    alone = text.tokenize("用四川话说这句话")
    endofprompt = text.tokenizer.convert_tokens_to_ids(ENDOFPROMPT)
    assert instruction == [*alone, endofprompt]  # the marker is one token, after the instruction's own
    embeds = layout(lm, INSTRUCT, prompt, ids, instruction)
    ni, nt = len(instruction), len(ids)
    assert embeds.shape[0] == 1 + ni + nt + 1  # no prompt speech, no prompt text
    torch.testing.assert_close(embeds[0], lm.llm_embedding.weight[0])
    torch.testing.assert_close(embeds[1 : 1 + ni], rows(lm, torch.tensor(instruction)))
    torch.testing.assert_close(embeds[ni], rows(lm, torch.tensor([endofprompt]))[0])  # right before the text
    torch.testing.assert_close(embeds[1 + ni : 1 + ni + nt], rows(lm, ids))
    torch.testing.assert_close(embeds[-1], lm.llm_embedding.weight[1])


def test_every_mode_keeps_the_voices_flow_prompt(inputs):
    _, text, prompt, _ = inputs
    instruction = text.tokenize(instruction_prompt("Speak softly."))
    for mode in (ZERO_SHOT, CROSS_LINGUAL, INSTRUCT):
        seen = lm_prompt(mode, prompt, instruction)
        assert seen.speech_feat is prompt.speech_feat and seen.embedding is prompt.embedding
    with pytest.raises(AssertionError):
        lm_prompt(VOICE_CONVERSION, prompt)


def test_the_instruction_is_not_normalised_only_trimmed():
    assert instruction_prompt("  Say 3 words\x00 slowly. ") == f"Say 3 words slowly.{ENDOFPROMPT}"


@pytest.mark.parametrize(
    ("mode", "instruction", "message"),
    [
        ("clone", None, "Unknown mode 'clone'; use one of: zero_shot, cross_lingual, instruct2, vc."),
        (INSTRUCT, "", "The instruction is empty"),
        (INSTRUCT, " \n\x00", "The instruction is empty"),
        (INSTRUCT, None, "The instruction is empty"),
        (INSTRUCT, 5, "The instruction must be a string, got int."),
        (INSTRUCT, "x" * 201, f"201 characters long; the limit is {MAX_INSTRUCTION_CHARS}."),
        (INSTRUCT, f"Speak softly.{ENDOFPROMPT}", "Leave <|endofprompt|> out of the instruction"),
        (
            CROSS_LINGUAL,
            "Speak softly.",
            "Instructions apply to the instruct2 mode only, not to cross_lingual.",
        ),
    ],
)
def test_bad_modes_and_instructions_get_a_clear_message(mode, instruction, message):
    with pytest.raises(ParamError) as caught:
        check_mode(mode, instruction)
    assert message in str(caught.value)
    assert caught.value.param == ("mode" if mode == "clone" else "instructions")


@pytest.mark.parametrize(
    ("mode", "source", "message"),
    [
        (VOICE_CONVERSION, (), "Voice conversion needs the speech to convert: upload or record it."),
        (ZERO_SHOT, (1, 2), "Speech to convert is for voice conversion (mode vc), not for zero_shot."),
    ],
)
def test_source_speech_belongs_to_voice_conversion_only(mode, source, message):
    with pytest.raises(ParamError, match=message.replace("(", r"\(").replace(")", r"\)")) as caught:
        check_mode(mode, None, source)
    assert caught.value.param == "file"


def test_good_modes_pass():
    check_mode(ZERO_SHOT, None)
    check_mode(CROSS_LINGUAL, "")
    check_mode(INSTRUCT, "x" * MAX_INSTRUCTION_CHARS)
    check_mode(VOICE_CONVERSION, None, (1, 2, 3))
