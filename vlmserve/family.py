"""What the rest of vlmserve may ask of a model family: one `ModelFamily` per architecture, written
by the family (vlmserve/families/<family>/family.py) and listed once in vlmserve/registry.py.

Nothing here names a family. The engine, the server and the entrypoints reach a family only
through these fields, so adding one is a new folder and one registry line."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlmserve.config import ModelConfig
from vlmserve.grounding import GroundingConvention
from vlmserve.multimodal.media import MediaLimits
from vlmserve.processor.base import ProcessingInfo, Processor, ProcessorLimits, RenderedChat


@dataclass(frozen=True)
class ProcessorContext:
    """Everything a family's processor (and its processing info) may be built from."""

    model_dir: Path
    model_config: ModelConfig
    limits: ProcessorLimits
    media_limits: MediaLimits
    # Engine-wide processor options (LLM(mm_processor_kwargs=...)); each family says which it takes.
    mm_processor_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelFamily:
    # Names: the architecture in config.json's `architectures`, its `model_type`, and the name
    # `vlmserve make-tiny --arch` takes.
    architecture: str
    model_type: str
    name: str
    display_name: str  # for people: "Qwen2-VL"
    # config.json (a dict, either published layout) -> the frozen ModelConfig.
    parse_config: Callable[[dict[str, Any]], ModelConfig]
    # The nn.Module: model_class(config, attention_backend) implements vlmserve.models.base.VLModel.
    model_class: Callable[..., Any]
    load_tokenizer: Callable[[Path], Any]
    # The processor without its tokenizer (what the engine process needs), and whole.
    make_processing_info: Callable[[ProcessorContext], ProcessingInfo]
    # (context, the family's tokenizer as load_tokenizer returned it) -> the processor
    make_processor: Callable[[ProcessorContext, Any], Processor]
    # OpenAI-style or the family's own messages -> the prompt the processor takes.
    # (tokenizer, messages, add_generation_prompt, chat_template, chat_template_kwargs)
    render_chat: Callable[[Any, list[dict[str, Any]], bool, str | None, dict[str, Any]], RenderedChat]
    # Token ids that end generation besides generation_config.json's eos (e.g. chat stop words).
    extra_eos_token_ids: Callable[[Any], list[int]]
    # How the model writes boxes: its syntax and scale (vlmserve.grounding).
    grounding: GroundingConvention
    # Write a tiny random-weight checkpoint in the published layout:
    # write_tiny(out_dir, seed=, num_shards=, preset=, nested_config=, untied=) -> the directory;
    # ValueError for an option the family does not have.
    write_tiny: Callable[..., Path]
    # Where `vlmserve inspect` finds the parts (attribute paths in the model): embedding, blocks,
    # final_norm, visual, adapter; and what the adapter is called.
    inspect_parts: dict[str, str]
    adapter_name: str
    # The transformers class of the same architecture (the benchmark's reference), if it has one.
    transformers_class: str | None = None

    @property
    def grounding_convention(self) -> str:
        """The grounding convention's name (what the server's responses say)."""
        return self.grounding.name
