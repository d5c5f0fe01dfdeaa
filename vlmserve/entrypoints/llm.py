"""The offline API, with vLLM's names: LLM(model).generate(prompts) and LLM(model).chat(messages)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from vlmserve.api.beam_search import (
    BeamSearch,
    BeamSearchOutput,
    BeamSearchParams,
    beam_eos_token_id,
    run_beam_search,
)
from vlmserve.engine.config import EngineConfig
from vlmserve.entrypoints.llm_engine import LLMEngine
from vlmserve.lora.request import LoRARequest
from vlmserve.multimodal.image import ImageSizing
from vlmserve.multimodal.inputs import ProcessedPrompt
from vlmserve.multimodal.media import MediaLimits
from vlmserve.multimodal.video import OPTION_KEYS, VideoOptions
from vlmserve.outputs import (
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from vlmserve.pooling import PoolingParams
from vlmserve.processor.base import DEFAULT_LIMIT_MM_PER_PROMPT, ImageInput, VideoInput
from vlmserve.processor.chat import SIZING_KEYS
from vlmserve.processor.truncation import truncate_ids, truncate_prompt, truncation_size
from vlmserve.progress import configure_default_logging
from vlmserve.sampling_params import SamplingParams
from vlmserve.tokenizer import AnyTokenizer

Conversation = list[dict[str, Any]]


class LLM:
    """A model and its engine, in this process.

    `model` is a checkpoint directory or a Hugging Face hub id; None runs the embedded demo
    checkpoint (a small Qwen2-VL trained on synthetic shapes, expanded on first use: see
    docs/demo-model.md).
    """

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        revision: str | None = None,
        dtype: str = "auto",
        device: str = "auto",
        quantization: str | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int | None = None,
        block_size: int = 16,
        memory_budget_gib: float | None = None,
        gpu_memory_utilization: float = 0.9,
        kv_cache_memory_gib: float | None = None,
        limit_mm_per_prompt: dict[str, int] | None = None,
        allowed_local_media_path: str | Path | None = None,
        enable_prefix_caching: bool = True,
        state_save_interval: int = 1024,
        saved_state_slots: int | None = None,
        mm_processor_kwargs: dict[str, int] | None = None,
        generation_config: str = "auto",
        max_logprobs: int = 20,
        grammar_cache_gib: float = 0.5,
        max_grammar_compile_seconds: float = 5.0,
        attention_backend: str = "auto",
        enforce_eager: bool = False,
        tensor_parallel_size: int = 1,
        nnodes: int = 1,
        node_rank: int = 0,
        master_addr: str = "127.0.0.1",
        master_port: int | None = None,
        speculative_config: dict[str, Any] | None = None,
        enable_lora: bool = False,
        max_loras: int = 1,
        max_lora_rank: int = 16,
        max_cpu_loras: int | None = None,
        runner: str = "auto",
        hf_overrides: dict[str, Any] | None = None,
    ) -> None:
        """state_save_interval, saved_state_slots: where a model with recurrent state (Qwen3.5)
        saves it for prefix caching besides message ends and the prompt's last full block (every so
        many tokens; 0: not by interval), and how many saved states are kept (None: max_num_seqs;
        the server's --state-save-interval and --saved-state-slots).
        grammar_cache_gib, max_grammar_compile_seconds: structured outputs' compiled grammars held
        (least recently used evicted) and the CPU seconds one compile may take (the server's
        --grammar-cache-gib and --max-grammar-compile-seconds).
        tensor_parallel_size: the model on that many rank processes (one device each on CUDA);
        with nnodes > 1 the other machines' ranks join by `vlmserve worker` at master_addr:master_port
        (docs/server.md, "Tensor parallelism and many machines").
        speculative_config: vLLM's, {"method": "ngram", "num_speculative_tokens": k,
        "prompt_lookup_min": a, "prompt_lookup_max": b} or {"method": "mtp", "num_speculative_tokens":
        k} (a checkpoint with an MTP head: Qwen3.5's); docs/engine.md, "Speculative decoding".
        enable_lora, max_loras, max_lora_rank, max_cpu_loras: LoRA adapters in PEFT's format, as
        vLLM's (generate and chat take lora_request=LoRARequest(name, id, path)): up to max_loras
        of them in one step, each of rank up to max_lora_rank, max_cpu_loras kept loaded (None:
        max_loras).
        runner, hf_overrides: vLLM's. runner "pooling" serves embed / encode / score instead of
        generate ("auto": so for an embedding checkpoint by its sentence-transformers files, or
        a reranker named by hf_overrides={"classifier_from_token": ["no", "yes"]}, the Qwen3
        rerankers' form); docs/pooling.md."""
        configure_default_logging()
        if model is None:
            from vlmserve.tools.tiny_checkpoint import default_checkpoint_dir

            model = default_checkpoint_dir()
        config = EngineConfig(
            model=str(model),
            revision=revision,
            dtype=dtype,
            device=device,
            quantization=quantization,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            block_size=block_size,
            memory_budget_bytes=None if memory_budget_gib is None else int(memory_budget_gib * (1 << 30)),
            gpu_memory_utilization=gpu_memory_utilization,
            kv_cache_memory_bytes=None if kv_cache_memory_gib is None else int(kv_cache_memory_gib * (1 << 30)),
            mm_processor_kwargs=dict(mm_processor_kwargs or {}),
            limit_mm_per_prompt=limit_mm_per_prompt or dict(DEFAULT_LIMIT_MM_PER_PROMPT),
            enable_prefix_caching=enable_prefix_caching,
            state_save_interval=state_save_interval,
            saved_state_slots=saved_state_slots,
            generation_config=generation_config,
            max_logprobs=max_logprobs,
            grammar_cache_bytes=int(grammar_cache_gib * (1 << 30)),
            max_grammar_compile_seconds=max_grammar_compile_seconds,
            attention_backend=attention_backend,
            enforce_eager=enforce_eager,
            tensor_parallel_size=tensor_parallel_size,
            nnodes=nnodes,
            node_rank=node_rank,
            master_addr=master_addr,
            master_port=master_port,
            speculative_config=speculative_config,
            enable_lora=enable_lora,
            max_loras=max_loras,
            max_lora_rank=max_lora_rank,
            max_cpu_loras=max_cpu_loras,
            runner=runner,
            hf_overrides=dict(hf_overrides or {}),
            media_limits=MediaLimits(
                allowed_local_media_path=Path(allowed_local_media_path) if allowed_local_media_path else None
            ),
        )
        self.llm_engine = LLMEngine(config)
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the tensor-parallel rank processes now (they also stop with this process)."""
        self.llm_engine.shutdown()

    def get_tokenizer(self) -> AnyTokenizer:
        return self.llm_engine.tokenizer

    def tokenize(self, inputs: list[dict[str, Any]]) -> list[int]:
        """The list-of-dicts input with shared-memory handles: [{"text": ...}, {"image": path or
        URL}, {"video": ...}] to the prompt's token ids as the family's chat renders it, each item's
        pixels in shared memory and its segment handle (and grid or shape, a video's seconds) in its first placeholder
        positions. Submit the ids as {"prompt_token_ids": ids} (here or to a server's engine);
        the segments are released when they are read."""
        from vlmserve.api.list_format import tokenize

        return tokenize(self.llm_engine.frontend, inputs)

    def reset_prefix_cache(self) -> None:
        """Forget cached prompt KV and image encodings (as vLLM's LLM.reset_prefix_cache)."""
        self.llm_engine.reset_prefix_cache()

    def get_default_sampling_params(self) -> SamplingParams:
        return self.llm_engine.default_sampling_params()

    # -- generate ---------------------------------------------------------------------------------

    def generate(
        self,
        prompts: str | dict[str, Any] | Sequence[str | dict[str, Any]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """A prompt is a string, {"prompt": str, "multi_modal_data": {"image": ..., "video": ...}}
        (one <|vision_start|><|image_pad|><|vision_end|> per image and
        <|vision_start|><|video_pad|><|vision_end|> per video in the text) or
        {"prompt_token_ids": [...], ...}; "mm_processor_kwargs" set the images' and videos'
        qwen-vl-utils options (min_pixels, max_pixels, fps, nframes, ...) for the prompt.

        "video" is one video or a list of them. A video is a path, URL or bytes of a file, a
        list of frames (PIL images or uint8 [height, width, 3] arrays; frames given by path or
        URL need the list of videos around them: [[frame, ...]]) or a uint8 array
        [frames, height, width, 3].

        lora_request: the LoRA adapter of every prompt, or one per prompt (None: the base model);
        LoRAError (nothing run) where one cannot be served."""
        batch = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        processed: list[ProcessedPrompt] = []
        try:
            loras = _loras_for(lora_request, len(batch))
            params = self._params_for(sampling_params, len(batch))
            for i, (p, sp) in enumerate(zip(batch, params, strict=True)):
                processed.append(self._process_prompt(p, f"prompts[{i}]", sp.truncate_prompt_tokens))
        except BaseException:
            for p in batch[len(processed) :]:  # token handles (LLM.tokenize) no one will read now
                self._release_handles(p)
            raise
        return self._run(processed, params, loras)

    def _truncated(self, prompt: ProcessedPrompt, truncate_prompt_tokens: int | None, where: str) -> ProcessedPrompt:
        """SamplingParams.truncate_prompt_tokens: the last N tokens of the processed prompt."""
        keep = truncation_size(truncate_prompt_tokens, self.llm_engine.max_model_len)
        if keep is None:
            return prompt
        try:
            return truncate_prompt(prompt, keep, "left", self.llm_engine.processor)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None

    def _process_prompt(
        self, prompt: str | dict[str, Any], where: str, truncate_prompt_tokens: int | None = None
    ) -> ProcessedPrompt:
        processor = self.llm_engine.processor
        keep = truncation_size(truncate_prompt_tokens, self.llm_engine.max_model_len)
        if isinstance(prompt, str):
            if keep is not None:  # cut before processing, so a text over max_model_len may be cut to fit
                return processor.process(truncate_ids(self.get_tokenizer().encode(prompt), keep), [])
            return processor.process(prompt, [])
        if not isinstance(prompt, dict):
            raise ValueError(f"{where} must be a string or a dict, got {type(prompt).__name__}")
        unknown = set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data", "mm_processor_kwargs"}
        if unknown:
            raise ValueError(f"{where} has unknown keys {sorted(unknown)}")
        text = prompt.get("prompt_token_ids", prompt.get("prompt"))
        if not isinstance(text, (str, list)) or (isinstance(text, list) and not all(isinstance(t, int) for t in text)):
            raise ValueError(f"{where} needs 'prompt' (a string) or 'prompt_token_ids' (a list of ints)")
        if isinstance(text, list) and any(t >= 1 << 61 for t in text):
            return self._from_token_handles(text, where)
        mm_data = prompt.get("multi_modal_data") or {}
        unsupported = set(mm_data) - {"image", "video"}
        if unsupported:
            raise ValueError(
                f"{where}.multi_modal_data: unsupported modality {sorted(unsupported)}; supported: image, video"
            )
        sources = mm_data.get("image", [])
        sources = sources if isinstance(sources, list) else [sources]
        kwargs = prompt.get("mm_processor_kwargs") or {}
        known = dict.fromkeys((*SIZING_KEYS, *OPTION_KEYS))
        bad = set(kwargs) - set(known)
        if bad:
            raise ValueError(f"{where}.mm_processor_kwargs: unknown keys {sorted(bad)}; supported: {list(known)}")
        sizing = ImageSizing(**{key: value for key, value in kwargs.items() if key in SIZING_KEYS})
        images = [ImageInput(src, sizing, f"{where}.multi_modal_data.image[{k}]") for k, src in enumerate(sources)]
        video_sources = _videos(mm_data["video"]) if "video" in mm_data else []
        options = VideoOptions.from_dict(kwargs, f"{where}.mm_processor_kwargs") if video_sources else VideoOptions()
        videos = [
            VideoInput(src, options, f"{where}.multi_modal_data.video[{k}]") for k, src in enumerate(video_sources)
        ]
        if keep is not None and not images and not videos:
            ids = self.get_tokenizer().encode(text) if isinstance(text, str) else text
            text = truncate_ids(ids, keep)
        try:
            return self._truncated(processor.process(text, images, videos), truncate_prompt_tokens, where)
        except ValueError as e:
            if str(e).startswith(where):  # an item's error, named by its label
                raise
            raise type(e)(f"{where}: {e}") from None

    def _from_token_handles(self, ids: list[int], where: str) -> ProcessedPrompt:
        """Token ids carrying shared-memory handles (LLM.tokenize): pixels read, segments released."""
        from vlmserve.ipc.token_handles import decode

        try:
            ids, items = decode(ids, self.llm_engine.processor)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        if len(ids) >= self.llm_engine.max_model_len:
            raise ValueError(f"{where}: prompt of {len(ids)} tokens leaves no room within max_model_len")
        try:
            return self.llm_engine.processor.from_token_ids(ids, items)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None

    def _release_handles(self, prompt: object) -> None:
        ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
        if isinstance(ids, list) and all(isinstance(t, int) for t in ids):
            from vlmserve.ipc.token_handles import release

            release(ids, self.llm_engine.processor)

    def beam_search(
        self, prompts: str | dict[str, Any] | Sequence[str | dict[str, Any]], params: BeamSearchParams
    ) -> list[BeamSearchOutput]:
        """vLLM's LLM.beam_search: prompts as generate takes them (images and videos too), one
        BeamSearchOutput each, its beam_width best sequences best first. As in vLLM's offline
        API, a sequence's `tokens` and `text` hold the prompt's and the beam's (an ending eos
        included); the rules are vlmserve.api.beam_search's."""
        batch = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        processed = [self._process_prompt(p, f"prompts[{i}]") for i, p in enumerate(batch)]
        engine = self.llm_engine
        eos = beam_eos_token_id(engine.tokenizer, engine.eos_token_ids)
        # vLLM's offline search keeps an ending eos in the tokens (its server: per the flag).
        offline = replace(params, include_stop_str_in_output=True)
        vocab = engine.model_config.text.vocab_size
        searches = [
            BeamSearch(p.prompt_token_ids, offline, eos, vocab, engine.max_model_len, rank_by_score=True)
            for p in processed
        ]
        run_beam_search(searches, processed, engine.processor, lambda ps, sp: list(self._run(ps, [sp] * len(ps))))
        outputs = []
        for search in searches:
            best = search.best()
            for beam in best:
                beam.text = engine.tokenizer.decode(beam.tokens, False)
            outputs.append(BeamSearchOutput(best))
        return outputs

    # -- chat -------------------------------------------------------------------------------------

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or a list of conversations. Content parts may
        be OpenAI-style (text, image_url, video_url) or qwen-vl-utils-style ({"type": "image",
        "image": ...}, {"type": "video", "video": path, URL or [frame, ...], "fps": ...}).
        continue_final_message (with add_generation_prompt=False) leaves the last message open
        for the model to continue, as vLLM's. lora_request: as generate's."""
        conversations = _conversations(messages)
        loras = _loras_for(lora_request, len(conversations))
        params = self._params_for(sampling_params, len(conversations))
        processed = [
            self._truncated(
                self.process_chat(
                    conv, chat_template, add_generation_prompt, chat_template_kwargs, where, continue_final_message
                ),
                p.truncate_prompt_tokens,
                where.rstrip(".") or "messages",
            )
            for (where, conv), p in zip(conversations, params, strict=True)
        ]
        return self._run(processed, params, loras)

    def process_chat(
        self,
        messages: Conversation,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        where: str = "",
        continue_final_message: bool = False,
    ) -> ProcessedPrompt:
        try:
            chat = self.llm_engine.frontend.render_chat(
                messages, add_generation_prompt, chat_template, chat_template_kwargs or {}, continue_final_message
            )
        except ValueError as e:
            raise ValueError(f"{where}{e}") from None
        items: list[ImageInput | VideoInput] = [*chat.images, *chat.videos]
        reused = next((item for item in items if item.source is None), None)
        if reused is not None:
            raise ValueError(
                f"{where}{reused.label}: uuid {reused.uuid!r} without media; the offline LLM keeps no media "
                "cache (a server reuses media by uuid)"
            )
        images = [ImageInput(i.source, i.sizing, where + i.label) for i in chat.images]
        videos = [VideoInput(v.source, v.options, where + v.label) for v in chat.videos]
        return self.llm_engine.processor.process(chat.prompt, images, videos)

    # -- pooling models ---------------------------------------------------------------------------

    def encode(
        self,
        prompts: object,
        pooling_params: PoolingParams | None = None,
        *,
        instruction: str | None = None,
        truncate_prompt_tokens: int | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[PoolingRequestOutput]:
        """A pooling model's vector for each input (vLLM's LLM.encode): embed's inputs, the
        tensors as the pooler made them (float32)."""
        from vlmserve.entrypoints import llm_pooling as pooling

        pooling.pooler_of(self)
        items = pooling.embedding_inputs(prompts)
        loras = _loras_for(lora_request, len(items))
        processed = [
            pooling.process_embedding_input(self, item, f"prompts[{i}]", instruction, truncate_prompt_tokens)
            for i, item in enumerate(items)
        ]
        return pooling.run_pooling(self, processed, pooling_params or PoolingParams(), loras)

    def embed(
        self,
        prompts: object,
        pooling_params: PoolingParams | None = None,
        *,
        instruction: str | None = None,
        truncate_prompt_tokens: int | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """Embeddings (vLLM's LLM.embed). An input is a string or vLLM's prompt dict, embedded as
        it is; or the official scripts' object {"text": ..., "image": ..., "video": ...,
        "instruction": ...} or a conversation (a list of messages), rendered with the chat template
        and its generation prompt (the object as Qwen3-VL-Embedding's script builds it: the
        instruction, default "Represent the user's input.", in a system message). instruction: the
        objects' default. pooling_params: dimensions (Matryoshka), normalize."""
        params = pooling_params or PoolingParams(task="embed")
        outputs = self.encode(
            prompts,
            params,
            instruction=instruction,
            truncate_prompt_tokens=truncate_prompt_tokens,
            lora_request=lora_request,
        )
        return [EmbeddingRequestOutput.from_base(output) for output in outputs]

    def score(
        self,
        data_1: object,
        data_2: object,
        *,
        instruction: str | None = None,
        truncate_prompt_tokens: int | None = None,
        lora_request: LoRARequest | None = None,
    ) -> list[ScoringRequestOutput]:
        """vLLM's LLM.score: one query against each document (data_1 one, data_2 a list), or the
        lists pairwise. A reranker (Qwen3-VL-Reranker: hf_overrides={"classifier_from_token": ["no",
        "yes"]}) scores each pair in its yes/no conversation (instruction: its task, default "Given
        a search query, retrieve relevant candidates that answer the query."); an embedding model
        gives the cosine similarity of the two embeddings (each input as embed takes it). A query
        or document is a string, the official object, or a list of content parts (vLLM's
        {"content": [...]} too), images and videos as chat() takes them."""
        from vlmserve.entrypoints import llm_pooling as pooling

        pooler = pooling.pooler_of(self)
        pairs = pooling.score_pairs(data_1, data_2)
        if pooler.task == "score":
            processed = [pooling.process_score_pair(self, a, b, (wa, wb), instruction) for (wa, a), (wb, b) in pairs]
            outputs = pooling.run_pooling(self, processed, PoolingParams(task="score"), [lora_request] * len(processed))
            return [
                ScoringRequestOutput(o.request_id, ScoringOutput(float(o.outputs.data[0])), o.prompt_token_ids)
                for o in outputs
            ]
        inputs = dict(side for pair in pairs for side in pair)  # each distinct input once, by its label
        by_label = {
            where: pooling.process_embedding_input(self, item, where, instruction, truncate_prompt_tokens)
            for where, item in inputs.items()
        }
        prompts = list(by_label.values())
        vectors = pooling.run_pooling(self, prompts, PoolingParams(task="embed"), [lora_request] * len(prompts))
        return pooling.cosine_scores(pairs, dict(zip(by_label, vectors, strict=True)), by_label)

    # -- running ----------------------------------------------------------------------------------

    def _params_for(
        self, sampling_params: SamplingParams | Sequence[SamplingParams] | None, count: int
    ) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.get_default_sampling_params()] * count
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        params = list(sampling_params)
        if len(params) != count:
            raise ValueError(f"got {len(params)} sampling_params for {count} prompts; give one, or one per prompt")
        return params

    def _run(
        self,
        prompts: list[ProcessedPrompt],
        params: list[SamplingParams],
        loras: Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        engine = self.llm_engine
        loras = list(loras) if loras is not None else [None] * len(prompts)
        for adapter in dict.fromkeys(lora for lora in loras if lora is not None):
            engine.add_lora(adapter)  # every adapter checked before any request runs
        ids = [str(next(self._ids)) for _ in prompts]
        added: list[str] = []
        finals: dict[str, RequestOutput] = {}
        try:
            for request_id, prompt, p, lora in zip(ids, prompts, params, loras, strict=True):
                engine.add_request(request_id, prompt, p, lora)
                added.append(request_id)
            while len(finals) < len(ids):
                for output in engine.step():
                    if output.finished:
                        finals[output.request_id] = output
        except BaseException:
            # Leave the engine as it was: nothing of this call may linger in it.
            for request_id in added:
                if request_id not in finals:
                    engine.abort_request(request_id)
            raise
        return [finals[request_id] for request_id in ids]

    def stream(self, prompt: ProcessedPrompt, params: SamplingParams) -> Iterator[RequestOutput]:
        """Yield the request's output after every step that changed it (cumulative text)."""
        engine = self.llm_engine
        request_id = str(next(self._ids))
        engine.add_request(request_id, prompt, params)
        try:
            while True:
                for output in engine.step():
                    if output.request_id == request_id:
                        yield output
                        if output.finished:
                            return
        finally:
            engine.abort_request(request_id)


def _loras_for(lora_request: LoRARequest | Sequence[LoRARequest | None] | None, count: int) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * count
    loras = list(lora_request)
    if len(loras) != count:
        raise ValueError(f"got {len(loras)} lora_request for {count} prompts; give one, or one per prompt")
    return loras


def _conversations(messages: Conversation | Sequence[Conversation]) -> list[tuple[str, Conversation]]:
    if isinstance(messages, list) and messages and all(isinstance(m, list) for m in messages):
        return [(f"conversations[{i}].", conv) for i, conv in enumerate(messages)]
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of messages or of conversations")
    return [("", messages)]  # type: ignore[list-item]


def _videos(data: object) -> list[object]:
    """multi_modal_data["video"] as a list of videos. A list whose items are all frames (PIL images
    or [height, width, 3] arrays) is one video, as vLLM reads it; any other list is one video per
    item; anything else is one video."""
    if isinstance(data, tuple):
        data = list(data)
    if not isinstance(data, list) or not data:
        return [data] if not isinstance(data, list) else []
    if all(isinstance(x, Image.Image) or (isinstance(x, np.ndarray) and x.ndim == 3) for x in data):
        return [data]
    return data
