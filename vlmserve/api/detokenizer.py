"""Incremental detokenization with stop strings.

`tokenizers`' DecodeStream emits text only once a token completes a UTF-8 character, so a
stream never shows half of a multi-byte character. While stop strings are set, the last
len(longest stop) - 1 characters are held back from the stream: they might be the start of a
stop string that the next token completes.

As in vLLM, the token that stopped a request (eos or one of stop_token_ids) is not part of the
text unless include_stop_str_in_output: with skip_special_tokens=False (needed to see Qwen2-VL's
<|box_start|> grounding tokens) an answer does not end in "<|im_end|>".
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from vlmserve.sampling_params import SamplingParams
from vlmserve.tokenizer import AnyTokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: AnyTokenizer, params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        self.stop_strings = params.stop_strings
        self.include_stop = params.include_stop_str_in_output
        # As vLLM: stop strings are looked for once the output is longer than min_tokens, in the
        # text from then on (a stop string may still start in the text before).
        self.min_tokens = params.min_tokens
        self.holdback = 0 if self.include_stop or not self.stop_strings else max(map(len, self.stop_strings)) - 1
        self.token_ids: list[int] = []
        self.text = ""
        self.stopped_by: str | None = None

    def update(self, new_token_ids: list[int], finished: bool, stop_terminated: bool = False) -> str | None:
        """Add tokens; returns the stop string if one now appears in the text (the text is then
        cut before it, or after it with include_stop_str_in_output). stop_terminated: the last
        token is the stop token that finished the request."""
        if stop_terminated and not self.include_stop and new_token_ids:
            new_token_ids = new_token_ids[:-1]
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            piece = self.stream.step(self.tokenizer.backend, token_id)
            if not piece:
                continue
            before = len(self.text)
            self.text += piece
            if self.stop_strings and len(self.token_ids) > self.min_tokens and self._check_stop(before):
                return self.stopped_by
        if finished:
            # Bytes that never completed a character decode as U+FFFD, exactly as a full decode.
            full = self.tokenizer.decode(self.token_ids, skip_special_tokens=self.skip_special_tokens)
            if full.startswith(self.text):
                self.text = full
        return None

    def _check_stop(self, new_from: int) -> bool:
        best: tuple[int, str] | None = None
        for stop in self.stop_strings:
            index = self.text.find(stop, max(0, new_from - len(stop) + 1))
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return False
        index, stop = best
        self.text = self.text[: index + len(stop)] if self.include_stop else self.text[:index]
        self.stopped_by = stop
        return True

    def visible_text(self, finished: bool) -> str:
        """The text a stream may show now."""
        if finished or self.holdback == 0:
            return self.text
        return self.text[: max(0, len(self.text) - self.holdback)]
