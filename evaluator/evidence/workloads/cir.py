"""The cir-retrieval workload of the evidence campaign: its inputs, one timed run, its gate, its quality.

min: `python -m evaluator.cir_corpus --out DIR --clip CLIPDIR` writes a generated corpus and
a tiny random CLIP, and `scripts/build.sh` builds the gallery index once (untimed
preparation). max/pro: a built index, its requests, labels and CLIP, given by path.
One run = one fresh `scripts/run.sh --index-dir --queries --output --report` process that
writes a fresh output file. The gate is the output's validity (check_results); quality
is evaluator.cir.score's raw quality and reward, scored per run. Both scripts run
with PYTHON set to the campaign's interpreter unless the caller set it.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from engine.io import sha256_file
from engine.retrieval.jsonl import is_id
from evaluator.cir.task import TOP_K
from evaluator.evidence import sha256_manifest
from evaluator.evidence.runs import (
    MIN_COUNT,
    Prepared,
    RunArgs,
    RunRecord,
    UsageError,
    Workload,
    default_runner,
    generated_markers,
    process_failure,
    timed_run,
)

WORKLOAD_ID = "cir-retrieval"
PER_TEMPLATE = 4  # min corpus: renders per template, so a CIRCO-style request has 3 positives
MIN_LAYOUT = "open_clip"  # the tiny CLIP layout min builds and runs with


@dataclass
class CirJudge:
    """What the gate and the scorer read, loaded once before the runs."""

    requests: list[tuple[str, str | None]]  # (query_id, reference image id) as str, request order
    index_ids: frozenset[str]  # str(image_id) of every gallery row
    labels: dict  # query_id -> evaluator.cir.score.Label
    request_warnings: list[str] = field(default_factory=list)  # lines the run skips too


@dataclass
class CirInputs:
    """What every run of one campaign reads: the same files for all N processes."""

    index_dir: Path
    queries: Path
    labels: tuple[Path, ...]
    clip_dir: Path
    judge: CirJudge
    dataset_mode: str
    split: str
    prepared: Path | None = None  # min: the folder holding corpus/, clip/, index/, build.log


def _env(clip_dir: Path) -> dict:
    env = {**os.environ, "CLIP_MODEL_DIR": str(clip_dir)}
    env.setdefault("PYTHON", sys.executable)  # scripts/*.sh exec ${PYTHON:-python3}
    return env


def prepare_min(source_dir: Path, dest: Path, count: int, requests: int, seed: int, timeout_s: float) -> dict:
    """Generate the corpus and tiny CLIP into dest, build dest/index once; return the preparation times."""
    build_sh = source_dir / "scripts" / "build.sh"
    if not build_sh.is_file():
        raise UsageError(f"{build_sh}: missing (the retrieval ABI builds the min index with it)")
    templates = max(1, math.ceil(count / PER_TEMPLATE))
    steps = [
        ("corpus_s", [sys.executable, "-m", "evaluator.cir_corpus", "--out", str(dest / "corpus"),
                      "--clip", str(dest / "clip"), "--templates", str(templates),
                      "--per-template", str(PER_TEMPLATE), "--requests", str(requests), "--seed", str(seed)]),
        ("index_build_s", [*default_runner(source_dir, "scripts/build.sh"), "--corpus", str(dest / "corpus"),
                           "--index-dir", str(dest / "index")]),
    ]
    times = {}
    dest.mkdir(parents=True, exist_ok=True)
    with open(dest / "build.log", "w") as log:
        for name, cmd in steps:
            log.write(f"$ {shlex.join(cmd)}\n")
            log.flush()
            t0 = time.perf_counter()
            try:
                proc = subprocess.run(cmd, cwd=source_dir, env=_env(dest / "clip" / MIN_LAYOUT), stdout=log,
                                      stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=timeout_s,
                                      check=False)
            except subprocess.TimeoutExpired as exc:
                raise RuntimeError(f"{shlex.join(cmd)}: timed out after {timeout_s:g} s (min preparation)") from exc
            times[name] = round(time.perf_counter() - t0, 3)
            if proc.returncode != 0:
                tail = (dest / "build.log").read_text(errors="replace").strip()[-1000:]
                raise RuntimeError(f"{shlex.join(cmd)} failed ({proc.returncode}): {tail}")
    return {"images": templates * PER_TEMPLATE, **times}


def load_judge(index_dir: Path, queries: Path, labels: tuple[Path, ...]) -> CirJudge:
    """Requests (read as scripts/run.sh reads them), gallery ids and labels; ValueError names a bad input."""
    from engine.retrieval.index import IndexLoadError, load_index
    from engine.retrieval.jsonl import read_requests
    from evaluator.cir.score import load_label_files

    warnings: list[str] = []
    try:
        ids = load_index(index_dir).ids
    except IndexLoadError as exc:
        raise ValueError(str(exc)) from exc
    reqs = read_requests(queries, warnings.append)
    if not reqs:
        raise ValueError(f"{queries}: no usable requests")
    return CirJudge([(str(r.query_id), r.reference) for r in reqs], frozenset(str(i) for i in ids),
                    load_label_files(labels), warnings)


def resolve_inputs(a: RunArgs, tmp: Path) -> tuple[CirInputs, dict]:
    """The run inputs for the profile (min: prepared here, untimed), plus the dataset record."""
    if a.prepared is not None:
        raise UsageError(f"--prepared is not used by {WORKLOAD_ID}: its min input is generated and indexed "
                         "by the campaign (--count, --requests, --seed)")
    if a.profile == "min":
        prepared = tmp / "prepared"
        count = a.count if a.count is not None else MIN_COUNT
        prep = prepare_min(a.source_dir, prepared, count, a.requests, a.seed, a.timeout_s)
        corpus = prepared / "corpus"
        judge = load_judge(prepared / "index", corpus / "requests.jsonl", (corpus / "labels.jsonl",))
        split = f"generated:seed={a.seed},images={prep['images']},requests={a.requests}"
        inputs = CirInputs(prepared / "index", corpus / "requests.jsonl", (corpus / "labels.jsonl",),
                           prepared / "clip" / MIN_LAYOUT, judge, "generated", split, prepared)
        dataset = {"mode": "generated", "mode_basis": "min profile: the kit's generated corpus", "split": split,
                   "version": "evaluator.synthetic.cir_corpus (this source tree)", "rows": len(judge.requests),
                   "gallery_images": len(judge.index_ids), "seed": a.seed, "canonical_seed": a.seed == 0,
                   "clip": f"tiny random CLIP ({MIN_LAYOUT} layout, seed {a.seed}): its quality is meaningless",
                   "preparation": {"corpus_s": prep["corpus_s"], "index_build_s": prep["index_build_s"],
                                   "note": "untimed preparation: part of no metric"},
                   "generated_markers": generated_markers(corpus)}
    else:
        for flag, path in [("--queries", a.queries), *(("--labels", p) for p in a.labels)]:
            if not path.is_file():
                raise UsageError(f"{flag} {path}: not a file")
        if not (a.index_dir / "meta.json").is_file():
            raise UsageError(f"--index-dir {a.index_dir}: no meta.json (build it with scripts/build.sh)")
        if not a.clip_dir.exists():
            raise UsageError(f"--clip-dir {a.clip_dir}: not found")
        labels = tuple(p.resolve() for p in a.labels)
        try:
            judge = load_judge(a.index_dir.resolve(), a.queries.resolve(), labels)
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
        inputs = CirInputs(a.index_dir.resolve(), a.queries.resolve(), labels, a.clip_dir.resolve(), judge,
                           "real", a.dataset_split)
        corpus = _corpus_dir(inputs.index_dir)
        markers = generated_markers(inputs.queries.parent, *(p.parent for p in labels), corpus)
        if markers:
            inputs.dataset_mode = "generated"
        basis = (f"generated: the kit's marker {markers[0]}" if markers else
                 "user-supplied inputs without a generated-data marker; split and version as declared")
        dataset = {"mode": inputs.dataset_mode, "mode_basis": basis, "split": a.dataset_split,
                   "version": a.dataset_version, "rows": len(judge.requests),
                   "gallery_images": len(judge.index_ids), "generated_markers": markers}
    labelled = sum(1 for qid, _ in judge.requests if qid in judge.labels)
    dataset["coverage"] = {"what": "requests with a label", "answered": labelled, "rows": len(judge.requests),
                           "complete": labelled == len(judge.requests)}
    dataset["request_warnings"] = judge.request_warnings[:20]  # request lines the run skips too
    return inputs, dataset


def _corpus_dir(index_dir: Path) -> Path | None:
    """The corpus folder the index was built from (meta.json `corpus`), when recorded."""
    try:
        corpus = json.loads((index_dir / "meta.json").read_text()).get("corpus")
    except (OSError, ValueError, AttributeError):
        return None
    return Path(corpus) if isinstance(corpus, str) and corpus else None


def _path_digest(path: Path) -> str:
    return sha256_file(path) if path.is_file() else sha256_manifest.tree_digest(path)["sha256"]


def input_digests(inputs: CirInputs) -> dict[str, str]:
    """Digests of everything every run reads (and the labels); taken before and after the runs."""
    out = {"queries": sha256_file(inputs.queries)}
    out |= {f"labels_{i:02d}": sha256_file(p) for i, p in enumerate(inputs.labels, 1)}
    out |= {"index_meta": sha256_file(inputs.index_dir / "meta.json"),
            "index_tree": sha256_manifest.tree_digest(inputs.index_dir)["sha256"], "clip": _path_digest(inputs.clip_dir)}
    return out


def input_copies(inputs: CirInputs) -> dict[str, tuple[Path, str]]:
    """name -> (source file, path in OUT) of the inputs copied into the evidence folder."""
    copies = {"queries": (inputs.queries, "inputs/queries.jsonl"),
              "index_meta": (inputs.index_dir / "meta.json", "inputs/index_meta.json")}
    copies |= {f"labels_{i:02d}": (p, f"inputs/labels-{i:02d}{p.suffix}") for i, p in enumerate(inputs.labels, 1)}
    if inputs.prepared is not None:
        copies |= {"records": (inputs.prepared / "corpus" / "records.jsonl", "inputs/records.jsonl"),
                   "index_build_log": (inputs.prepared / "build.log", "inputs/index_build.log")}
    return copies


def index_meta(inputs: CirInputs) -> dict:
    return json.loads((inputs.index_dir / "meta.json").read_text())


def row_problem(line: str, expected: tuple[str, str | None] | None, index_ids: frozenset[str],
                k: int = TOP_K) -> str | None:
    """What is wrong with one output line answering `expected` (query_id, reference), or None."""
    try:
        row = json.loads(line)
    except ValueError as exc:
        return f"not JSON ({exc})"
    if not isinstance(row, dict) or not is_id(row.get("query_id")):
        return "not a JSON object with a query_id"
    qid = row["query_id"]
    if expected is None:
        return f"query {qid!r}: extra row (every request is already answered)"
    if str(qid) != expected[0]:
        return f"query {qid!r} where request order expects {expected[0]!r}"
    from evaluator.cir.score import check_results  # the scorer's row rules: one copy

    problem = check_results(row.get("results"), expected[1], k)
    if problem:
        return f"query {qid!r}: {problem[1]}"
    unknown = [str(i["image_id"]) for i in row["results"] if str(i["image_id"]) not in index_ids]
    if unknown:
        return f"query {qid!r}: image id {unknown[0]!r} is not in the index ({len(unknown)} such)"
    return None


def check_results(path: Path, judge: CirJudge) -> str | None:
    """The gate: None when the output is valid, else its first problem (and how many there are)."""
    if not path.is_file():
        return "no output file was written"
    try:
        lines = [(no, ln) for no, ln in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if ln.strip()]
    except UnicodeDecodeError as exc:
        return f"output is not UTF-8 (byte {exc.start})"
    problems = []
    if len(lines) != len(judge.requests):
        problems.append(f"{len(lines)} rows for {len(judge.requests)} requests")
    for i, (no, line) in enumerate(lines):
        expected = judge.requests[i] if i < len(judge.requests) else None
        problem = row_problem(line, expected, judge.index_ids)
        if problem:
            problems.append(f"{path.name} line {no}: {problem}")
    if not problems:
        return None
    return problems[0] + (f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else "")


def run_once(index: int, runner: list[str], inputs: CirInputs, judge: CirJudge, out: Path,
             source_dir: Path, timeout_s: float) -> RunRecord:
    """Run one fresh scripts/run.sh process under OUT/runs/run-NN, time it from outside, gate and score it."""
    from evaluator.cir.score import read_results, score_file

    run_dir = out / "runs" / f"run-{index:02d}"
    run_dir.mkdir(parents=True)  # a new folder: the output never resumes an earlier run's rows
    files = {"results": run_dir / "results.jsonl", "timing": run_dir / "report.json",
             "stdout": run_dir / "stdout.log", "stderr": run_dir / "stderr.log", "score": run_dir / "score.json"}
    cmd = [*runner, "--index-dir", str(inputs.index_dir), "--queries", str(inputs.queries),
           "--output", str(files["results"]), "--report", str(files["timing"])]
    exit_code, wall_s, timed_out = timed_run(cmd, source_dir, _env(inputs.clip_dir), files["stdout"],
                                             files["stderr"], timeout_s)
    record = RunRecord(index, False, None, wall_s, exit_code, timed_out, None, None)
    record.reason = process_failure(exit_code, timed_out, timeout_s, files["stderr"])
    if record.reason is None:
        problem = check_results(files["results"], judge)
        record.reason = f"gate failed: {problem}" if problem else None
    if record.reason is None and files["timing"].is_file():  # the report is optional; a broken one is not
        try:
            record.timing = json.loads(files["timing"].read_text())
        except json.JSONDecodeError as exc:
            record.reason = f"run report (--report) is not JSON: {exc}"
        if record.reason is None and not isinstance(record.timing, dict):
            record.reason = f"run report (--report) is a JSON {type(record.timing).__name__}, expected an object"
            record.timing = None
        elif record.reason is None and record.timing.get("resumed"):
            record.reason = f"the run resumed {record.timing['resumed']} rows of an earlier output"
    if record.reason is None:
        references = {qid: ref for qid, ref in judge.requests}
        report = score_file(read_results(files["results"], references), judge.labels)
        if inputs.dataset_mode == "generated":
            report["label"] = "functional check on generated data: not a quality result"
        files["score"].write_text(json.dumps(report, indent=2) + "\n")
        record.quality = {"raw": report["raw"], "reward": report["reward"], "rows": len(judge.requests),
                          "sources": {s: v["mean_fraction"] for s, v in report["sources"].items()},
                          "raw_note": report["raw_note"], "missing": report["missing"],
                          "unlabeled": report["unlabeled"]}
        record.ok = True
    record.files = {k: v.relative_to(out).as_posix() for k, v in files.items() if v.exists()}
    return record


# ---------------------------------------------------------------- disclosure parts


def _stages(t: dict) -> dict | None:
    """The report's own stages, else setup/query from scripts/run.sh's summary (total = their sum)."""
    if isinstance(t.get("stages"), dict):
        return t["stages"]
    setup, query = t.get("setup_s"), t.get("query_s")
    if isinstance(setup, (int, float)) and isinstance(query, (int, float)):
        return {"setup": setup, "query": query, "total": setup + query}
    return None


def run_entry(r: RunRecord, label: str) -> dict:
    t = r.timing or {}
    q = r.quality or {}
    return {
        "index": r.index, "wall_s": r.wall_s, "exit_code": r.exit_code,
        "quality": {"label": label, "metric": "raw", "rows": q.get("rows"), "raw": q.get("raw"),
                    "reward": q.get("reward")},
        "files": r.files,
        "timing_report": {
            "stages": _stages(t), "timeline": t.get("timeline"), "queries": t.get("queries"),
            "answered": t.get("answered"), "queries_per_s": t.get("queries_per_s"), "gallery": t.get("gallery"),
            "method": t.get("method"), "device": t.get("device"), "precision": t.get("precision"),
            "backend": t.get("backend"),
        },
    }


def quality_block(workload: Workload, runs: list[RunRecord], promoted: bool, label: str, valid: bool) -> dict:
    """Raw quality and reward per valid run; they should be identical across runs, and a note says if not.
    An invalid attempt carries the per-run values only, no aggregate."""
    from evaluator.cir.score import reward_formula, reward_rule

    ok = [r for r in runs if r.ok]
    values, rewards = [r.quality["raw"] for r in ok], [r.quality["reward"] for r in ok]
    identical = len(set(values)) <= 1 and len(set(rewards)) <= 1
    first = ok[0].quality if ok else {}
    note = None if identical else (
        f"raw quality differs across runs ({min(values)!r} .. {max(values)!r}): the outputs are not "
        "deterministic" + ("; aggregate is the median" if valid else ""))
    block = {
        "metric": "raw", "label": label, "definition": workload.quality_metric, "gate": workload.gate,
        "values": values, "rewards": rewards, "reward_mapping": reward_formula(), "reward_rule": reward_rule(),
        "identical_across_runs": identical if values else None, "note": note,
        "sources": first.get("sources"), "raw_note": first.get("raw_note"),
        "missing": first.get("missing"), "unlabeled": first.get("unlabeled"),
        "gate_passed": bool(ok) and valid,
        "shown_as_quality": promoted,
    }
    if valid:
        block["aggregate"] = statistics.median(values) if values else None
    return block


def rebuild_command(meta: dict) -> str:
    """The command that rebuilds the index, from its meta.json (the corpus path it records)."""
    corpus = meta.get("corpus") or "CORPUS"
    return f"scripts/build.sh --corpus {shlex.quote(str(corpus))} --index-dir INDEX"


def describe(meta: dict, digests: dict, first_timing: dict, runner: list[str], scheduling: dict) -> dict:
    """The model, device, configuration and scheduling blocks of the disclosure, from the index's meta.json."""
    model = meta.get("model") or {}
    t = first_timing or {}
    return {
        "model": {"name": model.get("arch"), "layout": model.get("layout"), "model_digest": model.get("digest"),
                  "clip_sha256": digests.get("clip"), "index_meta_sha256": digests.get("index_meta"),
                  "index_tree_sha256": digests.get("index_tree"), "gallery_images": meta.get("count"),
                  "embed_dim": meta.get("dim"), "build_command": rebuild_command(meta) if meta else None},
        "device": {"index_built_on": meta.get("device"), "executed": t.get("device"),
                   "backend": t.get("backend")},
        "configuration": {"precision": t.get("precision"), "method": t.get("method") or meta.get("method"),
                          "index_decoder": meta.get("decoder"), "index_precision": meta.get("precision"),
                          "runner": runner},
        "scheduling": {**scheduling, "source": "the environment the runs inherit, read through engine.settings"},
    }


WORKLOAD = Workload(
    workload_id="cir-retrieval",
    roles=("score-bearing", "performance-bearing"),
    abi="scripts/run.sh --index-dir INDEX --queries QUERIES.jsonl --output OUT.jsonl --report REPORT.json "
        "(retrieval ABI; INDEX built beforehand by scripts/build.sh --corpus DIR --index-dir INDEX)",
    gate="run validity: exit status 0; one row per request, in request order; each row at most 50 "
         "distinct image ids, all in the index, the request's reference image excluded; scores finite "
         "and non-increasing",
    quality_metric="raw quality of evaluator.cir.score (equal-weight mean of CIRCO mAP@5/10/25/50 "
                   "and CIRR Recall@1/5/10/50) and its reward mapping, scored against the labels per run",
    rule="retrieval ABI. The gallery index is built once before the runs (scripts/build.sh: untimed "
         "preparation, part of no metric). One run = one fresh scripts/run.sh process answering every "
         "request into a fresh output file (never resumed from an earlier run's output), timed from "
         "process start to reaped exit outside the process; every run must pass the gate. min profile "
         "(generated corpus, tiny random CLIP): functional only, its wall times and its quality numbers "
         "are a functional check, never results. max/pro profiles (a real "
         "index, its requests, labels and CLIP): score-bearing and performance-bearing, the raw quality "
         "and the wall time are results only from a promoted campaign.",
    entry="scripts/run.sh",
    real_inputs=("index_dir", "queries", "labels", "clip_dir"),
)


def prepare(a: RunArgs, tmp: Path) -> Prepared:
    """The campaign's inputs (min: a generated corpus, index and CLIP in tmp), and how to digest, copy and run them."""
    inputs, dataset = resolve_inputs(a, tmp)
    meta = index_meta(inputs)
    return Prepared(inputs, dataset, inputs.judge, meta, input_digests, input_copies(inputs), run_once,
                    bundle=(inputs.index_dir, "inputs/index", rebuild_command(meta)))


def aggregate_reasons(ok: list[RunRecord]) -> list[str]:
    """The gate is per run only (each output's validity): nothing to add over the runs."""
    return []


def requested_device(artifact_manifest: dict) -> str | None:
    """None: an index only records where it was built, not where queries must run."""
    return None


def disclosure_parts(f, promoted: bool, label: str, valid: bool) -> dict:
    """quality, model, device, configuration, scheduling and runs of a cir-retrieval disclosure."""
    ok = [r for r in f.runs if r.ok]
    first = (ok[0].timing if ok else None) or {}
    return {"quality": quality_block(f.workload, f.runs, promoted, label, valid),
            **describe(f.artifact_manifest, f.digests_before, first, f.runner, f.scheduling),
            "runs": [run_entry(r, label) for r in ok]}
