"""The flow's matrix weights stored in the autocast dtype give bit for bit the flow autocast gives
with float32 weights (tiny model, bfloat16 autocast on the CPU)."""

import copy

import pytest
import torch
from test_flow_cache import prompt, recompute

from cosyapp.engine.token2wav.flow_cache import FlowItem, IncrementalFlow, raw_estimator
from cosyapp.engine.token2wav.pages import FlowCache, KVPool
from cosyapp.engine.token2wav.precision import cast_matmul_weights
from cosyapp.models.cosyvoice2 import PromptInputs

DTYPE = torch.bfloat16


@pytest.fixture(scope="module")
def flows(tiny_model):
    cast = copy.deepcopy(tiny_model.flow)
    cast_matmul_weights(cast, DTYPE)
    return tiny_model.flow, cast


def test_only_matrix_layers_change_dtype(flows):
    _, cast = flows
    assert cast.matmul_dtype == DTYPE
    kinds = {}
    for module in cast.modules():
        for p in module.parameters(recurse=False):
            kinds.setdefault(type(module).__name__, set()).add(p.dtype)
    assert kinds["Linear"] == {DTYPE}
    assert kinds["CausalConv1d"] == {DTYPE}
    assert kinds["LayerNorm"] == {torch.float32}  # autocast runs LayerNorm in float32
    assert kinds["Embedding"] == {torch.float32}
    assert kinds["Conv1d"] == {DTYPE}  # the pointwise ones (residual, final projection)


@pytest.mark.parametrize("streaming", [True, False])
def test_a_whole_pass_is_bit_identical(flows, streaming):
    p = prompt(30, seed=0)
    tokens = torch.randint(0, 6561, (40,), generator=torch.Generator().manual_seed(1))
    mels = []
    for flow in flows:
        with torch.inference_mode(), torch.autocast("cpu", dtype=DTYPE):
            mels.append(recompute(flow, p, tokens, final=True, streaming=streaming))
    assert mels[0].abs().max() > 0
    assert torch.equal(mels[0], mels[1])


def test_incremental_calls_are_bit_identical(flows):
    p = prompt(30, seed=2)
    tokens = torch.randint(0, 6561, (80,), generator=torch.Generator().manual_seed(3))
    calls = ((28, False), (53, False), (80, True))
    outputs = [incremental_mels(flow, p, tokens, calls) for flow in flows]
    for a, b in zip(*outputs, strict=True):
        assert torch.equal(a, b)


def incremental_mels(flow, p, tokens, calls, inputs: bool = False) -> list[torch.Tensor]:
    """One stream's incremental calls under autocast, padded to graph buckets: each call's mel."""
    speech, feat, emb = p
    est = raw_estimator(flow)
    steps = flow.decoder.n_timesteps
    pool = KVPool(est, pages=16, steps=steps, device=torch.device("cpu"), dtype=DTYPE, inputs=inputs)
    cache, frames = FlowCache(), []
    for n, final in calls:
        item = FlowItem(cache, speech, feat, emb, tokens[:n], final)
        with torch.autocast("cpu", dtype=DTYPE):
            [(mel, _)] = IncrementalFlow(flow, pool, graphs=True)([item])
        frames.append(mel)
    return frames


def test_the_reference_path_runs_under_the_stored_dtype(tiny_model, flows):
    _, cast = flows
    speech, feat, emb = prompt(30, seed=4)
    model = copy.copy(tiny_model)
    model.flow = cast
    p = PromptInputs(text_ids=torch.tensor([1, 2]), speech_tokens=speech, speech_feat=feat, embedding=emb)
    tokens = torch.arange(200, 220)
    mel = model.tokens_to_mel(tokens, p)
    # The same autocast over float32 weights; and with no autocast, float32 throughout.
    autocast_only = copy.copy(tiny_model)
    autocast_only.flow = copy.deepcopy(tiny_model.flow)
    autocast_only.flow.matmul_dtype = DTYPE
    float32 = tiny_model.tokens_to_mel(tokens, p)
    assert mel.dtype == torch.float32 and mel.shape == (80, 40)
    assert torch.equal(mel, autocast_only.tokens_to_mel(tokens, p))
    assert not torch.equal(mel, float32)
    torch.testing.assert_close(mel, float32, atol=0.1, rtol=0.05)


def test_a_pool_of_attention_inputs_gives_the_keys_and_values_pool_s_frames(flows):
    """Under autocast the projection casts its input to the stored dtype, so keeping that input and
    projecting it again at every call gives the keys and values kept before: the same frames (bit
    for bit on this CPU) across four calls of one stream."""
    _, cast = flows
    p = prompt(30, seed=5)
    tokens = torch.randint(0, 6561, (130,), generator=torch.Generator().manual_seed(6))
    calls = ((28, False), (53, False), (103, False), (130, True))
    outputs = [incremental_mels(cast, p, tokens, calls, inputs) for inputs in (False, True)]
    for a, b in zip(*outputs, strict=True):
        assert a.abs().max() > 0
        assert torch.equal(a, b)
