"""Reference embeddings and reranker scores of Qwen3-VL-Embedding and Qwen3-VL-Reranker, through
transformers' Qwen3-VL model on the same checkpoint files as vlmserve, with the inputs built as
the checkpoints' official scripts build them (scripts/qwen3_vl_embedding.py and
scripts/qwen3_vl_reranker.py in the Hugging Face repositories):

Embedding: a system message holding the instruction (default "Represent the user's input.", and
a given one gets a full stop when it ends in no punctuation), a user message of the item's videos,
images, then text ("NULL" when it has none), rendered by the chat template with the generation
prompt; the batch right-padded; the last hidden state (after the final norm) at each sequence's
last real token, which is the "\\n" after "<|im_start|>assistant"; L2-normalised. Matryoshka:
the first `dimensions` values, then normalised.

Reranker: a system message that asks for "yes" or "no", a user message "<Instruct>: {instruction}"
"<Query>:" {query's videos, images, text} "\\n<Document>:" {the document's}, with the generation
prompt; the batch left-padded; score = sigmoid(h . (lm_head["yes"] - lm_head["no"])) for h the
last position's final hidden state, which equals the softmax over the two logits [no, yes].

transformers' processor class needs torchvision for its video half (not installed here): images
go through its image processor, videos are patchified here as its video processor does, and the
placeholders are expanded as Qwen3VLProcessor expands them (each temporal patch after its time).
"""

from __future__ import annotations

import json
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from PIL import Image

from tests.reference import IMAGE_PAD, VIDEO_PAD, mm_token_type_ids, video_patches

EMBEDDING_INSTRUCTION = "Represent the user's input."
RERANKER_SYSTEM = (
    "Judge whether the Document meets the requirements based on the Query and the Instruct provided. Note that the "
    'answer can only be "yes" or "no".'
)
RERANKER_INSTRUCTION = "Given a search query, retrieve relevant candidates that answer the query."
PAD_TOKEN_ID = 151643  # <|endoftext|>
# The official scripts' image bounds (processed with factor 32 = patch 16 x merge 2).
MIN_PIXELS = 4 * 32 * 32
EMBEDDING_MAX_PIXELS = 1800 * 32 * 32
RERANKER_MAX_PIXELS = 1280 * 32 * 32


@dataclass(frozen=True)
class Video:
    """Frames (PIL, all one size) sampled at `fps` frames per second."""

    frames: tuple[Image.Image, ...]
    fps: float


@dataclass(frozen=True)
class Item:
    """A query or document: any of text, images, videos (the official scripts' multimodal object)."""

    text: str | None = None
    images: tuple[Image.Image, ...] = ()
    videos: tuple[Video, ...] = field(default=())


def _content(item: Item) -> list[dict[str, Any]]:
    """The official scripts' order: videos, then images, then the text."""
    content: list[dict[str, Any]] = [{"type": "video", "video": v} for v in item.videos]
    content += [{"type": "image", "image": image} for image in item.images]
    if item.text:
        content.append({"type": "text", "text": item.text})
    return content or [{"type": "text", "text": "NULL"}]


def embedding_messages(item: Item, instruction: str | None = None) -> list[dict[str, Any]]:
    if instruction:
        instruction = instruction.strip()
        if instruction and not unicodedata.category(instruction[-1]).startswith("P"):
            instruction += "."
    return [
        {"role": "system", "content": [{"type": "text", "text": instruction or EMBEDDING_INSTRUCTION}]},
        {"role": "user", "content": _content(item)},
    ]


def reranker_messages(query: Item, document: Item, instruction: str | None = None) -> list[dict[str, Any]]:
    content: list[dict[str, Any]] = [{"type": "text", "text": "<Instruct>: " + (instruction or RERANKER_INSTRUCTION)}]
    content += [{"type": "text", "text": "<Query>:"}, *_content(query)]
    content += [{"type": "text", "text": "\n<Document>:"}, *_content(document)]
    return [
        {"role": "system", "content": [{"type": "text", "text": RERANKER_SYSTEM}]},
        {"role": "user", "content": content},
    ]


def load_tokenizer(model_dir: Path) -> Any:
    """transformers' tokenizer of a checkpoint, with the chat template of its chat_template.json
    (the processor's file, which the tokenizer alone does not read)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    tokenizer.chat_template = json.loads((model_dir / "chat_template.json").read_text())["chat_template"]
    return tokenizer


def render(hf_tokenizer: Any, messages: list[dict[str, Any]]) -> str:
    return str(hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def _media(messages: list[dict[str, Any]]) -> list[Image.Image | Video]:
    return [part.get("image", part.get("video")) for m in messages for part in m["content"] if part["type"] != "text"]


def _resized(image: Image.Image, max_pixels: int) -> Image.Image:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    height, width = smart_resize(image.height, image.width, factor=32, min_pixels=MIN_PIXELS, max_pixels=max_pixels)
    return image.convert("RGB").resize((width, height), Image.Resampling.BICUBIC)


def _video_inputs(video: Video) -> tuple[torch.Tensor, list[int], list[float]]:
    """(pixel_values_videos, [t, h, w], each temporal patch's time) as Qwen3VLVideoProcessor and
    Qwen3VLProcessor make them, for frames whose sides are multiples of 32 (no resize)."""
    frames = list(video.frames)
    if len(frames) % 2:
        frames.append(frames[-1])  # the processor pads to whole temporal patches with the last frame
    w, h = frames[0].size
    assert w % 32 == 0 and h % 32 == 0, "frames of sides that are multiples of 32 need no resize"
    pixels = torch.stack([torch.tensor(list(f.convert("RGB").getdata()), dtype=torch.float32) for f in frames])
    pixels = (pixels / 255.0 - 0.5) / 0.5  # mean and std 0.5
    pixels = pixels.reshape(len(frames), h, w, 3).permute(0, 3, 1, 2)  # [frames, 3, h, w]
    patches, grid = video_patches(pixels, patch_size=16)
    indices = list(range(len(video.frames)))
    indices += [indices[-1]] * (len(frames) - len(indices))
    times = [i / video.fps for i in indices]
    return patches, list(grid), [(times[k] + times[k + 1]) / 2 for k in range(0, len(times), 2)]


def prompt_inputs(
    hf_tokenizer: Any, hf_image_processor: Any, messages: list[dict[str, Any]], max_pixels: int
) -> tuple[list[int], dict[str, torch.Tensor]]:
    """Token ids and vision inputs of one conversation, its placeholders expanded."""
    text = render(hf_tokenizer, messages)
    media = _media(messages)
    images = [_resized(m, max_pixels) for m in media if isinstance(m, Image.Image)]
    videos = [_video_inputs(m) for m in media if isinstance(m, Video)]
    vision: dict[str, torch.Tensor] = {}
    if images:
        vision = dict(hf_image_processor(images, do_resize=False, return_tensors="pt"))
    if videos:
        vision["pixel_values_videos"] = torch.cat([p for p, _, _ in videos])
        vision["video_grid_thw"] = torch.tensor([g for _, g, _ in videos])
    image_counts = iter(int(g.prod()) // 4 for g in vision.get("image_grid_thw", []))
    video_spans = iter(
        "".join(f"<{t:.1f} seconds><|vision_start|>{VIDEO_PAD * (g[1] * g[2] // 4)}<|vision_end|>" for t in times)
        for _, g, times in videos
    )
    parts = text.split(IMAGE_PAD)
    text = parts[0] + "".join(IMAGE_PAD * next(image_counts) + rest for rest in parts[1:])
    # Qwen3VLProcessor replaces the <|video_pad|> alone: the chat template's own
    # <|vision_start|> ... <|vision_end|> stay around the timestamped spans.
    parts = text.split(VIDEO_PAD)
    text = parts[0] + "".join(next(video_spans) + rest for rest in parts[1:])
    return hf_tokenizer(text, add_special_tokens=False)["input_ids"], vision


def _batch(prompts: list[tuple[list[int], dict[str, torch.Tensor]]], padding_side: str) -> dict[str, torch.Tensor]:
    longest = max(len(ids) for ids, _ in prompts)
    rows, masks = [], []
    for ids, _ in prompts:
        pad = [PAD_TOKEN_ID] * (longest - len(ids))
        mask = [1] * len(ids)
        rows.append(ids + pad if padding_side == "right" else pad + ids)
        masks.append(mask + [0] * len(pad) if padding_side == "right" else [0] * len(pad) + mask)
    input_ids = torch.tensor(rows)
    batch = {
        "input_ids": input_ids,
        "attention_mask": torch.tensor(masks),
        "mm_token_type_ids": mm_token_type_ids(input_ids),
    }
    for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
        parts = [vision[key] for _, vision in prompts if key in vision]
        if parts:
            batch[key] = torch.cat(parts)
    return batch


def last_hidden_states(hf_model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """[batch, seq, hidden] after the final norm: Qwen3VLModel's output, no lm_head."""
    with torch.no_grad():
        return hf_model.model(**batch).last_hidden_state


def embed(
    hf_model: Any,
    hf_tokenizer: Any,
    hf_image_processor: Any,
    items: list[Item],
    instruction: str | None = None,
    dimensions: int | None = None,
) -> torch.Tensor:
    """[len(items), dimensions or hidden] unit vectors, the batch run at once (right-padded)."""
    prompts = [
        prompt_inputs(hf_tokenizer, hf_image_processor, embedding_messages(item, instruction), EMBEDDING_MAX_PIXELS)
        for item in items
    ]
    batch = _batch(prompts, "right")
    hidden = last_hidden_states(hf_model, batch)
    last = batch["attention_mask"].sum(dim=1) - 1  # right padding: the last real token
    pooled = hidden[torch.arange(len(items)), last]  # [batch, hidden]
    if dimensions is not None:
        if not 0 < dimensions <= pooled.shape[-1]:
            raise ValueError(f"dimensions must be in 1..{pooled.shape[-1]}, got {dimensions}")
        pooled = pooled[:, :dimensions]
    return F.normalize(pooled.float(), p=2, dim=-1)


def yes_no_ids(hf_tokenizer: Any) -> tuple[int, int]:
    vocab = hf_tokenizer.get_vocab()
    return vocab["yes"], vocab["no"]


def rerank(
    hf_model: Any,
    hf_tokenizer: Any,
    hf_image_processor: Any,
    query: Item,
    documents: list[Item],
    instruction: str | None = None,
) -> list[float]:
    """One score in (0, 1) a document, the pairs run as one left-padded batch."""
    prompts = [
        prompt_inputs(hf_tokenizer, hf_image_processor, reranker_messages(query, doc, instruction), RERANKER_MAX_PIXELS)
        for doc in documents
    ]
    hidden = last_hidden_states(hf_model, _batch(prompts, "left"))[:, -1]  # [pairs, hidden]
    yes, no = yes_no_ids(hf_tokenizer)
    weight = hf_model.lm_head.weight
    return torch.sigmoid(hidden.float() @ (weight[yes] - weight[no]).float()).tolist()
