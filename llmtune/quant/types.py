"""The storage types a frozen matrix can keep (quant/matmul.py multiplies them, the CUDA backend
too): one registry of llmtune's name (ggml's), ggml's type id, block size, bytes per block, the
vec_dot type its activations are rounded to, and that rounding's block. The CUDA kernels read
the same numbers as `#define`s generated from it (`c_defines`), so none is written twice."""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGMLQuantizationType


@dataclass(frozen=True)
class ActType:
    """A vec_dot_type: how ggml's CPU matmul rounds the activations multiplied with a weight type."""

    name: str  # "f16", "bf16", "q8_0", "q8_1", "q8_K"
    block: int  # values rounded together (one scale per block)
    kind: int  # the id the kernels switch on (C: ACT_<NAME>)


ACT_TYPES: dict[str, ActType] = {a.name: a for a in (
    ActType("f16", 1, 0), ActType("bf16", 1, 1), ActType("q8_0", 32, 2), ActType("q8_1", 32, 3),
                                                     ActType("q8_K", 256, 4),
)}


@dataclass(frozen=True)
class QType:
    name: str  # ggml's type name
    block: int  # values per block
    size: int  # bytes per block
    act: str  # how ggml rounds the activations multiplied with it (its vec_dot_type, ACT_TYPES)
    has_min: bool = False  # Q4_1 / Q5_1: value = d * q + m (the Q8_1 correction applies)

    @property
    def ggml_id(self) -> int:
        """ggml's type id (GGUF's tensor type field; C: QT_<NAME>)."""
        return int(GGMLQuantizationType[self.name].value)

    @property
    def act_type(self) -> ActType:
        return ACT_TYPES[self.act]


QTYPES: dict[str, QType] = {
    t.name: t
    for t in (
        QType("F16", 1, 2, "f16"),
        QType("BF16", 1, 2, "bf16"),
        QType("Q8_0", 32, 34, "q8_0"),
        QType("Q4_0", 32, 18, "q8_0"),
        QType("Q5_0", 32, 22, "q8_0"),
        QType("Q4_1", 32, 20, "q8_1", has_min=True),
        QType("Q5_1", 32, 24, "q8_1", has_min=True),
        QType("Q4_K", 256, 144, "q8_K"),
        QType("Q5_K", 256, 176, "q8_K"),
        QType("Q6_K", 256, 210, "q8_K"),
    )
}
ACT_BLOCK = {a.name: a.block for a in ACT_TYPES.values()}


def qtype_of(name: str) -> QType:
    qt = QTYPES.get(name)
    if qt is None:
        raise ValueError(f"no quantized matmul for type {name} (have {', '.join(QTYPES)})")
    return qt


def row_bytes(qtype: str, n_cols: int) -> int:
    qt = qtype_of(qtype)
    if n_cols % qt.block:
        raise ValueError(f"{qtype}: a row of {n_cols} values is not a whole number of {qt.block}-value blocks")
    return n_cols // qt.block * qt.size


def c_defines() -> str:
    """The registry as C: QT_<NAME> (ggml's id), QT_<NAME>_BLOCK, QT_<NAME>_BYTES per storage type,
    ACT_<NAME> (the rounding kind) and ACT_<NAME>_BLOCK per vec_dot type."""
    lines = ["// storage types (generated from llmtune/quant/types.py)"]
    for t in QTYPES.values():
        n = t.name.upper()
        lines += [f"#define QT_{n} {t.ggml_id}", f"#define QT_{n}_BLOCK {t.block}", f"#define QT_{n}_BYTES {t.size}"]
    for a in ACT_TYPES.values():
        n = a.name.upper()
        lines += [f"#define ACT_{n} {a.kind}", f"#define ACT_{n}_BLOCK {a.block}"]
    return "\n".join(lines) + "\n"
