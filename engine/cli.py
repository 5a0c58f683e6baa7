"""One error style for every command (argparse's): `PROG: error: MESSAGE` on one line.

Exit 2 for a user mistake (a flag, a path, a file, an environment value), 1 for a check
that ran and failed (a gate, a verify), 0 otherwise. A user mistake never shows a
traceback unless `--debug` is given or ENGINE_DEBUG=1 (engine.settings); a bug still
does. `parser()` makes an ArgumentParser whose help shows every default and lists the
environment variables the command reads; its usage errors are one line too, with a
pointer to `--help` instead of the usage block.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

EXIT_FAILED = 1   # a check ran and failed
EXIT_USAGE = 2    # the user's input cannot be used (argparse's exit status)


class UsageError(Exception):
    """A mistake in a flag, a path, a file or an environment value: one line, exit 2."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults after each flag's help (not for required flags, switches or None); the
    description and epilog keep their line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str:
        # a switch (store_true/false/const) takes no value: "(default: True)" on --no-X would read backwards
        # `is`, not `in (None, False)`: a default of 0 (a seed, a count) equals False and is shown
        if (action.required or action.nargs == 0 or action.default is None or action.default is False
                or action.default is argparse.SUPPRESS):
            return _with_range(action, action.help or "")
        return _with_range(action, super()._get_help_string(action))


def _with_range(action: argparse.Action, text: str) -> str:
    """`text` with the allowed range of a Ranged option (engine.cli.finite_float, whole_number) added."""
    allowed = getattr(action.type, "allowed", None)
    if not allowed or allowed in text:
        return text
    tail = " (default: %(default)s)"   # argparse's, kept last
    head, end = (text[:-len(tail)], tail) if text.endswith(tail) else (text, "")
    return f"{head} (range: {allowed.replace('%', '%%')}){end}"


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line usage errors: `PROG: error: MESSAGE (see PROG --help)`, exit 2."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")


def json_object(text: str) -> dict:
    """An argparse `type`: a JSON object (model kwargs and the like), else a one-line refusal."""
    import json

    try:
        v = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e} (got {text!r})") from None
    if not isinstance(v, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return v


def env_epilog(env: dict[str, str] | None) -> str | None:
    """The `environment:` block of a --help: one `NAME  what` line per variable (None when none)."""
    if not env:
        return None
    width = max(len(k) for k in env)
    return "environment:\n" + "\n".join(f"  {k.ljust(width)}  {v}" for k, v in env.items())


def parser(prog: str, description: str, env: dict[str, str] | None = None) -> argparse.ArgumentParser:
    """An ArgumentParser with defaults shown, an `environment:` epilog for `env` (name -> what)
    and a `--debug` flag."""
    p = ArgumentParser(prog=prog, description=description, epilog=env_epilog(env), formatter_class=HelpFormatter)
    return debug_flag(p)


def debug_flag(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`p` with the `--debug` flag every command takes (read it with `debugging(a.debug)`)."""
    p.add_argument("--debug", action="store_true", help="show the Python traceback of an error (also ENGINE_DEBUG=1)")
    return p


def corpus_flags(p: argparse.ArgumentParser, unconfined: str) -> argparse.ArgumentParser:
    """`p` with the confinement pair of a command that reads image files a records file names:
    `--confine-to-corpus` (dest confine_to_corpus: for untrusted records) and
    `--allow-outside-corpus` (dest allow_outside_corpus: accepted and ignored; given with the
    other, the caller refuses them as contradictory). `unconfined`: what the command does with
    records paths by default, in its own words."""
    p.add_argument("--confine-to-corpus", action="store_true",
                   help="for untrusted records: refuse (and name) paths that are absolute or leave the corpus "
                        f"folder, also through a symlink (default: {unconfined})")
    p.add_argument("--allow-outside-corpus", action="store_true",
                   help="accepted for older scripts and ignored: following records paths is the default")
    return p


def one_line(e: BaseException) -> str:
    """The message of `e` on one line; an OSError names its file."""
    if isinstance(e, OSError) and e.strerror and e.filename is not None:
        msg = f"{e.strerror}: {e.filename}"
    else:
        msg = str(e).strip() or type(e).__name__
    return " | ".join(line.strip() for line in msg.splitlines() if line.strip())


def error(prog: str, message: str) -> int:
    """Print `PROG: error: MESSAGE` on stderr; returns EXIT_USAGE for `return error(...)`."""
    print(f"{prog}: error: {' '.join(message.split())}", file=sys.stderr, flush=True)
    return EXIT_USAGE


def debugging(argv_debug: bool = False) -> bool:
    """True when tracebacks are wanted (`--debug`, or ENGINE_DEBUG=1; a bad ENGINE_DEBUG counts as 0)."""
    from engine import settings

    try:
        return argv_debug or settings.debug()
    except settings.SettingsError:
        return False


def guard(prog: str, body: Callable[[], int], errors: tuple[type[BaseException], ...] = (),
          debug: bool = False) -> int:
    """`body()`, with UsageError, engine.settings.SettingsError, OSError and `errors` turned
    into one `PROG: error:` line and EXIT_USAGE (re-raised when debugging)."""
    from engine.settings import SettingsError

    try:
        return body()
    except (UsageError, SettingsError, OSError, *errors) as e:
        if debugging(debug):
            raise
        return error(prog, one_line(e))


# ---- ranged numbers: argparse `type=` factories ---------------------------------------------------

def _num(v: float) -> str:
    """A bound as the help and the refusal print it: 604800, 0.5, 4294967295."""
    return str(int(v)) if float(v).is_integer() and abs(v) < 1e16 else f"{v:g}"


class Ranged:
    """An argparse `type`: a finite number within [lo, hi] (either end open when asked), else a
    one-line refusal naming the allowed range and its unit. `allowed` is that range as text
    (HelpFormatter adds it to the option's help). Made by finite_float() and whole_number()."""

    def __init__(self, whole: bool, lo: float, hi: float, unit: str = "", lo_open: bool = False,
                 hi_open: bool = False):
        import math

        if not (math.isfinite(lo) and math.isfinite(hi) and lo <= hi):
            raise ValueError(f"a range needs finite bounds lo <= hi, got {lo}, {hi}")
        self.whole, self.lo, self.hi, self.unit = whole, lo, hi, unit
        self.lo_open, self.hi_open = lo_open, hi_open
        self.__name__ = "int" if whole else "float"   # what it yields (argparse names a type by it)
        if whole:
            span = f"{_num(lo)}..{_num(hi)}"
        else:
            span = f"{'(' if lo_open else '['}{_num(lo)}, {_num(hi)}{')' if hi_open else ']'}"
        self.allowed = f"{span} {unit}".strip()

    def __repr__(self) -> str:
        return f"Ranged({self.__name__} in {self.allowed})"

    def _what(self) -> str:
        return "whole number" if self.whole else "number"

    def __call__(self, text: str) -> float | int:
        import math

        what = f"must be a {self._what()} in {self.allowed}, got {text!r}"
        try:
            v = int(text, 10) if self.whole else float(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(what) from None
        if not self.whole and not math.isfinite(v):
            raise argparse.ArgumentTypeError(what)
        low_ok = self.lo < v if self.lo_open else self.lo <= v
        high_ok = v < self.hi if self.hi_open else v <= self.hi
        if not (low_ok and high_ok):
            raise argparse.ArgumentTypeError(what)
        return v


def finite_float(lo: float, hi: float, unit: str = "", *, lo_open: bool = False, hi_open: bool = False) -> Ranged:
    """An argparse `type`: a finite float in [lo, hi] (`lo_open`/`hi_open`: that end excluded), in
    `unit` (s, bp, a fraction: ""); nan, inf, out of range and garbage end in argparse's one line."""
    return Ranged(False, lo, hi, unit, lo_open, hi_open)


def whole_number(lo: int, hi: int, unit: str = "") -> Ranged:
    """An argparse `type`: a whole number (decimal) in lo..hi, in `unit`; anything else (1.5, 1e3,
    nan, garbage) ends in argparse's one line naming the range."""
    return Ranged(True, lo, hi, unit)


SEED = whole_number(0, 2**32 - 1)           # a random seed: numpy's range
MAX_DEADLINE_S = 30 * 86400.0               # the longest deadline or time limit a command takes (30 days)


def device_name(text: str) -> str:
    """An argparse `type`: cpu, cuda or cuda:N (a torch device of the kinds the engine runs on)."""
    if text in ("cpu", "cuda") or (text.startswith("cuda:") and text[5:].isdigit() and len(text) < 10):
        return text
    raise argparse.ArgumentTypeError(f"must be cpu, cuda or cuda:N, got {text!r}")
