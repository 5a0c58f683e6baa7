"""Evidence campaign: N fresh timed processes of a workload, judged by MLPerf-EDU-style rules.

    python -m evaluator.campaign run --workload eva02-imagenet1k --profile min|max|pro --runs 5 --out DIR
    python -m evaluator.campaign run --workload cir-retrieval --profile min|max|pro --runs 5 --out DIR
    python -m evaluator.campaign verify DIR/campaign.provd.json
    python -m evaluator.campaign package DIR --out FILE.tar.gz
    python -m evaluator.campaign render DIR/disclosure.json

`run` writes DIR/disclosure.json (authoritative), DIR/report.html (rendered from it),
copies of every input it can name, each run's outputs, and DIR/campaign.provd.json.
Exit status of `run`: 0 when the attempt is valid (every run passed its gate), 1 when
it was invalidated (or not promoted under --require-promotion), 2 on a usage error.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from engine.io import sha256_file
from evaluator.evidence import disclosure, fingerprint, provd, report_html
from evaluator.evidence.runs import PROFILES, REPO_ROOT, RunArgs, UsageError, default_runner
from evaluator.evidence.workloads import MODULES, WORKLOADS, cir


def git_state(source_dir: Path, exclude: Path | None = None) -> dict:
    """{"sha", "dirty", "error"} of the git tree at source_dir; paths under exclude are ignored."""
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(source_dir), *args], capture_output=True, text=True, check=False)

    head = git("rev-parse", "--verify", "HEAD")
    if head.returncode != 0:
        return {"sha": None, "dirty": None, "error": head.stderr.strip() or "git rev-parse HEAD failed"}
    pathspec = ["--", "."]
    if exclude is not None and exclude.resolve().is_relative_to(source_dir.resolve()):
        pathspec.append(f":(exclude){exclude.resolve().relative_to(source_dir.resolve()).as_posix()}")
    status = git("status", "--porcelain", *pathspec)
    if status.returncode != 0:
        return {"sha": head.stdout.strip(), "dirty": None, "error": status.stderr.strip()}
    return {"sha": head.stdout.strip(), "dirty": bool(status.stdout.strip()), "error": None}


def summarise_benchmark(path: Path) -> dict:
    """Names and medians of a pytest-benchmark --benchmark-json file, and its commit info."""
    data = json.loads(path.read_text())
    benches = data.get("benchmarks")
    if not isinstance(benches, list):
        raise ValueError(f"{path}: no 'benchmarks' list (expected pytest-benchmark --benchmark-json output)")
    commit = data.get("commit_info") or {}
    return {
        "benchmarks": [{"name": b.get("fullname") or b.get("name"), "median_s": (b.get("stats") or {}).get("median")}
                       for b in benches],
        "commit": {"id": commit.get("id"), "dirty": commit.get("dirty")},
    }


def _loadavg() -> list[float] | None:
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def check_args(a: RunArgs) -> None:
    """Refuse a campaign that cannot start as asked, before anything is written."""
    workload = WORKLOADS.get(a.workload)
    if workload is None:
        raise UsageError(f"unknown workload {a.workload!r}; known: {', '.join(WORKLOADS)}")
    if not workload.runnable:
        raise UsageError(f"workload {a.workload} is {'/'.join(workload.roles)}: {workload.rule}")
    profile = PROFILES[a.profile]
    flag = lambda name: f"--{name.replace('_', '-')}"  # noqa: E731
    given = lambda name: getattr(a, name) not in (None, "", ())  # noqa: E731
    needed = (workload.real_inputs if profile.dataset_mode == "real" else ()) + profile.required
    missing = [flag(name) for name in needed if not given(name)]
    if missing:
        raise UsageError(f"profile {a.profile} requires {', '.join(missing)}")
    foreign = sorted({flag(name) for w in WORKLOADS.values() for name in w.real_inputs
                      if name not in workload.real_inputs and given(name)})
    if foreign:
        raise UsageError(f"{', '.join(foreign)}: not an input of workload {a.workload}")
    if a.runs < 1:
        raise UsageError("--runs must be >= 1")
    if a.out.exists() and any(a.out.iterdir()):
        raise UsageError(f"--out {a.out}: not empty (an evidence folder is written once)")
    if a.runner is None and not (a.source_dir / workload.entry).is_file():
        raise UsageError(f"{a.source_dir / workload.entry}: missing (the contest ABI entry point)")
    for path in a.attach:
        summarise_benchmark(path)  # refuse a bad attachment before spending time on runs


def copy_evidence(copies: dict[str, tuple[Path, str]], attach: tuple[Path, ...],
                  out: Path) -> tuple[dict, list[dict], dict]:
    """Copy the inputs and attachments into OUT; return (input files, attachment records, provd roles)."""
    (out / "inputs").mkdir()
    files, roles = {}, {}
    for name, (src, rel) in copies.items():
        if src.is_file():
            shutil.copyfile(src, out / rel)
            files[name] = rel
            roles[rel] = "input"
    records = []
    for i, src in enumerate(attach, 1):
        rel = f"attachments/{i:02d}-{src.name}"
        (out / "attachments").mkdir(exist_ok=True)
        shutil.copyfile(src, out / rel)
        roles[rel] = "attachment"
        records.append({"file": rel, "sha256": sha256_file(out / rel)} | summarise_benchmark(out / rel))
    return files, records, roles


def run_campaign(a: RunArgs) -> dict:
    """Run the campaign, write OUT, and return the disclosure dict."""
    check_args(a)
    workload = WORKLOADS[a.workload]
    a.source_dir = a.source_dir.resolve()
    out = a.out.resolve()
    abi = default_runner(a.source_dir, workload.entry)
    runner = shlex.split(a.runner) if a.runner else abi
    with tempfile.TemporaryDirectory(prefix="campaign-") as tmp:
        prep = MODULES[a.workload].prepare(a, Path(tmp))
        inputs, dataset, judge, artifact_manifest = prep.inputs, prep.dataset, prep.judge, prep.artifact_manifest
        digests, copies, run = prep.digests, prep.copies, prep.run
        out.mkdir(parents=True, exist_ok=True)  # only once the inputs exist
        started, git_before, load_before = _now(), git_state(a.source_dir, out), _loadavg()
        fp_before, digests_before = fingerprint.collect(), digests(inputs)
        runs = []
        for i in range(1, a.runs + 1):
            record = run(i, runner, inputs, judge, out, a.source_dir, a.timeout_s)
            runs.append(record)
            judged = f"raw {record.quality['raw']:.4f}" if record.quality else f"{record.matches}/{record.total}"
            status = f"{record.wall_s:.3f} s, {judged}" if record.ok else record.reason
            print(f"campaign: run {i}/{a.runs}: {'ok' if record.ok else 'FAILED'} ({status})", file=sys.stderr)
            if not record.ok:
                break  # one failed process invalidates the attempt; runs are never retried
        digests_after, fp_after = digests(inputs), fingerprint.collect()
        git_after, load_after = git_state(a.source_dir, out), _loadavg()
        files, attachments, roles = copy_evidence(copies, a.attach, out)
    facts = disclosure.CampaignFacts(
        workload=workload, profile=PROFILES[a.profile], runs_requested=a.runs, runs=runs,
        dataset=dataset | {"files": files}, digests_before=digests_before, digests_after=digests_after,
        artifact_manifest=artifact_manifest, fingerprint_before=fp_before, fingerprint_after=fp_after,
        git_before=git_before, git_after=git_after, runner=runner, runner_is_abi=runner == abi,
        timeout_s=a.timeout_s, load_before=load_before, load_after=load_after, started_utc=started,
        finished_utc=_now(), config_note=a.config_note, attachments=attachments,
    )
    doc = disclosure.build(facts)
    disclosure.write(doc, out / "disclosure.json")
    (out / "report.html").write_text(report_html.render(doc))
    for r in runs:
        roles |= {rel: role for role, rel in r.files.items()}
    roles |= {"disclosure.json": "disclosure", "report.html": "report"}
    provd.write_manifest(out, git_before, roles)
    return doc


def cmd_run(a: RunArgs) -> int:
    doc = run_campaign(a)
    promo = doc["promotion"]
    print(f"campaign: {doc['workload']['id']} {doc['profile']}: {promo['status']}; "
          f"median {doc['primary_metric']['median']} s over {doc['primary_metric']['n']} valid runs")
    for reason in promo["reasons"]:
        print(f"  - {reason}")
    print(f"campaign: wrote {a.out / 'disclosure.json'}, report.html, {provd.MANIFEST_NAME}")
    if not doc["attempt"]["valid"]:
        return 1
    return 1 if a.require_promotion and not promo["promoted"] else 0


def cmd_verify(path: Path) -> int:
    result = provd.verify(path)
    for problem in result.problems:
        print(f"verify: {problem}", file=sys.stderr)
    if not result.ok:
        print(f"verify: FAILED: {len(result.problems)} problem(s) in {path.parent}", file=sys.stderr)
        return 1
    print(f"verify: OK: {result.checked} files match their SHA-256 digests ({provd.INTEGRITY})")
    return 0


def cmd_package(folder: Path, out: Path) -> int:
    manifest = folder / provd.MANIFEST_NAME
    if not manifest.is_file():
        print(f"package: {manifest}: missing", file=sys.stderr)
        return 1
    if cmd_verify(manifest) != 0:
        print("package: refusing to pack a folder that does not verify", file=sys.stderr)
        return 1
    print(f"package: wrote {provd.package(folder, out)}")
    return 0


def cmd_render(path: Path, out: Path | None) -> int:
    doc = json.loads(path.read_text())
    target = out or path.parent / "report.html"
    html = report_html.render(doc)
    manifested = (target.parent / provd.MANIFEST_NAME).is_file() and target.is_file()
    if manifested and target.read_text() != html:
        print(f"render: warning: {target} differs from the digested one; {target.parent} will no longer "
              "verify (use --out to render elsewhere)", file=sys.stderr)
    target.write_text(html)
    print(f"render: wrote {target}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m evaluator.campaign", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run a campaign and write its evidence folder")
    r.add_argument("--workload", required=True, choices=sorted(WORKLOADS))
    r.add_argument("--profile", required=True, choices=sorted(PROFILES))
    r.add_argument("--runs", type=int, default=5)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--manifest", type=Path, help="max/pro: cohort manifest.tsv")
    r.add_argument("--image-root", type=Path, help="max/pro: root the manifest paths are relative to")
    r.add_argument("--reference", type=Path, help="max/pro: reference answers (.i32 or .tsv)")
    r.add_argument("--artifact", type=Path, help="max/pro: prebuilt engine artifact dir")
    r.add_argument("--index-dir", type=Path, help="cir max/pro: gallery index built by scripts/build.sh")
    r.add_argument("--queries", type=Path, help="cir max/pro: requests JSONL")
    r.add_argument("--labels", type=Path, action="append", default=[],
                   help="cir max/pro: labels (JSONL or CIRCO/CIRR annotation JSON; repeatable)")
    r.add_argument("--clip-dir", type=Path, help="cir max/pro: the CLIP the index was built with (CLIP_MODEL_DIR)")
    r.add_argument("--config-note", help="pro: the research configuration, declared")
    r.add_argument("--split", help="max/pro: dataset split label (eva02 default imagenet-1k-val)")
    r.add_argument("--count", type=int, default=64,
                   help=f"min: generated images (cir: gallery, rounded up to groups of {cir.PER_TEMPLATE})")
    r.add_argument("--requests", type=int, default=60, help="cir min: generated requests")
    r.add_argument("--seed", type=int, default=0, help="min: generator seed (0 is canonical)")
    r.add_argument("--prepared", type=Path, help="eva02 min: reuse a dir written by `evaluator.contest.demo prepare`")
    r.add_argument("--timeout-s", type=float, default=1800.0, help="per-run wall limit")
    r.add_argument("--runner", help="command replacing the workload's ABI entry point (shell words; not promotable)")
    r.add_argument("--source-dir", type=Path, default=REPO_ROOT, help="git tree the runs come from")
    r.add_argument("--attach", type=Path, action="append", default=[], help="pytest-benchmark JSON (repeatable)")
    r.add_argument("--require-promotion", action="store_true", help="exit 1 unless promoted")
    v = sub.add_parser("verify", help="check every file of an evidence folder against its .provd.json")
    v.add_argument("manifest", type=Path)
    k = sub.add_parser("package", help="verify, then pack an evidence folder as tar.gz")
    k.add_argument("folder", type=Path)
    k.add_argument("--out", type=Path, required=True)
    d = sub.add_parser("render", help="re-render report.html from a disclosure JSON")
    d.add_argument("disclosure", type=Path)
    d.add_argument("--out", type=Path)
    return p


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        if ns.command == "verify":
            return cmd_verify(ns.manifest)
        if ns.command == "package":
            return cmd_package(ns.folder, ns.out)
        if ns.command == "render":
            return cmd_render(ns.disclosure, ns.out)
        fields = {k: v for k, v in vars(ns).items() if k != "command"}
        fields["attach"], fields["labels"] = tuple(fields["attach"]), tuple(fields["labels"])
        return cmd_run(RunArgs(**fields))
    except UsageError as exc:
        print(f"campaign: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError, RuntimeError, json.JSONDecodeError) as exc:
        print(f"campaign: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
