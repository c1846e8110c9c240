import asyncio
import copy
from collections import Counter

import pytest
import torch

from cosyapp.engine.lm import torch_engine as lm_torch
from cosyapp.engine.lm.base import LMRequest, LMStats
from cosyapp.engine.lm.torch_engine import BatchedDecoder, TorchSpeechLM
from cosyapp.models.sampling import EOS_TOKEN, ras_distribution, recent_window


@pytest.fixture
def lm(tiny_model):
    return copy.deepcopy(tiny_model.lm)


def prompt(lm, text_len: int, seed: int) -> torch.Tensor:
    """A zero-shot prefix of 2 prompt-text, ``text_len`` text and 3 prompt-speech tokens."""
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(3, 400, (2 + text_len,), generator=g)
    speech = torch.randint(0, 6561, (3,), generator=g)
    with torch.no_grad():
        return lm.prompt_embeds(text[:2], text[2:], speech)


def request(lm, i: int, min_tokens: int = 0, max_tokens: int = 40, seed: int | None = None) -> LMRequest:
    return LMRequest(f"r{i}", prompt(lm, 3 + i % 4, i), min_tokens, max_tokens, i if seed is None else seed)


def decode(lm, requests: list[LMRequest]) -> tuple[list[list[int]], LMStats]:
    """Run the requests concurrently on a fresh engine; their tokens and the final stats."""

    async def collect(engine, req):
        return [t async for chunk in engine.generate(req) for t in chunk]

    async def main():
        engine = TorchSpeechLM(lm)
        await engine.start()
        try:
            return await asyncio.gather(*(collect(engine, r) for r in requests)), engine.stats()
        finally:
            await engine.shutdown()

    return asyncio.run(main())


def set_stop_bias(lm, eos: float, others: float) -> None:
    with torch.no_grad():
        lm.llm_decoder.bias[EOS_TOKEN] = eos
        lm.llm_decoder.bias[EOS_TOKEN + 1 :] = others


def test_batched_decoder_hidden_states_match_hf_for_rows_of_different_lengths(lm):
    decoder = BatchedDecoder(lm)
    prefixes = [prompt(lm, 2, 0), prompt(lm, 6, 1)]  # 9 and 13 positions
    steps = lm.speech_embedding.weight[torch.tensor([[10, 20, 30], [40, 50, 60]])]
    with torch.inference_mode():
        cache = decoder.new_cache(2, 13)
        padded = torch.nn.utils.rnn.pad_sequence(prefixes, batch_first=True)
        hidden = decoder.forward(padded, torch.arange(13).expand(2, -1), cache)
        for row, prefix in enumerate(prefixes):
            expected = lm.llm(prefix[None])[0]
            torch.testing.assert_close(hidden[row, : len(prefix)], expected, atol=1e-5, rtol=1e-4)
        for i in range(steps.shape[1]):
            positions = torch.tensor([[len(p) + i] for p in prefixes])
            hidden = decoder.forward(steps[:, i : i + 1], positions, cache)[:, 0]
            for row, prefix in enumerate(prefixes):
                full = lm.llm(torch.cat([prefix, steps[row, : i + 1]])[None])[0, -1]
                torch.testing.assert_close(hidden[row], full, atol=1e-5, rtol=1e-4)


def test_batched_greedy_tokens_match_a_full_recompute_while_rows_join_and_leave(lm, monkeypatch):
    monkeypatch.setattr(lm_torch, "CACHE_CHUNK", 8)  # the caches grow and get padded to each other
    decoder = BatchedDecoder(lm)
    prefixes = [prompt(lm, 2, 0), prompt(lm, 7, 1)]

    def greedy(hidden):
        return lm.llm_decoder(hidden).argmax(dim=-1).tolist()

    def reference(prefix, steps):
        seq, tokens = prefix, []
        for _ in range(steps):
            tokens.append(greedy(lm.llm(seq[None])[0, -1:])[0])
            seq = torch.cat([seq, lm.speech_embedding.weight[tokens[-1]][None]])
        return tokens

    def step(cache, tokens, lengths):
        embeds = lm.speech_embedding.weight[[t[-1] for t in tokens]][:, None]
        hidden = decoder.forward(embeds, torch.tensor(lengths)[:, None], cache)[:, 0]
        return greedy(hidden), [n + 1 for n in lengths]

    with torch.inference_mode():
        # Row 0 decodes alone for 5 tokens, row 1 joins for 15 shared steps, row 0 leaves after 20.
        cache = decoder.new_cache(1, len(prefixes[0]))
        hidden = decoder.forward(prefixes[0][None], torch.arange(len(prefixes[0]))[None], cache)
        tokens, lengths = [greedy(hidden[:, -1])], [len(prefixes[0])]
        for _ in range(4):
            new, lengths = step(cache, tokens, lengths)
            tokens[0].append(new[0])
        joining = decoder.new_cache(1, len(prefixes[1]))
        hidden = decoder.forward(prefixes[1][None], torch.arange(len(prefixes[1]))[None], joining)
        cache.extend(joining)
        tokens.append(greedy(hidden[:, -1]))
        lengths.append(len(prefixes[1]))
        for _ in range(15):
            new, lengths = step(cache, tokens, lengths)
            for row, token in enumerate(new):
                tokens[row].append(token)
        cache.keep([1])
        left, tokens, lengths = tokens[0], tokens[1:], lengths[1:]
        for _ in range(4):
            new, lengths = step(cache, tokens, lengths)
            tokens[0].append(new[0])
        assert left == reference(prefixes[0], 20)
        assert tokens[0] == reference(prefixes[1], 20)


def test_first_token_distribution_matches_ras_distribution(lm):
    with torch.no_grad():
        lm.llm_decoder.weight.mul_(24.0)  # a peaked distribution, so the nucleus keeps a few tokens
    set_stop_bias(lm, eos=20.0, others=0.0)  # EOS would win if min_tokens did not mask it
    embeds = prompt(lm, 3, 0)
    n = 2000
    requests = [LMRequest(f"r{i}", embeds, 1, 1, seed=i) for i in range(n)]
    results, _ = decode(lm, requests)
    with torch.no_grad():
        logits = lm.llm_decoder(lm.llm(embeds[None])[:, -1])
    q = ras_distribution(logits, recent_window([[]], 10), torch.tensor([False]), lm.sampling)[0]
    counts = Counter(tokens[0] if tokens else "stop" for tokens in results)
    assert counts["stop"] == 0 and EOS_TOKEN not in counts
    support = set(q.nonzero().squeeze(1).tolist())
    assert set(counts) <= support and 2 <= len(support) < 25
    for token in support:
        expected = n * float(q[token])
        assert abs(counts[token] - expected) <= 5 * (expected * (1 - float(q[token]))) ** 0.5 + 1


def test_eos_is_masked_until_each_requests_min_tokens(lm):
    set_stop_bias(lm, eos=50.0, others=-50.0)  # EOS is certain as soon as it is allowed
    min_tokens = [0, 3, 7, 12]
    results, _ = decode(lm, [request(lm, i, min_tokens=m, max_tokens=100) for i, m in enumerate(min_tokens)])
    assert [len(tokens) for tokens in results] == min_tokens
    assert all(0 <= t < EOS_TOKEN for tokens in results for t in tokens)


def test_generation_is_cut_off_at_each_requests_max_tokens(lm):
    set_stop_bias(lm, eos=-50.0, others=-50.0)
    max_tokens = [1, 5, 17]
    results, _ = decode(lm, [request(lm, i, max_tokens=m) for i, m in enumerate(max_tokens)])
    assert [len(tokens) for tokens in results] == max_tokens


def test_eight_concurrent_requests_are_decoded_in_shared_steps(lm):
    set_stop_bias(lm, eos=50.0, others=-50.0)
    min_tokens = [20 + 3 * i for i in range(8)]
    results, stats = decode(
        lm, [request(lm, i, min_tokens=m, max_tokens=200) for i, m in enumerate(min_tokens)]
    )
    assert [len(tokens) for tokens in results] == min_tokens
    assert stats.max_batch_size == 8
    assert stats.tokens_generated == sum(min_tokens)


def test_a_requests_tokens_do_not_depend_on_the_batch(lm):
    # Logits alone vs in a batch differ by <= ~2.4e-7 on CPU fp32 (GEMM and attention blocking), so the
    # tokens match unless a draw falls within that margin of a decision boundary: not the case here.
    set_stop_bias(lm, eos=-50.0, others=-50.0)
    target = request(lm, 3, max_tokens=40, seed=123)
    others = [request(lm, i, max_tokens=10 + 5 * i) for i in range(7)]
    (alone,), _ = decode(lm, [target])
    together, _ = decode(lm, [*others[:4], target, *others[4:]])
    assert len(alone) == 40
    assert together[4] == alone


def test_a_closed_request_leaves_the_batch_and_others_continue(lm):
    set_stop_bias(lm, eos=-50.0, others=-50.0)
    endless = request(lm, 0, max_tokens=100_000)
    survivor = request(lm, 1, max_tokens=60)
    (expected,), _ = decode(lm, [survivor])

    async def main():
        engine = TorchSpeechLM(lm)
        await engine.start()
        try:
            stream = engine.generate(endless)
            await anext(stream)
            other = asyncio.create_task(collect(engine.generate(survivor)))
            await anext(stream)
            await stream.aclose()
            tokens = await other
            for _ in range(1000):
                if engine.stats().running == 0:
                    break
                await asyncio.sleep(0.01)
            return tokens, engine.stats()
        finally:
            await engine.shutdown()

    async def collect(stream):
        return [t async for chunk in stream for t in chunk]

    tokens, stats = asyncio.run(main())
    assert tokens == expected
    assert stats.running == 0
    assert stats.tokens_generated < 10_000  # the closed request stopped long before its 100,000 tokens


def test_a_failing_step_fails_its_requests_and_the_engine_keeps_serving(lm):
    set_stop_bias(lm, eos=-50.0, others=-50.0)
    broken = LMRequest("bad", torch.zeros(4, 3), 0, 10, seed=0)  # wrong embedding width

    async def main():
        engine = TorchSpeechLM(lm)
        await engine.start()
        try:
            with pytest.raises(RuntimeError, match="step failed"):
                await anext(engine.generate(broken))
            return [t async for chunk in engine.generate(request(lm, 0, max_tokens=5)) for t in chunk]
        finally:
            await engine.shutdown()

    assert len(asyncio.run(main())) == 5


def test_start_and_shutdown_are_idempotent_and_a_stopped_engine_refuses_requests(lm):
    async def main():
        engine = TorchSpeechLM(lm)
        await engine.start()
        await engine.start()
        await engine.shutdown()
        await engine.shutdown()
        with pytest.raises(RuntimeError, match="not started"):
            await anext(engine.generate(request(lm, 0)))

    asyncio.run(main())
