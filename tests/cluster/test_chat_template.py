"""Chat templates render exactly as transformers' apply_chat_template renders them (the reference), from
tokenizer_config.json (a string or named templates) or chat_template.jinja, and the default model's own."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mtpserve.cluster.chat_template import ChatTemplate
from mtpserve.errors import InvalidRequestError
from tests.checkpoints import write_tokenizer

DEFAULT_MODEL = Path(__file__).resolve().parents[2] / "mtpserve" / "default_model"

CHATML = """{% for message in messages %}
{% if loop.first and message['role'] != 'system' %}<|im_start|>system
You are helpful.<|im_end|>
{% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] | trim }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

LLAMA_LIKE = """{{ bos_token }}{% set ns = namespace(sys='') %}
{% for m in messages %}
    {% if m['role'] == 'system' %}{% set ns.sys = m['content'] %}{% continue %}{% endif %}
    {% if m['role'] not in ['user', 'assistant'] %}{{ raise_exception('bad role ' + m['role']) }}{% endif %}
    {% if m['role'] == 'user' %}[INST] {% if loop.index0 == 1 and ns.sys %}<<SYS>>{{ ns.sys }}<</SYS>> {% endif %}
{{ m['content'] }} [/INST]{% else %} {{ m['content'] }}{{ eos_token }}{% endif %}
{% endfor %}"""

TOOLS_JSON = ("{% for m in messages %}{{ m | tojson }}\n{% endfor %}{{ {'k': '<é>'} | tojson(indent=2) }}"
              "{% if add_generation_prompt %}>>{% endif %}")

CONVERSATIONS = [
    [{"role": "user", "content": "w5 w6"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "  w7  "},
     {"role": "assistant", "content": "w8"}, {"role": "user", "content": "w9 <é> \"q\""}],
]


def checkpoint(path: Path, config: dict[str, Any], jinja: str | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    write_tokenizer(path, 64)
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "unk_token": "<unk>",
        "eos_token": {"content": "</s>", "special": True, "__type": "AddedToken"}, **config}))
    if jinja is not None:
        (path / "chat_template.jinja").write_text(jinja)
    return path


def reference(path: Path, messages: list[dict], add_generation_prompt: bool) -> str:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    return tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)


@pytest.mark.parametrize("name,source", [("chatml", CHATML), ("llama-like", LLAMA_LIKE), ("tojson", TOOLS_JSON)])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_renders_as_transformers(tmp_path: Path, name: str, source: str, add_generation_prompt: bool) -> None:
    path = checkpoint(tmp_path / name, {"chat_template": source})
    template = ChatTemplate.from_checkpoint(path)
    assert template is not None and template.special_tokens["eos_token"] == "</s>"
    for messages in CONVERSATIONS:
        want = reference(path, messages, add_generation_prompt)
        assert template.render(messages, add_generation_prompt) == want


def test_jinja_file_wins_and_named_templates(tmp_path: Path) -> None:
    both = checkpoint(tmp_path / "both", {"chat_template": TOOLS_JSON}, jinja=CHATML)
    named = checkpoint(tmp_path / "named", {"chat_template": [{"name": "tool_use", "template": TOOLS_JSON},
                                                              {"name": "default", "template": LLAMA_LIKE}]})
    for path in (both, named):
        template = ChatTemplate.from_checkpoint(path)
        assert template.render(CONVERSATIONS[1]) == reference(path, CONVERSATIONS[1], True)
    assert ChatTemplate.from_checkpoint(checkpoint(tmp_path / "none", {})) is None


def test_raise_exception_is_a_bad_request(tmp_path: Path) -> None:
    template = ChatTemplate.from_checkpoint(checkpoint(tmp_path / "c", {"chat_template": LLAMA_LIKE}))
    with pytest.raises(InvalidRequestError, match="bad role tool") as err:
        template.render([{"role": "user", "content": "w5"}, {"role": "tool", "content": "w6"}])
    assert err.value.field == "messages"


def test_sandboxed(tmp_path: Path) -> None:
    escape = "{{ messages.__class__.__mro__ }}"
    template = ChatTemplate.from_checkpoint(checkpoint(tmp_path / "c", {"chat_template": escape}))
    with pytest.raises(InvalidRequestError):
        template.render(CONVERSATIONS[0])


def test_the_default_model_has_one(tmp_path: Path) -> None:
    template = ChatTemplate.from_checkpoint(DEFAULT_MODEL)
    assert template is not None
    for messages in CONVERSATIONS:
        for add in (True, False):
            assert template.render(messages, add) == reference(DEFAULT_MODEL, messages, add)
    assert template.render(CONVERSATIONS[1]).endswith("# user: w9 <é> \"q\"\n# assistant:\n")
