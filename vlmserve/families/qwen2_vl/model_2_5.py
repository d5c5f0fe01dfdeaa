"""Qwen2.5-VL: Qwen2-VL's decoder and model protocol around the windowed vision tower. Videos'
absolute-time M-RoPE positions come from the processor (vlmserve.multimodal.mrope), so the model
itself differs from Qwen2-VL only in the vision tower and its weight names."""

from __future__ import annotations

import dataclasses

from vlmserve.families.qwen2_vl.model import Qwen2VLForConditionalGeneration
from vlmserve.families.qwen2_vl.vision_2_5 import Qwen2_5_VisionTransformer
from vlmserve.models.loader import WeightTable


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    vision_tower = Qwen2_5_VisionTransformer

    def weight_table(self) -> WeightTable:
        """Qwen2-VL's table; the vision MLP's gate_proj / up_proj fuse into its gate_up_proj at
        the vision tower's width, the decoder's at the decoder's."""
        table = super().weight_table()
        text_shards = table.shards
        assert text_shards is not None
        width = self.config.vision.intermediate_size
        assert width is not None
        vision_offsets = {"0": (0, width), "1": (width, width)}

        def shards(param: str, shard: str) -> tuple[int, int]:
            if param.startswith("visual."):
                return vision_offsets[shard]
            return text_shards(param, shard)

        return dataclasses.replace(table, shards=shards)
