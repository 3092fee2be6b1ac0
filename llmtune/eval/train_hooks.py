"""Evaluation during a finetune, as hooks of the training loop (train/loop.py Hook): a greedy
sample of --sample-prompt, and --eval-benchmark scored before training and at each validation pass.
llmtune/workflows.py hands them to train/finetune.py, which knows nothing of eval/."""

from __future__ import annotations

import dataclasses

from llmtune.eval.benchmarks import prepare_benchmark, score_benchmark
from llmtune.eval.generate import TrainingSampler
from llmtune.model.loaded import Model
from llmtune.train import events as ev
from llmtune.train.chat import sample_prompt
from llmtune.train.config import FinetuneConfig
from llmtune.train.loop import Hook, Run


def training_hooks(cfg: FinetuneConfig, model: Model) -> list[Hook]:
    """The hooks cfg asks for; a bad --eval-benchmark file fails here, before training allocates."""
    hooks: list[Hook] = []
    if cfg.eval_benchmark is not None:
        hooks.append(BenchmarkHook(model, cfg.eval_benchmark))
    if cfg.sample_prompt is not None:
        hooks.append(SampleHook(cfg.sample_prompt, cfg.sample_every))
    return hooks


class SampleHook(Hook):
    """--sample-prompt: a short greedy continuation with the weights as they are now, after each
    epoch or every `every` optimizer steps. The generator is made when first used."""

    def __init__(self, prompt: str, every: int = 0):
        self.prompt, self.every, self.sampler, self.asks = prompt, every, None, False

    def on_step(self, run: Run, step: ev.Step) -> None:
        if self.every and run.step % self.every == 0:
            self._sample(run)

    def on_epoch(self, run: Run, result: ev.EpochResult) -> None:
        if not self.every:
            self._sample(run)

    def _sample(self, run: Run) -> None:
        if not run.trainer.comm.is_root:
            return
        if self.sampler is None:

            # the prompt as training renders the data's prompts (a user turn, the Alpaca prompt, text)
            ids, self.asks = sample_prompt(run.trainer.model.tokenizer, getattr(run.dataset, "template", None),
                                           getattr(run.dataset, "format", "text"), self.prompt)
            self.sampler = TrainingSampler(run.trainer, ids)
        run.emit(ev.Sample(epoch=run.epoch + 1, global_step=run.step, prompt=self.prompt, chat=self.asks,
                           text=self.sampler.sample()))


class BenchmarkHook(Hook):
    """--eval-benchmark: its tasks read and tokenized once (a bad file fails before training), then
    scored with the weights as they are: before the first step and at each validation pass (each
    epoch end, and every --eval-every steps)."""

    def __init__(self, model: Model, path):

        self.benchmark = prepare_benchmark(model, path)

    def before_training(self, run: Run) -> None:
        res = self._score(run, 0)
        run.result.bench_before = res.accuracy
        run.emit(ev.Benchmark(0, res.kind, res.accuracy, res.accuracy_err, res.n_tasks))

    def on_validation(self, run: Run, evaluation: ev.Evaluation) -> None:
        res = self._score(run, evaluation.epoch)
        evaluation.bench_accuracy, evaluation.bench_accuracy_err = res.accuracy, res.accuracy_err

    def _score(self, run: Run, epoch: int):

        res = score_benchmark(current_model(run), self.benchmark, backend=run.trainer.backend)
        run.log.write({"type": "benchmark", "epoch": epoch, "global_step": run.step, "kind": res.kind,
                       "accuracy": res.accuracy, "accuracy_err": res.accuracy_err, "n_tasks": res.n_tasks})
        return res


def current_model(run: Run) -> Model:
    """The model with the weights (or the adapter) as trained so far."""
    model, trained = run.trainer.model, run.trainer.trained_weights()
    if model.adapters:
        return dataclasses.replace(model, adapters=[model.adapters[0].with_tensors(trained)])
    return dataclasses.replace(model, weights={**model.weights, **trained})
