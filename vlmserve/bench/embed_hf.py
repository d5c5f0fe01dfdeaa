"""Qwen3-VL-Embedding through transformers, as the checkpoint's official script runs it
(scripts/qwen3_vl_embedding.py in the Qwen3-VL-Embedding repositories), for the embeddings
benchmark: a batch of inputs {"text": ..., "image": PIL image} each becomes a conversation (a
system message of the instruction, default "Represent the user's input."; a user message of the
image, then the text) rendered by the checkpoint's chat template with the generation prompt; each
image resized as qwen-vl-utils resizes it (sides multiples of 32, within the script's pixel
bounds) and cut into patches by transformers' image processor, its <|image_pad|> repeated once per
merged patch; the batch right-padded; Qwen3VLModel's last hidden state (after the final norm, no
lm_head) at each row's last real token, L2-normalised.

Written apart from vlmserve's processor and pooling (transformers' tokenizer and image processor,
the prompt and constants spelled out here) so that the benchmark's agreement check compares two
independent computations: a wrong prompt, resize or pooling on either side shows in it.
Qwen3VLProcessor itself needs torchvision for its video half, which is why its two parts are used."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from PIL import Image

from vlmserve.bench.run_hf import load_hf_model

# The official script's default instruction and image bounds (resize factor 32: patch 16 x merge 2).
INSTRUCTION = "Represent the user's input."
MIN_PIXELS = 4 * 32 * 32
MAX_PIXELS = 1800 * 32 * 32
MERGE = 2  # spatial_merge_size: one <|image_pad|> per 2 x 2 patches


class TransformersEmbedder:
    """transformers' model, tokenizer and image processor of one checkpoint, on `device`."""

    def __init__(self, model_dir: Path, dtype: torch.dtype, device: torch.device) -> None:
        try:
            from transformers import AutoTokenizer
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
        except ImportError:
            raise SystemExit("the transformers comparison needs transformers: pip install -e '.[bench]'") from None
        self.model = load_hf_model(model_dir, dtype).to(device)
        self.device = device
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        # The processor's chat template (chat_template.json), which the tokenizer alone does not read.
        template = model_dir / "chat_template.json"
        if template.is_file():
            self.tokenizer.chat_template = json.loads(template.read_text())["chat_template"]
        self.image_processor = Qwen2VLImageProcessorPil.from_pretrained(str(model_dir))
        vocab = self.tokenizer.get_vocab()
        self.image_pad_id, self.video_pad_id = vocab["<|image_pad|>"], vocab["<|video_pad|>"]

    def prompt_text(self, item: dict[str, Any]) -> str:
        """One input's rendered conversation, one <|image_pad|> for its image (not yet expanded)."""
        content: list[dict[str, Any]] = []
        if item.get("image") is not None:
            content.append({"type": "image", "image": item["image"]})
        if item.get("text"):
            content.append({"type": "text", "text": item["text"]})
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": [{"type": "text", "text": INSTRUCTION}]},
            {"role": "user", "content": content or [{"type": "text", "text": "NULL"}]},
        ]
        return str(self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))

    def batch_inputs(self, items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """The model's inputs for a batch: right-padded token ids, attention mask, token types,
        and every image's patches with its [t, h, w] grid."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        images = [_resized(item["image"], smart_resize) for item in items if item.get("image") is not None]
        vision: dict[str, torch.Tensor] = {}
        if images:
            vision = dict(self.image_processor(images, do_resize=False, return_tensors="pt"))
        counts = iter(int(grid.prod()) // MERGE**2 for grid in vision.get("image_grid_thw", []))
        rows = []
        for item in items:
            parts = self.prompt_text(item).split("<|image_pad|>")
            text = parts[0] + "".join("<|image_pad|>" * next(counts) + rest for rest in parts[1:])
            rows.append(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        longest = max(len(ids) for ids in rows)
        input_ids = torch.full((len(rows), longest), self.tokenizer.pad_token_id, dtype=torch.long)  # [batch, seq]
        attention_mask = torch.zeros_like(input_ids)
        for row, ids in enumerate(rows):  # right padding, as the official script pads
            input_ids[row, : len(ids)] = torch.tensor(ids)
            attention_mask[row, : len(ids)] = 1
        # transformers' token types: 0 text, 1 image placeholder, 2 video placeholder
        types = (input_ids == self.image_pad_id).int() + 2 * (input_ids == self.video_pad_id).int()
        return {"input_ids": input_ids, "attention_mask": attention_mask, "mm_token_type_ids": types, **vision}

    @torch.inference_mode()
    def embed(self, items: list[dict[str, Any]]) -> torch.Tensor:
        """[len(items), hidden] float32 unit vectors on the CPU, the items run as one batch."""
        batch = {name: t.to(self.device) for name, t in self.batch_inputs(items).items()}
        hidden = self.model.model(**batch).last_hidden_state  # [batch, seq, hidden]
        last = batch["attention_mask"].sum(dim=1) - 1  # right padding: each row's last real token
        pooled = hidden[torch.arange(len(items), device=self.device), last]  # [batch, hidden]
        return F.normalize(pooled.float(), p=2, dim=-1).cpu()


def _resized(image: Image.Image, smart_resize: Any) -> Image.Image:
    height, width = smart_resize(image.height, image.width, factor=32, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    return image.convert("RGB").resize((width, height), Image.Resampling.BICUBIC)
