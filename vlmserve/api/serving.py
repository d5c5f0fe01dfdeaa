"""What the two endpoints' serving share: the context they run in (front end, engine client,
metrics, fetch policy, served name, the cap on n), and one engine request's outputs, counted in
the metrics by outcome, with the engine's refusal (400), its error while computing the request
(500, the details in the log only) and its death (503) as API errors."""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from contextlib import aclosing
from contextvars import ContextVar
from dataclasses import dataclass, field

from vlmserve.api.beam_search import BeamSearchParams
from vlmserve.api.dp_client import DataParallelClient
from vlmserve.api.engine_client import RequestFailedInEngine, RequestRefused, request_lora
from vlmserve.api.engine_supervisor import EngineDeadError
from vlmserve.api.fetch import FetchPolicy
from vlmserve.api.frontend import Frontend
from vlmserve.api.media_cache import MediaUUIDCache
from vlmserve.api.metrics import Metrics
from vlmserve.api.protocol import APIError, _SamplingFields, check_text
from vlmserve.api.serving_beam import beam_search, beam_search_params
from vlmserve.api.serving_models import ServingModels
from vlmserve.lora.request import LoRARequest
from vlmserve.multimodal.inputs import ProcessedPrompt
from vlmserve.outputs import RequestOutput
from vlmserve.sampling_params import SamplingParams

logger = logging.getLogger("vlmserve.api")
MAX_NAME_SHOWN = 256  # characters of an unknown model name an error echoes

# When the request being served arrived at its endpoint (time.monotonic()), set by the endpoint
# before it fetches and processes the prompt's media: its metrics' TTFT and e2e latency run from
# it, as vLLM's from arrival. NOTE: a context variable, not an argument, so that the endpoints'
# signatures stay as they are; each request runs in its own task (and its tasks copy it).
request_arrival: ContextVar[float | None] = ContextVar("request_arrival", default=None)


@dataclass
class ServingContext:
    frontend: Frontend
    client: DataParallelClient
    metrics: Metrics
    fetch_policy: FetchPolicy
    model_name: str  # the name responses carry
    max_n: int = 8
    # The bytes of a request's structured-output spec (--max-grammar-bytes), checked here: a large
    # spec costs the engine its compile time and memory.
    max_grammar_bytes: int = 128 * 1024
    # What one request may make the engine run (PromptBuilder._check_cost): sequences at once
    # (--max-seqs-per-request) and prompt tokens scored for prompt_logprobs (--max-prompt-logprobs-tokens).
    max_seqs_per_request: int = 32
    max_prompt_logprobs_tokens: int = 8192
    # Every name a request's `model` may give (model_name among them); empty: model_name alone.
    served_model_names: tuple[str, ...] = ()
    # What /v1/models shows as `root`: the model as the server was given it (vLLM's).
    model_root: str = ""
    # The chat template requests are rendered in instead of the model's (--chat-template), and
    # whether a request may bring its own (--trust-request-chat-template; vLLM's flags).
    chat_template: str | None = None
    trust_request_chat_template: bool = False
    # vLLM's --reasoning-parser, --tool-call-parser and --enable-auto-tool-choice.
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    # The Responses API's store (response_store.py): the most recent responses kept, and their bytes.
    responses_store_max_entries: int = 1024
    responses_store_max_bytes: int = 256 << 20
    # The LoRA adapters a request's `model` may name besides (--lora-modules, /v1/load_lora_adapter).
    models: ServingModels = field(default_factory=lambda: ServingModels(None, ()))
    # Media sent with a uuid, reusable by it (vLLM's media uuids).
    media_uuids: MediaUUIDCache = field(default_factory=MediaUUIDCache)
    # What /v1/models tells a client the model can be asked (the chat page's empty conversation):
    # a line about the model, if there is one to say, and example questions.
    about: str | None = None
    example_questions: tuple[str, ...] = (
        "Describe this picture.",
        "What does the text in the picture say?",
        "Locate every object in the picture and give its bounding box.",
    )

    def check_model(self, name: str | None) -> LoRARequest | None:
        """A request names a served model or none (the served one, as in vLLM): None; or an
        adapter: the one it runs with. Any other name is a 404 in vLLM's words, the name shown
        truncated."""
        if name is None or name in (self.served_model_names or (self.model_name,)):
            return None
        lora = self.models.get(name)
        if lora is not None:
            return lora
        check_text(name, "model")  # echoed below: it must encode
        shown = name if len(name) <= MAX_NAME_SHOWN else name[:MAX_NAME_SHOWN] + "..."
        raise APIError(404, f"The model `{shown}` does not exist.", "model", "model_not_found", "NotFoundError")

    def response_model(self) -> str:
        """The name a response carries: the adapter's the request runs with, else the served
        model's (vLLM's)."""
        lora = request_lora.get()
        return self.model_name if lora is None else lora.lora_name


def engine_error(e: RequestRefused | RequestFailedInEngine | EngineDeadError, request_id: str) -> tuple[str, APIError]:
    """What an engine client's failure of a request is: its outcome for the requests metric and
    the HTTP error its client gets (the request's fault: 400; the engine's: 500, logged; no
    engine: 503)."""
    if isinstance(e, RequestRefused):
        return "error", APIError(400, str(e))
    if isinstance(e, RequestFailedInEngine):
        logger.error("request %s failed in the engine: %s", request_id, e)
        message = f"internal error while computing this request ({request_id})"
        return "error", APIError(500, message, code="internal_error")
    return "engine_down", APIError(503, str(e), code="engine_unavailable")


class EngineServing:
    """The base of an endpoint's serving: its context, the model's grounding convention (for the
    `vlmserve` extension), and engine requests run to their outputs."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx
        self.grounding_convention: str | None = ctx.frontend.family.grounding_convention

    def _beam(self, body: _SamplingFields, params: SamplingParams) -> BeamSearchParams | None:
        """The beam search a request asks for (use_beam_search), or None."""
        if not body.use_beam_search:
            return None
        return beam_search_params(params, body.length_penalty, self.ctx.frontend.max_model_len)

    async def _outputs(
        self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams, beam: BeamSearchParams | None = None
    ) -> AsyncGenerator[RequestOutput, None]:
        metrics = self.ctx.metrics  # vLLM's series are recorded by the engine client (request_stats.py)
        metrics.in_flight.inc()
        outcome = "aborted"
        arrival = request_arrival.get()
        try:
            source = (
                self.ctx.client.generate(request_id, prompt, params, arrival)
                if beam is None
                else beam_search(self.ctx.client, self.ctx.frontend, request_id, prompt, beam, params)
            )
            async with aclosing(source) as outputs:
                async for output in outputs:
                    if output.finished:
                        outcome = "success"
                        metrics.prompt_tokens.inc(len(output.prompt_token_ids))
                        metrics.image_tokens.inc(sum(output.num_image_tokens))
                        metrics.generation_tokens.inc(sum(len(o.token_ids) for o in output.outputs))
                    yield output
        except (RequestRefused, RequestFailedInEngine, EngineDeadError) as e:
            outcome, error = engine_error(e, request_id)
            raise error from None
        finally:
            metrics.in_flight.dec()
            metrics.requests.labels(outcome).inc()

    async def _last(
        self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams, beam: BeamSearchParams | None = None
    ) -> RequestOutput:
        final = None
        async for output in self._outputs(request_id, prompt, params, beam):
            final = output
        assert final is not None
        return final
