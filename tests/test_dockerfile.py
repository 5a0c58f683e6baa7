"""Structure of the contest Dockerfile (no Docker engine here: the rules are checked on the text)."""
from __future__ import annotations

import importlib.metadata
import re
import shlex
import subprocess
import sys

import pytest
from conftest import REPO

KNOWN = {"FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME", "USER",
         "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL"}


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order: continuations joined, comments (and directives) dropped."""
    out, cur = [], ""
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("#") or (not s and not cur):
            continue  # a comment line, also inside a continuation, as Docker reads it
        if s.endswith("\\"):
            cur += s[:-1] + " "
            continue
        cur += s
        kw, _, rest = cur.partition(" ")
        out.append((kw.upper(), rest.strip()))
        cur = ""
    assert not cur, "the Dockerfile ends inside a line continuation"
    return out


@pytest.fixture(scope="module")
def df() -> list[tuple[str, str]]:
    return instructions((REPO / "Dockerfile").read_text())


def _commands(run: str) -> list[list[str]]:
    """The simple commands of a RUN line (split on && || ; | outside quotes), tokenized."""
    lex = shlex.shlex(run, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    cmds: list[list[str]] = [[]]
    for tok in lex:
        if tok in ("&&", "||", ";", "|", "(", ")"):
            cmds.append([])
        else:
            cmds[-1].append(tok)
    return [c for c in cmds if c]


def test_parses_and_starts_with_from(df):
    assert df and df[0][0] in ("FROM", "ARG")
    assert {kw for kw, _ in df} <= KNOWN, {kw for kw, _ in df} - KNOWN
    assert any(kw == "FROM" for kw, _ in df)


def test_base_pinned_with_explicit_tag(df):
    for kw, args in df:
        if kw != "FROM":
            continue
        image = [t for t in args.split() if not t.startswith("--")][0]
        assert "$" not in image, f"FROM {image}: resolve the tag in the file, not through an ARG"
        if "@sha256:" in image:
            continue
        name, _, tag = image.rpartition("/")[2].partition(":")
        assert tag and tag != "latest", f"FROM {image}: pin an explicit tag (or a digest)"
    text = (REPO / "Dockerfile").read_text()
    base = re.search(r"^FROM python:(\d+)\.(\d+)-slim-\w+\b", text, re.M)
    assert base, "a plain multi-arch Python base expected (the locked stack comes from PyPI)"
    assert tuple(map(int, base.groups())) == sys.version_info[:2], \
        f"the image's Python {base.groups()} is not the Python the suite runs ({sys.version_info[:2]})"
    assert "imagetools inspect" in text and "@sha256:" in text, "say how to pin the base by digest"
    assert "linux/arm64" in text and "linux/amd64" in text, "say how to build both architectures"


def test_non_root_numeric_user_after_last_root_step(df):
    users = [(i, args) for i, (kw, args) in enumerate(df) if kw == "USER"]
    assert users, "no USER: the image would run as root"
    last_i, user = users[-1]
    assert re.fullmatch(r"\d+(:\d+)?", user), f"USER {user}: use a numeric uid[:gid]"
    assert int(user.split(":")[0]) != 0 and not user.endswith(":0")
    last_root = max(i for i, (kw, _) in enumerate(df) if kw in ("RUN", "COPY", "ADD"))
    assert last_i > last_root, "the non-root USER must come after the last step that needs root"


def test_no_remote_add(df):
    for kw, args in df:
        if kw == "ADD":
            assert not re.search(r"https?://|git@|\.git\b", args), f"remote ADD {args}: fetch in RUN, pinned"


def test_submission_run_wired_to_scripts_run(df):
    runs = " ".join(args for kw, args in df if kw == "RUN")
    assert any(kw == "COPY" and args.split()[-1].rstrip("/") == "/submission" for kw, args in df)
    assert "/submission/run" in runs and "/submission/scripts/run" in runs
    assert "chmod 0755 /submission/run" in runs
    assert (REPO / "scripts" / "run").is_file() and (REPO / "build.sh").is_file()
    for d in re.findall(r"compileall -q ([^&]+)", runs)[0].split():
        assert (REPO / d.replace("/submission/", "")).is_dir(), d
    assert ("ENTRYPOINT", "[]") in df, "no base entrypoint: it would run on the clock"


def _pip_installs(df) -> list[list[str]]:
    """The pip install commands of the Dockerfile's RUN lines, tokenized."""
    return [cmd for kw, args in df if kw == "RUN" for cmd in _commands(args)
            if "pip" in " ".join(cmd[:3]) and "install" in cmd]


def _requirement_files(cmd: list[str]) -> list[str]:
    """The -r FILE arguments of a pip command, as paths relative to the repository."""
    return [cmd[i + 1].removeprefix("/submission/") for i, tok in enumerate(cmd) if tok == "-r"]


def test_pip_installs_only_the_locks_without_cache(df):
    """Every pip install reads locks alone: no package named on the line, so no pin of its own
    (the Dockerfile cannot drift from the lock), --no-deps (no resolver choice), no cache."""
    installs = _pip_installs(df)
    assert installs, "expected the pip installs of the locks in the Dockerfile"
    for cmd in installs:
        assert "--no-cache-dir" in cmd and "--no-deps" in cmd, cmd
        files = _requirement_files(cmd)
        assert files, f"pip install without a lock: {cmd}"
        rest = cmd[cmd.index("install") + 1:]
        names = [t for k, t in enumerate(rest) if not t.startswith("-") and rest[k - 1] not in ("-r", "--extra-index-url")]
        assert not names, f"packages named outside the locks: {names}"
        for f in files:
            assert (REPO / f).is_file() and f.startswith("requirements/"), f
    copied = [args.split()[0].rstrip("/") for kw, args in df if kw == "COPY"]
    assert "requirements" in copied[:1], "COPY requirements/ before installing it (and before the source)"
    text = (REPO / "Dockerfile").read_text()
    assert not re.search(r"^\s*[^#\n]*[A-Za-z0-9_]==\d", text, re.M), "a version pin outside the locks"
    assert not re.search(r"apt-get install[^&]*=", text), "Debian versions follow the pinned base image"
    assert any(c[-1] == "check" for kw, args in df if kw == "RUN" for c in _commands(args)), "pip check the locks"


def test_cache_env_under_tmpdir_and_offline(df):
    env = {}
    for kw, args in df:
        if kw == "ENV":
            for tok in shlex.split(args):
                k, _, v = tok.partition("=")
                env[k] = v
    tmp = env["TMPDIR"]
    for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "XDG_CACHE_HOME", "HF_HOME"):
        assert env[k].startswith(tmp + "/"), f"{k}={env.get(k)} is not under TMPDIR={tmp}"
    assert env["HF_HUB_OFFLINE"] == "1"


def test_no_download_outside_the_dockerfile():
    """Long downloads live in the Dockerfile; build.sh and the run are offline."""
    text = (REPO / "Dockerfile").read_text()
    assert "build.sh" in text
    assert not re.search(r"^RUN .*build\.sh", text, re.M), "build.sh needs the checkpoint and the GPU: not at image build"


def test_dockerignore_keeps_data_and_vcs_out():
    lines = {ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")}
    for must in (".git", "artifacts", "**/__pycache__", "**/*.safetensors", "**/*.pt2", "**/*.i32", "**/*.JPEG",
                 "**/*.tsv", "**/*.jsonl"):
        assert must in lines, f".dockerignore should exclude {must}"


def _lock(name: str) -> dict[str, str]:
    """{normalised name: version} of requirements/NAME; every line a `name==version[; marker]` pin."""
    out = {}
    for ln in (REPO / "requirements" / name).read_text().splitlines():
        if not ln.strip() or ln.startswith("#"):
            continue
        m = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([\w.+\-]+)(\s*;\s*.+)?", ln.strip())
        assert m, f"requirements/{name}: not an exact pin: {ln!r}"
        key = _norm(m.group(1))
        assert key not in out, f"requirements/{name}: {key} pinned twice"
        out[key] = m.group(2)
    return out


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name.lower())


def test_dockerfile_installs_the_lock_ci_tests(df):
    """The image installs lock.txt, the file scripts/test.sh (CI) installs; test.sh adds only the
    test tools and the optional scale-out extra (Ray, tested in CI, not in the image), the image only
    the GPU extras."""
    image = {f for cmd in _pip_installs(df) for f in _requirement_files(cmd)}
    script = (REPO / "scripts" / "test.sh").read_text()
    ci = set(re.findall(r"-r (requirements/\S+)", script))
    assert "requirements/lock.txt" in image and "requirements/lock.txt" in ci
    assert image - ci == {"requirements/gpu.txt"} and ci - image == {"requirements/dev.txt", "requirements/scale.txt"}, \
        (image, ci)
    assert "./scripts/test.sh" in (REPO / ".ci" / "run").read_text()
    # the locks do not overlap: one version of each package
    lock, dev, gpu, scale = _lock("lock.txt"), _lock("dev.txt"), _lock("gpu.txt"), _lock("scale.txt")
    assert not (set(lock) & set(dev)) and not (set(lock) & set(gpu)), "a package pinned in two locks"
    assert not (set(lock) & set(scale)) and not (set(dev) & set(scale)), "a package pinned in two locks"


def test_lock_pins_the_stack_the_suite_runs():
    """The versions in the lock are the versions this test process imported."""
    lock = _lock("lock.txt")
    for dist in ("torch", "torchvision", "timm", "numpy", "pillow", "safetensors", "open_clip_torch"):
        installed = importlib.metadata.version(dist).split("+")[0]   # torch 2.14.1+cu130 -> 2.14.1
        assert lock.get(_norm(dist)) == installed, f"lock pins {dist} {lock.get(_norm(dist))}, the suite runs {installed}"
    for cuda_wheel in ("nvidia-cublas", "nvidia-cudnn-cu13", "triton", "nvidia-dali-cuda130"):
        assert cuda_wheel in lock, f"{cuda_wheel} (pulled by torch / DALI) is not locked"
    text = (REPO / "requirements" / "lock.txt").read_text()
    assert re.search(r'^triton==[\w.]+; platform_system == "Linux"$', text, re.M), "triton is Linux-only"


def test_every_declared_dependency_is_locked():
    """pyproject's dependencies and extras are all pinned, so `pip install -e .[dev]` after the
    locks installs nothing the locks do not name."""
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = lambda reqs: {_norm(Requirement(r).name) for r in reqs}  # noqa: E731
    base = names(project["dependencies"])
    assert {"open-clip-torch", "scikit-image", "nvidia-dali-cuda130"} <= base
    assert not base - set(_lock("lock.txt")), f"base dependencies not locked: {base - set(_lock('lock.txt'))}"
    extras = project["optional-dependencies"]
    assert not names(extras["dev"]) - set(_lock("dev.txt")), "dev extra not locked in requirements/dev.txt"
    assert not names(extras["gpu"]) - set(_lock("gpu.txt")), "gpu extra not locked in requirements/gpu.txt"
    checks = " ".join(args for _, args in (instructions((REPO / "Dockerfile").read_text())) if "import sys, torch" in args)
    for module in ("open_clip", "skimage", "nvidia.dali", "cupy"):
        assert module in checks, f"the image build should check that {module} imports"


def _fake_tools(tmp_path, chromium: bool = False) -> tuple[dict[str, str], object]:
    """A PATH of stubs for scripts/test.sh: python3, apt-get and id (root) record their calls."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    log = tmp_path / "calls.log"
    for name, body in (("python3", 'echo "python3 $*" >> "$LOG"'), ("apt-get", 'echo "apt-get $*" >> "$LOG"'),
                       ("id", "echo 0")) + ((("chromium", "true"),) if chromium else ()):
        (bin_ / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_ / name).chmod(0o755)
    (bin_ / "dirname").symlink_to(subprocess.run(["sh", "-c", "command -v dirname"], capture_output=True,
                                                 text=True).stdout.strip())
    return {"PATH": str(bin_), "LOG": str(log), "HOME": str(tmp_path)}, log


@pytest.mark.parametrize("env, installs", [({}, False), ({"CI": "true"}, True),
                                           ({"INSTALL_SYSTEM_PACKAGES": "1"}, True), ({"CI": "false"}, False)])
def test_test_sh_installs_system_packages_only_when_asked(tmp_path, env, installs):
    base, log = _fake_tools(tmp_path)
    r = subprocess.run(["/bin/sh", str(REPO / "scripts" / "test.sh"), "-k", "nothing"], env={**base, **env},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    calls = log.read_text().splitlines()
    assert calls[0].startswith("python3 -m pip install") and "-r requirements/lock.txt" in calls[0], calls
    assert any("apt-get install" in c and "chromium" in c for c in calls) == installs, calls
    if installs:
        assert "installing the Debian package chromium" in r.stderr
    else:
        assert "chromium not installed: its test will skip" in r.stderr and "INSTALL_SYSTEM_PACKAGES=1" in r.stderr
    assert calls[-1].startswith("python3 -m pytest -q --durations=25 -k nothing"), calls   # the full suite


def test_test_sh_is_quiet_about_chromium_when_present(tmp_path):
    base, log = _fake_tools(tmp_path, chromium=True)
    r = subprocess.run(["/bin/sh", str(REPO / "scripts" / "test.sh")], env={**base, "CI": "true"},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "chromium" not in r.stderr and "apt-get" not in log.read_text(), r.stderr


def test_lock_pins_the_cuda_headers_inductor_compiles_against():
    """CUDA_HOME's headers are complete: the C runtime headers (crt/) and CCCL, which the CUDA wheels
    torch pulls leave out, are locked at the versions the locked cuda-toolkit's extras name."""
    from packaging.requirements import Requirement

    lock = _lock("lock.txt")
    try:
        toolkit = importlib.metadata.distribution("cuda-toolkit")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("cuda-toolkit is not installed (Linux only): install requirements/lock.txt")
    wanted = {}
    for text in toolkit.requires or []:
        req = Requirement(text)
        for extra in ("crt", "cccl"):
            if req.marker and req.marker.evaluate({"extra": extra, "sys_platform": "linux",
                                                   "platform_machine": "aarch64"}):
                wanted[_norm(req.name)] = str(req.specifier).removeprefix("==").removesuffix(".*")
    assert set(wanted) == {"nvidia-cuda-crt", "nvidia-cuda-cccl"}, wanted
    assert importlib.metadata.version("cuda-toolkit") == lock["cuda-toolkit"]
    for name, version in wanted.items():
        assert lock.get(name) == version, f"lock pins {name} {lock.get(name)}, cuda-toolkit asks {version}"
