"""The Ray gallery build (scripts/build.sh --ray) when Ray cannot serve: each failure ends in one line
of ours, before the CLIP loads where it can be seen up front, and Ray's own retries are bounded.
No Ray starts here: a fake Ray (FakeRay) runs the actors in this process, where a real one would
add nothing to what is checked; tests/test_ray_build.py holds the builds on a real Ray."""
from __future__ import annotations

import importlib.util
import shutil
import socket
import types
from collections import namedtuple

import numpy as np
import pytest
from cir_helpers import build_args, built_index, clip_dirs

needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                               reason="ray is not installed (pip install -r requirements/scale.txt)")
Usage = namedtuple("Usage", "total used free")
MIB = 2**20


class FakeRayError(Exception):
    """Stands for ray.exceptions.RayError."""


class FakeRay:
    """What build_ray asks of Ray: `cpus` CPUs; map_batches' actor made once in this process, its
    batches run in order; `fail`, when given, raised by iter_rows as a worker's death would be."""

    def __init__(self, cpus: int, fail: BaseException | None = None):
        self.cpus, self.fail, self.calls = cpus, fail, {}
        self.data = types.SimpleNamespace(from_items=self.from_items, ActorPoolStrategy=self.pool)
        self.exceptions = types.SimpleNamespace(RayError=FakeRayError)

    def cluster_resources(self) -> dict:
        return {"CPU": float(self.cpus)}

    def pool(self, size: int):
        self.calls["pool_size"] = size
        return ("pool", size)

    def from_items(self, rows, override_num_blocks):
        self.rows = rows
        return self

    def map_batches(self, cls, *, batch_size, compute, fn_constructor_kwargs, **remote):
        self.cls, self.kwargs = cls, fn_constructor_kwargs
        self.calls.update(remote)
        return self

    def iter_rows(self):
        if self.fail is not None:
            raise self.fail
        actor = self.cls(**self.kwargs)
        for r in self.rows:
            out = actor({k: [v] for k, v in r.items()})
            yield {k: v[0] for k, v in out.items()}


@pytest.fixture
def cli(monkeypatch):
    """main() of scripts/build.sh in this process, on the tiny CLIP and a local Ray (no RAY_ADDRESS)."""
    from evaluator.cir import build as cir_build

    monkeypatch.setenv("CLIP_MODEL_DIR", str(clip_dirs()["open_clip"]))
    monkeypatch.setenv("CLIP_DEVICE", "cpu")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return cir_build.main


def _fake_start(monkeypatch, fake: FakeRay | None) -> None:
    """build_ray.start_ray hands out `fake` (None: starting Ray fails the test)."""
    from engine.retrieval import build_ray

    def start(*args, **kwargs):       # (session, local CPUs, ...): a session gets the fake as its Ray
        assert fake is not None, "Ray was started"
        if args and hasattr(args[0], "ray"):
            args[0].ray = fake
        return fake

    monkeypatch.setattr(build_ray, "start_ray", start)


def _last(err: str) -> str:
    lines = err.strip().splitlines()
    assert not any("Traceback" in ln for ln in lines), err[-3000:]
    return lines[-1]


@needs_ray
def test_workers_beyond_the_cpus_and_the_chunks_are_capped_in_one_line(tmp_path, monkeypatch, capsys, cli):
    """--workers 1000 on 2 CPUs starts 2 actors (the line says why), with no restarts or retries;
    the index is the single build's."""
    from engine.retrieval.index import load_index

    fake = FakeRay(cpus=2)
    _fake_start(monkeypatch, fake)
    assert cli([*build_args(tmp_path / "idx"), "--ray", "--workers", "1000"]) == 0
    err = capsys.readouterr().err
    assert "--workers 1000: starting 2 actors (2 CPUs usable, 6 unfinished chunks)" in err, err[-2000:]
    assert fake.calls["pool_size"] == 2
    assert fake.calls["max_restarts"] == 0 and fake.calls["max_task_retries"] == 0
    ref, got = load_index(built_index()), load_index(tmp_path / "idx")
    assert list(ref.ids) == list(got.ids)
    np.testing.assert_allclose(np.asarray(ref.emb, np.float32), np.asarray(got.emb, np.float32), atol=2e-3, rtol=0)



def test_the_workers_are_capped_at_the_unfinished_chunks_and_a_cluster_without_room_is_one_line():
    from engine.retrieval import ray_session

    assert ray_session.capped_workers(8, 1, 64, "CPU") == (1, "--workers 8: starting 1 actors (64 CPUs usable, "
                                                             "1 unfinished chunks)")
    assert ray_session.capped_workers(2, 6, 4, "GPU") == (2, None)
    with pytest.raises(ray_session.RayBuildError, match="offers no GPU"):
        ray_session.capped_workers(2, 6, 0, "GPU")


@needs_ray
def test_a_worker_dead_for_want_of_disk_ends_the_build_in_one_line_naming_the_path(tmp_path, monkeypatch, capsys,
                                                                                   cli):
    from engine import settings

    tmp = settings.tmpdir()
    real = shutil.disk_usage
    fake = FakeRay(cpus=2, fail=FakeRayError("The actor died unexpectedly before finishing this task.\n\tclass_name: "
                                             "MapWorker\n\tpid: 123"))
    full = {"now": False}

    def usage(path):
        if full["now"] and str(path) == str(tmp):
            return Usage(100 * 1024 * MIB, 100 * 1024 * MIB - MIB, MIB)
        return real(path)

    def iter_rows(self=fake):
        full["now"] = True        # TMPDIR fills while the actors work
        raise self.fail
        yield

    fake.iter_rows = iter_rows
    monkeypatch.setattr(shutil, "disk_usage", usage)
    _fake_start(monkeypatch, fake)
    assert cli([*build_args(tmp_path / "idx"), "--ray"]) == 1
    last = _last(capsys.readouterr().err)
    assert last.startswith(f"scripts/build.sh: error: a Ray worker died for want of disk: {tmp} has 1 MiB free"), last
    assert fake.calls["max_restarts"] == 0


@needs_ray
def test_a_worker_dead_otherwise_says_rays_first_line(tmp_path, monkeypatch, capsys, cli):
    fake = FakeRay(cpus=2, fail=FakeRayError("The actor died unexpectedly before finishing this task.\n\tpid: 123"))
    _fake_start(monkeypatch, fake)
    assert cli([*build_args(tmp_path / "idx"), "--ray"]) == 1
    last = _last(capsys.readouterr().err)
    assert last == ("scripts/build.sh: error: a Ray worker died (FakeRayError): The actor died unexpectedly before "
                    "finishing this task."), last


@needs_ray
def test_a_tmpdir_without_room_for_ray_is_refused_before_anything_loads(tmp_path, monkeypatch, capsys, cli):
    from engine import settings
    from engine.retrieval import ray_session

    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(100 * 1024 * MIB, 10 * 1024 * MIB, 100 * MIB))
    _fake_start(monkeypatch, None)
    assert cli([*build_args(tmp_path / "idx"), "--ray"]) == 2
    last = _last(capsys.readouterr().err)
    need = ray_session.SESSION_MB + ray_session.RETRIEVAL.ray_object_store_mb
    assert last.startswith(f"scripts/build.sh: error: TMPDIR {settings.tmpdir()} has 100 MiB free"), last
    assert f"needs {need} MiB" in last and "set TMPDIR" in last
    assert not (tmp_path / "idx").exists()


@needs_ray
def test_ray_data_that_cannot_import_names_the_install_line(tmp_path, monkeypatch, capsys, cli):
    import sys

    monkeypatch.setitem(sys.modules, "ray.data", None)      # as when pandas or pyarrow is missing
    assert cli([*build_args(tmp_path / "idx"), "--ray"]) == 2
    last = _last(capsys.readouterr().err)
    assert last.startswith("scripts/build.sh: error: --ray needs Ray Data, which cannot be imported here"), last
    assert "pip install -e '.[scale]'" in last
    assert not (tmp_path / "idx").exists()


@needs_ray
@pytest.mark.parametrize("address", ["not-a-host:xyz", "ray://:10001", "host:99999", "a b:1"])
def test_a_malformed_ray_address_is_refused_in_one_line(tmp_path, monkeypatch, capsys, cli, address):
    monkeypatch.setenv("RAY_ADDRESS", address)
    _fake_start(monkeypatch, None)
    assert cli([*build_args(tmp_path / "idx"), "--ray"]) == 2
    last = _last(capsys.readouterr().err)
    assert last == (f"scripts/build.sh: error: RAY_ADDRESS {address!r} is not HOST:PORT, ray://HOST:PORT, auto "
                    "or local"), last


@needs_ray
def test_a_ray_address_nobody_serves_is_one_line_within_the_stated_timeout(tmp_path, monkeypatch, capsys, cli):
    from engine.retrieval import ray_session

    with socket.socket() as s:          # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    _fake_start(monkeypatch, None)
    assert cli([*build_args(tmp_path / "idx"), "--ray"]) == 1
    last = _last(capsys.readouterr().err)
    assert last.startswith(f"scripts/build.sh: error: RAY_ADDRESS 127.0.0.1:{port}: no Ray cluster answered "
                           f"within {ray_session.CONNECT_TIMEOUT_S:g} s"), last


@needs_ray
def test_a_tmpdir_too_long_for_rays_sockets_is_refused_before_anything_loads(tmp_path, monkeypatch, capsys, cli):
    from engine.retrieval import ray_session

    long = tmp_path / ("t" * 80)
    long.mkdir()
    monkeypatch.setenv("TMPDIR", str(long))
    _fake_start(monkeypatch, None)
    assert cli([*build_args(tmp_path / "idx"), "--ray"]) == 2
    last = _last(capsys.readouterr().err)
    room = ray_session.SOCKET_PATH_MAX - ray_session.SOCKET_SUFFIX
    assert last.startswith(f"scripts/build.sh: error: TMPDIR {long} is too long a path for a local Ray "
                           f"({len(str(long))} bytes; at most {room}"), last
    assert not (tmp_path / "idx").exists()
