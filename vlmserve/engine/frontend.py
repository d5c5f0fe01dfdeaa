"""What turns user requests into engine requests and token ids back into text: the tokenizer,
the processor and the generation defaults. The offline LLM holds one next to the engine core;
the server holds one in its API process."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlmserve.config import ModelConfig
from vlmserve.engine.config import EngineConfig
from vlmserve.model_files import read_json, resolve_model_dir
from vlmserve.multimodal.image import ImageProcessorConfig
from vlmserve.processor.qwen2_vl import ProcessorLimits, Qwen2VLProcessor
from vlmserve.sampling_params import SamplingParams
from vlmserve.tokenizer import Tokenizer


@dataclass
class Frontend:
    model_dir: Path
    model_config: ModelConfig
    tokenizer: Tokenizer
    processor: Qwen2VLProcessor
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


def load_frontend(config: EngineConfig, model_dir: Path | None = None) -> Frontend:
    model_dir = model_dir or resolve_model_dir(config.model, config.revision)
    model_config = ModelConfig.from_file(model_dir / "config.json")
    tokenizer = Tokenizer(model_dir)
    generation_config = read_json(model_dir / "generation_config.json")
    limit = model_config.text.max_position_embeddings
    max_model_len = config.max_model_len or limit
    if not 1 < max_model_len <= limit:
        raise ValueError(f"max_model_len must be in 2..{limit} (max_position_embeddings), got {max_model_len}")
    unknown = set(config.mm_processor_kwargs) - {"min_pixels", "max_pixels"}
    if unknown:
        raise ValueError(f"mm_processor_kwargs: unknown keys {sorted(unknown)}; supported: min_pixels, max_pixels")
    preprocessor = read_json(model_dir / "preprocessor_config.json") | dict(config.mm_processor_kwargs)
    processor = Qwen2VLProcessor(
        model_config,
        tokenizer,
        ImageProcessorConfig.from_dict(preprocessor),
        ProcessorLimits(max_model_len, dict(config.limit_mm_per_prompt)),
        config.media_limits,
    )
    eos = generation_config.get("eos_token_id", tokenizer.eos_token_id)
    eos_token_ids = frozenset([eos] if isinstance(eos, int) else eos or [])
    return Frontend(model_dir, model_config, tokenizer, processor, generation_config, eos_token_ids, max_model_len)
