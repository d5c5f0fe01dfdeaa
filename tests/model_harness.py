"""Drive a vlmserve model directly through paged attention, without the scheduler: the prompt in
chunks of any sizes, then decode steps, returning logits for comparison with transformers."""

from __future__ import annotations

from pathlib import Path

import torch

from vlmserve.attention import select_backend
from vlmserve.attention.metadata import AttentionMetadata
from vlmserve.engine.kv_cache import KVCacheManager
from vlmserve.engine.model_runner import ModelRunner
from vlmserve.engine.request import Request
from vlmserve.engine.request_state import CachedRequestState
from vlmserve.ipc.contracts import NewRequestData
from vlmserve.models.base import item_rows, place_multimodal
from vlmserve.models.build import build_model
from vlmserve.multimodal.inputs import ProcessedPrompt
from vlmserve.registry import family_of, load_model_config
from vlmserve.sampling_params import SamplingParams


class Harness:
    def __init__(
        self,
        model_dir: Path,
        dtype: torch.dtype = torch.float32,
        num_blocks: int = 256,
        quantization: str | None = None,
    ) -> None:
        config = load_model_config(model_dir / "config.json")
        self.model = build_model(
            family_of(config).model_class,
            config,
            model_dir,
            select_backend(torch.device("cpu")),
            torch.device("cpu"),
            dtype,
            quantization,
        )
        self.kv = KVCacheManager(num_blocks, block_size=16)
        self.runner = ModelRunner(self.model, torch.device("cpu"), dtype)
        self.runner.bind_kv_cache(self.kv.pool.num_blocks, self.kv.block_size)
        # A model with per-request state (linear attention): one slot, slot 0, for the one request.
        self.stateful = bool(self.runner.state_layers)
        if self.stateful:
            self.runner.bind_state_cache(1)

    @torch.inference_mode()
    def logits(self, prompt: ProcessedPrompt, chunks: list[int] | None = None, extra: list[int] = ()) -> torch.Tensor:
        """Logits [num_tokens, vocab] for the prompt (computed in `chunks`) followed by `extra`
        tokens decoded one at a time."""
        request = Request("r", prompt, SamplingParams(max_tokens=len(extra) + 1), frozenset(), 1 << 20)
        request.output_token_ids = list(extra)
        # The runner's copy of the request, for its positions (the model's decode rule past the prompt).
        state = CachedRequestState.from_new(
            NewRequestData(
                request_id="r",
                prompt_token_ids=prompt.prompt_token_ids,
                mm_items=prompt.mm_items,
                mrope_positions=prompt.mrope_positions,
                mrope_delta=prompt.mrope_delta,
                sampling_params=request.params,
                block_ids=[],
                num_computed_tokens=0,
            )
        )
        total = request.num_tokens
        sizes = (chunks or [prompt.num_tokens]) + [1] * len(extra)
        assert sum(sizes) == total
        assert self.kv.allocate_slots("r", total)
        encoded = self.model.embed_multimodal(prompt.mm_items)
        out = []
        for n in sizes:
            start, end = request.num_computed_tokens, request.num_computed_tokens + n
            ids = torch.tensor(request.token_ids(start, end))
            spans = []
            for item, item_embeds in zip(prompt.mm_items, encoded, strict=True):
                lo, hi = max(start, item.offset), min(end, item.end)
                if lo < hi:
                    spans.append((lo - start, item_rows(item_embeds, lo - item.offset, hi - item.offset)))
            embeds, extras = place_multimodal(self.model.get_input_embeddings(ids), spans)
            meta = AttentionMetadata(
                slot_mapping=torch.tensor([self.kv.slot("r", t) for t in range(start, end)]),
                block_tables=torch.tensor([self.kv.block_ids["r"]]),
                seq_lens=torch.tensor([end]),
                query_start_loc=[0, n],
                seq_lens_host=[end],
                block_size=self.kv.block_size,
                state_slots=torch.tensor([0]) if self.stateful else None,
                state_slots_host=[0] if self.stateful else None,
                has_initial_state=[start > 0] if self.stateful else None,
            )
            hidden = self.model(None, state.positions(start, end, self.model.decode_positions), meta, embeds, extras)
            out.append(self.model.compute_logits(hidden).float())
            request.num_computed_tokens = end
        self.kv.free("r")
        return torch.cat(out)
