"""The contest ABI: MANIFEST IMAGE_ROOT OUTPUT -> one little-endian int32 per manifest row.

    scripts/run [MANIFEST [IMAGE_ROOT [OUTPUT]]] [--report FILE]   (python -m evaluator.contest.run)

Defaults come from CONTEST_MANIFEST / CONTEST_IMAGE_ROOT / CONTEST_OUTPUT, the artifact
from ENGINE_ARTIFACT (default artifacts/default), the timing report path from
CONTEST_REPORT (evaluator.settings, engine.settings). Nothing is printed on stdout; problems go to stderr.

Order: every check that can fail a run happens before the first image is read (IMAGE_ROOT,
OUTPUT refused if it is an input or a special file, its folder writable and a temp file
opened there, a stale OUTPUT removed, the manifest, 4 bytes per row reserved in the temp
file, TMPDIR, the address-space limit, the artifact with its self-checks). The output is
written to that temp file and renamed into place at the end, so a crash never leaves a file
that looks complete (evaluator.contest.output). Image paths are relative, without `..`, and
followed where they lead (symlinks included) unless --confine. Diagnostics are best effort:
a stderr that cannot be written changes nothing.
"""
from __future__ import annotations

import time

_T_IMPORT = time.perf_counter()

import argparse  # noqa: E402 - the clock above times every import below
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from evaluator.contest.output import Output, OutputError, stale  # noqa: E402

PROG = "run"
RUN_DIR_PREFIX = "eva-engine-run-"          # TMPDIR/eva-engine-run-<pid>: this run's scratch folder
BASE_ADDRESS_SPACE = 4 << 30   # virtual memory a CPU run maps besides its artifact (measured 3.4-3.8 GiB, 2 threads)
MANIFEST_MAX_BYTES = 1 << 30


class RunError(Exception):
    """A user mistake or an unusable environment: one `run: error:` line, exit 2."""


def _process_start() -> float:
    """Wall-clock second the process (or scripts/run, via ENGINE_T0) started."""
    from engine import settings

    try:
        t0 = settings.t0()
    except ValueError:
        t0 = None
    if t0 is not None:
        return t0
    try:  # Linux: process start time from /proc, in clock ticks since boot
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time() - (time.perf_counter() - _T_IMPORT)


def private_tmpdir() -> Path | None:
    """TMPDIR/eva-engine-run-<pid>, made the process's TMPDIR (whatever a library writes there
    stays in it) and removed on every exit path by the caller; folders of killed runs are removed first.
    None, said on stderr, when TMPDIR is not writable (an artifact that needs it then fails to load)."""
    import tempfile

    from engine import settings

    base = settings.tmpdir()
    try:
        for p in base.iterdir():
            if stale(p.name, RUN_DIR_PREFIX):
                shutil.rmtree(p, ignore_errors=True)
    except OSError:
        pass
    d = base / f"{RUN_DIR_PREFIX}{os.getpid()}"
    try:
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(mode=0o700)
    except OSError as e:
        print(f"{PROG}: warning: TMPDIR {base} is not writable ({e.strerror or e}); continuing without a "
              "scratch folder", file=sys.stderr)
        return None
    os.environ.update(TMPDIR=str(d))   # C++ loaders and Python's tempfile read it when they need it
    tempfile.tempdir = None
    return d


def _tree_bytes(root: Path) -> int:
    total = 0
    for dirpath, _, names in os.walk(root):
        for n in names:
            try:
                total += os.stat(os.path.join(dirpath, n)).st_size
            except OSError:
                pass
    return total


def check_address_space(artifact: Path) -> None:
    """RunError when RLIMIT_AS is below what the run maps (the artifact plus the runtime's base)."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return
    need = _tree_bytes(artifact) + BASE_ADDRESS_SPACE
    if soft < need:
        raise RunError(f"the address-space limit ({soft >> 20} MiB, ulimit -v) is below the about {need >> 20} MiB "
                       f"this run maps (artifact {_tree_bytes(artifact) >> 20} MiB + runtime "
                       f"{BASE_ADDRESS_SPACE >> 20} MiB)")


def _is_oom(e: BaseException) -> bool:
    text = str(e).lower()
    return isinstance(e, MemoryError) or (isinstance(e, RuntimeError) and (
        "out of memory" in text or "can't allocate memory" in text or "cannot allocate memory" in text))


def _decoder_name(a: argparse.Namespace, meta: dict) -> str:
    from engine.decoders import default_decoder

    return a.decoder or meta.get("decoder") or default_decoder(meta.get("device", "cpu"))


def early_decoder(a: argparse.Namespace, budget, isolate: bool):
    """The decoder started from the artifact's manifest before torch is imported, when it runs in a
    child process (engine.decoders.runs_isolated); None otherwise or if the manifest is unusable
    (load_artifact then says why). The caller keeps it only if the checked artifact agrees."""
    from engine.decoders import make_decoder, runs_isolated
    from engine.spec import Spec

    try:
        with open(a.artifact / "manifest.json", "rb") as f:
            meta = json.loads(f.read(64 << 20))
        name = _decoder_name(a, meta)
        if not runs_isolated(name, isolate):
            return None
        spec = Spec.from_dict(meta["spec"])
        return make_decoder(name, spec, spec.batch_size, budget.decoder, isolate)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from engine import settings
    from engine.cli import ArgumentParser, HelpFormatter, env_epilog
    from engine.decoders import DECODERS
    from evaluator import settings as ev

    p = ArgumentParser(prog="scripts/run", description=__doc__.split("\n\n")[0],
                       epilog=env_epilog(ev.env_help(ev.RUN_ENV)) + "\n(a 0/1 switch also takes true/false, yes/no, on/off)",
                       formatter_class=HelpFormatter)
    p.add_argument("manifest", nargs="?", type=Path, default=ev.contest_manifest(), help="env CONTEST_MANIFEST")
    p.add_argument("image_root", nargs="?", type=Path, default=ev.contest_image_root(),
                   help="env CONTEST_IMAGE_ROOT")
    p.add_argument("output", nargs="?", type=Path, default=ev.contest_output(), help="env CONTEST_OUTPUT")
    p.add_argument("--report", type=Path, default=ev.contest_report(),
                   help="write the timing report JSON here (env CONTEST_REPORT)")
    p.add_argument("--artifact", type=Path, default=settings.artifact(), help="env ENGINE_ARTIFACT")
    p.add_argument("--confine", action=argparse.BooleanOptionalAction, default=ev.contest_confine(),
                   help="untrusted inputs: every image's real path must stay inside IMAGE_ROOT's, and a final "
                        "symlink is not followed (env CONTEST_CONFINE; default: paths are followed where they "
                        "lead, as the reference opens them)")
    p.add_argument("--decoder", default=settings.decoder(), choices=tuple(DECODERS),
                   help="env ENGINE_DECODER; default: the artifact's")
    p.add_argument("--readers", type=int, default=settings.readers(),
                   help="file reader threads (env ENGINE_READERS; default from ENGINE_THREADS)")
    p.add_argument("--depth", type=int, default=settings.pipeline_depth(),
                   help="decoded batches in flight ahead of inference; 0 = decode and infer in turn "
                        "(env ENGINE_PIPELINE_DEPTH)")
    a = p.parse_args(argv)
    if (a.readers is not None and a.readers < 1) or a.depth < 0:
        p.error("--readers must be >= 1 and --depth >= 0")
    return a


def _say_blank(path: Path, blank: list[int], most: int = 10) -> None:
    """One stderr line per skipped blank manifest line (the first `most`, then a count)."""
    for no in blank[:most]:
        print(f"{PROG}: {path}:{no}: blank line skipped (not a row)", file=sys.stderr)
    if len(blank) > most:
        print(f"{PROG}: {path}: {len(blank) - most} more blank lines skipped", file=sys.stderr)


class Held:
    """What a run must release on every exit path: the reserved OUTPUT and the scratch folder."""

    output: Output | None = None
    scratch: Path | None = None

    def release(self) -> None:
        if self.output is not None:
            self.output.discard()
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)
            os.environ.update(TMPDIR=str(self.scratch.parent))   # the caller's TMPDIR again
            import tempfile

            tempfile.tempdir = None


class Signalled(SystemExit):
    """A signal stopped the run: main() cleans up and returns 128 + signal, so the caller's fast
    exit still applies (interpreter teardown would cost seconds)."""


def _on_signal(sig: int, _frame) -> None:
    raise Signalled(128 + sig)


def main(argv: list[str] | None = None) -> int:
    """scripts/run: 0 with OUTPUT written, 2 with one `run: error:` line and no OUTPUT."""
    from engine.streams import safe_std_streams

    safe_std_streams()
    wall0 = _process_start()
    held = Held()
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
    for s in previous:  # a terminated run still cleans up (the finally below)
        signal.signal(s, _on_signal)
    try:
        return _run(argv, wall0, held)
    except Signalled as e:
        print(f"{PROG}: stopped by {signal.Signals(e.code - 128).name}; no OUTPUT written", file=sys.stderr)
        return e.code
    except RunError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except (MemoryError, RuntimeError) as e:
        if not _is_oom(e):
            raise
        first = (str(e).splitlines() or [""])[0][:200]
        print(f"{PROG}: error: out of memory ({type(e).__name__}: {first}); raise the memory limit or use a "
              "smaller batch size", file=sys.stderr)
        return 2
    finally:
        held.release()
        for s, h in previous.items():
            signal.signal(s, h)


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
    os.environ.update(threads.library_env(budget))   # before numpy / torch load and size their pools
    if not os.path.isdir(a.image_root):
        raise RunError(f"IMAGE_ROOT is not a directory (or not reachable): {a.image_root}")
    from engine.pipeline import read_regular, resolve_relative
    from evaluator.contest.manifest import ManifestError, parse_manifest

    try:
        out = held.output = Output(a.output, a.manifest, a.image_root, a.artifact)
        manifest = parse_manifest(a.manifest)
        out.reserve(4 * len(manifest.rows))          # a full disk fails here, not after inference
    except (OutputError, ManifestError) as e:
        raise RunError(str(e)) from None
    rows = manifest.rows
    _say_blank(a.manifest, manifest.blank)
    check_address_space(a.artifact)                  # before anything large is mapped
    held.scratch = private_tmpdir()

    early = early_decoder(a, budget, isolate)   # a child decoder process starts while torch imports

    try:
        import torch  # noqa: F401 - heavy import timed as part of "imports"
    except (ImportError, OSError) as e:
        raise RunError(f"cannot import torch ({e}): is the memory limit too low?") from None
    from engine.artifact import ArtifactError, load_artifact
    from engine.decoders import start_decoder
    from engine.pipeline import classify, peak_rss_mib
    from engine.runtime import load_runtime

    t_imports = time.perf_counter()
    try:
        art = load_artifact(a.artifact)
    except (ArtifactError, OSError) as e:
        raise RunError(f"cannot load artifact {a.artifact}: {e}") from None
    budget = threads.budget(art.device)
    threads.apply_torch(budget)
    readers = a.readers or budget.readers
    decoder_name = _decoder_name(a, art.meta)
    if early is not None and (early.name, early.spec, early.batch_size) == (decoder_name, art.spec, art.batch_size):
        decoder, pending = early, None
    else:
        if early is not None:
            early.close()
        # built on a thread while the model loads (a DALI GPU pipeline takes about a second)
        pending = start_decoder(decoder_name, art.spec, art.batch_size, budget.decoder, isolate)
    try:
        runtime = load_runtime(art, capture=False)   # CUDA graphs: captured once the decoder is built
    except (ArtifactError, RuntimeError, OSError) as e:
        if _is_oom(e):
            raise
        hint = "" if held.scratch is not None else f" (TMPDIR {settings.tmpdir()} is not writable)"
        raise RunError(f"cannot load artifact {a.artifact}: {e}{hint}") from None
    if pending is not None:
        decoder = pending.result()
    runtime.capture_graphs()   # no other thread touches the device now (a DALI GPU build allocates)
    t_loaded = time.perf_counter()

    root, real_root, confine = a.image_root, os.path.realpath(a.image_root), a.confine

    def read(i: int) -> bytes:   # trusted: symlinks followed; confined: real path inside the root, no final link
        path = resolve_relative(root, rows[i].path, "IMAGE_ROOT", confine, real_root)
        return read_regular(path, cap, follow=not confine)

    res = classify(read, len(rows), decoder, runtime, readers=readers, depth=a.depth)
    t_done = time.perf_counter()
    for i in sorted(res.failed):
        r = rows[i]
        where = f"row {i + 1}" + (f", line {r.line}" if r.line != i + 1 else "")   # they differ after a blank line
        print(f"{PROG}: {where} ({r.request_id}, {r.path}): unreadable, predicted {res.top1[i]}: "
              f"{res.failed[i]}", file=sys.stderr)
    if 2 * len(res.failed) > len(rows):   # a wrong IMAGE_ROOT must not look like success
        print(f"{PROG}: warning: {len(res.failed)} of {len(rows)} rows could not be read or decoded: is "
              f"IMAGE_ROOT ({a.image_root}) the folder the manifest's paths are relative to?", file=sys.stderr)
    import numpy as np

    try:
        out.commit(np.ascontiguousarray(res.top1, dtype="<i4").tobytes())
    except OSError as e:
        raise RunError(f"cannot write OUTPUT {a.output}: {e.strerror or e}") from None
    t_end = time.perf_counter()
    if hasattr(decoder, "close"):
        decoder.close()   # the child decoder process, if any

    if a.report:
        # perf_counter -> seconds since process start
        offset = (time.time() - time.perf_counter()) - wall0
        report = {
            "images": len(rows),
            "rows": len(rows),                       # one int32 each in OUTPUT
            "blank_lines_skipped": len(manifest.blank),
            "failed": len(res.failed),
            "backend": art.backend,
            "decoder": decoder.name,
            "decoder_isolated": bool(getattr(decoder, "isolated", False)),
            "precision": art.precision,
            "batch_size": art.batch_size,
            "device": str(runtime.device),
            "pipeline_depth": a.depth,
            "threads": {"budget": budget.total, "readers": readers, "decoder": budget.decoder,
                        "intra_op": budget.intra_op, "inter_op": budget.inter_op},
            "stages": {
                "imports": round(t_imports + offset, 4),
                "artifact_load": round(t_loaded - t_imports, 4),
                "read": round(res.stages.get("read", 0.0), 4),
                "decode": round(res.stages.get("decode", 0.0), 4),
                "inference": round(res.stages.get("inference", 0.0), 4),
                "pipeline": round(t_done - t_loaded, 4),
                "write": round(t_end - t_done, 4),
                "total": round(t_end + offset, 4),
            },
            "first_batch_s": round(res.first_batch_at + offset, 4) if res.first_batch_at else None,
            "images_per_s": round(len(rows) / max(t_done - t_loaded, 1e-9), 2),
            "peak_rss_mib": peak_rss_mib(),          # this process; its ended children apart (the decoder's)
            "timeline": [{**e, "start": round(e["start"] + offset, 4), "end": round(e["end"] + offset, 4)}
                         for e in res.timeline],
        }
        if hasattr(runtime, "report"):
            report["runtime"] = runtime.report()
        try:
            a.report.write_text(json.dumps(report, indent=1) + "\n")
        except OSError as e:  # the predictions are written: a report that cannot be is only said
            print(f"{PROG}: warning: cannot write the report {a.report}: {e.strerror or e}", file=sys.stderr)
    return 0


def _exit_now(code: int) -> None:
    """Flush and leave without interpreter teardown (torch/DALI finalizers cost seconds on the clock)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(code)


if __name__ == "__main__":
    from engine import settings as _settings

    try:
        _fast = _settings.fast_exit()
    except ValueError:
        _fast = True
    if _fast:
        _exit_now(main())
    sys.exit(main())
