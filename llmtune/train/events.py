"""What a finetune run tells its caller: results, and progress events as frozen dataclasses.

`llmtune.finetune(callback=...)` receives one event object per call; the CLI renders them
(ui/finetune.py), tests read their fields. `Event.kind` names each ("step", "epoch", ...), and
`as_record()` gives the JSON-ready dict the --metrics file and tests use."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Optional


@dataclass
class EpochResult:
    epoch: int
    train_loss: float
    train_loss_err: float
    train_accuracy: float
    train_accuracy_err: float
    val_loss: float = float("nan")
    val_loss_err: float = float("nan")
    val_accuracy: float = float("nan")
    val_accuracy_err: float = float("nan")
    tokens_per_s: float = 0.0
    seconds: float = 0.0
    mfu: float = float("nan")  # model FLOP utilisation of the epoch's steps (train/flops.py)
    bench_accuracy: float = float("nan")  # --eval-benchmark: accuracy with the weights at the epoch's end
    bench_accuracy_err: float = float("nan")
    val_metrics: dict = field(default_factory=dict)  # --method dpo|orpo|simpo: TRL's metrics of the validation pass


@dataclass
class Evaluation:
    """One validation pass (at an epoch end, or every --eval-every steps) and the scores hooks add
    to it (--eval-benchmark): what --early-stop and --save-best select on."""

    epoch: int  # 1-based: the epoch in progress
    global_step: int  # optimizer steps done
    val_loss: float = float("nan")
    val_loss_err: float = float("nan")
    val_accuracy: float = float("nan")
    val_accuracy_err: float = float("nan")
    bench_accuracy: float = float("nan")
    bench_accuracy_err: float = float("nan")
    val_metrics: dict = field(default_factory=dict)  # --method dpo|orpo|simpo: TRL's metrics of the pass


@dataclass
class FinetuneResult:
    output: Path
    config: Any  # FinetuneConfig
    epochs: list[EpochResult] = field(default_factory=list)
    first_loss: float = float("nan")
    n_tokens: int = 0
    n_train_windows: int = 0
    n_val_windows: int = 0
    memory: dict = field(default_factory=dict)
    plan: tuple = ()  # what a memory limit decided and what it costs (train/preflight.py plan_lines)
    bench_before: float = float("nan")  # --eval-benchmark: accuracy of the model before training
    val_loss_written: float = float("nan")  # a full finetune: the validation loss of the file as written
    best_step: int = 0  # --save-best / --early-stop: the step of the best validation pass (0: none)
    best_value: float = float("nan")  # its --select-metric value
    stopped_at: int = 0  # --early-stop: the step training stopped at (0: it ran every epoch)


@dataclass(frozen=True)
class Event:
    kind: ClassVar[str] = ""

    def as_record(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Start(Event):
    """What will train, on what, and the memory it takes (printed before the first step)."""

    kind: ClassVar[str] = "start"
    config: Any  # FinetuneConfig
    memory: dict
    n_tokens: int
    n_train: int
    n_val: int
    steps_per_epoch: int
    n_trainable: int
    n_params: int
    trainable: list
    backend: str
    lora: Optional[dict]  # rank, alpha, n_targets, init (None: a full finetune)
    step: int  # > 0 when resumed
    base_types: dict
    data: dict  # train/chat.py data_info
    base_mapped: int = 0  # bytes of the frozen base read from the model file's mapping (train/memory.py)
    plan: tuple = ()  # what a memory limit decided and what it costs, one line each (train/preflight.py plan_lines)


@dataclass(frozen=True)
class Step(Event):
    kind: ClassVar[str] = "step"
    epoch: int  # 1-based
    step: int  # within the epoch, 1-based
    steps: int  # steps per epoch
    global_step: int
    loss: float
    running_loss: float
    accuracy: float
    lr: float
    tokens_per_s: float
    grad_norm: float = float("nan")  # the step's global gradient norm before --grad-clip
    mfu: float = float("nan")  # model FLOP utilisation of the epoch's steps so far (train/flops.py)
    metrics: dict = field(default_factory=dict)  # --method dpo|orpo|simpo: TRL's metrics (rewards/..., logps/...)

    def as_record(self) -> dict:
        record = asdict(self)
        metrics = record.pop("metrics")
        return {**record, **metrics}


@dataclass(frozen=True)
class EpochEnd(Event):
    kind: ClassVar[str] = "epoch"
    result: EpochResult

    def as_record(self) -> dict:
        return asdict(self.result)


@dataclass(frozen=True)
class Validation(Event):
    """A validation pass; `improved`: the best by --select-metric so far (--early-stop, --save-best)."""

    kind: ClassVar[str] = "validation"
    evaluation: Evaluation
    epoch_end: bool  # at an epoch's end (EpochEnd reports it too), else an --eval-every pass
    improved: bool
    best_step: int

    def as_record(self) -> dict:
        return {**asdict(self.evaluation), "epoch_end": self.epoch_end, "improved": self.improved,
                "best_step": self.best_step}


@dataclass(frozen=True)
class Selected(Event):
    """The end of a run with --early-stop or --save-best: the best validation pass and whether -o holds it."""

    kind: ClassVar[str] = "selected"
    metric: str
    value: float
    step: int  # its optimizer step (0: there was none)
    epoch: int
    saved: bool  # --save-best: -o receives the weights of that step
    stopped_at: int  # --early-stop: the step training stopped at (0: it ran every epoch)
    patience: int


@dataclass(frozen=True)
class Benchmark(Event):
    """--eval-benchmark's score; epoch 0 is the model before training."""

    kind: ClassVar[str] = "benchmark"
    epoch: int
    benchmark: str  # the task kind (hellaswag, winogrande, multiple-choice)
    accuracy: float
    accuracy_err: float
    n_tasks: int


@dataclass(frozen=True)
class Sample(Event):
    kind: ClassVar[str] = "sample"
    epoch: int
    global_step: int
    prompt: str
    chat: bool  # the prompt was rendered as an instruction (a chat user turn, the Alpaca prompt): text answers it
    text: str


@dataclass(frozen=True)
class Checkpoint(Event):
    """A checkpoint written: its path, the optimizer steps it holds, and where in the run that is."""

    kind: ClassVar[str] = "checkpoint"
    path: str
    step: int
    where: str


@dataclass(frozen=True)
class Resumed(Checkpoint):
    """A run continued from a checkpoint."""

    kind: ClassVar[str] = "resumed"
    epochs: tuple = ()  # the EpochResults of the epochs finished before the checkpoint


@dataclass(frozen=True)
class Stopping(Event):
    """A signal arrived: the current step finishes, then a checkpoint is written."""

    kind: ClassVar[str] = "stopping"
    signal: str
    step: int


@dataclass(frozen=True)
class Warning(Event):  # noqa: A001 - the event's name in the stream; never raised
    kind: ClassVar[str] = "warning"
    message: str


@dataclass(frozen=True)
class Saved(Event):
    kind: ClassVar[str] = "saved"
    path: str
    bytes: int


@dataclass(frozen=True)
class OutputChecked(Event):
    """A full finetune's output scored as written (train/output.py): `types` counts the trained
    tensors by the type they were written in; `rescored`: the validation windows were scored
    again with those values (a lossy type), else `val_loss_written` is the in-memory loss."""

    kind: ClassVar[str] = "output_checked"
    path: str
    val_loss: float
    val_loss_written: float
    types: dict
    rescored: bool


Callback = Callable[[Event], None]


def ignore(event: Event) -> None:
    """The callback of a caller that wants no progress."""
