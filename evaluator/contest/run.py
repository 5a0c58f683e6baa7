"""The contest ABI: MANIFEST IMAGE_ROOT OUTPUT -> one little-endian int32 per manifest row.

    scripts/run [MANIFEST [IMAGE_ROOT [OUTPUT]]] [--report FILE]   (python -m evaluator.contest.run)

Defaults come from CONTEST_MANIFEST / CONTEST_IMAGE_ROOT / CONTEST_OUTPUT, the artifact
from ENGINE_ARTIFACT (default artifacts/default), the timing report path from
CONTEST_REPORT (evaluator.settings, engine.settings). Nothing is printed on stdout; problems go to stderr.

Order: every check that can fail a run happens before the first image is read (IMAGE_ROOT,
OUTPUT refused if it is an input or a special file, its folder writable and a temp file
opened there, a stale OUTPUT removed, the manifest, 4 bytes per row reserved in the temp
file, TMPDIR, the address-space limit, the artifact with its self-checks; the full SHA-256
of its files, which overlaps the model's load, is waited for before the first image). The output is
written to that temp file and renamed into place at the end, so a crash never leaves a file
that looks complete (evaluator.contest.output). Image paths are relative, without `..`, and
followed where they lead (symlinks included) unless --confine. Diagnostics are best effort:
a stderr that cannot be written changes nothing.
"""
from __future__ import annotations

import argparse
import errno
import json
import os
import signal
import sys
import time
from pathlib import Path

import engine
from engine.classify.classifier import LoadError
from engine.io import FilesUnder
from engine.memory import exhaustion_line, import_failure, sigint_origin
from engine.process_stats import process_start, start_offset
from evaluator.contest.exits import Held, Signalled, exit_now, private_tmpdir, signals_exit
from evaluator.contest.output import Output, OutputError

PROG = "run"


class RunError(Exception):
    """A user mistake or an unusable environment: one `run: error:` line, exit 2."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from engine import settings
    from engine.cli import ArgumentParser, HelpFormatter, env_epilog, whole_number
    from engine.decoders import DECODERS
    from evaluator import settings as ev

    p = ArgumentParser(prog="scripts/run", description=__doc__.split("\n\n")[0],
                       epilog=env_epilog(ev.env_help(ev.RUN_ENV)) + "\n(a 0/1 switch also takes true/false, yes/no, on/off)",
                       formatter_class=HelpFormatter)
    p.add_argument("manifest", nargs="?", type=Path, default=ev.contest_manifest(),
                   help="request_id<TAB>relative/path per row (env CONTEST_MANIFEST)")
    p.add_argument("image_root", nargs="?", type=Path, default=ev.contest_image_root(),
                   help="folder the manifest's paths are relative to (env CONTEST_IMAGE_ROOT)")
    p.add_argument("output", nargs="?", type=Path, default=ev.contest_output(),
                   help="one little-endian int32 per manifest row, written atomically (env CONTEST_OUTPUT)")
    p.add_argument("--report", type=Path, default=ev.contest_report(),
                   help="write the timing report JSON here (env CONTEST_REPORT; default: not written)")
    p.add_argument("--artifact", type=Path, default=settings.artifact(),
                   help="the artifact ./build.sh wrote (env ENGINE_ARTIFACT)")
    p.add_argument("--confine", action=argparse.BooleanOptionalAction, default=ev.contest_confine(),
                   help="untrusted inputs: every image's real path must stay inside IMAGE_ROOT's, and a final "
                        "symlink is not followed (env CONTEST_CONFINE; default: paths are followed where they "
                        "lead, as the reference opens them)")
    p.add_argument("--decoder", default=settings.decoder(), choices=tuple(DECODERS),
                   help="env ENGINE_DECODER; default: the artifact's")
    p.add_argument("--readers", type=whole_number(1, settings.MAX_THREADS_SETTING, "threads"), default=settings.readers(),
                   help="file reader threads (env ENGINE_READERS; default from ENGINE_THREADS)")
    p.add_argument("--depth", type=whole_number(0, 64, "batches"), default=settings.pipeline_depth(),
                   help="decoded batches in flight ahead of inference; 0 = decode and infer in turn "
                        "(env ENGINE_PIPELINE_DEPTH)")
    a = p.parse_args(argv)
    if (a.readers is not None and a.readers < 1) or a.depth < 0:
        p.error("--readers must be >= 1 and --depth >= 0")
    return a


def main(argv: list[str] | None = None) -> int:
    """scripts/run: 0 with OUTPUT written, 2 with one `run: error:` line and no OUTPUT."""
    from engine.stdio import safe_std_streams

    safe_std_streams()
    wall0 = process_start()
    held = Held()
    with signals_exit():   # a terminated run still cleans up (the finally below)
        try:
            return _run(argv, wall0, held)
        except Signalled as e:
            print(f"{PROG}: stopped by {signal_named(e.code - 128)}; no OUTPUT written", file=sys.stderr)
            return e.code
        except RunError as e:
            print(f"{PROG}: error: {e}", file=sys.stderr)
            return 2
        except ModuleNotFoundError as e:   # an interpreter without the engine's dependencies
            print(f"{PROG}: error: {import_failure((e.name or '?').split('.')[0], e)}", file=sys.stderr)
            return 2
        except (MemoryError, RuntimeError) as e:   # out of memory, or a thread that cannot start
            line = exhaustion_line(e)
            if line is None:
                raise
            print(f"{PROG}: error: {line}", file=sys.stderr)
            return 2
        finally:
            held.release()


def signal_named(sig: int) -> str:
    """The signal's name; for SIGINT under an address-space limit, also that a library failing to
    start a thread raises it at itself (engine.memory.sigint_origin): no key is blamed alone."""
    origin = sigint_origin() if sig == signal.SIGINT else None
    return signal.Signals(sig).name + (f" ({origin})" if origin else "")


def _run(argv, wall0: float, held: Held) -> int:
    try:
        a = parse_args(argv)
    except ValueError as e:  # engine.settings.SettingsError: a bad environment value
        raise RunError(str(e)) from None
    from engine import settings, threads

    try:  # every switch is read (and refused when bad) before anything else happens
        settings.check()
        budget = threads.budget("cpu")
        cap = settings.max_file_bytes()
        isolate = settings.decoder_isolate()
        settings.artifact_verify()
    except ValueError as e:
        raise RunError(str(e)) from None
    threads.apply_library_env(budget)   # before numpy / torch load and size their pools
    if not os.path.isdir(a.image_root):
        raise RunError(f"IMAGE_ROOT is not a directory (or not reachable): {a.image_root}")
    from evaluator.contest.manifest import ManifestError, parse_manifest

    try:
        out = held.output = Output(a.output, a.manifest, a.image_root, a.artifact)
        manifest = parse_manifest(a.manifest)
        out.reserve(4 * len(manifest.rows))          # a full disk fails here, not after inference
    except (OutputError, ManifestError) as e:
        raise RunError(str(e)) from None
    rows = manifest.rows
    for line in manifest.blank_notes():
        print(f"{PROG}: {line}", file=sys.stderr)
    held.hold_scratch(private_tmpdir(PROG))

    try:   # the address-space limit is checked, an isolated decoder starts, torch imports, the artifact loads
        clf = engine.load(a.artifact, decoder=a.decoder, readers=a.readers, depth=a.depth, isolate=isolate,
                          max_file_bytes=cap)
    except LoadError as e:
        no_scratch = e.stage == "runtime" and held.scratch is None
        raise RunError(f"{e}" + (f" (TMPDIR {settings.tmpdir()} is not writable)" if no_scratch else "")
                       + _disk_full_where(e.__context__, settings.tmpdir())) from None
    # row i's bytes: trusted, symlinks followed; confined (--confine), the real path inside the root, no final link
    read = FilesUnder(a.image_root, [r.path for r in rows], "IMAGE_ROOT", a.confine, cap)
    from engine.classify.artifact import ArtifactError

    try:   # joins the full SHA-256 of the artifact's files first: damaged weights answer nothing
        top1 = clf.classify_read(read, len(rows))
    except ArtifactError as e:
        clf.close()
        raise RunError(f"cannot use artifact {a.artifact}: {e}") from None
    t_done = time.perf_counter()
    for i, why in clf.last_failed.items():
        r = rows[i]
        where = f"row {i + 1}" + (f", line {r.line}" if r.line != i + 1 else "")   # they differ after a blank line
        print(f"{PROG}: {where} ({r.request_id}, {r.path}): unreadable, predicted {top1[i]}: {why}", file=sys.stderr)
    if 2 * len(clf.last_failed) > len(rows):   # a wrong IMAGE_ROOT must not look like success
        print(f"{PROG}: warning: {len(clf.last_failed)} of {len(rows)} rows could not be read or decoded: is "
              f"IMAGE_ROOT ({a.image_root}) the folder the manifest's paths are relative to?", file=sys.stderr)
    try:
        out.commit(top1.astype("<i4").tobytes())
    except OutputError as e:
        raise RunError(str(e)) from None
    except OSError as e:
        raise RunError(f"cannot write OUTPUT {a.output}: {e.strerror or e}") from None
    t_end = time.perf_counter()
    clf.close()   # the child decoder process, if any
    if a.report:
        write_report(a.report, clf.report(wall0), manifest, t_end - t_done, t_end + start_offset(wall0))
    return 0


def _disk_full_where(e: BaseException | None, tmpdir: Path) -> str:
    """Where a load that found no room was writing, when its error names no file: loading writes
    only under TMPDIR (an unpacked package, compiler caches)."""
    full = isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
    return f" (while writing under TMPDIR {tmpdir})" if full and e.filename is None else ""


def write_report(path: Path, report: dict, manifest, write_s: float, total_s: float) -> None:
    """The engine's report of the run, with what only this command knows: the manifest's rows and
    blank lines, the OUTPUT write, the total since the process started."""
    report = {"images": report.pop("images"), "rows": len(manifest.rows),   # one int32 each in OUTPUT
              "blank_lines_skipped": len(manifest.blank), **report}
    report["stages"].update(write=round(write_s, 4), total=round(total_s, 4))
    try:
        path.write_text(json.dumps(report, indent=1) + "\n")
    except OSError as e:  # the predictions are written: a report that cannot be is only said
        print(f"{PROG}: warning: cannot write the report {path}: {e.strerror or e}", file=sys.stderr)


if __name__ == "__main__":
    from engine import settings as _settings

    try:
        _fast = _settings.fast_exit()
    except ValueError:
        _fast = True
    if _fast:
        exit_now(main())
    sys.exit(main())
