"""A training run's memory: what each part takes (the printed estimate, checked before the first
step), which copies of the frozen matrices it keeps within what is left, and the one-line refusal
of a run that does not fit."""

from __future__ import annotations

import numpy as np

from llmtune.errors import LlmtuneError
from llmtune.quant.qtensor import QTensor, float_copy_bytes, training_budget
from llmtune.resources import available_memory, binding_limit, limit_reserve


def does_not_fit(model_path, backend, what: str, available: int | None = None) -> LlmtuneError:
    """The one-line refusal of a run whose memory cannot be had."""
    available = available_memory(backend) if available is None else available
    have = f"; {available / 2**20:,.0f} MiB is available" if available is not None else ""
    return LlmtuneError(f"{model_path}: the run does not fit in memory: it needs {what}{have} (lower --ubatch "
                        f"or --ctx, use --grad-checkpoint, or train fewer tensors with --params or LoRA)")


def plan_copies(tr) -> tuple[int, set]:
    """Where the compiled product is built: packed copies of every frozen matrix multiplied
    (a stored one's decode, in place of its float copy: FloatCopies.stored_pack), all of
    them or none, since a step with some products packed would run the others on a
    single-threaded OpenBLAS (Trainer.__init__). Otherwise the frozen quantized matrices' float32
    copies: as many as fit (qtensor.training_budget), made at their first product; those only
    looked up (a token table) keep none. Float32 passes only (the copies are float32). Sets the
    trainer's FloatCopies' pack and budget; -> (bytes of the packed copies, the names packed)."""
    copies = tr.float_copies
    tr._packed_bytes, tr._packed_names = 0, set()  # (memory_bytes reads them while this plans)
    tr.copies_wanted = 0
    if copies is None or np.dtype(tr.backend.dtype) != np.float32:
        if copies is not None:
            copies.pack = False
        return 0, set()
    order = tr.programs.train[0].order
    multiplied = {n.inputs[1].name for n in order if n.op in ("qlinear", "qlinear_back")}
    quantized = {n: w for n, w in tr.frozen.items() if n in multiplied}
    # packed copies for the compiled products (forward and backward) of the frozen matrices
    # multiplied, stored (in place of their float copies) or float32
    weights = {n.inputs[1].name for n in order if n.op in ("qlinear", "matmul")}
    packs = {n: w for n, w in tr.frozen.items() if n in weights and (n in quantized or w.dtype == np.float32)}
    packed = sum(copies.packed_bytes(w.shape) for w in packs.values())
    need, available = sum(memory_bytes(tr).values()), available_memory(tr.backend)
    share, limit = 2, binding_limit(tr.backend)
    if limit is not None:  # the user's limit is the whole process's: all of what is left, less what runs
        need, share = need + runtime_bytes(tr) + limit_reserve(limit), 1
    packing = copies.packing() and packed > 0
    budget = training_budget({}, need, available, packed, share) if packing else 0
    if not packing or budget < packed:  # none, or not all of them: the float copies then, as they fit
        copies.pack = False
        budget = training_budget(quantized, need, available, share=share)
    copies.budget = budget
    tr.copies_wanted = float_copy_bytes(quantized)  # what all of them would take (the plan prints the share)
    names = set(packs) if copies.pack and copies.releases else set()  # once packed, their file pages go back
    return packed, names


def base_products(tr) -> str:
    """Which product multiplies the frozen matrices: "packed" (the compiled product over their
    packed copies, when all of them fit the memory budget) or "blas" (numpy's, on float32
    weights or copies). The two round differently, so a checkpoint records it (a resume with
    the other says its result may differ)."""
    fc = tr.float_copies
    return "packed" if fc is not None and fc.pack and tr._packed_bytes and fc.budget >= tr._packed_bytes else "blas"


def memory_bytes(tr) -> dict[str, int]:
    """Bytes by part: the base weights (frozen or trained), the adapters (LoRA), gradients (one
    buffer per worker), optimizer state, activations (the planned arenas) and, with LoRA dropout,
    the masks fed per micro-batch; the frozen matrices' copies; DoRA, the merged matrices its
    output is written from; a forward pass's arena where the run keeps one (preference methods)."""
    itemsize = np.dtype(tr.backend.dtype).itemsize
    n_base = sum(w.size for w in tr.model.weights.values())
    memory = {"base": sum(base_types(tr).values())}
    if tr.model.adapters:
        memory["adapters"] = (sum(w.size for w in tr.tensors.values()) - n_base) * itemsize
    memory.update({
        "gradients": tr.n_trainable * itemsize * tr.n_workers,
        "optimizer": tr.optimizer.state_bytes,
        "activations": tr.programs.planned_bytes(),
    })
    if tr.masks:
        memory["dropout masks"] = sum(int(np.prod(s)) for s in tr.masks.values()) * itemsize * tr.n_workers
    copies = tr.float_copies
    if copies is not None and copies.budget:  # at most: they are made while they fit it
        packed = tr._packed_bytes if copies.pack else 0  # all or none: within the budget whole
        if copies.budget > packed:
            memory["float copies"] = copies.budget - packed
        if packed:
            memory["packed copies"] = packed
    if tr.model.adapters and tr.model.adapters[0].magnitudes:  # DoRA's output: its merged matrices, F32
        memory["merged output"] = sum(tr.model.weights[n].size for n in tr.model.adapters[0].pairs) * 4
    if tr.forward is not None:
        memory["forward pass"] = tr.forward.memory.planned_bytes
    return memory


def mapped_bytes(tr) -> int:
    """Bytes of the frozen base weights read from the model file's memory mapping (views of it,
    in their file types): mapped, not the estimate's resident "base": the kernel reads their pages
    as they are used and may drop them (those multiplied through packed copies are given back once
    packed), so a memory-mapped base costs far less than its size."""
    gguf = getattr(tr.model, "gguf", None)
    if gguf is None:
        return 0
    arrays = [w.raw if isinstance(w, QTensor) else w for n, w in tr.frozen.items() if n in tr.model.weights]
    return sum(a.nbytes for a in arrays if isinstance(a, np.ndarray) and gguf.maps(a))


def base_types(tr) -> dict[str, int]:
    """Bytes of the base weights by how they are held: frozen matrices in their file type ("Q4_K",
    "F16", ...), everything else (trained or float) in the backend's float type; not those
    multiplied through packed copies, whose file pages are given back once packed (they are the
    estimate's "packed copies")."""
    itemsize = np.dtype(tr.backend.dtype).itemsize
    trained, packed = set(tr.trainable), tr._packed_names  # (plan_copies runs first)
    out: dict[str, int] = {}
    for name in tr.model.weights:  # adapters' tensors are not the base
        if name in packed:
            continue
        w = tr.tensors[name]
        if isinstance(w, QTensor) and name not in trained:
            key, nbytes = w.qtype, w.nbytes
        else:
            key, nbytes = ("F32" if itemsize == 4 else "F64"), w.size * itemsize
        out[key] = out.get(key, 0) + nbytes
    return out


def runtime_bytes(tr) -> int:
    """What the process holds now besides the estimate's parts written already (interpreter,
    libraries, tokenizer, data): its resident size less the trained values (held_already); 0 where
    the backend's arrays live elsewhere (a device)."""
    rss = tr.backend.resident_bytes()
    return 0 if rss is None else max(0, rss - held_already(tr))


def held_already(tr) -> int:
    """Bytes of the estimate that setup has written already: the trained values (and PiSSA's
    residual bases, made in memory); the gradients and optimizer state are zeros not yet touched."""
    held = tr.n_trainable * np.dtype(tr.backend.dtype).itemsize
    adapters = tr.model.adapters
    if adapters and adapters[0].initial:
        held += sum(tr.model.weights[n].nbytes for n in adapters[0].initial)
    return held
