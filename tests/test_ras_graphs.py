"""The RAS draw padded into per-bucket static buffers (ras_graphs.py) gives the unpadded draw's rows."""

import torch

from cosyapp.engine.lm.ras_graphs import RasGraphs, ras_choice
from cosyapp.models.sampling import SamplingParams, recent_window, uniform_bits

PARAMS = SamplingParams()


def step(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, 6564, generator=g)
    logits[:, :8] += 4.0  # a small nucleus, so the windows below trigger redraws
    histories = [torch.randint(0, 10, (n,), generator=g).tolist() for n in range(rows)]
    packed = torch.cat(
        [
            recent_window(histories, PARAMS.win_size),
            torch.tensor([[len(h) >= 2] for h in histories]),
            torch.from_numpy(
                uniform_bits([seed * 1000 + i for i in range(rows)], [len(h) for h in histories])
            )[:, None],
        ],
        dim=1,
    )
    return logits, packed


def test_padded_buckets_give_each_row_its_own_draw_whatever_the_padding_holds():
    graphs = RasGraphs(capture=False)
    for rows, seed in [(1, 0), (3, 1), (4, 2), (5, 3), (3, 4), (9, 5)]:  # buckets 1, 4, 4, 8, 4, 16
        logits, packed = step(rows, seed)
        expected = ras_choice(logits, packed, PARAMS)
        assert torch.equal(graphs(logits, packed, PARAMS), expected)
        assert torch.equal((expected == 0).sum(dim=1), torch.ones(rows, dtype=torch.long))
    # the second call of bucket 4 with 3 rows found the 4th row left over from the 4-row call
    assert graphs.replays == 6 and len(graphs._graphs) == 4


def test_a_batch_beyond_the_largest_bucket_runs_unpadded():
    graphs = RasGraphs(capture=False)
    logits, packed = step(3, 7)
    big_logits, big_packed = logits.repeat(400, 1), packed.repeat(400, 1)  # 1200 rows
    assert torch.equal(graphs(big_logits, big_packed, PARAMS), ras_choice(big_logits, big_packed, PARAMS))
    assert graphs.replays == 0
