"""The CosyVoice 2 text-speech language model (upstream ``Qwen2LM``), inference only.

Module names follow ``llm.pt``: ``llm_embedding`` (row 0 sos, row 1 task id), ``llm.model`` (a
transformers ``Qwen2ForCausalLM``), ``llm_decoder`` (speech head with bias) and ``speech_embedding``.
See docs/model.md §4.
"""

from collections.abc import Iterator

import torch
from torch import nn
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.cache_utils import DynamicCache
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

from cosyapp.models.sampling import STOP_TOKENS, SamplingParams, ras_sample, recent_window

SOS_INDEX = 0
TASK_ID_INDEX = 1


class Qwen2Encoder(nn.Module):
    """Holds the transformers backbone under the attribute name the checkpoint uses (``llm.model``)."""

    def __init__(self, config: Qwen2Config):
        super().__init__()
        self.model = Qwen2ForCausalLM(config)

    def forward(self, inputs_embeds: torch.Tensor, cache: DynamicCache | None = None) -> torch.Tensor:
        """Hidden states after the final RMSNorm, (B, T, D).

        Upstream reads the last entry of HF's ``hidden_states``, which is this post-norm output; the
        tied text ``lm_head`` is skipped because its logits are discarded anyway.
        """
        out = self.model.model(
            inputs_embeds=inputs_embeds, past_key_values=cache, use_cache=cache is not None
        )
        return out.last_hidden_state

    def tie_text_embedding(self) -> None:
        """Re-tie the text embedding after ``load_state_dict(assign=True)`` split the tied pair.

        Upstream copies ``lm_head.weight`` last into the shared tensor, so its effective text
        embedding is the ``lm_head`` copy (docs/model.md §1.2); tie to that one.
        """
        if self.model.config.tie_word_embeddings:
            self.model.model.embed_tokens.weight = self.model.lm_head.weight

    def place(self, device: torch.device, dtype: torch.dtype) -> None:
        """Move the backbone to ``device``/``dtype``, with rotary frequencies rebuilt there in float32.

        The rotary ``inv_freq`` buffers are not in the checkpoint (a meta-device build leaves them
        empty), and casting them to a half dtype would round the rotation angles, which HF avoids too.
        """
        backbone = self.model.model
        backbone.rotary_emb = None
        self.model.to(device, dtype)
        backbone.rotary_emb = Qwen2RotaryEmbedding(self.model.config).to(device)


class Qwen2LM(nn.Module):
    """Text-speech LM: embeddings in, speech tokens out."""

    def __init__(
        self,
        llm_input_size: int,
        llm_output_size: int,
        speech_token_size: int,
        llm: Qwen2Encoder,
        sampling: SamplingParams | None = None,
    ):
        super().__init__()
        self.speech_token_size = speech_token_size
        self.llm_embedding = nn.Embedding(2, llm_input_size)
        self.llm = llm
        self.llm_decoder = nn.Linear(llm_output_size, speech_token_size + 3)
        self.speech_embedding = nn.Embedding(speech_token_size + 3, llm_input_size)
        self.sampling = sampling or SamplingParams()

    def prompt_embeds(
        self, prompt_text_ids: torch.Tensor, text_ids: torch.Tensor, prompt_speech_tokens: torch.Tensor
    ) -> torch.Tensor:
        """The zero-shot prefix [sos | prompt text + text | task id | prompt speech] as (L0, D).

        Takes 1-D long tensors. Prompt text and TTS text were tokenized separately (docs/model.md §4.2).
        """
        text = torch.cat([prompt_text_ids, text_ids]).to(self.llm_embedding.weight.device)
        speech = prompt_speech_tokens.to(self.llm_embedding.weight.device)
        return torch.cat(
            [
                self.llm_embedding.weight[SOS_INDEX : SOS_INDEX + 1],
                self.llm.model.model.embed_tokens(text),
                self.llm_embedding.weight[TASK_ID_INDEX : TASK_ID_INDEX + 1],
                self.speech_embedding(speech),
            ]
        )

    @torch.inference_mode()
    def generate(
        self,
        prompt_text_ids: torch.Tensor,
        text_ids: torch.Tensor,
        prompt_speech_tokens: torch.Tensor,
        generator: torch.Generator | None = None,
    ) -> Iterator[int]:
        """Decode speech tokens one by one with a KV cache (docs/model.md §4.4), batch 1.

        Yields ints in [0, 6560]; stops on a stop token (not yielded) or after ``max_len`` tokens.
        """
        min_len, max_len = self.sampling.length_limits(len(text_ids))
        embeds = self.prompt_embeds(prompt_text_ids, text_ids, prompt_speech_tokens)[None]
        cache = DynamicCache()
        generated: list[int] = []
        for step in range(max_len):
            hidden = self.llm(embeds, cache)[:, -1]
            logits = self.llm_decoder(hidden)
            eos_allowed = torch.tensor([step >= min_len], device=logits.device)
            recent = recent_window([generated], self.sampling.win_size, logits.device)
            token = int(ras_sample(logits, recent, eos_allowed, self.sampling, generator)[0])
            if token in STOP_TOKENS:
                return
            generated.append(token)
            yield token
            embeds = self.speech_embedding.weight[token][None, None]
