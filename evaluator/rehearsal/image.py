"""Rehearse the contest image without Docker: what the Dockerfile assembles, checked on a CPU machine.

    python -m evaluator.rehearsal.image [--venv DIR] [--quick] [--codegen] [--json FILE]
    python -m evaluator.rehearsal.image --arch aarch64 [--cache DIR] [--json FILE]   # as root

`--arch aarch64` rehearses the arm64 image under emulation instead (qemu-user, an arm64 Debian root;
evaluator/rehearsal/emulated.py says its steps); the default, x86_64, is the venv rehearsal below.

Steps, one line each (`ok` or `FAILED` with the reason); exit 0 only when every step passed:
  venv     a fresh Python venv (the base image's Python version, read from FROM);
  locks    the locks the Dockerfile's pip lines name, installed `--no-deps`; a pin the configured
           indexes cannot serve (TensorRT's libraries come from NVIDIA's index) is named and skipped;
  pip-check  `pip check`, less the lines only those skipped pins explain;
  env      the Dockerfile's ENV, parsed (continuations, `${VAR}`), with the image's
           site-packages (/usr/local/lib/pythonX.Y/site-packages) mapped to the venv's;
  imports  the import line the Dockerfile's RUN runs, run in the venv; a `|| echo` fallback
           (a module that needs a GPU to import) is reported as the Dockerfile reports it;
  headers  the AOTInductor CUDA wrapper's headers and cuda_fp16.h / cuda_bf16.h compiled with
           g++ (`-fsyntax-only -DUSE_CUDA`) against that CUDA_HOME; a failure prints the
           compiler's missing-header line;
  codegen  (`--codegen`) Inductor's CUDA code generation for a tiny graph, its Triton kernels
           compiled to sm_90 cubins and the AOTInductor C++ model compiled (not linked) against
           CUDA_HOME, no GPU needed: see evaluator/rehearsal/image_codegen.py.

`--quick` runs only `headers` (and `codegen` when asked), against the Python running this (its
site-packages, where CI installs the lock): the check the test suite runs. Not rehearsed: Docker
itself (the base image, apt's g++, the user, the read-only root), a GPU and its driver, NVIDIA's
index (its pins are skipped), the other platform (arm64 on an x86_64 machine: `--arch aarch64`).
"""
from __future__ import annotations

import argparse
import json
import sys
import sysconfig
import tempfile
from dataclasses import asdict
from pathlib import Path

from evaluator.rehearsal.image_steps import ARCHES, DOCKERFILE, Step, full, quick, quick_env


def main(argv: list[str] | None = None) -> int:
    from engine.cli import HelpFormatter

    p = argparse.ArgumentParser(prog="python -m evaluator.rehearsal.image", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--venv", type=Path, help="the venv to (re)create (default: a temporary folder, removed after)")
    p.add_argument("--reuse", action="store_true", help="keep --venv's packages when it exists (a rerun)")
    p.add_argument("--quick", action="store_true", help="only the header compile, against this Python's packages")
    p.add_argument("--codegen", action="store_true", help="also Inductor's CUDA codegen and an sm_90 cubin")
    p.add_argument("--dockerfile", type=Path, default=DOCKERFILE, help="the Dockerfile whose image is rehearsed")
    p.add_argument("--json", type=Path, help="write a JSON summary here (default: not written)")
    p.add_argument("--arch", choices=ARCHES, default=ARCHES[0],
                   help="the image platform: x86_64 in a venv here, aarch64 in an emulated arm64 root (needs root)")
    p.add_argument("--cache", type=Path, help="with --arch aarch64: the folder its root and wheels are kept in "
                   "(default: eva-engine/arm64-rehearsal in the user's cache, $XDG_CACHE_HOME or ~/.cache)")
    a = p.parse_args(argv)
    if a.arch == "aarch64":
        return aarch64(p, a)
    if a.quick:
        steps = [quick(a.dockerfile)]
        if a.codegen:
            from evaluator.rehearsal import image_codegen
            env = quick_env(a.dockerfile, sysconfig.get_paths()["purelib"])
            steps.append(Step("codegen", *image_codegen.run_in(Path(sys.executable), {"CUDA_HOME": env.get("CUDA_HOME", "")})))
        for s in steps:
            print(s.line())
    elif a.venv:
        steps = full(a.venv, a.dockerfile, a.codegen, a.reuse)
    else:
        with tempfile.TemporaryDirectory(prefix="image-rehearsal-") as tmp:
            steps = full(Path(tmp) / "venv", a.dockerfile, a.codegen)
    ok = all(s.ok for s in steps)
    if a.json:
        a.json.write_text(json.dumps({"ok": ok, "steps": [asdict(s) for s in steps]}, indent=1) + "\n")
    print("image rehearsal:", "PASS" if ok else "FAIL", file=sys.stderr)
    return 0 if ok else 1


def aarch64(p: argparse.ArgumentParser, a: argparse.Namespace) -> int:
    """The emulated arm64 rehearsal: one line and exit 1 when this host cannot run it, else its verdict."""
    from engine.io import folder_refusal, mark_owned, marked
    from evaluator import settings
    from evaluator.rehearsal import emulated, emulated_plan

    if a.quick or a.venv or a.codegen:
        p.error("--quick, --venv and --codegen are the x86_64 rehearsal's; --arch aarch64 runs its own steps")
    cache = a.cache or emulated_plan.cache_dir(settings.user_cache_home())
    why = folder_refusal(cache, "--cache", lambda d: marked(d, emulated_plan.KIND))
    if why:
        p.error(why)
    cache.mkdir(parents=True, exist_ok=True)
    mark_owned(cache, emulated_plan.KIND)
    try:
        steps = emulated.rehearse(cache, a.dockerfile)
    except emulated_plan.Refused as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 1
    doc = emulated.record(steps, cache)
    if a.json:
        a.json.write_text(json.dumps(doc, indent=1) + "\n")
    failed = [s.name for s in steps if not s.ok]
    print(f"image rehearsal (aarch64, {'emulated' if doc['emulated'] else 'native'}): "
          f"{'PASS' if doc['ok'] else 'FAIL at ' + ', '.join(failed)} ({len(steps)} steps, {doc['total_s']:.0f} s)",
          file=sys.stderr)
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
