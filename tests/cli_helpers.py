"""Run the llmtune CLI in-process (through `llmtune.cli.main`, as the console script does)."""

import sys

from llmtune import cli


def run_cli(monkeypatch, capsys, *args):
    """-> (exit code, stdout, stderr) of `llmtune ARGS...`."""

    monkeypatch.setattr(sys, "argv", ["llmtune", *map(str, args)])
    code = 0
    try:
        cli.main()
    except SystemExit as exc:
        code = exc.code or 0
    captured = capsys.readouterr()
    return code, captured.out, captured.err
