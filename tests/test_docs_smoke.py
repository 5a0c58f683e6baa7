"""A newcomer's smoke test: every command README.md and the docs it links show, followed on the tiny model.

`test_every_documented_command_is_covered` extracts the command lines of the two documents'
code blocks (indented or fenced; continuation lines joined, trailing comments dropped) and
fails when one is not in DOCUMENTED, or when DOCUMENTED names one the documents no longer
show: the documents cannot drift from this test. Each documented command maps to the step
that runs it here (the same command with small counts, or, for a template with
placeholders, its concrete form) or to the reason it does not run here (a GPU, Docker, the
whole suite). The steps then run in order, each a test, in one shared work folder whose
`scripts` and `build.sh` are links into the repository, so every relative path the
documents use (artifacts/, cohort/, cir/, camp/) lands there and never in the tree.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import REPO

DOCS = ("README.md", "docs/SUBMITTING.md", "docs/classification.md", "docs/cir.md", "docs/evidence.md",
        "docs/benchmarks.md", "docs/gpu-check.md", "docs/install.md")
TINY_BUILD = ("--build-arg=--input-size=112 --build-arg=--crop-mode=squash --build-arg=--crop-pct=1.0 "
              "'--build-arg=--model-kwargs={\"depth\": 4}' --build-arg=--calibration-count=16")
CIR = "cir/corpus"

# (step, shell command run in the work folder, expected exit status). Smaller counts than the
# documents show, the eager backend where they leave the default (aot compiles for minutes), and
# fp32 where they leave the precision to the measured search (tests/test_build_sh.py runs it).
STEPS: list[tuple[str, str, int]] = [
    ("presets", "python -m engine.presets", 0),
    ("cohort", "python -m evaluator.cohort --out cohort --count 24", 0),
    ("build", "ENGINE_CHECKPOINT=cohort/tiny_eva02.safetensors ENGINE_ARTIFACT=artifacts/tiny "
              "ENGINE_BACKEND=eager ENGINE_BATCH_SIZE=8 ENGINE_PRECISION=fp32 ./build.sh", 0),
    ("run", "ENGINE_ARTIFACT=artifacts/tiny scripts/run cohort/manifest.tsv cohort pred.i32", 0),
    ("reference", "python -m evaluator.reference cohort/manifest.tsv cohort ref.i32 "
                  "--checkpoint cohort/tiny_eva02.safetensors", 0),
    ("agreement", "python -m evaluator.agreement --predictions pred.i32 --reference ref.i32", 0),
    ("rehearse", "scripts/rehearse --artifact artifacts/tiny --cohort cohort --reference ref.i32", 0),
    ("rehearse-generated", "scripts/rehearse --artifact artifacts/tiny --count 24", 0),
    ("provenance", "python -m evaluator.provenance artifacts/tiny --out provenance.json", 0),
    ("sweep", "python -m evaluator.sweep --model eva02_tiny_patch14_224 --checkpoint cohort/tiny_eva02.safetensors "
              "--manifest cohort/manifest.tsv --image-root cohort --reference ref.i32 --precisions fp32 "
              f"--batch-sizes 8 --backend eager --out sweep {TINY_BUILD}", 0),
    ("campaign-min", "python -m evaluator.campaign run --workload eva02-imagenet1k --profile min --runs 2 "
                     "--out camp --prepared prep", 0),
    ("campaign-verify", "python -m evaluator.campaign verify camp/campaign.provd.json", 0),
    ("campaign-package", "python -m evaluator.campaign package camp --out camp.tar.gz", 0),
    ("cir-corpus", f"python -m evaluator.cir_corpus --out {CIR} --clip cir/clip --templates 6 --per-template 4 "
                   "--requests 12", 0),
    ("cir-build", f"CLIP_MODEL_DIR=cir/clip/open_clip scripts/build.sh --corpus {CIR} --index-dir cir/index", 0),
    ("cir-run", f"CLIP_MODEL_DIR=cir/clip/open_clip scripts/run.sh --index-dir cir/index "
                f"--queries {CIR}/requests.jsonl --output cir/results.jsonl", 0),
    ("cir-score", f"python -m evaluator.score_retrieval --results cir/results.jsonl --labels {CIR}/labels.jsonl", 0),
    ("cir-ablate", f"CLIP_MODEL_DIR=cir/clip/open_clip python -m evaluator.ablate --index-dir cir/index "
                   f"--queries {CIR}/requests.jsonl --labels {CIR}/labels.jsonl --methods slerp,sum", 0),
]

# every command line the documents show -> the step that runs it, or "skip: why not here"
DOCUMENTED: dict[str, str] = {
    # README.md and the docs it links
    "python3 -m pip install -e . && python3 -m evaluator.demo":
        "skip: installs packages (done before the suite runs); tests/test_demo.py runs the demo on a small cohort",
    "./scripts/test.sh": "skip: the whole suite, this test included",
    "python3 -m pip install torch torchvision --index-url https://download.pytorch.org/whl/cpu":
        "skip: installs packages from the network",
    "python3 -m pip install -e .": "skip: installs packages (done before the suite runs)",
    "python -m engine.build --model eva02_large_patch14_448.mim_m38m_ft_in22k_in1k --checkpoint "
    "/path/model.safetensors --out artifacts/default [--device cpu|cuda] [--precision auto|fp32|bf16|fp16|fp8|int8] "
    "[--backend auto|aot|eager|trt|null] [--batch-size auto|N] [--input-size N] [--crop-mode center|squash] "
    "[--deadline-s S] [--search-budget-s S] [--search-precisions fp32,bf16] [--no-verify] [--no-guard] "
    "[--calibration-source photos|renders] [--calibration-images DIR] [--guard-budget 10] [--guard-safety 2] "
    "[--recheck-batch 8|auto]": "build",
    "python -m evaluator.sweep --model NAME --checkpoint FILE --manifest M.tsv --image-root DIR --reference "
    "ANSWERS.tsv [--precisions fp32,bf16,fp16,fp8] [--batch-sizes 16,32,64] [--backend NAME]": "sweep",
    "scripts/run MANIFEST IMAGE_ROOT OUTPUT": "run",
    "python -m engine.presets": "presets",
    "python -m evaluator.reference MANIFEST IMAGE_ROOT REF.i32 --model NAME --checkpoint FILE": "reference",
    "python -m evaluator.agreement --predictions P.i32 --reference REF.i32|ANSWERS.tsv [--manifest M] "
    "[--gate 0.99] [--expect-rows N] [--json]": "agreement",
    "CLIP_MODEL_DIR=/task/models/clip scripts/build.sh --corpus DIR --index-dir INDEX": "cir-build",
    "scripts/run.sh --index-dir INDEX --queries requests.jsonl --output results.jsonl": "cir-run",
    "scripts/build.sh --ray --workers N --corpus DIR --index-dir INDEX":
        "skip: starts a Ray cluster; tests/test_ray_build.py runs it on a local Ray of 2 CPUs",
    "python -m evaluator.score_retrieval --results results.jsonl --labels "
    "labels.jsonl|circo_val.json|cap.rc2.val.json": "cir-score",
    "python -m evaluator.score_retrieval --results results.jsonl --labels labels.jsonl": "cir-score",
    "python -m evaluator.ablate --index-dir INDEX --queries requests.jsonl --labels labels.jsonl "
    "[--methods slerp,slerp+gap,slerp+isoftmax,pic2word,slerp+reinspect]": "cir-ablate",
    "python -m evaluator.cir_corpus --out cir/corpus --clip cir/clip": "cir-corpus",
    "export CLIP_MODEL_DIR=cir/clip/open_clip": "cir-build",
    "scripts/build.sh --corpus cir/corpus --index-dir cir/index": "cir-build",
    "scripts/run.sh --index-dir cir/index --queries cir/corpus/requests.jsonl --output cir/results.jsonl": "cir-run",
    "python -m evaluator.score_retrieval --results cir/results.jsonl --labels cir/corpus/labels.jsonl": "cir-score",
    "python -m evaluator.ablate --index-dir cir/index --queries cir/corpus/requests.jsonl "
    "--labels cir/corpus/labels.jsonl": "cir-ablate",
    "python -m evaluator.campaign run --workload eva02-imagenet1k --profile min --runs 5 --out camp": "campaign-min",
    "python -m evaluator.campaign run --workload eva02-imagenet1k --profile max --runs 5 --out camp --manifest M.tsv "
    "--image-root IMAGES --reference ANSWERS.tsv --artifact artifacts/default --dataset-split imagenet-1k-val "
    "--dataset-version ILSVRC2012 [--power \"mains, performance governor\"] [--bundle-limit-mb 256] "
    "[--attach bench.json]":
        "skip: needs real data to mean anything; tests/test_campaign_rules.py runs max on prepared inputs",
    "python -m evaluator.campaign verify camp/campaign.provd.json [--external ARTIFACT_DIR]": "campaign-verify",
    "python -m evaluator.campaign package camp --out camp.tar.gz": "campaign-package",
    "python -m pytest tests/bench --benchmark-enable --benchmark-json=bench.json":
        "skip: benchmarks take minutes each and are timed on a quiet machine",
    "BENCH_PREPARED=.benchmarks/prepared python -m pytest tests/bench --benchmark-enable --benchmark-json=bench.json":
        "skip: benchmarks take minutes each and are timed on a quiet machine; tests/test_bench_progress.py checks "
        "that their preparation is said on the terminal",
    "scripts/device_check.sh [OUTDIR]": "skip: needs a GPU; tests/test_device_check.py runs it on the CPU (--tiny)",
    "python3 -c \"import glob, sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in "
    "sorted(glob.glob('device_carry/*.whl'))]\" /tmp/device_carry && PYTHONPATH=/tmp/device_carry "
    "scripts/device_check.sh \"$OUT\" --limit-s 500": "skip: the lent device machine's command (a GPU)",
    "python3 -m pip download --no-deps -d device_carry timm==1.0.31 nvidia-cuda-crt==13.0.88 "
    "nvidia-cuda-cccl==13.0.85 torchao==0.18.0": "skip: downloads from PyPI",
    "python3 -m venv --system-site-packages /tmp/gpucheck-venv": "skip: the torch 2.11 rehearsal's environment "
    "(minutes, a 530 MB download); its result is docs/perf/2026-12-05-device-check-torch211-cpu.md",
    "/tmp/gpucheck-venv/bin/python -m pip download --no-deps -d /tmp/gpucheck-dl torch==2.11.0 torchvision==0.26.0":
        "skip: downloads from PyPI",
    "PIP_CONSTRAINT= /tmp/gpucheck-venv/bin/python -m pip install --no-deps "
    "/tmp/gpucheck-dl/torch-2.11.0-cp311-cp311-manylinux_2_28_x86_64.whl "
    "/tmp/gpucheck-dl/torchvision-0.26.0-cp311-cp311-manylinux_2_28_x86_64.whl":
        "skip: the torch 2.11 rehearsal's environment",
    "PATH=/tmp/gpucheck-venv/bin:$PATH scripts/device_check.sh /tmp/gpucheck-211-out --tiny --device cpu --count 24 "
    "--ref-count 24 --batch-size 8 --calibration-count 32 --search-budget-s 5 --gpu-tests-s 60 --limit-s 1200":
        "skip: needs the torch 2.11 environment; tests/test_device_check.py runs the same on the suite's torch",
    # docs/SUBMITTING.md
    "docker buildx build --platform linux/arm64,linux/amd64 -t eva-engine:submission .":
        "skip: no Docker engine here; tests/test_dockerfile.py checks the Dockerfile",
    "ENGINE_CHECKPOINT=/checkpoint/model.safetensors ./build.sh": "build",
    "/submission/run MANIFEST IMAGE_ROOT OUTPUT": "run",
    "python -m evaluator.cohort --out cohort --count 200 --checkpoint": "cohort",
    "ENGINE_CHECKPOINT=cohort/tiny_eva02.safetensors ENGINE_ARTIFACT=artifacts/tiny ./build.sh": "build",
    "ENGINE_ARTIFACT=artifacts/tiny scripts/run cohort/manifest.tsv cohort pred.i32": "run",
    "python -m evaluator.reference cohort/manifest.tsv cohort ref.i32 --checkpoint cohort/tiny_eva02.safetensors":
        "reference",
    "python -m evaluator.agreement --predictions pred.i32 --reference ref.i32": "agreement",
    "scripts/rehearse --artifact artifacts/tiny --cohort cohort --reference ref.i32": "rehearse",
    "scripts/rehearse --artifact artifacts/default --cohort COHORT --reference REF.i32": "rehearse",
    "scripts/rehearse --artifact artifacts/default": "rehearse-generated",
    "python -m evaluator.provenance artifacts/default --out provenance.json": "provenance",
}


def documented_commands(text: str) -> list[str]:
    """The command lines of a Markdown text's code blocks: fenced, or indented by 4 after a blank
    line; `\\` continuations joined, comments dropped, whitespace collapsed. A block whose first
    word ends with `/` is a folder listing, and a fenced block of another language (```python) is
    code, not commands."""
    blocks: list[list[str]] = []
    fenced, prev_blank, indented = False, True, False
    code = False                         # inside a fenced block of another language (```python): not commands
    for ln in text.splitlines():
        if ln.lstrip().startswith("```"):
            fenced, indented = not fenced, False
            lang = ln.lstrip()[3:].strip()
            code = fenced and lang not in ("", "sh", "bash", "shell", "console")
            if fenced and not code:
                blocks.append([])
        elif fenced:
            if not code:
                blocks[-1].append(ln)
        elif ln.startswith("    ") and (prev_blank or indented):
            if not indented:
                blocks.append([])
            blocks[-1].append(ln)
            indented = True
        elif ln.strip():                 # a text line ends an indented block (a blank line does not)
            indented = False
        prev_blank = not ln.strip()
    out = []
    for block in blocks:
        joined, cur = [], ""
        for ln in block:
            cur += " " + ln.strip()
            if cur.endswith("\\"):
                cur = cur[:-1]
                continue
            joined.append(cur)
            cur = ""
        cmds = [" ".join(re.split(r"\s{2,}#\s", c)[0].split()) for c in joined]
        cmds = [c for c in cmds if c and not c.startswith("#")]
        if cmds and not cmds[0].split()[0].endswith("/"):
            out += cmds
    return out


def test_every_documented_command_is_covered():
    shown = {c: doc for doc in DOCS for c in documented_commands((REPO / doc).read_text())}
    missing = sorted(c for c in shown if c not in DOCUMENTED)
    assert not missing, ("commands the documents show that this test does not cover (add each to DOCUMENTED "
                         f"with the step that runs it, or why it cannot run here): {missing}")
    stale = sorted(c for c in DOCUMENTED if c not in shown)
    assert not stale, f"DOCUMENTED names commands the documents no longer show: {stale}"
    steps = {name for name, _, _ in STEPS}
    assert all(v in steps or v.startswith("skip: ") for v in DOCUMENTED.values())
    assert steps <= set(DOCUMENTED.values()), "a step no documented command maps to"


def test_a_document_that_runs_the_test_tools_says_how_to_install_them():
    """`pip install -e .` (the README's first command) installs no pytest: every document that
    shows a command running pytest (the benchmarks, a measured figure, the mutation tool) says
    where the test tools come from."""
    needs = re.compile(r"python3? -m pytest|scripts/mutate\.py")
    for doc in ["README.md", *(str(p.relative_to(REPO)) for p in sorted((REPO / "docs").glob("*.md")))]:
        text = (REPO / doc).read_text()
        if needs.search(text):
            assert "pip install -e '.[dev]'" in text and "scripts/test.sh" in text, \
                f"{doc} runs pytest but does not say `python3 -m pip install -e '.[dev]'` (or ./scripts/test.sh)"


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces as dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_cross_document_links_and_the_sections_they_name_exist():
    """Every relative link of README.md and docs/ reaches a file, its `#anchor` a heading there, and
    a section named after a link (`[x.md](x.md), "Section"`) is a heading or a bold paragraph
    (`**Section.**`) of that file; a section pointer names its file by a link, not in words."""
    bad = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
        text = " ".join(doc.read_text().split())           # a pointer may wrap across lines
        for m in re.finditer(r"\[[^\]]*\]\(([^)\s]+)\)(?:, \"([^\"]+)\")?", text):
            target, section = m.group(1), m.group(2)
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            where = f"{doc.relative_to(REPO)}: {m.group(0)}"
            if not file.exists():
                bad.append(f"{where}: no such file")
                continue
            if file.suffix != ".md" or not (anchor or section):
                continue
            body = file.read_text()
            heads = re.findall(r"^#+\s+(.*)$", body, re.M)
            if anchor and anchor not in {_slug(h) for h in heads}:
                bad.append(f"{where}: no heading with anchor #{anchor}")
            if section and section not in heads and f"**{section}.**" not in " ".join(body.split()):
                bad.append(f"{where}: no section {section!r} there")
        bad += [f"{doc.relative_to(REPO)}: {m.group(0)!r} names a section in words: link its file"
                for m in re.finditer(r"(?:README|[\w-]+\.md), \"[^\"]+\"", text)]
    assert not bad, bad


def test_documented_outputs_stay_out_of_git():
    """Following the documents never dirties the tree: every output they suggest is ignored."""
    outputs = ["demo/x", "artifacts/default/x", "artifacts/tiny/x", "cohort/x", "pred.i32", "ref.i32", "sweep/x",
               "camp/x", "camp.tar.gz", "cir/corpus/x", "provenance.json", "bench.json", "ablate.json",
               ".benchmarks/prepared/x"]
    r = subprocess.run(["git", "-C", str(REPO), "check-ignore", "--no-index", *outputs], capture_output=True,
                       text=True)
    assert sorted(r.stdout.split()) == sorted(outputs), set(outputs) - set(r.stdout.split())


@pytest.fixture(scope="module")
def work(tmp_path_factory, tiny_checkpoint) -> Path:
    """The work folder: links to the repository's entry points, and the session's tiny checkpoint in
    cohort/ (the documented `--checkpoint` fit is tests/test_cohort.py's; copying it saves minutes)."""
    w = tmp_path_factory.mktemp("docs_smoke")
    (w / "scripts").symlink_to(REPO / "scripts")
    (w / "build.sh").symlink_to(REPO / "build.sh")
    (w / "cohort").mkdir()
    for suffix in (".safetensors", ".json"):
        shutil.copy(tiny_checkpoint.with_suffix(suffix), w / "cohort" / f"tiny_eva02{suffix}")
    (w / "prep").mkdir()
    for name, target in (("cohort", "../cohort"), ("artifact", "../artifacts/tiny"), ("reference.i32", "../ref.i32")):
        (w / "prep" / name).symlink_to(target)
    return w


@pytest.mark.abi
@pytest.mark.parametrize("name, cmd, rc", STEPS, ids=[s[0] for s in STEPS])
def test_documented_step(work, name, cmd, rc):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ENGINE_", "CONTEST_", "CIR_", "CLIP_"))}
    env["OMP_WAIT_POLICY"] = "PASSIVE"
    r = subprocess.run(["sh", "-c", cmd], cwd=work, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == rc, f"{cmd}\nexit {r.returncode}\n{r.stderr[-3000:]}"
    if name == "presets":   # the docs' copies of the two defaults tables are the tables
        classification, retrieval = r.stdout.strip().split("\n\n")
        assert classification.startswith("| field | cpu | cuda |") and retrieval.startswith("| field | value |")
        assert classification in (REPO / "docs/classification.md").read_text(), classification
        assert retrieval in (REPO / "docs/retrieval.md").read_text(), retrieval
    elif name == "agreement":
        assert "PASS" in r.stdout.splitlines()[0] and "could not read" in r.stdout, r.stdout
    elif name == "build":
        assert "the checkpoint records its spec" in r.stderr and (work / "artifacts/tiny/manifest.json").is_file()
    elif name in ("rehearse", "rehearse-generated"):
        assert json.loads(r.stdout)["verdict"] == "PASS"
    elif name == "sweep":
        fp32 = json.loads(r.stdout)["results"][0]
        assert fp32["gate"]["passed"] and fp32["gate"]["unreadable"] >= 1, fp32
    elif name == "cir-score":
        assert r.stdout.strip()
