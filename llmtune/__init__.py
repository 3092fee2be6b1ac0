"""llmtune: finetune and evaluate GGUF language models.

Library entry points (the CLI calls the same functions):
    llmtune.finetune(...)    -> llmtune.workflows.finetune (train/finetune.py with eval's training hooks)
    llmtune.perplexity(...)  -> llmtune.eval.perplexity.perplexity
    llmtune.evaluate(...)    -> llmtune.eval.benchmarks.evaluate (HellaSwag, Winogrande, MMLU...)
    llmtune.export(...)      -> llmtune.convert.export.export
    llmtune.generate(...)    -> llmtune.eval.generate.generate (KV-cached sampling, as llama-completion)
"""

__version__ = "0.1.0"

import importlib

_LAZY = {
    "finetune": ("llmtune.workflows", "finetune"),
    "perplexity": ("llmtune.eval.perplexity", "perplexity"),
    "evaluate": ("llmtune.eval.benchmarks", "evaluate"),
    "export": ("llmtune.convert.export", "export"),
    "generate": ("llmtune.eval.generate", "generate"),
    "load_gguf": ("llmtune.gguf.file", "load_gguf"),
    "LlmtuneError": ("llmtune.errors", "LlmtuneError"),
}


def __getattr__(name):  # lazy so `import llmtune` stays fast for the CLI
    if name in _LAZY:
        mod, attr = _LAZY[name]
        return getattr(importlib.import_module(mod), attr)
    raise AttributeError(name)
