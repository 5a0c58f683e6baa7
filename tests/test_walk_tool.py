"""scripts/walk.py: the reading walk over a call tree, what carries a value, and the layers."""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _walk_module():
    spec = importlib.util.spec_from_file_location("walk_tool", REPO / "scripts" / "walk.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["walk_tool"] = mod   # dataclasses resolve their module by name
    spec.loader.exec_module(mod)
    return mod


walk = _walk_module()


def node(module, function, carried=True, children=()):
    return walk.Node(module, function, object() if function != "same" else SAME, carried, list(children))


SAME = object()


def test_carries_follows_paths_containers_closures_and_partials():
    needle = "/data/walk-root"

    @dataclasses.dataclass
    class Job:
        root: Path

    def make():
        root = Path(needle) / "images"
        return lambda: root

    assert walk.carries(Path(needle) / "x.jpg", needle)
    assert walk.carries({"a": [1, needle + "/y"]}, needle)
    assert walk.carries(Job(Path(needle)), needle)
    assert walk.carries(make(), needle)
    assert walk.carries(functools.partial(print, needle), needle)
    assert not walk.carries({"a": {"b": {"c": needle}}}, needle)   # deeper than two levels
    assert not walk.carries(["/data/other"], needle)


def test_reading_order_stays_returns_and_climbs():
    # evaluator.run -> engine.classify.pipeline -> evaluator.run's callback (a climb) -> engine.io
    tree = node("evaluator.run", "main", children=[
        node("evaluator.run", "parse"),
        node("engine.classify.pipeline", "classify", children=[
            node("engine.helper_not_carried", "step", carried=False, children=[
                node("evaluator.run", "read", children=[node("engine.io", "read_regular")]),
            ]),
        ]),
    ])
    w = walk.read([tree])
    counts = w.counts()
    assert counts["modules"] == ["evaluator.run", "engine.classify.pipeline", "engine.io"]
    # run, pipeline, run (the callback), io, run (return), pipeline (return), run (return)
    assert counts["stays"] == 7 and counts["returns"] == 3
    assert counts["climbs"] == 1   # the pipeline calling the evaluator's reader


def test_a_function_is_read_once():
    tree = node("a.m", "main", children=[node("b.m", "same"), node("b.m", "same"), node("c.m", "other")])
    assert walk.read([tree]).counts()["stays"] == 5   # a, b, a, c, a: the second call of `same` passed through


def test_layers_order_engine_below_the_evaluator():
    assert walk.layer("kernels.topk") < walk.layer("engine.io") < walk.layer("engine.decoders.pil")
    assert walk.layer("engine.classify.pipeline") < walk.layer("engine.retrieval.query") < walk.layer("evaluator.cir.run")
