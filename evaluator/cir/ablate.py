"""Ablations in one command: run several methods on one index and score each.

    python -m evaluator.ablate --index-dir DIR --queries FILE --labels FILE --methods slerp,slerp+gap,... \
        [--json OUT.json] [--out-dir DIR] [--model-dir DIR] [--device cpu] [--corpus DIR]

Each method runs through evaluator.cir.run.main (the code scripts/run.sh execs), in this
process, into OUT_DIR/<method>.jsonl (a fresh output: no resume), and is scored with
evaluator.cir.score (CIRCO mAP@5/10/25/50, CIRR R@1/5/10/50, per-source means, raw
quality, reward). Prints one table (percent) and, with --json, writes every report.
Pick methods on your own labelled validation split: the generated test corpus and a
random CLIP say nothing about quality (docs/retrieval_quality.md).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from evaluator.cir.score import CIRCO_KS, CIRR_KS


@dataclass
class AblateConfig:
    index_dir: Path
    queries: Path
    labels: list[Path]
    methods: list[str]
    json: Path | None = None
    out_dir: Path | None = None
    model_dir: Path | None = None
    device: str | None = None
    corpus: Path | None = None
    batch_size: int = 256


def parse_args(argv: list[str] | None) -> AblateConfig:
    p = argparse.ArgumentParser(prog="python -m evaluator.ablate", description=__doc__.split("\n\n")[0])
    p.add_argument("--index-dir", type=Path, required=True)
    p.add_argument("--queries", type=Path, required=True)
    p.add_argument("--labels", type=Path, required=True, action="append", help="labels file (repeatable)")
    p.add_argument("--methods", required=True, help="comma-separated method names (see scripts/run.sh --help)")
    p.add_argument("--json", type=Path, default=None, help="also write every method's report here")
    p.add_argument("--out-dir", type=Path, default=None, help="run outputs (default: a folder under TMPDIR)")
    p.add_argument("--model-dir", type=Path, default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--corpus", type=Path, default=None, help="corpus for re-inspecting methods")
    p.add_argument("--batch-size", type=int, default=256)
    a = p.parse_args(argv)
    a.methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    if not a.methods:
        p.error("--methods names no method")
    return AblateConfig(**vars(a))


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
    row["queries_per_s"] = run.get("queries_per_s")
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
        return f"{v:.4f}" if col in ("raw", "reward") else f"{v:.1f}" if col == "queries_per_s" else f"{v:.2f}"
    return str(v)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    from evaluator.cir import run as cir_run
    from evaluator.cir.score import InputError, load_label_files, load_results, score

    try:
        labels = load_label_files(cfg.labels)
    except (InputError, OSError) as e:
        print(f"[ablate] error: {e}", file=sys.stderr)
        return 2
    out_dir = cfg.out_dir or Path(tempfile.mkdtemp(prefix="cir-ablate-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    rows, reports = [], []
    for name in cfg.methods:
        safe = "".join(c if c.isalnum() or c in "-_.=" else "_" for c in name)
        out, rep = out_dir / f"{safe}.jsonl", out_dir / f"{safe}.run.json"
        args = ["--index-dir", str(cfg.index_dir), "--queries", str(cfg.queries), "--output", str(out),
                "--method", name, "--no-resume", "--report", str(rep), "--batch-size", str(cfg.batch_size)]
        for flag, value in (("--model-dir", cfg.model_dir), ("--device", cfg.device), ("--corpus", cfg.corpus)):
            if value is not None:
                args += [flag, str(value)]
        print(f"[ablate] {name}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        rc = cir_run.main(args)
        run = json.loads(rep.read_text()) if rc == 0 and rep.is_file() else {"status": f"run failed ({rc})"}
        run["wall_s"] = round(time.perf_counter() - t0, 3)
        report = score(load_results(out), labels) if rc == 0 else None
        rows.append(_row(name, report, run))
        reports.append({"method": name, "output": str(out), "run": run, "score": report})
    print(format_table(rows))
    print("(CIRCO / CIRR metrics in percent; raw and reward as fractions: evaluator.cir.score)")
    if cfg.json is not None:
        cfg.json.write_text(json.dumps({"index_dir": str(cfg.index_dir), "queries": str(cfg.queries),
                                        "labels": [str(p) for p in cfg.labels], "table": rows,
                                        "methods": reports}, indent=2) + "\n")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
