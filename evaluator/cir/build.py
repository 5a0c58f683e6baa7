"""Build the CIR gallery index: records -> decode -> CLIP image tower -> unit FP16 rows.

    scripts/build.sh --corpus DIR --index-dir DIR [--model-dir DIR] [--method slerp] ...

Reads DIR/records.jsonl ({image_id, path}; a path resolves as the task gives it: relative
to DIR, absolute as is, symlinks followed, as the reference's Image.open does;
--confine-to-corpus refuses and names an absolute path or one that leaves DIR, also through
a symlink), reads only regular files of at most ENGINE_MAX_FILE_BYTES, decodes with the
engine's decoders (dali-gpu on CUDA, dali-cpu otherwise; ENGINE_DECODER=pil is the
reference), embeds in batches, and writes the index described in engine.retrieval.index
(engine.retrieval.gallery does the work). Chunked and resumable: a killed build restarts at
its first unfinished chunk. Images no decoder can read are listed in meta.json and left out.
Build-time extras (gallery mean, `--mapping pic2word`, gallery-derived text bank, DBA):
engine.retrieval.index_extras. Env:
CLIP_MODEL_DIR, CLIP_MODEL_NAME, CLIP_DEVICE, CLIP_PRECISION, CIR_METHOD. main()'s
stop_after_chunks / p2w_stop_after end a build early, as a kill would (resumable).
"""
from __future__ import annotations

import hashlib
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from evaluator import settings as evaluator_settings

STOPPED = 3  # exit status of a build ended early by main(stop_after_chunks=...) (resumable)


PROG = "scripts/build.sh"


def _error(msg: str) -> int:
    """A user mistake: one `PROG: error: MESSAGE` line (the caller returns 2)."""
    from engine.cli import error

    return error(PROG, msg)


@dataclass
class BuildConfig:
    corpus: Path
    index_dir: Path
    model_dir: Path | None = None
    model_name: str | None = None
    decoder: str = "auto"          # auto: dali-gpu on CUDA, dali-cpu otherwise
    batch_size: int | None = None  # None: 256 on CUDA, 64 on CPU
    chunk_size: int = 4096         # images per resumable chunk
    readers: int = 8
    device: str | None = None
    precision: str | None = None
    method: str = "slerp"
    text_weight: float | None = None
    prompt: str | None = None
    force: bool = False
    mapping: str = "none"          # none | pic2word (engine.retrieval.index_extras)
    p2w_epochs: int = 20
    p2w_steps: int = 0
    p2w_batch_size: int = 256
    p2w_lr: float = 1e-4
    p2w_warmup: int = -1           # warm-up steps; -1: a tenth of the run
    p2w_hidden: int = 512
    p2w_seed: int = 0
    p2w_ckpt_every: int = 200
    p2w_time_budget: float = 2400.0
    text_bank: int = -1            # -1: 4096 with a mapping, else 0
    dba: int = 0
    dba_alpha: float = 3.0
    dba_chunk: int = 1024          # gallery rows per DBA block; 0: one [N, N] matrix (the reference twin)
    confine_to_corpus: bool = False      # records paths must be relative and stay inside the corpus folder
    stop_after_chunks: int = 0     # stop (resumably) after this many chunks; 0: never
    p2w_stop_after: int = 0        # stop (resumably) after this many Pic2Word steps; 0: never
    ray: bool = False              # embed on Ray Data actors (engine.retrieval.build_ray; extra `scale`)
    workers: int = 2               # Ray actors (one GPU each on CUDA, else one CPU each)

    def extras(self):
        from engine.retrieval.index_extras import ExtrasConfig
        from engine.retrieval.pic2word import Pic2WordConfig

        p2w = Pic2WordConfig(hidden=self.p2w_hidden, epochs=self.p2w_epochs, steps=self.p2w_steps,
                             batch_size=self.p2w_batch_size, lr=self.p2w_lr, warmup=self.p2w_warmup,
                             seed=self.p2w_seed, ckpt_every=self.p2w_ckpt_every, time_budget_s=self.p2w_time_budget)
        return ExtrasConfig(self.mapping, p2w, self.text_bank, self.dba, self.dba_alpha, self.dba_chunk,
                            self.p2w_stop_after)


def parse_args(argv: list[str] | None) -> BuildConfig:
    from engine.cli import ArgumentParser, corpus_flags, debug_flag

    p = ArgumentParser(prog="scripts/build.sh", description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", type=Path, required=True, help="folder with records.jsonl")
    p.add_argument("--index-dir", type=Path, required=True, help="where the index goes (created if missing)")
    p.add_argument("--model-dir", type=Path, default=None, help="CLIP folder (env CLIP_MODEL_DIR)")
    p.add_argument("--model-name", default=None, help="architecture for a bare state dict (env CLIP_MODEL_NAME)")
    p.add_argument("--decoder", default="auto", help="auto | pil | dali-cpu | dali-gpu (env ENGINE_DECODER)")
    p.add_argument("--batch-size", type=int, default=None, help="images per batch (default 256 on CUDA, 64 on CPU)")
    p.add_argument("--chunk-size", type=int, default=4096)
    p.add_argument("--readers", type=int, default=8)
    p.add_argument("--device", default=None, help="cpu | cuda (env CLIP_DEVICE; default cuda when present)")
    p.add_argument("--precision", default=None, help="fp32 | fp16 | bf16 (env CLIP_PRECISION)")
    p.add_argument("--method", default=evaluator_settings.cir_method() or "slerp",
                   help="default composition method recorded for scripts/run.sh (env CIR_METHOD)")
    p.add_argument("--text-weight", type=float, default=None)
    p.add_argument("--prompt", default=None)
    p.add_argument("--force", action="store_true", help="rebuild even if the index is up to date")
    x = p.add_argument_group("extras (docs/retrieval_quality.md)")
    x.add_argument("--mapping", default="none", choices=("none", "pic2word"),
                   help="learn a Pic2Word image-to-word mapping on the gallery (method pic2word)")
    x.add_argument("--p2w-epochs", type=int, default=20, help="passes over the gallery (when --p2w-steps is 0)")
    x.add_argument("--p2w-steps", type=int, default=0, help="optimiser steps (0: epochs x N / batch)")
    x.add_argument("--p2w-batch-size", type=int, default=256)
    x.add_argument("--p2w-lr", type=float, default=1e-4, help="peak learning rate (after the warm-up)")
    x.add_argument("--p2w-warmup", type=int, default=-1,
                   help="linear warm-up steps before the cosine decay (-1: a tenth of the run)")
    x.add_argument("--p2w-hidden", type=int, default=512)
    x.add_argument("--p2w-seed", type=int, default=0)
    x.add_argument("--p2w-ckpt-every", type=int, default=200, help="steps between training checkpoints")
    x.add_argument("--p2w-time-budget", type=float, default=2400.0, help="seconds of training at most")
    x.add_argument("--text-bank", type=int, default=-1,
                   help="gallery-derived texts to store (default 4096 with a mapping, else 0)")
    x.add_argument("--dba", type=int, default=0, help="store DBA rows over N neighbours (0: off)")
    x.add_argument("--dba-alpha", type=float, default=3.0)
    x.add_argument("--dba-chunk", type=int, default=1024,
                   help="gallery rows per DBA block (0: one [N, N] matrix, the reference twin)")
    corpus_flags(p, "follow them, as the reference's Image.open does")
    p.add_argument("--ray", action="store_true",
                   help="embed on Ray Data actors: a local Ray, or the cluster at RAY_ADDRESS (pip install '.[scale]')")
    p.add_argument("--workers", type=int, default=2, help="Ray actors, with --ray (one GPU each on CUDA)")
    debug_flag(p)
    a = p.parse_args(argv)
    del a.debug
    if a.allow_outside_corpus and a.confine_to_corpus:
        p.error("--allow-outside-corpus and --confine-to-corpus contradict each other")
    del a.allow_outside_corpus
    if (a.batch_size is not None and a.batch_size < 1) or a.chunk_size < 1 or a.readers < 1 or a.workers < 1:
        p.error("--batch-size, --chunk-size, --readers and --workers must be >= 1")
    if min(a.p2w_epochs, a.p2w_batch_size, a.p2w_ckpt_every, a.p2w_hidden) < 1 or min(a.p2w_steps, a.dba,
                                                                                        a.dba_chunk) < 0 \
            or a.p2w_warmup < -1:
        p.error("--p2w-* sizes must be >= 1 (--p2w-steps, --dba >= 0; --p2w-warmup >= -1)")
    return BuildConfig(**vars(a))


def main(argv: list[str] | None = None, stop_after_chunks: int = 0, p2w_stop_after: int = 0) -> int:
    """scripts/build.sh. The stop_* arguments end the build early, as an interruption would (resumable)."""
    from engine.cli import guard
    from evaluator.cir.limits import exhaustion_guarded
    from evaluator.cir.run import interrupt_ends

    debug = bool(argv and "--debug" in argv)
    with interrupt_ends(PROG, "finished chunks are kept; the same command resumes the build"):
        return exhaustion_guarded(PROG, lambda: guard(PROG, lambda: _main(argv, stop_after_chunks, p2w_stop_after),
                                                      debug=debug), debug)


def _main(argv: list[str] | None, stop_after_chunks: int, p2w_stop_after: int) -> int:
    from engine.stdio import safe_std_streams

    safe_std_streams()   # diagnostics are best effort: a broken stderr never fails the build
    cfg = parse_args(argv)
    from engine import threads

    try:
        os.environ.update(threads.library_env(threads.budget("cpu")))   # before torch sizes its pools
    except ValueError as e:   # a bad ENGINE_THREADS / ENGINE_READERS
        _error(f"{e}")
        return 2
    from engine.memory import RETRIEVAL_BUILD
    from evaluator.cir.limits import address_space_problem, clip_folder_guess

    problem = address_space_problem(RETRIEVAL_BUILD, "an index build", clip_folder_guess(cfg.model_dir))
    if problem:   # before torch loads: without room, glibc may abort a thread with nothing to catch
        _error(problem)
        return 2
    cfg.stop_after_chunks, cfg.p2w_stop_after = stop_after_chunks, p2w_stop_after
    t_start = time.perf_counter()
    from engine.retrieval.jsonl import read_input, read_records, stderr_warn
    from evaluator.cir import task
    from evaluator.cir.run import tmpdir_problem

    problem = tmpdir_problem()
    if problem:
        _error(f"{problem}")
        return 2
    try:
        method = task.method(cfg.method, cfg.text_weight, cfg.prompt)
    except ValueError as e:
        _error(f"{e}")
        return 2
    if method.name == "pic2word" and cfg.mapping != "pic2word":
        _error("--method pic2word needs the mapping: add --mapping pic2word")
        return 2
    records_path = cfg.corpus / "records.jsonl"
    if not records_path.is_file():
        _error(f"{records_path} not found (or not a regular file)")
        return 2
    try:
        cfg.index_dir.mkdir(exist_ok=True)
    except OSError as e:
        _error(f"cannot create the index dir {cfg.index_dir}: {e.strerror or e}")
        return 2
    if not os.access(cfg.index_dir, os.W_OK):
        _error(f"the index dir {cfg.index_dir} is not writable")
        return 2
    try:
        records = read_records(records_path, stderr_warn("cir_build"))
        records_sha = hashlib.sha256(read_input(records_path)).hexdigest()
    except (OSError, ValueError) as e:
        _error(f"cannot read {records_path}: {e}")
        return 2
    if not records:
        _error(f"{records_path} holds no usable records")
        return 2

    from engine.clip.load import ClipLoadError, load_clip
    from engine.clip.towers import ClipTowers, default_device

    if cfg.batch_size is None:
        cfg.batch_size = 256 if (cfg.device or default_device()).startswith("cuda") else 64
    try:
        model, spec, info = load_clip(task.clip_dir(cfg.model_dir), cfg.model_name, cfg.batch_size)
    except (ClipLoadError, OSError) as e:
        _error(f"{e}")
        return 2
    towers = ClipTowers(model, spec, cfg.device, cfg.precision)
    threads.apply_torch(threads.budget(towers.device.type))
    t_loaded = time.perf_counter()
    from engine.retrieval import gallery
    from engine.retrieval.index import IndexLoadError

    args = dict(corpus=cfg.corpus, index_dir=cfg.index_dir, extras=cfg.extras(), decoder=cfg.decoder,
                batch_size=cfg.batch_size, chunk_size=cfg.chunk_size, readers=cfg.readers,
                confine_to_corpus=cfg.confine_to_corpus, force=cfg.force, stop_after_chunks=cfg.stop_after_chunks,
                t_start=t_start, t_loaded=t_loaded)
    build = _ray_build(cfg, towers, info) if cfg.ray else gallery.build
    if build is None:
        return 2
    try:
        done = build(records, records_sha, towers, info, method.to_dict(), **args)
    except IndexLoadError as e:
        _error(f"{e}")
        return 2
    return 0 if done else STOPPED


def _ray_build(cfg: BuildConfig, towers, info):
    """--ray: the build with its chunks embedded on Ray actors (engine.retrieval.build_ray), or None
    (said in one line) when Ray is not installed."""
    import functools
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        _error("--ray needs Ray Data, which is not installed: pip install -r requirements/scale.txt")
        return None
    from engine.retrieval import build_ray

    tower_args = (str(info["dir"]), cfg.model_name, cfg.batch_size, str(towers.device), towers.precision)
    return functools.partial(build_ray.build, tower_args=tower_args, workers=cfg.workers)

if __name__ == "__main__":
    sys.exit(main())
