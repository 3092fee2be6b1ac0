"""Library calls that compose rooms. `finetune`: train/'s loop with eval/'s hooks during training
(--sample-prompt, --eval-benchmark) and GRPO's sampler, so that train/ never imports eval/."""

from __future__ import annotations

from llmtune.eval.generate import PolicySampler
from llmtune.eval.train_hooks import training_hooks
from llmtune.train.finetune import finetune as train_finetune


def finetune(model_path, data_path, out_path, **kwargs):
    """llmtune.finetune: train/finetune.py's finetune (every argument and setting as documented
    there) with eval/train_hooks.py's hooks and, for --method grpo, eval/generate.py's sampler."""

    return train_finetune(model_path, data_path, out_path, hooks=training_hooks, rollout=PolicySampler, **kwargs)

