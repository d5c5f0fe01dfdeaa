"""The memory planner's worst case: the step the limits admit that needs the most activation
memory, run once at start-up on a scratch KV cache, its peak measured (engine/memory.py)."""

from __future__ import annotations

import logging
from typing import Protocol

import torch

from vlmserve.attention.layer import PagedAttention
from vlmserve.attention.state import SequenceState
from vlmserve.engine.logits_processors import TokenHistory
from vlmserve.engine.memory import PeakMeter, one_block_per_stack
from vlmserve.engine.pooler import Pooler
from vlmserve.engine.sampler import Sampler
from vlmserve.engine.step_batch import attention_metadata
from vlmserve.models.base import VLModel
from vlmserve.multimodal.inputs import MultiModalItem
from vlmserve.pooling import PoolingParams
from vlmserve.progress import progress
from vlmserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Greedy rows and rows through every stage of the sampler, penalties over a full-length history
# included, alternating.
PROFILED_SAMPLING = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0, top_p=0.9, top_k=50, min_p=0.05, repetition_penalty=1.1, frequency_penalty=0.5),
]


class ProfiledRunner(Protocol):
    """What the worst-case step needs of the model runner."""

    model: VLModel
    device: torch.device
    dtype: torch.dtype
    sampler: Sampler
    # A pooling runner's: its rows are pooled, never sampled (an embedding model has no lm_head).
    pooler: Pooler | None
    block_size: int
    attention_layers: list[PagedAttention]
    state_layers: list[SequenceState]

    def bind_kv_cache(self, num_blocks: int, block_size: int, layers: list[PagedAttention] | None = None) -> None: ...


@torch.inference_mode()
def profile_worst_step(
    runner: ProfiledRunner,
    dummy_items: list[MultiModalItem],
    num_tokens: int,
    max_model_len: int,
    num_seqs: int,
    block_size: int,
) -> int:
    """Peak activation bytes of the worst step the limits admit: encode `dummy_items`, compute
    `num_tokens` new tokens at the end of a max_model_len context, decode `num_seqs` sequences of
    max_model_len, and sample `num_seqs` rows. Uses a scratch KV cache of max_model_len tokens
    (not counted)."""
    model, device, dtype = runner.model, runner.device, runner.dtype
    num_blocks = -(-max_model_len // block_size)
    blocks = list(range(num_blocks))
    hidden_size = model.get_input_embeddings(torch.zeros(1, dtype=torch.long, device=device)).shape[-1]
    meter = PeakMeter(device)
    # Three parts: the largest images through the encoder, a prompt chunk, a full decode batch.
    parts = progress(desc="profiling memory (worst-case step)", total=3, unit="part", logger=logger)
    with parts, one_block_per_stack(model):
        runner.bind_kv_cache(num_blocks, block_size, [m for m in model.modules() if isinstance(m, PagedAttention)])
        # Scratch states, one slot per sequence (their bytes are planned apart, not measured here).
        state_layers = [m for m in model.modules() if isinstance(m, SequenceState)]
        for state_layer in state_layers:
            state_layer.bind(num_seqs, dtype, device)
        stateful = bool(state_layers)
        meter.reset()  # first: it gives free heap pages back, which lowers the current RSS
        baseline = meter.current()
        if dummy_items:
            model.embed_multimodal(dummy_items)
        parts.update()
        # A prompt chunk at the end of the longest context.
        q = min(num_tokens, max_model_len)
        meta = attention_metadata(
            list(range(max_model_len - q, max_model_len)),
            [0, q],
            [max_model_len],
            [blocks],
            block_size,
            device,
            [0] if stateful else None,
            [True] if stateful else None,
        )
        embeds = torch.randn(q, hidden_size, dtype=dtype, device=device)
        positions = torch.arange(max_model_len - q, max_model_len, device=device).expand(3, -1)
        hidden = model(None, positions, meta, embeds)
        rows = min(num_seqs, q)
        _sample(runner, hidden[-rows:], rows, max_model_len)
        del hidden, embeds
        parts.update()
        # Every sequence decoding at full length (block tables may alias: reads only).
        meta = attention_metadata(
            [max_model_len - 1] * num_seqs,
            list(range(num_seqs + 1)),
            [max_model_len] * num_seqs,
            [blocks] * num_seqs,
            block_size,
            device,
            list(range(num_seqs)) if stateful else None,
            [True] * num_seqs if stateful else None,
        )
        embeds = torch.randn(num_seqs, hidden_size, dtype=dtype, device=device)
        positions = torch.full((3, num_seqs), max_model_len - 1, device=device)
        hidden = model(None, positions, meta, embeds)
        _sample(runner, hidden, num_seqs, max_model_len)
        del hidden, embeds
        parts.update()
    peak = meter.peak()
    for layer in runner.attention_layers:
        layer.kv_cache = None
    for state_layer in runner.state_layers:
        state_layer.states = []
    runner.block_size = 0
    return max(0, peak - baseline)


def _sample(runner: ProfiledRunner, hidden: torch.Tensor, rows: int, max_model_len: int) -> None:
    if runner.pooler is not None:  # a pooling model's rows become vectors, no logits
        runner.pooler(hidden, [PoolingParams()] * rows)
        return
    logits = runner.model.compute_logits(hidden)  # as a step hands them to the sampler
    params = [PROFILED_SAMPLING[i % len(PROFILED_SAMPLING)] for i in range(rows)]
    # Half prompt, half output, at full length (one list shared: the sampler only reads it).
    history = TokenHistory([0] * max_model_len, max_model_len // 2)
    runner.sampler(logits, params, [None] * rows, [history] * rows)
