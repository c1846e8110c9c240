import copy

import pytest
import torch
from transformers.cache_utils import DynamicCache

from cosyapp.models.sampling import EOS_TOKEN


@pytest.fixture
def lm(tiny_model):
    return copy.deepcopy(tiny_model.lm)


def ids(*values):
    return torch.tensor(values, dtype=torch.long)


def test_prompt_embeds_are_sos_text_task_speech(lm):
    prompt_text, text, speech = ids(5, 6, 7), ids(8, 9), ids(100, 200, 300, 400)
    emb = lm.prompt_embeds(prompt_text, text, speech)
    assert emb.shape == (1 + 3 + 2 + 1 + 4, lm.llm_embedding.embedding_dim)
    table = lm.llm.model.model.embed_tokens.weight
    assert torch.equal(emb[0], lm.llm_embedding.weight[0])
    assert torch.equal(emb[1:6], table[[5, 6, 7, 8, 9]])
    assert torch.equal(emb[6], lm.llm_embedding.weight[1])
    assert torch.equal(emb[7:], lm.speech_embedding.weight[[100, 200, 300, 400]])


def test_kv_cache_decoding_matches_a_full_recompute(lm):
    prefix = lm.prompt_embeds(ids(5, 6), ids(7, 8, 9), ids(1, 2, 3))[None]
    steps = lm.speech_embedding.weight[[10, 20, 30]][None]
    with torch.inference_mode():
        cache = DynamicCache()
        incremental = [lm.llm(prefix, cache)[:, -1]]
        for i in range(steps.shape[1]):
            incremental.append(lm.llm(steps[:, i : i + 1], cache)[:, -1])
        full = lm.llm(torch.cat([prefix, steps], dim=1))
    expected = full[:, prefix.shape[1] - 1 :]
    torch.testing.assert_close(torch.stack(incremental, dim=1), expected, atol=1e-5, rtol=1e-4)


def test_eos_cannot_end_the_sentence_before_min_len(lm):
    with torch.no_grad():
        lm.llm_decoder.weight.zero_()
        lm.llm_decoder.bias.zero_()
        lm.llm_decoder.bias[EOS_TOKEN] = 50.0  # EOS is certain as soon as it is allowed
        lm.llm_decoder.bias[6562:] = -50.0
    text = ids(3, 4, 5, 6)
    tokens = list(lm.generate(ids(1), text, ids(7, 8), torch.Generator().manual_seed(0)))
    assert len(tokens) == lm.sampling.length_limits(len(text))[0] == 8
    assert all(0 <= t < 6561 for t in tokens)


def test_generation_is_cut_off_at_max_len(lm):
    with torch.no_grad():
        lm.llm_decoder.bias[6561:] = -50.0
    text = ids(3, 4)
    tokens = list(lm.generate(ids(1), text, ids(7, 8), torch.Generator().manual_seed(0)))
    assert len(tokens) == lm.sampling.length_limits(len(text))[1] == 40


def test_stop_tokens_end_generation_and_are_not_emitted(lm):
    with torch.no_grad():
        lm.llm_decoder.weight.zero_()
        lm.llm_decoder.bias.zero_()
        lm.llm_decoder.bias[6563] = 50.0  # the fill token is a stop token outside bi-streaming
    assert list(lm.generate(ids(1), ids(3, 4), ids(7), torch.Generator().manual_seed(0))) == []


def test_same_generator_seed_gives_the_same_tokens(lm):
    def run(seed):
        return list(lm.generate(ids(1, 2), ids(3, 4, 5), ids(7, 8, 9), torch.Generator().manual_seed(seed)))

    first = run(1)
    assert len(first) >= 6
    assert run(1) == first
    assert run(2) != first
