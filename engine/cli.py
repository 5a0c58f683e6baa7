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
            return action.help or ""
        return super()._get_help_string(action)


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
