"""The Qwen-VL-Chat processor: prompt text or token ids whose <img>...</img> spans name
the images become a ProcessedPrompt with one 256-token item per span, the pixels the visual
module takes and Qwen-VL's 1-D positions.

An image occupies the 256 positions between <img> and </img> (the tokenizer writes its URL's
bytes there, padded with <imgpad>; the model overwrites all 256 with the image's features):

    ids     ... <img> 104 116 ... <imgpad> ... </img> ...
    index       p     p+1              ...    p+257
    item        offset = p + 1, length = 256, grid_thw = (1, 32, 32): the ViT's 32 x 32 patches of
                14 pixels, resampled to 256 queries

Images come from the spans' URLs (what the reference does: the token ids carry the path), or,
when `images` are passed, from those, one per span in order (the span's bytes are then only a
label: the chat bridge writes nothing there for an image given as bytes, a PIL image or a long
data: URL). Each is opened by open_lazily (its header held to the media limits, every image's
before any is decoded), decoded by load_pixels (errors naming the image; a JPEG much larger than
448 x 448 at a reduced scale, DRAFT_MIN_SIDE), converted to RGB, resized to 448 x 448 bicubic
and normalised with the CLIP mean and std in float32, as the reference's torchvision transform
does.

Positions are 1-D (Qwen's rotary embedding), carried in the [3, N] M-RoPE layout the engine
uses:

    row 0 = row 2 = arange(N)     the rotary position of each token
    row 1 = N - 1                 for every prompt token; + 1 is the sequence length the reference
                                  had in view when it computed the token (it runs the whole prompt
                                  in one forward), which its dynamic NTK scaling depends on

and mrope_delta = 0: decoded token i sits at i on rows 0 and 2. Row 1 stays N - 1 while
decoding (QWenLMHeadModel.decode_positions): the reference chooses ntk_alpha from the prompt's length at
prefill and keeps it for every decode step (QWenModel.forward's `else: ntk_alpha =
self.rotary_emb._ntk_alpha_cached`; the reference notes the check is true only at the start of
generate).

Note: load_pixels applies the EXIF orientation; the reference opens files with PIL and does not.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import numpy as np
import torch
from PIL import Image

from vlmserve.families.qwen_vl.model import ntk_alpha
from vlmserve.families.qwen_vl.tokenizer import IMG_TOKEN_SPAN, QwenVLTokenizer
from vlmserve.multimodal import handles
from vlmserve.multimodal.image import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from vlmserve.multimodal.inputs import MultiModalItem, ProcessedPrompt
from vlmserve.multimodal.media import DEFAULT_LIMITS, MediaError, MediaLimits, load_pixels, open_lazily, oriented_size
from vlmserve.processor.base import ImageInput, ProcessorLimits, VideoInput

IMAGE_SIZE = 448
PATCH_SIZE = 14
GRID_THW = (1, IMAGE_SIZE // PATCH_SIZE, IMAGE_SIZE // PATCH_SIZE)  # the ViT's patch grid
# A JPEG is decoded at 1/2, 1/4 or 1/8 of its size (libjpeg's DCT scaling, Image.draft) when
# that still leaves this many pixels per side: 4x the 448 it is resized to, so the bicubic
# filter still averages >= 4 decoded pixels per output pixel (measured on an 8192x8192 photo-like
# JPEG: at most 3 levels of 255 apart from decoding it whole, 0.17 on average; 0.33 s instead
# of 1.04 s, ~40 MB instead of ~530 MB). Smaller JPEGs decode whole, as the reference does.
DRAFT_MIN_SIDE = 4 * IMAGE_SIZE
# The array an image's segment holds, as the contract's tokenize() writes it (image_pixel[None, :]).
SEGMENT_SHAPE = (1, 3, IMAGE_SIZE, IMAGE_SIZE)


def positions(num_tokens: int, items: Sequence[MultiModalItem] = ()) -> tuple[torch.Tensor, int]:
    """([3, num_tokens] int64 positions, mrope_delta) of a Qwen-VL prompt (module docstring).
    Images do not change them; `items` is taken for the same call shape as mrope_positions."""
    del items
    index = torch.arange(num_tokens, dtype=torch.int64)
    seen = torch.full((num_tokens,), num_tokens - 1, dtype=torch.int64)
    return torch.stack([index, seen, index]), 0  # [3, num_tokens]


def check_image_items(token_ids: Sequence[int], items: Sequence[MultiModalItem], image_start_id: int) -> None:
    """For a prompt rebuilt from token ids and items elsewhere (the engine process): each item
    must fill the 256 positions of one <img> span (<img> is image_start_id, </img> the next id,
    config.json's visual.image_start_id), and every span must have its item."""
    starts = [i + 1 for i, t in enumerate(token_ids) if t == image_start_id]
    offsets = [item.offset for item in items]
    if offsets != starts:
        raise ValueError(f"image items at {offsets} do not match the <img> spans after positions {starts}")
    for item in items:
        if item.modality != "image" or item.length != IMG_TOKEN_SPAN:
            raise ValueError(
                f"a Qwen-VL item is an image of {IMG_TOKEN_SPAN} tokens, got {item.modality} x {item.length}"
            )
        if item.end >= len(token_ids) or token_ids[item.end] != image_start_id + 1:
            raise ValueError(f"the <img> span at {item.offset - 1} is not closed by </img> at {item.end}")


def preprocess_image(image: Image.Image, size: int = IMAGE_SIZE) -> tuple[torch.Tensor, str]:
    """([3, size, size] float32 pixel values, content hash) as the reference's
    Resize((size, size), BICUBIC) -> ToTensor -> Normalize(CLIP mean, std) on image.convert("RGB")."""
    rgb = image if image.mode == "RGB" else image.convert("RGB")  # convert() would copy an RGB image
    if rgb.size != (size, size):
        rgb = rgb.resize((size, size), resample=Image.Resampling.BICUBIC)
    pixels = np.asarray(rgb, dtype=np.uint8)  # [size, size, 3]
    digest = hashlib.blake2b(pixels.tobytes(), digest_size=16, person=b"qwen-vl-448").hexdigest()
    # float32 throughout, in torchvision's order: / 255, - mean, / std.
    scaled = pixels.astype(np.float32) / np.float32(255)
    mean = np.asarray(OPENAI_CLIP_MEAN, dtype=np.float32)
    std = np.asarray(OPENAI_CLIP_STD, dtype=np.float32)
    chw = ((scaled - mean) / std).transpose(2, 0, 1)  # [3, size, size]
    return torch.from_numpy(np.ascontiguousarray(chw)), digest


class QwenVLProcessingInfo:
    """What the engine needs of the processor, without a tokenizer (the engine process loads
    none): limits, dummy images for memory planning, and a prompt rebuilt from token ids and
    images processed elsewhere. `vocab_size` bounds the token ids a prompt may hold (the model's
    embedding rows); `image_start_id` is <img> (config.json's visual.image_start_id)."""

    def __init__(
        self,
        limits: ProcessorLimits,
        media_limits: MediaLimits,
        vocab_size: int,
        image_start_id: int,
        ntk_seq_length: int | None = None,
    ) -> None:
        # config.json's seq_length when use_dynamic_ntk: past it a prompt's KV depends on its
        # length (the rotary base), so such prompts get a cache salt naming the base.
        self.ntk_seq_length = ntk_seq_length
        self.limits = limits
        self.media_limits = media_limits
        self.vocab_size = vocab_size
        self.image_start_id = image_start_id

    # -- what the memory planner needs ----------------------------------------------------------

    def max_items_per_prompt(self) -> dict[str, int]:
        return {"image": self.limits.limit("image"), "video": 0}

    def max_tokens_per_item(self) -> dict[str, int]:
        return {"image": IMG_TOKEN_SPAN}

    def dummy_items(
        self, count: int, tokens_per_item: int = IMG_TOKEN_SPAN, modality: str = "image"
    ) -> list[MultiModalItem]:
        """`count` images of random pixels: every Qwen-VL image is the same size, 256 tokens."""
        if modality != "image":
            raise ValueError("Qwen-VL-Chat has no video input")
        return [
            MultiModalItem(
                modality="image",
                offset=0,
                length=IMG_TOKEN_SPAN,
                grid_thw=GRID_THW,
                content_hash=f"dummy-image-{k}",
                pixel_values=torch.randn(3, IMAGE_SIZE, IMAGE_SIZE),
                original_size=(IMAGE_SIZE, IMAGE_SIZE),
                resized_size=(IMAGE_SIZE, IMAGE_SIZE),
            )
            for k in range(count)
        ]

    def from_token_ids(self, token_ids: list[int], items: list[MultiModalItem]) -> ProcessedPrompt:
        """A prompt whose images were processed elsewhere (the API process): each item must fill
        one <img> span; positions rebuilt."""
        if any(not 0 <= t < self.vocab_size for t in token_ids):
            raise ValueError(f"prompt token ids must be in 0..{self.vocab_size - 1}")
        check_image_items(token_ids, items, self.image_start_id)
        pos, delta = positions(len(token_ids), items)
        return ProcessedPrompt(token_ids, items, pos, delta, cache_salt=self._cache_salt(len(token_ids)))

    # -- the list-of-dicts input: images as shared-memory handles in the token ids ---------------------------
    #
    #     ids   ... <img> HANDLE SHAPE  (the rest of the span) </img> ...
    #     index     p     p+1    p+2                          p+257
    #
    # the contract's worked example: the segment's name and the shape of the pixels it holds
    # ([1, 3, 448, 448] float32) in the two positions after <img> (config.json's
    # visual.image_start_id). The model fills the whole span with the image's features, so the
    # engine puts <imgpad> (image_start_id + 2) in all 256 positions: the image comes from the
    # segment, the span names no URL.

    def handle_payload(self, item: MultiModalItem) -> tuple[np.ndarray, list[int]]:
        pixels = item.pixel_values.numpy()[None]
        return pixels, [handles.shape_to_int64(pixels.shape)]

    def handle_positions(self, token_ids: Sequence[int]) -> list[int]:
        return handles.handles_after(self.image_start_id, token_ids)

    def item_from_handle(
        self, token_ids: list[int], position: int, read: Callable[[tuple[int, ...]], np.ndarray]
    ) -> MultiModalItem:
        p = position
        if p + 1 >= len(token_ids):
            raise ValueError(f"the segment handle at token {p} is not followed by a shape")
        shape = handles.int64_to_shape(token_ids[p + 1])
        if shape != SEGMENT_SHAPE:
            raise ValueError(f"the segment at token {p} holds {shape}; a Qwen-VL image is {SEGMENT_SHAPE}")
        end = p + IMG_TOKEN_SPAN
        if end >= len(token_ids) or token_ids[end] != self.image_start_id + 1:
            raise ValueError(f"the <img> span at {p - 1} is not closed by </img> at {end}")
        tags = (self.image_start_id, self.image_start_id + 1)
        if any(t in tags or t >= handles.HANDLE_TAG for t in token_ids[p + 2 : end]):
            raise ValueError(f"the <img> span at {p - 1} holds <img>, </img> or another handle")
        pixels = np.ascontiguousarray(read(shape)[0])
        token_ids[p:end] = [self.image_start_id + 2] * IMG_TOKEN_SPAN
        return MultiModalItem(
            modality="image",
            offset=p,
            length=IMG_TOKEN_SPAN,
            grid_thw=GRID_THW,
            content_hash=hashlib.blake2b(pixels.tobytes(), digest_size=16, person=b"qwen-vl-shm").hexdigest(),
            pixel_values=torch.from_numpy(pixels),
            original_size=(IMAGE_SIZE, IMAGE_SIZE),
            resized_size=(IMAGE_SIZE, IMAGE_SIZE),
        )

    def _cache_salt(self, num_tokens: int) -> str | None:
        if self.ntk_seq_length is None:
            return None
        alpha = ntk_alpha(num_tokens, self.ntk_seq_length)
        return None if alpha == 1 else f"ntk-alpha-{alpha}"


class QwenVLProcessor(QwenVLProcessingInfo):
    """Same interface as Qwen2VLProcessor; `vocab_size` defaults to the tokenizer's 151860 ids."""

    def __init__(
        self,
        tokenizer: QwenVLTokenizer,
        limits: ProcessorLimits,
        media_limits: MediaLimits = DEFAULT_LIMITS,
        vocab_size: int | None = None,
        ntk_seq_length: int | None = None,
    ) -> None:
        super().__init__(
            limits, media_limits, vocab_size or tokenizer.vocab_size, tokenizer.img_start_id, ntk_seq_length
        )
        self.tokenizer = tokenizer

    # -- prompts --------------------------------------------------------------------------------

    def prompt_images(self, prompt: str | list[int]) -> tuple[list[int], list[str]]:
        """The prompt's token ids and the URL (or "") inside each <img>...</img> span, in order."""
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        return token_ids, [url for _, url in self.image_spans(token_ids)]

    def image_spans(self, token_ids: Sequence[int]) -> list[tuple[int, str]]:
        """(offset of the span's first inner position, URL or "" when it holds none) per span.
        A span must hold exactly 256 ids; a </img> closing no <img> is an error, as it is for the
        reference model (it pairs the k-th <img> with the k-th </img>)."""
        tok = self.tokenizer
        spans: list[tuple[int, str]] = []
        i = 0
        while i < len(token_ids):
            token = token_ids[i]
            if token == tok.img_end_id:
                raise ValueError(f"</img> at position {i} closes no <img>")
            if token != tok.img_start_id:
                i += 1
                continue
            stop = i + 1 + IMG_TOKEN_SPAN
            if stop >= len(token_ids) or token_ids[stop] != tok.img_end_id:
                raise ValueError(
                    f"image {len(spans) + 1}: the <img> at position {i} must be followed by {IMG_TOKEN_SPAN} "
                    "positions and </img>; write <img>URL</img> in the text (the tokenizer pads it)"
                )
            inner = list(token_ids[i + 1 : stop])
            if tok.img_start_id in inner or tok.img_end_id in inner:
                raise ValueError(f"image {len(spans) + 1}: <img> or </img> inside the span at position {i}")
            url = tok.image_span_url(inner)
            spans.append((i + 1, url or ""))
            i = stop + 1
        return spans

    def process(
        self, prompt: str | list[int], images: Sequence[ImageInput] = (), videos: Sequence[VideoInput] = ()
    ) -> ProcessedPrompt:
        """`prompt` holds one <img>...</img> span per image. Without `images`, each span's URL is
        loaded; with them, there must be one per span, and they are used in span order."""
        if videos:
            raise ValueError("Qwen-VL-Chat has no video input")
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty")
        bad = next((i for i, t in enumerate(token_ids) if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(
                f"prompt token ids must be in 0..{self.vocab_size - 1}; position {bad} holds {token_ids[bad]}"
            )
        spans = self.image_spans(token_ids)
        inputs = self._image_inputs(spans, images)
        num_tokens = len(token_ids)
        if num_tokens >= self.limits.max_model_len:
            raise ValueError(
                f"prompt needs {num_tokens} tokens ({len(spans)} image(s) of {IMG_TOKEN_SPAN}), which leaves no "
                f"room to generate within max_model_len={self.limits.max_model_len}"
            )
        # Every image's header is read and held to the limits before any is decoded.
        opened = [
            image.source
            if isinstance(image.source, Image.Image)
            else open_lazily(image.source, image.label, self.media_limits)
            for image in inputs
        ]
        items = [
            self._image_item(image, pil, offset) for (offset, _), image, pil in zip(spans, inputs, opened, strict=True)
        ]
        pos, delta = positions(num_tokens, items)
        return ProcessedPrompt(
            prompt_token_ids=token_ids,
            mm_items=items,
            mrope_positions=pos,
            mrope_delta=delta,
            prompt=text,
            cache_salt=self._cache_salt(num_tokens),
        )

    def _image_inputs(self, spans: list[tuple[int, str]], images: Sequence[ImageInput]) -> list[ImageInput]:
        limit = self.limits.limit("image")
        if images and len(images) != len(spans):
            raise ValueError(
                f"the prompt holds {len(spans)} <img>...</img> span(s) but {len(images)} image(s) were given; "
                "write 'Picture N: <img></img>\\n' once per image, where it belongs"
            )
        if not images:
            images = [ImageInput(url, label=f"image {k + 1} (<img>{url}</img>)") for k, (_, url) in enumerate(spans)]
        if len(images) > limit:
            raise ValueError(
                f"too many images: {len(images)} given, at most {limit} per prompt "
                f"(the first one over: {images[limit].label})"
            )
        for image, (offset, _) in zip(images, spans, strict=True):
            if image.sizing.resizes:
                raise ValueError(
                    f"{image.label}: Qwen-VL-Chat resizes every image to {IMAGE_SIZE}x{IMAGE_SIZE}; "
                    "min_pixels, max_pixels, resized_height and resized_width do not apply"
                )
            if isinstance(image.source, str) and not image.source:
                raise MediaError(
                    f"{image.label}: the <img></img> span at position {offset - 1} names no image; "
                    "write its path or URL between the tags or pass the image"
                )
        return list(images)

    def _image_item(self, image: ImageInput, pil: Image.Image, offset: int) -> MultiModalItem:
        """`pil` as given, or opened lazily (header only): decoded here, a large JPEG at a reduced
        scale (DRAFT_MIN_SIDE)."""
        width, height = pil.size if isinstance(image.source, Image.Image) else oriented_size(pil)
        if width <= 0 or height <= 0:
            raise MediaError(f"{image.label}: image is zero-sized ({width}x{height})")
        if isinstance(image.source, Image.Image):
            pixel_values, content_hash = preprocess_image(pil)
        else:
            pil.draft(None, (DRAFT_MIN_SIDE, DRAFT_MIN_SIDE))  # a no-op but for a JPEG
            try:
                pixel_values, content_hash = preprocess_image(load_pixels(pil, image.label))
            finally:
                pil.close()  # one decoded image held at a time
        return MultiModalItem(
            modality="image",
            offset=offset,
            length=IMG_TOKEN_SPAN,
            grid_thw=GRID_THW,
            content_hash=content_hash,
            pixel_values=pixel_values,
            original_size=(width, height),
            resized_size=(IMAGE_SIZE, IMAGE_SIZE),
        )
