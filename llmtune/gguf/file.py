"""GGUF reading and writing.

File layout (GGUF v2/v3, little-endian): a header (magic "GGUF", version, tensor count,
metadata count), the metadata entries (key, value type, value), one descriptor per tensor
(name, dims, type, offset), padding to `general.alignment` (default 32), then the tensor data,
each tensor at an aligned offset from the start of the data section.

We parse and write this layout ourselves and take only the type tables and quantization
kernels from the `gguf` package: `gguf.GGUFReader` builds numpy views per string (about 2 s
to open a 50k-token vocabulary) and reports damaged files with messages such as "index 0 is
out of bounds", where a user needs "file ends inside the tensor data".

Shapes: GGUF stores `ne[0]` as the fastest axis; numpy shapes here are the reverse (a GGUF
tensor with ne = [64, 512] is a numpy (512, 64) array). All tensors are exposed in this
logical numpy shape.
"""

from __future__ import annotations

import math
import mmap as mmap_module
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT, GGUFValueType as VT

from llmtune.errors import LlmtuneError
from llmtune.resources import write_atomically

GGUF_MAGIC = b"GGUF"
GZIP_MAGIC = b"\x1f\x8b"  # a .gguf.gz downloaded as it is
READ_VERSIONS = (2, 3)  # v1 used 32-bit counts and is long obsolete
WRITE_VERSION = 3
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_NESTING = 16  # arrays of arrays (llama.cpp reads none; the gguf package writes them)
_INT64_MAX = 2**63 - 1

# Pseudo-keys some tools report (gguf.GGUFReader) that are not metadata entries; never written.
_WRITER_OWNED_KEYS = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}

FLOAT_TYPES = {"f32": QT.F32, "f16": QT.F16, "bf16": QT.BF16}

_SCALAR_FORMATS = {
    VT.UINT8: "<B", VT.INT8: "<b", VT.UINT16: "<H", VT.INT16: "<h",
    VT.UINT32: "<I", VT.INT32: "<i", VT.FLOAT32: "<f", VT.BOOL: "<?",
    VT.UINT64: "<Q", VT.INT64: "<q", VT.FLOAT64: "<d",
}
_SCALARS = {vt: struct.Struct(fmt) for vt, fmt in _SCALAR_FORMATS.items()}
_ARRAY_DTYPES = {vt: np.dtype(fmt) for vt, fmt in _SCALAR_FORMATS.items()}
_U32, _U64 = _SCALARS[VT.UINT32], _SCALARS[VT.UINT64]

# Tensor types stored as plain numpy elements; every other type is exposed as uint8 block bytes
# of shape (..., bytes per row), as `gguf.quants.quantize` returns them.
_ELEMENT_DTYPES = {
    QT.F32: np.dtype("<f4"), QT.F16: np.dtype("<f2"), QT.F64: np.dtype("<f8"),
    QT.I8: np.dtype("i1"), QT.I16: np.dtype("<i2"), QT.I32: np.dtype("<i4"), QT.I64: np.dtype("<i8"),
}


@dataclass(frozen=True)
class MetaValue:
    """One metadata value with the GGUF types needed to write it back unchanged.

    Arrays hold a python list; an array of arrays holds a list of MetaValue (each inner
    array keeps its own element type).
    """

    value: Any
    type: VT
    sub_type: VT | None = None


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # logical numpy shape (GGUF ne reversed)
    type: QT
    raw: np.ndarray  # memory-mapped elements (float/int types) or uint8 block bytes (others)
    n_bytes: int

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape))


# --------------------------------------------------------------------------------------------
# reading
# --------------------------------------------------------------------------------------------


class _Truncated(Exception):
    """The parser needed bytes past the end of the file."""


class _Corrupt(Exception):
    """The bytes are there but make no sense."""


class _Cursor:
    """Sequential little-endian reads from a buffer; running past its end raises _Truncated."""

    def __init__(self, buf: memoryview):
        self.buf = buf
        self.pos = 0
        self.size = len(buf)

    def take(self, n: int) -> int:
        """Consume n bytes; returns where they start."""
        start = self.pos
        if start + n > self.size:
            raise _Truncated
        self.pos = start + n
        return start

    def scalar(self, fmt: struct.Struct):
        return fmt.unpack_from(self.buf, self.take(fmt.size))[0]

    def string(self) -> str:
        n = self.scalar(_U64)
        start = self.take(n)
        return str(self.buf[start : start + n], "utf-8", "surrogateescape")

    def strings(self, count: int) -> list[str]:
        """`count` strings in a row (a vocabulary's tokens and merges: 100k+ of them, so one tight
        loop rather than a method call per string: time to first token)."""
        buf, pos, size, unpack = self.buf, self.pos, self.size, _U64.unpack_from
        out = []
        append = out.append
        for _ in range(count):
            if pos + 8 > size:
                raise _Truncated
            end = pos + 8 + unpack(buf, pos)[0]
            if end > size:
                raise _Truncated
            append(str(buf[pos + 8 : end], "utf-8", "surrogateescape"))
            pos = end
        self.pos = pos
        return out


def _value_type(raw: int) -> VT:
    try:
        return VT(raw)
    except ValueError:
        raise _Corrupt(f"unknown metadata value type {raw}") from None


def _read_value(cur: _Cursor, vtype: VT, depth: int = 0) -> MetaValue:
    if vtype == VT.STRING:
        return MetaValue(cur.string(), vtype)
    if vtype == VT.ARRAY:
        if depth >= MAX_ARRAY_NESTING:
            raise _Corrupt(f"arrays nested more than {MAX_ARRAY_NESTING} deep")
        sub = _value_type(cur.scalar(_U32))
        count = cur.scalar(_U64)
        return MetaValue(_read_array(cur, sub, count, depth), vtype, sub)
    return MetaValue(cur.scalar(_SCALARS[vtype]), vtype)


def _read_array(cur: _Cursor, sub: VT, count: int, depth: int) -> list:
    if sub in _ARRAY_DTYPES:
        dtype = _ARRAY_DTYPES[sub]
        start = cur.take(count * dtype.itemsize)
        return np.frombuffer(cur.buf, dtype, count, start).tolist()
    min_item = 8 if sub == VT.STRING else 12  # string length / inner type + count
    if count * min_item > cur.size - cur.pos:
        raise _Truncated
    if sub == VT.STRING:
        return cur.strings(count)
    return [_read_value(cur, VT.ARRAY, depth + 1) for _ in range(count)]


@dataclass(frozen=True)
class _Descriptor:
    name: str
    ne: tuple[int, ...]
    type_id: int
    offset: int


def _read_header(cur: _Cursor, path: Path) -> tuple[int, int, int]:
    cur.take(4)  # magic, checked before
    version = cur.scalar(_U32)
    if version not in READ_VERSIONS:
        if version & 0xFFFF == 0 and (version >> 16) in READ_VERSIONS:
            raise LlmtuneError(f"{path}: big-endian GGUF files are not supported")
        raise LlmtuneError(f"{path}: unsupported GGUF version {version} (llmtune reads versions 2 and 3)")
    return version, cur.scalar(_U64), cur.scalar(_U64)


def _parse_layout(path: Path, buf: memoryview):
    """Header, metadata and tensor descriptors; errors say where the file stops making sense."""
    cur = _Cursor(buf)
    where = "the header"
    try:
        version, n_tensors, n_kv = _read_header(cur, path)
        meta: dict[str, MetaValue] = {}
        for i in range(n_kv):
            where = f"metadata entry {i + 1} of {n_kv}"
            key = cur.string()
            where += f" ({key!r})"
            vtype = _value_type(cur.scalar(_U32))
            if key in meta:
                raise _Corrupt(f"duplicate metadata key {key!r}")
            meta[key] = _read_value(cur, vtype)
        descriptors = []
        for i in range(n_tensors):
            where = f"tensor descriptor {i + 1} of {n_tensors}"
            name = cur.string()
            n_dims = cur.scalar(_U32)
            if not 1 <= n_dims <= MAX_DIMS:
                raise _Corrupt(f"tensor {name!r} has {n_dims} dimensions (1..{MAX_DIMS} allowed)")
            ne = struct.unpack_from(f"<{n_dims}Q", buf, cur.take(8 * n_dims))
            descriptors.append(_Descriptor(name, ne, cur.scalar(_U32), cur.scalar(_U64)))
    except _Truncated:
        raise LlmtuneError(f"{path}: truncated GGUF (the file ends inside {where})") from None
    except _Corrupt as exc:
        raise LlmtuneError(f"{path}: corrupt GGUF ({exc} in {where})") from None
    return version, meta, descriptors, cur.pos


def _alignment(path: Path, meta: dict[str, MetaValue]) -> int:
    mv = meta.get("general.alignment")
    if mv is None:
        return DEFAULT_ALIGNMENT
    if mv.type != VT.UINT32 or mv.value <= 0 or mv.value & (mv.value - 1):
        raise LlmtuneError(f"{path}: corrupt GGUF (general.alignment must be a power of two, got {mv.value!r})")
    return mv.value


def _align(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


def _tensor_type(path: Path, d: _Descriptor) -> QT:
    try:
        qtype = QT(d.type_id)
    except ValueError:
        raise LlmtuneError(f"{path}: tensor {d.name!r} has unsupported type id {d.type_id}") from None
    if qtype not in gguf.GGML_QUANT_SIZES:
        raise LlmtuneError(f"{path}: tensor {d.name!r} has unsupported type {qtype.name}")
    return qtype


class GGUFFile:
    """A GGUF file opened read-only and memory-mapped.

    `meta` maps every key to its MetaValue (value + GGUF types, enough to write it back
    unchanged); `metadata` gives the plain values. Tensor data is not read until asked for.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.file_size = _check_readable_gguf(self.path)
        try:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as exc:
            raise LlmtuneError(f"{self.path}: cannot map file ({exc})") from None
        self.version, self.meta, descriptors, end = _parse_layout(self.path, memoryview(self._mm))
        self.alignment = _alignment(self.path, self.meta)
        self.data_offset = _align(end, self.alignment)
        self.tensors: dict[str, TensorInfo] = {}
        for d in descriptors:
            if d.name in self.tensors:
                raise LlmtuneError(f"{self.path}: corrupt GGUF (duplicate tensor {d.name!r})")
            self.tensors[d.name] = self._tensor_info(d)
        _check_no_overlap(self.path, descriptors, self.tensors)

    def drop_pages(self, part: np.ndarray | None = None) -> None:
        """Let the kernel drop the mapped pages read so far (madvise MADV_DONTNEED): they are clean
        file pages, read back on the next access. A full finetune copies every tensor into its
        trained buffer; without this the copied pages stay resident and count twice. part: only
        the whole pages under that array, when it is a view of this file's mapping (a frozen
        matrix now multiplied through its packed copies); anything else is left alone, since
        MADV_DONTNEED would zero memory of its own."""
        mm = getattr(self._mm, "_mmap", None)
        if mm is None or not hasattr(mm, "madvise") or not hasattr(mmap_module, "MADV_DONTNEED"):
            return
        if part is None:
            mm.madvise(mmap_module.MADV_DONTNEED)
            return
        if not self.maps(part):
            return
        start = part.__array_interface__["data"][0] - self._mm.__array_interface__["data"][0]
        stop = start + part.nbytes
        page = mmap_module.PAGESIZE
        first, last = -(-start // page) * page, stop // page * page
        if first < last:
            mm.madvise(mmap_module.MADV_DONTNEED, first, last - first)

    def maps(self, part: np.ndarray) -> bool:
        """Whether `part` is a contiguous view of this file's mapping (a tensor read from it, not a
        copy): its bytes are the kernel's clean file pages, read in as they are used."""
        start = part.__array_interface__["data"][0] - self._mm.__array_interface__["data"][0]
        return part.flags.c_contiguous and 0 <= start and start + part.nbytes <= self._mm.nbytes

    def _tensor_info(self, d: _Descriptor) -> TensorInfo:
        qtype = _tensor_type(self.path, d)
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        if d.ne[0] % block:
            raise LlmtuneError(
                f"{self.path}: corrupt GGUF (tensor {d.name!r}: row of {d.ne[0]} is not a multiple of "
                f"the {qtype.name} block size {block})"
            )
        # llama.cpp wants every dimension and the element count in int64; numpy the byte size
        bound = type_size
        for n in d.ne:
            bound *= max(n, 1)
        if bound // block > _INT64_MAX:
            raise LlmtuneError(f"{self.path}: corrupt GGUF (tensor {d.name!r} has impossible dimensions {list(d.ne)})")
        if d.offset % self.alignment:
            raise LlmtuneError(
                f"{self.path}: corrupt GGUF (tensor {d.name!r} data offset {d.offset:,} is not a multiple of "
                f"the alignment {self.alignment})"
            )
        shape = tuple(int(n) for n in reversed(d.ne))
        n_bytes = int(np.prod(shape, dtype=object)) // block * type_size
        start = self.data_offset + d.offset
        if start + n_bytes > self.file_size:
            raise LlmtuneError(
                f"{self.path}: truncated GGUF (the file ends inside the tensor data: {d.name!r} needs bytes "
                f"up to {start + n_bytes:,}, the file has {self.file_size:,})"
            )
        raw = self._mm[start : start + n_bytes]
        dtype = _ELEMENT_DTYPES.get(qtype)
        if dtype is not None:
            raw = raw.view(dtype).reshape(shape)
        else:
            raw = raw.reshape(gguf.quants.quant_shape_to_byte_shape(shape, qtype))
        return TensorInfo(d.name, shape, qtype, raw, n_bytes)

    # -- metadata ---------------------------------------------------------------------
    @property
    def metadata(self) -> dict[str, Any]:
        return plain_metadata(self.meta)

    def get(self, key: str, default: Any = None) -> Any:
        mv = self.meta.get(key)
        return default if mv is None else _plain(mv)

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


def _check_no_overlap(path: Path, descriptors: list[_Descriptor], tensors: dict[str, TensorInfo]) -> None:
    """Each byte of the data section belongs to at most one tensor (llama.cpp refuses shared data)."""
    spans = sorted(  # by offset, then in file order
        (d.offset, i, d.offset + tensors[d.name].n_bytes, d.name) for i, d in enumerate(descriptors)
                   if tensors[d.name].n_bytes
    )
    prev_start, prev_end, prev_name = 0, 0, None
    for start, _, end, name in spans:
        if start < prev_end:
            where = (
                f"both start at data offset {start:,}" if start == prev_start
                else f"{name!r} starts at data offset {start:,}, before {prev_name!r} ends at {prev_end:,}"
            )  # fmt: skip
            raise LlmtuneError(f"{path}: corrupt GGUF (tensors {prev_name!r} and {name!r} share data: {where})")
        if end > prev_end:
            prev_start, prev_end, prev_name = start, end, name


def plain_metadata(meta: dict[str, MetaValue]) -> dict[str, Any]:
    """The plain values of metadata entries (what GGUFFile.metadata gives for a file's)."""
    return {k: _plain(v) for k, v in meta.items()}


def _plain(mv: MetaValue) -> Any:
    if mv.type == VT.ARRAY and mv.sub_type == VT.ARRAY:
        return [_plain(inner) for inner in mv.value]
    return mv.value


def _check_readable_gguf(path: Path) -> int:
    """Cheap checks that give a clear message before any parsing; returns the file size."""
    if not path.exists():
        raise LlmtuneError(f"{path}: no such file")
    if path.is_dir():
        raise LlmtuneError(f"{path}: is a directory, not a GGUF file")
    try:
        with open(path, "rb") as fh:
            magic = fh.read(4)
            size = os.fstat(fh.fileno()).st_size
    except OSError as exc:
        raise LlmtuneError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if size == 0:
        raise LlmtuneError(f"{path}: empty file, not a GGUF model")
    if magic[:2] == GZIP_MAGIC:
        raise LlmtuneError(f"{path}: a gzip-compressed file, not a GGUF (decompress it first: gunzip -k {path})")
    if magic != GGUF_MAGIC:
        raise LlmtuneError(f"{path}: not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})")
    return size


def dequantize_tensor(info: TensorInfo, path: Path | str = "") -> np.ndarray:
    if info.type in _ELEMENT_DTYPES:
        return np.asarray(info.raw).astype(np.float32, copy=False).reshape(info.shape)
    try:
        out = gguf.quants.dequantize(np.asarray(info.raw), info.type)
    except NotImplementedError:
        raise LlmtuneError(f"{path}: tensor {info.name} has unsupported type {info.type.name}") from None
    return out.reshape(info.shape)


def load_gguf(path: str | os.PathLike) -> GGUFFile:
    return GGUFFile(path)


# --------------------------------------------------------------------------------------------
# writing
# --------------------------------------------------------------------------------------------


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


# what an output may replace without --force: (its words, the first bytes such a file starts with)
FileKind = tuple[str, tuple[bytes, ...]]
GGUF_KIND: FileKind = ("a GGUF", (GGUF_MAGIC,))


def check_output_path(out: str | os.PathLike, *inputs: str | os.PathLike, flag: str = "-o",
                      replaces: FileKind | None = None, force: bool = False) -> Path:
    """Refuse to write over an input file or into something that is not a folder; returns the path.

    A missing output folder is created here, so `-o out/model.gguf` works on a fresh checkout
    and every writer that checks its path first (GGUF, JSON, metrics) can simply open it.
    `flag` is the option that named the path (-o, --json, --metrics), so the message names it.
    `replaces`: the kind of file the command writes; an existing non-empty file of another kind
    (a user's data file under a mistyped -o) is refused unless `force` (the commands' --force).
    """
    out = Path(out)
    for src in inputs:
        if _same_file(out, Path(src)) or out.resolve() == Path(src).resolve():
            raise LlmtuneError(f"{out}: refusing to overwrite the input file {src}; choose another {flag} path")
    if out.is_dir():
        raise LlmtuneError(f"{out}: is a directory; give a file name with {flag}")
    if replaces is not None:
        check_replaceable(out, replaces, flag, force)
    ancestor = out.resolve().parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise LlmtuneError(f"{out}: cannot create a file under {ancestor} (not a directory)")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LlmtuneError(f"{out}: cannot create its folder ({exc.strerror or exc})") from None
    return out


def check_replaceable(out: Path, kind: FileKind, flag: str = "-o", force: bool = False) -> None:
    """Refuse (unless `force`) to write over an existing non-empty file that is not of `kind`."""
    if force or not out.is_file():
        return
    words, magics = kind
    try:
        with open(out, "rb") as fh:
            head = fh.read(max(map(len, magics)))
    except OSError:
        return  # unreadable: the writer's own check (check_writable_folder, the write) says why
    if head and not head.startswith(magics):
        raise LlmtuneError(f"{out}: exists and is not {words}; refusing to overwrite it (choose another {flag} path, "
                           f"or add --force to replace it)")


TensorSpec = tuple[str, np.ndarray, QT]  # name, data (float array, or raw quantized bytes), stored type


@dataclass(frozen=True)
class TensorSlot:
    """A tensor as the header describes it before its data exists: name, logical numpy shape, stored type."""

    name: str
    shape: tuple[int, ...]
    type: QT

    @property
    def n_bytes(self) -> int:
        block, type_size = gguf.GGML_QUANT_SIZES[self.type]
        return math.prod(self.shape) // block * type_size


TensorData = Callable[[TensorSlot], Iterable[np.ndarray]]  # a slot's data, in pieces, in file order


def write_gguf(
    path: str | os.PathLike,
    arch: str,
    meta: dict[str, MetaValue],
    tensors: Iterable[TensorSpec],
    *,
    inputs: Iterable[str | os.PathLike] = (),
    progress=None,
) -> Path:
    """Write a GGUF v3 atomically (temp file in the same folder, then rename).

    Metadata is written in `meta`'s order with general.architecture set to `arch` (first when
    `meta` lacks it); `general.alignment`, if given, sets the alignment, so an unchanged
    read -> write of a file reproduces it byte for byte.
    `tensors` yields (name, array, type). A float array is converted to F32/F16/BF16 as asked;
    for a quantized type, pass the already-quantized uint8 block array (logical shape in bytes,
    as `gguf.quants.quantize` returns). Every tensor is held until the file is written (the header
    needs their shapes first); write_gguf_streamed writes tensors whose shapes are known up front
    one piece at a time. `progress(name)` is called after each tensor.
    Paths in `inputs` are never overwritten.
    """
    path = check_output_path(path, *inputs)
    slots, arrays = [], []
    for name, data, qtype in tensors:
        arrays.append(_encode(data, qtype))
        slots.append(TensorSlot(name, _logical_shape(arrays[-1], qtype), qtype))
    pending = iter(arrays)
    return _write(path, arch, meta, slots, lambda slot: (next(pending),), progress)


def write_gguf_streamed(
    path: str | os.PathLike,
    arch: str,
    meta: dict[str, MetaValue],
    slots: Sequence[TensorSlot],
    tensor_data: TensorData,
    *,
    inputs: Iterable[str | os.PathLike] = (),
    progress=None,
) -> Path:
    """write_gguf for tensors whose shapes and types are known before their data: the header goes
    first, then `tensor_data(slot)` is asked for each slot in order and yields its data in pieces
    (consecutive rows, each in the form write_gguf takes: float array or uint8 blocks). Each piece is
    written and dropped before the next is asked for, so memory holds one piece, whatever the model's
    size. The pieces must add up to the slot's n_bytes. Atomic like write_gguf: an exception or
    Ctrl-C anywhere leaves no file behind (and an existing `path` as it was)."""
    path = check_output_path(path, *inputs)
    return _write(path, arch, meta, list(slots), tensor_data, progress)


def _write(path: Path, arch: str, meta: dict[str, MetaValue], slots: list[TensorSlot], tensor_data: TensorData,
           progress) -> Path:
    arch_mv = MetaValue(arch, VT.STRING)
    if "general.architecture" not in meta:
        meta = {"general.architecture": arch_mv, **meta}
    meta = {k: arch_mv if k == "general.architecture" else v for k, v in meta.items() if k not in _WRITER_OWNED_KEYS}
    alignment = _alignment(path, meta)
    return write_atomically(path, lambda fh: _write_layout(fh, meta, slots, tensor_data, alignment, progress))


def _write_layout(fh, meta: dict[str, MetaValue], slots: list[TensorSlot], tensor_data: TensorData, alignment: int,
                  progress) -> None:
    head = [GGUF_MAGIC, _U32.pack(WRITE_VERSION), _U64.pack(len(slots)), _U64.pack(len(meta))]
    for key, mv in meta.items():
        head += [_pack_string(key), _U32.pack(mv.type), _pack_value(mv)]
    offset = 0
    for slot in slots:
        ne = tuple(reversed(slot.shape))
        head += [_pack_string(slot.name), _U32.pack(len(ne)), struct.pack(f"<{len(ne)}Q", *ne)]
        head += [_U32.pack(slot.type), _U64.pack(offset)]
        offset = _align(offset + slot.n_bytes, alignment)
    header = b"".join(head)
    del head
    fh.write(header)
    if slots:  # the data section starts aligned; a tokenizer-only file has none
        fh.write(bytes(_align(len(header), alignment) - len(header)))
    for slot in slots:
        written = 0
        for piece in tensor_data(slot):
            arr = _encode(piece, slot.type)
            fh.write(memoryview(arr).cast("B"))
            written += arr.nbytes
            del piece, arr  # the next piece may be drawn before the loop rebinds these
        if written != slot.n_bytes:
            raise ValueError(f"tensor {slot.name!r}: {written:,} bytes of data, its header says {slot.n_bytes:,}")
        fh.write(bytes(_align(written, alignment) - written))
        if progress is not None:
            progress(slot.name)


def metadata_nbytes(meta: dict[str, MetaValue]) -> int:
    """Bytes the metadata entries take in a file's header (as write_gguf packs them)."""
    return sum(len(_pack_string(key)) + _U32.size + len(_pack_value(mv)) for key, mv in meta.items())


def _pack_string(s: str | bytes) -> bytes:
    raw = s.encode("utf-8", "surrogateescape") if isinstance(s, str) else bytes(s)
    return _U64.pack(len(raw)) + raw


def _pack_value(mv: MetaValue) -> bytes:
    if mv.type == VT.STRING:
        return _pack_string(mv.value)
    if mv.type != VT.ARRAY:
        return _SCALARS[mv.type].pack(mv.value)
    items = list(mv.value)
    head = _U32.pack(mv.sub_type) + _U64.pack(len(items))
    if mv.sub_type in _ARRAY_DTYPES:
        return head + np.asarray(items, dtype=_ARRAY_DTYPES[mv.sub_type]).tobytes()
    if mv.sub_type == VT.STRING:
        return head + b"".join(_pack_string(s) for s in items)
    if mv.sub_type == VT.ARRAY:
        return head + b"".join(_pack_value(inner) for inner in items)  # each: sub type, count, items
    raise ValueError(f"cannot write metadata array of {mv.sub_type!r}")


def _logical_shape(arr: np.ndarray, qtype: QT) -> tuple[int, ...]:
    if qtype in _ELEMENT_DTYPES:
        return arr.shape
    return gguf.quants.quant_shape_from_byte_shape(arr.shape, qtype)


def _encode(data: np.ndarray, qtype: QT) -> np.ndarray:
    """The bytes to store for `data` as `qtype`, as a C-contiguous little-endian array (>= 1-D)."""
    data = np.atleast_1d(data)
    if qtype in _ELEMENT_DTYPES:
        return np.ascontiguousarray(data, dtype=_ELEMENT_DTYPES[qtype])
    if data.dtype == np.uint8:
        return np.ascontiguousarray(data)
    if qtype == QT.BF16:
        return gguf.quants.quantize(np.ascontiguousarray(data, dtype=np.float32), QT.BF16)
    raise ValueError(f"tensor for {qtype.name} must be pre-quantized uint8 blocks")
