"""What turns user requests into engine requests and token ids back into text: the family's
tokenizer, processor and chat rendering, and the generation defaults. The offline LLM holds one
next to the engine core; the server holds one in its API process."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlmserve.config import ModelConfig
from vlmserve.engine.checkpoint import EngineModel, open_checkpoint
from vlmserve.engine.config import EngineConfig
from vlmserve.family import ModelFamily
from vlmserve.model_files import read_json
from vlmserve.processor.base import Processor, RenderedChat
from vlmserve.sampling_params import SamplingParams
from vlmserve.tokenizer import AnyTokenizer


@dataclass
class Frontend:
    model_dir: Path
    model_config: ModelConfig
    family: ModelFamily
    tokenizer: AnyTokenizer
    processor: Processor
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
        """OpenAI-style or the family's own messages as the family prompts them (the checkpoint's
        chat template, or the family's own chat format)."""
        return self.family.render_chat(
            self.tokenizer, messages, add_generation_prompt, chat_template, chat_template_kwargs or {}
        )

    def engine_model(self) -> EngineModel:
        """What the engine core needs of this checkpoint (its processor serves as processing info)."""
        return EngineModel(
            self.model_dir, self.model_config, self.family, self.processor, self.max_model_len, self.eos_token_ids
        )


def load_frontend(config: EngineConfig, model_dir: Path | None = None) -> Frontend:
    model_dir, model_config, family, ctx = open_checkpoint(config, model_dir)
    generation_config = read_json(model_dir / "generation_config.json")
    tokenizer = family.load_tokenizer(model_dir)
    processor = family.make_processor(ctx, tokenizer)
    eos = generation_config.get("eos_token_id", tokenizer.eos_token_id)
    eos_token_ids = frozenset([eos] if isinstance(eos, int) else eos or []) | frozenset(
        family.extra_eos_token_ids(tokenizer)
    )
    return Frontend(
        model_dir,
        model_config,
        family,
        tokenizer,
        processor,
        generation_config,
        eos_token_ids,
        ctx.limits.max_model_len,
    )
