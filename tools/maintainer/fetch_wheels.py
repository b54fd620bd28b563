"""Downloads into .whl/ the wheels a machine lacks to install sdquant offline, with pip resolving
the dependencies there (tools/maintainer/gpu_install.sh: `pip install --no-index --find-links .whl -e .`).

The machine is described by the packages it already has (default: the GPU image's,
tools/maintainer/gpu_image_packages.txt). pip itself decides what is missing: the resolution runs
against a throwaway environment that holds a stand-in (name and version, no code) of each of those
packages, for the machine's Python and platform, with constraints.txt's tested versions for
everything the machine does not have.

    python tools/maintainer/fetch_wheels.py                     # the GPU machine: Python 3.12, x86-64
    python tools/maintainer/fetch_wheels.py --extras peers      # and an optional extra's wheels (torchao)
    python tools/maintainer/fetch_wheels.py --python-version 3.11 --image freeze.txt   # another machine
    python tools/maintainer/fetch_wheels.py \
        --alone nvidia-cudnn-frontend==1.32.0 fa3-fwd==0.0.3 torchao==0.18.0   # what the headline rows need

With --extras, the optional dependencies of those extras in pyproject.toml are resolved with the
rest; install them there with `pip install --no-index --find-links .whl -e ".[peers]"`. (`peers`
adds 3.3 MB; `fp8-attention` brings nvidia-cutlass-dsl's ~190 MB with nvidia-cudnn-frontend,
more than the device tool carries: its wheel alone has been enough.) --alone fetches such wheels
without their dependencies into .whl/alone/, which gpu_install.sh installs with --no-deps after
its checks.
pulp, which ModelOpt imports, travels without the CBC solver binaries its wheel bundles (SLIMMED).

Run it with the project's own Python (it reads packaging and pyproject.toml); it needs PyPI and pip
23.3 or newer (the first that resolves for another platform without --target).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import venv
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
# The GPU image's glibc takes any manylinux tag up to 2.28; pip matches --platform tags literally.
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64")
# Published as a source archive only: built into a (pure Python) wheel here.
SOURCE_ONLY = ("antlr4-python3-runtime",)
# Wheels carried without a folder that sdquant never runs, which alone would overfill the device
# tool's 64 MiB: ModelOpt imports pulp, whose wheel bundles CBC solver binaries (16 MB) that only
# ModelOpt's AutoQuantize search calls.
SLIMMED = {"pulp": "pulp/solverdir/cbc/"}
# The first pip whose `install --dry-run --report` takes --platform and --python-version.
PIP_FOR_OTHER_PLATFORMS = Version("23.3")
# Specifier operators that put a minimum on a version.
FLOOR_OPERATORS = (">=", ">", "==", "~=", "===")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(path: Path) -> dict[str, str | None]:
    """name -> version (None where the list gives only the name), from a pip freeze style file."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[canonical(name)] = version.strip() or None
    return pins


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def requirements_with(project: dict, extras: str) -> list[str]:
    """The project's dependencies and those of the comma-separated optional `extras`."""
    optional = project.get("optional-dependencies", {})
    unknown = [extra for extra in filter(None, extras.split(",")) if extra not in optional]
    if unknown:
        sys.exit(f"error: no extra {', '.join(unknown)} in pyproject.toml (it has {', '.join(optional)})")
    return project["dependencies"] + [r for extra in filter(None, extras.split(",")) for r in optional[extra]]


def stand_in_environment(root: Path, image: dict[str, str | None], tested: dict[str, str]) -> Path:
    """A venv whose site-packages hold only metadata, one dist-info per package of the machine. A
    package whose version was never recorded stands in at its tested version, or at 0 where it is
    not in the tested set either (nothing sdquant installs needs it)."""
    venv.create(root, with_pip=False)
    site_packages = next(root.glob("lib/python*/site-packages"))
    for name, version in image.items():
        version = version or tested.get(name, "0")
        info = site_packages / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return root / "bin" / "python"


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def target_flags(python_version: str) -> list[str]:
    flags = ["--only-binary=:all:", "--python-version", python_version, "--implementation", "cp"]
    for platform in PLATFORMS:
        flags += ["--platform", platform]
    return flags


def resolve(python: Path, requirements: list[str], constraints: Path, find_links: Path, flags: list[str],
            report: Path) -> dict[str, dict]:
    """What pip would install into `python`'s environment: name -> the report's metadata."""
    pip("--python", str(python), "install", "--dry-run", "--quiet", "--report", str(report), *flags,
        "--find-links", str(find_links), "-c", str(constraints), *requirements)
    items = json.loads(report.read_text())["install"]
    return {canonical(item["metadata"]["name"]): item["metadata"] for item in items}


def floors(requirements: list[str], python_version: str) -> dict[str, list[str]]:
    """name -> the lower bounds these requirements put on it, for the target Python."""
    environment = {"extra": "", "python_version": python_version, "python_full_version": f"{python_version}.0"}
    found: dict[str, list[str]] = {}
    for line in requirements:
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate(environment):
            continue
        bounds = [str(spec) for spec in requirement.specifier if spec.operator in FLOOR_OPERATORS]
        if bounds:
            found.setdefault(canonical(requirement.name), []).extend(bounds)
    return found


def unrecorded_fallbacks(image: dict[str, str | None], tested: dict[str, str], asked: dict[str, list[str]],
                         missing: dict[str, dict], flags: list[str], scratch: Path) -> list[Path]:
    """The machine's packages of unrecorded version that something to be installed asks a minimum
    of may be older than that: their tested release, where it is pure Python (small), so that pip
    there has it should the machine's own fall short (else pip keeps the machine's)."""
    unrecorded = {name: sorted(set(asked[name])) for name, version in image.items()
                  if version is None and name in asked and name in tested and name not in missing}
    if not unrecorded:
        return []
    pip("download", "--quiet", "--no-deps", *flags, "-d", str(scratch),
        *(f"{name}=={tested[name]}" for name in unrecorded))
    carried = []
    for wheel in sorted(scratch.glob("*.whl")):
        name = canonical(wheel.name.split("-")[0])
        pure = wheel.name.endswith("-none-any.whl")
        print(f"{'carried' if pure else 'assumed'}: {name} {tested[name]}, in case the machine's own is older "
              f"than {', '.join(unrecorded[name])}{'' if pure else ' (not pure Python: not carried)'}")
        if pure:
            carried.append(wheel)
    return carried


def slim(wheel: Path, dropped: str) -> None:
    """Rewrites `wheel` without the files under `dropped`, and without their lines in its RECORD."""
    slimmed = wheel.with_suffix(".slim")
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(slimmed, "w", zipfile.ZIP_DEFLATED) as target:
        for item in source.infolist():
            if item.filename.startswith(dropped):
                continue
            data = source.read(item)
            if item.filename.endswith(".dist-info/RECORD"):
                data = b"".join(line for line in data.splitlines(keepends=True) if not line.startswith(dropped.encode()))
            target.writestr(item, data)
    print(f"slimmed: {wheel.name} without {dropped} ({wheel.stat().st_size / 2**20:.1f} -> "
          f"{slimmed.stat().st_size / 2**20:.1f} MiB)")
    slimmed.replace(wheel)


def require_recent_pip() -> None:
    from importlib.metadata import version

    installed = Version(version("pip"))
    if installed < PIP_FOR_OTHER_PLATFORMS:
        print(f"error: fetch_wheels.py resolves for another platform, which needs pip {PIP_FOR_OTHER_PLATFORMS} or "
              f"newer (this Python has pip {installed}): run python -m pip install --upgrade pip", file=sys.stderr)
        sys.exit(2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python-version", default="3.12")
    parser.add_argument("--image", type=Path, default=REPO / "tools" / "maintainer" / "gpu_image_packages.txt",
                        help="packages the machine has, one per line, NAME or NAME==VERSION")
    parser.add_argument("--extras", default="", help="comma-separated optional extras of pyproject.toml to fetch too")
    parser.add_argument("--alone", nargs="*", default=[], metavar="NAME==VERSION",
                        help="wheels fetched without their dependencies, into .whl/alone/")
    args = parser.parse_args()
    require_recent_pip()
    requirements = requirements_with(pyproject()["project"], args.extras)
    dest = REPO / ".whl"
    image = read_pins(args.image)
    tested = {name: version for name, version in read_pins(REPO / "constraints.txt").items() if version}
    flags = target_flags(args.python_version)
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        built = scratch / "built"
        pip("wheel", "--quiet", "--no-deps", "-w", str(built), *(f"{n}=={tested[n]}" for n in SOURCE_ONLY))
        constraints = scratch / "constraints.txt"
        constraints.write_text("".join(f"{n}=={v}\n" for n, v in tested.items() if n not in image))
        python = stand_in_environment(scratch / "machine", image, tested)
        missing = resolve(python, requirements, constraints, built, flags, scratch / "report.json")

        asked = floors(requirements + [r for m in missing.values() for r in m.get("requires_dist", [])],
                       args.python_version)
        wheels = unrecorded_fallbacks(image, tested, asked, missing, flags, scratch / "fallback")
        wheels += [wheel for wheel in built.glob("*.whl") if canonical(wheel.name.split("-")[0]) in missing]
        for wheel in wheels:
            shutil.move(wheel, dest / wheel.name)
        downloads = [f"{m['name']}=={m['version']}" for name, m in missing.items() if name not in SOURCE_ONLY]
        if downloads:
            pip("download", "--quiet", "--no-deps", *flags, "-d", str(dest), *downloads)
    for wheel in sorted(dest.glob("*.whl")):
        dropped = SLIMMED.get(canonical(wheel.name.split("-")[0]))
        if dropped:
            slim(wheel, dropped)
    # pip builds sdquant in an isolated environment of its own, where the machine's packages do
    # not count: its build backend always travels.
    build_requires = pyproject()["build-system"]["requires"]
    pip("download", "--quiet", *flags, "-d", str(dest), *build_requires)
    print(f"build backend: {', '.join(build_requires)}")
    for name, metadata in sorted(missing.items()):
        print(f"missing: {name} {metadata['version']}")
    if args.alone:
        pip("download", "--quiet", "--no-deps", *flags, "-d", str(dest / "alone"), *args.alone)
        print(f"alone (installed with --no-deps): {', '.join(args.alone)}")
    wheels = sorted(dest.rglob("*.whl"))
    print(f"{len(wheels)} wheels, {sum(w.stat().st_size for w in wheels) / 2**20:.1f} MiB in {dest}")


if __name__ == "__main__":
    main()
