"""Evidence campaign: N fresh timed processes of a workload, judged by MLPerf-EDU-style rules.

    python -m evaluator.campaign run --workload eva02-imagenet1k --profile min|max|pro --runs 5 --out DIR
    python -m evaluator.campaign run --workload cir-retrieval --profile min|max|pro --runs 5 --out DIR
    python -m evaluator.campaign verify DIR/campaign.provd.json
    python -m evaluator.campaign package DIR --out FILE.tar.gz
    python -m evaluator.campaign render DIR/disclosure.json

`run` writes DIR/disclosure.json (authoritative), DIR/report.html (rendered from it),
copies of every input it can name, the artifact's (or index's) files or their digests,
each run's outputs, and DIR/campaign.provd.json. An attempt stopped by SIGINT or SIGTERM,
or by a crash of the campaign itself, still writes all of them, marked invalid, with the
reason and the runs completed so far.
Exit status of `run`: 0 when the attempt is valid (every run passed its gate), 1 when
it was invalidated or crashed (or not promoted under --require-promotion), 2 on a usage
error, 128 + the signal number when a signal stopped it.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from engine.io import folder_refusal, sha256_file
from evaluator.evidence import conditions, disclosure, fingerprint, report_html, sha256_manifest
from evaluator.evidence.runs import (
    MIN_COUNT,
    PROFILES,
    REPO_ROOT,
    Interrupted,
    Prepared,
    RunArgs,
    RunRecord,
    UsageError,
    default_runner,
)
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


def scheduling_environment() -> dict:
    """Scheduling settings the runs inherit from this environment (read through engine.settings),
    and the thread budget: the CPUs this process may use and the OpenMP thread count."""
    from engine import settings

    out = {}
    for name, read in (("decoder", settings.decoder), ("pipeline_depth", settings.pipeline_depth),
                       ("reader_threads", settings.readers), ("cuda_graphs", settings.cuda_graphs)):
        try:
            out[name] = read()
        except ValueError as exc:  # engine.settings.SettingsError: the runs refuse it too
            out[name] = f"invalid: {exc}"
    out["decoder"] = out["decoder"] or "the artifact's default"
    out["thread_budget"] = {"usable_cores": conditions.usable_cores(),
                            "OMP_NUM_THREADS": fingerprint.perf_env().get("OMP_NUM_THREADS", "unset")}
    return out


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
    if a.bundle_limit_mb < 0:
        raise UsageError("--bundle-limit-mb must be >= 0")
    why = folder_refusal(a.out, "the evidence folder", lambda d: False)   # only a new or empty folder: written once
    if why:
        raise UsageError(why)
    if a.runner is None and not (a.source_dir / workload.entry).is_file():
        raise UsageError(f"{a.source_dir / workload.entry}: missing (the contest ABI entry point)")
    for path in a.attach:
        summarise_benchmark(path)  # refuse a bad attachment before spending time on runs


def copy_evidence(copies: dict[str, tuple[Path, str]], attach: tuple[Path, ...],
                  out: Path) -> tuple[dict, list[dict], dict]:
    """Copy the inputs and attachments into OUT; return (input files, attachment records, provd roles)."""
    (out / "inputs").mkdir(exist_ok=True)
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


@dataclass
class Attempt:
    """What one attempt has observed so far: filled in as it goes, recorded however it ends."""

    args: RunArgs
    out: Path
    runner: list[str]
    runner_is_abi: bool
    prep: Prepared | None = None  # once the inputs are ready
    runs: list[RunRecord] = field(default_factory=list)
    started: str = ""
    git_before: dict = field(default_factory=dict)
    fp_before: dict | None = None
    digests_before: dict = field(default_factory=dict)
    conditions_before: dict = field(default_factory=dict)
    scheduling: dict = field(default_factory=dict)
    interrupted: str | None = None  # why it stopped early
    signal: int | None = None  # the signal that stopped it, if one did


@contextlib.contextmanager
def _signals(handler):
    """SIGINT and SIGTERM handled by `handler` (a function or SIG_IGN) inside the block (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def _raise_interrupted(signum, frame):
    raise Interrupted(signum)  # a BaseException: unwinds the run (its process group is killed) to the record


def _stop_reason(exc: BaseException) -> tuple[str, int | None]:
    """(why the attempt stopped, the signal number or None) for what stopped it."""
    if isinstance(exc, Interrupted):
        return f"stopped by {signal.Signals(exc.args[0]).name}", int(exc.args[0])
    if isinstance(exc, KeyboardInterrupt):
        return "stopped by SIGINT (Ctrl-C)", int(signal.SIGINT)
    where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    at = f" (at {Path(where.filename).name}:{where.lineno})" if where else ""
    return f"the campaign crashed: {type(exc).__name__}: {exc}{at}", None


def _run_attempt(att: Attempt, tmp: Path) -> None:
    """Prepare the inputs and run the processes, filling att as it goes (raises when stopped)."""
    a = att.args
    print(f"campaign: preparing the {a.workload} inputs ({a.profile} profile; generated inputs take a minute or more)",
          file=sys.stderr, flush=True)
    att.prep = MODULES[a.workload].prepare(a, tmp)
    att.out.mkdir(parents=True, exist_ok=True)  # only once the inputs exist
    att.started, att.git_before = _now(), git_state(a.source_dir, att.out)
    att.conditions_before, att.scheduling = conditions.snapshot(), scheduling_environment()
    att.fp_before, att.digests_before = fingerprint.collect(), att.prep.digests(att.prep.inputs)
    for i in range(1, a.runs + 1):
        print(f"campaign: run {i}/{a.runs}: started (one fresh process, timed from outside)", file=sys.stderr, flush=True)
        record = att.prep.run(i, att.runner, att.prep.inputs, att.prep.judge, att.out, a.source_dir, a.timeout_s)
        att.runs.append(record)
        judged = (f"raw {record.quality['raw']:.4f}" if record.quality else
                  f"{record.matches}/{record.total}" if record.total is not None else "not judged")
        status = f"{record.wall_s:.2f} s, {judged}" if record.ok else record.reason
        print(f"campaign: run {i}/{a.runs}: {'ok' if record.ok else 'FAILED'} ({status})", file=sys.stderr)
        if not record.ok:
            break  # one failed process invalidates the attempt; runs are never retried


def _bundle(att: Attempt) -> tuple[dict | None, list[dict], dict]:
    """Bundle the artifact / index into OUT, or list its digests: (record, external entries, provd roles)."""
    if att.prep is None or att.prep.bundle is None or not att.prep.bundle[0].is_dir():
        return None, [], {}
    src, rel, rebuild = att.prep.bundle
    record = sha256_manifest.bundle(src, att.out, rel, att.args.bundle_limit_mb * 2**20, rebuild)
    external = record.pop("external")
    roles = {f"{rel}/{p}": "bundled" for p in sha256_manifest.list_files(att.out / rel)} if record["bundled"] else {}
    return record, external, roles


def _record(att: Attempt) -> dict:
    """Take the after-state, copy the evidence, and write disclosure, report and manifest."""
    a, prep, out = att.args, att.prep, att.out
    out.mkdir(parents=True, exist_ok=True)
    digests_after = {}
    if prep is not None:
        try:
            digests_after = prep.digests(prep.inputs)
        except (OSError, ValueError) as exc:  # a stopped attempt may have lost its inputs
            print(f"campaign: digests after the runs not taken: {exc}", file=sys.stderr)
    fp_after = None if att.interrupted else fingerprint.collect()
    git_after, conditions_after = git_state(a.source_dir, out), conditions.snapshot()
    files, attachments, roles = copy_evidence(prep.copies if prep else {}, a.attach, out)
    bundle, external, bundled_roles = _bundle(att)
    roles |= bundled_roles
    for r in att.runs:
        roles |= {rel: role for role, rel in r.files.items()}
    facts = disclosure.CampaignFacts(
        workload=WORKLOADS[a.workload], profile=PROFILES[a.profile], runs_requested=a.runs, runs=att.runs,
        dataset=(prep.dataset if prep else {}) | {"files": files}, digests_before=att.digests_before,
        digests_after=digests_after, artifact_manifest=prep.artifact_manifest if prep else {},
        fingerprint_before=att.fp_before, fingerprint_after=fp_after, git_before=att.git_before or git_after,
        git_after=git_after, runner=att.runner, runner_is_abi=att.runner_is_abi, timeout_s=a.timeout_s,
        conditions_before=att.conditions_before or conditions_after, conditions_after=conditions_after,
        started_utc=att.started or _now(), finished_utc=_now(), config_note=a.config_note,
        attachments=attachments, interrupted=att.interrupted, scheduling=att.scheduling or scheduling_environment(),
        operator_power=a.power, evidence={"sha256": sha256_manifest.evidence_digest(out), "covers": sha256_manifest.EVIDENCE_COVERS},
        bundle=bundle,
    )
    doc = disclosure.build(facts)
    disclosure.write(doc, out / "disclosure.json")
    (out / "report.html").write_text(report_html.render(doc))
    roles |= {"disclosure.json": "disclosure", "report.html": "report"}
    sha256_manifest.write_manifest(out, att.git_before or git_after, roles, external=external)
    return doc


def run_campaign(a: RunArgs) -> tuple[dict, int | None]:
    """Run the campaign, write OUT; return (the disclosure dict, the signal that stopped it or None).

    A usage error raises UsageError before anything is written; any other stop (SIGINT,
    SIGTERM, a crash of the campaign) is recorded as an invalid attempt."""
    check_args(a)
    workload = WORKLOADS[a.workload]
    a.source_dir = a.source_dir.resolve()
    abi = default_runner(a.source_dir, workload.entry)
    runner = shlex.split(a.runner) if a.runner else abi
    att = Attempt(a, a.out.resolve(), runner, runner == abi)
    with tempfile.TemporaryDirectory(prefix="campaign-") as tmp:
        try:
            with _signals(_raise_interrupted):
                _run_attempt(att, Path(tmp))
        except UsageError:
            raise
        except BaseException as exc:  # noqa: B036 - a signal or a crash: the attempt is recorded, then reported
            att.interrupted, att.signal = _stop_reason(exc)
            print(f"campaign: attempt stopped: {att.interrupted}; recording it as invalid", file=sys.stderr)
        with _signals(signal.SIG_IGN):  # the record is written whole
            doc = _record(att)
    return doc, att.signal


def summary_line(doc: dict) -> str:
    """The CLI's result line: the median of a valid attempt; only the raw values of an invalid one."""
    promo, pm, att = doc["promotion"], doc["primary_metric"], doc["attempt"]
    head = f"campaign: {doc['workload']['id']} {doc['profile']}: {promo['status']}; "
    if att["valid"]:
        return head + f"median {pm['median']:.2f} s over {pm['n']} valid runs (exact figures: disclosure.json)"
    values = ", ".join(f"{v:.2f}" for v in pm["values"]) or "none"
    return head + f"attempt INVALID ({att['reason']}): no aggregate; wall s of the runs that completed: {values}"


def cmd_run(a: RunArgs) -> int:
    doc, signum = run_campaign(a)
    promo = doc["promotion"]
    print(summary_line(doc))
    for reason in promo["reasons"]:
        print(f"  - {reason}")
    print(f"campaign: wrote {a.out / 'disclosure.json'}, report.html, {sha256_manifest.MANIFEST_NAME} "
          f"(evidence sha256 {doc['evidence']['sha256']})")
    if signum is not None:
        return 128 + signum
    if not doc["attempt"]["valid"]:
        return 1
    return 1 if a.require_promotion and not promo["promoted"] else 0


def cmd_verify(path: Path, external: Path | None = None) -> int:
    if path.is_dir():                       # the evidence folder: its listing is inside
        if not (path / sha256_manifest.MANIFEST_NAME).is_file():
            print(f"verify: error: {path} holds no {sha256_manifest.MANIFEST_NAME}: pass an evidence folder written by "
                  "`campaign run`, or its campaign.provd.json", file=sys.stderr)
            return 2
        path = path / sha256_manifest.MANIFEST_NAME
    try:
        result = sha256_manifest.verify(path, external)
    except (OSError, ValueError) as exc:
        print(f"verify: error: {path}: {exc}", file=sys.stderr)
        return 2
    for problem in result.problems:
        print(f"verify: {problem}", file=sys.stderr)
    if not result.ok:
        print(f"verify: FAILED: {len(result.problems)} problem(s) in {path.parent}", file=sys.stderr)
        return 1
    extra = ""
    if result.external_checked:
        extra += f"; {result.external_checked} external files match under {external}"
    if result.external_unchecked:
        extra += (f"; {result.external_unchecked} external files listed by digest only (not bundled: "
                  "re-check them with --external DIR)")
    print(f"verify: OK: {result.checked} files match their SHA-256 digests ({sha256_manifest.INTEGRITY}); "
          f"evidence sha256 {result.evidence_sha256}{extra}")
    return 0


def cmd_package(folder: Path, out: Path) -> int:
    manifest = folder / sha256_manifest.MANIFEST_NAME
    if not manifest.is_file():
        print(f"package: {manifest}: missing", file=sys.stderr)
        return 1
    if cmd_verify(manifest) != 0:
        print("package: refusing to pack a folder that does not verify", file=sys.stderr)
        return 1
    print(f"package: wrote {sha256_manifest.package(folder, out)}")
    return 0


def cmd_render(path: Path, out: Path | None) -> int:
    doc = json.loads(path.read_text())
    target = out or path.parent / "report.html"
    html = report_html.render(doc)
    manifested = (target.parent / sha256_manifest.MANIFEST_NAME).is_file() and target.is_file()
    if manifested and target.read_text() != html:
        print(f"render: warning: {target} differs from the digested one; {target.parent} will no longer "
              "verify (use --out to render elsewhere)", file=sys.stderr)
    target.write_text(html)
    print(f"render: wrote {target}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from engine.cli import (
        MAX_DEADLINE_S,
        SEED,
        ArgumentParser,
        HelpFormatter,
        debug_flag,
        finite_float,
        whole_number,
    )

    p = ArgumentParser(prog="python -m evaluator.campaign", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run a campaign and write its evidence folder", formatter_class=HelpFormatter)
    r.add_argument("--workload", required=True, choices=sorted(WORKLOADS),
                   help="what runs: the contest ABI (eva02-imagenet1k) or the retrieval ABI (cir-retrieval)")
    r.add_argument("--profile", required=True, choices=sorted(PROFILES),
                   help="min: generated input, functional only; max: real data, canonical; pro: real data under a "
                        "declared research configuration (--config-note)")
    r.add_argument("--runs", type=whole_number(1, 1000), default=5, help="fresh timed processes (five for a promotable result)")
    r.add_argument("--out", type=Path, required=True, help="the evidence folder to write (new or empty)")
    r.add_argument("--manifest", type=Path, help="max/pro (required): cohort manifest.tsv")
    r.add_argument("--image-root", type=Path, help="max/pro (required): root the manifest paths are relative to")
    r.add_argument("--reference", type=Path, help="max/pro (required): reference answers (.i32 or .tsv)")
    r.add_argument("--artifact", type=Path, help="max/pro (required): prebuilt engine artifact dir")
    r.add_argument("--index-dir", type=Path, help="cir max/pro (required): gallery index built by scripts/build.sh")
    r.add_argument("--queries", type=Path, help="cir max/pro (required): requests JSONL")
    r.add_argument("--labels", type=Path, action="append", default=[],
                   help="cir max/pro (required): labels (JSONL or CIRCO/CIRR annotation JSON; repeatable)")
    r.add_argument("--clip-dir", type=Path, help="cir max/pro: the CLIP the index was built with (default: env "
                                                 "CLIP_MODEL_DIR, else the one the index records)")
    r.add_argument("--config-note", help="pro (required): the research configuration, declared")
    r.add_argument("--dataset-split", "--split", dest="dataset_split",
                   help="max/pro (required): the dataset split the inputs are, as you declare it")
    r.add_argument("--dataset-version", help="max/pro (required): the dataset version / release, declared")
    r.add_argument("--power", help="power source and policy, stated by the operator (recorded beside what Linux "
                                   "exposes; the only power record where it exposes nothing; default: none stated)")
    r.add_argument("--bundle-limit-mb", type=finite_float(0.0, 1e7, "MB"), default=RunArgs.bundle_limit_mb,
                   help="bundle the artifact's (index's) files up to this size; above it, keep their digests "
                        "and the command that rebuilds them")
    r.add_argument("--count", type=whole_number(1, 10**7, "images"), default=None,
                   help=f"min: generated images (cir: gallery, rounded up to groups of {cir.PER_TEMPLATE}); default: "
                        f"eva02 reuses the prepared demo (./demo or SOURCE_DIR/demo, as `python -m evaluator.demo` "
                        f"leaves it) when one of --seed is there, else {MIN_COUNT} generated")
    r.add_argument("--requests", type=whole_number(1, 10**6), default=RunArgs.requests,
                   help="cir min: generated requests")
    r.add_argument("--seed", type=SEED, default=RunArgs.seed, help="min: generator seed (0 is canonical)")
    r.add_argument("--prepared", type=Path, help="eva02 min: reuse a dir written by `python -m evaluator.demo` or "
                                                 "`python -m evaluator.demo prepare` (default: the prepared demo, "
                                                 "else one prepared in a temporary folder)")
    r.add_argument("--timeout-s", type=finite_float(0.0, MAX_DEADLINE_S, "s", lo_open=True), default=RunArgs.timeout_s,
                   help="per-run wall limit")
    r.add_argument("--runner", help="command replacing the workload's ABI entry point (shell words; not promotable; "
                                    "default: the source tree's scripts/run or scripts/run.sh)")
    r.add_argument("--source-dir", type=Path, default=REPO_ROOT, help="git tree the runs come from")
    r.add_argument("--attach", type=Path, action="append", default=[],
                   help="pytest-benchmark JSON to bundle (repeatable; default: none)")
    r.add_argument("--require-promotion", action="store_true", help="exit 1 unless promoted")
    v = sub.add_parser("verify", help="check every file of an evidence folder against its .provd.json",
                       formatter_class=HelpFormatter)
    v.add_argument("manifest", type=Path, help="the evidence folder, or its campaign.provd.json")
    v.add_argument("--external", type=Path, help="a copy of the unbundled artifact / index: re-check its digests "
                                                 "(default: those files are listed by digest only)")
    k = sub.add_parser("package", help="verify, then pack an evidence folder as tar.gz",
                       formatter_class=HelpFormatter)
    k.add_argument("folder", type=Path, help="the evidence folder `campaign run` wrote")
    k.add_argument("--out", type=Path, required=True, help="the .tar.gz to write")
    d = sub.add_parser("render", help="re-render report.html from a disclosure JSON",
                       formatter_class=HelpFormatter)
    d.add_argument("disclosure", type=Path, help="a disclosure.json `campaign run` wrote")
    d.add_argument("--out", type=Path, help="the HTML to write (default: report.html beside the disclosure)")
    for sp in (r, v, k, d):
        debug_flag(sp)
    return p


def main(argv: list[str] | None = None) -> int:
    from engine.cli import debugging

    ns = build_parser().parse_args(argv)
    try:
        if ns.command == "verify":
            return cmd_verify(ns.manifest, ns.external)
        if ns.command == "package":
            return cmd_package(ns.folder, ns.out)
        if ns.command == "render":
            return cmd_render(ns.disclosure, ns.out)
        # absolute paths: the runs start in the source tree, not where the user typed them
        fields = {k: v.resolve() if isinstance(v, Path) else v for k, v in vars(ns).items()
                  if k not in ("command", "debug")}
        fields["attach"] = tuple(x.resolve() for x in fields["attach"])
        fields["labels"] = tuple(x.resolve() for x in fields["labels"])
        return cmd_run(RunArgs(**fields))
    except UsageError as exc:
        if debugging(ns.debug):
            raise
        print(f"campaign: error: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError, RuntimeError, json.JSONDecodeError) as exc:
        if debugging(ns.debug):
            raise
        print(f"campaign: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
