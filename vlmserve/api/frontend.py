"""What turns user requests into engine requests and token ids back into text: the family's
tokenizer, processor and chat rendering, and the generation defaults. The offline LLM holds one
next to the engine core; the server holds one in its API process."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from vlmserve.config import ModelConfig
from vlmserve.engine.checkpoint import EngineModel, open_checkpoint, resolve_pooler
from vlmserve.engine.config import EngineConfig
from vlmserve.family import ModelFamily
from vlmserve.model_files import read_json
from vlmserve.pooling import PoolerConfig
from vlmserve.processor.base import Processor, RenderedChat
from vlmserve.processor.continuation import cut_at_mark, mark_final_message
from vlmserve.processor.roles import check_custom_roles_rendered
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
    # The sampling defaults (--generation-config): SamplingParams field -> value.
    sampling_defaults: dict[str, Any]
    # The most logprobs a request may ask for (vLLM's --max-logprobs; -1: the vocabulary's size).
    max_logprobs: int = 20
    # A pooling model's pooler (runner "pooling": embeddings or scores); None: it generates.
    pooler: PoolerConfig | None = None

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the sampling defaults applied (as vLLM's
        LLM.get_default_sampling_params)."""
        return SamplingParams(**self.sampling_defaults)

    def resolve_params(self, params: SamplingParams) -> SamplingParams:
        """What the engine needs of `params` that takes the tokenizer or the vocabulary: bad_words
        as token ids; logit_bias and allowed_token_ids checked against the vocabulary, logprobs and
        prompt_logprobs against max_logprobs. ValueError names what is wrong."""
        vocab = self.model_config.text.vocab_size
        for name, ids in (("logit_bias", params.logit_bias), ("allowed_token_ids", params.allowed_token_ids)):
            outside = sorted({t for t in ids or () if t >= vocab})
            if outside:
                raise ValueError(f"{name} has token ids past the vocabulary (size {vocab}): {outside[:8]}")
        for name in ("logprobs", "prompt_logprobs"):
            problem = self.logprobs_problem(getattr(params, name))
            if problem:
                raise ValueError(f"{name} {problem}")
        if not params.bad_words or params.bad_words_token_ids is not None:
            return params
        return replace(params, bad_words_token_ids=bad_words_token_ids(self.tokenizer, params.bad_words))

    def logprobs_problem(self, count: int | None) -> str | None:
        """Why a request may not ask for `count` logprobs, if it may not (vLLM's rule: -1 counts as
        the whole vocabulary, and max_logprobs -1 allows up to it)."""
        if count is None:
            return None
        vocab = self.model_config.text.vocab_size
        asked = vocab if count == -1 else count
        allowed = vocab if self.max_logprobs == -1 else self.max_logprobs
        if asked > allowed:
            return f"requests {asked} logprobs, more than the {allowed} allowed (max_logprobs, --max-logprobs)"
        return None

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> RenderedChat:
        """OpenAI-style or the family's own messages as the family prompts them (the checkpoint's
        chat template, or the family's own chat format); continue_final_message leaves the last
        message open (processor/continuation.py)."""
        kwargs = chat_template_kwargs or {}

        def render(marked: list[dict[str, Any]]) -> str:
            prompt = self.family.render_chat(self.tokenizer, marked, False, chat_template, kwargs).prompt
            return prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt, skip_special_tokens=False)

        check_custom_roles_rendered(messages, render)
        if not continue_final_message:
            return self.family.render_chat(self.tokenizer, messages, add_generation_prompt, chat_template, kwargs)
        if add_generation_prompt:  # vLLM's rule
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        chat = self.family.render_chat(self.tokenizer, mark_final_message(messages), False, chat_template, kwargs)
        if not isinstance(chat.prompt, str):
            raise ValueError(
                f"continue_final_message: {self.family.display_name} builds its prompts as token ids, "
                "with no chat template to leave open"
            )
        return replace(chat, prompt=cut_at_mark(chat.prompt))

    def engine_model(self) -> EngineModel:
        """What the engine core needs of this checkpoint (its processor serves as processing info)."""
        return EngineModel(
            self.model_dir,
            self.model_config,
            self.family,
            self.processor,
            self.max_model_len,
            self.eos_token_ids,
            self.pooler,
        )


# generation_config.json keys vLLM takes as sampling defaults, and the SamplingParams field of each.
_GENERATION_DEFAULTS = {
    "repetition_penalty": "repetition_penalty",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "max_new_tokens": "max_tokens",
}


def sampling_defaults(mode: str, generation_config: dict[str, Any]) -> dict[str, Any]:
    """vLLM's --generation-config: "vllm": none (SamplingParams' own); "auto" (or a folder, whose
    generation_config.json is passed in): the sampling keys the file sets (do_sample is not read,
    as in vLLM: Qwen2-VL's top_k 1 makes its default greedy anyway)."""
    if mode == "vllm":
        return {}
    return {
        field: generation_config[key]
        for key, field in _GENERATION_DEFAULTS.items()
        if generation_config.get(key) is not None
    }


def bad_words_token_ids(tokenizer: AnyTokenizer, words: list[str]) -> list[list[int]]:
    """Each word's token ids as it starts a text and, where that tokenizes differently (to as
    many tokens), after a space: vLLM's SamplingParams.update_from_tokenizer."""
    out: list[list[int]] = []
    for word in words:
        bare = tokenizer.encode(word.lstrip())
        out.append(bare)
        spaced = tokenizer.encode(" " + word.lstrip())
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return out


def load_frontend(config: EngineConfig, model_dir: Path | None = None) -> Frontend:
    model_dir, model_config, family, ctx = open_checkpoint(config, model_dir)
    generation_config = read_json(model_dir / "generation_config.json")
    if config.generation_config not in ("auto", "vllm"):
        source = Path(config.generation_config) / "generation_config.json"
        if not source.is_file():
            raise ValueError(
                f"generation_config must be 'auto', 'vllm' or a folder with a generation_config.json; no {source}"
            )
        defaults_from = read_json(source)
    else:
        defaults_from = generation_config
    defaults = sampling_defaults(config.generation_config, defaults_from)
    SamplingParams(**defaults)  # a checkpoint's bad default fails at load, not at every request
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
        defaults,
        config.max_logprobs,
        resolve_pooler(config, model_dir, model_config),
    )
