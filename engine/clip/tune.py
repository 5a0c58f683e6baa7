"""The CLIP towers an index is built and queried with: measured and verified at index build.

Each tower (image, text) has its candidates: backend (engine.clip.compiled: eager, aot) x
precision (fp32, and the low precisions the device runs natively) x static batch (the
device's preset), and on the CPU eager int8 per batch (torchao dynamic INT8, engine.clip.int8;
CLIP_TOWERS_INT8=0: none). Each is built, run on a sample drawn from the gallery and checked against
the FP32 eager reference:

    cosine >= COS_MIN for every row, and
    identical top-k (k = TOP, at most the sample) for the held-out queries: the first
    `queries` sample images (image tower: candidate queries against the candidate gallery)
    and PROMPTS (text tower: candidate texts against the reference gallery);

then timed on one static batch (median of `rounds`). The fastest that holds is chosen,
per tower; when none holds, the eager FP32 reference is, said in one stderr line. The
table (every candidate: rate, cosine min, top-k equal, status) and the choice go to
meta.json `towers`; a chosen aot tower's files go to INDEX_DIR/towers-<tag>/<tower>/, each
recorded as an artifact's file is (sha256, sampled SHA-256, bytes). The query run loads them
(load_recorded) after each file's size and full SHA-256 match the record, whatever
ENGINE_ARTIFACT_VERIFY says (a compiled tower's .so holds its weights: one damaged embedding row
changes every answer that uses it, and no sample sees it); a file that differs means eager
towers, said in one line. Nothing compiles then.

`CLIP_TOWERS` (engine.settings): `auto` measures; `eager` (the default on the CPU, where
an AOTInductor compile of a ViT-L takes minutes) keeps ClipTowers as they are, at build and
at query time: the off switch.
"""
from __future__ import annotations

import json
import shutil
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from engine.clip import compiled as C
from engine.presets.retrieval import RETRIEVAL

COS_MIN = 0.999
TOP = RETRIEVAL.top_k   # the depth of the top-k lists the check compares
PROMPTS = ("a photo of a red car", "make it blue and add stripes", "a dog on a beach at sunset",
           "the same shirt but green", "remove the people in the background", "a small wooden house in snow",
           "add a hat", "make the sky darker", "a bowl of fruit on a table", "the same scene at night",
           "two cats instead of one", "a yellow bicycle", "zoom out a little", "black and white version",
           "a red circle on white", "the pattern with waves")
RECORD = "towers.json"   # INDEX_DIR/.build/towers.json: a resumed build's choice, kept with its chunks


@dataclass(frozen=True)
class Preset:
    """One device's tower search; its values are the retrieval table's `tower_*` (engine/presets/retrieval.py)."""
    backends: tuple[str, ...] = C.BACKENDS
    batches: tuple[int, ...] = field(kw_only=True)   # static batches measured
    precisions: tuple[str, ...] | None = None   # None: those the device runs natively
    sample: int = RETRIEVAL.tower_sample         # gallery images drawn for the check
    queries: int = RETRIEVAL.tower_queries       # of which held-out queries
    rounds: int = RETRIEVAL.tower_rounds


PRESETS = {device: Preset(batches=batches) for device, batches in RETRIEVAL.tower_batches.items()}


@dataclass(frozen=True)
class Candidate:
    """One tower form; build() returns fn(x [n, ...]) -> [n, D] float32 unit rows and its files."""
    tower: str
    backend: str
    precision: str
    batch: int

    @property
    def name(self) -> str:
        return f"{self.tower}-{self.backend}-{self.precision}-b{self.batch}"

    def build(self, model, spec, device: torch.device, work: Path) -> tuple[C.Static, Path | None]:
        d = None
        if self.backend == C.AOT:
            d = work / self.name
            ex = C.example_input(self.tower, spec, self.batch, C.text_len_for(spec), str(device))
            C.export_aot(C.make_graph(self.tower, model, spec, self.precision), ex, device.type, d)
        return C.tower_fn(self.tower, self.backend, model, spec, self.precision, self.batch, device, d,
                          C.text_len_for(spec)), d


def candidates(tower: str, device: str, preset: Preset) -> list[Candidate]:
    """Every candidate of `tower` on `device` under `preset`."""
    from engine.core.precision import native_precisions

    precs = preset.precisions or tuple(native_precisions(device)[0])
    out = [Candidate(tower, b, p, n) for b in preset.backends for p in precs if p in ("fp32", "bf16", "fp16")
           for n in preset.batches]
    return out + int8_candidates(tower, device, preset)


def int8_candidates(tower: str, device: str, preset: Preset) -> list[Candidate]:
    """torchao dynamic-INT8 eager candidates (engine.clip.int8): on the CPU when the preset names
    int8 or leaves precisions to the device, elsewhere only when it names int8; none when
    CLIP_TOWERS_INT8=0. One that cannot build here (no torchao) is a failed row saying why."""
    from engine import settings

    wanted = "int8" in preset.precisions if preset.precisions else device == "cpu"
    if not wanted or not settings.clip_towers_int8() or C.EAGER not in preset.backends:
        return []
    return [Candidate(tower, C.EAGER, "int8", n) for n in preset.batches]


@dataclass
class Choice:
    record: dict                       # meta.json towers[tower]
    fn: C.Static | None = None
    files: Path | None = None
    table: list = field(default_factory=list)


def _topk(q: torch.Tensor, g: torch.Tensor, k: int) -> torch.Tensor:
    return (q @ g.T).topk(k, dim=1).indices            # [Q, k] best first


def _measure(cand: Candidate, fn, x: torch.Tensor, ref: torch.Tensor, gallery_ref: torch.Tensor,
             queries: int, k: int, rounds: int) -> dict:
    """Run `fn` on the sample, compare with the reference, time one static batch."""
    out = fn(x)                                                      # [n, D]; also the warm-up
    cos = float((out * ref).sum(1).min())
    if cand.tower == "image":    # candidate queries against the candidate gallery
        same = torch.equal(_topk(out[:queries], out, k), _topk(ref[:queries], gallery_ref, k))
    else:                        # candidate texts against the reference gallery
        same = torch.equal(_topk(out, gallery_ref, k), _topk(ref, gallery_ref, k))
    one = x[torch.arange(cand.batch) % x.shape[0]]                   # one full static batch
    times = []
    for _ in range(rounds):
        if one.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(one)
        if one.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    ok = cos >= COS_MIN and same
    return {"candidate": cand.name, "backend": cand.backend, "precision": cand.precision, "batch": cand.batch,
            "per_s": round(cand.batch / statistics.median(times), 2), "cos_min": round(cos, 6),
            f"top{k}_equal": same, "status": "ok" if ok else
            f"refused: cosine min {cos:.6f} (needs {COS_MIN})" if cos < COS_MIN else f"refused: top-{k} differs"}


def choose(tower: str, cands: list[Candidate], model, spec, device: torch.device, x: torch.Tensor,
           ref: torch.Tensor, gallery_ref: torch.Tensor, preset: Preset, work: Path, log) -> Choice:
    """Measure every candidate of `tower`; the fastest that holds, else the eager FP32 reference."""
    k = min(TOP, gallery_ref.shape[0])
    table, best, best_rate = [], None, -1.0
    for cand in cands:
        t0 = time.perf_counter()
        try:
            fn, files = cand.build(model, spec, device, work)
            row = _measure(cand, fn, x, ref, gallery_ref, preset.queries, k, preset.rounds)
        except Exception as e:  # noqa: BLE001 - a candidate that cannot build or run is a row of the table
            table.append({"candidate": cand.name, "backend": cand.backend, "precision": cand.precision,
                          "batch": cand.batch, "status": f"failed: {type(e).__name__}: {str(e)[:200]}"})
            continue
        row["build_s"] = round(time.perf_counter() - t0, 2)
        table.append(row)
        if row["status"] == "ok" and row["per_s"] > best_rate:
            best, best_rate = (cand, fn, files), row["per_s"]
    if best is None:
        log(f"{tower} tower: no candidate agrees with the FP32 eager reference "
            f"({'; '.join(r['candidate'] + ' ' + r['status'] for r in table)}): using eager fp32")
        cand = Candidate(tower, C.EAGER, "fp32", preset.batches[0])
        best = (cand, *cand.build(model, spec, device, work))
    cand, fn, files = best
    rec = {"backend": cand.backend, "precision": cand.precision, "batch": cand.batch, "fallback": best_rate < 0}
    return Choice(rec, fn, files, table)


def tune(base, images: torch.Tensor, dest: Path, log, preset: Preset | None = None):
    """(CompiledTowers, meta.json `towers` record) for `base` (a ClipTowers), measured on
    `images` (uint8 [n, S, S, 3], a gallery sample). A chosen aot tower's files end in `dest`."""
    from engine.clip.towers import ClipTowers

    dev = base.device
    preset = preset or PRESETS.get(dev.type, PRESETS["cuda"])
    ref_towers = ClipTowers(base.model, base.spec, str(dev), "fp32", trim_text=True)
    x = images.to(dev)
    gallery_ref = ref_towers.encode_images(x)                                  # [n, D]
    text_len = C.text_len_for(base.spec)
    tokens = ref_towers.tokenize(list(PROMPTS))[0].to(dev)
    text_ref = ref_towers.encode_tokens(tokens)
    work = dest.parent / f".{dest.name}-work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    record = {"mode": "auto", "device": dev.type, "text_len": text_len, "dir": dest.name,
              "reference": {"backend": C.EAGER, "precision": "fp32"}, "preset": asdict(preset),
              "verify": {"sample_images": int(x.shape[0]), "image_queries": min(preset.queries, int(x.shape[0])),
                         "text_queries": len(PROMPTS), "top": min(TOP, int(x.shape[0])), "cos_min": COS_MIN}}
    fns = {}
    try:
        for tower, inp, ref in (("image", x, gallery_ref), ("text", tokens[:, :text_len], text_ref)):
            ch = choose(tower, candidates(tower, dev.type, preset), base.model, base.spec, dev, inp, ref,
                        gallery_ref, preset, work, log)
            if ch.files is not None:
                (dest / tower).parent.mkdir(parents=True, exist_ok=True)
                shutil.move(str(ch.files), dest / tower)
                ch.record["files"] = file_record(dest / tower)
            record[tower] = {"table": ch.table, "choice": ch.record}
            fns[tower] = ch.fn
            log(f"{tower} tower: {ch.record['backend']} {ch.record['precision']} batch {ch.record['batch']}"
                f" ({len(ch.table)} candidates measured)")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return C.CompiledTowers(base, fns["image"], fns["text"], text_len, record), record


def load_recorded(base, index_dir: Path, record: dict | None, say):
    """`base` (ClipTowers) running the towers `record` (meta.json `towers`) names, loaded from
    `index_dir` without compiling; `base` itself when the record names none, the switch is off,
    or a recorded file is unusable (one line through `say` saying why)."""
    from engine import settings

    if not isinstance(record, dict) or record.get("mode") != "auto" or settings.clip_towers() == C.EAGER:
        return base
    if record.get("device") != base.device.type:
        say(f"the index's towers were chosen on {record.get('device')}, this run is on {base.device.type}: "
            "eager towers")
        return base
    fns = {}
    for tower in ("image", "text"):
        ch = (record.get(tower) or {}).get("choice") or {}
        files = None
        try:
            if ch.get("backend") == C.AOT:
                files = index_dir / record["dir"] / tower
                check_recorded_files(files, ch["files"])
            fns[tower] = C.tower_fn(tower, ch["backend"], base.model, base.spec, ch["precision"], int(ch["batch"]),
                                    base.device, files, int(record["text_len"]))
        except (OSError, KeyError, ValueError, TypeError, RuntimeError) as e:
            say(f"the index's {tower} tower is unusable ({type(e).__name__}: {e}): eager towers")
            return base
    return C.CompiledTowers(base, fns["image"], fns["text"], int(record["text_len"]), record)


def file_record(folder: Path) -> dict:
    """{name: {"sha256", "sample_sha256", "bytes"}} of a chosen tower's files: the classification
    artifact's record (a load checks the size and the full sha256 of each: check_recorded_files)."""
    from engine.classify.artifact import sample_sha256
    from engine.io import sha256_file

    return {p.name: {"sha256": sha256_file(p), "sample_sha256": sample_sha256(p), "bytes": p.stat().st_size}
            for p in sorted(folder.iterdir())}


def check_recorded_files(folder: Path, files: dict) -> None:
    """Every tower file's size and full SHA-256 against the record, in every ENGINE_ARTIFACT_VERIFY
    mode: each file is read by the tower's load (the .so holds the weights and the code, the
    metadata and kernel binaries decide how it runs), so none may be sampled. The query run waits
    for it before any query: ~13 ms for the tiny test towers' 17 MB; a ViT-L/14's towers hold
    428 M parameters, 0.86 GB in fp16, about a second at the ~1 GB/s hashed here (docs/retrieval.md).
    An index written before the sampled digests (name -> sha256) gets the same check.
    ValueError naming the first file that differs."""
    from engine.classify.artifact import ArtifactError, check_files
    from engine.io import sha256_file

    if all(isinstance(v, str) for v in files.values()):
        for name, digest in files.items():
            if sha256_file(folder / name) != digest:
                raise ValueError(f"{folder / name}: sha256 differs from meta.json's")
        return
    try:
        check_files(folder, files, "sha256")
    except ArtifactError as e:
        raise ValueError(str(e)) from None


def save_resume(build_dir: Path, record: dict) -> None:
    """The choice of an unfinished build, so a resumed one embeds with the same towers."""
    from engine.io import write_atomic

    write_atomic(build_dir / RECORD, json.dumps(record).encode())


def read_resume(build_dir: Path) -> dict | None:
    try:
        rec = json.loads((build_dir / RECORD).read_text())
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None
