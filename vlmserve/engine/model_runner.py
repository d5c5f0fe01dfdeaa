"""Runs one scheduled step: encodes the images the step needs, builds the flat batch and its
attention metadata, runs the model and samples the requests whose known tokens are all
computed."""

from __future__ import annotations

import torch
from torch import nn

from vlmserve.attention.layer import PagedAttention
from vlmserve.attention.metadata import AttentionMetadata
from vlmserve.engine.kv_cache import KVCacheManager
from vlmserve.engine.sampler import Sampler
from vlmserve.engine.scheduler import SchedulerOutput


def kv_bytes_per_token(model: nn.Module, dtype: torch.dtype) -> int:
    layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
    return sum(2 * m.num_kv_heads * m.head_dim for m in layers) * torch.empty((), dtype=dtype).element_size()


class ModelRunner:
    def __init__(self, model: nn.Module, kv: KVCacheManager, device: torch.device, dtype: torch.dtype) -> None:
        self.model = model
        self.kv = kv
        self.device = device
        self.dtype = dtype
        self.sampler = Sampler()
        # Encoder outputs by content hash; the scheduler says when each may go.
        self.encoder_cache: dict[str, torch.Tensor] = {}
        self.attention_layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
        for layer in self.attention_layers:
            # Zeroed so padded reads in batched decode see finite values (masked away anyway).
            layer.kv_cache = torch.zeros(
                2, kv.pool.num_blocks, kv.block_size, layer.num_kv_heads, layer.head_dim, dtype=dtype, device=device
            )

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> dict[str, int]:
        for content_hash in step.free_encoder_hashes:
            self.encoder_cache.pop(content_hash, None)
        if step.encoder_inputs:
            items = [request.mm_items[i] for request, i in step.encoder_inputs]
            for item, embeds in zip(items, self.model.embed_multimodal(items), strict=True):  # type: ignore[operator]
                self.encoder_cache[item.content_hash] = embeds
        if not step.scheduled:
            return {}

        token_ids: list[int] = []
        positions: list[torch.Tensor] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        block_rows: list[list[int]] = []
        mm_spans: list[tuple[int, torch.Tensor]] = []  # (row in the batch, embeddings to place there)
        sample_rows: list[int] = []
        sampled_requests = []
        for request, n in step.scheduled:
            start, end = request.num_computed_tokens, request.num_computed_tokens + n
            base = len(token_ids)
            token_ids.extend(request.token_ids(start, end))
            positions.append(request.positions(start, end))
            slots.extend(self.kv.slot(request.request_id, t) for t in range(start, end))
            for item in request.mm_items:
                lo, hi = max(start, item.offset), min(end, item.end)
                if lo < hi:
                    embeds = self.encoder_cache[item.content_hash]
                    mm_spans.append((base + lo - start, embeds[lo - item.offset : hi - item.offset]))
            query_start_loc.append(len(token_ids))
            seq_lens.append(end)
            block_rows.append(self.kv.block_ids[request.request_id])
            if end == request.num_tokens:  # every known token computed: sample the next one
                sample_rows.append(len(token_ids) - 1)
                sampled_requests.append(request)

        meta = self._metadata(slots, query_start_loc, seq_lens, block_rows)
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        inputs_embeds = self.model.get_input_embeddings(input_ids)  # type: ignore[operator]
        for row, embeds in mm_spans:
            inputs_embeds[row : row + embeds.shape[0]] = embeds.to(inputs_embeds.dtype)
        hidden = self.model(None, torch.cat(positions, dim=1).to(self.device), meta, inputs_embeds)
        if not sampled_requests:
            return {}
        logits = self.model.compute_logits(hidden[sample_rows]).float()  # type: ignore[operator]
        tokens = self.sampler(logits, [r.params for r in sampled_requests], [r.generator for r in sampled_requests])
        return {r.request_id: t for r, t in zip(sampled_requests, tokens, strict=True)}

    def _metadata(
        self, slots: list[int], query_start_loc: list[int], seq_lens: list[int], block_rows: list[list[int]]
    ) -> AttentionMetadata:
        width = max(len(row) for row in block_rows)
        block_tables = torch.zeros(len(block_rows), width, dtype=torch.long)
        for i, row in enumerate(block_rows):
            block_tables[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            block_tables=block_tables.to(self.device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.long, device=self.device),
            query_start_loc=query_start_loc,
            seq_lens_host=seq_lens,
            block_size=self.kv.block_size,
        )
