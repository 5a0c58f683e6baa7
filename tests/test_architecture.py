"""The layout's rules, checked on the source: no import cycles, a backend named only by its
own file and the registry, the environment read only in the settings modules, a thin
evaluator top level, and the engine free of task rules."""
from __future__ import annotations

import ast
import re
import subprocess
import tokenize
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "evaluator", "kernels")


def _source_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout.split()
    return [REPO / f for f in out if (REPO / f).is_file()]


def _modules() -> dict[str, Path]:
    mods = {}
    for p in _source_files():
        rel = p.relative_to(REPO)
        if p.suffix == ".py" and rel.parts[0] in PACKAGES:
            name = ".".join(rel.with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = p
    return mods


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    """Project modules `name` imports anywhere in its file: at the top, inside functions, under
    `if TYPE_CHECKING:` (a type-only import is still an arrow between the two), and by
    importlib.import_module / __import__ given a literal name."""
    return {m for _, m in _import_lines(path, name, known)}


def _import_lines(path: Path, name: str, known: set[str]) -> list[tuple[int, str]]:
    """(line, project module) of every import in `name`'s file (see _imports)."""
    tree = ast.parse(path.read_text())
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name in known]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".") if is_pkg else name.split(".")[:-1]
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            for a in node.names:
                full = f"{base}.{a.name}"
                out.append((node.lineno, full if full in known else base))
    out += _import_calls(tree)
    return sorted({(line, m) for line, m in out if m in known and m != name})


def test_no_import_cycles():
    mods = _modules()
    graph = {m: _imports(p, m, set(mods)) for m, p in mods.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycle = stack[stack.index(n):] + [n]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not any(m.startswith("engine") and any(n.startswith("evaluator") for n in deps)
                   for m, deps in graph.items()), "engine/ must never import evaluator/"


def engine_layers() -> dict[str, int]:
    """Folder -> layer, read from engine/__init__.py's table (`(root)` stands for the root modules)."""
    doc = ast.get_docstring(ast.parse((REPO / "engine" / "__init__.py").read_text())) or ""
    layers = {}
    for rank, folders in re.findall(r"^ {4}(\d)\s{2,}((?:\(root\)|\w+/)(?:, (?:\(root\)|\w+/))*)", doc, re.M):
        for folder in folders.split(", "):
            layers[folder.rstrip("/")] = int(rank)
    return layers


# the layer rule's exceptions: the API facade imports classify/ and retrieval/ on first use, the build
# command's name (engine/build.py: `python -m engine.build`) hands over to tuning/; engine.settings
# checks ENGINE_DECODER and CLIP_TOWERS against the registries' name tables, which import nothing of the engine
FACADE = "engine"
COMMAND_MODULES = {"engine.build": "engine.tuning"}
NAME_TABLES = {"engine.decoders.registry", "engine.backends"}


def _folder(module: str, layers: dict[str, int]) -> str:
    """engine.core.spec -> core; engine.backends -> backends; engine.settings -> (root)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in layers else "(root)"


def layer_violations(mods: dict[str, Path]) -> list[str]:
    """Every import in engine/ that points up a layer or sideways to a sibling folder on its own layer."""
    layers = engine_layers()
    known = set(mods)
    out = []
    for name, path in sorted(mods.items()):
        if not name.startswith("engine") or name == FACADE:
            continue
        if name in COMMAND_MODULES:      # a command's name: it imports the one package it names, nothing else
            wrong = [(line, t) for line, t in _import_lines(path, name, known)
                     if t.startswith("engine") and not t.startswith(COMMAND_MODULES[name])]
            out += [f"{path.relative_to(REPO)}:{line} imports {t} (the command name {name} hands over to "
                    f"{COMMAND_MODULES[name]} only)" for line, t in wrong]
            continue
        here = _folder(name, layers)
        for line, target in _import_lines(path, name, known):
            if not target.startswith("engine"):
                continue
            there = _folder(target, layers) if target != FACADE else "(facade)"
            if there == here or (name == "engine.settings" and target in NAME_TABLES):
                continue
            if layers.get(there, 99) >= layers[here]:
                out.append(f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}:{line} imports {target} "
                           f"({there}, layer "
                           f"{layers.get(there, '?')}) from layer {layers[here]} ({here})")
    return out


def test_engine_imports_point_down_the_layers():
    """engine/__init__.py's table of layers holds every folder of engine/, and every import in engine/
    (top-level, function-local, type-only, importlib with a literal name) names a module of its own
    folder or of a lower layer."""
    layers = engine_layers()
    assert set(layers) == ENGINE_PACKAGES | {"(root)"}, f"engine/__init__.py's layers name {sorted(layers)}"
    mods = _modules()
    found = layer_violations(mods)
    assert not found, "imports against the layers (engine/__init__.py):\n" + "\n".join(found)
    for target in NAME_TABLES:   # what the settings read may carry no arrow of its own
        assert not {m for m in _imports(mods[target], target, set(mods)) if m.startswith("engine")}, target


def test_the_layer_check_sees_every_kind_of_import(tmp_path):
    """A planted upward import is found in each form: top-level, inside a function, type-only, importlib."""
    planted = tmp_path / "planted.py"
    planted.write_text("from typing import TYPE_CHECKING\nimport engine.io\n"
                       "from engine.classify.runtime import load_runtime\n"
                       "if TYPE_CHECKING:\n    from engine.tuning.table import Rows\n"
                       "def f():\n    from engine.retrieval import search\n"
                       "    importlib.import_module('engine.clip.tune')\n")
    mods = {m: p for m, p in _modules().items() if m.startswith("engine")}
    mods["engine.decoders.planted"] = planted
    found = [f.split(" imports ")[1].split()[0] for f in layer_violations(mods) if "planted" in f]
    assert found == ["engine.classify.runtime", "engine.tuning.table", "engine.retrieval.search",
                     "engine.clip.tune"], found


def _imported_names(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of every absolute import anywhere in the tree (function-local ones too),
    and of importlib.import_module / __import__ calls given a literal name."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            out.append((node.lineno, node.module or ""))
    return out + _import_calls(tree)


def _import_calls(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of every importlib.import_module / __import__ call given a literal name."""
    return [(node.lineno, node.args[0].value) for node in ast.walk(tree)
            if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and ast.unparse(node.func) in ("import_module", "importlib.import_module", "__import__")]


def test_kernels_is_a_leaf():
    """kernels/ imports neither engine/ nor evaluator/: its callers pass in what it needs (the
    backend a setting chose, a file writer)."""
    files = [p for p in _source_files() if p.suffix == ".py" and p.relative_to(REPO).parts[0] == "kernels"]
    assert files
    for path in files:
        for line, module in _imported_names(ast.parse(path.read_text())):
            top = module.split(".")[0]
            assert top not in ("engine", "evaluator"), f"{path.relative_to(REPO)}:{line} imports {module}"
    planted = ast.parse("def f():\n    from engine import settings\nimport evaluator.cir\n"
                        "importlib.import_module('engine.io')\n")
    assert [m for _, m in _imported_names(planted)] == ["evaluator.cir", "engine", "engine.io"]


def test_evaluator_top_level_is_thin_commands_and_subpackages():
    top = sorted(p.name for p in (REPO / "evaluator").glob("*.py"))
    subpackages = sorted(p.parent.name for p in (REPO / "evaluator").glob("*/__init__.py"))
    assert len(top) <= 14, top
    assert len(subpackages) >= 3, subpackages
    for p in (REPO / "evaluator").glob("*.py"):
        if p.name not in ("__init__.py", "settings.py"):
            assert len(p.read_text().splitlines()) <= 12, f"{p.name} is a command: keep it a thin entry point"


def _string_literals(path: Path) -> list[tuple[int, str]]:
    with open(path, "rb") as f:
        return [(t.start[0], ast.literal_eval(t.string)) for t in tokenize.tokenize(f.readline)
                if t.type == tokenize.STRING and not t.string.startswith(('f"', "f'", 'rb', 'b"', "b'"))
                and not t.string.startswith(('"""', "'''"))]


def test_a_backend_is_named_only_by_its_own_file_and_the_registry():
    from engine.backends import BACKENDS

    registry = REPO / "engine" / "backends" / "__init__.py"
    for path in _source_files():
        rel = path.relative_to(REPO)
        if rel.parts[0] in ("tests", "docs") or path.suffix in (".md", ".json", ".tsv", ".txt", ".toml"):
            continue
        for name in BACKENDS:
            own = REPO / "engine" / "backends" / f"{name}.py"
            if path in (own, registry):
                continue
            if path.suffix == ".py":
                hits = [line for line, s in _string_literals(path) if s == name]
            else:  # shell scripts and the Dockerfile: the name as a backend choice or in a list of choices
                text = path.read_text(errors="replace")
                n = re.escape(name)
                choice = re.compile(rf"backend\w*[\s=:\-\"']+{n}\b|(?<![\w/.-]){n}\s*\|\s*\w|\w\s*\|\s*{n}(?![\w/.-])",
                                    re.I)
                hits = [i for i, line in enumerate(text.splitlines(), 1) if choice.search(line)]
            assert not hits, f"{rel}:{hits[0]} names backend {name!r}: ask engine.backends instead"


def test_adding_a_backend_is_one_file_and_one_entry(tmp_path, monkeypatch):
    """A backend defined in one module and registered once builds, loads and runs through the ABI code."""
    import numpy as np
    import torch

    from engine import backends
    from engine.classify.artifact import load_artifact
    from engine.classify.runtime import load_runtime
    from engine.core.spec import Spec
    from engine.tuning import build

    mod = tmp_path / "backend_seven.py"
    mod.write_text(
        "import torch\nNAME = 'seven'\nFILES = ('seven.txt',)\nCOMPILED = ('.seven',)\nNEEDS_WEIGHTS = False\n"
        "def save(net, spec, device, out_dir, margin=False):\n    (out_dir / FILES[0]).write_text('7')\n    return {'seven': 1}\n"
        "def load(artifact, device):\n    k = int(artifact.path(FILES[0]).read_text())\n"
        "    return lambda x: torch.full((x.shape[0],), k, dtype=torch.int32)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(backends.BACKENDS, "seven", "backend_seven")
    spec = Spec(model="any", input_size=16, batch_size=4)
    meta = build(spec, None, tmp_path / "art", backend="seven")
    assert meta["seven"] == 1 and meta["files"]["seven.txt"]["bytes"] == 1
    rt = load_runtime(load_artifact(tmp_path / "art"))
    assert rt.run(np.zeros((4, 16, 16, 3), np.uint8)).tolist() == [7, 7, 7, 7]
    assert ".seven" in backends.compiled_suffixes()
    assert torch.is_tensor(rt.run_async(np.zeros((4, 16, 16, 3), np.uint8)))


def test_the_environment_is_read_only_in_the_settings_modules():
    allowed = {REPO / "engine" / "settings.py", REPO / "evaluator" / "settings.py"}
    read = re.compile(r"os\.environ\.get\(|os\.environ\[|os\.getenv\(|environ\.setdefault\(")
    for path in _source_files():
        rel = path.relative_to(REPO)
        if path.suffix != ".py" or rel.parts[0] not in PACKAGES or path in allowed:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            assert not read.search(line), f"{rel}:{i} reads the environment: use engine.settings / evaluator.settings"


# the contest's cohort sizes (10,000 scored images, 50,000 validation images) and ImageNet's file
# names, in any spelling: the engine is told them by its caller (evaluator.contest)
CONTEST_NUMBERS = re.compile(r"(?<![\w.])(?<!\d,)(?:10_?000|10,000|50_?000|50,000)(?!\w|,\d)|ilsvrc", re.IGNORECASE)
# a number that is not the cohort: the retrieval table's decoded-row cache size (engine/presets/retrieval.py)
NOT_THE_COHORT = {"engine/presets/retrieval.py": "cached per call\", 50_000,"}


def test_the_engine_knows_no_task():
    for path in (REPO / "engine").rglob("*.py"):
        text = path.read_text()
        rel = path.relative_to(REPO).as_posix()
        for word in ("/task/", "the task", "contest"):
            assert word not in text.lower(), f"{rel} mentions {word!r}"
        for i, line in enumerate(text.splitlines(), 1):
            if NOT_THE_COHORT.get(rel, "\0") in line:
                continue
            hit = CONTEST_NUMBERS.search(line)
            assert not hit, f"{rel}:{i} names the contest's {hit.group()!r}: take it from the caller"
    assert CONTEST_NUMBERS.search("PER = 10_000") and CONTEST_NUMBERS.search("counts = 10000, 5")
    assert CONTEST_NUMBERS.search("per 10,000 images") and CONTEST_NUMBERS.search('"ILSVRC2012" + "_val_"')
    assert not CONTEST_NUMBERS.search("budget 1e4, 100_000 rows, 110,000 px, 1.10000, 10,000,000 B")


def test_bad_settings_are_one_clear_error(monkeypatch):
    from engine import settings

    for var, value, getter in [("ENGINE_READERS", "0", settings.readers), ("ENGINE_READERS", "abc", settings.readers),
                               ("ENGINE_DECODER", "foo", settings.decoder),
                               ("ENGINE_CUDA_GRAPHS", "maybe", settings.cuda_graphs),
                               ("CLIP_DEVICE", "tpu", settings.clip_device)]:
        monkeypatch.setenv(var, value)
        with pytest.raises(settings.SettingsError, match=var):
            getter()
    monkeypatch.setenv("ENGINE_READERS", "3")
    assert settings.readers() == 3
    monkeypatch.delenv("ENGINE_READERS")
    assert settings.readers() is None  # unset: engine.threads derives it from ENGINE_THREADS


# what makes a retrieval engine: the index format, the gallery embedding, the query pipeline and the API
RETRIEVAL_ENGINE = {
    "engine/retrieval/index.py": {"FORMAT", "BUILD_DIR", "EXTRA_FILES", "KERNEL_DIR", "Index", "ChunkStore",
                                  "load_index", "read_meta", "commit"},
    "engine/retrieval/index_extras.py": {"ExtrasConfig", "extras_key", "build_extras"},
    "engine/retrieval/gallery.py": {"build", "commit_with_extras", "store_kernels", "reuse_embeddings"},
    "engine/retrieval/query.py": {"QueryPipeline", "PipelineError"},
    "engine/retrieval/search.py": {"Searcher", "open_index"},
}


def _defined(path: Path) -> set[str]:
    """Classes and functions defined anywhere in the file, and its module-level constants."""
    tree = ast.parse(path.read_text())
    names = {n.name for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))}
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) \
            else []
        names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def test_the_retrieval_engine_lives_in_the_engine():
    """The index format, the gallery embedding and the query pipeline are engine modules; evaluator/cir
    keeps the commands, the task's rules and the scores (and calls the engine)."""
    for rel, names in RETRIEVAL_ENGINE.items():
        missing = names - _defined(REPO / rel)
        assert not missing, f"{rel} no longer defines {sorted(missing)}: update RETRIEVAL_ENGINE"
    engine_only = {"FORMAT", "BUILD_DIR", "EXTRA_FILES", "KERNEL_DIR", "Index", "ChunkStore", "load_index",
                   "ExtrasConfig", "build_extras", "commit_with_extras", "store_kernels", "reuse_embeddings",
                   "QueryPipeline", "PipelineError", "Searcher", "open_index", "Progress"}
    for path in sorted((REPO / "evaluator" / "cir").rglob("*.py")):
        again = _defined(path) & engine_only
        assert not again, f"{path.relative_to(REPO)} defines {sorted(again)}: that is engine/retrieval's work"
    for path in sorted((REPO / "evaluator").rglob("*.py")):
        again = _defined(path) & {"QueryPipeline", "ChunkStore", "Index", "Searcher", "commit_with_extras"}
        assert not again, f"{path.relative_to(REPO)} defines {sorted(again)}: that is engine/retrieval's work"



def test_ray_is_imported_by_the_ray_build_only():
    """Ray is an optional extra (requirements/scale.txt): the Ray build and its session import it, nothing else."""
    allowed = {REPO / "engine" / "retrieval" / "build_ray.py", REPO / "engine" / "retrieval" / "ray_session.py"}
    users = []
    for p in _source_files():
        if p.suffix != ".py" or p.relative_to(REPO).parts[0] not in PACKAGES:
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            if any(n == "ray" or n.startswith("ray.") for n in names):
                users.append(p)
    assert users and set(users) <= allowed, f"ray imported in {sorted(str(u.relative_to(REPO)) for u in users)}"


# the engine in folders by job: a few shared modules at its root, each job a package
ENGINE_ROOT_MODULES = {"__init__", "build", "children", "cli", "io", "memory", "process_stats", "progress",
                       "settings", "stdio", "threads"}
ENGINE_PACKAGES = {"backends", "classify", "clip", "core", "decoders", "presets", "retrieval", "tuning"}


def test_engine_is_in_folders_by_job():
    engine = REPO / "engine"
    tracked = {p.relative_to(engine) for p in _source_files() if p.is_relative_to(engine) and p.suffix == ".py"}
    root = {p.stem for p in tracked if len(p.parts) == 1}
    packages = {p.parts[0] for p in tracked if len(p.parts) > 1}
    assert len(root) - 1 <= 10, f"engine/ holds {len(root) - 1} modules at its root (at most 10): {sorted(root)}"
    assert root == ENGINE_ROOT_MODULES, f"engine/'s root modules changed: {sorted(root ^ ENGINE_ROOT_MODULES)}"
    assert packages == ENGINE_PACKAGES, f"engine/'s packages changed: {sorted(packages ^ ENGINE_PACKAGES)}"
    for pkg in packages:
        assert (engine / pkg / "__init__.py").is_file(), f"engine/{pkg}/ has no __init__.py"


# folder names GitHub's Python .gitignore template ignores (generated output, environments): a forker
# who adds that template would have new files in such a folder left out of their commits without a word
TEMPLATE_IGNORED = {"build", "develop-eggs", "dist", "downloads", "eggs", ".eggs", "lib", "lib64", "parts", "sdist",
                    "var", "wheels", "share", "htmlcov", "env", "venv", "ENV", "site", "instance", "target"}


def test_no_tracked_folder_has_a_name_the_common_ignore_templates_hide():
    import subprocess

    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout")
    folders = {part for path in tracked for part in Path(path).parts[:-1]}
    assert not folders & TEMPLATE_IGNORED, f"tracked folders an ignore template hides: {sorted(folders & TEMPLATE_IGNORED)}"
