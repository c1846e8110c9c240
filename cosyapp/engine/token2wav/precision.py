"""The flow's matrix-product weights kept in the autocast dtype it runs under.

Under autocast a Linear or Conv1d with float32 parameters casts its weight and bias to the autocast
dtype on every call: a kernel each, about a third of an incremental flow call's kernels at batch 1
(docs/benchmarks/README.md). Cast once, autocast finds them already in its dtype and runs the same
products on the same values, so the flow's output is bit for bit unchanged. LayerNorms keep their
float32 parameters, as autocast runs them in float32; embeddings and other parameters stay too.
"""

import torch
from torch import nn

from cosyapp.models.flow import CausalMaskedDiffWithXvec

MATMUL_LAYERS = (nn.Linear, nn.Conv1d)


def cast_matmul_weights(flow: CausalMaskedDiffWithXvec, dtype: torch.dtype) -> None:
    """Store ``flow``'s Linear and Conv1d parameters in ``dtype``, in place.

    The flow must then always run under ``torch.autocast(dtype=dtype)``; ``flow.matmul_dtype``
    says which (``CosyVoice2.tokens_to_mel`` reads it).
    """
    assert isinstance(flow, CausalMaskedDiffWithXvec)
    for module in flow.modules():
        if isinstance(module, MATMUL_LAYERS):
            module.to(dtype)
    flow.matmul_dtype = dtype
