from __future__ import annotations

import json
from pathlib import Path

import pytest

from vlmserve.families.qwen2_vl.tiny import QWEN2_VL_CHAT_TEMPLATE
from vlmserve.tokenizer import Tokenizer, load_chat_template, read_chat_template, template_variables

MESSAGES = [
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]},
    {"role": "assistant", "content": "A cat."},
    {"role": "user", "content": "And its colour?"},
]


def test_chat_template_matches_transformers(tiny_dir: Path, hf_tokenizer) -> None:  # type: ignore[no-untyped-def]
    tok = Tokenizer(tiny_dir)
    for add in (True, False):
        ours = tok.apply_chat_template(MESSAGES, add_generation_prompt=add)
        theirs = hf_tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=add)
        assert ours == theirs
    assert ours.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n")
    assert "<|vision_start|><|image_pad|><|vision_end|>What is this?" in ours
    with_ids = tok.apply_chat_template(MESSAGES, add_vision_id=True)
    assert "Picture 1: <|vision_start|>" in with_ids


@pytest.mark.parametrize("where", ["tokenizer_config.json", "chat_template.json", "chat_template.jinja"])
def test_template_found_wherever_it_is_stored(tmp_path: Path, where: str) -> None:
    if where == "tokenizer_config.json":
        (tmp_path / where).write_text(json.dumps({"chat_template": QWEN2_VL_CHAT_TEMPLATE}))
    elif where == "chat_template.json":
        (tmp_path / where).write_text(json.dumps({"chat_template": QWEN2_VL_CHAT_TEMPLATE}))
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "stale"}))
    else:
        (tmp_path / where).write_text(QWEN2_VL_CHAT_TEMPLATE)
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "stale"}))
    assert load_chat_template(tmp_path) == QWEN2_VL_CHAT_TEMPLATE


def test_encode_decode_and_special_tokens(tiny_dir: Path) -> None:
    tok = Tokenizer(tiny_dir)
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 151644 and ids[-1] == 151645
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"
    assert tok.eos_token_id == 151645
    assert tok.decode([151643, 151655, 151656, 9707]) == tok.decode([9707])  # special tokens skipped


def test_template_errors_are_value_errors(tiny_dir: Path) -> None:
    tok = Tokenizer(tiny_dir)
    with pytest.raises(ValueError, match="could not render"):
        tok.apply_chat_template(MESSAGES, chat_template="{{ raise_exception('roles must alternate') }}")


def test_a_template_that_does_not_parse_names_its_line(tiny_dir: Path) -> None:
    tok = Tokenizer(tiny_dir)
    broken = "{% for m in messages %}\n{{ m.content }}\n{% if m.role %}\n{% endfor %}"
    with pytest.raises(ValueError, match=r"^the chat template does not parse: line 4: Encountered unknown tag"):
        tok.apply_chat_template(MESSAGES, chat_template=broken)
    with pytest.raises(ValueError, match=r"^the chat template does not parse: line 2: unexpected"):
        template_variables("{{ tools }}\n{{ )")


def test_a_template_that_fails_to_render_names_its_line(tiny_dir: Path) -> None:
    tok = Tokenizer(tiny_dir)
    strict = "{% for m in messages %}\n{{ m.role }}\n{% if m.role == 'assistant' %}\n{{ raise_exception('no answers here') }}\n{% endif %}\n{% endfor %}"  # noqa: E501
    with pytest.raises(ValueError, match=r"could not render these messages: no answers here \(template line 4\)$"):
        tok.apply_chat_template(MESSAGES, chat_template=strict)
    # Python's error on a value of the wrong type: its kind and line, not its message.
    typed = "{{ messages[0].role }}\n{{ messages | length + 'x' }}"
    with pytest.raises(ValueError, match=r"\(TypeError at template line 2\): a value has the wrong type"):
        tok.apply_chat_template(MESSAGES, chat_template=typed)
    # The sandbox refuses unsafe operations: an error naming the line too.
    unsafe = "ok\n{{ messages.__class__.__mro__ }}"
    with pytest.raises(ValueError, match=r"could not render these messages: .*\(template line 2\)$"):
        tok.apply_chat_template(MESSAGES, chat_template=unsafe)


def test_read_chat_template_takes_a_file_or_the_template_itself(tmp_path: Path) -> None:
    """vLLM's --chat-template: a path, or the template inline."""
    template = "{% for m in messages %}[{{ m.role }}]{% endfor %}"
    path = tmp_path / "template.jinja"
    path.write_text(template)
    assert read_chat_template(str(path)) == template
    assert read_chat_template(template) == template
    with pytest.raises(ValueError, match=r"missing\.jinja: no such file"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    (tmp_path / "broken.jinja").write_text("a\n{% if x %}")
    with pytest.raises(ValueError, match="does not parse: line 2"):
        read_chat_template(str(tmp_path / "broken.jinja"))
