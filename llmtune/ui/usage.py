"""The command line's own words about itself: a usage mistake as one line with the closest real
flag (or command), and --help with readable placeholders (FILE, N, X, TEXT), not Python types."""

from __future__ import annotations

from typing import Iterable, Optional

import typer.core

try:  # typer 0.29+ vendors its own click: its exceptions and parameter classes are those
    from typer._click import exceptions as errors
except ImportError:  # pragma: no cover - older typer on the real click
    from click import exceptions as errors

# llama.cpp's short flags that llmtune spells long only: suggested when the command has the long one
LLAMA_CPP_SHORT = {"-s": "--seed"}


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions)."""
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
    return row[-1]


def _closeness(given: str, candidate: str) -> Optional[tuple[int, int]]:
    """How near a mistyped flag or command name is to a real one (lower is nearer; None: not near).
    Beyond plain typos: initials (`learning-rate` -> `lr`) and a whole word of a longer flag
    (`n` -> `n-predict`, `ctx-size` -> `ctx`), the first word before any other."""
    g, c = given.lstrip("-").replace("_", "-").lower(), candidate.lstrip("-")
    distance = edit_distance(g, c)
    g_words, c_words = g.split("-"), c.split("-")
    if g == c:
        return 0, 0
    if len(g_words) > 1 and "".join(w[0] for w in g_words if w) == c:
        return 1, distance
    if c_words[0] == g or g_words[0] == c:
        return 2, distance
    if g in c_words or c in g_words:
        return 3, distance
    if distance <= (1 if len(g) <= 4 else 2 if len(g) <= 8 else 3):
        return 4, distance
    return None


def closest(given: str, candidates: Iterable[str]) -> list[str]:
    """The candidates nearest to `given` (several only when they tie), [] when none is near."""
    scored = sorted((score, c) for c in dict.fromkeys(candidates) if (score := _closeness(given, c)) is not None)
    return [c for score, c in scored if score == scored[0][0]][:3] if scored else []


def _long_flags(command) -> list[str]:
    return [o for p in command.params if isinstance(p, typer.core.TyperOption) and not p.hidden
            for o in (*p.opts, *p.secondary_opts) if o.startswith("--")]


def flag_name(param) -> str:
    """'--ctx' for an option (its long name), 'MODEL' for an argument."""
    if isinstance(param, typer.core.TyperOption):
        longs = [o for o in param.opts if o.startswith("--")]
        return (longs or param.opts)[0]
    return param.metavar or param.name.upper()


def _did_you_mean(names: list[str]) -> str:
    return f" (did you mean {' or '.join(names)}?)" if names else ""


def usage_error_line(exc: errors.UsageError) -> str:
    """A click usage error (unknown flag, bad value, missing argument...) as llmtune's one line."""
    ctx = exc.ctx
    command = ctx.command if ctx is not None else None
    where = f"llmtune {ctx.info_name}" if ctx is not None and ctx.parent is not None else "llmtune"
    if isinstance(exc, errors.NoSuchOption) and command is not None:
        flags = _long_flags(command)
        near = closest(exc.option_name, flags)
        known = LLAMA_CPP_SHORT.get(exc.option_name)
        if not near and known in flags:
            near = [known]
        return f"{exc.option_name}: no such option for {where}" + (_did_you_mean(near)
                                                                   or f" ({where} --help lists them)")
    if isinstance(exc, errors.BadParameter) and exc.param is not None:
        if isinstance(exc, errors.MissingParameter):
            if isinstance(exc.param, typer.core.TyperOption):
                return f"{flag_name(exc.param)}: missing ({where} --help)"
            return f"{where}: missing the {flag_name(exc.param)} argument ({where} --help)"
        message = " ".join(exc.message.split()).rstrip(".")
        errors_of = getattr(exc.__cause__, "errors", None)  # typer 0.29's pydantic coercion knows the value
        value = f" (got {errors_of()[0]['input']!r})" if callable(errors_of) and errors_of() else ""
        return f"{flag_name(exc.param)}: {message[:1].lower()}{message[1:]}{value}"
    message = " ".join(exc.format_message().split()).rstrip(".")
    if isinstance(command, typer.core.TyperGroup) and message.startswith("No such command"):
        name = message.split("'")[1] if "'" in message else ""
        return f"{name}: no such command" + (_did_you_mean(closest(name, command.list_commands(ctx)))
                                             or " (llmtune --help lists them)")
    return f"{where}: {message[:1].lower()}{message[1:]}"


# ------------------------------------------------------------------------------------ --help
def _placeholder(param) -> str:
    """FILE, N, X or TEXT, from the declared type (a list's items: list[Path] is FILE)."""
    kind = (param.bare_type() if hasattr(param, "bare_type") else getattr(param.type, "name", "")).lower()
    return "FILE" if "path" in kind else "N" if "int" in kind else "X" if "float" in kind else "TEXT"


class _Argument(typer.core.TyperArgument):
    """An argument shown by its name (MODEL), without a type column or braces in the usage line."""

    def display_type_rich(self, ctx):
        return None

    def _usage_display_name(self) -> str:
        return self.display_name_raw if self.required else f"[{self.display_name_raw}]"


class _Readable:
    """--help that names values FILE, N, X or TEXT (flags show none) instead of typer's <path>,
    <int>, <bool>, <list[Path]> and {model}."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for param in self.params:
            if isinstance(param, typer.core.TyperOption):
                if param.metavar is None:
                    param.metavar = "" if param.is_flag else _placeholder(param)
            elif isinstance(param, typer.core.TyperArgument):
                if param.metavar is None:
                    param.metavar = param.name.upper()
                param.__class__ = _Argument

    def get_help_option(self, ctx):
        option = super().get_help_option(ctx)
        if option is not None:
            option.metavar = ""  # a flag: no <bool>
        return option


class ReadableCommand(_Readable, typer.core.TyperCommand):
    """A command with readable --help (see _Readable)."""


class ReadableGroup(_Readable, typer.core.TyperGroup):
    """The command group (`llmtune --help`) with readable --help (see _Readable)."""


def readable_help(app: typer.Typer) -> None:
    """Every command registered on `app` renders its --help with ReadableCommand."""
    for info in app.registered_commands:
        info.cls = ReadableCommand

