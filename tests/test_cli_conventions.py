"""One error style and progress on stderr: engine.cli, engine.progress, and the commands that use them.

A user mistake is one `PROG: error: MESSAGE` line and exit 2, never a traceback (unless --debug
or ENGINE_DEBUG=1); --help shows defaults and the environment variables read; progress goes to
stderr, a bar on a terminal, plain lines otherwise."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest
from conftest import REPO, TINY_MODEL

from engine import cli
from engine.progress import Progress


def _one_error_line(r: subprocess.CompletedProcess, prog: str) -> str:
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"{prog}: error: "), lines[0]
    return lines[0]


def _py(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


# ---- engine.cli ------------------------------------------------------------------------------------


def test_guard_turns_user_errors_into_one_line_and_exit_2(capsys):
    from engine.settings import SettingsError

    def missing() -> int:
        open("/nonexistent/dir/file.txt")
        return 0

    for body, words in [(missing, "No such file or directory: /nonexistent/dir/file.txt"),
                        (lambda: (_ for _ in ()).throw(cli.UsageError("bad\nvalue  here")), "bad | value here"),
                        (lambda: (_ for _ in ()).throw(SettingsError("ENGINE_X must be 0 or 1")), "ENGINE_X")]:
        assert cli.guard("prog", body) == cli.EXIT_USAGE
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("prog: error: ") and words in err, err
    assert cli.guard("prog", lambda: 0) == 0
    with pytest.raises(ZeroDivisionError):       # a bug is not a user error: its traceback stays
        cli.guard("prog", lambda: 1 // 0)
    assert cli.guard("prog", lambda: (_ for _ in ()).throw(KeyError("k")), errors=(KeyError,)) == 2


def test_debug_flag_and_engine_debug_show_the_traceback(monkeypatch, capsys):
    def body() -> int:
        raise cli.UsageError("nope")

    with pytest.raises(cli.UsageError):
        cli.guard("prog", body, debug=True)
    monkeypatch.setenv("ENGINE_DEBUG", "1")
    with pytest.raises(cli.UsageError):
        cli.guard("prog", body)
    monkeypatch.setenv("ENGINE_DEBUG", "maybe")  # a bad value of the switch itself does not hide the error
    assert cli.guard("prog", body) == 2
    assert "prog: error: nope" in capsys.readouterr().err


def test_parser_help_shows_defaults_and_environment():
    p = cli.parser("prog", "Does things.", {"ENGINE_THING": "what it sets"})
    p.add_argument("--size", type=int, default=7, help="how many")
    p.add_argument("--name", required=True, help="who")
    p.add_argument("--flag", action="store_true", help="a switch")
    text = p.format_help()
    assert "how many (default: 7)" in text
    assert "who (default" not in text and "a switch (default" not in text
    assert "environment:" in text and "ENGINE_THING  what it sets" in text
    assert "--debug" in text


# ---- engine.progress -------------------------------------------------------------------------------


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_lines_off_the_terminal():
    s = io.StringIO()
    with Progress(4, "step", unit="images", every_s=0.0, stream=s) as bar:
        for _ in range(4):
            bar.update()
    lines = s.getvalue().splitlines()
    assert lines[0].startswith("step: 1/4 images (25 %), ") and "left" in lines[0]
    assert lines[-1].startswith("step: 4/4 images, in ") and lines[-1].endswith("images/s")
    quiet = io.StringIO()
    with Progress(4, "step", every_s=3600, stream=quiet) as bar:   # under every_s: only the closing line
        bar.update(4)
    assert len(quiet.getvalue().splitlines()) == 1


def test_progress_bar_on_a_terminal_and_the_off_switch(monkeypatch):
    tty = _Tty()
    with Progress(3, "step", unit="steps", stream=tty) as bar:
        assert bar.mode == "bar"
        bar.update(3)
    assert "3/3" in tty.getvalue() and "step" in tty.getvalue()
    monkeypatch.setenv("ENGINE_PROGRESS", "off")
    s = _Tty()
    with Progress(3, "step", every_s=0.0, stream=s) as bar:
        bar.update(3)
    assert s.getvalue() == ""
    monkeypatch.setenv("ENGINE_PROGRESS", "lines")
    s = _Tty()
    with Progress(2, "step", every_s=0.0, stream=s) as bar:
        bar.update(2)
    assert s.getvalue().startswith("step: 2/2 it")


# ---- the commands ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    d = tmp_path_factory.mktemp("ref_inputs")
    (d / "images").mkdir()
    (d / "manifest.tsv").write_text("a\timages/x.JPEG\n")
    return d


@pytest.mark.abi
def test_reference_bad_inputs(manifest, tmp_path):
    prog = "python -m evaluator.reference"
    m, root, out = str(manifest / "manifest.tsv"), str(manifest), str(tmp_path / "r.i32")
    line = _one_error_line(_py("-m", "evaluator.reference", m, root, out, "--model", TINY_MODEL,
                               "--checkpoint", str(tmp_path / "absent.safetensors")), prog)
    assert "checkpoint not found" in line and "absent.safetensors" in line
    line = _one_error_line(_py("-m", "evaluator.reference", str(tmp_path / "none.tsv"), root, out,
                               "--model", TINY_MODEL, "--checkpoint", m), prog)
    assert "cannot read manifest" in line and "none.tsv" in line
    (tmp_path / "bad.tsv").write_text("no tab here\n")
    line = _one_error_line(_py("-m", "evaluator.reference", str(tmp_path / "bad.tsv"), root, out,
                               "--model", TINY_MODEL, "--checkpoint", m), prog)
    assert "bad.tsv:1" in line
    line = _one_error_line(_py("-m", "evaluator.reference", m, str(tmp_path / "nowhere"), out,
                               "--model", TINY_MODEL, "--checkpoint", m), prog)
    assert "IMAGE_ROOT is not a directory" in line
    (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 64)
    line = _one_error_line(_py("-m", "evaluator.reference", m, root, out, "--model", TINY_MODEL,
                               "--input-size", "112", "--checkpoint", str(tmp_path / "junk.safetensors")), prog)
    assert "cannot read checkpoint" in line
    r = _py("-m", "evaluator.reference", m, root, out, "--model", TINY_MODEL, "--checkpoint", m,
            "--model-kwargs", "[1")
    assert r.returncode == 2 and "--model-kwargs: not JSON" in r.stderr and "Traceback" not in r.stderr
    r = _py("-m", "evaluator.reference", m, root, out, "--model", TINY_MODEL, "--debug",
            "--checkpoint", str(tmp_path / "absent.safetensors"))
    assert r.returncode == 1 and "Traceback" in r.stderr and "UsageError" in r.stderr


def test_help_of_every_owned_command_exits_0_with_defaults():
    for module, words in [("evaluator.demo", ["(default: 200)", "OMP_WAIT_POLICY"]),
                          ("evaluator.reference", ["ENGINE_PROGRESS", "(default: cpu)"]),
                          ("evaluator.cohort", ["(default: 200)", "ENGINE_PROGRESS"]),
                          ("evaluator.cir_corpus", ["(default: 40)"]),
                          ("evaluator.ablate", ["CLIP_MODEL_DIR", "(default: 32)"]),
                          ("evaluator.rehearse", ["REHEARSE_RUN_CMD", "(default: 120)"])]:
        r = _py("-m", module, "--help")
        assert r.returncode == 0, (module, r.stderr[-1000:])
        text = " ".join(r.stdout.split())          # argparse wraps long help lines
        for w in words:
            assert w in text, (module, w)


@pytest.mark.abi
def test_selfcheck_run_without_an_artifact_is_a_usage_error(tmp_path):
    r = _py("-m", "evaluator.contest.selfcheck", "run", "--artifact", str(tmp_path))
    assert r.returncode == 2 and "no manifest.json" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.abi
def test_selfcheck_current_with_unreadable_inputs_is_one_line(tmp_path):
    r = _py("-m", "evaluator.contest.selfcheck", "current", "--", "--model", TINY_MODEL, "--input-size", "112",
            "--checkpoint", str(tmp_path / "absent.safetensors"), "--out", str(tmp_path / "art"))
    # no artifact there yet: stale (exit 1) with a JSON line, not a traceback
    assert r.returncode == 1, r.stderr[-2000:]
    assert json.loads(r.stdout)["reusable"] is False and "Traceback" not in r.stderr


# ---- settings up front, one set of boolean spellings, one-line usage errors ----------------------------


def test_boolean_switches_take_one_set_of_spellings(monkeypatch):
    from engine import settings

    for raw, want in [("1", True), ("TRUE", True), ("yes", True), ("On", True),
                      ("0", False), ("false", False), ("NO", False), ("off", False)]:
        monkeypatch.setenv("ENGINE_GUARD", raw)
        settings.reload()
        assert settings.guard() is want, raw
    for raw in ("banana", "2", "y"):
        monkeypatch.setenv("ENGINE_GUARD", raw)
        settings.reload()
        with pytest.raises(settings.SettingsError, match="ENGINE_GUARD .*1/true/yes/on or 0/false/no/off"):
            settings.guard()
    settings.reload()


def test_check_reads_every_run_switch_up_front(monkeypatch):
    from engine import settings

    settings.reload()
    settings.check()                                     # the defaults are all valid
    for var in ("ENGINE_CUDA_GRAPHS", "ENGINE_FAST_EXIT", "ENGINE_DECODER_ISOLATE", "ENGINE_THREADS"):
        monkeypatch.setenv(var, "banana")
        settings.reload()
        with pytest.raises(settings.SettingsError, match=var):
            settings.check()
        monkeypatch.delenv(var)
    settings.reload()


@pytest.mark.abi
@pytest.mark.parametrize("var", ["ENGINE_CUDA_GRAPHS", "ENGINE_GUARD", "ENGINE_FAST_EXIT", "ENGINE_PIPELINE_DEPTH"])
def test_scripts_run_refuses_a_bad_switch_in_one_line(var, tmp_path):
    (tmp_path / "images").mkdir()
    (tmp_path / "m.tsv").write_text("a\timages/x.JPEG\n")
    r = subprocess.run([str(REPO / "scripts" / "run"), str(tmp_path / "m.tsv"), str(tmp_path), str(tmp_path / "o.i32")],
                       capture_output=True, text=True, timeout=120, env={**os.environ, var: "banana"})
    line = _one_error_line(r, "run")
    assert var in line and "banana" in line
    assert not (tmp_path / "o.i32").exists()


@pytest.mark.abi
def test_usage_errors_are_one_line_with_a_pointer_to_help():
    for module, prog in [("engine.build", "python -m engine.build"), ("evaluator.agreement", "python -m evaluator.agreement"),
                         ("evaluator.reference", "python -m evaluator.reference"),
                         ("evaluator.sweep", "python -m evaluator.sweep"),
                         ("evaluator.campaign", "python -m evaluator.campaign")]:
        line = _one_error_line(_py("-m", module, "--no-such-flag"), prog)
        assert line.endswith(f"(see {prog} --help)"), line
    r = subprocess.run([str(REPO / "scripts" / "run"), "--no-such-flag"], capture_output=True, text=True, timeout=120)
    assert _one_error_line(r, "scripts/run").endswith("(see scripts/run --help)")


@pytest.mark.abi
def test_help_names_every_setting_with_its_default():
    from engine.settings import documented
    from evaluator import settings as ev

    r = subprocess.run([str(REPO / "scripts" / "run"), "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0
    for var in ev.RUN_ENV:
        assert f"  {var} " in r.stdout, var
    # a switch added to the engine's table is listed too
    engine_vars = {v for v in documented() if v.startswith(("ENGINE_", "OMP_")) or v == "TMPDIR"}
    assert engine_vars <= set(ev.RUN_ENV), engine_vars - set(ev.RUN_ENV)
    assert "ENGINE_GUARD" in r.stdout and "(default: 1)" in r.stdout
    text = " ".join(_py("-m", "engine.build", "--help").stdout.split())
    assert "--no-guard build the raw low-precision form" in text
    assert "low-precision form (default" not in text    # a switch shows no "(default: True)" that reads backwards


@pytest.mark.abi
def test_the_reference_takes_the_kits_thread_settings_before_torch_loads(tmp_path):
    """Busy-waiting OpenMP threads made the reference ~15x slower on a shared 2-core machine: it sets
    the kit's budget and OMP_WAIT_POLICY=PASSIVE before torch is imported, as scripts/run does."""
    code = ("import sys, evaluator.contest.reference as r; assert 'torch' not in sys.modules; "
            "t = r.thread_settings('cpu'); import os, torch; "
            "print(os.environ['OMP_WAIT_POLICY'], os.environ['OMP_NUM_THREADS'], t['budget'].intra_op)")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={**env, "ENGINE_THREADS": "3"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["PASSIVE", "3", "3"]
    r = subprocess.run([sys.executable, "-m", "evaluator.reference", "m", "i", "o", "--model", TINY_MODEL,
                        "--checkpoint", "c"], cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={**env, "OMP_WAIT_POLICY": "lazy"})
    assert _one_error_line(r, "python -m evaluator.reference") and "OMP_WAIT_POLICY" in r.stderr


@pytest.mark.parametrize("module", ["evaluator.cohort", "evaluator.cir_corpus"])
def test_a_generator_refusing_a_setting_leaves_no_folder_behind(module, tmp_path):
    r = _py("-m", module, "--out", str(tmp_path / "out"), env={"ENGINE_PROGRESS": "sometimes"})
    assert "ENGINE_PROGRESS" in _one_error_line(r, f"python -m {module}")
    assert not (tmp_path / "out").exists()


@pytest.mark.abi
def test_campaign_verify_takes_the_folder_and_usage_errors_say_error(tmp_path):
    from evaluator.evidence import sha256_manifest

    folder = tmp_path / "camp"
    folder.mkdir()
    (folder / "a.txt").write_text("evidence\n")
    r = _py("-m", "evaluator.campaign", "verify", str(folder))
    assert "holds no campaign.provd.json" in _one_error_line(r, "verify")
    sha256_manifest.write_manifest(folder, {"sha": "0" * 40, "dirty": False})
    r = _py("-m", "evaluator.campaign", "verify", str(folder))
    assert r.returncode == 0 and r.stdout.startswith("verify: OK"), r.stderr[-2000:]
    (folder / "a.txt").write_text("changed\n")
    assert _py("-m", "evaluator.campaign", "verify", str(folder)).returncode == 1
    r = _py("-m", "evaluator.campaign", "run", "--workload", "eva02-imagenet1k", "--profile", "max",
            "--out", str(tmp_path / "out"))
    line = _one_error_line(r, "campaign")
    assert "profile max requires --manifest" in line and not (tmp_path / "out").exists()


DOCUMENTED_COMMANDS = [["-m", "engine.build"], ["-m", "evaluator.demo"], ["-m", "evaluator.cohort"],
                       ["-m", "evaluator.reference"], ["-m", "evaluator.agreement"], ["-m", "evaluator.sweep"],
                       ["-m", "evaluator.provenance"], ["-m", "evaluator.campaign", "run"],
                       ["-m", "evaluator.campaign", "verify"], ["-m", "evaluator.cir_corpus"],
                       ["-m", "evaluator.score_retrieval"], ["-m", "evaluator.ablate"], ["-m", "evaluator.rehearse"]]


@pytest.mark.abi
@pytest.mark.parametrize("cmd", DOCUMENTED_COMMANDS, ids=lambda c: " ".join(c[1:]))
def test_every_documented_command_takes_debug(cmd):
    """The README promises `--debug` on every command: each one's --help lists it."""
    r = _py(*cmd, "--help")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "--debug" in r.stdout, r.stdout
