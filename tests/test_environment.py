"""An environment the code cannot run on is refused at start, naming the package, the version found
and the version needed; the version a bug report needs is printed."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib

import pytest
from packaging.requirements import Requirement

import sdquant
from sdquant.environment import MODELOPT_NAMES, installed_version, missing_names, require_supported, version_problem
from sdquant.errors import EXIT_USER_ERROR, UserError
from sdquant.report import print_summary

from conftest import REPO


def declared(name: str) -> Requirement:
    """The requirement pyproject.toml declares for `name`."""
    lines = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return next(r for r in map(Requirement, lines) if r.name == name)


@pytest.mark.parametrize("found", ["2.11.0+cu130", "2.11.0a0+ecf3bae40a.nv26.01", "2.13.0+cpu", "2.13.0"])
def test_torch_builds_in_range_pass(found):
    # The GPU machine's CUDA build, an NVIDIA container's prerelease build, CI's CPU build.
    assert version_problem(declared("torch"), found) is None


@pytest.mark.parametrize("found", ["2.10.0+cu128", "2.10.1", "2.11.0.dev20260101+cu130"])
def test_torch_below_the_lower_bound_is_named_with_both_versions(found):
    problem = version_problem(declared("torch"), found)
    assert problem == f"torch {found} is installed, sdquant needs {declared('torch')}"


def test_missing_package_is_named():
    assert version_problem(Requirement("diffusers>=0.42.1"), None) == \
        "diffusers is not installed, sdquant needs diffusers>=0.42.1"


def test_installed_modelopt_has_every_name_the_code_uses():
    assert missing_names(MODELOPT_NAMES) == []


def test_modelopt_lacking_a_name_is_refused_naming_its_version():
    # The real ModelOpt, asked for a name no release has: what a ModelOpt that moved one would give.
    moved = ("modelopt.torch.quantization.calib", "_NoSuchCalibrator")
    with pytest.raises(UserError) as error:
        require_supported([declared("nvidia-modelopt")], MODELOPT_NAMES + (moved,))
    message = str(error.value)
    assert message.startswith(f"nvidia-modelopt {installed_version('nvidia-modelopt')} lacks "
                              "modelopt.torch.quantization.calib._NoSuchCalibrator, which sdquant uses")
    assert str(declared("nvidia-modelopt")) in message
    assert "\n" not in message


def test_this_environment_is_supported():
    require_supported()


def test_script_with_torch_below_the_range_exits_2_before_any_work(tmp_path):
    # A torch whose installed metadata says 2.10.0 shadows the real one's, as pip would see it.
    fake = tmp_path / "site" / "torch-2.10.0.dist-info"
    fake.mkdir(parents=True)
    (fake / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.10.0\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(fake.parent), os.environ.get("PYTHONPATH")])))
    out_dir = tmp_path / "quantized"
    result = subprocess.run(
        [sys.executable, str(REPO / "quantize.py"), "model=tiny_sdxl", f"out_dir={out_dir}",
         f"hydra.run.dir={tmp_path / 'hydra'}"],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert result.returncode == EXIT_USER_ERROR
    err = result.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("error: torch 2.10.0 is installed, sdquant needs torch")
    assert not out_dir.exists()


def test_version_comes_from_the_installed_metadata():
    result = subprocess.run([sys.executable, "-c", "import sdquant; print(sdquant.__version__)"],
                            capture_output=True, text=True, cwd=REPO, check=True)
    assert result.stdout.strip() == installed_version("sdquant") == sdquant.__version__


def test_closing_summary_names_the_versions_that_ran(capsys):
    import diffusers
    import tensorrt_rtx
    import torch

    print_summary("quantize", [], 1.0)
    last_line = capsys.readouterr().out.splitlines()[-1].strip()
    assert last_line == (f"versions: sdquant {sdquant.__version__}, torch {torch.__version__}, "
                         f"diffusers {diffusers.__version__}, ModelOpt {installed_version('nvidia-modelopt')}, "
                         f"tensorrt_rtx {tensorrt_rtx.__version__}")
