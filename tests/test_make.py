"""The Makefile's install steps, read with `make -n` (nothing runs): `make install` and `make test` never compile
llama.cpp (issue 25: a first start in about a minute), `make llamacpp` does, once per venv, and `make check-lock`,
which compares the venv with the whole lock, builds it first."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAKEFILE = ROOT / "Makefile"

pytestmark = pytest.mark.skipif(shutil.which("make") is None and not os.environ.get("CI"), reason="no make here")


def _dry_run(target: str, venv: Path, *flags: str) -> list[str]:
    """The commands `make TARGET` would run for a venv at `venv` (-B: as if nothing were built yet)."""
    out = subprocess.run(["make", "-f", str(MAKEFILE), "-C", str(ROOT), "--no-print-directory", "-n", *flags, target,
                          f"VENV={venv}"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def _locked_llama() -> str:
    return re.search(r"^llama_cpp_python==\S+$", (ROOT / "requirements.lock").read_text(), re.M).group(0)


def _builds_llama(line: str) -> bool:
    return "CMAKE_ARGS" in line or bool(re.search(r"pip install .*llama[_-]cpp[_-]python", line, re.I))


@pytest.mark.parametrize("target", ["install", "install-test", "serve", "test"])
def test_install_serve_and_test_install_the_lock_without_compiling_llama_cpp(target, tmp_path):
    lines = _dry_run(target, tmp_path / "venv", "-B")
    assert not [line for line in lines if _builds_llama(line)], lines
    # the lock without its llama_cpp_python line, whatever else it holds
    filtered = [line for line in lines if re.match(r"grep -vE '\^llama_cpp_python==' requirements\.lock > \S+$", line)]
    assert len(filtered) == 1, lines
    requirements = filtered[0].rsplit("> ", 1)[1]
    assert any(re.match(rf"\S+/pip install -q -r {re.escape(requirements)}$", line) for line in lines), lines
    assert not any(re.search(r"pip install .*-r requirements\.lock", line) for line in lines), lines
    assert not any("requirements-lmeval.lock" in line for line in lines), lines  # `make lm-eval`, CI's


def test_make_llamacpp_compiles_the_locked_version_without_amx_and_without_the_wheel_cache(tmp_path):
    lines = _dry_run("llamacpp", tmp_path / "venv", "-B")
    builds = [line for line in lines if _builds_llama(line)]
    assert len(builds) == 1, lines
    build = builds[0]
    assert "compiling llama.cpp" in build and "7-10 minutes on 2 cores" in build  # said before it starts
    assert f"--no-cache-dir --no-deps {_locked_llama()} " in build
    for flag in ("-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"):
        assert build.count(flag) == 2, flag  # C and C++
    assert "-DLLAVA_BUILD=OFF" in build  # the multimodal library, which Lethe never loads, is not compiled
    assert "set -o pipefail" in build  # a failed build fails make (bash: `make` runs it with SHELL /bin/bash)
    # after the lock's other packages (its dependencies), before its stamp
    assert lines.index(build) > next(i for i, line in enumerate(lines) if "requirements-no-llamacpp" in line)
    assert lines[-1] == f"touch {tmp_path / 'venv' / '.llamacpp'}"


def test_make_llamacpp_runs_once_per_venv(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    for stamp in ("bin/python", ".installed", ".llamacpp"):  # all newer than pyproject.toml and the lock
        (venv / stamp).touch()
    assert not [line for line in _dry_run("llamacpp", venv) if _builds_llama(line)]


def test_check_lock_builds_llama_cpp_and_installs_lm_eval_before_comparing_the_venv_with_both_whole_locks(tmp_path):
    lines = _dry_run("check-lock", tmp_path / "venv", "-B")
    build = next(i for i, line in enumerate(lines) if _builds_llama(line))
    lm_eval = lines.index(f"{tmp_path / 'venv'}/bin/pip install -q --no-deps -r requirements-lmeval.lock")
    diff = next(i for i, line in enumerate(lines) if "diff -u" in line)
    assert build < diff and lm_eval < diff
    assert lines[diff].startswith("grep -hvE '^(#|$)' requirements.lock requirements-lmeval.lock | LC_ALL=C sort -f "
                                  "| diff -u - "), lines[diff]


def test_the_llama_cpp_engine_without_llama_cpp_python_says_in_one_line_to_run_make_llamacpp(tmp_path):
    """`make install` leaves llama-cpp-python out: `lethe serve --engine llamacpp` and `lethe bench engine` on a
    GGUF file fail at once, in one line naming `make llamacpp` (before any model loads)."""
    import sys

    script = ("import sys; sys.modules['llama_cpp'] = None  # as in a venv without llama-cpp-python\n"
              "from lethe.clients.cli import main\n"
              f"print(main(['serve', '--engine', 'llamacpp', '--data-dir', {str(tmp_path / 'data')!r}]), "
              "main(['bench', 'engine', '--model', 'missing.gguf', '--forget', 'f.jsonl', '--retain', 'r.jsonl']))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.stdout.split() == ["1", "1"], out
    errors = out.stderr.splitlines()
    assert len(errors) == 2 and all(e.startswith("lethe: error: the llama.cpp engine needs llama-cpp-python")
                                    and "run `make llamacpp`" in e for e in errors), out.stderr
    assert not (tmp_path / "data").exists()
