"""Packaging: the dependencies' bounds and their lock, the container files and the wheel."""

import os
import re
import subprocess
import sys
import sysconfig
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent


def _requirements() -> list[Requirement]:
    """pyproject.toml's requirements: the main ones and every extra's."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    listed = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    return [Requirement(r) for r in listed]


def _lock() -> dict[str, Version]:
    """requirements.lock: each line `name==version` (comments aside), as {canonical name: version}."""
    pins: dict[str, Version] = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        req = Requirement(line)
        assert len(req.specifier) == 1 and not req.extras and req.marker is None and req.url is None, line
        (pin,) = req.specifier
        assert pin.operator == "==" and "*" not in pin.version and "+" not in pin.version, f"not an exact pin: {line}"
        name = canonicalize_name(req.name)
        assert name not in pins, f"{name} pinned twice"
        pins[name] = Version(pin.version)
    return pins


def test_every_requirement_has_bounds_and_the_lock_pins_it_within_them_below_the_next_major():
    pins = _lock()
    for req in _requirements():
        upper = [Version(s.version) for s in req.specifier if s.operator in ("<", "<=")]
        assert upper and any(s.operator in (">=", ">") for s in req.specifier), f"{req}: needs both bounds"
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is not pinned in requirements.lock (run `make lock`)"
        assert req.specifier.contains(pins[name], prereleases=True), f"the lock's {name}=={pins[name]}: not {req}"
        # no further than the next major release after the locked one (a 0.x package: below 1.0, often tighter)
        assert max(upper) <= Version(str(pins[name].major + 1)), f"{req}: the upper bound is past the next major"


def test_the_lock_has_the_makefiles_torch_and_neither_the_project_nor_cuda_packages():
    pins = _lock()
    torch = re.search(r"^TORCH := torch==(\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert torch and pins["torch"] == Version(torch.group(1))
    assert "lethe" not in pins
    assert not [n for n in pins if n.startswith("nvidia-") or n == "triton"], "a CUDA build's packages are locked"


def test_lm_evaluation_harness_has_its_own_exact_lock_beside_the_projects_within_the_makefiles_bounds():
    """requirements-lmeval.lock (`make lm-eval`, CI): exact pins, none of the project's lock's packages (installing
    it changes nothing the project runs on), lm_eval within the Makefile's LM_EVAL."""
    pins = _lock()
    extra: dict[str, Version] = {}
    for line in (ROOT / "requirements-lmeval.lock").read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        req = Requirement(line)
        (pin,) = req.specifier
        assert pin.operator == "==" and not req.extras and req.marker is None, f"not an exact pin: {line}"
        extra[canonicalize_name(req.name)] = Version(pin.version)
    assert not set(extra) & set(pins), "packages in both locks"
    wanted = Requirement(re.search(r"^LM_EVAL := (\S+)$", (ROOT / "Makefile").read_text(), re.M).group(1))
    assert wanted.specifier.contains(extra["lm-eval"]), (wanted, extra["lm-eval"])


def test_dockerfile_runs_as_non_root_with_a_data_volume_a_healthcheck_and_the_demo_model():
    text = (ROOT / "docker" / "Dockerfile").read_text()
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert users and users[-1] not in ("root", "0"), "the last USER is not root"
    assert re.search(r"^VOLUME\s+\[\"/data\"\]", text, re.M)
    assert re.search(r"^HEALTHCHECK .*\n?.*CMD .*healthz", text, re.M)
    assert "LETHE_DATA_DIR=/data" in text and "COPY heads ./heads" in text  # heads/ carries the demo model
    assert "torch==2.13.0" in text and "download.pytorch.org/whl/cpu" in text


def test_compose_runs_the_server_with_a_named_volume_on_data():
    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    service = compose["services"]["lethe"]
    assert service["build"]["dockerfile"] == "docker/Dockerfile"
    volume, target = service["volumes"][0].split(":")
    assert target == "/data" and volume in compose["volumes"]
    assert "8000:8000" in service["ports"]


@pytest.mark.skipif(not os.environ.get("CI") and not os.environ.get("LETHE_TEST_WHEEL"),
                    reason="builds a wheel (about 30 s): runs in CI, or with LETHE_TEST_WHEEL=1")
def test_wheel_installs_in_a_fresh_venv_and_its_commands_run(tmp_path):
    built = subprocess.run([sys.executable, "-m", "build", "--wheel", "--outdir", str(tmp_path / "dist"), str(ROOT)],
                           check=True, capture_output=True, text=True, timeout=600)
    assert "Warning" not in built.stdout + built.stderr  # the build is quiet: no setuptools warnings to wade through
    wheel = next((tmp_path / "dist").glob("lethe-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "lethe/heads/demo/assets/model/model.safetensors" in names and "lethe/server/app.py" in names
    assert {"lethe/clients/py.typed", "lethe/heads/py.typed", "lethe/server/py.typed"} <= set(names)  # PEP 561
    # one top-level name: the design card's folders install under `lethe`, never as `server` or `heads`
    assert {n.split("/")[0] for n in names if not n.startswith("lethe-")} == {"lethe"}
    venv.create(tmp_path / "venv", with_pip=True)
    py = tmp_path / "venv" / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], check=True, timeout=300)
    # the dependencies come from this environment; the package itself only from the wheel
    env = dict(os.environ, PYTHONPATH=sysconfig.get_paths()["purelib"])
    lethe = tmp_path / "venv" / "bin" / "lethe"
    for args in (["--help"], ["demo", "build", "--help"]):
        done = subprocess.run([str(lethe), *args], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
        assert done.returncode == 0, done.stderr
        assert "usage: lethe" in done.stdout
    done = subprocess.run([str(py), "-c", "from lethe.clients.client import Lethe, AsyncLethe; import lethe.server.app"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr


def test_the_scale_files_run_lethe_on_ray_with_postgresql_and_one_shared_data_volume():
    compose = yaml.safe_load((ROOT / "docker" / "compose.scale.yaml").read_text())
    services = compose["services"]
    assert {"postgres", "ray-head", "ray-worker"} <= set(services)
    head, worker = services["ray-head"], services["ray-worker"]
    for node in (head, worker):
        assert node["build"]["args"]["EXTRAS"] == "[ray]" and node["build"]["dockerfile"] == "docker/Dockerfile"
        assert node["environment"]["LETHE_DATABASE_URL"].startswith("postgresql://")
        assert "lethe-data:/data" in node["volumes"]  # one data directory for every replica
    assert "lethe serve --ray" in head["command"] and "ray start --address=ray-head" in worker["command"]
    assert 'ARG EXTRAS=""' in (ROOT / "docker" / "Dockerfile").read_text()
    config = yaml.safe_load((ROOT / "docker" / "serve.scale.yaml").read_text())
    (application,) = config["applications"]
    module, builder = application["import_path"].split(":")
    import importlib

    assert callable(getattr(importlib.import_module(module), builder))  # Ray Serve's CLI can import it
    assert application["runtime_env"]["env_vars"]["LETHE_DATABASE_URL"].startswith("postgresql://")
