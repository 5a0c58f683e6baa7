"""The optimized path (aot + dali-cpu) against the naive FP32 reference (PIL + eager, batch 1)."""
from __future__ import annotations

import numpy as np
import pytest
from conftest import run_abi, tiny_spec

from engine.classify.artifact import load_artifact
from engine.classify.runtime import load_runtime
from evaluator.contest.agreement import agreement
from evaluator.contest.manifest import read_manifest
from evaluator.contest.reference import reference_top1

pytestmark = pytest.mark.abi   # the AOTInductor artifacts (compiles) and scripts/run

GATE = 0.995


@pytest.fixture(scope="module")
def references(cohort, tiny_checkpoint):
    rows = read_manifest(cohort / "manifest.tsv")
    paths = [cohort / r.path for r in rows]
    return {mode: reference_top1(tiny_spec(mode), tiny_checkpoint, paths) for mode in ("squash", "center")}


@pytest.mark.parametrize("mode,fixture", [("squash", "aot_artifact"), ("center", "aot_artifact_center")])
def test_aot_dali_cpu_agrees_with_reference(mode, fixture, cohort, references, tmp_path, request):
    artifact = request.getfixturevalue(fixture)
    out = tmp_path / "pred.i32"
    r = run_abi(cohort / "manifest.tsv", cohort, out, artifact, "--decoder", "dali-cpu")
    assert r.returncode == 0, r.stderr
    ref = references[mode]
    res = agreement(np.fromfile(out, "<i4"), ref, GATE)
    assert res.unreadable == 4  # the broken files: no reference answer
    assert res.total == 396
    assert res.passed, f"{res.matches}/{res.total} = {res.rate:.4f} < {GATE}"
    # the reference itself is not degenerate: many classes are predicted
    assert len(np.unique(ref[ref >= 0])) >= 40


def test_aot_and_eager_give_the_same_top1(aot_artifact, eager_artifact):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (16, 112, 112, 3), dtype=np.uint8)
    a = load_runtime(load_artifact(aot_artifact)).run(x)
    e = load_runtime(load_artifact(eager_artifact)).run(x)
    assert a.dtype == np.int32 and a.shape == (16,)
    assert (a == e).mean() >= 15 / 16


def test_static_batch_shape_is_enforced(aot_artifact):
    rt = load_runtime(load_artifact(aot_artifact))
    with pytest.raises(ValueError, match="pad the batch"):
        rt.run(np.zeros((3, 112, 112, 3), np.uint8))
