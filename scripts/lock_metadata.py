"""The image's locks are complete on each architecture: every pin's requirements are met by the pins.

The Dockerfile installs its locks with `pip install --no-deps` and then runs `pip check`, on
linux/amd64 and linux/arm64 alike. A wheel's requirements can differ between the two (the aarch64
wheel of torch-tensorrt 2.14.0 asks for `tensorrt`, its x86_64 wheel for `tensorrt-cu13`), so a lock
that passes `pip check` on one machine can stop the image build on the other. This module checks it
without either machine:

- `fetch` (network: PyPI's simple index) reads, for every pin of the Docker locks and each
  architecture, the Requires-Dist of the file pip would install there (the best wheel for CPython
  3.11 on manylinux up to bookworm's glibc, else the sdist): from PEP 658 metadata where the index
  has it, else the wheel's METADATA by HTTP range requests (its zip directory and that one member),
  else the whole file. It returns the data `python scripts/lock.py --metadata` writes to
  requirements/metadata.json, with the sha256 of each lock it was made from.
- `unmet` (pure, offline) evaluates each requirement's markers for each architecture (Linux,
  CPython 3.11) and says which are not met by a pin: name missing, or its version outside the
  specifier. Extras are followed: `foo[bar]` also needs foo's `extra == "bar"` requirements.

Not covered: nothing is installed or imported on either architecture, and a pin whose real wheel
only NVIDIA's index serves is checked with the metadata PyPI has for it (listed under `partial`).
"""
from __future__ import annotations

import hashlib
import io
import json
import re
import tarfile
import tempfile
import urllib.request
import zipfile
from email.parser import HeaderParser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import (
    InvalidSdistFilename,
    InvalidWheelFilename,
    canonicalize_name,
    parse_sdist_filename,
    parse_wheel_filename,
)
from packaging.version import InvalidVersion, Version

REPO = Path(__file__).resolve().parent.parent
DATA = "requirements/metadata.json"
REGENERATE = "python scripts/lock.py --metadata"
ARCHES = ("x86_64", "aarch64")          # the Dockerfile's linux/amd64 and linux/arm64
PYTHON = (3, 11)                        # the base image's Python (FROM python:3.11-...)
GLIBC = (2, 36)                         # Debian bookworm's
INDEX = "https://pypi.org/simple/"
LEGACY_MANYLINUX = {"x86_64": ["manylinux2014", "manylinux2010", "manylinux1"], "aarch64": ["manylinux2014"]}
CHUNK = 1 << 16                         # bytes per range request: a wheel's zip directory fits in a few


# ---- the locks and the environment of each architecture (pure) ---------------------------------

def docker_locks(dockerfile: str) -> list[str]:
    """The lock files the Dockerfile's pip lines read (`-r /submission/requirements/X`), in order."""
    code = "\n".join(ln for ln in dockerfile.splitlines() if not ln.lstrip().startswith("#"))
    return list(dict.fromkeys(re.findall(r"-r\s+/submission/(requirements/\S+)", code)))


def pins(text: str) -> list[Requirement]:
    """The `name[extras]==version[; marker]` lines of a lock, parsed."""
    out = []
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            req = Requirement(line.strip())
            assert len(req.specifier) == 1 and next(iter(req.specifier)).operator == "==", f"not a pin: {line}"
            out.append(req)
    return out


def pin_key(req: Requirement) -> str:
    """`name==version` with the name normalised: the key of a pin in the metadata file."""
    return f"{canonicalize_name(req.name)}=={next(iter(req.specifier)).version}"


def environment(arch: str) -> dict[str, str]:
    """The marker environment of the image's Python on linux `arch` (any 3.11 patch: 3.11.0 stands for it)."""
    py = "%d.%d" % PYTHON
    return {"implementation_name": "cpython", "implementation_version": py + ".0", "os_name": "posix",
            "platform_machine": arch, "platform_python_implementation": "CPython", "platform_release": "",
            "platform_system": "Linux", "platform_version": "", "python_full_version": py + ".0",
            "python_version": py, "sys_platform": "linux", "extra": ""}


def installed(locks: dict[str, str], arch: str) -> dict[str, Requirement]:
    """{normalised name: pin} of what `pip install --no-deps -r` of each lock installs on `arch`."""
    env = environment(arch)
    return {canonicalize_name(r.name): r for text in locks.values() for r in pins(text)
            if r.marker is None or r.marker.evaluate(env)}


def digests(locks: dict[str, str]) -> dict[str, str]:
    """{lock path: sha256 of its text}: what the metadata file was made from."""
    return {path: hashlib.sha256(text.encode()).hexdigest() for path, text in locks.items()}


def read_locks(repo: Path = REPO) -> dict[str, str]:
    """{path: text} of the locks the repository's Dockerfile installs."""
    return {p: (repo / p).read_text() for p in docker_locks((repo / "Dockerfile").read_text())}


# ---- the check (pure, offline) -----------------------------------------------------------------

def stale(locks: dict[str, str], data: dict) -> str | None:
    """Why `data` does not describe `locks` (another set of files, or a file changed), or None."""
    made, now = data.get("locks", {}), digests(locks)
    if made == now:
        return None
    changed = sorted(p for p in set(made) | set(now) if made.get(p) != now.get(p))
    return f"{DATA} was made from other locks ({', '.join(changed)} differ): run {REGENERATE}"


def unmet(locks: dict[str, str], requires: dict[str, dict[str, list[str]]]) -> dict[str, list[str]]:
    """{arch: [one line per requirement no pin meets]} for the locks installed together `--no-deps`.

    `requires` is {arch: {name==version: [Requires-Dist strings]}}. A requirement applies when its
    marker holds on that arch with no extra, or with an extra some applied requirement (or the lock
    line) asks of its package; it is met when a pin of that name is installed there with a version
    the specifier contains."""
    out: dict[str, list[str]] = {}
    for arch in ARCHES:
        env, have = environment(arch), installed(locks, arch)
        wanted = {name: set(r.extras) for name, r in have.items()}     # extras asked of each pin
        problems: list[str] = []
        changed = True
        while changed:                                                 # until no new extra is asked
            changed, problems = False, []
            for name, pin in sorted(have.items()):
                key = pin_key(pin)
                if key not in requires.get(arch, {}):
                    problems.append(f"{key}: no metadata for {arch}: run {REGENERATE}")
                    continue
                for text in requires[arch][key]:
                    req = Requirement(text)
                    extras = [""] + sorted(wanted[name])
                    if req.marker is not None and not any(req.marker.evaluate({**env, "extra": e}) for e in extras):
                        continue
                    dep = canonicalize_name(req.name)
                    if dep not in have:
                        problems.append(f"{key} requires {text}: {dep} is not pinned for {arch}")
                        continue
                    if not set(req.extras) <= wanted[dep]:
                        wanted[dep] |= set(req.extras)
                        changed = True
                    version = next(iter(have[dep].specifier)).version
                    if not req.specifier.contains(version, prereleases=True):
                        problems.append(f"{key} requires {text}: the locks pin {dep}=={version}")
        if problems:
            out[arch] = problems
    return out


# ---- reading Requires-Dist from the index (network) --------------------------------------------

def wheel_tags(arch: str) -> dict[Tag, int]:
    """{tag: preference, 0 best} of CPython 3.11 on manylinux `arch` up to bookworm's glibc, as pip orders them."""
    platforms = [f"manylinux_{GLIBC[0]}_{m}_{arch}" for m in range(GLIBC[1], 4, -1)]
    platforms += [f"{p}_{arch}" for p in LEGACY_MANYLINUX[arch]] + [f"linux_{arch}"]
    tags = list(cpython_tags(PYTHON, platforms=platforms)) + list(compatible_tags(PYTHON, "cp311", platforms))
    return {t: i for i, t in reversed(list(enumerate(tags)))}


def index_files(name: str) -> list[dict]:
    """The files of project `name` on the index (PEP 691 JSON)."""
    req = urllib.request.Request(INDEX + canonicalize_name(name) + "/",
                                 headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)["files"]


def choose(files: list[dict], version: str, arch: str) -> dict | None:
    """The file pip installs for `==version` on `arch`: the best-tagged wheel, else the sdist."""
    prefs, best, sdist = wheel_tags(arch), None, None
    for f in files:
        fn = f["filename"]
        try:
            if fn.endswith(".whl"):
                _, v, _, tags = parse_wheel_filename(fn)
                rank = min((prefs[t] for t in tags if t in prefs), default=None)
                if v == Version(version) and rank is not None and (best is None or rank < best[0]):
                    best = (rank, f)
            elif fn.endswith((".tar.gz", ".zip")) and parse_sdist_filename(fn)[1] == Version(version):
                sdist = f
        except (InvalidWheelFilename, InvalidSdistFilename, InvalidVersion):
            continue                # an old upload pip would not read either (imageio-1.1-linux32.zip)
    return best[1] if best else sdist


class RangeReader(io.RawIOBase):
    """A remote file read by HTTP range requests, CHUNK bytes at a time: what zipfile needs to read one member."""

    def __init__(self, url: str) -> None:
        self.url, self.pos, self.cache = url, 0, {}
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=120) as r:
            self.size = int(r.headers["Content-Length"])

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = (0, self.pos, self.size)[whence] + offset
        return self.pos

    def _chunk(self, i: int) -> bytes:
        if i not in self.cache:
            start, end = i * CHUNK, min(self.size, (i + 1) * CHUNK) - 1
            req = urllib.request.Request(self.url, headers={"Range": f"bytes={start}-{end}"})
            with urllib.request.urlopen(req, timeout=120) as r:
                if r.status != 206:
                    raise OSError(f"{self.url}: no range requests (HTTP {r.status})")
                self.cache[i] = r.read()
        return self.cache[i]

    def read(self, n: int = -1) -> bytes:
        end = self.size if n is None or n < 0 else min(self.size, self.pos + n)
        parts = []
        while self.pos < end:
            i, off = divmod(self.pos, CHUNK)
            part = self._chunk(i)[off:off + end - self.pos]
            parts.append(part)
            self.pos += len(part)
        return b"".join(parts)


def _requires_dist(text: str) -> list[str]:
    return HeaderParser().parsestr(text).get_all("Requires-Dist") or []


def _wheel_metadata(archive: zipfile.ZipFile) -> str:
    name = next((n for n in archive.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)), None)
    if name is None:
        raise LookupError(f"{archive.filename or 'a wheel'}: no .dist-info/METADATA")
    return archive.read(name).decode()


def _download(url: str, into: Path) -> Path:
    path = into / url.rsplit("/", 1)[1].split("#")[0]
    with urllib.request.urlopen(url, timeout=600) as r, open(path, "wb") as out:
        while block := r.read(1 << 20):
            out.write(block)
    return path


def file_requires(f: dict) -> tuple[list[str], str | None]:
    """(Requires-Dist of index file `f`, why they may be incomplete or None)."""
    url = f["url"].split("#")[0]
    if f["filename"].endswith(".whl"):
        if f.get("core-metadata") or f.get("dist-info-metadata"):          # PEP 658/714
            with urllib.request.urlopen(url + ".metadata", timeout=120) as r:
                return _requires_dist(r.read().decode()), None
        try:
            return _requires_dist(_wheel_metadata(zipfile.ZipFile(RangeReader(url)))), None
        except OSError:
            with tempfile.TemporaryDirectory() as tmp:                     # the whole wheel, last resort
                return _requires_dist(_wheel_metadata(zipfile.ZipFile(_download(url, Path(tmp))))), None
    with tempfile.TemporaryDirectory() as tmp:                             # an sdist: its PKG-INFO
        path = _download(url, Path(tmp))
        top_pkg_info = lambda n: n.count("/") == 1 and n.endswith("/PKG-INFO")  # noqa: E731
        if path.name.endswith(".zip"):
            with zipfile.ZipFile(path) as z:
                member = next((n for n in z.namelist() if top_pkg_info(n)), None)
                text = z.read(member).decode() if member else None
        else:
            with tarfile.open(path) as t:
                member = next((m for m in t.getmembers() if top_pkg_info(m.name)), None)
                text = t.extractfile(member).read().decode() if member else None
    if text is None:
        raise LookupError(f"{f['filename']}: no PKG-INFO")
    head = HeaderParser().parsestr(text)
    dynamic = {d.lower() for d in head.get_all("Dynamic") or []}
    if Version(head["Metadata-Version"]) < Version("2.2") or "requires-dist" in dynamic:
        return _requires_dist(text), (f"only an sdist on the index ({f['filename']}), its Requires-Dist not "
                                      "static (metadata before 2.2 or dynamic): the wheel it builds or fetches may add some")
    return _requires_dist(text), None


def fetch(locks: dict[str, str], say=print) -> dict:
    """The metadata file's data for `locks`: sha256 of each lock, and per arch the Requires-Dist and
    file of every pin installed there, and the pins whose requirements may be incomplete."""
    data: dict = {"made_by": REGENERATE, "python": "%d.%d" % PYTHON, "glibc": "%d.%d" % GLIBC,
                  "locks": digests(locks), "requires": {}, "files": {}, "partial": {}}
    listing: dict[str, list[dict]] = {}
    read: dict[str, tuple[list[str], str | None]] = {}                     # by file name: wheels shared by arches
    for arch in ARCHES:
        data["requires"][arch], data["files"][arch], data["partial"][arch] = {}, {}, {}
        for name, pin in sorted(installed(locks, arch).items()):
            key, version = pin_key(pin), next(iter(pin.specifier)).version
            if name not in listing:
                try:
                    listing[name] = index_files(name)
                except OSError as e:
                    raise OSError(f"{INDEX}{name}/: {e}") from e
            f = choose(listing[name], version, arch)
            if f is None:
                raise LookupError(f"{key}: the index has no file for CPython {data['python']} on linux {arch}")
            if f["filename"] not in read:
                say(f"{arch}: {key}: {f['filename']}")
                try:
                    read[f["filename"]] = file_requires(f)
                except (OSError, zipfile.BadZipFile, tarfile.TarError) as e:
                    raise OSError(f"{f['filename']}: {e}") from e
            requires, partial = read[f["filename"]]
            data["requires"][arch][key] = requires
            data["files"][arch][key] = f["filename"]
            if partial:
                data["partial"][arch][key] = partial
    return data
