"""Seeing a run: --tensorboard event files and the --plot picture, both drawn from the records the
--metrics file gets (Hook.on_record), and `llmtune plot`, the same picture from a finished run's
--metrics file. Neither ever costs the run: a writer that fails warns once and is dropped."""

from __future__ import annotations

import importlib
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from llmtune.errors import LlmtuneError
from llmtune.gguf.file import check_output_path, check_replaceable
from llmtune.resources import write_atomically
from llmtune.train.config import FinetuneConfig
from llmtune.train.loop import Hook, Run
from llmtune.train.metrics import read_metrics
from llmtune.train.preference import LOSS_LABELS

# record type -> TensorBoard tag group; every number of such a record is a scalar there
TAG_GROUPS = {"train_step": "train", "validation": "val", "benchmark": "benchmark"}
NOT_SCALARS = {"type", "epoch", "step", "steps", "global_step", "elapsed_s", "n_tasks"}  # positions and counts
TB_FLUSH_S = 10  # a TensorBoard watching the run sees a step within this many seconds
PLOT_SIZE, PLOT_DPI = (8.0, 4.5), 100  # 800 x 450 pixels
PREFERENCE_PLOT_SIZE = (8.0, 7.5)  # 800 x 750: the loss above, reward margin and accuracy below
MARGIN, REWARD_ACCURACY = "rewards/margins", "rewards/accuracies"  # what the preference trainer records (TRL's)
REDRAW_S = 60.0  # --plot is redrawn at least this often while steps come (an epoch may be long)


def observe_hooks(cfg: FinetuneConfig) -> list[Hook]:
    """The hooks --tensorboard and --plot ask for; a missing library fails here, before training."""
    hooks: list[Hook] = []
    if cfg.tensorboard:
        hooks.append(TensorBoardHook(cfg.tensorboard))
    if cfg.plot:
        hooks.append(PlotHook(cfg.plot))
    return hooks


def need(module: str, flag: str, extra: str):
    """The optional library, imported now (before training, so the first epoch's tokens/s does not
    pay for it); one line naming the pip command when it is not installed."""
    try:
        return importlib.import_module(module)
    except ImportError:
        package = module.split(".")[0]
        raise LlmtuneError(f"{flag}: needs {package}, which is not installed (pip install {package}, or "
                           f"pip install -e \".[{extra}]\" in llmtune's folder)") from None


def scalars(record: dict) -> list[tuple[str, float]]:
    """(tag, value) of every number in a record TensorBoard shows: train/loss, val/accuracy,
    benchmark/accuracy... (standard errors, positions and counts left out)."""
    group = TAG_GROUPS.get(record.get("type"))
    if group is None:
        return []
    return [(f"{group}/{key}", float(value)) for key, value in record.items()
            if key not in NOT_SCALARS and not key.endswith("_err") and isinstance(value, (int, float))
            and not isinstance(value, bool)]


class _Writer(Hook):
    """A hook writing files beside the run on rank 0 only; the first failure warns and stops it."""

    flag = ""

    def __init__(self, path):
        self.path, self.failed = Path(path), False

    def _fail(self, run: Run, exc: Exception) -> None:
        self.failed = True
        why = (str(exc) if isinstance(exc, LlmtuneError)
               else f"{self.path}: cannot write ({getattr(exc, 'strerror', None) or exc})")
        run.warn(f"{self.flag} {why}; training goes on without it")

    def _live(self, run: Run) -> bool:
        return not self.failed and run.trainer.comm.is_root


class TensorBoardHook(_Writer):
    """--tensorboard DIR: each record's numbers as scalars at its global step, through tensorboardX's
    SummaryWriter (torch.utils.tensorboard's API). A resumed run purges the steps from the resume on
    that the interrupted process had written (SummaryWriter's purge_step), so TensorBoard shows one curve."""

    flag = "--tensorboard"

    def __init__(self, folder):
        self.library = need("tensorboardX", self.flag, "tensorboard")
        super().__init__(folder)
        self.writer = None

    def on_record(self, run: Run, record: dict) -> None:
        step = record.get("global_step")
        if step is None or not self._live(run):
            return
        try:
            if self.writer is None:  # a new run's first record is at step 0 or 1; a resumed run's after its checkpoint
                # the file name's own time has whole seconds: a resume within the same second would
                # overwrite the first writer's file, so the time in nanoseconds (TensorBoard reads the
                # files in name order) and the pid follow
                suffix = f".{time.time_ns():020d}.{os.getpid()}"
                self.writer = self.library.SummaryWriter(str(self.path), purge_step=step if step > 1 else None,
                                                         flush_secs=TB_FLUSH_S, filename_suffix=suffix)
            for tag, value in scalars(record):
                self.writer.add_scalar(tag, value, step)
        except Exception as exc:  # noqa: BLE001 - an observer never costs the run (it warns and stops)
            self._fail(run, exc)

    def on_stop(self, run: Run, reason: str) -> None:
        if self.writer is not None:
            try:
                self.writer.close()
            except Exception as exc:  # noqa: BLE001 - as above
                self._fail(run, exc)
            self.writer = None


@dataclass
class Curves:
    """What the picture shows: the loss and learning rate of each step, the validation passes, the
    best pass and the early stop (the "selected" record of --early-stop / --save-best), and for a
    preference run (--method dpo|orpo|simpo) the reward margin and accuracy of each step and pass, for a
    GRPO run its mean reward and completion length."""

    steps: list = field(default_factory=list)
    loss: list = field(default_factory=list)
    lr: list = field(default_factory=list)
    epoch: list = field(default_factory=list)
    val_steps: list = field(default_factory=list)
    val_loss: list = field(default_factory=list)
    margin: list = field(default_factory=list)  # per step (NaN: not a preference run)
    reward_accuracy: list = field(default_factory=list)
    val_margin: list = field(default_factory=list)  # per validation pass
    val_reward_accuracy: list = field(default_factory=list)
    reward: list = field(default_factory=list)  # GRPO's mean reward per step (NaN: not a GRPO run)
    length: list = field(default_factory=list)  # and its completions' mean length
    val_reward: list = field(default_factory=list)  # per validation pass
    selected_step: int = 0  # the run's best pass by its --select-metric (0: no "selected" record)
    stopped_at: int = 0  # the step --early-stop ended the run at (0: it did not)
    method: str = "sft"  # --method: what the loss is (the y axis's label); files from before it: sft

    @classmethod
    def of(cls, records) -> "Curves":
        curves = cls()
        for record in records:
            curves.add(record)
        return curves

    def add(self, record: dict) -> None:
        if record.get("type") == "train_step":
            self.steps.append(record["global_step"])
            self.loss.append(_number(record.get("loss")))
            self.lr.append(_number(record.get("lr")))
            self.epoch.append(record.get("epoch"))
            self.margin.append(_number(record.get(MARGIN)))
            self.reward_accuracy.append(_number(record.get(REWARD_ACCURACY)))
            self.reward.append(_number(record.get("reward")))
            self.length.append(_number(record.get("completions/mean_length")))
            self.method = record.get("method", self.method)
        elif record.get("type") == "validation":
            self.val_steps.append(record["global_step"])
            self.val_loss.append(_number(record.get("loss")))
            self.val_margin.append(_number(record.get(MARGIN)))
            self.val_reward_accuracy.append(_number(record.get(REWARD_ACCURACY)))
            self.val_reward.append(_number(record.get("reward")))
        elif record.get("type") == "selected":
            self.selected_step = _step(record.get("global_step"))
            self.stopped_at = _step(record.get("stopped_at"))

    def __len__(self) -> int:
        return len(self.steps) + len(self.val_steps) + bool(self.selected_step or self.stopped_at)

    @property
    def best_step(self) -> int:
        """The best validation pass's step: the run's own choice when it made one (--early-stop,
        --save-best: its --select-metric), else the pass with the lowest validation loss; 0: none."""
        if self.selected_step:
            return self.selected_step
        finite = [(v, s) for s, v in zip(self.val_steps, self.val_loss) if math.isfinite(v)]
        return min(finite)[1] if finite else 0

    @property
    def preference(self) -> bool:
        return any(math.isfinite(v) for v in self.margin + self.val_margin)

    @property
    def grpo(self) -> bool:
        return any(math.isfinite(v) for v in self.reward + self.val_reward)


def _number(value) -> float:
    return float(value) if isinstance(value, (int, float)) else math.nan  # None: NaN in the record


def _step(value) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
def picture_format(path, flag: str) -> str:
    """The format a picture file is written in: the one its extension names when matplotlib writes
    it (png, jpg, svg, pdf, ...), PNG for a name without one; any other extension is refused in one
    line, before the run (a .jpg name never holds PNG bytes)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415 - optional (the plot extra)

    ext = Path(path).suffix.lower().removeprefix(".")
    if not ext:
        return "png"
    if ext not in FigureCanvasAgg.get_supported_filetypes():
        raise LlmtuneError(f"{flag} {path}: matplotlib cannot write .{ext} pictures (name it .png, .jpg, .svg, .pdf "
                           f"or another of {', '.join(sorted(FigureCanvasAgg.get_supported_filetypes()))})")
    return ext


class PlotHook(_Writer):
    """--plot FILE.png (or .jpg, .svg, .pdf...: picture_format): the curves so far, redrawn after
    each validation pass (or epoch end), every REDRAW_S seconds of steps, and when the run stops,
    each time written atomically, so the file is always a whole picture. A resumed run with
    --metrics starts from that file's records."""

    flag = "--plot"

    def __init__(self, path):
        need("matplotlib.backends.backend_agg", self.flag, "plot")
        self.format = picture_format(path, self.flag)
        super().__init__(path)
        self.curves: Optional[Curves] = None
        self.drawn, self.last_draw = 0, time.perf_counter()

    def on_record(self, run: Run, record: dict) -> None:
        if not self._live(run):
            return
        if self.curves is None:
            self.curves = self._start(run, record)
        else:
            self.curves.add(record)
        if record["type"] in ("validation", "epoch") or time.perf_counter() - self.last_draw > REDRAW_S:
            self._draw(run)

    @staticmethod
    def _start(run: Run, record: dict) -> Curves:
        """The curves of a new run start with this record; a resumed one's with its --metrics file,
        which holds the records up to the checkpoint and this one."""
        if record.get("global_step", 0) > 1 and run.log.fh is not None:
            try:
                return Curves.of(read_metrics(run.log.path))
            except LlmtuneError:
                pass
        return Curves.of([record])

    def on_stop(self, run: Run, reason: str) -> None:
        if self._live(run):
            self._draw(run)

    def _draw(self, run: Run) -> None:
        self.last_draw = time.perf_counter()
        if self.curves is None or len(self.curves) == self.drawn:
            return
        try:
            draw_curves(self.curves, self.path, title=Path(run.result.output).name, fmt=self.format)
            self.drawn = len(self.curves)
        except Exception as exc:  # noqa: BLE001 - an observer never costs the run (it warns and stops)
            self._fail(run, exc)


# the first bytes of the pictures matplotlib writes, where a format has them: `llmtune plot -o`
# replaces an existing file only when it is such a picture (else --force)
PICTURE_MAGIC = {"png": (b"\x89PNG",), "jpg": (b"\xff\xd8\xff",), "jpeg": (b"\xff\xd8\xff",), "pdf": (b"%PDF",),
                 "svg": (b"<?xml", b"<svg"), "gif": (b"GIF8",), "webp": (b"RIFF",), "tif": (b"II*\0", b"MM\0*"),
                 "tiff": (b"II*\0", b"MM\0*"), "eps": (b"%!PS", b"\xc5\xd0\xd3\xc6"), "ps": (b"%!PS",)}


def plot_metrics(metrics, out, force: bool = False) -> Curves:
    """`llmtune plot`: a --metrics file's curves drawn into `out` (the --plot picture); an existing
    `out` that is not a picture of its format is refused unless `force`."""
    need("matplotlib.backends.backend_agg", "llmtune plot", "plot")
    out = check_output_path(out, metrics)
    fmt = picture_format(out, "-o")
    if fmt in PICTURE_MAGIC:
        check_replaceable(out, (f"a .{fmt} picture", PICTURE_MAGIC[fmt]), "-o", force)
    curves = Curves.of(read_metrics(metrics))
    draw_curves(curves, Path(out), title=Path(metrics).name, fmt=fmt)
    return curves


def draw_curves(curves: Curves, path: Path, title: str = "", fmt: str = "png") -> Path:
    """Train loss per step (faint) and its moving mean, validation loss, the learning rate on a
    second axis, epoch boundaries, the best validation pass (a red star and line) and the early
    stop (a purple line): a picture of PLOT_SIZE at PLOT_DPI in format `fmt` (picture_format's),
    written atomically. A preference run adds a panel below with its reward margin and accuracy
    (PREFERENCE_PLOT_SIZE). Drawn with
    matplotlib's object API on an Agg canvas (no pyplot), so a caller's own figures and backend are
    left alone."""
    # optional dependency (the extra "plot"): imported only when a picture is drawn
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415 - optional (the plot extra)
    from matplotlib.figure import Figure  # noqa: PLC0415 - optional (the plot extra)

    preference = curves.preference or curves.grpo  # a panel below
    fig = Figure(figsize=PREFERENCE_PLOT_SIZE if preference else PLOT_SIZE, dpi=PLOT_DPI)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(2, 1, 1) if preference else fig.add_subplot()
    handles = _loss_lines(ax, curves)
    handles += _marks(ax, curves, labels=True)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(LOSS_LABELS.get(curves.method, "loss"))
    ax.grid(True, alpha=0.25)
    lr_ax = ax.twinx()
    handles += lr_ax.plot(curves.steps, curves.lr, color="C2", ls="--", lw=1.0, label="learning rate")
    lr_ax.set_ylabel("learning rate")
    top = max((v for v in curves.lr if math.isfinite(v)), default=0.0)
    lr_ax.set_ylim(0, 1.3 * top if top > 0 else 1.0)  # headroom: the legend sits above the lr's plateau
    lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    lr_ax.legend(handles=handles, loc="upper right", fontsize=8, framealpha=0.9)  # the twin axis is drawn on top
    if title:
        ax.set_title(title, fontsize=10)
    if preference:
        (_reward_panel if curves.preference else _grpo_panel)(fig.add_subplot(2, 1, 2, sharex=ax), curves)
    fig.tight_layout()
    return write_atomically(path, lambda fh: fig.savefig(fh, format=fmt, dpi=PLOT_DPI), "cannot write the plot")


def _marks(ax, curves: Curves, labels: bool) -> list:
    """Epoch boundaries (dotted grey), the best validation pass (dotted red line; a red star on the
    validation loss) and the early stop (dashed purple line); the legend's handles when `labels`."""
    handles = []
    for s, before, after in zip(curves.steps[1:], curves.epoch, curves.epoch[1:]):
        if before != after:
            ax.axvline(s - 0.5, color="0.6", lw=0.6, ls=":")  # an epoch boundary
    best = curves.best_step
    if best:
        line = ax.axvline(best, color="C3", lw=1.0, ls=":", label=f"best: step {best}" if labels else None)
        at = [v for s, v in zip(curves.val_steps, curves.val_loss) if s == best and math.isfinite(v)]
        if labels and at:
            handles += ax.plot([best], at[-1:], "*", color="C3", ms=14, zorder=5, label=f"best: step {best}")
        elif labels:
            handles.append(line)
    if curves.stopped_at:
        line = ax.axvline(curves.stopped_at, color="C4", lw=1.4, ls="--",
                          label=f"stopped early at step {curves.stopped_at}" if labels else None)
        handles += [line] if labels else []
    return handles


def _reward_panel(ax, curves: Curves) -> None:
    """A preference run's reward margin per step (faint) and its moving mean, per validation pass,
    and the reward accuracy (the share of pairs whose chosen reward beats the rejected one) on a
    second axis, in [0, 1]."""
    handles = _step_and_mean(ax, curves.steps, curves.margin, "C5", "reward margin")
    if any(math.isfinite(v) for v in curves.val_margin):
        handles += ax.plot(curves.val_steps, curves.val_margin, "o-", color="C5", lw=1.6, ms=4,
                           label="reward margin (validation)")
    _marks(ax, curves, labels=False)
    ax.axhline(0.0, color="0.6", lw=0.6)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("reward margin (chosen - rejected)")
    ax.grid(True, alpha=0.25)
    acc_ax = ax.twinx()
    handles += _step_and_mean(acc_ax, curves.steps, curves.reward_accuracy, "C6", "reward accuracy", faint_only=True)
    if any(math.isfinite(v) for v in curves.val_reward_accuracy):
        handles += acc_ax.plot(curves.val_steps, curves.val_reward_accuracy, "s--", color="C6", lw=1.2, ms=4,
                               label="reward accuracy (validation)")
    acc_ax.set_ylim(-0.02, 1.3)  # headroom for the legend
    acc_ax.set_ylabel("reward accuracy")
    acc_ax.legend(handles=handles, loc="upper left", fontsize=8, framealpha=0.9, ncol=2)


def _grpo_panel(ax, curves: Curves) -> None:
    """A GRPO run's mean reward per step (faint) and its moving mean, per validation pass, and the
    completions' mean length (tokens) on a second axis."""
    handles = _step_and_mean(ax, curves.steps, curves.reward, "C5", "reward")
    if any(math.isfinite(v) for v in curves.val_reward):
        handles += ax.plot(curves.val_steps, curves.val_reward, "o-", color="C5", lw=1.6, ms=4,
                           label="reward (validation)")
    _marks(ax, curves, labels=False)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("reward (mean over completions)")
    ax.grid(True, alpha=0.25)
    len_ax = ax.twinx()
    handles += _step_and_mean(len_ax, curves.steps, curves.length, "C6", "completion length", faint_only=True)
    top = max((v for v in curves.length if math.isfinite(v)), default=1.0)
    len_ax.set_ylim(0, 1.3 * top)  # headroom for the legend
    len_ax.set_ylabel("completion length (tokens)")
    len_ax.legend(handles=handles, loc="upper left", fontsize=8, framealpha=0.9, ncol=2)


def _step_and_mean(ax, steps, values, colour: str, name: str, faint_only: bool = False) -> list:
    """Each step's value (faint) and its moving mean over about a 40th of the run (the curve to read)."""
    steps, values = np.asarray(steps, dtype=float), np.asarray(values, dtype=float)
    window = max(1, len(steps) // 40)
    faint = dict(alpha=0.3, lw=0.8) if window > 1 else dict(lw=1.4)
    handles = ax.plot(steps, values, color=colour, label=f"{name} (step)", **faint)
    if window > 1:
        mean = ax.plot(steps[window - 1:], _moving_mean(values, window), color=colour, lw=1.6,
                       label=f"{name} (mean of {window} steps)")
        handles = mean if faint_only else handles + mean
    return handles


def _loss_lines(ax, curves: Curves) -> list:
    """Each step's loss (faint), its moving mean over about a 40th of the run, the validation passes."""
    handles = _step_and_mean(ax, curves.steps, curves.loss, "C0", "train loss")
    if curves.val_steps:
        handles += ax.plot(curves.val_steps, curves.val_loss, "o-", color="C1", lw=1.6, ms=4, label="validation loss")
    return handles


def _moving_mean(values: np.ndarray, window: int) -> np.ndarray:
    """The mean of each run of `window` values ending at each point (NaN steps count as gaps)."""
    finite = np.isfinite(values)
    sums = np.convolve(np.where(finite, values, 0.0), np.ones(window), "valid")
    counts = np.convolve(finite.astype(float), np.ones(window), "valid")
    with np.errstate(invalid="ignore", divide="ignore"):
        return sums / counts
