"""`llmtune.finetune(...)`: the library call behind `llmtune finetune`: set up (config, checks,
model, data, trainer), run the loop (train/loop.py) with the hooks a workflow hands in, write."""

from __future__ import annotations

import dataclasses
import uuid
from typing import Callable, Optional

from llmtune.backends import get_backend
from llmtune.backends.dist import world
from llmtune.errors import Interrupted, LlmtuneError
from llmtune.model.adapter import A, attach, dora_init, init_adapter, load_adapter, pissa_init
from llmtune.model.loaded import Model, load_model, past_training
from llmtune.train import checkpoint as ckpts, events as ev, guard, preflight
from llmtune.train.chat import build_dataset, data_info
from llmtune.train.config import FinetuneConfig, make_config, resume_config
from llmtune.train.distributed import agree_ranks
from llmtune.train.events import EpochResult, FinetuneResult  # noqa: F401 - part of this call's interface
from llmtune.train.grpo import GRPOSettings, GRPOTrainer, build_prompts, reward_error
from llmtune.train.guard import Diverged
from llmtune.train.kto import KTOObjective, balance_warning, build_unpaired
from llmtune.train.loop import Hook, Run, train
from llmtune.train.memory import mapped_bytes
from llmtune.train.metrics import MetricsLog
from llmtune.train.observe import observe_hooks
from llmtune.train.optim import LRSchedule
from llmtune.train.output import write_output
from llmtune.train.preference import REFERENCE_METHODS, Objective, PreferenceTrainer, build_pairs
from llmtune.train.rewards import RewardError, Rewards, parse_weights
from llmtune.train.selection import Selection
from llmtune.train.signals import StopRequest, signal_name
from llmtune.train.trainer import Trainer

# what a workflow hands in: the hooks of a run, made once the config and the model are known
# (so a bad --eval-benchmark file fails before the trainer allocates anything)
HookFactory = Callable[[FinetuneConfig, Model], list[Hook]]


def finetune(model_path, data_path, out_path, *, config_file=None, callback: Optional[ev.Callback] = None,
             resume=None, hooks: Optional[HookFactory] = None, force: bool = False, rollout: Optional[Callable] = None,
             **settings) -> FinetuneResult:
    """Train `model_path` on `data_path` and write the result to `out_path` (llama.cpp's
    examples/training/finetune.cpp, with validation, batching and schedules as flags).

    settings: any FinetuneConfig field (train/config.py); None means "take it from config_file or
    the default". callback(event) receives the train/events.py events (Start, Step, EpochEnd,
    Checkpoint, Warning, Stopping, Resumed, Benchmark, Sample, Saved); the CLI renders them.
    hooks(cfg, model): the loop's extra behaviour; `llmtune.finetune` (llmtune/workflows.py) hands
    in eval/'s --sample-prompt and --eval-benchmark. rollout(trainer, n_ctx): --method grpo's sampler
    of completions with the live weights (train/grpo.py GRPOTrainer; eval/generate.py PolicySampler).

    LoRA (lora_rank or lora_init): the base stays frozen, only the adapter's A/B train, and
    `out_path` receives llama.cpp's adapter GGUF (load it with llama.cpp's --lora). An existing
    `out_path` that is not a GGUF is refused unless `force` (--force).

    Checkpoints (train/checkpoint.py) go beside `out_path` at every epoch end and every
    checkpoint_every steps; `resume` (a checkpoint path) continues one with its own settings and
    writes the same bytes an uninterrupted run would. SIGINT/SIGTERM (main thread) finish the
    current step, write a checkpoint and raise Interrupted; a second signal aborts at once. A
    non-finite or runaway loss raises TrainingStopped before the step's update; no model is written."""
    emit = callback or ev.ignore

    def setup():
        ckpt = ckpts.read_checkpoint(resume) if resume is not None else None
        if ckpt is None:
            cfg = make_config(config_file, **settings)
        else:
            cfg = resume_config(ckpt.meta["config"], ckpt.path, config_file, **settings)
        return ckpt, cfg, _prepare(model_path, data_path, out_path, cfg, ckpt, emit, hooks, force, rollout)

    # under an MPI launcher (backends/dist.py) every rank sets up; an error on any stops all alike
    ckpt, cfg, run = world().together(setup)
    agree_ranks(run)  # same files, settings and versions on every rank
    emit(start_event(run))
    on_signal = lambda signum: emit(ev.Stopping(signal_name(signum), run.step))  # noqa: E731
    same_metrics = ckpt is not None and ckpt.meta["config"].get("metrics") == cfg.metrics
    keep_lines = ckpt.meta.get("metrics_lines") if same_metrics else None
    metrics = cfg.metrics if run.trainer.comm.is_root else None  # rank 0 alone writes them
    listener = lambda record: run.call_hooks("on_record", record)  # noqa: E731
    with StopRequest(on_signal) as stop, MetricsLog(metrics, run.warn, keep_lines, listener) as run.log:
        try:
            train(run, stop)
            write_output(run)
        except Diverged as exc:
            run.call_hooks("on_stop", "diverged")
            raise run.diverged(exc) from None
        except RewardError as exc:  # a user's reward function failed (train/rewards.py): the checkpoints stay
            run.call_hooks("on_stop", "diverged")
            raise reward_error(exc, run.last_checkpoint) from None
        except Interrupted as exc:
            run.call_hooks("on_stop", "interrupted")
            if exc.checkpoint is None and run.last_checkpoint is not None:  # a second signal aborted the run
                exc.checkpoint = run.last_checkpoint
                exc.message += f"; the last checkpoint is {run.last_checkpoint}"
            raise
    run.call_hooks("on_stop", "done")
    return run.result


def _prepare(model_path, data_path, out_path, cfg: FinetuneConfig, ckpt, emit: ev.Callback,
             hooks: Optional[HookFactory], force: bool = False, rollout: Optional[Callable] = None) -> Run:
    """Every check and allocation before the first step (train/preflight.py), in that order."""
    warn = lambda message: emit(ev.Warning(message))  # noqa: E731
    inputs = {"model": model_path, "data": data_path, **({"lora_init": cfg.lora_init} if cfg.lora_init else {})}
    out_path = preflight.check_outputs(out_path, cfg, inputs, ckpt, warn, force)
    model = load_model(model_path, adapter_flag="--lora-init")  # finetune continues an adapter with --lora-init
    model, trainable = _with_adapter(model, cfg) if cfg.lora else (model, model.select(cfg.params))
    run_hooks = _hooks(cfg, model, hooks)
    if (past := past_training(model, cfg.ctx)) is not None:
        warn(past)
    # plain text / {"text"}: overlapping windows; prompt-completion / chat: one masked example per window
    if cfg.method == "sft":
        dataset, n_tokens = build_dataset(model, data_path, cfg.ctx, cfg.holdout, cfg.format, cfg.chat_template,
                                          cfg.train_on_prompt, cfg.pack)
    elif cfg.method == "kto":  # unpaired examples, one per window with a KL completion (train/kto.py)
        dataset, n_tokens = build_unpaired(model, data_path, cfg.ctx, cfg.holdout, cfg.batch // cfg.ctx, cfg.format,
                                           cfg.chat_template, kl=cfg.kto_loss == "kto")
        if ckpt is None and (unbalanced := balance_warning(dataset, cfg.desirable_weight, cfg.undesirable_weight)):
            warn(unbalanced)
    elif cfg.method == "grpo":  # prompts, completions sampled in the loop (train/grpo.py)
        if rollout is None:
            raise LlmtuneError("--method grpo: needs eval's sampler; call llmtune.finetune (llmtune/workflows.py), "
                               "not llmtune.train.finetune.finetune")
        # a user's reward file is imported here
        rewards = Rewards.of(cfg.reward, parse_weights(cfg.reward_weights, len(cfg.reward)))
        dataset, n_tokens = build_prompts(model, data_path, cfg, rewards)
    else:  # preference pairs, one per window (train/preference.py)
        dataset, n_tokens = build_pairs(model, data_path, cfg.ctx, cfg.holdout, cfg.format, cfg.chat_template,
                                        cfg.method)
    steps_per_epoch = preflight.steps_per_epoch(dataset, cfg, data_path)
    preflight.check_selection(dataset, cfg)
    make = lambda c: _trainer(model, trainable, c, ckpt, rewards=rewards if c.method == "grpo" else None,  # noqa: E731
                              rollout=rollout)
    trainer, cfg, plan = preflight.planned_trainer(make, cfg)
    trainer.peak_flops = trainer.backend.peak_flops()  # the best this machine has shown (cached): MFU's denominator
    trainer.limits = guard.Limits.of(trainer)  # from the weights it starts from (a resume restores them below)
    memory = preflight.checked_memory(trainer, model_path, best_copy=cfg.save_best)
    preflight.check_disk(out_path, trainer, model_path, cfg, dataset)
    # linear / cosine span every step of the run: epochs x steps per epoch (a resume checks the latter)
    schedule = LRSchedule(cfg.lr, cfg.lr_min, cfg.decay_epochs, cfg.epochs, cfg.warmup, cfg.lr_schedule,
                          total_steps=cfg.epochs * steps_per_epoch)
    if ckpt is None:  # a resumed run was told when it started
        preflight.warn_futile(cfg, schedule, steps_per_epoch, warn)
    result = FinetuneResult(out_path, cfg, n_tokens=n_tokens, n_train_windows=dataset.n_train,
                            n_val_windows=dataset.n_val, memory=memory, plan=plan)
    run = Run(cfg, dataset, trainer, schedule, steps_per_epoch, result, inputs=inputs, run_id=uuid.uuid4().hex,
              hooks=run_hooks, emit=emit, selection=Selection.of(cfg))
    if ckpt is not None:
        ckpts.restore(run, ckpt)
    elif cfg.method in REFERENCE_METHODS:
        dataset.ref = trainer.reference_logps(dataset)  # the model as it starts: DPO's / KTO's reference, kept
    return run


def _trainer(model: Model, trainable: list[str], cfg: FinetuneConfig, ckpt, rewards=None, rollout=None) -> Trainer:
    """The trainer of the run: next-token (sft) or a preference method's."""
    kw = dict(n_ctx=cfg.ctx, n_batch=cfg.batch, n_ubatch=cfg.ubatch, trainable=trainable, optimizer=cfg.optimizer,
              wd=cfg.wd, lora_dropout=cfg.lora_dropout, seed=cfg.seed, grad_checkpoint=cfg.grad_checkpoint,
              grad_clip=cfg.grad_clip, lr_factors=lr_factors(cfg, trainable))
    backend = get_backend(cfg.backend, precision=cfg.precision)
    if cfg.method == "kto":
        objective = KTOObjective(beta=cfg.beta, desirable_weight=cfg.desirable_weight,
                                 undesirable_weight=cfg.undesirable_weight, loss_type=cfg.kto_loss)
        return PreferenceTrainer(model, backend, objective=objective, **kw)
    if cfg.method == "grpo":
        return GRPOTrainer(model, backend, settings=GRPOSettings.of(cfg), rewards=rewards, rollout=rollout,
                           completions_log=cfg.completions_log, **kw)
    if cfg.method != "sft":
        objective = Objective(cfg.method, cfg.beta, cfg.label_smoothing, cfg.gamma)
        return PreferenceTrainer(model, backend, objective=objective, **kw)
    workers = ckpts.resume_workers(ckpt.meta, world().size) if ckpt is not None else None
    return Trainer(model, backend, workers=workers, packed=cfg.pack, **kw)


def _hooks(cfg: FinetuneConfig, model: Model, hooks: Optional[HookFactory]) -> list[Hook]:
    """The workflow's hooks, then --tensorboard's and --plot's (last: they see the scores the others add)."""
    if hooks is not None:
        return hooks(cfg, model) + observe_hooks(cfg)
    for name in ("sample_prompt", "eval_benchmark"):
        if getattr(cfg, name) is not None:
            raise LlmtuneError(f"--{name.replace('_', '-')}: needs eval's training hooks; call llmtune.finetune "
                               f"(llmtune/workflows.py), not llmtune.train.finetune.finetune")
    return observe_hooks(cfg)


def start_event(run: Run) -> ev.Start:
    """What will train, on what, and the memory it takes."""
    tr, ds, res = run.trainer, run.dataset, run.result
    return ev.Start(config=run.cfg, memory=res.memory, n_tokens=res.n_tokens, n_train=ds.n_train, n_val=ds.n_val,
                    steps_per_epoch=run.steps_per_epoch, n_trainable=tr.n_trainable, n_params=tr.model.n_params(),
                    trainable=tr.trainable, backend=tr.backend.name, lora=_lora_info(tr.model, run.cfg), step=run.step,
                    base_types=tr.base_types(), base_mapped=mapped_bytes(tr), plan=res.plan,
                    data=data_info(ds, run.steps_per_epoch * (run.cfg.batch // run.cfg.ctx)))


def _lora_info(model: Model, cfg: FinetuneConfig) -> Optional[dict]:
    """What the Start event says about the adapter being trained (None for a full finetune);
    "variants": the LoRA variants in words (docs/finetune.md "LoRA variants")."""
    if not model.adapters:
        return None
    a = model.adapters[0]
    words = [f"rsLoRA, scale {a.weight_scale(next(iter(a.pairs))):.4g}"] if cfg.rslora else []
    words += ["DoRA, written merged"] if cfg.dora else []
    words += [f"LoRA+ B lr x{cfg.lora_plus:g}"] if cfg.lora_plus else []
    words += [{"gaussian": "gaussian init",
               "pissa": "PiSSA, residual base F32, written as rank 2r"}[cfg.lora_init_method]
              ] if cfg.lora_init_method != "kaiming" else []
    return {"rank": sorted(a.ranks), "alpha": a.alpha, "n_targets": len(a.pairs), "init": str(a.path) if a.path
            else None,
            "variants": words}


def _with_adapter(model: Model, cfg: FinetuneConfig) -> tuple[Model, list[str]]:
    """The model with the adapter to train (new, or --lora-init's) and the adapter's tensor keys."""

    if cfg.lora_init is not None:
        adapter = load_adapter(cfg.lora_init, model, flag="--lora-init")
        if cfg.lora_rank is not None and adapter.ranks != {cfg.lora_rank}:
            raise LlmtuneError(f"--lora-rank: {cfg.lora_rank} differs from --lora-init {cfg.lora_init}'s rank "
                               f"{', '.join(map(str, sorted(adapter.ranks)))}")
        if cfg.lora_alpha is not None:  # the scale is alpha / rank now, whatever the file's variant
            adapter.alpha, adapter.rslora = float(cfg.lora_alpha), False
    else:
        adapter = init_adapter(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets, cfg.seed, cfg.lora_init_method,
                               cfg.rslora)
    if cfg.lora_init_method == "pissa":  # the base becomes the residual W - s B0 A0 (float32)
        model = dataclasses.replace(model, weights={**model.weights, **pissa_init(model, adapter)})
    if cfg.dora:
        dora_init(model, adapter)
    return attach(model, [adapter]), list(adapter.tensors())


def lr_factors(cfg: FinetuneConfig, trainable: list[str]) -> dict[str, float]:
    """LoRA+ (PEFT's create_loraplus_optimizer): B and DoRA's magnitudes (its 1-d parameters) learn
    at --lora-plus times the learning rate of A; {} when off."""

    if not cfg.lora_plus:
        return {}
    return {n: 1.0 if n.split("#")[0].endswith("." + A) else float(cfg.lora_plus) for n in trainable}
