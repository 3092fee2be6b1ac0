"""A toy backend defined outside llmtune: the numpy kernels under another name, with policies of
its own. This module and its one `register_backend` call are all it takes (the structure test
runs perplexity, generation and a training step on it): nothing outside backends/ asks a
backend's name, only its capabilities (llmtune/backends/base.py)."""

from llmtune.backends import register_backend
from llmtune.backends.base import Backend
from llmtune.backends.cpu import CPUBackend


class ToyBackend(CPUBackend):
    name = "toy"
    replays = False  # every run is an ordinary Program.run
    default_batch_tokens = 128

    def workers(self, requested, n_items):
        return Backend.workers(self, requested, n_items)  # one work item at a time

    def decode_context(self):
        return Backend.decode_context(self)

    def step_tuner(self, n_workers):
        return Backend.step_tuner(self, n_workers)


register_backend("toy", lambda dtype, precision: ToyBackend(dtype))
