"""Finite-difference gradient checking of graph ops (float64), used by the op tests of every backend."""

from __future__ import annotations

from typing import Callable

import numpy as np

from llmtune.graph import ops
from llmtune.graph.autodiff import grad
from llmtune.graph.planner import Program


def check_gradients(build: Callable, arrays: dict[str, np.ndarray], backend, *, int_inputs=None,
                    eps: float = 1e-6, seed: int = 0, leaves=None) -> dict[str, float]:
    """Max relative error between autodiff and central differences for every float input.

    build(**nodes) -> output node. `arrays` are float64 values of the differentiable inputs,
    `int_inputs` arrays passed as non-differentiable inputs (integer arrays as int32, float ones,
    e.g. an attention mask, as floats). The scalar checked is
    sum(output * R) for a fixed random R, so every output element matters. `leaves`: other leaf
    node -> backend array, bound for every run (e.g. an ops.qweight's bytes that `build` closes over).
    """
    int_inputs = int_inputs or {}
    nodes = {k: ops.param(v.shape, name=k) for k, v in arrays.items()}
    is_int = {k: np.issubdtype(np.asarray(v).dtype, np.integer) for k, v in int_inputs.items()}
    inodes = {k: ops.input(v.shape, "i32" if is_int[k] else "f32", name=k) for k, v in int_inputs.items()}
    out = build(**nodes, **inodes)
    rng = np.random.default_rng(seed)
    weights = ops.input(out.shape, name="__r")
    loss = ops.sum_to(ops.mul(out, weights), ())
    grads = grad(loss, list(nodes.values()))
    values = {n: backend.asarray(np.array(arrays[k], dtype=np.float64)) for k, n in nodes.items()}
    prog = Program([loss] + [grads[n] for n in nodes.values()], backend, params={**(leaves or {}), **values})
    feed = {k: backend.asarray(np.asarray(v, np.int32 if is_int[k] else np.float64)) for k, v in int_inputs.items()}
    feed["__r"] = backend.asarray(rng.standard_normal(out.shape))

    def f() -> float:
        return float(backend.to_numpy(prog.run(**feed)[0]))

    results = prog.run(**feed)
    analytic = [backend.to_numpy(g).copy() for g in results[1:]]
    errors = {}
    for (name, node), g_an in zip(nodes.items(), analytic):
        host = np.array(arrays[name], dtype=np.float64)
        g_num = np.zeros_like(host)
        for idx in np.ndindex(host.shape):
            orig = host[idx]
            for sign in (1, -1):
                host[idx] = orig + sign * eps
                values[node][...] = backend.asarray(host)
                g_num[idx] += sign * f() / (2 * eps)
            host[idx] = orig
        values[node][...] = backend.asarray(host)
        scale = max(np.abs(g_num).max(), 1e-8)
        errors[name] = float(np.abs(g_an - g_num).max() / scale)
    return errors
