"""The worker's flow stage (flow_steps.py): recompute calls of at most ``max_rows`` jobs, for steps
bounded per flow call (scheduler.py ``max_batch_per_call``)."""

import torch
from scheduling import zero_stream

from cosyapp.engine.token2wav.flow_steps import FlowSteps
from cosyapp.engine.token2wav.stats import Token2WavStats
from cosyapp.engine.token2wav.stream import Job


def test_recompute_calls_keep_to_max_rows_and_give_the_same_mels(tiny_model, loop):
    def last_chunks():
        jobs = []
        for i in range(5):
            stream = zero_stream()
            stream.attach(tiny_model.device, torch.float32)
            tokens = torch.arange(30 + i, dtype=torch.long) % 50  # of several lengths: padded calls
            jobs.append(Job(stream, tokens, 25, True, loop.create_future()))
        return jobs

    split, stats = last_chunks(), Token2WavStats()
    FlowSteps(tiny_model, None, stats, max_rows=2).run(split)
    assert stats.flow_calls == 3 and stats.max_flow_batch == 2 and stats.recompute_jobs == 5
    whole, stats = last_chunks(), Token2WavStats()
    FlowSteps(tiny_model, None, stats).run(whole)
    assert stats.flow_calls == 1 and stats.max_flow_batch == 5
    for a, b in zip(split, whole, strict=True):
        assert a.mel.shape == b.mel.shape == (80, 2 * (len(a.tokens) - 25))
        torch.testing.assert_close(a.mel, b.mel, rtol=1e-5, atol=1e-5)
