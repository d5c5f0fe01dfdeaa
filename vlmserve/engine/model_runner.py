"""Runs one scheduled step: encodes the images the step needs, builds the flat batch and its
attention metadata, runs the model and samples the requests whose known tokens are all
computed. Also runs the memory planner's worst-case profile step."""

from __future__ import annotations

import torch

from vlmserve.attention.layer import PagedAttention
from vlmserve.attention.metadata import AttentionMetadata
from vlmserve.engine.kv_cache import KVCacheManager
from vlmserve.engine.memory import PeakMeter, one_block_per_stack
from vlmserve.engine.sampler import Sampler, TokenLogprobs, token_logprobs
from vlmserve.engine.scheduler import SchedulerOutput
from vlmserve.models.base import VLModel
from vlmserve.multimodal.inputs import MultiModalItem
from vlmserve.sampling_params import SamplingParams


class ModelRunner:
    def __init__(self, model: VLModel, device: torch.device, dtype: torch.dtype) -> None:
        self.model = model
        self.device = device
        self.dtype = dtype
        self.sampler = Sampler()
        self.kv: KVCacheManager | None = None
        # Encoder outputs by content hash; the scheduler says when each may go.
        self.encoder_cache: dict[str, torch.Tensor] = {}
        self.last_logprobs: dict[str, TokenLogprobs] = {}
        self.attention_layers = [m for m in model.modules() if isinstance(m, PagedAttention)]

    @property
    def kv_bytes_per_token(self) -> int:
        per_layer = [2 * m.num_kv_heads * m.head_dim for m in self.attention_layers]
        return sum(per_layer) * torch.empty((), dtype=self.dtype).element_size()

    def bind_kv_cache(self, kv: KVCacheManager, layers: list[PagedAttention] | None = None) -> None:
        self.kv = kv
        for layer in self.attention_layers if layers is None else layers:
            # Zeroed so padded reads in batched decode see finite values (masked away anyway).
            layer.kv_cache = torch.zeros(
                2,
                kv.pool.num_blocks,
                kv.block_size,
                layer.num_kv_heads,
                layer.head_dim,
                dtype=self.dtype,
                device=self.device,
            )

    def free_encoder_outputs(self, content_hashes: list[str]) -> None:
        for content_hash in content_hashes:
            self.encoder_cache.pop(content_hash, None)

    # -- a step ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> dict[str, int]:
        """The token sampled for each request that reached the end of its known tokens;
        their log-probabilities, where asked for, are left in `self.last_logprobs`."""
        assert self.kv is not None, "bind_kv_cache() before the first step"
        self.free_encoder_outputs(step.free_encoder_hashes)
        if step.encoder_inputs:
            items = [request.mm_items[i] for request, i in step.encoder_inputs]
            for item, embeds in zip(items, self.model.embed_multimodal(items), strict=True):
                self.encoder_cache[item.content_hash] = embeds
        self.last_logprobs = {}
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

        meta = self._metadata(slots, query_start_loc, seq_lens, block_rows, self.kv.block_size)
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        inputs_embeds = self.model.get_input_embeddings(input_ids)
        for row, embeds in mm_spans:
            inputs_embeds[row : row + embeds.shape[0]] = embeds.to(inputs_embeds.dtype)
        hidden = self.model(None, torch.cat(positions, dim=1).to(self.device), meta, inputs_embeds)
        if not sampled_requests:
            return {}
        logits = self.model.compute_logits(hidden[sample_rows]).float()
        tokens = self.sampler(logits, [r.params for r in sampled_requests], [r.generator for r in sampled_requests])
        counts = [r.params.logprobs for r in sampled_requests]
        if any(c is not None for c in counts):
            info = token_logprobs(logits, tokens, counts)
            self.last_logprobs = {r.request_id: x for r, x in zip(sampled_requests, info, strict=True) if x is not None}
        return {r.request_id: t for r, t in zip(sampled_requests, tokens, strict=True)}

    def _metadata(
        self,
        slots: list[int],
        query_start_loc: list[int],
        seq_lens: list[int],
        block_rows: list[list[int]],
        block_size: int,
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
            block_size=block_size,
        )

    # -- the memory planner's worst case --------------------------------------------------------

    @torch.inference_mode()
    def profile_run(
        self, dummy_items: list[MultiModalItem], num_tokens: int, max_model_len: int, num_seqs: int, block_size: int
    ) -> int:
        """Peak activation bytes of the worst step the limits admit: encode `dummy_items`, compute
        `num_tokens` new tokens at the end of a max_model_len context, decode `num_seqs` sequences
        of max_model_len, and sample `num_seqs` rows. Uses a scratch KV cache of max_model_len
        tokens (not counted)."""
        scratch = KVCacheManager(-(-max_model_len // block_size), block_size, enable_prefix_caching=False)
        blocks = list(range(scratch.pool.num_blocks))
        hidden_size = self.model.get_input_embeddings(torch.zeros(1, dtype=torch.long, device=self.device)).shape[-1]
        greedy_and_sampled = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_p=0.9, top_k=50)]
        meter = PeakMeter(self.device)
        with one_block_per_stack(self.model):
            self.bind_kv_cache(scratch, [m for m in self.model.modules() if isinstance(m, PagedAttention)])
            baseline = meter.current()
            meter.reset()
            if dummy_items:
                self.model.embed_multimodal(dummy_items)
            # A prompt chunk at the end of the longest context.
            q = min(num_tokens, max_model_len)
            meta = self._metadata(
                list(range(max_model_len - q, max_model_len)), [0, q], [max_model_len], [blocks], block_size
            )
            embeds = torch.randn(q, hidden_size, dtype=self.dtype, device=self.device)
            positions = torch.arange(max_model_len - q, max_model_len, device=self.device).expand(3, -1)
            hidden = self.model(None, positions, meta, embeds)
            rows = min(num_seqs, q)
            self._profile_sample(hidden[-rows:], rows, greedy_and_sampled)
            del hidden, embeds
            # Every sequence decoding at full length (block tables may alias: reads only).
            meta = self._metadata(
                [max_model_len - 1] * num_seqs,
                list(range(num_seqs + 1)),
                [max_model_len] * num_seqs,
                [blocks] * num_seqs,
                block_size,
            )
            embeds = torch.randn(num_seqs, hidden_size, dtype=self.dtype, device=self.device)
            positions = torch.full((3, num_seqs), max_model_len - 1, device=self.device)
            hidden = self.model(None, positions, meta, embeds)
            self._profile_sample(hidden, num_seqs, greedy_and_sampled)
            del hidden, embeds
        peak = meter.peak()
        for layer in self.attention_layers:
            layer.kv_cache = None
        self.kv = None
        return max(0, peak - baseline)

    def _profile_sample(self, hidden: torch.Tensor, rows: int, kinds: list[SamplingParams]) -> None:
        logits = self.model.compute_logits(hidden).float()
        params = [kinds[i % len(kinds)] for i in range(rows)]
        self.sampler(logits, params, [None] * rows)
