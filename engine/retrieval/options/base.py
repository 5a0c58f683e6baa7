"""What a retrieval option is: a name, its keys with their defaults, its checks, its hooks.

An option is one file of engine/retrieval/options/ holding one `Option` subclass, and one line
of the `OPTIONS` table (engine/retrieval/options/__init__.py). A method name adds it after `+`
(`slerp+NAME:key=value`); the query pipeline (engine.retrieval.query.QueryPipeline) calls the
hooks it defines in the table's order, and the index build (engine.retrieval.index_extras) asks
it what to store. Nothing else names it.

An instance is a value (its keys' values, compared and hashed as such); what a hook computes
for one pipeline lives on that pipeline's `Workspace` (`space`: engine.retrieval.query), never on
the option. The workspace holds the index's data (meta.json, ids, the stored files the option
`reads`), not the index.

Hooks, each a no-op here (the pipeline calls only those a subclass defines), in the order the
pipeline calls them:

    set-up    reads(meta) -> names            the index's stored files it needs (read once, space.stored)
              load(space)                     read what the build stored (a trained mapping)
              gallery_rows(space, rows) -> rows the gallery rows before comparison (DBA)
              setup(space)                    the comparison space, helpers (gap, re-inspection)
    per call  begin_call(space)               reset per-call state, refuse what cannot run
              prepare_texts(space, call)      statistics of the call's texts (a text mean)
              prepare(space, call)            statistics of the call's composed queries (a bank)
    answer    encode_texts(space, batch, texts, ref_t) -> rows | None   the text side (pic2word)
              image_side / text_side(space, rows) -> rows               the comparison space (gap)
              expand(space, scored, ref_t, topk) -> Scored              a second look (alpha-QE)
              depth(space) -> int                                       candidates the top-k keeps
              rescore(space, batch, scored, vals, idx) -> (vals, idx)   the final list (re-inspection)
    report    summary(space) -> dict          (classmethod) keys every run's summary holds
    build     extras(ctx) -> (meta, files)    (classmethod) what the index stores for it

A scorer (a hubness scorer, engine/retrieval/options/hubness.py) also gives
`row_state(space, cos, ref_t)` and `scores(space, cos, state, cols)`; the pipeline scores with the
one option of the method that has them (cosines alone without one). A set-up or per-call hook
that cannot run raises `space.Error` (one line; the pipeline adds the index folder).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class Key:
    """One `key=value` of an option: the attribute it sets, its default, its type (int, float, str)."""
    attr: str
    default: Any
    kind: type


class Option:
    name: ClassVar[str] = ""          # the head in a method name: `base+NAME[:key=value...]`
    source: ClassVar[str] = ""        # published (with its source) or this kit's own variant (--help)
    keys: ClassVar[dict[str, Key]] = {}
    group: ClassVar[str] = ""         # one option of a group at a time ("gap correction", "hubness scorer")
    base: ClassVar[str] = ""          # implied by this base method, never named after `+` (pic2word)
    trained: ClassVar[bool] = False   # learned at build time: a `--mapping` choice of the build
    extra_files: ClassVar[tuple[str, ...]] = ()   # the index's optional data files it writes
    # the flat method record (meta.json `method`, a run's identity): field -> value with the option off
    record_defaults: ClassVar[dict[str, Any]] = {}

    def __init__(self, **values) -> None:
        attrs = {k.attr: k for k in self.keys.values()}
        for key in self.keys.values():
            object.__setattr__(self, key.attr, key.default)
        for attr, value in values.items():
            if attr not in attrs:
                raise ValueError(f"{self.name} has no setting {attr!r}")
            object.__setattr__(self, attr, value)
        self.validate()

    # ------------------------------------------------------------ a value
    def __setattr__(self, attr, value):
        raise AttributeError(f"{self.name}: an option is a value; make a new one")

    def values(self) -> dict:
        """attribute -> value, in the keys' order."""
        return {k.attr: getattr(self, k.attr) for k in self.keys.values()}

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and other.values() == self.values()

    def __hash__(self) -> int:
        return hash((self.name, tuple(self.values().items())))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.values().items())})"

    def validate(self) -> None:
        """ValueError (one line) when a value is out of its range."""

    @property
    def active(self) -> bool:
        """False when the values switch it off (aqe:n=0): the method drops it."""
        return True

    @property
    def label(self) -> str:
        """`name[:key=value...]` with the values that differ from the keys' defaults."""
        parts = [self.name]
        for key, spec in self.keys.items():
            value = getattr(self, spec.attr)
            if value != spec.default:
                parts.append(f"{key}={value:g}" if isinstance(value, float) else f"{key}={value}")
        return ":".join(parts)

    @classmethod
    def parse(cls, spec: str, pairs: list[str]) -> Option:
        """An instance from `key=value` strings (`spec` names the whole method in messages)."""
        values = {}
        for pair in pairs:
            key, eq, raw = pair.partition("=")
            if not eq or key not in cls.keys:
                raise ValueError(f"{spec!r}: {cls.name} takes {', '.join(k + '=' for k in cls.keys)} got {pair!r}")
            k = cls.keys[key]
            try:
                values[k.attr] = k.kind(raw)
            except ValueError:
                raise ValueError(f"{cls.name} {key}: {raw!r} is not a number") from None
        return cls(**values)

    def within(self, max_reinspect: int | None, say) -> Option:
        """This option kept to the caller's per-request re-inspection limit (a copy, the cut said
        through `say`), or itself."""
        return self

    def inspected(self) -> int:
        """Candidate images per request it re-inspects visually (a caller's per-request limit counts them)."""
        return 0

    def missing(self, meta: dict, corpus) -> str | None:
        """Why an index (its meta.json) cannot run it, or None (ablation's default set)."""
        return None

    # ------------------------------------------------------------ the flat record (the index format)
    def record(self) -> dict:
        """This option's fields of the flat method record (meta.json `method`)."""
        return {}

    @classmethod
    def from_record(cls, flat: dict) -> Option | None:
        """The option a flat method record switches on, or None."""
        return None

    # ------------------------------------------------------------ what a pipeline needs
    def needs_text_bank(self) -> bool:
        """Whether the pipeline loads the index's gallery-derived texts for it."""
        return False

    def needs_requests(self, space) -> bool:
        """Whether every request of a call is encoded before any is answered (transductive)."""
        return False

    @property
    def uses_requests(self) -> bool:
        """Whether an answer depends on the call's other requests (decided by the values alone)."""
        return False

    # ------------------------------------------------------------ hooks (see the module docstring)
    def reads(self, meta: dict) -> tuple[str, ...]:
        return ()

    def load(self, space) -> None:
        pass

    def gallery_rows(self, space, rows):
        return rows

    def setup(self, space) -> None:
        pass

    def begin_call(self, space) -> None:
        pass

    def prepare_texts(self, space, call) -> None:
        pass

    def prepare(self, space, call) -> None:
        pass

    def encode_texts(self, space, batch, texts: list[str], ref_t):
        return None

    def image_side(self, space, rows):
        return rows

    def text_side(self, space, rows):
        return rows

    def expand(self, space, scored, ref_t, topk):
        return scored

    def depth(self, space) -> int:
        return 0

    def rescore(self, space, batch, scored, vals, idx):
        return vals, idx

    @classmethod
    def summary(cls, space) -> dict:
        """Keys every run's summary holds for this option, named in the method or not."""
        return {}

    @classmethod
    def extras(cls, ctx) -> tuple[dict, dict]:
        """(meta.json additions, {extra file name: (suffix, bytes)}) the build stores for it
        (engine.retrieval.index_extras.ExtrasContext: the build's extras settings, the gallery rows)."""
        return {}, {}


# the hooks the pipeline asks each option of a method for once (engine.retrieval.query.Hooks)
HOOKS = ("reads", "load", "gallery_rows", "setup", "needs_text_bank", "begin_call", "needs_requests",
         "prepare_texts", "prepare", "encode_texts", "image_side", "text_side", "expand", "depth", "rescore",
         "summary")


def defines(cls: type, hook: str) -> bool:
    """Whether option class `cls` has its own `hook` (not Option's no-op)."""
    own, default = getattr(cls, hook), getattr(Option, hook)
    return getattr(own, "__func__", own) is not getattr(default, "__func__", default)


class NeighbourMean(Option):
    """An option that moves a row toward its `n` nearest rows weighted by `alpha` (aqe on the query
    side, dba on the gallery's): the keys `n` and `alpha`, recorded flat as NAME and NAME_alpha."""
    n: int
    alpha: float

    def validate(self) -> None:
        if self.n < 0:
            raise ValueError("aqe / dba neighbours must be >= 0")
        if self.alpha < 0:
            raise ValueError("alpha must be >= 0")

    @property
    def active(self) -> bool:
        return self.n > 0

    def record(self) -> dict:
        return {self.name: self.n, f"{self.name}_alpha": self.alpha}

    @classmethod
    def from_record(cls, flat: dict):
        n = flat.get(cls.name, 0)
        return cls(n=n, alpha=flat.get(f"{cls.name}_alpha", cls.keys["alpha"].default)) if n else None
