"""CosyVoice 2's four modes and what the LM sees of a voice in each (docs/model.md §4.3).

Upstream builds every mode from its zero-shot input and then drops what the LM must not see
(``frontend_cross_lingual``, ``frontend_instruct2``, ``frontend_vc``); the flow always gets the voice's
prompt speech tokens, prompt mel and x-vector:

- ``zero_shot``: the LM continues the prompt: [sos | prompt text + text | task id | prompt speech];
- ``cross_lingual``: the LM sees no prompt at all: [sos | text | task id], so the voice's language
  does not pull the speech toward it;
- ``instruct2``: the instruction and ``<|endofprompt|>`` stand where the prompt text stood and the
  LM gets no prompt speech: [sos | instruction + <|endofprompt|> + text | task id];
- ``vc`` (voice conversion): no LM; the source speech's tokens go to the flow in the voice's prompt.

Torch-free at import: the request rules (``engine/request.py``) use the checks below.
"""

from collections.abc import Sequence
from typing import TYPE_CHECKING

from cosyapp.errors import ParamError
from cosyapp.frontend.tags import ENDOFPROMPT
from cosyapp.frontend.text import remove_control_characters

if TYPE_CHECKING:
    from cosyapp.models.cosyvoice2 import PromptInputs

ZERO_SHOT = "zero_shot"
CROSS_LINGUAL = "cross_lingual"
INSTRUCT = "instruct2"
VOICE_CONVERSION = "vc"
MODES = (ZERO_SHOT, CROSS_LINGUAL, INSTRUCT, VOICE_CONVERSION)
# An instruction names a dialect, an emotion, a pace or a style in a sentence; this leaves room for
# several of them (upstream sets no limit; the instruction counts toward the LM's prompt).
MAX_INSTRUCTION_CHARS = 200


def check_mode(mode: object, instruction: object, source_tokens: object = None) -> None:
    """Raise ``ParamError`` for an unknown ``mode``, source speech tokens missing in voice conversion
    or given in another mode, or an ``instruction`` that does not fit ``mode``: given outside
    instruct2, or, in instruct2, not a string, empty, longer than MAX_INSTRUCTION_CHARS, or holding
    ``<|endofprompt|>`` (the server adds the one the model expects)."""
    if mode not in MODES:
        raise ParamError(f"Unknown mode {mode!r}; use one of: {', '.join(MODES)}.", "mode")
    if mode == VOICE_CONVERSION and not source_tokens:
        raise ParamError("Voice conversion needs the speech to convert: upload or record it.", "file")
    if mode != VOICE_CONVERSION and source_tokens:
        raise ParamError(f"Speech to convert is for voice conversion (mode vc), not for {mode}.", "file")
    if mode != INSTRUCT:
        if instruction:
            raise ParamError(f"Instructions apply to the instruct2 mode only, not to {mode}.", "instructions")
        return
    if instruction is not None and not isinstance(instruction, str):
        raise ParamError(
            f"The instruction must be a string, got {type(instruction).__name__}.", "instructions"
        )
    if not instruction or not remove_control_characters(instruction).strip():
        raise ParamError(
            "The instruction is empty: say how to speak, e.g. 用四川话说这句话 or Speak slowly and softly.",
            "instructions",
        )
    if len(instruction) > MAX_INSTRUCTION_CHARS:
        raise ParamError(
            f"The instruction is {len(instruction):,} characters long; the limit is {MAX_INSTRUCTION_CHARS}.",
            "instructions",
        )
    if ENDOFPROMPT in instruction:
        raise ParamError(f"Leave {ENDOFPROMPT} out of the instruction: it is added for you.", "instructions")


def instruction_prompt(instruction: str) -> str:
    """The text the LM gets in place of the prompt text: the instruction, then ``<|endofprompt|>``.

    Not normalised, as upstream's ``inference_instruct2`` (the marker would switch normalisation
    off anyway); control characters go and surrounding space is stripped."""
    return remove_control_characters(instruction).strip() + ENDOFPROMPT


def lm_prompt(mode: str, prompt: "PromptInputs", instruction_ids: Sequence[int] = ()) -> "PromptInputs":
    """What the LM sees of ``prompt`` in ``mode``: its prompt text ids and prompt speech tokens (the
    flow keeps using ``prompt`` whole). ``instruction_ids`` are the tokens of ``instruction_prompt``
    (instruct2 only). Voice conversion has no LM input: AssertionError."""
    import dataclasses

    import torch

    assert mode in (ZERO_SHOT, CROSS_LINGUAL, INSTRUCT), mode
    if mode == ZERO_SHOT:
        return prompt
    none = prompt.speech_tokens[:0]
    if mode == CROSS_LINGUAL:
        return dataclasses.replace(prompt, text_ids=prompt.text_ids[:0], speech_tokens=none)
    assert instruction_ids, "instruct2 needs the instruction's tokens"
    return dataclasses.replace(
        prompt, text_ids=torch.tensor(list(instruction_ids), dtype=torch.long), speech_tokens=none
    )
