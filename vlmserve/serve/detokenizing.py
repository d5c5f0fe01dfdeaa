"""The API process's detokenizing: each request's n samples are registered with an
OutputProcessor (their child ids are what the engine schedules), and the engine's token updates,
as they come off the wire, become cumulative RequestOutputs (text decoded incrementally, stop
strings applied, the samples of a request gathered into one output)."""

from __future__ import annotations

from vlmserve.engine.output_processor import OutputProcessor
from vlmserve.multimodal.inputs import ProcessedPrompt
from vlmserve.outputs import MultiModalItemInfo, RequestOutput
from vlmserve.sampling_params import SamplingParams
from vlmserve.serve.messages import StepOutputs
from vlmserve.tokenizer import AnyTokenizer


class Detokenizer:
    def __init__(self, tokenizer: AnyTokenizer) -> None:
        self.output_processor = OutputProcessor(tokenizer)

    def add(self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams) -> list[str]:
        """Register a request; returns the ids the engine knows its samples by."""
        return self.output_processor.add_request(
            request_id,
            prompt.prompt,
            prompt.prompt_token_ids,
            params,
            [MultiModalItemInfo.from_item(item) for item in prompt.mm_items],
        )

    def step(self, message: StepOutputs) -> tuple[list[RequestOutput], list[str]]:
        """The outputs this step changed, and the child ids a stop string ended (for the engine
        to drop)."""
        return self.output_processor.process(message.outputs)

    def abort(self, request_id: str) -> list[str]:
        """Forget a request (its unfinished samples aborted); returns the child ids the engine may
        still be running."""
        _, child_ids = self.output_processor.abort(request_id)
        return child_ids
