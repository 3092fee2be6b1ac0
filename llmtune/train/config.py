"""Finetune settings: built-in defaults < TOML config file < explicit command-line flags."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from llmtune.errors import LlmtuneError
from llmtune.tomlfile import read_toml
from llmtune.train.data import VAL_PICKS, Holdout

KTO_BATCH = 8  # --method kto's windows per step when --batch is not given: TRL's per_device_train_batch_size


def setting(default, help: str, *, short: Optional[str] = None, metavar: Optional[str] = None,
            unset: Optional[str] = None, flag: Optional[str] = None, path: bool = False):
    """One finetune setting, declared once: the FinetuneConfig field (its default), the TOML key
    (the field's name, `-` or `_`), and the command-line option (--name, or `flag`; its short
    form, metavar and help; `unset` words a default that is a rule, as "ctx" for --batch; `path`:
    a file name, given to the library as a string)."""
    meta = {"help": help, "short": short, "metavar": metavar, "unset": unset, "flag": flag, "path": path}
    return dataclasses.field(default=default, metadata=meta)


@dataclass
class FinetuneConfig:
    ctx: int = setting(512, "Tokens per training sequence (n_ctx).", short="-c", metavar="N")
    batch: Optional[int] = setting(None, "Tokens per optimizer step, a multiple of --ctx (--method kto: at least 2 "
                                         "x --ctx, 8 x by default as TRL's batch).", short="-b", metavar="N",
                                   unset="ctx")
    ubatch: Optional[int] = setting(None,
                                    "Tokens per forward/backward pass, a multiple of --ctx dividing --batch; trades "
                                          "memory for speed, never the result.", metavar="N", unset="batch")
    epochs: int = setting(2, "Passes over the training windows.", metavar="N")
    lr: float = setting(1e-5, "Learning rate.", metavar="X")
    lr_min: float = setting(0.0, "The learning rate's floor: halflife halves down to it; linear and cosine decay to it "
                                 "instead of 0 (after warmup the rate stays above it).", metavar="X", unset="off")
    decay_epochs: float = setting(0.0, "Epochs over which --lr decays to --lr-min (halflife).", metavar="X",
                                  unset="all")
    lr_schedule: Optional[str] = setting(None,
                                         "constant, linear, cosine or halflife. linear and cosine are transformers' "
                                               "get_linear_schedule_with_warmup and get_cosine_schedule_with_warmup "
                                               "step for step, over all --epochs "
                                               "x steps-per-epoch optimizer steps; halflife is llama.cpp's (halving "
                                               "steadily to --lr-min over --decay-epochs). The default "
                                               "keeps what llmtune "
                                               "and llama.cpp's finetune always did, so existing recipes keep their "
                                               "results.", metavar="NAME", unset="constant; halflife with --lr-min")
    warmup: int = setting(0, "Linear warmup over this many optimizer steps (linear, cosine: lr x step/N from step 0, "
                             "as transformers; constant, halflife: lr x (step+1)/N, as before).", metavar="N")
    wd: float = setting(0.0, "Decoupled weight decay.", metavar="X")
    optimizer: str = setting("adamw", "adamw, adamw8bit (AdamW with block-wise 8-bit moments, as bitsandbytes' "
                                      "AdamW8bit: 2 bytes of state per trained value instead of 8) or sgd.",
                             metavar="NAME")
    grad_clip: float = setting(0.0, "Clip the gradient's global L2 norm over every trained value to this "
                                    "(torch.nn.utils.clip_grad_norm_; after accumulation and the data-parallel "
                                    "all-reduce, before the update). Off by default, as llama.cpp's finetune, so "
                                    "existing recipes keep their results; HF Trainer uses 1.0. "
                                    "The norm before clipping is logged every step.", metavar="X", unset="off")
    val_split: float = setting(0.05, "Fraction of windows (examples, pairs) held out for validation: the last ones, "
                                     "or see --val-pick.", metavar="X")
    val_pick: str = setting("last", "Which windows (examples, pairs) --val-split holds out: last (the last ones, as "
                                    "llama.cpp's finetune) or random (a sample drawn with --seed, the same on resume "
                                    "and on every MPI rank; plain text: the training windows overlapping a drawn "
                                    "window are left out, so no validation token is trained on).", metavar="NAME")
    eval_every: int = setting(0, "Also run the validation pass (and --eval-benchmark) every N optimizer steps.",
                              metavar="N", unset="at epoch ends only")
    early_stop: int = setting(0, "Stop training once this many validation passes in a row have not improved "
                                 "--select-metric by more than --min-delta (transformers' EarlyStoppingCallback).",
                              metavar="PATIENCE", unset="off")
    min_delta: float = setting(0.0, "The least change of --select-metric that counts as an improvement.", metavar="X")
    select_metric: str = setting("val_loss", "What --early-stop and --save-best follow: val_loss (lower is better), "
                                             "val_accuracy or benchmark (--eval-benchmark's accuracy).", metavar="NAME")
    save_best: bool = setting(False, "-o receives the weights (LoRA: the adapter) of the best validation pass by "
                                     "--select-metric, not the last step's (transformers' load_best_model_at_end); the "
                                     "summary names its step.")
    params: Optional[str] = setting(None, "Regex over GGUF tensor names choosing what trains, e.g. 'attn_(q|v)'.",
                                    metavar="REGEX", unset="all")
    seed: int = setting(42, "Shuffling seed; same seed, same output file.", metavar="N")
    shuffle: bool = setting(True, "Keep the training windows in file order.", flag="--no-shuffle")
    backend: str = setting("cpu", "cpu, cuda or auto.", metavar="NAME")
    precision: str = setting("f32",
                             "Matmul precision: f32, or on cuda tf32/bf16 (f32 accumulation and master weights).",
                             metavar="NAME")
    grad_checkpoint: bool = setting(False, "Keep only the residual stream between layers and recompute each layer's "
                                           "activations in the backward: less memory (long contexts), about a third "
                                           "more compute; the same gradients.")
    metrics: Optional[str] = setting(None, "Write one JSON record per step and per validation pass here.",
                                     metavar="FILE", path=True)
    tensorboard: Optional[str] = setting(None, "Write TensorBoard event files into this folder: every --metrics value "
                                               "per step (loss, accuracy, lr, gradient norm, tokens/s, validation and "
                                               "benchmark scores); watch with `tensorboard --logdir DIR`. Needs "
                                               "tensorboardX (pip install tensorboardX; the extra \"tensorboard\").",
                                         metavar="DIR", path=True)
    plot: Optional[str] = setting(None, "Draw the train and validation loss and the learning rate against steps into "
                                        "this picture (PNG, or the format its extension names: .jpg, .svg, .pdf...), "
                                        "the best validation pass and an early stop marked (preference methods: their "
                                        "reward margin and accuracy below), redrawn after each "
                                        "validation pass, every minute, and at the end. "
                                        "Needs matplotlib (pip install matplotlib; the extra \"plot\").",
                                  metavar="FILE", path=True)
    out_type: Optional[str] = setting(None, "A full finetune of a quantized or f16 model writes its trained tensors as "
                                            "F32, which keeps every update (re-encoding them in the input's type "
                                            "rounds most updates away); with this, the whole model is written as "
                                            "`llmtune export --type TYPE` would (f16, q8_0, q4_k_m, ...), and the file "
                                            "is scored again as written.", metavar="TYPE",
                                      unset="trained tensors F32, the others as they were")
    # LoRA (set lora_rank or lora_init): train only adapters on a frozen base, write an adapter GGUF
    lora_rank: Optional[int] = setting(None, "Train a LoRA adapter of this rank on the frozen model; -o then receives "
                                             "llama.cpp's adapter GGUF (use it with --lora).", metavar="N")
    lora_alpha: Optional[float] = setting(None, "LoRA alpha: the adapter is scaled by alpha / rank.", metavar="X",
                                          unset="the rank")
    lora_targets: Optional[str] = setting(None, "Regex over GGUF tensor names choosing the adapted matrices, e.g. "
                                                "'attn_(q|v)'.", metavar="REGEX",
                                          unset="attention q/k/v/output and FFN matrices")
    lora_dropout: float = setting(0.0, "Dropout on the adapters' inputs while training (as PEFT).", metavar="X")
    lora_init: Optional[str] = setting(None, "Continue training this adapter GGUF (llmtune's or "
                                             "convert_lora_to_gguf.py's) or PEFT adapter folder; it fixes rank and "
                                             "targets.", metavar="PATH", path=True)
    # LoRA variants (model/adapter/initialise.py; docs/finetune.md "LoRA variants")
    rslora: bool = setting(False,
                           "Rank-stabilised LoRA (PEFT's use_rslora): scale alpha / sqrt(rank), not alpha / rank; "
                                  "the adapter file stores alpha * sqrt(rank), so llama.cpp applies the same scale.")
    dora: bool = setting(False, "Weight-decomposed LoRA (PEFT's use_dora): each adapted matrix is a trained per-row "
                                "magnitude times the direction of W + scale B A. llama.cpp cannot load DoRA adapters, "
                                "so -o receives the merged model (the adapted matrices as F32).")
    lora_plus: float = setting(0.0, "LoRA+ (PEFT's create_loraplus_optimizer): B's learning rate (and DoRA's "
                                    "magnitude's) is RATIO x A's, e.g. 16.", metavar="RATIO", unset="off")
    lora_init_method: str = setting("kaiming", "How a new adapter starts: kaiming (PEFT's default), gaussian (A ~ "
                                               "N(0, 1/rank)) or pissa (A, B from W's top singular "
                                               "vectors, W replaced by "
                                               "the residual W - scale B A, kept in F32; -o receives the change as a "
                                               "rank-2r adapter of the original base).", metavar="NAME")
    # instruction / chat data (train/chat.py) and samples during training
    format: str = setting("auto", "Data format: auto (detected from the file's first record), plain, text, completion, "
                                  "chat, sharegpt, alpaca, preference ({prompt, chosen, rejected}: --method "
                                  "dpo|orpo|simpo), unpaired ({prompt, completion, label}: --method kto) or "
                                  "prompt ({prompt, columns}: --method grpo).", metavar="NAME")
    pack: bool = setting(False, "Put several prompt/completion or chat examples in each --ctx window, each attending "
                                "only to itself with its own positions (TRL's padding_free): the same loss and "
                                "gradients per example, most of the padding's compute saved (SmolLM2-135M chat set "
                                "at --ctx 128: 2.00x the loss-carrying tokens/s, BENCHMARKS.md). Off by default: a "
                                "step of --batch tokens then holds more examples, so an --lr/--epochs recipe changes "
                                "meaning, and past --ctx 256 packed attention is not blockwise (memory grows with "
                                "ctx^2).")
    chat_template: Optional[str] = setting(None, "Jinja chat template rendering chat data, instead of the model's "
                                                 "tokenizer.chat_template.", metavar="FILE", path=True)
    train_on_prompt: bool = setting(False, "Completion / chat data: every token carries loss, not only the completion "
                                           "and assistant turns.")
    sample_prompt: Optional[str] = setting(None, "After each epoch print a short greedy continuation of this prompt "
                                                 "(chat data: as a user turn), to watch the model change.",
                                           metavar="TEXT")
    sample_every: int = setting(0, "Print the --sample-prompt continuation every N optimizer steps instead.",
                                metavar="N", unset="after each epoch")
    # preference tuning (train/preference.py, train/kto.py): TRL's losses
    method: str = setting("sft", "sft (supervised, next-token loss), or on preference pairs dpo (TRL's DPOTrainer, "
                                 "sigmoid loss; the reference is the model as training starts), orpo (ORPOTrainer: "
                                 "SFT loss plus the odds-ratio term) or simpo (CPOTrainer loss_type=simpo); on "
                                 "unpaired {prompt, completion, label} records kto (KTOTrainer); or on prompt "
                                 "records grpo (GRPOTrainer: completions sampled in the loop, scored by --reward).",
                          metavar="NAME")
    beta: Optional[float] = setting(None, "DPO / SimPO / KTO: the beta of the sigmoid loss; ORPO: lambda, the "
                                          "odds-ratio term's weight (TRL's beta); GRPO: the weight of the KL to the "
                                          "reference (the model as training starts; 0: none, no reference pass).",
                                    metavar="X", unset="0.1; grpo 0")
    desirable_weight: float = setting(1.0, "KTO: the weight of the desirable (label true) examples' losses.",
                                      metavar="X")
    undesirable_weight: float = setting(1.0, "KTO: the weight of the undesirable (label false) examples' losses.",
                                        metavar="X")
    kto_loss: str = setting("kto", "KTO: TRL's loss_type, kto, or apo_zero_unpaired (APO-zero's unpaired loss: no "
                                   "KL estimate, a step may hold one example).", metavar="NAME")
    label_smoothing: float = setting(0.0, "DPO / SimPO: the chance a pair's labels are flipped (conservative DPO).",
                                     metavar="X")
    gamma: float = setting(0.5, "SimPO: the target reward margin (TRL's simpo_gamma).", metavar="X")
    # GRPO (train/grpo.py, rewards train/rewards.py): prompt records, completions sampled in the loop, TRL's loss
    reward: Optional[list[str]] = setting(None, "GRPO: a reward, repeated for several (summed with --reward-weights): "
                                                "exact:COLUMN, number:COLUMN, regex:PATTERN, length:N or "
                                                "FILE.py:FUNCTION (TRL's reward-function signature); "
                                                "docs/finetune.md \"GRPO\".", metavar="KIND:ARG")
    reward_weights: Optional[str] = setting(None, "GRPO: the rewards' weights, comma-separated, one per --reward.",
                                            metavar="W,W,...", unset="1 each")
    num_generations: int = setting(8, "GRPO: completions sampled per prompt (a group); --batch / --ctx completions per "
                                      "step, a multiple of it.", metavar="G")
    max_completion_length: int = setting(256, "GRPO: the most tokens a completion samples (an end-of-generation token "
                                              "stops it before).", metavar="N")
    temperature: float = setting(1.0, "GRPO: the sampling temperature (the log-probabilities are of the tempered "
                                      "distribution, as TRL's).", metavar="X")
    top_p: float = setting(1.0, "GRPO: nucleus sampling's mass (1: off).", metavar="X")
    loss_type: str = setting("dapo", "GRPO: grpo (each completion's token mean), bnpo or dapo (the batch's token "
                                     "mean), dr_grpo (sum / completions x --max-completion-length); TRL's.",
                             metavar="NAME")
    scale_rewards: str = setting("group", "GRPO: advantages divided by the group's reward std (group), the batch's "
                                          "(batch) or not (none).", metavar="NAME")
    epsilon: float = setting(0.2, "GRPO: the ratio's clipping range, 1 - X .. 1 + --epsilon-high.", metavar="X")
    epsilon_high: Optional[float] = setting(None, "GRPO: the clipping range's upper epsilon.", metavar="X",
                                            unset="--epsilon")
    num_iterations: int = setting(1, "GRPO: optimizer steps per generation batch (TRL's mu).", metavar="N")
    completions_log: Optional[str] = setting(None, "GRPO: append every sampled completion (step, prompt, completion, "
                                                   "rewards, advantage) to this JSONL file.", metavar="FILE",
                                             path=True, unset="beside --metrics as .completions.jsonl")
    # checkpoints (train/checkpoint.py): every epoch end, and every checkpoint_every steps when > 0
    checkpoint_every: int = setting(0, "Also write a checkpoint every N optimizer steps (one is written at every epoch "
                                       "end, and on Ctrl-C / SIGTERM).", metavar="N", unset="epoch ends only")
    keep_checkpoints: Optional[int] = setting(None,
                                              "Keep this run's last K checkpoints, also once the model is written.",
                                              metavar="K", unset="the last one while training, none after")
    eval_benchmark: Optional[str] = setting(None, "Benchmark file (any format of llmtune eval: HellaSwag, Winogrande "
                                                  "CSV, multiple choice) scored before training and after each epoch, "
                                                  "so the summary shows whether the finetune helps.",
                                            metavar="FILE", path=True)

    @property
    def lora(self) -> bool:
        return self.lora_rank is not None or self.lora_init is not None

    @property
    def holdout(self) -> Holdout:
        """What validates: --val-split of the items, picked by --val-pick (random: with --seed)."""
        return Holdout(self.val_split, self.val_pick, self.seed)

    def resolved(self) -> "FinetuneConfig":
        """Fill derived defaults and validate ranges (one-line errors naming the flag)."""
        c = dataclasses.replace(self)
        if c.ctx < 2:
            raise LlmtuneError(f"--ctx: must be at least 2, got {c.ctx}")
        per_step = {"kto": KTO_BATCH, "grpo": c.num_generations}.get(c.method, 1)  # GRPO: one prompt's group
        c.batch = c.batch or c.ctx * per_step
        if c.batch % c.ctx:  # each flag checked on its own, so the message names only what was given
            raise LlmtuneError(f"--batch {c.batch}: must be a multiple of --ctx {c.ctx}")
        if c.ubatch and (c.ubatch % c.ctx or c.batch % c.ubatch):
            raise LlmtuneError(f"--ubatch {c.ubatch}: must be a multiple of --ctx {c.ctx} dividing --batch {c.batch}")
        c.ubatch = c.ubatch or c.batch
        if c.epochs < 1:
            raise LlmtuneError(f"--epochs: must be at least 1, got {c.epochs}")
        if not 0 <= c.val_split < 1:
            raise LlmtuneError(f"--val-split: must be in [0, 1), got {c.val_split}")
        if c.val_pick not in VAL_PICKS:
            raise LlmtuneError(f"--val-pick: unknown choice {c.val_pick!r} (choose {', '.join(VAL_PICKS)})")
        if c.val_pick != "last" and not c.val_split:
            raise LlmtuneError(f"--val-pick {c.val_pick}: needs --val-split above 0 (no window is held out)")
        if not c.grad_clip >= 0:
            raise LlmtuneError(f"--grad-clip: must be >= 0 (0: off), got {c.grad_clip}")
        if c.wd < 0:
            raise LlmtuneError(f"--wd: must be >= 0, got {c.wd}")
        from llmtune.train.optim import OPTIMIZERS

        if c.optimizer.lower() not in OPTIMIZERS:
            raise LlmtuneError(f"--optimizer: unknown optimizer {c.optimizer!r} (choose {', '.join(OPTIMIZERS)})")
        c.optimizer = c.optimizer.lower()
        if c.precision not in ("f32", "tf32", "bf16"):
            raise LlmtuneError(f"--precision: unknown precision {c.precision!r} (choose f32, tf32 or bf16)")
        if c.warmup < 0:
            raise LlmtuneError(f"--warmup: must be >= 0, got {c.warmup}")
        _check_schedule(c)
        _check_selection(c)
        if c.checkpoint_every < 0:
            raise LlmtuneError(f"--checkpoint-every: must be >= 0 (0: at epoch ends only), got {c.checkpoint_every}")
        if c.keep_checkpoints is not None and c.keep_checkpoints < 1:
            raise LlmtuneError(f"--keep-checkpoints: must be at least 1, got {c.keep_checkpoints}")
        if c.sample_every < 0:
            raise LlmtuneError(f"--sample-every: must be >= 0, got {c.sample_every}")
        if c.sample_every and c.sample_prompt is None:
            raise LlmtuneError("--sample-every: needs --sample-prompt")
        _check_method(c)
        from llmtune.train.chat import FORMATS

        if c.format not in FORMATS:
            raise LlmtuneError(f"--format: unknown format {c.format!r} (choose {', '.join(FORMATS)})")
        if c.out_type is not None:
            from llmtune.quant.plan import EXPORT_TYPES

            if c.out_type.lower() not in EXPORT_TYPES:
                raise LlmtuneError(f"--out-type: unknown type {c.out_type!r} (choose from {', '.join(EXPORT_TYPES)})")
            c.out_type = c.out_type.lower()
            if c.lora and c.dora:
                raise LlmtuneError("--out-type: with --dora, -o receives the merged model with its "
                                   "adapted matrices in "
                                   "F32; shrink it afterwards: llmtune export OUT.gguf --type "
                                   f"{c.out_type} -o SMALL.gguf")
            if c.lora:
                raise LlmtuneError(f"--out-type: a LoRA adapter is written in F32; to merge it and store the model as "
                                   f"{c.out_type}: llmtune export BASE.gguf --lora ADAPTER.gguf --type "
                                   f"{c.out_type} -o OUT.gguf")
        if c.lora_rank is not None and c.lora_rank < 1:
            raise LlmtuneError(f"--lora-rank: must be at least 1, got {c.lora_rank}")
        if not 0 <= c.lora_dropout < 1:
            raise LlmtuneError(f"--lora-dropout: must be in [0, 1), got {c.lora_dropout}")
        if c.lora_alpha is not None and not c.lora_alpha >= 0:
            raise LlmtuneError(f"--lora-alpha: must be >= 0, got {c.lora_alpha}")
        if not c.lora:
            for name in ("lora_alpha", "lora_targets"):
                if getattr(c, name) is not None:
                    flag = "--" + name.replace("_", "-")
                    raise LlmtuneError(f"{flag}: needs --lora-rank (or --lora-init)")
            if c.lora_dropout:
                raise LlmtuneError("--lora-dropout: needs --lora-rank (or --lora-init)")
        _check_lora_variants(c)
        if c.lora and c.params is not None:
            raise LlmtuneError("--params: LoRA trains only adapters; choose the adapted matrices with --lora-targets")
        elif c.lora_init is not None and c.lora_targets is not None:
            raise LlmtuneError("--lora-targets: --lora-init's adapter fixes the adapted matrices")
        return c


def _check_method(c: "FinetuneConfig") -> None:
    """--method and its settings: each flag only with the methods that read it."""
    from llmtune.train.preference import METHODS

    if c.method not in METHODS:
        raise LlmtuneError(f"--method: unknown method {c.method!r} (choose {', '.join(METHODS)})")
    default_beta = 0.0 if c.method == "grpo" else 0.1
    beta_given = c.beta is not None and c.beta != default_beta
    c.beta = default_beta if c.beta is None else c.beta
    if not (c.beta >= 0 if c.method == "grpo" else c.beta > 0):
        raise LlmtuneError(f"--beta: must be {'>=' if c.method == 'grpo' else '>'} 0, got {c.beta}")
    if not 0 <= c.label_smoothing <= 0.5:
        raise LlmtuneError(f"--label-smoothing: must be in [0, 0.5], got {c.label_smoothing}")
    for name in ("desirable_weight", "undesirable_weight"):
        if not getattr(c, name) > 0:
            raise LlmtuneError(f"{flag_name(name)}: must be > 0, got {getattr(c, name)}")
    if c.kto_loss not in ("kto", "apo_zero_unpaired"):
        raise LlmtuneError(f"--kto-loss: unknown loss {c.kto_loss!r} (choose kto, apo_zero_unpaired)")
    given = {"beta": beta_given, "label_smoothing": c.label_smoothing != 0.0, "gamma": c.gamma != 0.5,
             "desirable_weight": c.desirable_weight != 1.0, "undesirable_weight": c.undesirable_weight != 1.0,
             "kto_loss": c.kto_loss != "kto",
             **{name: getattr(c, name) != FIELDS[name].default for name in GRPO_SETTINGS}}
    readers = {"beta": ("dpo", "orpo", "simpo", "kto", "grpo"), "label_smoothing": ("dpo", "simpo"),
               "gamma": ("simpo",), "desirable_weight": ("kto",), "undesirable_weight": ("kto",),
               "kto_loss": ("kto",), **{name: ("grpo",) for name in GRPO_SETTINGS}}
    for name, on in given.items():
        if on and c.method not in readers[name]:
            raise LlmtuneError(f"{flag_name(name)}: only --method {' or '.join(readers[name])} uses it")
    if c.method == "grpo":
        _check_grpo(c)
    if c.method != "sft" and c.pack:
        raise LlmtuneError(f"--pack: not with --method {c.method} (one {'example' if c.method == 'kto' else 'pair'} "
                           f"per window)")
    if c.method != "sft" and c.train_on_prompt:
        why = {"orpo": "ORPO's NLL term counts the prompt's tokens already, as TRL's ORPOTrainer does",
               "kto": "KTO scores the completion given the prompt"}.get(
            c.method, f"{c.method.upper()} compares the chosen and rejected answers given the prompt, which both share")
        raise LlmtuneError(f"--train-on-prompt: not with --method {c.method} ({why})")
    if c.method == "kto" and c.kto_loss == "kto" and c.batch < 2 * c.ctx:
        raise LlmtuneError(f"--batch {c.batch}: --method kto needs at least 2 examples a step (--batch >= 2 x --ctx "
                           f"{c.ctx}): its KL estimate pairs each completion with another example's prompt of the step "
                           f"(TRL's KTOTrainer refuses a batch of 1)")


GRPO_SETTINGS = ("reward", "reward_weights", "num_generations", "max_completion_length", "temperature", "top_p",
                 "loss_type", "scale_rewards", "epsilon", "epsilon_high", "num_iterations", "completions_log")


def _check_grpo(c: "FinetuneConfig") -> None:
    """--method grpo's settings: rewards named (kinds known; files are loaded with the data), ranges as TRL's."""
    from llmtune.train.grpo import LOSS_TYPES, SCALE_REWARDS
    from llmtune.train.rewards import check_spec, parse_weights

    if not c.reward:
        raise LlmtuneError("--method grpo: needs --reward (e.g. regex:PATTERN, exact:COLUMN, FILE.py:FUNCTION)")
    for spec in c.reward:
        check_spec(spec)
    parse_weights(c.reward_weights, len(c.reward))
    if c.num_generations < 2:
        raise LlmtuneError(f"--num-generations: must be at least 2 (GRPO compares a prompt's completions), got "
                           f"{c.num_generations}")
    if (c.batch // c.ctx) % c.num_generations:
        raise LlmtuneError(f"--batch {c.batch}: {c.batch // c.ctx} completion(s) of --ctx {c.ctx} per step, not a "
                           f"multiple of --num-generations {c.num_generations}")
    if not 1 <= c.max_completion_length < c.ctx:
        raise LlmtuneError(f"--max-completion-length: must be in [1, --ctx {c.ctx}), got {c.max_completion_length}")
    if not (c.temperature > 0 and math.isfinite(c.temperature)):
        raise LlmtuneError(f"--temperature: must be > 0, got {c.temperature}")
    if not 0 < c.top_p <= 1:
        raise LlmtuneError(f"--top-p: must be in (0, 1], got {c.top_p}")
    if c.loss_type not in LOSS_TYPES:
        raise LlmtuneError(f"--loss-type: unknown loss {c.loss_type!r} (choose {', '.join(LOSS_TYPES)})")
    if c.scale_rewards not in SCALE_REWARDS:
        raise LlmtuneError(f"--scale-rewards: unknown choice {c.scale_rewards!r} (choose {', '.join(SCALE_REWARDS)})")
    for name in ("epsilon", "epsilon_high"):
        value = getattr(c, name)
        if value is not None and not 0 <= value < (1 if name == "epsilon" else math.inf):
            raise LlmtuneError(f"{flag_name(name)}: must be in [0, {'1' if name == 'epsilon' else 'inf'}), got {value}")
    if c.num_iterations < 1:
        raise LlmtuneError(f"--num-iterations: must be at least 1, got {c.num_iterations}")
    if c.completions_log is None and c.metrics is not None:
        c.completions_log = str(Path(c.metrics).with_suffix("")) + ".completions.jsonl"


def _check_schedule(c: FinetuneConfig) -> None:
    """--lr-schedule's default (constant, or llama.cpp's halflife when --lr-min is set: what runs
    did before it existed) and the flags each schedule takes."""
    from llmtune.train.optim import SCHEDULES

    if c.lr_schedule is None:
        c.lr_schedule = "halflife" if c.lr_min > 0 else "constant"
    if c.lr_schedule not in SCHEDULES:
        raise LlmtuneError(f"--lr-schedule: unknown schedule {c.lr_schedule!r} (choose {', '.join(SCHEDULES)})")
    if c.lr_schedule == "halflife" and not c.lr_min > 0:
        raise LlmtuneError("--lr-schedule halflife: needs --lr-min (the rate it halves down to)")
    if c.lr_schedule == "constant" and c.lr_min > 0:
        raise LlmtuneError("--lr-min: the constant schedule does not decay (choose --lr-schedule halflife, "
                           "linear or cosine)")
    if c.decay_epochs and c.lr_schedule in ("linear", "cosine"):
        raise LlmtuneError(f"--decay-epochs: only --lr-schedule halflife uses it ({c.lr_schedule} spans every "
                           "step of --epochs)")


def _check_selection(c: FinetuneConfig) -> None:
    """--eval-every, --early-stop, --min-delta, --select-metric, --save-best."""
    from llmtune.train.selection import METRICS

    for name in ("eval_every", "early_stop"):
        if getattr(c, name) < 0:
            raise LlmtuneError(f"{flag_name(name)}: must be >= 0 (0: off), got {getattr(c, name)}")
    if not c.min_delta >= 0:
        raise LlmtuneError(f"--min-delta: must be >= 0, got {c.min_delta}")
    if c.select_metric not in METRICS:
        raise LlmtuneError(f"--select-metric: unknown metric {c.select_metric!r} (choose {', '.join(METRICS)})")
    if not (c.early_stop or c.save_best):
        for name, default in (("min_delta", 0.0), ("select_metric", "val_loss")):
            if getattr(c, name) != default:
                raise LlmtuneError(f"{flag_name(name)}: needs --early-stop or --save-best")
    if c.select_metric == "benchmark" and c.eval_benchmark is None:
        raise LlmtuneError("--select-metric benchmark: needs --eval-benchmark FILE")


LORA_INIT_METHODS = ("kaiming", "gaussian", "pissa")


def _check_lora_variants(c: FinetuneConfig) -> None:
    """--rslora, --dora, --lora-plus and --lora-init-method: each needs an adapter, and a new one
    where it decides how the adapter starts or is scaled."""
    if c.lora_init_method not in LORA_INIT_METHODS:
        raise LlmtuneError(f"--lora-init-method: unknown method {c.lora_init_method!r} (choose "
                           f"{', '.join(LORA_INIT_METHODS)})")
    if not (c.lora_plus >= 0 and math.isfinite(c.lora_plus)):
        raise LlmtuneError(f"--lora-plus: must be a positive ratio (0: off), got {c.lora_plus}")
    given = [flag for flag, on in (("--rslora", c.rslora), ("--dora", c.dora), ("--lora-plus", c.lora_plus),
                                   ("--lora-init-method", c.lora_init_method != "kaiming")) if on]
    if given and not c.lora:
        new_only = given[0] in ("--rslora", "--lora-init-method")  # --lora-init is refused with these below
        raise LlmtuneError(f"{given[0]}: needs --lora-rank{' (a new adapter)' if new_only else ' (or --lora-init)'}")
    if c.lora_init is not None and c.lora_init_method != "kaiming":
        raise LlmtuneError(f"--lora-init-method: starts a new adapter; --lora-init {c.lora_init} continues one "
                           f"(drop one of them)")
    if c.lora_init is not None and c.rslora:
        raise LlmtuneError(f"--rslora: --lora-init {c.lora_init} fixes the scale (its adapter.lora.alpha / rank, as "
                           f"llama.cpp applies it); set it with --lora-alpha")


FIELDS = {f.name: f for f in dataclasses.fields(FinetuneConfig)}
# settings that do not change the trained weights: a resumed run may change them
RUN_ONLY = ("backend", "out_type", "metrics", "checkpoint_every", "keep_checkpoints", "eval_benchmark", "sample_prompt",
            "sample_every", "tensorboard", "plot", "completions_log")


def flag_name(field: str) -> str:
    return (FIELDS[field].metadata.get("flag") or "--" + field.replace("_", "-") if field in FIELDS
            else "--" + field.replace("_", "-"))


def default_words(name: str) -> Optional[str]:
    """How --help words a setting's default: its `unset` rule when the default is None or 0,
    else the value as one writes it on the command line (1e-05 -> 1e-5, 0.0 -> 0); None for a
    switch or a setting that is simply absent by default."""
    f = FIELDS[name]
    value, unset = f.default, f.metadata.get("unset")
    if unset and not value:
        return unset
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, float):
        mantissa, _, exponent = f"{value:g}".partition("e")
        value = mantissa + (f"e{int(exponent)}" if exponent else "")
    return str(value)


def _type_words(field: str) -> str:
    """'an integer', 'a number', 'true or false' or 'a string': what FinetuneConfig's annotation asks for."""
    kind = FIELDS[field].type.removeprefix("Optional[").removesuffix("]")
    return {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string",
            "list[str]": "a list of strings"}[kind]


def _check_type(field: str, value: Any, source: str) -> None:
    """A one-line error naming the setting when `value` is not of the field's type (a TOML
    string where a number belongs would otherwise fail deep inside as a comparison of str and int)."""
    words = _type_words(field)
    ok = {"an integer": isinstance(value, int) and not isinstance(value, bool),
          "a number": isinstance(value, (int, float)) and not isinstance(value, bool),
          "true or false": isinstance(value, bool),
          "a string": isinstance(value, str),
          "a list of strings": isinstance(value, list) and all(isinstance(v, str) for v in value)}[words]
    if not ok:
        raise LlmtuneError(f"{source}{value!r} should be {words}")


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Settings from a TOML file: top-level keys or a [finetune] table, named like the flags
    (`lr-min` or `lr_min`). Unknown keys are errors, so typos don't pass silently."""
    path = Path(path)
    data = read_toml(path)
    table = data.get("finetune", data)
    out = {}
    for key, value in table.items():
        name = key.replace("-", "_")
        if name == "no_shuffle":
            _check_type("shuffle", value, f"{path}: {key} = ")
            name, value = "shuffle", not value
        if name not in FIELDS:
            raise LlmtuneError(f"{path}: unknown setting {key!r} (known: {', '.join(sorted(FIELDS))})")
        _check_type(name, value, f"{path}: {key} = ")
        out[name] = value
    return out


def _explicit(config_file, flags: dict) -> dict[str, Any]:
    """The settings a run names: the config file's, then every flag that is not None."""
    values = load_config_file(config_file) if config_file else {}
    for key, value in flags.items():
        if key not in FIELDS:
            raise TypeError(f"unknown finetune setting {key!r}")
        if value is not None:
            _check_type(key, value, f"{flag_name(key)}: ")
            values[key] = value
    return values


def make_config(config_file: str | Path | None = None, **flags) -> FinetuneConfig:
    """Defaults, then the config file, then every flag that is not None."""
    values = _explicit(config_file, flags)
    try:
        return FinetuneConfig(**values).resolved()
    except TypeError as exc:
        raise LlmtuneError(f"{config_file or 'settings'}: {exc}") from None


def _differs(key: str, value: Any, saved: dict, checkpoint) -> str:
    """How a flag differs from the setting a checkpoint was trained with, in words for a switch and
    for a setting the run did not have (a full finetune has no --lora-rank)."""
    then = saved.get(key)
    if isinstance(then, bool) or isinstance(value, bool):
        flag_means = not FIELDS[key].default  # a switch names the value that is not the default
        return f"checkpoint {checkpoint} was trained {'with' if then == flag_means else 'without'} it"
    if then is None:
        full = key in ("lora_rank", "lora_init") and saved.get("lora_rank") is None and saved.get("lora_init") is None
        return f"{value!r}, but checkpoint {checkpoint} {'is a full finetune' if full else 'was trained without it'}"
    return f"{value!r} differs from the {then!r} checkpoint {checkpoint} was trained with"


def resume_config(saved: dict, checkpoint, config_file: str | Path | None = None, **flags) -> FinetuneConfig:
    """The settings of a resumed run: the checkpoint's (`saved`, FinetuneConfig fields), so the
    resume command needs no flags. A flag or config key that would change the trained weights must
    agree with them (one line naming it); RUN_ONLY ones (backend, metrics, checkpointing) may change."""
    values = {k: v for k, v in saved.items() if k in FIELDS}
    # the benchmark chooses the best step and the stop when it is the selection metric
    selects_by_benchmark = values.get("select_metric") == "benchmark"
    for key, value in _explicit(config_file, flags).items():
        fixed = key not in RUN_ONLY or (key == "eval_benchmark" and selects_by_benchmark)
        if fixed and value != values.get(key):
            raise LlmtuneError(f"{flag_name(key)}: {_differs(key, value, values, checkpoint)} (--resume continues a "
                               f"run with its own settings: drop the flag, or start a new run)")
        values[key] = value
    return FinetuneConfig(**values).resolved()
