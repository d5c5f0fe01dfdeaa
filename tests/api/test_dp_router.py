"""DataParallelRouter on hand-built prompts and loads, no process: the least loaded engine that is
up takes a request (equals in turn); a request repeating an image, or a long token prefix, goes
back to the engine that had it unless that one is more than the slack busier; an engine down is
never chosen."""

from __future__ import annotations

import torch

from vlmserve.api.dp_router import MIN_PREFIX_TOKENS, DataParallelRouter, affinity_keys
from vlmserve.multimodal.inputs import MultiModalItem, ProcessedPrompt

UP = [True, True]


def prompt(ids: list[int], image_hash: str | None = None) -> ProcessedPrompt:
    items = []
    if image_hash is not None:
        item = MultiModalItem("image", 3, 4, (1, 4, 4), image_hash, torch.empty(0), (56, 56), (56, 56))
        items.append(item)
    return ProcessedPrompt(ids, items, None, 0)


def text(first: int, length: int) -> list[int]:
    return list(range(first, first + length))


def test_the_least_loaded_engine_takes_a_request_and_equals_take_turns() -> None:
    router = DataParallelRouter(3)
    router.add(0, 3)
    router.add(1, 1)
    router.add(2, 2)
    assert router.choose([], [True] * 3) == 1
    router.add(1, 2)  # now 3, 3, 2
    assert router.choose([], [True] * 3) == 2
    router.remove(0, 3)
    router.remove(1, 3)
    router.remove(2, 2)
    # All idle: requests sent one at a time go round.
    assert [router.choose([], [True] * 3) for _ in range(4)] == [0, 1, 2, 0]


def test_a_repeated_image_goes_back_to_its_engine_unless_that_one_is_clearly_busier() -> None:
    router = DataParallelRouter(2, affinity_slack=2)
    router.add(0)
    cat = affinity_keys(prompt([1, 2, 3, 4, 5, 6, 7, 8], "cat"))
    assert router.choose(cat, UP) == 1  # the least loaded
    router.add(1, 3)  # 1 against 3: engine 1 is 2 busier, within the slack
    assert router.choose(cat, UP) == 1
    dog = affinity_keys(prompt([1, 2, 3, 4, 5, 6, 7, 8], "dog"))  # same tokens, another picture
    assert router.choose(dog, UP) == 0
    router.add(1)  # 3 busier: past the slack, the least loaded takes it, and it is remembered there
    assert router.choose(cat, UP) == 0
    router.remove(1, 4)  # engine 1 idle again: the cat's last engine still wins
    assert router.choose(cat, UP) == 0


def test_a_long_common_token_prefix_goes_back_to_its_engine_and_a_short_prompt_only_balances() -> None:
    router = DataParallelRouter(2)
    first = text(100, 2 * MIN_PREFIX_TOKENS + 10)
    # Same first 128 tokens, then other text: shares the 64- and 128-token prefixes.
    second = first[: 2 * MIN_PREFIX_TOKENS] + text(5000, 40)
    other = text(9000, 2 * MIN_PREFIX_TOKENS + 10)
    router.add(0)
    assert router.choose(affinity_keys(prompt(first)), UP) == 1
    router.add(1, 2)
    assert router.choose(affinity_keys(prompt(second)), UP) == 1
    assert router.choose(affinity_keys(prompt(other)), UP) == 0
    short = prompt(text(100, MIN_PREFIX_TOKENS))  # 63 tokens before its last: no key
    assert affinity_keys(short) == []
    # A salt (another rotary base) makes other prefixes of the same ids.
    salted = prompt(first)
    salted.cache_salt = "ntk-2"
    assert set(affinity_keys(salted)).isdisjoint(affinity_keys(prompt(first)))


def test_an_engine_that_is_down_is_never_chosen() -> None:
    router = DataParallelRouter(2)
    cat = affinity_keys(prompt([1, 2, 3], "cat"))
    assert router.choose(cat, UP) == 0
    router.add(1, 5)
    # Engine 0, the least loaded and the cat's, is down: engine 1 takes everything.
    assert [router.choose(cat, [False, True]) for _ in range(3)] == [1, 1, 1]
    assert router.choose([], [False, True]) == 1
    # Back up: the cat's engine is now 1, but 1 is 5 busier, past the default slack of 4.
    assert router.choose(cat, UP) == 0
