"""GGUF reading and writing through the `gguf` package.

Shapes: GGUF stores `ne[0]` as the fastest axis; numpy shapes here are the reverse
(a GGUF tensor with ne = [64, 512] is a numpy (512, 64) array). All tensors are exposed
in this logical numpy shape.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import gguf
from gguf import GGMLQuantizationType as QT, GGUFValueType as VT

from llmtune.errors import LlmtuneError

# Keys the writer recreates itself; never copied from metadata.
_WRITER_OWNED_KEYS = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.alignment"}

FLOAT_TYPES = {"f32": QT.F32, "f16": QT.F16, "bf16": QT.BF16}


@dataclass(frozen=True)
class MetaValue:
    """One metadata value with the GGUF types needed to write it back unchanged."""

    value: Any
    type: VT
    sub_type: VT | None = None


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # logical numpy shape (GGUF ne reversed)
    type: QT
    raw: np.ndarray  # memory-mapped bytes/elements as stored
    n_bytes: int

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape))


def _field_value(field: gguf.ReaderField) -> MetaValue:
    main = field.types[0]
    if main == VT.ARRAY:
        sub = field.types[-1] if len(field.types) > 1 else None
        if sub == VT.STRING:
            val = [bytes(field.parts[i]).decode("utf-8", errors="surrogateescape") for i in field.data]
        elif sub is None:
            val = []
        else:
            val = np.concatenate([field.parts[i] for i in field.data]) if field.data else np.zeros(0)
            val = val.tolist()
        return MetaValue(val, main, sub)
    if main == VT.STRING:
        return MetaValue(bytes(field.parts[field.data[0]]).decode("utf-8", errors="surrogateescape"), main)
    return MetaValue(field.parts[field.data[0]].tolist()[0], main)


class GGUFFile:
    """A GGUF file opened read-only and memory-mapped.

    `metadata` maps every key to its python value; `meta_types` keeps the GGUF types so a
    writer reproduces them. Tensors are not read until asked for.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.exists():
            raise LlmtuneError(f"{self.path}: no such file")
        if self.path.is_dir():
            raise LlmtuneError(f"{self.path}: is a directory, not a GGUF file")
        with open(self.path, "rb") as fh:
            magic = fh.read(4)
        if magic != b"GGUF":
            raise LlmtuneError(f"{self.path}: not a GGUF file (bad magic {magic!r})")
        try:
            reader = gguf.GGUFReader(self.path, "r")
        except Exception as exc:  # the gguf package raises a mix of ValueError/IndexError/etc.
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise LlmtuneError(f"{self.path}: corrupt or truncated GGUF ({reason})") from None
        self._reader = reader
        self.meta: dict[str, MetaValue] = {}
        for key, field in reader.fields.items():
            if key in _WRITER_OWNED_KEYS:
                continue
            try:
                self.meta[key] = _field_value(field)
            except Exception:
                raise LlmtuneError(f"{self.path}: corrupt metadata value for key {key!r}") from None
        self.tensors: dict[str, TensorInfo] = {}
        size = self.path.stat().st_size
        for t in reader.tensors:
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            if t.data_offset + t.n_bytes > size:
                raise LlmtuneError(f"{self.path}: truncated GGUF (tensor {t.name} runs past the end of the file)")
            self.tensors[t.name] = TensorInfo(t.name, shape, QT(t.tensor_type), t.data, int(t.n_bytes))

    # -- metadata ---------------------------------------------------------------------
    @property
    def metadata(self) -> dict[str, Any]:
        return {k: v.value for k, v in self.meta.items()}

    def get(self, key: str, default: Any = None) -> Any:
        mv = self.meta.get(key)
        return default if mv is None else mv.value

    @property
    def arch(self) -> str:
        arch = self.get("general.architecture")
        if arch is None:
            raise LlmtuneError(f"{self.path}: missing general.architecture")
        return arch

    # -- tensors ----------------------------------------------------------------------
    def tensor(self, name: str, dtype=np.float32) -> np.ndarray:
        """The tensor `name` in logical numpy shape, dequantized to `dtype`."""
        info = self.tensors.get(name)
        if info is None:
            raise LlmtuneError(f"{self.path}: missing tensor {name!r}")
        return dequantize_tensor(info, self.path).astype(dtype, copy=False)

    def n_params(self) -> int:
        return sum(t.n_elements for t in self.tensors.values())


def dequantize_tensor(info: TensorInfo, path: Path | str = "") -> np.ndarray:
    if info.type == QT.F32:
        return np.asarray(info.raw, dtype=np.float32).reshape(info.shape)
    try:
        out = gguf.quants.dequantize(np.asarray(info.raw), info.type)
    except NotImplementedError:
        raise LlmtuneError(f"{path}: tensor {info.name} has unsupported type {info.type.name}") from None
    return out.reshape(info.shape)


def load_gguf(path: str | os.PathLike) -> GGUFFile:
    return GGUFFile(path)


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def check_output_path(out: str | os.PathLike, *inputs: str | os.PathLike) -> Path:
    """Refuse to write over an input file; returns the output path."""
    out = Path(out)
    for src in inputs:
        if _same_file(out, Path(src)) or out.resolve() == Path(src).resolve():
            raise LlmtuneError(f"{out}: refusing to overwrite the input file; choose another -o path")
    if out.is_dir():
        raise LlmtuneError(f"{out}: is a directory; give a file name with -o")
    if not out.resolve().parent.exists():
        raise LlmtuneError(f"{out}: directory {out.resolve().parent} does not exist")
    return out


TensorSpec = tuple[str, np.ndarray, QT]  # name, data (float array, or raw quantized bytes), stored type


def write_gguf(
    path: str | os.PathLike,
    arch: str,
    meta: dict[str, MetaValue],
    tensors: Iterable[TensorSpec],
    *,
    inputs: Iterable[str | os.PathLike] = (),
    progress=None,
) -> Path:
    """Write a GGUF atomically (temp file in the same folder, then rename).

    `tensors` yields (name, array, type). A float array is converted to F32/F16/BF16 as asked;
    for a quantized type, pass the already-quantized uint8 block array (logical shape in bytes,
    as `gguf.quants.quantize` returns). `progress(name)` is called after each tensor.
    """
    path = check_output_path(path, *inputs)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=str(path.resolve().parent))
    os.close(fd)
    try:
        writer = gguf.GGUFWriter(tmp, arch)
        for key, mv in meta.items():
            if key in _WRITER_OWNED_KEYS or key == "general.architecture":
                continue
            writer.add_key_value(key, mv.value, mv.type, mv.sub_type)
        items = []
        for name, data, qtype in tensors:
            items.append((name, _encode(data, qtype), qtype))
        for name, arr, qtype in items:
            writer.add_tensor(name, arr, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def _encode(data: np.ndarray, qtype: QT) -> np.ndarray:
    if qtype == QT.F32:
        return np.ascontiguousarray(data, dtype=np.float32)
    if qtype == QT.F16:
        return np.ascontiguousarray(data, dtype=np.float16)
    if qtype == QT.BF16:
        if data.dtype == np.uint8:
            return data
        return gguf.quants.quantize(np.ascontiguousarray(data, dtype=np.float32), QT.BF16)
    if data.dtype != np.uint8:
        raise ValueError(f"tensor for {qtype.name} must be pre-quantized uint8 blocks")
    return data
