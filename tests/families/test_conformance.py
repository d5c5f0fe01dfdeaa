"""Every registered family (vlmserve.registry.FAMILIES) held to the same checks, asking the family
entry for everything it can: its config parsed as transformers reads it, its processor's token
ids, pixels and positions as transformers makes them, float32 logits (whole prompts, and chunks
ending inside images, then decode steps) and greedy tokens (batched with a small token budget,
alone, and again from the prefix cache) as its reference gives them, a verify step's logits as
decoding its tokens one by one gives them, one request through a real
server, Qwen's list-of-dicts input with shared-memory handles in the token ids, tensor
parallelism where the family shards, its grounding convention, and a tiny checkpoint of its own
writing that loads whole. A family exempt from a check says why (conftest.py's EXEMPTIONS).

Family-specific behaviour (videos, DeepStack, Gated DeltaNet state, dynamic NTK, experts'
layouts) is tested in the family's own files under tests/models, tests/processor, tests/qwen_vl."""

from __future__ import annotations

import dataclasses
import gc
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.families.conftest import (
    CASES,
    CHECKS,
    EXEMPTIONS,
    Reference,
    TransformersReference,
    exemption,
    skip_if_exempt,
    small_llm,
)
from tests.model_harness import Harness
from tests.speculation import oracle_drafts
from vlmserve.family import ModelFamily
from vlmserve.multimodal.inputs import ProcessedPrompt
from vlmserve.registry import (
    BY_ARCHITECTURE,
    FAMILIES,
    GROUNDING_CONVENTIONS,
    convention_for_model,
    family_of,
    grounding_convention,
    load_model_config,
)

MAX_NEW = 8
EXTRA = [1234, 77, 151645, 9]  # tokens decoded after a prompt (any ids: the logits are compared)


def user(*parts: Any) -> dict[str, Any]:
    return {"role": "user", "content": list(parts)}


def image_part(path: Path) -> dict[str, str]:
    return {"type": "image", "image": str(path)}


def text_part(text: str) -> dict[str, str]:
    return {"type": "text", "text": text}


def two_images(pictures: dict[str, Path]) -> list[dict[str, Any]]:
    """A chat with two images of different sizes and aspects."""
    first, second = image_part(pictures["first"]), image_part(pictures["second"])
    return [user(first, text_part("and"), second, text_part("compare them"))]


def image_files(messages: list[dict[str, Any]]) -> list[Path]:
    """The image files of a conversation, in order."""
    parts = [part for m in messages if isinstance(m["content"], list) for part in m["content"]]
    return [Path(part["image"]) for part in parts if part.get("type") == "image"]


def conversations(pictures: dict[str, Path]) -> dict[str, list[dict[str, Any]]]:
    """The greedy checks' prompts: history with an image, two images, text alone."""
    return {
        "history and an image": [
            user(text_part("Name a colour.")),
            {"role": "assistant", "content": "Blue."},
            user(image_part(pictures["square"]), text_part("Is this picture blue?")),
        ],
        "two images": [
            user(image_part(pictures["first"]), text_part("then"), image_part(pictures["second"]), text_part("?"))
        ],
        "text": [user(text_part("Write a haiku about the sea."))],
    }


def process(frontend: Any, messages: list[dict[str, Any]]) -> tuple[Any, ProcessedPrompt, list[Path]]:
    """The family's chat rendering and processor over `messages`: (the rendered chat, the prompt, its image files)."""
    chat = frontend.render_chat(messages)
    prompt = frontend.processor.process(chat.prompt, chat.images, chat.videos)
    return chat, prompt, [Path(image.source) for image in chat.images]


# -- the registry's side ---------------------------------------------------------------------------


def test_every_registered_family_has_a_case_and_every_exemption_a_family() -> None:
    assert sorted(CASES) == sorted(f.name for f in FAMILIES)
    assert all(name in CASES and check in CHECKS for name, check in EXEMPTIONS)
    # One entry per architecture; each names a transformers class or is checked against the dense reference.
    assert len(BY_ARCHITECTURE) == len(FAMILIES)
    assert all((f.transformers_class is None) == (CASES[f.name].hf_model is None) for f in FAMILIES)


def test_config_is_the_familys(family: ModelFamily, model_dir: Path) -> None:
    """The tiny checkpoint's config.json parses through the registry to this very entry, and the
    entry's own parser gives the same config."""
    from vlmserve.config import read_config_json

    config = load_model_config(model_dir / "config.json")
    assert (config.architecture, config.model_type) == (family.architecture, family.model_type)
    assert family_of(config) is family
    assert family.parse_config(read_config_json(model_dir / "config.json")) == config


@pytest.mark.parity
def test_config_reads_as_transformers_reads_it(family: ModelFamily, model_dir: Path) -> None:
    """The text and vision fields every family has, as transformers' AutoConfig reads the same file."""
    skip_if_exempt(family, "config_against_transformers")
    from transformers import AutoConfig

    ours, theirs = load_model_config(model_dir / "config.json"), AutoConfig.from_pretrained(str(model_dir))
    assert type(theirs).__name__.removesuffix("Config") + "ForConditionalGeneration" == family.transformers_class
    text = theirs.text_config if hasattr(theirs, "text_config") else theirs
    vision = theirs.vision_config
    assert (ours.text.hidden_size, ours.text.num_hidden_layers, ours.text.vocab_size) == (
        text.hidden_size,
        text.num_hidden_layers,
        text.vocab_size,
    )
    assert (ours.text.num_attention_heads, ours.text.num_key_value_heads) == (
        text.num_attention_heads,
        text.num_key_value_heads,
    )
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    assert ours.text.head_dim == head_dim
    rope = getattr(text, "rope_parameters", None) or {}
    assert ours.text.mrope_section == tuple(rope["mrope_section"])
    assert ours.text.tie_word_embeddings == theirs.tie_word_embeddings
    # The tower's own width is embed_dim in Qwen2-VL's vision config, hidden_size in the others'.
    width = getattr(vision, "embed_dim", None) or vision.hidden_size
    out = getattr(vision, "out_hidden_size", None) or vision.hidden_size
    assert (ours.vision.depth, ours.vision.embed_dim, ours.vision.hidden_size) == (vision.depth, width, out)
    assert (ours.vision.patch_size, ours.vision.spatial_merge_size) == (vision.patch_size, vision.spatial_merge_size)
    assert (ours.image_token_id, ours.video_token_id) == (theirs.image_token_id, theirs.video_token_id)


# -- the processor -------------------------------------------------------------------------------


@pytest.mark.parity
def test_processor_matches_transformers(family: ModelFamily, frontend: Any, reference: Reference, pictures) -> None:  # type: ignore[no-untyped-def]
    """Token ids, pixels, grids and M-RoPE positions of a chat with two images of different
    sizes, as transformers' tokenizer, image processor and get_rope_index make them."""
    skip_if_exempt(family, "processor_against_transformers")
    assert isinstance(reference, TransformersReference)
    chat, prompt, images = process(frontend, two_images(pictures))
    ids, vision = reference.prompt_ids(chat.prompt, images)
    assert prompt.prompt_token_ids == ids
    assert [item.grid_thw for item in prompt.mm_items] == [tuple(g.tolist()) for g in vision["image_grid_thw"]]
    assert [item.grid_thw[1:] for item in prompt.mm_items] == [(14, 20), (22, 14)]  # kept at their sizes
    pixels = torch.cat([item.pixel_values for item in prompt.mm_items])
    assert (pixels - vision["pixel_values"]).abs().max() <= 1e-6
    config = frontend.model_config
    for item in prompt.mm_items:  # each item covers exactly its run of placeholders
        assert set(ids[item.offset : item.end]) == {config.image_token_id}
        assert ids[item.offset - 1] == config.vision_start_token_id and ids[item.end] == config.vision_end_token_id
    tensor = torch.tensor([ids])
    positions, delta = reference.hf.model.get_rope_index(
        tensor, (tensor == config.image_token_id).int(), image_grid_thw=vision["image_grid_thw"]
    )
    assert torch.equal(prompt.mrope_positions, positions[:, 0])
    assert prompt.mrope_delta == int(delta)


# -- the model against the reference --------------------------------------------------------------


@pytest.fixture(scope="module")
def harness(model_dir: Path) -> Harness:
    return Harness(model_dir, torch.float32)


LOGITS_CASES = ["two images, whole", "two images, chunks ending inside each, then decode", "text, chunks, then decode"]


@pytest.mark.against_reference
@pytest.mark.parametrize("shape", LOGITS_CASES)
def test_logits_match_the_reference_float32(
    shape: str, family: ModelFamily, frontend: Any, harness: Harness, reference: Reference, pictures
) -> None:  # type: ignore[no-untyped-def]
    """float32 logits of every prompt token (and of decode steps after it, at the positions the
    family's decode rule gives) equal the reference's one forward over the same tokens."""
    if shape.startswith("text"):
        messages = [user(text_part("Tell me a story about a lighthouse that stands alone by a grey and restless sea."))]
    else:
        messages = two_images(pictures)
    _, prompt, images = process(frontend, messages)
    n = prompt.num_tokens
    chunks, extra = None, []
    if "chunks" in shape:
        extra = EXTRA
        if prompt.mm_items:
            first, second = prompt.mm_items
            chunks = [first.offset + 7, second.offset + 9 - first.offset - 7]
            chunks.append(n - sum(chunks))
            ends = [sum(chunks[: i + 1]) for i in range(len(chunks))]
            assert first.offset < ends[0] < first.end and second.offset < ends[1] < second.end
        else:
            chunks = [n // 3, n // 2 - n // 3 + 5, n - n // 2 - 5]
    ours = harness.logits(prompt, chunks=chunks, extra=extra)
    expected = reference.logits(prompt.prompt_token_ids, images, extra)
    assert ours.shape == expected.shape == (n + len(extra), frontend.model_config.text.vocab_size)
    atol, rtol = reference.tolerance
    torch.testing.assert_close(ours, expected, atol=atol, rtol=rtol)


def test_a_verify_step_gives_the_logits_of_its_tokens_decoded_one_by_one(
    frontend: Any, harness: Harness, pictures: dict[str, Path]
) -> None:
    """Speculative decoding's verify step: the last 5 tokens of a prompt with two images, computed
    in one step after the rest is cached (they run as decode rows, each over its own prefix, at its
    own M-RoPE positions), give in float32 the logits of the same tokens computed one step each."""
    _, prompt, _ = process(frontend, two_images(pictures))
    n = prompt.num_tokens
    verify = harness.logits(prompt, chunks=[n - 5, 5])[n - 5 :]
    one_by_one = harness.logits(prompt, chunks=[n - 5, 1, 1, 1, 1, 1])[n - 5 :]
    torch.testing.assert_close(verify, one_by_one, atol=1e-4, rtol=1e-4)


@pytest.mark.against_reference
def test_greedy_batched_alone_and_cached_match_the_reference(
    family: ModelFamily, llm: Any, reference: Reference, pictures
) -> None:  # type: ignore[no-untyped-def]
    """Through the engine: three conversations in one call (a 64-token budget, so image prompts are
    prefilled in chunks while others decode), then each alone, then one again from the prefix
    cache: the reference's greedy tokens every time."""
    from vlmserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    convs = conversations(pictures)
    batched = llm.chat(list(convs.values()), params)
    expected = {}
    for (name, messages), out in zip(convs.items(), batched, strict=True):
        expected[name] = reference.greedy(out.prompt_token_ids, image_files(messages), MAX_NEW)
        assert out.outputs[0].token_ids == expected[name], f"{name}, batched"
    assert any(out.mm_items for out in batched) and any(not out.mm_items for out in batched)
    for name, messages in convs.items():
        (alone,) = llm.chat(messages, params)
        assert alone.outputs[0].token_ids == expected[name], f"{name}, alone"
    (again,) = llm.chat(convs["two images"], params)
    assert again.num_cached_tokens > 0, "a repeated prompt reuses cached blocks"
    assert again.outputs[0].token_ids == expected["two images"]
    engine = llm.llm_engine
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks
    # a family with per-request state (Qwen3.5's slot group) has its slots all back too
    assert all(group.slots.num_free == group.slots.num_slots for group in engine.kv.groups)


@pytest.fixture(scope="module")
def speculative_llm(model_dir: Path) -> Any:
    """The `llm` fixture's engine with n-gram speculation (drafts from any 1-3 repeated tokens)."""
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    engine = small_llm(model_dir, speculative_config=ngram)
    yield engine
    del engine
    gc.collect()


def test_greedy_with_speculation_is_greedy_without(
    family: ModelFamily, llm: Any, speculative_llm: Any, pictures
) -> None:  # type: ignore[no-untyped-def]
    """Speculative decoding changes no greedy token: the three conversations batched (image
    prompts prefilled in chunks beside other requests' verifications) give what the engine gives
    without it (which the check above holds to the reference), with n-gram drafts, then with
    drafts that are the right continuation except a wrong token every few steps (so that every
    family verifies drafts whether or not its random weights repeat themselves: whole drafts
    accepted, some cut short, a hybrid model's state put back), the second time from the prefix
    cache; every block and state slot comes back."""
    from vlmserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=24)
    convs = list(conversations(pictures).values())
    plain = [out.outputs[0].token_ids for out in llm.chat(convs, params)]
    speculated = speculative_llm.chat(convs, params)
    assert [out.outputs[0].token_ids for out in speculated] == plain, "n-gram drafts"
    core = speculative_llm.llm_engine.core
    before = dataclasses.replace(core.spec_stats)
    answers = {tuple(out.prompt_token_ids): out.outputs[0].token_ids for out in speculated}
    with oracle_drafts(core, answers):
        again = speculative_llm.chat(convs, params)
    assert [out.outputs[0].token_ids for out in again] == plain, "drafts right but for a wrong token"
    assert any(out.num_cached_tokens > 0 for out in again)
    drafted = core.spec_stats.num_draft_tokens - before.num_draft_tokens
    accepted = core.spec_stats.num_accepted_tokens - before.num_accepted_tokens
    assert 0 < accepted < drafted, (accepted, drafted)
    engine = speculative_llm.llm_engine
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks  # rejected drafts' blocks came back
    assert all(group.slots.num_free == group.slots.num_slots for group in engine.kv.groups)


# -- serving ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(case: Any, model_dir: Path, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A real server of the family's checkpoint: the session's where one serves it, else one started here."""
    if case.server is not None:
        yield request.getfixturevalue(case.server)
        return
    from tests.api.conftest import start_server

    server = start_server(model_dir, tmp_path_factory.mktemp("server"))
    yield server
    server.stop()


def test_a_served_request_is_answered_as_offline(family: ModelFamily, served: Any, llm: Any, pictures) -> None:  # type: ignore[no-untyped-def]
    """One chat request with an image through `vlmserve serve` (the official openai client): the
    offline engine's tokens and top logprobs, and the family's grounding convention and the
    image's sizes in the response's `vlmserve` extension."""
    import openai
    from PIL import Image

    from tests.api.conftest import data_url
    from tests.api.test_video_server import ask, assert_same_answer, offline_answer
    from tests.api.test_video_server import served as served_tokens

    image = Image.open(pictures["square"])
    picture = data_url(image)
    messages = [user({"type": "image_url", "image_url": {"url": picture}}, text_part("What is this?"))]
    client = openai.OpenAI(base_url=served.url + "/v1", api_key=served.api_key, max_retries=0, timeout=120)
    reply = ask(client, messages, 6)
    assert_same_answer(served_tokens(reply), offline_answer(llm, messages, 6)[0])
    extension = (reply.model_extra or {})["vlmserve"]
    assert extension["grounding_convention"] == family.grounding.name
    (item,) = extension["mm_items"]
    assert item["modality"] == "image" and item["original_size"] == list(image.size)


# -- list-of-dicts input, shared-memory handles in the token ids -------------------------


def test_list_of_dicts_with_shared_memory_handles_generate_what_chat_does(
    family: ModelFamily, llm: Any, pictures
) -> None:  # type: ignore[no-untyped-def]
    """LLM.tokenize([{"text"}, {"image"}, {"text"}]) puts the image's pixels in a shared-memory
    segment and its handle in the token ids; generating from those ids gives chat's prompt and
    image and chat's tokens and logprobs, and frees the segment."""
    from tests.api.conftest import segments_left
    from vlmserve import SamplingParams
    from vlmserve.multimodal import handles

    inputs = [{"text": "Look:"}, {"image": str(pictures["square"])}, {"text": "What is it?"}]
    chat = [user(*[{"type": key, key: value} for entry in inputs for key, value in entry.items()])]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=3)
    ids = llm.tokenize(inputs)
    expected = llm.chat(chat, params)[0]
    assert len(ids) == len(expected.prompt_token_ids)
    differ = [k for k, (a, b) in enumerate(zip(ids, expected.prompt_token_ids, strict=True)) if a != b]
    assert differ and handles.is_handle(ids[differ[0]]), "the first difference is the segment's handle"
    assert len(segments_left()) >= 1
    out = llm.generate({"prompt_token_ids": ids}, params)[0]
    assert segments_left() == []
    # The same items at the same places, and the same tokens around them (inside an image's span
    # the engine's ids are its placeholders; Qwen-VL-Chat's chat writes the image's path there).
    (item,), (chat_item,) = out.mm_items, expected.mm_items
    assert (item.modality, item.offset, item.length, item.resized_size) == (
        chat_item.modality,
        chat_item.offset,
        chat_item.length,
        chat_item.resized_size,
    )
    if exemption(family, "handles_keep_original_size") is None:
        assert item.original_size == chat_item.original_size
    spans = {k for item in expected.mm_items for k in range(item.offset, item.offset + item.length)}
    outside = [k for k in range(len(ids)) if k not in spans]
    assert [out.prompt_token_ids[k] for k in outside] == [expected.prompt_token_ids[k] for k in outside]
    assert out.outputs[0].token_ids == expected.outputs[0].token_ids
    # The same candidates at each step, their logprobs as close as two runs' (chat's prompt blocks
    # are cached by the time the ids run).
    got, want = out.outputs[0].logprobs, expected.outputs[0].logprobs
    assert got is not None and want is not None and len(got) == len(want)
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.keys() == b.keys(), step
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-5 for t in a), step


# -- tensor parallelism ---------------------------------------------------------------------------


def _results(outputs: list[Any]) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy tokens and, per prompt and step, the top-5 logprobs, best first."""
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    logprobs = [[sorted(v.logprob for v in step.values()) for step in o.outputs[0].logprobs] for o in outputs]
    return tokens, torch.tensor(logprobs)


def parameter_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes of all parameters, bytes of those every rank holds whole: no ShardSpec)."""
    from vlmserve.models.parallel import spec_of

    total = replicated = 0
    seen: set[int] = set()  # a tied lm_head is the embedding's parameter: counted once
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            n = p.numel() * p.element_size()
            total += n
            replicated += n if spec_of(module, name) is None else 0
    return total, replicated


def test_tensor_parallel_two_ranks_match_one_process_or_are_refused(
    family: ModelFamily, model_dir: Path, llm: Any, pictures
) -> None:  # type: ignore[no-untyped-def]
    """A family that shards: LLM(tensor_parallel_size=2) (two gloo rank processes) gives the single
    process's greedy tokens and top logprobs for three conversations batched, each rank holding
    half of every sharded weight. A family that does not: building it at tensor_parallel_size 2
    is refused by name, as its exemption says."""
    from vlmserve import LLM, SamplingParams
    from vlmserve.attention import TorchAttentionBackend
    from vlmserve.distributed import simulated_tensor_parallel
    from vlmserve.engine.executor import MultiprocExecutor

    config = load_model_config(model_dir / "config.json")
    if exemption(family, "tensor_parallel") is not None:
        with (
            simulated_tensor_parallel(0, 2),
            torch.device("meta"),
            pytest.raises(ValueError, match=f"{family.display_name}.*does not support tensor parallelism"),
        ):
            family.model_class(config, TorchAttentionBackend())
        with torch.device("meta"):
            family.model_class(config, TorchAttentionBackend())  # tensor_parallel_size 1 builds
        return
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=5)
    convs = list(conversations(pictures).values())
    tokens, logprobs = _results(llm.chat(convs, params))
    total, replicated = parameter_bytes(llm.llm_engine.model)
    # The prompts really differ: each pair's logprobs apart by far more than the tolerance below,
    # so ranks that mixed up the batch's rows would fail (random weights often repeat tokens).
    for a in range(len(tokens)):
        for b in range(a + 1, len(tokens)):
            assert (logprobs[a] - logprobs[b]).abs().max() > 1e-2, (a, b)
    gc.collect()
    two = LLM(
        model_dir,
        tensor_parallel_size=2,
        dtype="float32",
        max_model_len=1024,
        max_num_batched_tokens=64,
        kv_cache_memory_gib=0.02,
        limit_mm_per_prompt={"image": 2},
    )
    try:
        tp_tokens, tp_logprobs = _results(two.chat(convs, params))
        executor = two.llm_engine.core.executor
        assert isinstance(executor, MultiprocExecutor)
        ranks = executor.plan(None)
    finally:
        two.shutdown()
    assert tp_tokens == tokens
    torch.testing.assert_close(tp_logprobs, logprobs, atol=1e-4, rtol=0)
    # Every rank holds all of the rest (norms, patch embedding, Qwen3-VL's position grid, q/k
    # norms, the MoE router, row-parallel biases): under 1% here.
    assert replicated < 0.01 * total
    assert [r.weights_bytes for r in ranks] == [(total - replicated) // 2 + replicated] * 2


# -- the entry's other parts -----------------------------------------------------------------------


def test_grounding_convention_is_the_familys(family: ModelFamily) -> None:
    """The entry carries its convention whole: the registry finds it by name and by model_type,
    and a box written in its syntax (its tags, or JSON) maps to the image by its scale."""
    convention = family.grounding
    assert GROUNDING_CONVENTIONS[convention.name] is convention is grounding_convention(convention.name)
    assert convention_for_model(family.model_type) is convention
    assert family.grounding_convention == convention.name  # what the server's responses say
    from vlmserve.grounding import parse_boxes

    original, resized = (2000, 1000), (1000, 500)  # the model saw it at half the size
    written = [(100, 200, 300, 400)]
    texts = ['[{"bbox_2d": [100, 200, 300, 400], "label": "a"}]']
    if convention.tags is not None:
        (ref_open, ref_close), (box_open, box_close) = convention.tags.ref, convention.tags.box
        texts.append(f"{ref_open}a{ref_close}{box_open}(100,200),(300,400){box_close}")
    scale = (2, 2) if convention.coordinates == "resized_pixels" else (2000 / 1000, 1000 / 1000)
    for text in texts:
        (box,) = parse_boxes(text, convention, original, resized)
        assert box.label == "a" and box.convention == convention.name
        x1, y1, x2, y2 = written[0]
        assert box.xyxy == pytest.approx((x1 * scale[0], y1 * scale[1], x2 * scale[0], y2 * scale[1]))


def test_write_tiny_untied_and_sharded_loads_every_weight(family: ModelFamily, tmp_path: Path) -> None:
    """The entry's write_tiny (as `vlmserve make-tiny --arch NAME --untied --shards 2` runs it)
    writes a checkpoint of this architecture whose every weight loads into the model, and the
    model has no parameter left unloaded."""
    from vlmserve.model_files import weight_names

    out = family.write_tiny(tmp_path / family.name, untied=True, num_shards=2, seed=3)
    config = load_model_config(out / "config.json")
    assert family_of(config) is family and not config.text.tie_word_embeddings
    assert "lm_head.weight" in set(weight_names(out) or [])
    Harness(out)
    with pytest.raises(ValueError, match="no preset 'huge'"):
        family.write_tiny(tmp_path / "huge", preset="huge")
