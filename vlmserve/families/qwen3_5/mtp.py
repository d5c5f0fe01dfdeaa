"""Qwen3.5's multi-token-prediction (MTP) head: a one-layer drafter for speculative decoding that
the published Qwen3.5 and Qwen3.5-MoE checkpoints ship beside the model (Qwen3-Next's design).

At position i it reads the target's hidden state of position i (the one the lm_head reads: after
the decoder's final norm) and the embedding of token i + 1 (the target's embed_tokens), and its
output through the target's lm_head predicts token i + 2:

    x = fc(cat([pre_fc_norm_embedding(embed(token i + 1)), pre_fc_norm_hidden(hidden i)]))
    x = layers[0](x)   # a full-attention decoder layer, the target's kind, at position i (the
                       # target's row's position, slot and block table), over its own paged KV cache
    out = norm(x)

A further draft step feeds `out` back as the hidden state, beside the token it drafted, one
position on (vLLM's speculative proposer does so).

The checkpoint's tensors (config.json: text_config.mtp_num_hidden_layers = 1), as vLLM's
qwen3_5_mtp.py and SGLang's qwen3_5_mtp.py load them and the published index files name them:
    mtp.fc.weight                      [hidden, 2 * hidden] (input: embedding first, then hidden)
    mtp.pre_fc_norm_embedding.weight   [hidden]  } RMS norms scaled by (1 + weight),
    mtp.pre_fc_norm_hidden.weight      [hidden]  } as the decoder's
    mtp.norm.weight                    [hidden]  }
    mtp.layers.0.input_layernorm.weight, mtp.layers.0.post_attention_layernorm.weight [hidden]
    mtp.layers.0.self_attn.{q_proj (query and gate per head), k_proj, v_proj, o_proj, q_norm, k_norm}
        as a full-attention layer of the decoder
    mtp.layers.0.mlp.{gate_proj, up_proj, down_proj} (Qwen3.5), or in Qwen3.5-MoE the layer's
        routed experts and shared expert as every decoder layer's: mlp.gate, mlp.experts.<e>.
        {gate_proj, up_proj, down_proj}, mlp.shared_expert.{gate_proj, up_proj, down_proj},
        mlp.shared_expert_gate
No embedding or lm_head of its own: the target's serve both."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from vlmserve.attention import AttentionBackend
from vlmserve.attention.metadata import AttentionMetadata
from vlmserve.config import TextConfig
from vlmserve.families.qwen3_5.config import Qwen35FamilyConfig
from vlmserve.families.qwen3_5.decoder import OffsetRMSNorm, Qwen35DecoderLayer
from vlmserve.models.layers import Linear


class Qwen35MultiTokenPredictor(nn.Module):
    def __init__(self, config: TextConfig, family: Qwen35FamilyConfig, backend: AttentionBackend) -> None:
        super().__init__()
        # NOTE: vLLM runs layer (draft step % layers) for each draft step; every published checkpoint
        # has one layer, which every draft step reuses. Other counts are refused until one is published.
        if family.mtp_num_hidden_layers != 1:
            raise ValueError(
                f"config.json: text_config.mtp_num_hidden_layers is {family.mtp_num_hidden_layers}; "
                "vlmserve runs a multi-token-prediction head of 1 layer (as Qwen3.5 publishes)"
            )
        h, eps = config.hidden_size, config.rms_norm_eps
        self.fc = Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = OffsetRMSNorm(h, eps)
        self.pre_fc_norm_hidden = OffsetRMSNorm(h, eps)
        full_attention = dataclasses.replace(family, layer_types=("full_attention",))
        self.layers = nn.ModuleList([Qwen35DecoderLayer(config, full_attention, 0, backend)])
        self.norm = OffsetRMSNorm(h, eps)

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """inputs_embeds: [n, hidden] of tokens i + 1; hidden: [n, hidden], the target's at i;
        cos, sin: the rotary of the rows' positions -> [n, hidden] (the lm_head's input)."""
        x = self._input(inputs_embeds, hidden)
        for layer in self.layers:
            x = layer(x, cos, sin, meta)
        return self.norm(x)

    def fill(
        self,
        inputs_embeds: torch.Tensor,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        """forward's keys and values of the rows, written to the head's cache, without the rest of
        its layer (attention, MLP, norm): rows whose output no draft reads (a third of the cost)."""
        (layer,) = self.layers
        assert isinstance(layer, Qwen35DecoderLayer) and not layer.linear
        layer.self_attn.store_kv(layer.input_layernorm(self._input(inputs_embeds, hidden)), cos, sin, meta)

    def _input(self, inputs_embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        assert inputs_embeds.shape == hidden.shape, (inputs_embeds.shape, hidden.shape)
        x = torch.cat([self.pre_fc_norm_embedding(inputs_embeds), self.pre_fc_norm_hidden(hidden)], dim=-1)
        return self.fc(x)  # [n, hidden]
