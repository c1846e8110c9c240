"""RasLogitsProcessor (engine/lm/vllm_model.py) on hand-made batch states: what it draws, from which
row data, and how it follows vLLM's persistent batch."""

import pytest
import torch
from test_lm_vllm import requires_vllm

from cosyapp.models.sampling import (
    EOS_TOKEN,
    SamplingParams,
    draw_tokens,
    ras_distribution,
    recent_window,
    uniform_bits,
    window_row,
)


def ras_params(min_tokens: int, sampling: SamplingParams, seed: int = 0):
    from vllm import SamplingParams as VllmSamplingParams

    from cosyapp.engine.lm.vllm_model import ras_extra_args

    return VllmSamplingParams(extra_args=ras_extra_args(min_tokens, sampling, seed))


def new_processor():
    from cosyapp.engine.lm.vllm_model import RasLogitsProcessor

    return RasLogitsProcessor(None, torch.device("cpu"), False)


def batch_update(size, added=(), removed=(), moved=()):
    from vllm.v1.sample.logits_processor import BatchUpdate

    return BatchUpdate(batch_size=size, removed=list(removed), added=list(added), moved=list(moved))


def peaked_logits(rows: int, seed: int) -> torch.Tensor:
    logits = torch.randn(rows, 6564, generator=torch.Generator().manual_seed(seed))
    logits[:, :8] += 4.0  # a nucleus of a few tokens, so the repetition window matters
    return logits


def drawn(out: torch.Tensor) -> list[int]:
    """The token each one-hot row of the processor's output leaves to vLLM's argmax."""
    assert torch.equal((out == 0).sum(dim=1), torch.ones(len(out), dtype=torch.long))
    assert torch.equal((out == float("-inf")).sum(dim=1), torch.full((len(out),), out.size(1) - 1))
    return out.argmax(dim=1).tolist()


@requires_vllm
def test_logits_processor_draws_each_ras_row_from_its_seed_and_position():
    sampling = SamplingParams()
    history = [0, 1, 2, 50, 3]  # tokens 0-3 sit in the nucleus and in the window
    processor = new_processor()
    processor.update_state(batch_update(2, added=[(0, ras_params(2, sampling, seed=7), None, history)]))
    logits = peaked_logits(2, seed=0)
    out = processor.apply(logits.clone())
    q = ras_distribution(logits[:1], recent_window([history], 10), torch.tensor([True]), sampling)
    bits = torch.from_numpy(uniform_bits([7], [len(history)]))
    assert drawn(out[:1]) == draw_tokens(q, bits).tolist()
    assert q[0, drawn(out[:1])[0]] > 0
    assert torch.equal(out[1], logits[1])  # a request without the RAS argument is left alone


@requires_vllm
def test_logits_processor_draws_follow_the_ras_distribution_with_its_window():
    from scipy.stats import chi2

    sampling, rows = SamplingParams(), 4000
    history = [0, 1, 2, 50, 3]
    processor = new_processor()
    added = [(i, ras_params(2, sampling, seed=i), None, history) for i in range(rows)]
    processor.update_state(batch_update(rows, added=added))
    logits = peaked_logits(1, seed=3).expand(rows, -1).contiguous()
    tokens = torch.tensor(drawn(processor.apply(logits.clone())))
    q = ras_distribution(logits[:1], recent_window([history], 10), torch.tensor([True]), sampling)[0].double()
    without_window = ras_distribution(logits[:1], recent_window([[]], 10), torch.tensor([True]), sampling)[0]
    assert not torch.allclose(q.float(), without_window, atol=1e-3)  # the window does change the outcome
    assert bool((q[tokens] > 0).all())
    # The nucleus's tokens one by one, the fallback's thin spread over the rest as one bin.
    top = q.topk(8).indices
    observed = torch.stack([(tokens == t).sum() for t in top] + [(~torch.isin(tokens, top)).sum()]).double()
    expected = rows * torch.cat([q[top], (1 - q[top].sum()).view(1)])
    statistic = float(((observed - expected) ** 2 / expected).sum())
    assert chi2.sf(statistic, len(expected) - 1) > 1e-4, (statistic, observed, expected)


@requires_vllm
def test_logits_processor_masks_only_eos_before_min_tokens():
    processor = new_processor()
    histories = [[7, 8, 9] for _ in range(200)]
    added = [(i, ras_params(4, SamplingParams(), seed=i), None, h) for i, h in enumerate(histories)]
    processor.update_state(batch_update(len(histories), added=added))
    logits = torch.zeros(len(histories), 6564)
    logits[:, 6561:] = 20.0  # all three stop tokens far ahead of the speech tokens
    tokens = drawn(processor.apply(logits.clone()))
    assert EOS_TOKEN not in tokens and set(tokens) == {6562, 6563}

    for h in histories:
        h.append(10)  # vLLM appends to the list it handed over: 4 tokens reach min_tokens
    tokens = drawn(processor.apply(logits.clone()))
    assert tokens.count(EOS_TOKEN) > 0.2 * len(tokens)


@requires_vllm
def test_logits_processor_follows_removed_and_moved_requests():
    from vllm.v1.sample.logits_processor import MoveDirectionality

    sampling = SamplingParams()
    histories = [[0, 1], [2, 3, 4, 5, 6]]
    processor = new_processor()
    processor.update_state(
        batch_update(
            2, added=[(i, ras_params(0, sampling, seed=40 + i), None, h) for i, h in enumerate(histories)]
        )
    )
    processor.update_state(batch_update(1, removed=[0], moved=[(1, 0, MoveDirectionality.UNIDIRECTIONAL)]))
    logits = peaked_logits(1, seed=1)
    q = ras_distribution(logits, recent_window(histories[1:], 10), torch.tensor([True]), sampling)
    bits = torch.from_numpy(uniform_bits([41], [len(histories[1])]))
    assert drawn(processor.apply(logits.clone())) == draw_tokens(q, bits).tolist()


@requires_vllm
def test_logits_processor_draws_the_same_tokens_through_padded_graph_buckets():
    from cosyapp.engine.lm.ras_graphs import RasGraphs

    sampling = SamplingParams()
    histories = [[0, 1, 2], [], [5, 5, 5, 1], [3] * 12, [7, 0]]
    eager, padded = new_processor(), new_processor()
    padded.draw = RasGraphs(capture=False)  # the replay's padding and copies, run eagerly on the CPU
    for processor in (eager, padded):  # rows 0, 2, 3, 5, 6 of a batch of 7: two rows without RAS
        added = [
            (i, ras_params(3, sampling, seed=i), None, h)
            for i, h in zip((0, 2, 3, 5, 6), histories, strict=True)
        ]
        processor.update_state(batch_update(7, added=added))
    logits = peaked_logits(7, seed=9)
    assert torch.equal(padded.apply(logits.clone()), eager.apply(logits.clone()))
    assert padded.draw.replays == 1


@requires_vllm
def test_packed_rows_hold_each_window_eos_flag_uniform_and_index():
    from cosyapp.engine.lm.vllm_model import _RasRow, pack_rows

    g = torch.Generator().manual_seed(5)
    histories = [torch.randint(0, 6561, (n,), generator=g).tolist() for n in (0, 1, 9, 10, 11, 37, 3)]
    rows = [
        _RasRow(SamplingParams(), min_tokens=10, seed=100 + i, output_ids=h) for i, h in enumerate(histories)
    ]
    indices = [0, 2, 3, 5, 8, 9, 12]
    packed = pack_rows(rows, indices, 10)
    for got, h, i, seed in zip(packed.tolist(), histories, indices, range(100, 107), strict=True):
        assert got[:10] == window_row(h, 10)
        assert got[10:] == [len(h) >= 10, int(uniform_bits([seed], [len(h)])[0]), i]


@requires_vllm
def test_logits_processor_rejects_a_malformed_ras_argument():
    from vllm import SamplingParams as VllmSamplingParams

    from cosyapp.engine.lm.vllm_model import RAS_ARG, RasLogitsProcessor

    with pytest.raises(ValueError, match=RAS_ARG):
        RasLogitsProcessor.validate_params(VllmSamplingParams(extra_args={RAS_ARG: {"min_tokens": 3}}))
