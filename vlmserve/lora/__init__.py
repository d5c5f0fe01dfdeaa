"""LoRA adapters (PEFT's format) served over one base model, many in one batch: the request that
names one (request.py), the adapter files read and checked against the model (adapter.py), the
low-rank products added to the model's linear layers per row of a step (layers.py), and the
bounded pool of adapters a worker holds (manager.py)."""

from vlmserve.lora.request import AdapterInfo, LoRAError, LoRARequest

__all__ = ["AdapterInfo", "LoRAError", "LoRARequest"]
