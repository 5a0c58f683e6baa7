"""Ablations in one command: run several methods on one index and score each.

    python -m evaluator.ablate --index-dir DIR --queries FILE --labels FILE [--methods slerp,slerp+gap,...] \
        [--json OUT.json] [--out-dir DIR] [--model-dir DIR] [--device cpu] [--corpus DIR] [--warmup N]

Without --methods it runs the default set, every entry the index supports: the three
training-free compositions, Slerp with each gallery-aware option alone, Pic2Word when
the index has a mapping, the gallery text bank when it has one, re-inspection when the
corpus images are reachable; the others are named on stderr and left out. A method named
with --methods that the index cannot run is skipped with the reason in its row.
Before the first timed method, an untimed warm-up runs the first method on the first N
requests (torch and the tokenizer initialise there, not inside the first timing).
Each method runs through evaluator.cir.run.main (the code scripts/run.sh execs), in this
process, into OUT_DIR/<method>.jsonl (a fresh output: no resume), and is scored with
evaluator.cir.score (CIRCO mAP@5/10/25/50, CIRR R@1/5/10/50, per-source means, raw
quality, reward). Progress is one stderr line per method; stdout ends with one table (percent),
its rows in method order; every run's and score's full report goes to --json.
Exit 0 when every method ran, 1 when one failed, 2 for bad input.
Pick methods on your own labelled validation split: the generated test corpus and a
random CLIP say nothing about quality (docs/retrieval_quality.md).
"""
from __future__ import annotations

import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from engine.presets.retrieval import RETRIEVAL
from evaluator.cir.score import CIRCO_KS, CIRR_KS

PROG = "python -m evaluator.ablate"
# the default set, in table order; entries the index cannot run are left out (said on stderr)
# (hubness scorers: the default gallery bank, then the call's own requests, transductive, named as such)
DEFAULT_METHODS = ("text-only", "sum", "slerp", "slerp+gap", "slerp+gap-centre", "slerp+isoftmax", "slerp+qbnorm",
                   "slerp+dual-softmax", "slerp+csls", "slerp+isoftmax:bank=requests", "slerp+qbnorm:bank=requests",
                   "slerp+dual-softmax:bank=requests", "slerp+csls:bank=requests", "slerp+aqe", "slerp+dba",
                   "slerp+reinspect:n=20", "pic2word", "pic2word+qbnorm")
WARMUP = 32   # requests of the untimed warm-up


@dataclass
class AblateConfig:
    index_dir: Path
    queries: Path
    labels: list[Path]
    methods: list[str] | None = None    # None: DEFAULT_METHODS the index supports
    json: Path | None = None
    out_dir: Path | None = None
    model_dir: Path | None = None
    device: str | None = None
    corpus: Path | None = None
    batch_size: int = RETRIEVAL.query_batch
    warmup: int = WARMUP
    debug: bool = False


def parse_args(argv: list[str] | None) -> AblateConfig:
    from engine.cli import device_name, parser, whole_number

    p = parser(PROG, __doc__.split("\n\n")[0], {
        "CLIP_MODEL_DIR": "the CLIP folder (as --model-dir)", "CLIP_DEVICE": "cpu or cuda (as --device)",
        "ENGINE_DEBUG": "1: tracebacks instead of one-line errors"})
    p.add_argument("--index-dir", type=Path, required=True, help="a finished index (scripts/build.sh)")
    p.add_argument("--queries", type=Path, required=True, help="requests JSONL")
    p.add_argument("--labels", type=Path, required=True, action="append", help="labels file (repeatable)")
    p.add_argument("--methods", default=None,
                   help="comma-separated method names (scripts/run.sh --help); default: every entry of "
                        f"{', '.join(DEFAULT_METHODS)} the index supports")
    p.add_argument("--json", type=Path, default=None, help="also write every method's full report here (default: not written)")
    p.add_argument("--out-dir", type=Path, default=None, help="run outputs (default: a folder under TMPDIR)")
    p.add_argument("--model-dir", type=Path, default=None,
                   help="CLIP folder (default: env CLIP_MODEL_DIR, else /task/models/clip when it is there, "
                        "else the folder the index records when its digest matches)")
    p.add_argument("--device", default=None, type=device_name, help="cpu, cuda or cuda:N (default: env CLIP_DEVICE, else cuda if present)")
    p.add_argument("--corpus", type=Path, default=None, help="corpus for re-inspecting methods (default: the index's)")
    p.add_argument("--batch-size", type=whole_number(1, 4096, "requests"), default=RETRIEVAL.query_batch, help="requests per batch")
    p.add_argument("--warmup", type=whole_number(0, 10**6, "requests"), default=WARMUP, help="requests of the untimed warm-up (0: none)")
    a = p.parse_args(argv)
    if a.methods is not None:
        a.methods = [m.strip() for m in a.methods.split(",") if m.strip()]
        if not a.methods:
            p.error("--methods names no method")
    if a.batch_size < 1 or a.warmup < 0:
        p.error("--batch-size must be >= 1 and --warmup >= 0")
    return AblateConfig(**vars(a))


def unsupported(name: str, meta: dict, corpus: Path | None) -> str | None:
    """Why the index (its meta.json) cannot run method `name`, or None (each option says what it
    needs: engine.retrieval.options). A name that does not parse is left to the run, which reports it."""
    from engine.retrieval.compose import make_method

    try:
        method = make_method(name)
    except ValueError:
        return None
    return next((why for o in method.steps for why in [o.missing(meta, corpus)] if why), None)


def _row(name: str, report: dict | None, run: dict) -> dict:
    """One table row: percent metrics per source, means, raw, reward, throughput."""
    row = {"method": name, "status": run.get("status", "ok")}
    for src, ks, prefix in (("circo", CIRCO_KS, "mAP@"), ("cirr", CIRR_KS, "R@")):
        s = report["sources"].get(src) if report else None
        for k in ks:
            row[f"{src} {prefix}{k}"] = s["percent"][f"{prefix}{k}"] if s else None
        row[f"{src} mean"] = s["mean_percent"] if s else None
    row["raw"] = report["raw"] if report else None
    row["reward"] = report["reward"] if report else None
    row["q/s"] = run.get("queries_per_s")
    return row


def format_table(rows: list[dict]) -> str:
    """Fixed-width text table; metrics in percent, raw and reward as fractions."""
    cols = ["method"] + [c for c in rows[0] if c not in ("method", "status")] if rows else ["method"]
    width = {c: max(len(c), *(len(_fmt(c, r.get(c))) for r in rows)) for c in cols}
    lines = ["  ".join(c.ljust(width[c]) for c in cols)]
    for r in rows:
        cells = [_fmt(c, r.get(c)) for c in cols]
        lines.append("  ".join(v.ljust(width[c]) for v, c in zip(cells, cols))
                     + ("" if r.get("status", "ok") == "ok" else f"  ({r['status']})"))
    return "\n".join(lines)


def _fmt(col: str, v) -> str:
    if v is None:
        return "-"
    if isinstance(v, (int, float)) and col != "method":
        return f"{v:.4f}" if col in ("raw", "reward") else f"{v:.1f}" if col == "q/s" else f"{v:.2f}"
    return str(v)


def _run_args(cfg: AblateConfig, name: str, queries: Path, out: Path, rep: Path) -> list[str]:
    args = ["--index-dir", str(cfg.index_dir), "--queries", str(queries), "--output", str(out),
            "--method", name, "--no-resume", "--report", str(rep), "--batch-size", str(cfg.batch_size)]
    for flag, value in (("--model-dir", cfg.model_dir), ("--device", cfg.device), ("--corpus", cfg.corpus)):
        if value is not None:
            args += [flag, str(value)]
    return args


def _say(msg: str) -> None:
    print(f"ablate: {msg}", file=sys.stderr, flush=True)


def _warm_up(cfg: AblateConfig, name: str, out_dir: Path) -> float:
    """Run `name` untimed on the first cfg.warmup requests; returns its wall seconds."""
    from evaluator.cir import run as cir_run

    lines = cfg.queries.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)[:cfg.warmup]
    q = out_dir / ".warmup-requests.jsonl"
    q.write_text("".join(lines), encoding="utf-8")
    t0 = time.perf_counter()
    cir_run.main(_run_args(cfg, name, q, out_dir / ".warmup.jsonl", out_dir / ".warmup.run.json"), log_summary=False)
    return round(time.perf_counter() - t0, 3)


def ablate(cfg: AblateConfig) -> int:
    """Run, score and tabulate every method; 0 when all ran, 1 when one failed."""
    from engine.cli import UsageError
    from engine.io import folder_refusal, mark_owned, marked
    from engine.retrieval.index import read_meta
    from evaluator.cir import run as cir_run
    from evaluator.cir import task
    from evaluator.cir.score import InputError, load_label_files, load_results, score

    meta = read_meta(cfg.index_dir)
    if meta is None:
        raise UsageError(f"no finished index in {cfg.index_dir} (meta.json missing or unreadable; "
                         "build one with scripts/build.sh)")
    if not cfg.queries.is_file():
        raise UsageError(f"queries file not found: {cfg.queries}")
    cfg.model_dir = task.clip_dir(cfg.model_dir, meta, say=_say)   # found once, said once, for every run
    try:
        labels = load_label_files(cfg.labels)
    except InputError as e:
        raise UsageError(str(e)) from e
    if cfg.methods is None:
        methods, left_out = [], {}
        for name in DEFAULT_METHODS:
            why = unsupported(name, meta, cfg.corpus)
            (left_out.setdefault(why, []).append(name) if why else methods.append(name))
        _say(f"default set: {len(methods)} methods the index supports" +
             "".join(f"; left out: {', '.join(names)}: {why}" for why, names in left_out.items()))
    else:
        methods = cfg.methods
    out_dir = cfg.out_dir or Path(tempfile.mkdtemp(prefix="cir-ablate-"))
    why = folder_refusal(out_dir, "--out-dir", lambda d: marked(d, "ablate"))
    if why:
        raise UsageError(why)
    out_dir.mkdir(parents=True, exist_ok=True)
    mark_owned(out_dir, "ablate")
    runnable = [m for m in methods if unsupported(m, meta, cfg.corpus) is None]
    if cfg.warmup and runnable:
        _say(f"warm-up: {runnable[0]} on the first {cfg.warmup} requests (untimed)")
        _say(f"warm-up took {_warm_up(cfg, runnable[0], out_dir):.1f} s")
    rows, reports = [], []
    for i, name in enumerate(methods, 1):
        why = unsupported(name, meta, cfg.corpus)
        if why:
            _say(f"method {i} of {len(methods)}: {name}: skipped: {why}")
            run, report, output = {"status": f"skipped: {why}"}, None, None
        else:
            safe = "".join(c if c.isalnum() or c in "-_.=" else "_" for c in name)
            out, rep = out_dir / f"{safe}.jsonl", out_dir / f"{safe}.run.json"
            _say(f"method {i} of {len(methods)}: {name}")
            t0 = time.perf_counter()
            rc = cir_run.main(_run_args(cfg, name, cfg.queries, out, rep), log_summary=False)
            run = json.loads(rep.read_text()) if rc == 0 and rep.is_file() else {"status": f"run failed ({rc})"}
            run["wall_s"] = round(time.perf_counter() - t0, 3)
            report = score(load_results(out), labels) if rc == 0 else None
            output = str(out)
            if report is not None:
                _say(f"method {i} of {len(methods)}: {name}: {run.get('answered')} requests in "
                     f"{run['wall_s']:.1f} s, raw {report['raw']:.4f}")
        rows.append(_row(name, report, run))
        reports.append({"method": name, "output": output, "run": run, "score": report})
    if cfg.json is not None:
        cfg.json.write_text(json.dumps({"index_dir": str(cfg.index_dir), "queries": str(cfg.queries),
                                        "labels": [str(p) for p in cfg.labels], "warmup": cfg.warmup,
                                        "table": rows, "methods": reports}, indent=2) + "\n")
        _say(f"every method's run and score report: {cfg.json}")
    sys.stderr.flush()      # the table comes last, after every progress line
    print("CIRCO / CIRR metrics in percent; raw and reward as fractions (evaluator.cir.score); q/s: requests "
          "answered per second")
    print(format_table(rows), flush=True)
    return 0 if all(r["status"] == "ok" or r["status"].startswith("skipped") for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    from engine.cli import guard

    cfg = parse_args(argv)
    return guard(PROG, lambda: ablate(cfg), debug=cfg.debug)


if __name__ == "__main__":
    sys.exit(main())
