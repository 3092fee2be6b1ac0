"""Chat templates: a conversation rendered to text exactly as HF transformers' apply_chat_template
renders it, from the model's own `tokenizer.chat_template` (or a --chat-template file).

Jinja2 with transformers' environment (utils/chat_template_utils.py): a sandboxed environment with
trim_blocks and lstrip_blocks, the loop-controls extension and the `{% generation %}` tag (its body
is rendered as is), `raise_exception(message)`, `strftime_now(format)`, and a `tojson` filter that
keeps non-ASCII characters; the template sees `messages`, `add_generation_prompt`, `tools` and
`documents` (None), and the special tokens as strings (`bos_token`, `eos_token`, `unk_token`,
`pad_token` when the vocabulary has them). The text is then tokenized as transformers does for a
chat, without adding special tokens (the template writes BOS itself) and with special-token
strings parsed: `encode`.

Errors are one line naming where the template came from and its line: a syntax error when the
template is loaded, a `raise_exception` (or any failure) when it renders.
"""

from __future__ import annotations

import json
import sys
from datetime import datetime
from pathlib import Path
from typing import Optional

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from llmtune.errors import LlmtuneError
from llmtune.tokenizer import tokenizer as tk

TEMPLATE_KEY = "tokenizer.chat_template"


class ChatTemplateError(LlmtuneError):
    """The template failed to render (the message says where in the template)."""


def _environment():

    class GenerationTag(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (transformers' AssistantTracker): renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def _template_line(tb, filename: str = "<template>") -> Optional[int]:
    """The last template line in a traceback (jinja2 rewrites frames to the template's lines)."""
    line = None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == filename:
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


class ChatTemplate:
    """A compiled chat template and the special-token strings it is rendered with."""

    def __init__(self, source: str, origin: str, special: Optional[dict] = None):

        self.source, self.origin = source, origin
        self.special = dict(special or {})
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise LlmtuneError(f"{origin}: line {exc.lineno}: chat template syntax error: {exc.message}") from None

    @classmethod
    def for_model(cls, gf, tokenizer=None, override: Optional[str | Path] = None,
                  flag: str = "--chat-template") -> "ChatTemplate":
        """The template of a GGUF (`tokenizer.chat_template`), or the file `override` names; a
        model without one is an error naming the flag that supplies it."""
        special = special_tokens(tokenizer) if tokenizer is not None else {}
        if override is not None:
            path = Path(override)
            if not path.is_file():
                raise LlmtuneError(f"{path}: no such file ({flag})")
            try:
                source = tk.strip_bom(path.read_bytes()).decode("utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise LlmtuneError(f"{path}: cannot read the chat template ({exc})") from None
            return cls(source, str(path), special)
        source = gf.metadata.get(TEMPLATE_KEY)
        if not isinstance(source, str) or not source.strip():
            raise LlmtuneError(f"{gf.path}: the model has no chat template ({TEMPLATE_KEY}); give one with "
                               f"{flag} FILE.jinja")
        return cls(source, f"{gf.path} ({TEMPLATE_KEY})", special)

    def render(self, messages: list[dict], add_generation_prompt: bool = False, **kwargs) -> str:
        """The conversation as text (transformers' render_jinja_template for one chat)."""
        values = {**self.special, **kwargs}
        # transformers drops the keys whose value is None (templates handle a missing key)
        messages = [{k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m for m in messages]
        try:
            return self._template.render(messages=messages, tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt, **values)
        except Exception as exc:  # noqa: BLE001 - any failure inside the template is the template's
            line = _template_line(sys.exc_info()[2])
            where = f"line {line}: " if line else ""
            msg = getattr(exc, "message", None) or str(exc) or type(exc).__name__
            raise ChatTemplateError(f"{self.origin}: {where}the chat template failed: {msg}") from None


def special_tokens(tokenizer) -> dict[str, str]:
    """bos_token, eos_token, unk_token, pad_token as the template sees them (those the vocabulary has)."""
    out = {}
    for name, token_id in (("bos_token", tokenizer.bos_id), ("eos_token", tokenizer.eos_id),
                           ("unk_token", tokenizer.unk_id), ("pad_token", tokenizer.pad_id)):
        if token_id is not None and 0 <= token_id < tokenizer.n_vocab:
            out[name] = tokenizer.tokens[token_id]
    return out


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of rendered chat text: no BOS/EOS added, special-token strings parsed
    (transformers' apply_chat_template(tokenize=True); llama.cpp's common_tokenize(.., true))."""
    return tokenizer.encode(text, add_special=False, parse_special=True)


def eog_ids(tok) -> set[int]:
    """llama.cpp's special_eog_ids (llama-vocab.cpp): EOS, EOT, EOM, the FIM pad/repo/sep tokens,
    and every token whose text is an end-of-generation marker, less the exceptions llama.cpp makes
    (harmony's <|end|>, gemma4's normal </s>)."""
    special = getattr(tok, "_special", {})
    texts = list(tok.tokens)
    ids = {special.get(k) for k in ("fim_pad", "fim_rep", "fim_sep", "eos", "eot", "eom")}
    ids |= {i for i, t in enumerate(texts) if t in tk._EOG_TEXTS}
    ids.discard(None)
    has = {texts[i] for i in ids}
    if "<|end|>" in has and ("<|call|>" in has or "<|calls|>" in has) and ("<|return|>" in has or "<|flush|>" in has):
        ids -= {i for i in ids if texts[i] == "<|end|>"}
    if "<|tool_response>" in has and "</s>" in has:
        ids -= {i for i in ids if texts[i] == "</s>"}
    return {int(i) for i in ids}
