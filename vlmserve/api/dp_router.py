"""Which of the data-parallel engines (`vlmserve serve --data-parallel-size N`) a request goes to.

Load: the engine requests (one per sample: a request with n=4 counts 4) each engine has in
flight, counted here as requests are sent and as they end, so it is exact at every decision
(vLLM's DP load balancer reads the engines' waiting and running counts from periodic stats and
adds its own sends in between). The least loaded engine that is up gets the request; among equals
the turn rotates, so that requests sent one at a time alternate too.

Affinity: each engine has its own prefix cache and encoder cache, so a request that repeats an
earlier one's image, or a long prefix of its tokens, is cheaper on the engine that served that
one. A request is keyed by its first image's content hash (the most specific key) and by hashes
of its token prefixes at doubling lengths (64, 128, 256, ... tokens before its first image, salt
included); the most specific key recently sent to an engine that is up takes it there, unless
that engine has more
than `affinity_slack` engine requests more in flight than the least loaded one. Short prompts
(under MIN_PREFIX_TOKENS, a chat template's preamble) have no text key: they only balance load.

No process, socket or clock here: the engine client asks `choose` with which engines are up,
and reports what it sent (`add`) and what ended (`remove`).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from vlmserve.multimodal.inputs import ProcessedPrompt

MIN_PREFIX_TOKENS = 64
MAX_KEYS = 4096


def affinity_keys(prompt: ProcessedPrompt) -> list[bytes]:
    """The prompt's keys, most specific first: its first image's (or video's) content hash, then
    its token prefixes from the longest. Hashing is one pass over the text before the first item."""
    keys: list[bytes] = []
    if prompt.mm_items:
        keys.append(b"mm:" + prompt.mm_items[0].content_hash.encode())
    # The last token is computed whatever the cache holds; items' placeholders are alike for any
    # two pictures of one size, so only the text before the first item is a text prefix.
    end = prompt.mm_items[0].offset if prompt.mm_items else len(prompt.prompt_token_ids) - 1
    if end < MIN_PREFIX_TOKENS:
        return keys
    tokens = np.asarray(prompt.prompt_token_ids[:end], dtype=np.int64)
    digest = hashlib.blake2b(digest_size=16)
    digest.update((prompt.cache_salt or "").encode() + b"\0")
    prefixes = []
    done, cut = 0, MIN_PREFIX_TOKENS
    while cut <= end:
        digest.update(tokens[done:cut].tobytes())
        prefixes.append(b"text:" + digest.copy().digest())
        done, cut = cut, cut * 2
    keys.extend(reversed(prefixes))
    return keys


class DataParallelRouter:
    def __init__(self, num_engines: int, *, affinity_slack: int = 4, max_keys: int = MAX_KEYS) -> None:
        if num_engines < 1:
            raise ValueError(f"num_engines must be at least 1, got {num_engines}")
        self.num_engines = num_engines
        self.affinity_slack = affinity_slack
        self.max_keys = max_keys
        self.loads = [0] * num_engines  # engine requests in flight, per engine
        self._recent: OrderedDict[bytes, int] = OrderedDict()  # key -> the engine it went to last
        self._turn = 0  # where the rotation among equally loaded engines starts

    def choose(self, keys: Sequence[bytes], up: Sequence[bool]) -> int:
        """The engine for a request with these affinity keys, given which engines are up (at
        least one must be); the keys are remembered as sent there."""
        if len(up) != self.num_engines:
            raise ValueError(f"{len(up)} engine states for {self.num_engines} engines")
        candidates = [k for k in range(self.num_engines) if up[k]]
        if not candidates:
            raise ValueError("no engine is up")
        least = min(candidates, key=lambda k: (self.loads[k], (k - self._turn) % self.num_engines))
        chosen = least
        for key in keys:
            engine = self._recent.get(key)
            if engine is not None and up[engine]:
                if self.loads[engine] - self.loads[least] <= self.affinity_slack:
                    chosen = engine
                break  # the most specific key known decides; a looser one says less
        if chosen == least:
            self._turn = (least + 1) % self.num_engines
        for key in keys:
            self._recent[key] = chosen
            self._recent.move_to_end(key)
        while len(self._recent) > self.max_keys:
            self._recent.popitem(last=False)
        return chosen

    def add(self, engine: int, cost: int = 1) -> None:
        """`cost` engine requests were sent to `engine`."""
        self.loads[engine] += cost

    def remove(self, engine: int, cost: int = 1) -> None:
        """They ended there (finished, aborted or failed: the engine holds them no more)."""
        self.loads[engine] -= cost
        assert self.loads[engine] >= 0, f"engine {engine}'s load went below zero"
