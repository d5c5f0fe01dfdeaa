"""A request body becomes what the engine takes: processed prompts and sampling params. Text is
checked (valid Unicode, no NUL), max_tokens and the number of prompts bounded, chat messages
rendered; media is fetched through the guarded fetcher (the counts checked before anything is
fetched). Rendering, tokenizing and processing run in a worker thread, and a text prompt that
cannot fit max_model_len is refused by its length before any of it is tokenized. Every problem
is a 400 naming the parameter: an exception other than ValueError raised while a request is
rendered or processed (TypeError, KeyError, OverflowError... from a value of the wrong type that
no check caught) is a 400 too, with a message that names the parameter and echoes nothing of it."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from vlmserve.api.fetch import FetchError, FetchPolicy, fetch
from vlmserve.api.protocol import APIError, ChatCompletionRequest, CompletionRequest, _SamplingFields, check_text
from vlmserve.api.serving import ServingContext
from vlmserve.api.tool_calling import template_messages
from vlmserve.multimodal.inputs import ProcessedPrompt
from vlmserve.multimodal.media import MediaError
from vlmserve.processor.base import ImageInput, VideoInput
from vlmserve.processor.media_options import MediaDefaults, apply_media_defaults, media_defaults
from vlmserve.processor.truncation import TruncationSide, truncate_ids, truncate_prompt, truncation_size
from vlmserve.sampling_params import SamplingParams
from vlmserve.tokenizer import AnyTokenizer

logger = logging.getLogger(__name__)

T = TypeVar("T")
Truncation = tuple[int, TruncationSide]  # (tokens kept, side)

# What a request's values can raise in rendering or processing when a check missed them: a 400,
# never a 500. (ValueError and MediaError carry messages written for the user.)
_INPUT_ERRORS = (TypeError, LookupError, AttributeError, ArithmeticError, RecursionError)

# Characters a prompt may have per token it can need, at most: the tokenizers are NFC-normalising
# byte-level BPEs, so a token covers at most its own length in bytes (the longest vocabulary
# entry, _longest_token), and NFC at most shrinks a text to 1/1.5 of its characters per UTF-8
# byte (the longest canonical decomposition per byte of the composed character is 1.5 code
# points, e.g. U+01D5: 2 bytes, 3 code points). 2 is that 1.5 with room to spare: a text longer
# than max_model_len * longest token * 2 characters cannot fit, whatever it holds.
_CHARS_PER_TOKEN_BYTE = 2


def _longest_token(tokenizer: AnyTokenizer) -> int:
    """The longest vocabulary entry, in characters of its byte-level form (= its bytes), special
    tokens included."""
    return max(len(token) for token in tokenizer.backend.get_vocab())


def _walk_text(value: Any, param: str) -> None:
    if isinstance(value, str):
        check_text(value, param)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _walk_text(v, f"{param}[{i}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            _walk_text(v, f"{param}.{k}")


class PromptBuilder:
    """Each endpoint's request body as (processed prompt(s), sampling params)."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx
        self.frontend = ctx.frontend
        self.max_prompt_chars = (
            self.frontend.max_model_len * _longest_token(self.frontend.tokenizer) * _CHARS_PER_TOKEN_BYTE
        )

    async def chat(self, body: ChatCompletionRequest) -> tuple[ProcessedPrompt, SamplingParams]:
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        problem = self.frontend.logprobs_problem(logprobs)
        if problem:
            raise APIError(400, f"top_logprobs {problem}", "top_logprobs")
        max_tokens = self._max_tokens(body.max_completion_tokens or body.max_tokens)
        params = self._resolve(
            body.sampling_params(
                self.frontend.default_sampling_params(),
                max_tokens,
                logprobs,
                self.ctx.max_n,
                max_grammar_bytes=self.ctx.max_grammar_bytes,
                tool_call_parser=self.ctx.tool_call_parser,
                reasoning_parser=self.ctx.reasoning_parser,
            )
        )
        try:
            messages = template_messages(body.messages)
        except ValueError as e:
            raise APIError(400, str(e), "messages") from None
        media, truncation = self._request_options(body)
        prompt = await self.chat_prompt(
            messages,
            body.add_generation_prompt,
            body.template_kwargs(),
            continue_final_message=body.continue_final_message,
            media=media,
            truncation=truncation,
            chat_template=self.chat_template(body.chat_template),
        )
        self._check_cost([prompt], params)
        return prompt, params

    def chat_template(self, requested: str | None) -> str | None:
        """The template a chat request is rendered in: its own `chat_template` where the server
        trusts requests with one (a 400 naming the flag otherwise, as vLLM), else the server's
        --chat-template, else (None) the model's."""
        if requested is None:
            return self.ctx.chat_template
        if not self.ctx.trust_request_chat_template:
            raise APIError(
                400,
                "chat_template: this server renders no chat template a request brings (a template runs code on "
                "the server); start it with --trust-request-chat-template to allow them, or give the server one "
                "with --chat-template",
                "chat_template",
            )
        return check_text(requested, "chat_template")

    def _check_cost(self, prompts: list[ProcessedPrompt], params: SamplingParams) -> None:
        """What one request may make the engine do, counted in its own units, not as one HTTP
        request: sequences at once (prompts x n; beams: prompts x n too) within
        --max-seqs-per-request, and prompt rows scored over the whole vocabulary (prompt_logprobs:
        every prompt token, for each of the n samples) within --max-prompt-logprobs-tokens. A 400
        naming both numbers and the flag, before anything reaches the engine."""
        ctx = self.ctx
        sequences = len(prompts) * params.n
        if sequences > ctx.max_seqs_per_request:
            shape = f"{len(prompts)} prompt(s) x n {params.n}"
            raise APIError(
                400,
                f"this request asks for {sequences} sequences at once ({shape}), more than the "
                f"{ctx.max_seqs_per_request} one request may run (--max-seqs-per-request), so that other "
                "requests keep room: send fewer prompts or a smaller n",
                "n" if len(prompts) == 1 else "prompt",
            )
        if params.prompt_logprobs is not None:
            rows = sum(len(p.prompt_token_ids) for p in prompts) * params.n
            if rows > ctx.max_prompt_logprobs_tokens:
                raise APIError(
                    400,
                    f"prompt_logprobs would score {rows} prompt tokens (every prompt token, for each sample), "
                    f"more than the {ctx.max_prompt_logprobs_tokens} allowed (--max-prompt-logprobs-tokens)",
                    "prompt_logprobs",
                )

    async def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        chat_template_kwargs: dict[str, Any] | None,
        continue_final_message: bool = False,
        media: MediaDefaults | None = None,
        truncation: Truncation | None = None,
        chat_template: str | None = None,
    ) -> ProcessedPrompt:
        """Messages rendered (in `chat_template`; None: the model's), their media fetched, and
        processed: the prompt the engine gets."""
        _walk_text(messages, "messages")
        _walk_text(chat_template_kwargs or {}, "chat_template_kwargs")
        self._check_last_message_length(messages)
        # Rendering tokenizes too (Qwen-VL-Chat's chat format): off the event loop.
        try:
            chat = await self._in_thread(
                "messages",
                self.frontend.render_chat,
                messages,
                add_generation_prompt,
                chat_template=chat_template,
                chat_template_kwargs=chat_template_kwargs,
                continue_final_message=continue_final_message,
            )
        except APIError as e:
            if e.message.startswith("tools:"):  # the template takes no tools
                e.param = "tools"
            elif e.message.startswith("continue_final_message"):
                e.param = "continue_final_message"
            elif e.message.startswith("the chat template does not parse"):
                e.param = "chat_template"
            raise
        if isinstance(chat.prompt, str):
            self._check_length(chat.prompt, "messages")
        images, videos = await self._fetch_media(chat.images, chat.videos)
        if media:
            images, videos = await self._in_thread("messages", apply_media_defaults, media, images, videos)
        return await self._process(chat.prompt, images, "messages", videos, truncation)

    def _request_options(self, body: _SamplingFields) -> tuple[MediaDefaults, Truncation | None]:
        """The request's media options and truncation, checked (400s naming the field)."""
        media = self.media_options(body.mm_processor_kwargs, body.media_io_kwargs)
        try:
            keep = truncation_size(body.truncate_prompt_tokens, self.frontend.max_model_len)
        except ValueError as e:
            raise APIError(400, str(e), "truncate_prompt_tokens") from None
        return media, None if keep is None else (keep, body.truncation_side or "left")

    @staticmethod
    def media_options(mm_processor_kwargs: object, media_io_kwargs: object) -> MediaDefaults:
        """vLLM's per-request media options, checked (a 400 naming the field)."""
        try:
            return media_defaults(mm_processor_kwargs, media_io_kwargs)
        except ValueError as e:
            message = str(e)
            param = "media_io_kwargs" if message.startswith("media_io_kwargs") else "mm_processor_kwargs"
            raise APIError(400, message, param) from None

    async def encode(self, text: str) -> list[int]:
        """A text's token ids as the tokenizer gives them (/tokenize), checked as a prompt is."""
        check_text(text, "prompt")
        self._check_length(text, "prompt")
        return await self._in_thread("prompt", self.frontend.tokenizer.encode, text)

    async def completion(self, body: CompletionRequest) -> tuple[list[ProcessedPrompt], SamplingParams]:
        params = self._resolve(
            body.sampling_params(
                self.frontend.default_sampling_params(),
                self._max_tokens(body.max_tokens),
                body.logprobs,
                self.ctx.max_n,
                # vLLM's: echo with logprobs scores the prompt's tokens too.
                body.logprobs if body.echo and body.prompt_logprobs is None else None,
                max_grammar_bytes=self.ctx.max_grammar_bytes,
            )
        )
        media, truncation = self._request_options(body)
        raw = body.prompt
        if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
            batch: list[str | list[int]] = [raw]  # type: ignore[list-item]
        else:
            batch = list(raw)  # type: ignore[arg-type]
        if len(batch) > self.ctx.max_n:
            raise APIError(400, f"at most {self.ctx.max_n} prompts per request", "prompt")
        prompts = []
        for i, p in enumerate(batch):
            param = "prompt" if len(batch) == 1 else f"prompt[{i}]"
            if isinstance(p, str):
                check_text(p, param)
                self._check_length(p, param)
            images: list[ImageInput] = []
            # A family whose prompts name their images (inside the token ids): fetched here
            # through the guard, never by the processor. Finding them may tokenize: in a thread.
            p, urls = await self._in_thread(param, self.frontend.processor.prompt_images, p)
            if urls:
                images = [ImageInput(url, label=f"{param} (image {k + 1})") for k, url in enumerate(urls)]
                images, _ = await self._fetch_media(images, [])
                images, _ = apply_media_defaults(media, images, [])
            prompts.append(await self._process(p, images, param, None, truncation))  # the processor checks token ids
        self._check_cost(prompts, params)
        return prompts, params

    def _check_length(self, text: str, param: str) -> None:
        """Refuse a text that needs more tokens than max_model_len whatever it holds, before
        anything tokenizes it (see _CHARS_PER_TOKEN_BYTE)."""
        self._check_length_of(len(text), param)

    def _check_last_message_length(self, messages: list[dict[str, Any]]) -> None:
        """The last message's text is in every prompt rendered (the query Qwen-VL-Chat always
        keeps, a template's last turn), stripped at most: too long, refused before rendering,
        which may tokenize."""
        content = messages[-1].get("content") if isinstance(messages[-1], dict) else None
        parts = [content] if isinstance(content, str) else content if isinstance(content, list) else []
        texts = [part.get("text") if isinstance(part, dict) else part for part in parts]
        self._check_length_of(sum(len(text.strip()) for text in texts if isinstance(text, str)), "messages")

    def _check_length_of(self, length: int, param: str) -> None:
        if length > self.max_prompt_chars:
            raise APIError(
                400,
                f"{param} is {length} characters long, more than a prompt of max_model_len="
                f"{self.frontend.max_model_len} tokens can hold (at most {self.max_prompt_chars} characters)",
                param,
            )

    async def _in_thread(self, param: str, work: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`work` in a worker thread (tokenizing and decoding are CPU work), its errors as 400s
        naming `param`."""
        try:
            return await asyncio.to_thread(work, *args, **kwargs)
        except (MediaError, ValueError) as e:
            raise APIError(400, str(e), param) from None
        except _INPUT_ERRORS as e:
            # A value of the wrong type or out of range that no check caught: the request's fault,
            # said without echoing Python's message (it can name internals); logged for a fix.
            logger.warning("%s: unchecked %s while building the prompt", param, type(e).__name__, exc_info=True)
            raise APIError(
                400, f"{param}: a value has the wrong type or is out of range and could not be used", param
            ) from None

    def _max_tokens(self, requested: int | None) -> int | None:
        """The request's max_tokens, capped by the generation config's max_new_tokens (as vLLM)."""
        limit = self.frontend.max_model_len - 1
        if requested is not None and requested > limit:
            raise APIError(400, f"max_tokens must be at most {limit} (max_model_len - 1)", "max_tokens")
        cap = self.frontend.sampling_defaults.get("max_tokens")
        return cap if requested is None else requested if cap is None else min(requested, cap)

    def _resolve(self, params: SamplingParams) -> SamplingParams:
        """Bad words as token ids, logit_bias checked against the vocabulary (tokenizes: a few
        short words at most, MAX_BAD_WORDS of MAX_STOP_LENGTH characters)."""
        try:
            return self.frontend.resolve_params(params)
        except ValueError as e:
            message = str(e)
            raise APIError(400, message, message.split(" ", 1)[0]) from None

    async def _fetch_media(
        self, images: list[ImageInput], videos: list[VideoInput]
    ) -> tuple[list[ImageInput], list[VideoInput]]:
        """http(s) sources downloaded through the guarded fetcher (a video's frames one by one);
        counts checked first so that no request makes the server fetch more than it may use."""
        limits = self.frontend.processor.max_items_per_prompt()
        for kind, given in (("image", images), ("video", videos)):
            if len(given) > limits.get(kind, 0):
                raise APIError(
                    400, f"too many {kind}s: {len(given)} given, at most {limits.get(kind, 0)} per request", "messages"
                )
        video_policy = dataclasses.replace(
            self.ctx.fetch_policy, max_bytes=self.frontend.processor.media_limits.max_video_bytes
        )
        fetched_images = []
        for image in images:
            if image.source is None:
                source = self._cached("image", image.uuid, image.label)
            else:
                source = await self._fetched(image.source, self.ctx.fetch_policy, image.label)
                self._keep("image", image.uuid, source)
            fetched_images.append(ImageInput(source, image.sizing, image.label))
        fetched_videos = []
        for video in videos:
            source = video.source
            if source is None:
                source = self._cached("video", video.uuid, video.label)
            elif isinstance(source, list):
                source = [
                    await self._fetched(frame, self.ctx.fetch_policy, f"{video.label} frame {k}")
                    for k, frame in enumerate(source)
                ]
                self._keep("video", video.uuid, source)
            else:
                source = await self._fetched(source, video_policy, video.label)
                self._keep("video", video.uuid, source)
            fetched_videos.append(VideoInput(source, video.options, video.label))
        return fetched_images, fetched_videos

    def _cached(self, modality: str, uuid: str | None, label: str) -> object:
        """The media last sent under `uuid` (a part that names it and gives none)."""
        source = None if uuid is None else self.ctx.media_uuids.get(modality, uuid)
        if source is None:
            raise APIError(
                400,
                f"{label}: no {modality} is cached under uuid {uuid!r}: send the {modality} with its uuid first "
                "(the cache keeps the most recently used media, up to a bound)",
                "messages",
            )
        return source

    def _keep(self, modality: str, uuid: str | None, source: object) -> None:
        if uuid is not None:
            self.ctx.media_uuids.put(modality, uuid, source)

    async def _fetched(self, source: object, policy: FetchPolicy, label: str) -> object:
        """The bytes behind an http(s) URL; any other source as it is (the processor reads it)."""
        if not (isinstance(source, str) and source[:8].lower().startswith(("http://", "https://"))):
            return source
        try:
            return await fetch(source, policy, label)
        except FetchError as e:
            raise APIError(400, str(e), "messages", e.code) from None

    async def _process(
        self,
        prompt: str | list[int],
        images: list[ImageInput],
        param: str,
        videos: list[VideoInput] | None = None,
        truncation: Truncation | None = None,
    ) -> ProcessedPrompt:
        # Tokenizing, decoding and resizing images and video frames: off the event loop.
        processor = self.frontend.processor
        if truncation is None:
            return await self._in_thread(param, processor.process, prompt, images, videos or [])
        keep, side = truncation
        if not images and not videos:  # cut before processing: a text over max_model_len may be cut to fit
            if isinstance(prompt, str):
                ids = await self._in_thread(param, self.frontend.tokenizer.encode, prompt)
            else:
                ids = prompt
            return await self._in_thread(param, processor.process, truncate_ids(ids, keep, side), [], [])
        # With media the placeholders are expanded first: the cut counts the tokens the engine sees.
        processed = await self._in_thread(param, processor.process, prompt, images, videos or [])
        return await self._in_thread("truncate_prompt_tokens", truncate_prompt, processed, keep, side, processor)
