"""The harness of scripts/device_check.py: the result document and its deadlines, the children
and their logs, and the ABI run judged against the reference.

`Check` holds DIR/device_check.json (rewritten after every step) and DIR/results.jsonl (a line
per result as it lands; both written whole and fsynced), runs each step against its
own timeout (its share of the limit, at most the time left), starts children in their own
process groups with output into a private work folder (the tail of each goes into
DIR/device_check.log) and, at the end or on SIGTERM/SIGINT, stops them, marks what was cut,
lists the plan's steps that never started and removes the work folder.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from device_probes import not_exercised, scored_setup  # noqa: E402 - scripts/ is this file's folder

from engine.io import write_atomic  # noqa: E402 - after the path setup
from evaluator.contest.task import COHORT_IMAGES  # noqa: E402

RESULTS = "results.jsonl"    # one line per result as it lands (DIR/device_check.json holds them all too)
LOG_TAIL = 200_000          # bytes of each step's output kept in DIR/device_check.log
LOG_MAX = 12 << 20          # the combined log stays under the 16 MiB a returned file may have


class Interrupted(BaseException):
    """SIGTERM or SIGINT: save what is known, clean up, exit (not an Exception: no step catches it)."""


def on_signal(signum, frame) -> None:
    raise Interrupted(signal.Signals(signum).name)


class Check:
    """The result document, saved after every step; steps run against one deadline; children
    write into a private work folder, and the tail of each one's output goes into one log."""

    def __init__(self, out: Path, limit_s: float, plan: tuple[tuple[str, float, str], ...]):
        self.out, self.t0, self.limit_s = out, time.perf_counter(), limit_s
        self.plan = plan                                 # (name, share of limit_s, what it tells), in order
        self.doc: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "status": "running", "limit_s": limit_s,
                          "steps": {}, "alarms": []}
        self.work: Path | None = None
        self.procs: dict[str, subprocess.Popen] = {}     # children still running, by log name
        self.until = self.t0 + limit_s                   # the deadline of the step under way
        self.landed: list[str] = []                      # DIR/results.jsonl's lines, in landing order
        self.lacks: dict[str, list[str]] = {}            # step -> what of torch it calls this torch lacks

    def left(self) -> float:
        return self.limit_s - (time.perf_counter() - self.t0)

    def budget(self) -> float:
        """Seconds left to the step under way: its own timeout, at most the time left."""
        return min(self.until - time.perf_counter(), self.left())

    def elapsed(self) -> float:
        return round(time.perf_counter() - self.t0, 1)

    def save(self) -> None:
        self.doc["elapsed_s"] = self.elapsed()
        write_atomic(self.out / "device_check.json", (json.dumps(self.doc, indent=1) + "\n").encode())

    def land(self, name: str, res: dict, started_s: float | None = None) -> None:
        """One result as it lands: a line of DIR/results.jsonl (the file rewritten whole and
        fsynced, so a check killed at any point leaves whole lines of every result it reached)."""
        self.landed.append(json.dumps({"step": name, "started_s": started_s, "landed_s": self.elapsed(), **res},
                                      default=str) + "\n")
        write_atomic(self.out / RESULTS, [line.encode() for line in self.landed])

    def lacks_note(self, name: str) -> str:
        torch = (self.doc["steps"].get("env") or {}).get("torch", "this torch")
        return f"torch {torch} lacks {', '.join(self.lacks[name])}"

    def record(self, name: str, res: dict) -> None:
        """A step's result set without running it (skipped, or filled in later): saved and landed."""
        self.doc["steps"][name] = res
        self.save()
        self.land(name, res)

    def make_work(self) -> Path:
        self.work = Path(tempfile.mkdtemp(prefix="device_check_"))    # under $TMPDIR, never under DIR
        (self.work / "logs").mkdir()
        (self.work / "tmp").mkdir()
        self.doc["work_dir"] = str(self.work)
        return self.work

    def step(self, name: str, fn, need_s: float = 0.0) -> dict | None:
        """Run fn() -> dict as step `name` unless fewer than need_s seconds are left; record it either way.
        Its timeout (what `budget()` says inside fn) is its plan share of the limit, at most the time left."""
        if self.left() < need_s:
            self.record(name, {"skipped": f"{self.left():.0f} s left, the step needs ~{need_s:.0f} s"})
            return None
        if self.lacks.get(name):
            self.record(name, {"skipped": self.lacks_note(name)})
            print(f"device_check: {name}: skipped: {self.lacks_note(name)}", file=sys.stderr, flush=True)
            return None
        share = next(sh for n, sh, _ in self.plan if n == name)
        timeout = min(share * self.limit_s, self.left())
        self.until = time.perf_counter() + timeout
        started = self.elapsed()
        self.doc["steps"][name] = {"running": f"since {started} s", "timeout_s": round(timeout, 1)}
        self.save()
        t = time.perf_counter()
        try:
            res = fn() or {}
        except Exception as e:  # noqa: BLE001 - a failed step is recorded, the next one still runs
            res = {"error": f"{type(e).__name__}: {e}"[:600]}
            if self.budget() < 1:
                res["timed_out"] = f"at its {timeout:.0f} s timeout"
        res["seconds"], res["timeout_s"] = round(time.perf_counter() - t, 2), round(timeout, 1)
        self.doc["steps"][name] = res
        self.save()
        self.land(name, res, started)
        print(f"device_check: {name}: {json.dumps(res)[:300]}", file=sys.stderr, flush=True)
        return res

    def start(self, name: str, cmd: list[str], env: dict | None = None) -> subprocess.Popen:
        """cmd in its own process group, stdout and stderr into work/logs/NAME.{out,err}; children get
        TMPDIR inside the work folder, so whatever they leave there goes with it (compile caches stay
        where the environment puts them: scripts/device_check.sh sets them as scripts/run does)."""
        assert self.work is not None
        logs = self.work / "logs"
        full = {**os.environ, "TMPDIR": str(self.work / "tmp"), **(env or {})}
        with open(logs / f"{name}.out", "wb") as o, open(logs / f"{name}.err", "wb") as e:
            p = subprocess.Popen(cmd, cwd=REPO, env=full, stdout=o, stderr=e, process_group=0)
        self.procs[name] = p
        return p

    def finish(self, name: str, p: subprocess.Popen, rc: int | None) -> subprocess.CompletedProcess:
        """The ended child's output, its tail appended to DIR/device_check.log."""
        self.procs.pop(name, None)
        assert self.work is not None
        out, err = ((self.work / "logs" / f"{name}.{s}").read_text(errors="replace") for s in ("out", "err"))
        self.append_log(name, f"exit {rc}", out + err)
        return subprocess.CompletedProcess(p.args, rc if rc is not None else -1, out, err)

    def background(self, name: str, cmd: list[str], env: dict | None = None, **info) -> subprocess.Popen:
        """start() as step `name`, recorded as running in the background until waited for."""
        p = self.start(name, cmd, env)
        self.doc["steps"][name] = {"running": f"in the background since {self.elapsed()} s", **info}
        self.save()
        return p

    def run(self, name: str, cmd: list[str], timeout: float | None = None,
            env: dict | None = None) -> subprocess.CompletedProcess:
        """start() and wait, at most `timeout` and the step's budget; then the child is stopped
        and the exit status reads 124."""
        p = self.start(name, cmd, env)
        timeout = self.budget() if timeout is None else min(timeout, self.budget())
        try:
            rc = p.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            stop(p)
            rc = 124
        return self.finish(name, p, rc)

    def probe(self, name: str, args: list[str], timeout: float, env: dict | None = None) -> dict:
        """One of scripts/device_probes.py's probes in its own process: its JSON line."""
        r = self.run(name, [sys.executable, str(REPO / "scripts" / "device_probes.py"), *args], timeout, env)
        if r.returncode != 0:
            raise RuntimeError(f"probe failed ({r.returncode}): {last_error(r.stderr)}")
        return json.loads(r.stdout.strip().splitlines()[-1])

    def append_log(self, name: str, header: str, text: str) -> None:
        log = self.out / "device_check.log"
        if log.is_file() and log.stat().st_size > LOG_MAX:
            return
        data = text.encode(errors="replace")
        cut = f"[... {len(data) - LOG_TAIL} bytes cut ...]\n".encode() if len(data) > LOG_TAIL else b""
        with open(log, "ab") as f:
            f.write(f"==== {name} ({header}, at {self.elapsed()} s) ====\n".encode() + cut + data[-LOG_TAIL:] + b"\n")

    def teardown(self, stopped: str | None) -> None:
        """Stop the children, mark unfinished steps, list what was not exercised, save, remove the work folder."""
        for name, p in list(self.procs.items()):
            stop(p)
            self.finish(name, p, p.returncode)
        for name, s in self.doc["steps"].items():
            if "running" in s:
                why = stopped or "stopped as the check ended"
                self.doc["steps"][name] = {"interrupted": f"{why} at {self.elapsed()} s", "was": s["running"]}
                self.land(name, self.doc["steps"][name])
        self.doc["cut_by_deadline"] = [n for n, s in self.doc["steps"].items() if "s left, " in s.get("skipped", "")]
        self.doc["not_run"] = [n for n, _, _ in self.plan if n not in self.doc["steps"]]
        try:
            self.doc["not_exercised"] = not_exercised(self.doc, scored_setup(REPO))
        except Exception as e:  # noqa: BLE001 - the rest of the document still gets saved
            self.doc["not_exercised"] = [f"unknown ({type(e).__name__}: {e})"]
        self.doc["status"] = f"stopped ({stopped})" if stopped else "alarm" if self.doc["alarms"] else \
            "incomplete" if self.doc["not_run"] else "done"
        self.save()
        if self.work is not None:
            shutil.rmtree(self.work, ignore_errors=True)
            self.doc["work_dir_removed"] = not self.work.exists()
            self.save()


def last_error(stderr: str, limit: int = 300) -> str:
    """The line a failed child ended on (a traceback's exception line, a CLI's `prog: error: ...`),
    not the traceback above it: what a step's one-line error says."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip() and not set(ln.strip()) <= set("^~ ")]
    return (lines[-1] if lines else "no output on stderr")[:limit]


def stop(p: subprocess.Popen, grace_s: float = 5.0) -> None:
    """SIGTERM to p's process group (compile workers too), SIGKILL after grace_s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if p.poll() is not None:
            return
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass


def agree(got, ref) -> dict:
    """Agreement of predictions `got` with the reference's answers `ref` on its rows."""
    from evaluator.contest.agreement import agreement

    ag = agreement(got[:len(ref)], ref)
    return {"agreement": f"{ag.matches}/{ag.total}", "agreement_rate": round(ag.matches / max(ag.total, 1), 5)}


def judge(c: Check, name: str, art: Path, cohort: Path, ref, count: int, env_extra=None):
    """Run the ABI on the cohort with `art`: (the run's figures, with its agreement on the reference
    rows when `ref` is given, and its predictions)."""
    import numpy as np

    assert c.work is not None
    pred, report = c.work / f"pred_{name}.i32", c.work / f"timing_{name}.json"
    env = {"ENGINE_ARTIFACT": str(art), "CONTEST_REPORT": str(report), **(env_extra or {})}
    t = time.perf_counter()
    r = c.run(f"run_{name}", [str(REPO / "scripts" / "run"), str(cohort / "manifest.tsv"), str(cohort), str(pred)],
              env=env)
    wall = time.perf_counter() - t
    if r.returncode != 0:
        raise RuntimeError(f"scripts/run failed ({r.returncode}): {last_error(r.stderr, 400)}")
    timing = json.loads(report.read_text())
    got = np.fromfile(pred, "<i4")
    rt, stages = timing.get("runtime") or {}, timing.get("stages") or {}
    pipeline = stages.get("pipeline") or 1e-9
    steady = timing.get("images", count) / pipeline
    res = {"wall_s": round(wall, 3), "images_per_s_end_to_end": round(count / wall, 1),
           "images_per_s_steady": round(steady, 1), **(agree(got, ref) if ref is not None else {}),
           "decoder": timing.get("decoder"),
           "decoder_notes": [ln[:200] for ln in r.stderr.splitlines() if "[engine] decoder" in ln][:4],
           "cuda_graph": rt.get("cuda_graph"), "gpu_busy_s": rt.get("gpu_busy_s"), "guard": rt.get("guard"),
           "stages": stages, "first_batch_s": timing.get("first_batch_s"),
           "projected_10k_s": round((stages.get("total") or 0) - pipeline + COHORT_IMAGES / steady, 1)}
    if str(res["cuda_graph"]).startswith("failed"):
        c.doc["alarms"].append(f"{name}: CUDA graph capture failed: {res['cuda_graph']}")
    return res, got


def side_by_side(c: Check, name: str, guarded: dict, raw: dict) -> dict:
    """The guard's figures beside the raw run's: does it pay for itself on this device?"""
    g = guarded.get("guard") if isinstance(guarded.get("guard"), dict) else {}
    if raw["agreement_rate"] > guarded["agreement_rate"]:
        c.doc["alarms"].append(f"{name}: the guard lowered agreement ({raw['agreement']} raw, "
                               f"{guarded['agreement']} guarded)")
    return {"raw_agreement": raw["agreement"], "guarded_agreement": guarded["agreement"],
            "raw_agreement_rate": raw["agreement_rate"], "guarded_agreement_rate": guarded["agreement_rate"],
            "rechecked_fraction": g.get("fraction"), "recheck_seconds": g.get("seconds"),
            "recheck_calls": g.get("calls"), "recheck_batch": g.get("recheck_batch"), "changed": g.get("changed"),
            "tau": g.get("tau"), "raw_wall_s": raw["wall_s"], "guarded_wall_s": guarded["wall_s"],
            "raw_images_per_s_steady": raw["images_per_s_steady"],
            "guarded_images_per_s_steady": guarded["images_per_s_steady"]}


def build_cmd(model_args: list[str], out: Path, device: str, backend: str, precision: str, batch: int,
              *extra: str) -> list[str]:
    return [sys.executable, "-m", "engine.build", *model_args, "--out", str(out), "--device", device,
            "--backend", backend, "--precision", precision, "--batch-size", str(batch), *extra]
