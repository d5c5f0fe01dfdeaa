"""The adapter a request runs with (vLLM's LoRARequest: the same names and order)."""

from __future__ import annotations

import msgspec


class LoRAError(ValueError):
    """An adapter that cannot be served (a missing file, a module the model does not have, a rank
    above max_lora_rank, shapes that do not match the base model, another architecture's), or
    a request naming one while LoRA is off: the message names what was wrong and the fix."""


class AdapterInfo(msgspec.Struct, frozen=True):
    """What the engine core learns of an adapter it loads: whether it changes image embeddings
    (then its requests' encoder outputs and image blocks are its own), its bytes on a rank, its
    largest rank, how many layers it changes."""

    vision: bool
    nbytes: int
    max_rank: int
    num_layers: int


class LoRARequest(msgspec.Struct, frozen=True):
    """lora_name: what requests call the adapter (the server's `model`); lora_int_id: a positive
    number unique among the adapters loaded at once; lora_path: the folder holding
    adapter_config.json and adapter_model.safetensors."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise LoRAError(
                f"adapter {self.lora_name!r}: lora_int_id must be a positive integer, got {self.lora_int_id}"
            )
        if not self.lora_name:
            raise LoRAError("an adapter needs a non-empty lora_name")
