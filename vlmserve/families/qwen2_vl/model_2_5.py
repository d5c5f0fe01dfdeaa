"""Qwen2.5-VL: Qwen2-VL's decoder and model protocol around the windowed vision tower. Videos'
absolute-time M-RoPE positions come from the processor (vlmserve.multimodal.mrope), so the model
itself differs from Qwen2-VL only in the vision tower. Qwen2-VL's weight table serves both: the
vision MLP's gate_proj / up_proj fuse into its gate_up_proj as the decoder's do, each at its own
width (the fused parameter's ShardSpec says where)."""

from __future__ import annotations

from vlmserve.families.qwen2_vl.model import Qwen2VLForConditionalGeneration
from vlmserve.families.qwen2_vl.vision_2_5 import Qwen2_5_VisionTransformer


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    vision_tower = Qwen2_5_VisionTransformer
