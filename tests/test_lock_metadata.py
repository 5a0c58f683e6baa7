"""The image's locks meet every pin's requirements on linux x86_64 and aarch64 (offline).

requirements/metadata.json holds, per architecture, the Requires-Dist of the file pip installs for
each pin of the locks the Dockerfile installs (`python scripts/lock.py --metadata` reads them from
PyPI); scripts/lock_metadata.py checks them against the pins with each architecture's markers, as
the image's `pip check` would, extras followed. Nothing here touches the network."""
from __future__ import annotations

import importlib.util
import json
import re
import sys

import pytest
from conftest import REPO


@pytest.fixture(scope="module")
def lm():
    spec = importlib.util.spec_from_file_location("lock_metadata", REPO / "scripts" / "lock_metadata.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["lock_metadata"] = mod
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop("lock_metadata", None)


@pytest.fixture(scope="module")
def data(lm) -> dict:
    path = REPO / lm.DATA
    assert path.is_file(), f"{lm.DATA} is missing: run {lm.REGENERATE}"
    return json.loads(path.read_text())


def _torch_tensorrt(lm) -> str:
    """gpu.txt's torch-tensorrt pin as the data file keys it (`torch-tensorrt==X`)."""
    return next(lm.pin_key(r) for r in lm.pins((REPO / "requirements" / "gpu.txt").read_text())
                if r.name == "torch-tensorrt")


def test_metadata_is_made_from_the_current_locks(lm, data):
    """The data file names exactly the locks the Dockerfile installs, at their current sha256, and
    holds the requirements of exactly the pins each architecture installs."""
    locks = lm.read_locks()
    assert set(locks) == {"requirements/lock.txt", "requirements/gpu.txt"}, locks.keys()
    assert lm.stale(locks, data) is None, lm.stale(locks, data)
    for arch in lm.ARCHES:
        pinned = {lm.pin_key(r) for r in lm.installed(locks, arch).values()}
        assert set(data["requires"][arch]) == pinned, (arch, set(data["requires"][arch]) ^ pinned)
        assert set(data["files"][arch]) == pinned


def test_a_changed_lock_without_new_metadata_is_named(lm, data):
    locks = lm.read_locks()
    bumped = {**locks, "requirements/gpu.txt": locks["requirements/gpu.txt"].replace("psutil==", "psutil==0")}
    why = lm.stale(bumped, data)
    assert why and "requirements/gpu.txt" in why and "requirements/lock.txt" not in why, why
    assert lm.REGENERATE == "python scripts/lock.py --metadata" and lm.REGENERATE in why, why
    assert lm.stale({**locks, "requirements/extra.txt": "x==1\n"}, data), "a new lock the data never saw"


def test_the_files_read_are_each_architectures_own(lm, data):
    """Per arch, a platform wheel of that arch (or a pure one, or an sdist): never the other's."""
    for arch in lm.ARCHES:
        other = next(a for a in lm.ARCHES if a != arch)
        for key, name in data["files"][arch].items():
            assert other not in name, (arch, key, name)
            assert name.endswith(("-any.whl", f"_{arch}.whl", ".tar.gz", ".zip")), (arch, key, name)
    trt = _torch_tensorrt(lm)
    assert data["files"]["aarch64"][trt] != data["files"]["x86_64"][trt]


def test_only_nvidia_index_pins_have_incomplete_metadata(lm, data):
    """A pin whose Requires-Dist could not be read completely from PyPI is one of gpu.txt's
    (TensorRT's libraries come from NVIDIA's index): the contest stack is covered whole."""
    gpu = {lm.pin_key(r) for r in lm.pins((REPO / "requirements" / "gpu.txt").read_text())}
    for arch in lm.ARCHES:
        assert set(data["partial"][arch]) <= gpu, (arch, data["partial"][arch])


def test_current_locks_meet_every_requirement_on_both_architectures(lm, data):
    assert lm.unmet(lm.read_locks(), data["requires"]) == {}


def test_the_lock_without_tensorrt_fails_on_aarch64_only(lm, data):
    """gpu.txt as it was without the aarch64 `tensorrt` pin: torch-tensorrt's aarch64 wheel asks for
    `tensorrt` (its x86_64 wheel for tensorrt-cu13), so the arm64 image's pip check fails."""
    locks = lm.read_locks()
    old = "".join(ln for ln in locks["requirements/gpu.txt"].splitlines(keepends=True)
                  if not re.match(r"tensorrt==", ln))
    assert old != locks["requirements/gpu.txt"], "gpu.txt no longer pins tensorrt"
    problems = lm.unmet({**locks, "requirements/gpu.txt": old}, data["requires"])
    assert set(problems) == {"aarch64"}, problems
    assert len(problems["aarch64"]) == 1, problems
    line = problems["aarch64"][0]
    assert line.startswith(f"{_torch_tensorrt(lm)} requires tensorrt") and "tensorrt is not pinned" in line, line


# ---- the check itself, on small made-up locks ----------------------------------------------------

def _check(lm, lock: str, requires: dict[str, list[str]]) -> dict[str, list[str]]:
    return lm.unmet({"requirements/x.txt": lock}, {arch: requires for arch in lm.ARCHES})


def test_markers_are_evaluated_per_architecture(lm):
    lock = 'a==1\nb==2; platform_machine == "x86_64"\n'
    requires = {"a==1": ['b>=2; platform_machine == "x86_64"', 'c; platform_machine == "aarch64"',
                         'd; sys_platform == "win32"', 'e; python_version < "3.10"'], "b==2": []}
    problems = _check(lm, lock, requires)
    assert set(problems) == {"aarch64"} and len(problems["aarch64"]) == 1, problems
    assert "a==1 requires c" in problems["aarch64"][0] and "c is not pinned for aarch64" in problems["aarch64"][0]


def test_a_version_outside_the_specifier_is_named(lm):
    problems = _check(lm, "a==1\nb_B.x==2.0\n", {"a==1": ["B-b-X<2"], "b-b-x==2.0": []})
    assert problems["x86_64"] == ["a==1 requires B-b-X<2: the locks pin b-b-x==2.0"], problems
    assert _check(lm, "a==1\nb==2.0\n", {"a==1": ["b>=2,<3"], "b==2.0": []}) == {}


def test_extras_are_followed(lm):
    """`b[x]` needs b's `extra == "x"` requirements too, through a chain of extras; unasked extras do not."""
    requires = {"a==1": ["b[x]"], "b==1": ['c[y]; extra == "x"', 'd; extra == "z"'],
                "c==1": ['e; extra == "y"'], "e==1": []}
    problems = _check(lm, "a==1\nb==1\nc==1\n", requires)
    assert problems["aarch64"] == ['c==1 requires e; extra == "y": e is not pinned for aarch64'], problems
    assert _check(lm, "a==1\nb==1\nc==1\ne==1\n", requires) == {}
    assert _check(lm, "a==1\nb[z]==1\nc==1\ne==1\n", requires)["x86_64"][0].startswith("b==1 requires d")


def test_a_pin_without_metadata_names_the_command(lm):
    problems = _check(lm, "a==1\n", {})
    assert problems["x86_64"] == [f"a==1: no metadata for x86_64: run {lm.REGENERATE}"], problems


def test_the_dockerfiles_locks_are_read_from_its_pip_lines(lm):
    text = ("# RUN pip install -r /submission/requirements/old.txt\n"
            "RUN python -m pip install --no-deps -r /submission/requirements/lock.txt \\\n"
            "    && python -m pip install -r /submission/requirements/gpu.txt && python -m pip check\n")
    assert lm.docker_locks(text) == ["requirements/lock.txt", "requirements/gpu.txt"]
