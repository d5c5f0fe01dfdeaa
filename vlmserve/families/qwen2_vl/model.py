"""Qwen2-VL: the vision tower's merged patch embeddings replace the <|image_pad|> tokens of a
Qwen2 decoder (q/k/v with a bias) with sectioned M-RoPE."""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from vlmserve.attention import AttentionBackend
from vlmserve.config import ModelConfig, TextConfig
from vlmserve.families.common.decoder import MRotaryEmbedding, QwenAttention, QwenDecoder, QwenDecoderLayer, QwenMLP
from vlmserve.families.common.model import VisionLanguageModel, untied_lm_head
from vlmserve.families.qwen2_vl.vision import Qwen2VisionTransformer


def qwen2_decoder(config: TextConfig, backend: AttentionBackend) -> QwenDecoder:
    layers = [
        QwenDecoderLayer(
            config,
            QwenAttention(config, backend, qkv_bias=True, qk_norm=False),
            QwenMLP(config.hidden_size, config.intermediate_size, config.hidden_act),
        )
        for _ in range(config.num_hidden_layers)
    ]
    return QwenDecoder(config, layers, MRotaryEmbedding(config.head_dim, config.rope_theta, config.mrope_section))


class Qwen2VLForConditionalGeneration(VisionLanguageModel):
    prunes_output_rows = True  # the last layer computes only AttentionMetadata.output_rows
    # Built from (config.vision, backend); maps (pixel_values, grid_thw) to the merged embeddings.
    # Qwen2.5-VL swaps in its windowed tower.
    vision_tower: ClassVar[type[nn.Module]] = Qwen2VisionTransformer

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__(config)
        self.visual = self.vision_tower(config.vision, backend)
        self.model = qwen2_decoder(config.text, backend)
        self.lm_head = untied_lm_head(config.text)
