"""Architecture families: one module per family in this package, each registering a Family
subclass with `@register` (found automatically: adding a family edits nothing else).

    get_family("llama")          the Family for a `general.architecture` value
    read_hparams(md, names, src) hyper-parameters of a GGUF's metadata, through its family
    check_tensors(...)           the file's tensors against the family's list (names, shapes)
    hf_names("llama", source)    the family's names in Hugging Face checkpoints (hf_names.py)
"""

from __future__ import annotations

import importlib
import pkgutil

from llmtune.arch.family import Family
from llmtune.arch.hparams import MetaKeys
from llmtune.errors import LlmtuneError

_FAMILIES: dict = {}
_SHARED_MODULES = {"context", "family", "hf_names", "hparams"}  # the machinery, not families
_discovered = False


def register(cls):
    """Class decorator: make a Family subclass available under its `name`."""
    if not cls.name:
        raise ValueError(f"{cls.__name__}: a family needs a name (its general.architecture)")
    _FAMILIES[cls.name] = cls()
    return cls


def _discover() -> None:
    global _discovered
    if not _discovered:
        _discovered = True
        for info in pkgutil.iter_modules(__path__):
            if info.name not in _SHARED_MODULES:
                importlib.import_module(f"{__name__}.{info.name}")


def supported() -> list[str]:
    _discover()
    return sorted(_FAMILIES)


def get_family(arch, source: str = ""):
    _discover()
    family = _FAMILIES.get(arch) if isinstance(arch, str) else None
    if family is None:
        raise LlmtuneError(f"{source}: unsupported architecture {arch!r} (supported: {', '.join(supported())})")
    return family


def hf_names(arch, source: str = ""):
    """The family's HFNames (its tensors' names in Hugging Face checkpoints); a family without
    one is refused in one line naming it and the families that have one."""
    family = get_family(arch, source)
    if family.hf is None:
        mapped = ", ".join(n for n in supported() if _FAMILIES[n].hf is not None)
        raise LlmtuneError(f"{source}: the {arch} family has no Hugging Face tensor names in llmtune "
                           f"(mapped: {mapped})")
    return family.hf


def read_hparams(md: dict, tensor_names: set[str] | None = None, source: str = "", *, any_arch: bool = False):
    """Hyper-parameters from `{arch}.*` keys (llama.cpp's load_hparams for the file's family).

    `tensor_names` (when given) decides `tied_output`: no output.weight means the output
    projection reuses token_embd.weight, as llama.cpp does. any_arch: read an architecture
    llmtune cannot run with the keys every decoder shares (for `info`)."""

    arch = md.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise LlmtuneError(f"{source}: missing general.architecture")
    family = Family() if any_arch and arch not in supported() else get_family(arch, source)
    tokens = md.get("tokenizer.ggml.tokens")
    n_vocab_default = len(tokens) if isinstance(tokens, list) else 0
    hp = family.read_hparams(MetaKeys(md, arch, source), n_vocab_default, tensor_names)
    hp.check(source)
    return hp


def check_tensors(hp, shapes: dict[str, tuple], source: str) -> list:
    """The family's TensorSpecs present in a file whose tensors have `shapes` (numpy order).

    A missing required tensor, a wrong shape, or a tensor the family does not know is a user
    error: weights are never silently ignored."""
    specs = get_family(hp.arch, source).tensors(hp)
    known = {s.name for s in specs}
    for name in shapes:
        if name not in known:
            raise LlmtuneError(f"{source}: tensor {name} is not part of the {hp.arch} architecture as llmtune knows it")
    present = []
    for spec in specs:
        shape = shapes.get(spec.name)
        if shape is None:
            if not spec.optional:
                raise LlmtuneError(f"{source}: missing tensor {spec.name}")
            continue
        if tuple(shape) != tuple(spec.shape):
            raise LlmtuneError(f"{source}: tensor {spec.name} has shape {tuple(shape)}, expected {tuple(spec.shape)}")
        present.append(spec)
    return present
