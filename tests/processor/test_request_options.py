"""The request-level prompt options, without a server: continue_final_message against
transformers' apply_chat_template on the same tokenizer files, custom roles, truncation of a
processed prompt with an image (kept, dropped, or refused when cut through), and the checks of
mm_processor_kwargs / media_io_kwargs."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import random_image
from tests.processor.test_qwen2_vl import make_processor
from vlmserve.api.frontend import Frontend, load_frontend
from vlmserve.engine.config import EngineConfig
from vlmserve.processor.base import ImageInput, VideoInput
from vlmserve.processor.media_options import apply_media_defaults, media_defaults
from vlmserve.processor.truncation import truncate_ids, truncate_prompt, truncation_size

IMAGE_PAD = 151655


@pytest.fixture(scope="module")
def frontend(tiny_dir: Path) -> Frontend:
    return load_frontend(EngineConfig(model=str(tiny_dir), max_model_len=4096))


PARTIAL = [
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "The colour is"},
]


@pytest.mark.parametrize(
    "messages",
    [
        PARTIAL,
        # trailing spaces (the template keeps them), and the last text part of a list
        [PARTIAL[0], {"role": "assistant", "content": "The colour is  "}],
        [PARTIAL[0], {"role": "assistant", "content": [{"type": "text", "text": "It is"}]}],
    ],
)
def test_continue_final_message_matches_transformers(frontend: Frontend, hf_tokenizer, messages) -> None:  # type: ignore[no-untyped-def]
    ours = frontend.render_chat(messages, add_generation_prompt=False, continue_final_message=True).prompt
    theirs = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    assert ours == theirs
    assert not ours.endswith("<|im_end|>\n") and "<|im_start|>assistant\n" in ours
    closed = frontend.render_chat(messages, add_generation_prompt=False).prompt
    assert closed.endswith("<|im_end|>\n") and closed.startswith(ours)


def test_continue_final_message_rules(frontend: Frontend) -> None:
    with pytest.raises(ValueError, match="cannot both be true"):
        frontend.render_chat(PARTIAL, add_generation_prompt=True, continue_final_message=True)
    no_text = [PARTIAL[0], {"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(ValueError, match="no text to continue"):
        frontend.render_chat(no_text, add_generation_prompt=False, continue_final_message=True)


def test_custom_roles_reach_the_template(frontend: Frontend, hf_tokenizer) -> None:  # type: ignore[no-untyped-def]
    messages = [{"role": "narrator", "content": "Once."}, {"role": "user", "content": "Go on."}]
    prompt = frontend.render_chat(messages).prompt
    assert "<|im_start|>narrator\nOnce.<|im_end|>" in prompt
    assert prompt == hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_a_role_the_template_refuses_is_a_clear_error(frontend: Frontend) -> None:
    template = (
        "{% for m in messages %}{% if m.role not in ['user'] %}"
        "{{ raise_exception('bad role ' + m.role) }}{% endif %}{% endfor %}"
    )
    with pytest.raises(ValueError, match="could not render these messages: bad role narrator"):
        frontend.render_chat([{"role": "narrator", "content": "x"}], chat_template=template)


def test_a_role_the_template_drops_is_a_clear_error_not_a_silent_loss(frontend: Frontend) -> None:
    # As Qwen3-VL's template: turns of roles it does not know are left out without a word.
    template = (
        "{% for m in messages %}{% if m.role in ['system', 'user', 'assistant'] %}"
        "<|im_start|>{{ m.role }}\n{{ m.content if m.content is string else '' }}<|im_end|>\n"
        "{% endif %}{% endfor %}"
    )
    kept = frontend.render_chat([{"role": "user", "content": "x"}], chat_template=template).prompt
    assert kept == "<|im_start|>user\nx<|im_end|>\n"
    messages = [{"role": "user", "content": "x"}, {"role": "narrator", "content": [{"type": "text", "text": "y"}]}]
    with pytest.raises(
        ValueError, match=r"messages\[1\].role 'narrator' is not rendered by this model's chat template"
    ):
        frontend.render_chat(messages, chat_template=template)


def test_truncation_bounds_are_vllm_s() -> None:
    assert truncation_size(None, 100) is None
    assert truncation_size(-1, 100) == 100
    assert truncation_size(100, 100) == 100
    for bad, match in ((0, ">= 1 or -1"), (-2, ">= 1 or -1"), (101, "greater than max_model_len")):
        with pytest.raises(ValueError, match=match):
            truncation_size(bad, 100)
    assert truncate_ids([1, 2, 3, 4], 2) == [3, 4]
    assert truncate_ids([1, 2, 3, 4], 2, "right") == [1, 2]


def test_truncation_keeps_whole_images_drops_cut_off_ones_and_refuses_halves(tiny_dir: Path) -> None:
    processor = make_processor(tiny_dir, max_model_len=4096)
    text = "before <|vision_start|><|image_pad|><|vision_end|> after the image, some more words"
    whole = processor.process(text, [ImageInput(random_image(56, 56, seed=3))])
    (item,) = whole.mm_items
    ids = whole.prompt_token_ids
    tail = len(ids) - item.end
    # Left, keeping the image: the same ids, the item moved, positions those of the cut prompt.
    keep = tail + item.length + 2
    cut = truncate_prompt(whole, keep, "left", processor)
    assert cut.prompt_token_ids == ids[-keep:]
    assert cut.mm_items[0].offset == item.offset - (len(ids) - keep)
    assert cut.mm_items[0].content_hash == item.content_hash
    assert cut.mrope_positions is not None and cut.mrope_positions.shape == (3, keep)
    # Left, past the image: no item left.
    short = truncate_prompt(whole, tail, "left", processor)
    assert short.prompt_token_ids == ids[-tail:] and short.mm_items == []
    # Right, before the image.
    head = truncate_prompt(whole, item.offset, "right", processor)
    assert head.prompt_token_ids == ids[: item.offset] and head.mm_items == []
    # Through the image: refused, naming the field.
    with pytest.raises(ValueError, match="truncate_prompt_tokens=.*cut through the placeholder"):
        truncate_prompt(whole, tail + item.length // 2, "left", processor)
    with pytest.raises(ValueError, match="cut through"):
        truncate_prompt(whole, item.offset + 1, "right", processor)
    assert ids.count(IMAGE_PAD) == item.length


def test_media_options_are_checked_by_name() -> None:
    assert media_defaults(None, {"video": {"num_frames": 4}}).video == {"nframes": 4}
    assert media_defaults({"max_pixels": 5000, "fps": 1}, None).image == {"max_pixels": 5000}
    for mm, io, match in [
        ("invalid", None, "mm_processor_kwargs must be an object"),
        ({"bogus": 1}, None, r"mm_processor_kwargs: unknown keys \['bogus'\]"),
        ({"max_pixels": -3}, None, "mm_processor_kwargs: max_pixels must be a positive integer"),
        (None, "invalid", "media_io_kwargs must be an object"),
        (None, {"audio": {}}, "media_io_kwargs: unknown modality 'audio'"),
        (None, {"video": "x"}, "media_io_kwargs.video must be an object"),
        (None, {"video": {"frames": 4}}, "media_io_kwargs.video: unknown key 'frames'"),
        (None, {"image": {"mode": "RGB"}}, "media_io_kwargs.image: unknown key 'mode'; supported: none"),
        (None, {"video": {"num_frames": 0}}, "media_io_kwargs.video: nframes must be a positive integer"),
        ({"fps": 1}, {"video": {"num_frames": 4}}, "give fps or nframes"),
    ]:
        with pytest.raises(ValueError, match=match):
            media_defaults(mm, io)


def test_a_part_s_own_options_win_over_the_request_s() -> None:
    defaults = media_defaults({"max_pixels": 5000}, {"video": {"num_frames": 4}})
    from vlmserve.multimodal.image import ImageSizing
    from vlmserve.multimodal.video import VideoOptions

    images = [ImageInput("a"), ImageInput("b", ImageSizing(max_pixels=3000))]
    videos = [VideoInput(b"v"), VideoInput(b"w", VideoOptions(fps=1.0)), VideoInput([b"f1", b"f2"])]
    images, videos = apply_media_defaults(defaults, images, videos)
    assert [i.sizing.max_pixels for i in images] == [5000, 3000]
    assert [(v.options.nframes, v.options.fps) for v in videos] == [(4, None), (None, 1.0), (None, None)]
    assert videos[0].options.max_pixels == 5000
