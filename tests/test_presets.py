"""Every default of a preset field lives in its table: engine/presets/classification.py (classification, one
column per device) and engine/presets/retrieval.py (retrieval); no other module holds a literal
copy that could drift from it, and every other numeric module constant is a fact, listed in FACTS
with the reason it is not a choice."""
from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from engine import presets
from engine.presets import retrieval

REPO = Path(__file__).resolve().parent.parent
TABLES = {"engine/presets/classification.py": presets.Preset, "engine/presets/retrieval.py": retrieval.RetrievalPreset}
SCANNED = ("engine", "evaluator", "scripts")


def watched_names() -> dict[str, str]:
    """name or Owner.name -> the table field it stands for: every field of both tables by its own
    name, and by each name in its `names` metadata (what other code calls it)."""
    out: dict[str, str] = {}
    for table in TABLES.values():
        for f in dataclasses.fields(table):
            for name in (f.name, *f.metadata.get("names", ())):
                out[name] = f"{table.__name__}.{f.name}"
    return out


def _numeric(node: ast.AST) -> bool:
    """A number literal (a sign allowed), or a tuple / list of them; True and False are not numbers."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        node = node.operand
    if isinstance(node, (ast.Tuple, ast.List)):
        return bool(node.elts) and all(_numeric(e) for e in node.elts)
    return isinstance(node, ast.Constant) and type(node.value) in (int, float)


def _dest(call: ast.Call) -> str | None:
    """The attribute an add_argument call fills: dest=, else its first long flag, else its first name."""
    for k in call.keywords:
        if k.arg == "dest" and isinstance(k.value, ast.Constant):
            return k.value.value
    flags = [a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    long = [f for f in flags if f.startswith("--")]
    name = (long or flags or [None])[0]
    return name.lstrip("-").replace("-", "_") if name else None


def numeric_defaults(tree: ast.AST):
    """(owner, name, line, literal) of every numeric literal default in `tree`: dataclass-style
    field defaults (`name: T = 3`, `name: T = field(default=3)`), function parameter defaults
    (positional and keyword-only) and argparse `add_argument(..., default=3)`. The owner is the
    class of a field or a method, else the function; None for module level."""
    def visit(node, owner):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                for s in child.body:
                    if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name) and s.value is not None:
                        v = s.value
                        if isinstance(v, ast.Call) and getattr(v.func, "attr", getattr(v.func, "id", "")) == "field":
                            v = next((k.value for k in v.keywords if k.arg == "default"), None)
                        if v is not None and _numeric(v):
                            yield child.name, s.target.id, s.lineno, ast.unparse(v)
                yield from visit(child, child.name)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                here = owner if owner and child.name == "__init__" else child.name
                a = child.args
                positional = a.posonlyargs + a.args
                pairs = list(zip(positional[len(positional) - len(a.defaults):], a.defaults))
                pairs += [(arg, d) for arg, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
                for arg, d in pairs:
                    if _numeric(d):
                        yield here, arg.arg, d.lineno, ast.unparse(d)
                yield from visit(child, here)
            else:
                if isinstance(child, ast.Call) and getattr(child.func, "attr", "") == "add_argument":
                    for k in child.keywords:
                        if k.arg == "default" and _numeric(k.value):
                            yield owner, _dest(child), child.lineno, ast.unparse(k.value)
                yield from visit(child, owner)

    yield from visit(tree, None)


def literal_copies(root: Path = REPO) -> list[str]:
    watched = watched_names()
    found = []
    for pkg in SCANNED:
        for path in sorted((root / pkg).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel in TABLES:
                continue
            for owner, name, line, literal in numeric_defaults(ast.parse(path.read_text(), rel)):
                field = watched.get(f"{owner}.{name}") or watched.get(name)
                if field:
                    found.append(f"{rel}:{line}: {owner or '<module>'}.{name} = {literal} (a copy of {field})")
    return found


def test_no_numeric_default_of_a_preset_field_is_written_outside_its_table():
    """Fails when a numeric literal default for a field of either table appears in engine/ or
    evaluator/ outside the two table modules.

    Fields: every field of engine.presets.Preset and of engine.presets.retrieval.RetrievalPreset,
    each under its own name and under every name its `names` metadata lists (a bare name
    anywhere, e.g. SearchConfig's `budget_s` for `search_budget_s`; `Owner.name` only in that
    class or function, e.g. `GuardConfig.budget` for `guard_budget`, `Pic2WordConfig.hidden` for
    `p2w_hidden`).

    Forms (the numeric literals: int and float constants, negated or not, and tuples or lists of
    them; True/False are not numbers): a class-body annotated default (`name: T = 3` or
    `name: T = field(default=3)`, i.e. dataclass fields), a function parameter default
    (positional or keyword-only; a method's owner is its class), and argparse's
    `add_argument(..., default=3)` whose dest (dest=, else the first long flag) is the name.
    A default written as a reference to the table (`RETRIEVAL.dba_alpha`, `preset(d).guard_budget`)
    or a name (`TOP_K`) is not a literal and passes; so does a literal under a name no table holds.
    """
    found = literal_copies()
    assert not found, "numeric defaults of preset fields outside the tables:\n" + "\n".join(found)


def test_the_scan_finds_each_form_it_checks(tmp_path):
    (tmp_path / "engine").mkdir()
    (tmp_path / "evaluator").mkdir()
    (tmp_path / "engine" / "m.py").write_text(
        "import dataclasses\n"
        "@dataclasses.dataclass\n"
        "class SearchConfig:\n"
        "    budget_s: float = 900.0\n"
        "    dba_alpha: float = dataclasses.field(default=3.0)\n"
        "class GuardConfig:\n"
        "    budget: float = 10.0\n"
        "def photo_pixels(spec, count=256, *, chunk_size=-1):\n"
        "    pass\n"
        "def other(count=256, budget=10.0):\n"      # names watched only in their owner: not copies
        "    pass\n")
    (tmp_path / "evaluator" / "cli.py").write_text(
        "def main(p):\n"
        "    p.add_argument('--p2w-hidden', type=int, default=512)\n"
        "    p.add_argument('--size', dest='batch_size', default=(8, 16))\n"
        "    p.add_argument('--gap-shift', default=RETRIEVAL.gap_shift)\n")   # a reference: not a copy
    found = literal_copies(tmp_path)
    assert [f.split(": ", 1)[1] for f in found] == [
        "SearchConfig.budget_s = 900.0 (a copy of Preset.search_budget_s)",
        "SearchConfig.dba_alpha = 3.0 (a copy of RetrievalPreset.dba_alpha)",
        "GuardConfig.budget = 10.0 (a copy of Preset.guard_budget)",
        "photo_pixels.count = 256 (a copy of Preset.calibration_count)",
        "photo_pixels.chunk_size = -1 (a copy of RetrievalPreset.chunk_size)",
        "main.p2w_hidden = 512 (a copy of RetrievalPreset.p2w_hidden)",
        "main.batch_size = (8, 16) (a copy of Preset.batch_size)",
    ], found


# Numeric module constants (UPPER_CASE, a number or a tuple / dict / expression of numbers) that are
# facts, not choices, so no table holds them: file -> {name: why}. A new one is either a table field
# (its module reads it: `PRUNE = shared("search_prune")`) or a fact added here with its reason.
FACTS: dict[str, dict[str, str]] = {
    # units, formats and protocols: what a number means, not how much of something to use
    "engine/tuning/calibrate.py": {"BASIS_POINTS": "the unit of budgets: basis points in a rate of 1",
                                  "MIN_IMAGES": "the guard's statistical floor: tau on fewer images means nothing",
                                  "MAX_FILE_BYTES": "a limit against a hostile calibration folder"},
    "engine/tuning/command.py": {"ALL_BP": "a rate of 1 in basis points (--guard-budget's upper bound)",
                                "MAX_BATCH": "the range of --batch-size (a limit, not a default)"},
    "engine/tuning/autotune.py": {"SIMPLER": "the order of precisions by simplicity, the tie-break rule",
                                 "SCREEN_CALLS": "a screen's calls: one warm-up, two timed (the method)"},
    "engine/tuning/decoder_choice.py": {"NATURAL_SEED": "the check images' draw: another than the calibration's",
                                       "NATURAL_SIDES": "what a natural size is: smaller and larger than the input",
                                       "NATURAL_ASPECT": "the same: a photo's aspects",
                                       "NATURAL_QUALITY": "the same: a camera's JPEG qualities"},
    "engine/tuning/calibration_trade.py": {"STEP": "the trade's grid: how finely counts are weighed (its resolution)"},
    "engine/tuning/watchdog.py": {"REPEAT_S": "how often a stopped compile is told again (hygiene, not a budget)"},
    "engine/tuning/clock.py": {"MAX_WAIT_S": "a sanity bound on a wait (30 days), not a budget"},
    "engine/classify/artifact.py": {"SAMPLE_BLOCKS": "the artifact format's sampled digest (16 blocks)",
                                    "SAMPLE_BYTES": "the artifact format's sampled digest (64 KiB blocks)"},
    "engine/cli.py": {"EXIT_FAILED": "the exit status convention", "EXIT_USAGE": "the exit status convention",
                      "MAX_DEADLINE_S": "the range of every seconds option (30 days)"},
    "engine/children.py": {"GRACE_S": "a child's clean-up time after SIGTERM (process hygiene)",
                           "_PR_SET_PDEATHSIG": "linux/prctl.h"},
    "engine/classify/pipeline.py": {"LEAVE_S": "how long a stopping consumer waits for its worker (hygiene)"},
    "engine/core/checkpoint.py": {"_SHOW": "how many differing keys an error message lists"},
    "engine/core/fp8_torchao.py": {"FP8_CC": "the first compute capability with float8 GEMMs (Ada, Hopper)"},
    "engine/core/precision.py": {"FP8_MAX": "the largest float8 e4m3 value"},
    "engine/clip/spec.py": {"OPENAI_MEAN": "CLIP's normalisation (a fact of the model)",
                            "OPENAI_STD": "CLIP's normalisation (a fact of the model)"},
    "engine/clip/compiled.py": {"TEXT_LEN": "the compiled text tower's token shape (a graph shape)"},
    "engine/clip/towers.py": {"MAX_CHARS": "a limit against a hostile request", "MAX_WORD_CHARS": "the same"},
    "engine/clip/tune.py": {"COS_MIN": "a check's threshold: compiled towers equal to the reference's"},
    "engine/decoders/dali.py": {"FAST_BATCH": "a marker value of progress(), not a size"},
    "engine/decoders/isolate.py": {"MAX_RESTARTS": "a crash-loop bound of the isolated decoder",
                                   "NONE": "the wire protocol's 'no blob' length",
                                   "NORMAL": "the wire protocol's request modes", "REFERENCE": "the same",
                                   "HELLO_S": "a child's start-up bound (imports, pipeline build)"},
    "engine/decoders/pil.py": {"_PIL_FILTERS": "PIL's resampling filter numbers"},
    "engine/decoders/route.py": {"MAX_PIXELS": "PIL's decompression-bomb limit",
                                 "MAX_BLOCKS_IN_MCU": "the JPEG standard's limit",
                                 "MAX_FAST_SCANS": "a limit against a hostile progressive JPEG"},
    "engine/retrieval/options/reinspect.py": {"MAX_CROPS": "the views re-inspection defines (a range, not a default)"},
    "engine/retrieval/index.py": {"NORM_TOL": "a check's threshold: stored rows are unit vectors",
                                  "READ_TRIES": "retries of a torn read (hygiene)",
                                  "MAX_FILE": "a limit against a hostile index"},
    "engine/retrieval/jsonl.py": {"MAX_BYTES": "a limit against a hostile line", "MAX_DEPTH": "the same"},
    "engine/retrieval/ray_session.py": {"ACTOR_RESTARTS": "Ray's: none, a failed actor fails the build",
                                       "CONNECT_TIMEOUT_S": "a connection bound (hygiene)",
                                       "SESSION_MB": "the local Ray's object store floor",
                                       "RAY_DISK_LIMIT": "Ray's own disk-full threshold, restated",
                                       "SOCKET_PATH_MAX": "Linux's sun_path length less one"},
    "engine/settings.py": {"MAX_THREADS_SETTING": "the range of a setting", "MAX_BYTES_SETTING": "the same",
                           "MAX_PIXELS_SETTING": "the same", "MAX_EPOCH_S": "the same",
                           "MAX_THREADS": "the thread budget's cap (the scored sandbox bounds PIDs)"},
    # the tasks' rules and scores (evaluator/): what the benchmarks state
    "evaluator/cir/score.py": {"CIRCO_KS": "the metric's cut-offs", "CIRR_KS": "the metric's cut-offs",
                               "REWARD_B": "the reward's formula", "REWARD_A": "the reward's formula",
                               "EXAMPLES": "how many bad rows a report quotes"},
    "evaluator/cir/task.py": {"TOP_K": "the task's results per request", "MAX_REINSPECT": "the task's cap"},
    "evaluator/contest/agreement.py": {"GATE": "the contest's gate (99 % exact top-1)"},
    "evaluator/contest/task.py": {"COHORT_IMAGES": "the contest's cohort", "GATE_MARGIN": "the task's stated margin"},
    "evaluator/contest/eval_data_signs.py": {"VALIDATION_IMAGES": "ImageNet's validation set size",
                                             "TABLE_LINES": "ImageNet's class count", "TEXT_LIMIT": "a read limit"},
    "evaluator/contest/manifest.py": {"MAX_BYTES": "a limit against a hostile manifest"},
    "evaluator/evidence/disclosure.py": {"MIN_RUNS": "the evidence rules' five processes",
                                         "CV_LIMIT": "the evidence rules' 5 % CV"},
    # exit statuses, limits and the tools' own sizes (evaluator/ and scripts/: no engine default)
    "evaluator/cir/build.py": {"STOPPED": "an exit status", "_MAX_BATCH": "an option's range",
                               "_MAX_COUNT": "an option's range", "_MAX_THREADS": "an option's range"},
    "evaluator/cir/run.py": {"INTERRUPTED": "the exit status of SIGINT (128 + 2)"},
    "evaluator/cir/ablate.py": {"WARMUP": "the ablation's untimed warm-up, a measurement method"},
    "evaluator/contest/build_step.py": {"SELFCHECK_RESERVE_S": "the task's build step keeps this for its self-check",
                                        "EXIT_FAILED": "the exit status convention", "EXIT_USAGE": "the same"},
    "evaluator/contest/selfcheck.py": {"RUN_TIMEOUT_S": "a bound on one image's run (hygiene)"},
    "evaluator/contest/demo.py": {"DEFAULT_COUNT": "the demo's size", "MAX_COUNT": "an option's range",
                                  "HEARTBEAT_S": "how often a waiting line is printed"},
    "evaluator/evidence/conditions.py": {"QUIET_LOAD_PER_CORE": "what the report calls a quiet machine"},
    "evaluator/evidence/runs.py": {"MIN_COUNT": "the min profile's generated images"},
    "evaluator/evidence/workloads/cir.py": {"PER_TEMPLATE": "the generated corpus's group size"},
    "evaluator/synthetic/cohort.py": {"TINY_KWARGS": "the tiny test model's shape", "TINY_INPUT": "the same",
                                      "TEMPLATE_SEED": "the canonical seed"},
    "scripts/device_probes.py": {"SCORED_GPU_MAJOR": "the scored machine's GPU (Hopper: compute capability 9)"},
    "scripts/device_check.py": {"ABI_NEED_S": "a step's estimated cost, for its plan",
                                "SEARCH_EXIT_S": "the same: the search's verification and exit after its deadline",
                                "BUILD_NEED_S": "a step's estimated cost, for its plan"},
    "evaluator/rehearsal/emulated_plan.py": {"GLIBC": "bookworm's glibc: the newest manylinux tag its wheels may carry",
                                             "NEOVERSE_V2_MIDR": "Arm Neoverse V2's MIDR_EL1 (a hardware fact)",
                                             "TINY_COUNT": "the rehearsal's smoke run: a few images, not a measure",
                                             "STEP_TIMEOUT_S": "a bound against a hung emulated step (hygiene)"},
    "scripts/walk.py": {"DEPTH": "the walk's definition: how deep a parameter's containers are searched"},
    "scripts/device_harness.py": {"LOG_TAIL": "how much of a log comes back", "LOG_MAX": "the same"},
    "scripts/lock_metadata.py": {"PYTHON": "the scored image's Python", "GLIBC": "the scored image's glibc",
                                 "CHUNK": "a read size"},
}


def _numeric_value(node: ast.AST) -> bool:
    """A number, a tuple / list / dict of numbers, or an expression of numbers (`64 << 20`)."""
    if isinstance(node, ast.BinOp):
        return _numeric_value(node.left) and _numeric_value(node.right)
    if isinstance(node, ast.Dict):
        return bool(node.values) and all(_numeric_value(v) for v in node.values)
    return _numeric(node)


def numeric_constants(root: Path = REPO) -> list[tuple[str, str, int]]:
    """(file, NAME, line) of every module-level UPPER_CASE constant given a numeric literal value,
    outside the two tables."""
    out = []
    for pkg in SCANNED:
        for path in sorted((root / pkg).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel in TABLES:
                continue
            for node in ast.parse(path.read_text(), rel).body:
                targets = node.targets if isinstance(node, ast.Assign) else \
                    [node.target] if isinstance(node, ast.AnnAssign) and node.value is not None else []
                pairs = [(t, node.value) for t in targets]
                for t, v in list(pairs):   # NAME_A, NAME_B = 3, 2.0: each name with its value
                    if isinstance(t, ast.Tuple) and isinstance(v, ast.Tuple) and len(t.elts) == len(v.elts):
                        pairs += list(zip(t.elts, v.elts))
                for t, v in pairs:
                    if isinstance(t, ast.Name) and t.id.lstrip("_").isupper() and _numeric_value(v):
                        out.append((rel, t.id, node.lineno))
    return out


def test_every_numeric_module_constant_is_a_table_field_or_a_listed_fact():
    """A module constant with a literal number is a choice in hiding unless FACTS says why it is a fact:
    a choice belongs in a table, its module reading it (`TIE = shared("retime_tie")`)."""
    found = numeric_constants()
    new = [f"{rel}:{line}: {name}" for rel, name, line in found if name not in FACTS.get(rel, {})]
    assert not new, ("numeric module constants neither read from a table nor listed in FACTS (tests/test_presets.py):\n"
                     + "\n".join(new))
    gone = {(rel, name) for rel, names in FACTS.items() for name in names} - {(r, n) for r, n, _ in found}
    assert not gone, f"FACTS lists constants that are no longer numeric literals there: {sorted(gone)}"
    for rel, names in FACTS.items():
        assert all(why.strip() for why in names.values()), rel


def test_the_constant_scan_finds_each_form(tmp_path):
    for pkg in SCANNED:
        (tmp_path / pkg).mkdir()
    (tmp_path / "scripts" / "s.py").write_text("PRUNE = 0.6\nBATCHES = {'cpu': (4, 8)}\nLIMIT = 64 << 20\n"
                                               "_HIDDEN: float = -1.5\nNAME = 'x'\nFLAG = True\n"
                                               "TIE = shared('retime_tie')\nlower = 3\ndef f():\n    INNER = 2\nCALLS, SECONDS = 3, 2.0\n")
    assert [n for _, n, _ in numeric_constants(tmp_path)] == ["PRUNE", "BATCHES", "LIMIT", "_HIDDEN", "CALLS",
                                                              "SECONDS"]


def test_a_shared_field_is_one_value_on_every_device(monkeypatch):
    """A module constant reads a field every device's preset holds alike; once a device sets its own, the
    read fails instead of taking one device's value."""
    assert presets.shared("search_prune") == presets.preset("cpu").search_prune == presets.preset("cuda").search_prune
    monkeypatch.setitem(presets.PRESETS, "cuda", dataclasses.replace(presets.preset("cuda"), search_prune=0.5))
    with pytest.raises(ValueError, match="search_prune"):
        presets.shared("search_prune")


def test_every_field_says_what_it_means():
    for table in TABLES.values():
        for f in dataclasses.fields(table):
            if f.name != "device":
                assert f.metadata.get("doc", "").strip(), f"{table.__name__}.{f.name} has no doc"


@pytest.mark.abi
def test_python_m_engine_presets_prints_both_tables():
    r = subprocess.run([sys.executable, "-m", "engine.presets"], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    classification, retrieval_table = r.stdout.strip().split("\n\n")
    assert classification == presets.markdown() and retrieval_table == retrieval.markdown()
    assert "| `guard_budget` | 10.0 | 10.0 |" in classification
    assert "| `dba_alpha` | 3.0 |" in retrieval_table and "| `image_batch` | cpu: 64, cuda: 256 |" in retrieval_table


def test_the_build_help_says_what_each_option_does_and_prints_the_presets_values():
    from engine.tuning import argument_parser

    p = argument_parser()
    text = " ".join(p.format_help().split())          # argparse wraps long help lines
    for field in ("precision", "backend", "batch_size", "search_budget_s", "build_deadline_s", "recheck_batch",
                  "guard_budget", "guard_safety", "calibration_count"):
        assert presets.per_device(field) in text, field
    for action in p._actions:
        assert (action.help or "").strip(), f"{action.option_strings} has no help"


def test_the_defaults_compose_quotes_in_prose_are_the_tables():
    """engine.retrieval.compose's docstring shows each option with its default (`aqe[:n=3:alpha=3]`)
    and Slerp's text weights: every number it quotes is the value a method built from that name gets."""
    import re

    from engine.retrieval import compose
    from engine.retrieval.options import named

    doc = compose.__doc__
    checked = set()
    for opt, brackets in re.findall(r"`([a-z-]+)((?:\[:[^\]`]*\])+)`", doc):
        if opt not in named():          # `option[:key=value...]`: the syntax itself
            continue
        method = compose.make_method(f"slerp+{opt}")
        for pair in re.findall(r"[a-z]+=[^:\]]+", brackets):
            key, value = pair.split("=")
            if re.fullmatch(r"[0-9.]+", value):
                got = getattr(method.option(opt), named()[opt].keys[key].attr)
                assert float(got) == float(value), f"compose's docstring says {opt}:{key}={value}; the default is {got}"
                checked.add((opt, key))
    assert checked >= {("isoftmax", "beta"), ("qbnorm", "beta"), ("dual-softmax", "temp"), ("csls", "k"),
                       ("aqe", "n"), ("aqe", "alpha"), ("dba", "n"), ("dba", "alpha"), ("reinspect", "n"),
                       ("reinspect", "crops")}, checked
    weights = re.search(r"text\s+weight ([0-9.]+) for requests with a shared_concept[^.]*?and ([0-9.]+) otherwise",
                        doc)
    assert weights and tuple(map(float, weights.groups())) == tuple(compose.DEFAULT_WEIGHTS["slerp"])
