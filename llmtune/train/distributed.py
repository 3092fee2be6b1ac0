"""What a data-parallel finetune checks across its ranks before the first step
(the communicator itself is llmtune/backends/dist.py)."""

from __future__ import annotations

import platform

import numpy as np

from llmtune import __version__
from llmtune.backends.dist import digest
from llmtune.train.checkpoint import run_fingerprint


def agree_ranks(run) -> None:
    """Every rank must train the same thing: same llmtune, numpy and Python, the same model, data
    and settings (sha256), backend, trained tensors and starting point; otherwise every rank stops
    with one line naming the first difference. Rank 0's run id becomes every rank's."""
    comm = run.trainer.comm
    if comm.size == 1:
        return

    tr, fp = run.trainer, run_fingerprint(run)
    facts = {"llmtune's version": __version__, "numpy's version": np.__version__,
             "Python's version": platform.python_version()}
    facts.update({f"the {name} file" if name != "lora_init" else "the --lora-init file": fp[name]
                  for name in run.inputs})
    facts.update({
        "the run's settings": fp["settings"],
        "the backend": f"{tr.backend.name} {tr.backend.dtype} {tr.backend.precision}",
        "the trained tensors": digest(tr.trainable, tr.n_trainable),
        "the starting point (--resume)": f"step {run.step}" + (f" of run {run.run_id}" if run.step else ""),
    })
    comm.check_same(facts)
    run.run_id = comm.bcast(run.run_id, "sharing the run id")
