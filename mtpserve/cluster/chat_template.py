"""The checkpoint's chat template, rendered with jinja2 the way transformers' apply_chat_template does.

Where it comes from, in transformers' order: `chat_template.jinja` in the checkpoint directory, else the
`chat_template` key of tokenizer_config.json (a string, or a list of named templates of which we use
"default"). The environment matches transformers': a sandbox, trim_blocks and lstrip_blocks, the
loopcontrols extension, `raise_exception`, `strftime_now`, a `tojson` that does not escape HTML, and the
tokenizer's special tokens (bos_token, eos_token, ...) as variables.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mtpserve.errors import InvalidRequestError

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    return env


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str] | None = None) -> None:
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self._template = _environment().from_string(source)

    @staticmethod
    def from_checkpoint(checkpoint: str | Path) -> "ChatTemplate | None":
        """The checkpoint's template, or None when it has none."""
        path = Path(checkpoint)
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        specials = {k: t for k in SPECIAL_TOKEN_KEYS if (t := _token_text(config.get(k))) is not None}
        jinja_file = path / "chat_template.jinja"
        if jinja_file.is_file():
            return ChatTemplate(jinja_file.read_text(), specials)
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: [{"name": "default", "template": ...}, ...]
            source = next((t.get("template") for t in source if t.get("name") == "default"), None)
        return ChatTemplate(source, specials) if isinstance(source, str) else None

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               **variables: Any) -> str:
        """The prompt text; a template that refuses the conversation (raise_exception) is a bad request."""
        context = {**self.special_tokens, "tools": None, "documents": None, **variables, "messages": messages,
                   "add_generation_prompt": add_generation_prompt}
        try:
            return self._template.render(**context)
        except (jinja2.exceptions.TemplateError, TypeError, ValueError) as e:
            raise InvalidRequestError("messages", f"the chat template refused them: {e}") from e
