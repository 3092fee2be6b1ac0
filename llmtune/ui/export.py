"""Rich rendering of `llmtune export`: sizes before and after (its progress bar: ui/progress.py tensor_progress)."""

from __future__ import annotations

from rich.table import Table

from llmtune.convert.export import ExportSummary, TensorExport
from llmtune.ui.format import mib


def summary_table(summary: ExportSummary) -> Table:
    """Sizes before and after, per conversion (source type -> output type) and in total (summary_notes follow it)."""
    table = Table(title=f"{summary.model_path.name} -> {summary.out_path.name} ({summary.type})", title_justify="left")
    table.add_column("tensors", no_wrap=True)
    for col in ("count", "params", "size before", "size after", "bits/weight"):
        table.add_column(col, justify="right")
    for key, ts in _by_conversion(summary.tensors):
        n = sum(t.n_elements for t in ts)
        after = sum(t.dst_bytes for t in ts)
        table.add_row(key, str(len(ts)), f"{n:,}", mib(sum(t.src_bytes for t in ts), 2), mib(after, 2),
                      f"{8 * after / n:.2f}")
    table.add_section()
    table.add_row("total", str(len(summary.tensors)), f"{summary.n_params:,}", mib(summary.bytes_in, 2),
                  mib(summary.bytes_out, 2), f"{summary.bpw_out:.2f}", style="bold")
    return table


def summary_notes(summary: ExportSummary) -> list[str]:
    """The lines under the table (lines of their own: a table's caption would wrap at its width)."""
    notes = [f"quantized weights: {summary.quantized_bpw:.2f} bits/weight; file {mib(summary.file_bytes, 2)}; "
             f"{summary.seconds:.1f} s"]
    if summary.n_fallback:
        notes.append("* rows do not split into blocks of the wanted type: llama.cpp's fallback type")
    return notes


def _by_conversion(tensors: list[TensorExport]) -> list[tuple[str, list[TensorExport]]]:
    """Tensors grouped as 'F32 -> Q8_0' (a '*' marks llama.cpp's fallback type), biggest output first."""
    groups: dict[str, list[TensorExport]] = {}
    for t in tensors:
        key = f"{t.src_type.name} -> {t.dst_type.name}" + (" *" if t.fallback else "")
        groups.setdefault(key, []).append(t)
    return sorted(groups.items(), key=lambda kv: -sum(t.dst_bytes for t in kv[1]))
