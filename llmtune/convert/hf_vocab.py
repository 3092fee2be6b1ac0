"""A Hugging Face tokenizer folder's tokenizer as GGUF `tokenizer.*` metadata, as llama.cpp's converter writes it.

SentencePiece models (tokenizer.model, which the converter's set_vocab tries first: hf_spm.py) and
byte-level BPE tokenizers (tokenizer.json with a BPE model and a ByteLevel pre-tokenizer):
convert_hf_to_gguf.py's `_set_vocab_gpt2` (get_vocab_base: tokens with their types; get_vocab_base_pre:
the pre-tokenizer's name by the hash of the check text's ids) and gguf-py's SpecialVocab (merges,
special token ids, add_bos / add_eos, the chat template). The check text is encoded with the
`tokenizers` library (the Rust tokenizer transformers itself wraps, no torch). Any other tokenizer
(WordPiece, a tokenizer.json-only SentencePiece BPE) is refused naming what is missing.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from gguf import GGUFValueType as VT, TokenType

from llmtune.convert.hf_pretok import CHECK_TEXT, PRE_BY_HASH
from llmtune.convert.hf_spm import spm_vocab
from llmtune.errors import LlmtuneError
from llmtune.gguf.file import MetaValue

SPECIAL_TYPES = ("bos", "eos", "unk", "sep", "pad", "cls", "mask")
_ID_KEYS = {"unk": "unknown", "sep": "seperator", "pad": "padding"}  # gguf-py's key names (Keys.Tokenizer)


def _tokenizers():
    try:
        import tokenizers  # noqa: PLC0415 - optional (the hf extra): only `llmtune import` needs it
    except ImportError:
        raise LlmtuneError("llmtune import needs the tokenizers and safetensors packages: pip install llmtune[hf]") \
            from None
    return tokenizers


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise LlmtuneError(f"{path}: not readable JSON ({exc})") from None


def vocab_metadata(folder: Path, config: dict, arch: str) -> dict[str, MetaValue]:
    """Every `tokenizer.*` key the converter writes for the tokenizer in `folder`: tokenizer.model
    (SentencePiece, which set_vocab tries first: hf_spm.py), else a byte-level BPE tokenizer.json."""
    path = folder / "tokenizer.json"
    tc_path = folder / "tokenizer_config.json"
    tc = read_json(tc_path) if tc_path.is_file() else {}
    meta = {}
    if arch == "llama" and isinstance(tc.get("add_prefix_space"), bool):  # LlamaModel.set_vocab, before the rest
        meta["tokenizer.ggml.add_space_prefix"] = MetaValue(tc["add_prefix_space"], VT.BOOL)
    phi3_bpe = arch == "phi3" and tc.get("tokenizer_class") == "GPT2Tokenizer"  # Phi-4: Phi3MiniModel.set_vocab
    if (folder / "tokenizer.model").is_file() and not phi3_bpe:
        added_path = folder / "added_tokens.json"
        added = read_json(added_path) if added_path.is_file() else {}
        tok_json = read_json(path) if path.is_file() else {}
        json_added = tok_json.get("added_tokens", []) if arch == "phi3" else None
        meta.update(spm_vocab(folder / "tokenizer.model", config, added if isinstance(added, dict) else {},
                              tc.get("added_tokens_decoder") or {}, _looks_special, json_added))
        n_vocab = len(meta["tokenizer.ggml.tokens"].value)
        meta.update(special_metadata(folder, tok_json, config, merges=False, n_vocab=n_vocab))
        if arch in ("gemma2", "gemma3"):  # Gemma2Model / Gemma3Model.set_vocab, after the rest
            meta["tokenizer.ggml.add_space_prefix"] = MetaValue(False, VT.BOOL)
        return meta
    if arch in ("gemma2", "phi3") and not phi3_bpe:  # their set_vocab reads tokenizer.model only
        raise LlmtuneError(f"{folder}: has no tokenizer.model; {arch}'s converter reads its SentencePiece model")
    if not path.is_file():
        raise LlmtuneError(f"{folder}: has neither tokenizer.model (SentencePiece) nor tokenizer.json; llmtune "
                           f"import reads those two")
    tok_json = read_json(path)
    model = tok_json.get("model") or {}
    if model.get("type") != "BPE" or "ByteLevel" not in json.dumps(tok_json.get("pre_tokenizer")):
        raise LlmtuneError(f"{path}: a {model.get('type')} tokenizer without a ByteLevel pre-tokenizer and no "
                           f"tokenizer.model; llmtune import reads SentencePiece models and byte-level BPE only")
    tokenizer = _tokenizers().Tokenizer.from_file(str(path))
    tokens, types = _tokens(tokenizer, tok_json, config, path)
    meta.update({
        "tokenizer.ggml.model": MetaValue("gpt2", VT.STRING),
        "tokenizer.ggml.pre": MetaValue(_pre_name(tokenizer, path), VT.STRING),
        "tokenizer.ggml.tokens": MetaValue(tokens, VT.ARRAY, VT.STRING),
        "tokenizer.ggml.token_type": MetaValue(types, VT.ARRAY, VT.INT32),
    })
    meta.update(special_metadata(folder, tok_json, config))
    return meta


def _pre_name(tokenizer, path: Path) -> str:
    """get_vocab_base_pre: sha256 of str(ids) of the check text, special tokens added as encode() adds them."""
    ids = tokenizer.encode(CHECK_TEXT).ids
    digest = hashlib.sha256(str(ids).encode()).hexdigest()
    if digest not in PRE_BY_HASH:
        raise LlmtuneError(f"{path}: a BPE pre-tokenizer llama.cpp's converter does not name (check-text hash "
                           f"{digest[:16]}...) or llmtune's tokenizer does not know")
    return PRE_BY_HASH[digest]


def _looks_special(token: str) -> bool:
    """TextModel.does_token_look_special."""
    return (token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
            or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<｜") and token.endswith("｜>"))
            or (token.startswith("<unused") and token.endswith(">")))


def _tokens(tokenizer, tok_json: dict, config: dict, path: Path) -> tuple[list[str], list[int]]:
    """get_vocab_base: `vocab_size` tokens (config.json's, else the vocabulary's), ids without a token as
    [PAD{i}] (UNUSED), added tokens CONTROL when special or special-looking, else USER_DEFINED."""
    vocab = dict(tok_json["model"]["vocab"])
    added = {a["id"]: a for a in tok_json.get("added_tokens", [])}
    for a in added.values():
        vocab[a["content"]] = a["id"]
    reverse = {i: t for t, i in vocab.items()}
    size = int(config.get("vocab_size", len(vocab)))
    if max(reverse) >= size:
        raise LlmtuneError(f"{path}: token id {max(reverse)} is beyond config.json's vocab_size ({size})")
    tokens, types = [], []
    for i in range(size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(int(TokenType.UNUSED))
            continue
        token = reverse[i]
        if i in added and token in vocab:
            if not added[i].get("normalized", True):
                token = tokenizer.decode(tokenizer.encode(token, add_special_tokens=False).ids,
                                         skip_special_tokens=False)
            if added[i].get("special") or _looks_special(token):
                types.append(int(TokenType.CONTROL))
            else:
                token = token.replace("\u2581", " ")
                types.append(int(TokenType.USER_DEFINED))
        else:
            types.append(int(TokenType.NORMAL))
        tokens.append(token)
    return tokens, types


def _merges(tok_json: dict) -> list[str]:
    """SpecialVocab's merges: "a b" strings; pairs (transformers >= 4.45) joined, a space in a part as U+0120."""
    merges = (tok_json.get("model") or {}).get("merges") or []
    if merges and not isinstance(merges[0], str):
        merges = [" ".join("".join(chr(ord(c) + 256) if c == " " else c for c in part) for part in pair)
                  for pair in merges]
    return list(merges)


def special_metadata(folder: Path, tok_json: dict, config: dict, merges: bool = True,
                     n_vocab: int | None = None) -> dict[str, MetaValue]:
    """gguf-py SpecialVocab(load_merges=merges, n_vocab=n_vocab).add_to_gguf: merges, special ids
    (tokenizer_config.json's tokens by their tokenizer.json added_tokens id, then config.json's
    *_token_id; ids from n_vocab on skipped), add_* flags (the post-processor's, else
    tokenizer_config.json's), and the chat template. `tok_json`: {} for a folder without tokenizer.json."""
    tc_path = folder / "tokenizer_config.json"
    tc = read_json(tc_path) if tc_path.is_file() else {}
    add: dict[str, bool] = {}
    for proc in _processors(tok_json):
        if proc.get("type") == "ByteLevel":
            add.setdefault("bos", False)
            add.setdefault("eos", False)
        elif proc.get("type") == "TemplateProcessing":
            single = proc.get("single", [])
            if len(single) > 1:
                first = single[0].get("SpecialToken", {}).get("id")
                if first:  # without a tokenizer_config.json the template's own token is the BOS
                    add["bos"] = not tc or first in (_content(tc.get("bos_token")), _content(tc.get("cls_token")))
                last = single[-1].get("SpecialToken", {}).get("id")
                if last:
                    add["eos"] = not tc or last == _content(tc.get("eos_token"))
        elif proc.get("type") is not None:
            raise LlmtuneError(f"{folder / 'tokenizer.json'}: a {proc['type']} post-processor; llmtune import "
                               f"knows ByteLevel and TemplateProcessing")
    ids: dict[str, int] = {}
    added = tok_json.get("added_tokens", [])
    for typ in SPECIAL_TYPES:
        if isinstance(entry := tc.get(f"add_{typ}_token"), bool):
            add.setdefault(typ, entry)
        content = _content(tc.get(f"{typ}_token"))
        if content is not None:
            _set_id(ids, typ, next((a.get("id") for a in added if a.get("content") == content), None), n_vocab)
    for typ in SPECIAL_TYPES:
        _set_id(ids, typ, config.get(f"{typ}_token_id"), n_vocab)
    meta = {}
    if merges and (merge_list := _merges(tok_json)):
        meta["tokenizer.ggml.merges"] = MetaValue(merge_list, VT.ARRAY, VT.STRING)
    for typ, tid in ids.items():
        key = _ID_KEYS.get(typ, typ)
        meta[f"tokenizer.ggml.{key}_token_id"] = MetaValue(tid, VT.UINT32)
    for typ, value in add.items():
        meta[f"tokenizer.ggml.add_{typ}_token"] = MetaValue(value, VT.BOOL)
    if tc and (template := _chat_template(folder, tc)) is not None:  # SpecialVocab reads it beside a config only
        meta["tokenizer.chat_template"] = MetaValue(template, VT.STRING)
    return meta


def _processors(tok_json: dict) -> list[dict]:
    post = tok_json.get("post_processor")
    return [] if not post else post.get("processors", [post])


def _content(entry) -> str | None:
    if isinstance(entry, dict):
        entry = entry.get("content")
    return entry if isinstance(entry, str) else None


def _set_id(ids: dict[str, int], typ: str, tid, n_vocab: int | None = None) -> None:
    """SpecialVocab._set_special_token: the first id found for a type (under n_vocab) stays."""
    if isinstance(tid, int) and not isinstance(tid, bool) and tid >= 0 and typ not in ids \
            and (n_vocab is None or tid < n_vocab):
        ids[typ] = tid


def _chat_template(folder: Path, tc: dict) -> str | None:
    """tokenizer_config.json's chat_template, else chat_template.jinja, else chat_template.json's."""
    template = tc.get("chat_template")
    if template is None and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    elif template is None and (folder / "chat_template.json").is_file():
        template = read_json(folder / "chat_template.json").get("chat_template")
    if isinstance(template, list):  # named templates: llama.cpp's default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) else None
