"""Provenance of an artifact and of the environment its run uses, with forbidden-data flags.

    python -m evaluator.provenance ARTIFACT_DIR [--out FILE.json] [--checkpoint FILE] [--repo DIR]
                                   [--extra DIR ...]

Lists every file of the artifact (SHA-256, bytes, role, what it was made from), the
checkpoint it was built from (path and SHA-256 from the manifest; the safetensors
metadata `made_from` when the file is at hand), the build argv and versions, the
repository's source files (`git ls-files`, else a walk) and the installed versions of the
packages the run imports. Every listed file is checked for signs of ImageNet validation
data: validation file names, ground-truth / synset / label file names, answer tables
(>= 1000 `<id><TAB><0..999>` lines, or >= 1000 synset ids) and answer arrays (10,000 or
50,000 int32 values all in [0, 999]). Exit 1 when anything is flagged, 0 otherwise, 2 when
the artifact cannot be read. JSON on stdout (the whole record, or a summary with --out).
"""
from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

from engine.backends import compiled_suffixes
from engine.io import package_versions, sha256_file
from evaluator.contest.eval_data_signs import content_flags, name_flags

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("torch", "torchvision", "timm", "numpy", "pillow", "safetensors", "nvidia-dali-cuda130",
            "nvidia-dali-cuda120", "nvidia-dali", "tensorrt", "tensorrt-cu12", "tensorrt-cu13", "torch-tensorrt")


def file_record(path: Path, rel: str, role: str, made_from: str) -> dict:
    rec = {"path": rel, "sha256": sha256_file(path), "bytes": path.stat().st_size, "role": role,
           "made_from": made_from}
    flags = name_flags(rel) + content_flags(path)
    if path.suffix in compiled_suffixes() and zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as z:
            rec["members"] = [{"name": i.filename, "bytes": i.file_size} for i in z.infolist()]
            flags += [f"member {i.filename}: {f}" for i in z.infolist() for f in name_flags(i.filename)]
    rec["flags"] = flags
    return rec


def checkpoint_record(meta: dict, override: Path | None) -> dict:
    """The source checkpoint: manifest facts, plus its safetensors metadata when the file is at hand."""
    ck = dict(meta.get("checkpoint", {}))
    path = override or (Path(ck["path"]) if ck.get("path") else None)
    rec = {"path_in_manifest": ck.get("path"), "sha256": ck.get("sha256"), "bytes": ck.get("bytes"),
           "model": meta.get("spec", {}).get("model")}
    if path is None or not path.is_file():
        rec["at_hand"] = False
        rec["made_from"] = "not at hand here: origin known only by the manifest's sha256"
        return rec
    rec["at_hand"] = str(path)
    rec["sha256_matches_manifest"] = sha256_file(path) == ck.get("sha256")
    rec["flags"] = name_flags(str(path))
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), "np") as f:
            md = f.metadata() or {}
        rec["metadata"] = {k: _maybe_json(v) for k, v in md.items()}
        if "made_from" in md:
            rec["made_from"] = _maybe_json(md["made_from"])
    rec.setdefault("made_from", f"not stated in the file's metadata (published weights for {rec['model']}?)")
    return rec


def _maybe_json(v: str):
    try:
        return json.loads(v)
    except ValueError:
        return v


def source_files(repo: Path) -> tuple[list[str], str | None]:
    """(files, git HEAD) of the repo: tracked + untracked-not-ignored via git, else a walk."""
    from evaluator.rehearsal.rehearse import source_files as files

    head = None
    if (repo / ".git").exists():
        r = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True)
        head = r.stdout.strip() or None
    return files(repo), head


def versions() -> dict[str, str]:
    return package_versions(PACKAGES, missing=False)


def provenance(artifact: Path, checkpoint: Path | None, repo: Path | None, extra: list[Path]) -> dict:
    from engine.classify.artifact import load_artifact

    art = load_artifact(artifact, verify="size")  # sizes here; every digest is recomputed below
    meta = art.meta
    ck = checkpoint_record(meta, checkpoint)
    origin = (f"built by engine.build from checkpoint sha256 {str(ck['sha256'])[:16]}... "
              f"({ck['path_in_manifest']}), which is made from: {ck['made_from']}")
    files = []
    for p in sorted(x for x in artifact.rglob("*") if x.is_file()):
        rel = p.relative_to(artifact).as_posix()
        listed = meta["files"].get(rel)
        role = "manifest" if rel == "manifest.json" else ("compiled package" if p.suffix in compiled_suffixes() else
                                                          "weights" if p.suffix == ".safetensors" else "other")
        rec = file_record(p, rel, role, "written by engine.build (spec, versions, digests)"
                          if rel == "manifest.json" else origin)
        if rel != "manifest.json":
            rec["matches_manifest"] = bool(listed) and listed["sha256"] == rec["sha256"]
            if not listed:
                rec["flags"].append("not listed in manifest.json: where does it come from?")
        files.append(rec)
    record = {
        "artifact": str(artifact.resolve()),
        "backend": art.backend, "device": art.device, "precision": art.precision, "spec": meta.get("spec"),
        "build": meta.get("build"), "built_with": meta.get("versions"),
        "checkpoint": ck, "files": files,
    }
    if repo is not None:
        names, head = source_files(repo)
        record["source"] = {"repo": str(repo), "git_head": head, "files": [
            file_record(repo / n, n, "source", f"repository file{f' at {head[:12]}' if head else ''} (hand-written)")
            for n in names]}
    record["extra"] = [file_record(p, str(p), "extra", "given with --extra")
                       for d in extra for p in sorted([d] if d.is_file() else d.rglob("*")) if p.is_file()]
    record["environment"] = versions()
    flagged = [{"path": f["path"], "flags": f["flags"]} for group in
               (files, record.get("source", {}).get("files", []), record["extra"], [ck]) for f in group
               if f.get("flags")]
    record["flagged"] = flagged
    record["verdict"] = "FLAGGED" if flagged else "CLEAN"
    return record


def main(argv: list[str] | None = None) -> int:
    from engine.classify.artifact import ArtifactError
    from engine.cli import error, guard, parser

    prog = "python -m evaluator.provenance"
    p = parser(prog, __doc__.split("\n\n")[0])
    p.add_argument("artifact", type=Path, help="artifact directory (with manifest.json)")
    p.add_argument("--out", type=Path, help="write the record here; stdout then gets a summary (default: the record on stdout)")
    p.add_argument("--checkpoint", type=Path, help="the checkpoint file, when not at the manifest's path (default: the manifest's path)")
    p.add_argument("--repo", type=Path, default=REPO, help="source tree to list")
    p.add_argument("--no-source", action="store_true", help="list the artifact only")
    p.add_argument("--extra", type=Path, action="append", default=[], help="more files or folders to check")
    a = p.parse_args(argv)
    if not (a.artifact / "manifest.json").is_file():
        return error(prog, f"{a.artifact} has no manifest.json (not an artifact)")

    def body() -> int:
        rec = provenance(a.artifact, a.checkpoint, None if a.no_source else a.repo, a.extra)
        text = json.dumps(rec, indent=1)
        if a.out:
            a.out.write_text(text + "\n")
            print(json.dumps({"out": str(a.out), "verdict": rec["verdict"], "flagged": rec["flagged"],
                              "checkpoint_made_from": rec["checkpoint"]["made_from"]}))
        else:
            print(text)
        for f in rec["flagged"]:
            print(f"{prog}: FLAG {f['path']}: {'; '.join(f['flags'])}", file=sys.stderr)
        return 1 if rec["flagged"] else 0

    return guard(prog, body, errors=(ArtifactError,), debug=a.debug)


if __name__ == "__main__":
    sys.exit(main())
