"""Shape a random-weight LM so that it stops at about a human pace (the demo and test models).

Random weights give the stop token (EOS, 6561) one random logit among 6564, so a random LM rarely
stops and runs to its maximum of 20 speech tokens per text token: about 7 times a spoken pace. The
real model ends a sentence once its speech covers the text. Here a few weights, set by hand in an
otherwise random network, compute a coarse version of that, with the ordinary layers:

* every input embedding gets a constant component (dimension ``CONSTANT``, which holds the RMS of
  the residual stream steady) and a marker (dimension ``MARKER``): +1 for speech tokens, -``ratio``
  for text tokens and 0 for the two special rows, as each reaches layer 0 after its RMSNorm;
* head 0 of layer 0 has a zero query, so it attends uniformly over the whole sequence; its first
  value channel reads the marker, and the output projection writes the mean into ``COVERAGE``:
  (speech tokens - ratio * text tokens) / length, below 0 until the speech tokens pass ``ratio``
  times the text tokens (prompt text and speech included: no network can tell them from the
  sentence's own, as the prefix carries no boundary between them);
* no other layer writes into ``CONSTANT`` or ``COVERAGE``, and the speech head reads ``COVERAGE``
  only for EOS, whose logit rises with it: at the crossing EOS is about as likely as each of the
  top speech tokens, past it soon the most likely. Sampling (nucleus, RAS, the minimum length)
  stays upstream's, so the length varies from draw to draw.
"""

import math

import torch

from cosyapp.models.lm import Qwen2LM
from cosyapp.models.sampling import EOS_TOKEN, STOP_TOKENS

MARKER, COVERAGE, CONSTANT = 0, 1, 2
# Norms in the residual stream: the constant dominates its RMS, the random part stays large enough
# for the random layers to vary the speech tokens.
CONSTANT_VALUE = 2.0
RANDOM_NORM = 1.0
SPEECH_MARKER = 0.3
# Measured over English and Chinese sentences with the built-in voices (prompt ratios 2.3-3.0 in
# the tiny tokenizer): 2.6 and these EOS weights give a mean of about 3 speech tokens per text token.
RATIO = 2.4
EOS_SLOPE = 6.0
EOS_BIAS = 0.5


@torch.no_grad()
def shape_pace(lm: Qwen2LM, ratio: float = RATIO, slope: float = EOS_SLOPE, bias: float = EOS_BIAS) -> None:
    """Set the weights described in the module docstring, in place, on a randomly initialised ``lm``."""
    backbone = lm.llm.model.model
    config = lm.llm.model.config
    dims = config.hidden_size
    rest_sq = RANDOM_NORM**2 + CONSTANT_VALUE**2

    def rms_scaled(marker: float) -> float:  # the marker after RMSNorm (weight 1, eps negligible)
        return marker * math.sqrt(dims) / math.sqrt(rest_sq + marker**2)

    # The text marker whose normalised value is -ratio times the speech marker's.
    speech_value = rms_scaled(SPEECH_MARKER)
    target = -ratio * speech_value
    assert abs(target) < math.sqrt(dims), (ratio, dims)
    text_marker = target * math.sqrt(rest_sq) / math.sqrt(dims - target**2)

    for table, marker in [
        (backbone.embed_tokens.weight, text_marker),
        (lm.speech_embedding.weight, SPEECH_MARKER),
        (lm.llm_embedding.weight, 0.0),
    ]:
        _set_channels(table, marker)

    layers = backbone.layers
    head_dim = getattr(config, "head_dim", None) or dims // config.num_attention_heads
    attention = layers[0].self_attn
    attention.q_proj.weight[:head_dim] = 0.0  # head 0: equal scores, a uniform average
    attention.q_proj.bias[:head_dim] = 0.0
    attention.v_proj.weight[0] = 0.0  # value channel 0 of kv head 0 (the one head 0 reads)
    attention.v_proj.weight[0, MARKER] = 1.0 / speech_value  # speech +1, text -ratio, specials 0
    attention.v_proj.bias[0] = 0.0
    layers[0].input_layernorm.weight[MARKER] = 1.0
    for layer in layers:
        for writer in (layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight):
            writer[COVERAGE] = 0.0
            writer[CONSTANT] = 0.0
    attention.o_proj.weight[:, 0] = 0.0
    attention.o_proj.weight[COVERAGE, 0] = 1.0
    backbone.norm.weight[[MARKER, COVERAGE, CONSTANT]] = 1.0

    head = lm.llm_decoder
    head.weight[:, [MARKER, COVERAGE, CONSTANT]] = 0.0  # speech tokens: no static preference
    head.weight[EOS_TOKEN] = 0.0
    head.weight[EOS_TOKEN, COVERAGE] = slope
    head.bias[EOS_TOKEN] = bias
    # The other stop tokens end a sentence at any length (the minimum masks only EOS); trained
    # weights never pick them, random ones would now and then.
    head.bias[[t for t in STOP_TOKENS if t != EOS_TOKEN]] = -1e4


def _set_channels(table: torch.Tensor, marker: float) -> None:
    """Rows of an embedding table: random part rescaled to RANDOM_NORM, then marker and constant."""
    table[:, [MARKER, COVERAGE, CONSTANT]] = 0.0
    table *= RANDOM_NORM / table.norm(dim=1, keepdim=True).clamp(min=1e-6)
    table[:, MARKER] = marker
    table[:, CONSTANT] = CONSTANT_VALUE
