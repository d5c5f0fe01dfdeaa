"""What turns user requests into engine requests and token ids back into text: the tokenizer,
the processor and the generation defaults. The offline LLM holds one next to the engine core;
the server holds one in its API process."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlmserve.config import ModelConfig
from vlmserve.engine.config import EngineConfig
from vlmserve.model_files import read_json, resolve_model_dir
from vlmserve.multimodal.image import ImageProcessorConfig
from vlmserve.processor.chat import parse_chat_messages
from vlmserve.processor.qwen2_vl import ImageInput, ProcessorLimits, Qwen2VLProcessor, VideoInput
from vlmserve.processor.qwen_vl import QwenVLProcessor
from vlmserve.qwen_vl.chat_format import chat_prompt, stop_token_ids
from vlmserve.qwen_vl.tokenizer import QwenVLTokenizer
from vlmserve.sampling_params import SamplingParams
from vlmserve.tokenizer import AnyTokenizer, Tokenizer


@dataclass
class RenderedChat:
    """A conversation as the processor takes it: the prompt (text, or token ids for Qwen-VL-Chat,
    whose turns are encoded one by one) and the images and videos in order."""

    prompt: str | list[int]
    images: list[ImageInput] = field(default_factory=list)
    videos: list[VideoInput] = field(default_factory=list)


@dataclass
class Frontend:
    model_dir: Path
    model_config: ModelConfig
    tokenizer: AnyTokenizer
    processor: Qwen2VLProcessor | QwenVLProcessor
    generation_config: dict[str, Any]
    eos_token_ids: frozenset[int]
    max_model_len: int

    def default_sampling_params(self) -> SamplingParams:
        """Sampling defaults from generation_config.json, as vLLM applies them."""
        g = self.generation_config
        return SamplingParams(
            temperature=float(g.get("temperature", 1.0)),
            top_p=float(g.get("top_p", 1.0)),
            top_k=int(g.get("top_k", 0)),
        )

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> RenderedChat:
        """OpenAI-style or Qwen-style messages as this family prompts them: the checkpoint's chat
        template (Qwen2-VL, Qwen2.5-VL), or make_context's chatml with history (Qwen-VL-Chat)."""
        kwargs = chat_template_kwargs or {}
        if isinstance(self.tokenizer, QwenVLTokenizer):
            if chat_template is not None:
                raise ValueError("Qwen-VL-Chat has no chat template to replace; it prompts as make_context does")
            unknown = set(kwargs) - {"system", "max_window_size"}
            if unknown:
                raise ValueError(
                    f"chat_template_kwargs: unknown keys {sorted(unknown)}; supported: system, max_window_size"
                )
            chat = chat_prompt(self.tokenizer, messages, add_generation_prompt, **kwargs)
            return RenderedChat(chat.token_ids, chat.images)
        rendered, images, videos = parse_chat_messages(messages)
        text = self.tokenizer.apply_chat_template(rendered, add_generation_prompt, chat_template, **kwargs)
        return RenderedChat(text, images, videos)


def load_frontend(config: EngineConfig, model_dir: Path | None = None) -> Frontend:
    model_dir = model_dir or resolve_model_dir(config.model, config.revision)
    model_config = ModelConfig.from_file(model_dir / "config.json")
    generation_config = read_json(model_dir / "generation_config.json")
    limit = model_config.text.max_position_embeddings
    max_model_len = config.max_model_len or limit
    if not 1 < max_model_len <= limit:
        raise ValueError(f"max_model_len must be in 2..{limit} (max_position_embeddings), got {max_model_len}")
    limits = ProcessorLimits(max_model_len, dict(config.limit_mm_per_prompt))
    tokenizer: AnyTokenizer
    processor: Qwen2VLProcessor | QwenVLProcessor
    if model_config.model_type == "qwen":
        # Qwen-VL-Chat: qwen.tiktoken, every image 448 x 448 (no resize options).
        if config.mm_processor_kwargs:
            raise ValueError("mm_processor_kwargs: Qwen-VL-Chat takes every image at 448 x 448; no options")
        tokenizer = QwenVLTokenizer(model_dir)
        qwen = model_config.qwen_vl
        assert qwen is not None
        processor = QwenVLProcessor(
            tokenizer,
            limits,
            config.media_limits,
            vocab_size=model_config.text.vocab_size,
            ntk_seq_length=qwen.seq_length if qwen.use_dynamic_ntk else None,
        )
        # Its chat() stops on <|im_end|> or <|im_start|> (stop words) as well as <|endoftext|>.
        extra_eos = stop_token_ids(tokenizer)
    else:
        tokenizer = Tokenizer(model_dir)
        unknown = set(config.mm_processor_kwargs) - {"min_pixels", "max_pixels"}
        if unknown:
            raise ValueError(f"mm_processor_kwargs: unknown keys {sorted(unknown)}; supported: min_pixels, max_pixels")
        preprocessor = read_json(model_dir / "preprocessor_config.json") | dict(config.mm_processor_kwargs)
        processor = Qwen2VLProcessor(
            model_config, tokenizer, ImageProcessorConfig.from_dict(preprocessor), limits, config.media_limits
        )
        extra_eos = []
    eos = generation_config.get("eos_token_id", tokenizer.eos_token_id)
    eos_token_ids = frozenset([eos] if isinstance(eos, int) else eos or []) | frozenset(extra_eos)
    return Frontend(model_dir, model_config, tokenizer, processor, generation_config, eos_token_ids, max_model_len)
