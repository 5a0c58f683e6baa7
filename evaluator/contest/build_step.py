"""The submission's build step, behind ./build.sh: the read-only checkpoint -> an artifact for
the machine this runs on (python -m engine.build) -> one generated image through scripts/run.

    ./build.sh [--help]      (python -m evaluator.contest.build_step; every knob an environment variable)

Every knob is checked before anything runs, a refusal one `build.sh: error: KNOB ...` line: the
engine.build knobs by engine.build's own parser, its flag named as the knob. A checkpoint that
records its spec in its safetensors metadata (the kit's tiny ones do) gives every spec knob left
unset; otherwise the model is evaluator.contest.task's. Precision, batch size and backend default
to the device's preset (engine/presets/classification.py); the device is cuda when torch sees a GPU, and a GPU
nvidia-smi lists but torch cannot use is refused (a CPU artifact on the GPU machine would pass
every check and then be scored at CPU speed). The contest's disagreement budget (its gate's 100
of 10,000 images over a margin of 2: `--guard-budget=50` basis points, the decoder's flips and
precision's together; evaluator/contest/task.py) and its check that no ImageNet-validation-like
folder calibrates the guard go to engine.build as flags. An artifact
whose files are intact and whose manifest records the same checkpoint sha256, spec, backend and
device is reused (FORCE=1 rebuilds); then one generated image runs through scripts/run. The
whole step keeps one deadline (ENGINE_BUILD_DEADLINE_S, else the preset's `build_deadline_s`):
engine.build gets what is left of it after SELFCHECK_RESERVE_S kept for that check.
"""
from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from engine import children

PROG = "build.sh"
EXIT_FAILED, EXIT_USAGE = 1, 2
# build knob -> the engine.build flag it becomes (the spec and search knobs, then the paths and the device)
FLAG = {"ENGINE_MODEL": "--model", "ENGINE_PRECISION": "--precision", "ENGINE_BATCH_SIZE": "--batch-size",
        "ENGINE_BACKEND": "--backend", "ENGINE_INPUT_SIZE": "--input-size", "ENGINE_CROP_MODE": "--crop-mode",
        "ENGINE_CROP_PCT": "--crop-pct", "ENGINE_MODEL_KWARGS": "--model-kwargs",
        "ENGINE_CHECKPOINT": "--checkpoint", "ENGINE_ARTIFACT": "--out", "ENGINE_DEVICE": "--device"}
KNOB = {flag: knob for knob, flag in FLAG.items()}
CALIBRATION_CHECK = "evaluator.contest.eval_data_signs:calibration_refusals"
# seconds the deadline keeps after engine.build for the one-image check through scripts/run (a process
# start, the artifact's load, one image) and engine.build's own process start
SELFCHECK_RESERVE_S = 90.0
ANOTHER_MODEL = "a checkpoint of another model needs ENGINE_MODEL, ENGINE_INPUT_SIZE and ENGINE_MODEL_KWARGS"
DESCRIPTION = """\
The submission's build step: builds the artifact from the read-only checkpoint with
python -m engine.build for the machine it runs on, then runs one generated image through
scripts/run and checks the output. An intact, current artifact is reused."""


class Stop(Exception):
    """The step ends here: one `build.sh: error:` line and an exit status."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def log(msg: str) -> None:
    print(f"{PROG}: {msg}", file=sys.stderr, flush=True)


def usage() -> str:
    from engine.cli import env_epilog
    from engine.presets import PRESETS
    from evaluator import settings
    from evaluator.contest.task import DEFAULT_MODEL

    env = {k: v.removeprefix("./build.sh").lstrip(": ") for k, v in settings.env_help(settings.BUILD_ENV).items()}
    presets = "".join(f"\n  {d}: precision {p.precision}, batch {p.batch_size} (of {', '.join(map(str, p.batch_sizes))}), "
                      f"backend {p.backend}" for d, p in PRESETS.items())
    return (f"usage: ./build.sh            (no arguments: every knob is an environment variable)\n\n{DESCRIPTION}\n\n"
            f"{env_epilog(env)}\n\nthe model (evaluator/contest/task.py): {DEFAULT_MODEL}\n"
            f"the device presets (engine/presets/classification.py):{presets}\n\n"
            "exit status: 0 ready, 1 the build or the check failed, 2 a bad knob or a missing input")


def knobs_with_recorded_spec(knobs: dict[str, str | None], checkpoint: Path) -> dict[str, str | None]:
    """`knobs` with the spec the checkpoint records where the user set none (only when ENGINE_MODEL is unset)."""
    from engine.cli import one_line
    from evaluator.contest.selfcheck import recorded_spec

    if knobs["ENGINE_MODEL"] is not None:
        return knobs
    try:
        recorded = recorded_spec(checkpoint)
    except OSError as e:
        raise Stop(EXIT_USAGE, f"cannot read the checkpoint's metadata: {checkpoint} ({one_line(e)})") from None
    if recorded:
        log("the checkpoint records its spec: " + " ".join(f"{k}={shlex.quote(v)}" for k, v in recorded.items())
            + " (set ENGINE_MODEL to override)")
    return {k: v if v is not None else recorded.get(k) for k, v in knobs.items()}


def engine_flags(knobs: dict[str, str | None], checkpoint: Path, artifact: Path, device: str) -> list[str]:
    """The python -m engine.build flags: one per knob that has a value, then the contest's own."""
    from evaluator.contest.task import COHORT_IMAGES, guard_budget

    given = {**knobs, "ENGINE_CHECKPOINT": str(checkpoint), "ENGINE_ARTIFACT": str(artifact), "ENGINE_DEVICE": device}
    return ([f"{FLAG[k]}={v}" for k, v in given.items() if v is not None]
            + [f"--guard-budget={guard_budget():g}", f"--run-images={COHORT_IMAGES}",
               f"--calibration-check={CALIBRATION_CHECK}"])


def check_knobs(flags: list[str]) -> None:
    """engine.build's parser on `flags`: a value it refuses is one line naming the knob."""
    import argparse

    from engine.tuning import parse_args

    try:
        parse_args(flags, exit_on_error=False)
    except argparse.ArgumentError as e:
        knob = KNOB.get(e.argument_name or "", e.argument_name)
        raise Stop(EXIT_USAGE, f"{knob}: {e.message}") from None
    except SystemExit:   # a refusal argparse printed itself (a combination of flags): already one line
        raise Stop(EXIT_USAGE, f"python -m engine.build refused the knobs (see above; {ANOTHER_MODEL})") from None


def build_device(knob: str) -> str:
    """cuda or cpu: `knob` unless auto; auto is cuda when torch sees a GPU."""
    if knob != "auto":
        return knob
    try:
        import torch

        if torch.cuda.is_available():
            return "cuda"
    except Exception:  # noqa: BLE001 - torch that does not import sees no GPU; engine.build says why it fails
        pass
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        listed = ""
    if any(line.startswith("GPU") for line in listed.splitlines()):
        raise Stop(EXIT_USAGE, "nvidia-smi lists a GPU but torch.cuda cannot use it (driver/container mismatch?); "
                               "set ENGINE_DEVICE=cpu to build for the CPU anyway")
    return "cpu"


def stack() -> str:
    """The stack the artifact is built with, as its manifest records it (a run on another torch refuses it)."""
    try:
        from engine.classify.artifact import versions

        v = versions()
    except Exception:  # noqa: BLE001 - said on the line; the build then fails with the reason
        return "unknown (torch does not import)"
    have = {k: x or "absent" for k, x in v.items()}
    return (f"torch {have['torch']} (CUDA {v['torch_cuda']}) torchvision {have['torchvision']} timm {have['timm']} "
            f"DALI {have['nvidia-dali-cuda130']}")


def reusable(flags: list[str]) -> bool:
    from engine.cli import one_line
    from evaluator.contest.selfcheck import stale_reasons

    try:
        reasons = stale_reasons(flags)
    except (OSError, ValueError, RuntimeError) as e:
        raise Stop(EXIT_USAGE, f"cannot compare the artifact with the knobs: {one_line(e)}") from None
    for r in reasons:
        log(f"stale: {r}")
    return not reasons


def engine_deadline(deadline_s: float, spent_s: float) -> float:
    """engine.build's --deadline-s: the step's deadline less what is spent and the check's reserve."""
    left = deadline_s - spent_s - SELFCHECK_RESERVE_S
    if left <= 0:
        raise Stop(EXIT_USAGE, f"ENGINE_BUILD_DEADLINE_S: {deadline_s:g} s leaves no time for the build ({spent_s:.0f} s "
                               f"spent preparing, {SELFCHECK_RESERVE_S:.0f} s kept for the one-image check)")
    return left


def build(flags: list[str], artifact: Path) -> None:
    """python -m engine.build in its own process (a crash there is a failed build, and its memory
    is freed before the check), its output on stderr."""
    log(f"building {artifact} (untimed preparation)")
    t0 = time.monotonic()
    sys.stderr.flush()
    # its own process group, killed with everything it started when this step ends or is killed
    rc = children.run([sys.executable, "-m", "engine.build", *flags], stdout=sys.stderr.fileno()).returncode
    if rc == EXIT_USAGE:
        raise Stop(EXIT_USAGE, f"python -m engine.build refused the knobs (see above; {ANOTHER_MODEL}: ./build.sh --help)")
    if rc != 0:
        raise Stop(EXIT_FAILED, f"python -m engine.build failed with exit {rc if rc > 0 else 128 - rc} (see above)")
    log(f"built in {round(time.monotonic() - t0)} s")


def run_check(artifact: Path) -> None:
    """One generated image through scripts/run (evaluator.contest.selfcheck), its JSON line on stderr."""
    from engine.cli import guard
    from evaluator.contest import selfcheck

    with contextlib.redirect_stdout(sys.stderr):
        rc = guard(selfcheck.PROG, lambda: selfcheck.run_check(artifact))
    if rc != 0:
        raise Stop(EXIT_FAILED, f"the artifact at {artifact} does not run through scripts/run (see above)")


def build_step(clock=time.monotonic) -> int:
    from engine import settings as engine_settings
    from engine.io import folder_refusal
    from engine.presets import preset
    from engine.tuning.command import is_artifact_folder
    from evaluator import settings
    from evaluator.contest.task import DEFAULT_MODEL

    t0 = clock()
    deadline_s = settings.build_deadline_s()
    checkpoint = settings.build_checkpoint()
    if not checkpoint.exists():
        raise Stop(EXIT_USAGE, f"checkpoint not found: {checkpoint} (mount it there or set ENGINE_CHECKPOINT)")
    if not checkpoint.is_file() or not os.access(checkpoint, os.R_OK):
        raise Stop(EXIT_USAGE, f"checkpoint is not a readable file: {checkpoint}")
    force, device, artifact = settings.build_force(), settings.build_device(), engine_settings.artifact()
    why = folder_refusal(artifact, "the artifact folder", is_artifact_folder, (checkpoint,))
    if why:
        raise Stop(EXIT_USAGE, f"ENGINE_ARTIFACT: {why}")
    knobs = knobs_with_recorded_spec({k: settings.build_knob(k) for k in settings.BUILD_FLAG_KNOBS}, checkpoint)
    knobs["ENGINE_MODEL"] = knobs["ENGINE_MODEL"] or DEFAULT_MODEL
    check_knobs(engine_flags(knobs, checkpoint, artifact, "cpu" if device == "auto" else device))

    device = build_device(device)
    pre = preset(device)
    for knob, default in (("ENGINE_PRECISION", pre.precision), ("ENGINE_BATCH_SIZE", pre.batch_size),
                          ("ENGINE_BACKEND", pre.backend)):
        knobs[knob] = knobs[knob] or str(default)
    flags = engine_flags(knobs, checkpoint, artifact, device)
    log(f"model {knobs['ENGINE_MODEL']}, checkpoint {checkpoint}, backend {knobs['ENGINE_BACKEND']} on {device}, "
        f"precision {knobs['ENGINE_PRECISION']}, batch {knobs['ENGINE_BATCH_SIZE']} -> {artifact}")
    log(f"stack: {stack()}")
    deadline_s = deadline_s if deadline_s is not None else pre.build_deadline_s
    if not force and reusable(flags):
        log(f"reusing artifact {artifact} (files intact; checkpoint sha256, spec, backend and device match; "
            "FORCE=1 rebuilds)")
    else:
        spent = clock() - t0
        budget = engine_deadline(deadline_s, spent)
        log(f"deadline {deadline_s:.0f} s: {spent:.0f} s spent preparing, engine.build {budget:.0f} s, "
            f"{SELFCHECK_RESERVE_S:.0f} s kept for the one-image check (ENGINE_BUILD_DEADLINE_S)")
        build([*flags, f"--deadline-s={budget:.1f}"], artifact)
    t = clock()
    run_check(artifact)
    log(f"spent {clock() - t0:.0f} s of the {deadline_s:.0f} s deadline (the one-image check {clock() - t:.0f} s)")
    log(f"OK: {artifact} is ready for scripts/run (ENGINE_ARTIFACT={artifact})")
    return 0


def main(argv: list[str] | None = None) -> int:
    from engine.settings import SettingsError

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        print(usage())
        return 0
    try:
        if argv:
            raise Stop(EXIT_USAGE, f"unknown argument '{argv[0]}' (build.sh takes none: its knobs are environment "
                                   "variables; see ./build.sh --help)")
        with children.signals_exit():
            return build_step()
    except (children.Terminated, KeyboardInterrupt) as e:   # engine.build and its children are gone already
        sig = e.signal if isinstance(e, children.Terminated) else signal.SIGINT
        print(f"{PROG}: stopped by signal {sig} ({signal.Signals(sig).name}); the build it ran was stopped too",
              file=sys.stderr, flush=True)
        return 128 + sig
    except Stop as e:
        print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        return e.status
    except SettingsError as e:   # a knob read through evaluator.settings: the message names it
        print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
