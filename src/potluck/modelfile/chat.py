"""Chat messages -> prompt text, with the file's `tokenizer.chat_template` or a built-in one.

Templates are untrusted code from the model file, so they run in Jinja's immutable sandbox with the
helpers Hugging Face templates expect (`raise_exception`, `strftime_now`, a `tojson` that does not
escape HTML, the `{% generation %}` tag). A file without a template gets a built-in one chosen by
architecture. Built-ins do not write the BOS token: `Tokenizer.encode` adds it by the file's rule
(and adds no second one when a file's template did write it).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cache
from typing import Any

import jinja2
from gguf import Keys
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from potluck.errors import PotluckError, UnsupportedError

_K = Keys.Tokenizer


class ChatTemplateError(PotluckError):
    """A chat template that does not compile, or that fails on the messages it is given."""


# ChatML (Qwen, SmolLM, many fine-tunes).
CHATML = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Gemma: roles user/model, strict alternation, the system prompt opens the first user turn.
GEMMA = (
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] + '\\n\\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set system = '' %}{% set turns = messages %}{% endif %}"
    "{% for m in turns %}"
    "{% if (m['role'] == 'user') != (loop.index0 is even) %}"
    "{{ raise_exception('Gemma needs turns that alternate user/assistant, starting with user') }}"
    "{% endif %}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\\n' }}"
    "{{ (system if loop.first else '') + m['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)

# Llama 2 / Mistral: every user turn in [INST] ... [/INST], the system prompt in <<SYS>> inside the
# first; the model answers right after [/INST], so there is no separate generation prompt.
LLAMA2 = (
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] | trim %}{% set turns = messages[1:] %}"
    "{% else %}{% set system = '' %}{% set turns = messages %}{% endif %}"
    "{% for m in turns %}"
    "{% if (m['role'] == 'user') != (loop.index0 is even) %}"
    "{{ raise_exception('Llama 2 needs turns that alternate user/assistant, starting with user') }}"
    "{% endif %}"
    "{% if m['role'] == 'user' %}"
    "{% set text = m['content'] | trim %}"
    "{% if loop.first and system %}{% set text = '<<SYS>>\\n' + system + '\\n<</SYS>>\\n\\n' + text %}"
    "{% endif %}"
    "{{ bos_token + '[INST] ' + text + ' [/INST]' }}"
    "{% else %}{{ ' ' + m['content'] | trim + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)

BUILTIN_TEMPLATES = {"chatml": CHATML, "gemma": GEMMA, "llama2": LLAMA2}
# Built-in template per architecture, for files without one. A llama or mistral vocabulary that has
# <|im_start|> / <|im_end|> belongs to a ChatML fine-tune and gets ChatML instead.
BUILTIN_BY_ARCH = {
    "gemma": "gemma",
    "gemma2": "gemma",
    "gemma3": "gemma",
    "qwen2": "chatml",
    "qwen3": "chatml",
    "llama": "llama2",
    "mistral": "llama2",
}


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` (HF's marker of assistant text) renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@cache
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, "jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _text(content: Any) -> Any:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    return content


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


class ChatTemplate:
    """A compiled chat template. Raises ChatTemplateError if `source` does not compile."""

    def __init__(
        self, source: str, bos_token: str = "", eos_token: str = "", name: str = "file"
    ) -> None:
        self.source = source
        self.name = name
        self.builtin = name.startswith("built-in")
        self.bos_token = bos_token
        self.eos_token = eos_token
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(
                f"chat template ({name}) does not compile: {_one_line(exc)}"
            ) from exc

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any], arch: str | None = None) -> ChatTemplate:
        """The file's template, else the built-in one for `arch` (default: general.architecture).

        Raises UnsupportedError when the file has no template and there is no built-in for arch.
        """
        arch = arch or metadata.get(Keys.General.ARCHITECTURE) or "?"
        tokens: Sequence[str] = metadata.get(_K.LIST) or []

        def token(key: str) -> str:
            i = metadata.get(key)
            return tokens[i] if i is not None and 0 <= i < len(tokens) else ""

        bos, eos = token(_K.BOS_ID), token(_K.EOS_ID)
        source = metadata.get(_K.CHAT_TEMPLATE)
        if source:
            return cls(source, bos, eos, name="file")
        name = BUILTIN_BY_ARCH.get(arch)
        if "<|im_start|>" in tokens and "<|im_end|>" in tokens and name in (None, "llama2"):
            name = "chatml"
        if name is None:
            raise UnsupportedError(
                f"the file has no chat template and there is no built-in one for architecture "
                f"{arch!r} (built-ins: {', '.join(sorted(BUILTIN_BY_ARCH))}); use plain completion"
            )
        return cls(BUILTIN_TEMPLATES[name], bos, eos, name=f"built-in {name}")

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **variables: Any,
    ) -> str:
        """The prompt text for `messages` ({"role", "content"} dicts); `variables` go to the
        template as well (tools, enable_thinking, ...). Raises ChatTemplateError."""
        context = {"bos_token": self.bos_token, "eos_token": self.eos_token, **variables}
        plain = [dict(m) for m in messages]
        if self.builtin:  # ours take text only: join the text parts of OpenAI-style content lists
            plain = [m | {"content": _text(m.get("content"))} for m in plain]
        try:
            return self._template.render(
                messages=plain,
                add_generation_prompt=add_generation_prompt,
                **context,
            )
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError) as exc:
            raise ChatTemplateError(
                f"chat template ({self.name}) failed: {_one_line(exc)}"
            ) from exc
