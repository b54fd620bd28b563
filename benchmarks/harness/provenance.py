"""What names a result: the code (a digest of sdquant/ and benchmarks/, which defines the peers as
well as ours, and the commit where there is one), the GPU, its driver, and the libraries."""

from __future__ import annotations

import hashlib
import subprocess
from importlib import metadata
from pathlib import Path

import torch

from sdquant import report

REPO = Path(__file__).resolve().parents[2]
CODE_FOLDERS = ("sdquant", "benchmarks")
# The files code_digest reads, as git pathspecs.
DIGESTED = tuple(f":(glob){folder}/**/*.{suffix}" for folder in CODE_FOLDERS for suffix in ("py", "sh"))
# Beyond sdquant's own provenance: the attention kernels and the peers' libraries.
MORE_PACKAGES = ("nvidia-cudnn-frontend", "fa3-fwd", "flash_attn_3", "torchao", "triton")


def code_digest(repo: Path = REPO) -> str:
    """One digest over the Python and shell source of sdquant/ and benchmarks/ (results left out)."""
    digest = hashlib.sha256()
    for folder in CODE_FOLDERS:
        digest.update(report.source_digest(repo / folder).encode())
        for path in sorted((repo / folder).rglob("*.sh")):
            digest.update(path.relative_to(repo).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def commit(repo: Path = REPO) -> str | None:
    """The checkout's commit, with "+changes" where a file the digest covers differs from it (a
    lease's tree goes without its results and scene models); None without git."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True)
        changed = subprocess.run(["git", "status", "--porcelain", "--", *DIGESTED], cwd=repo,
                                 capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return head.stdout.strip() + ("+changes" if changed.stdout.strip() else "")


def driver() -> str | None:
    try:
        found = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return found.stdout.splitlines()[0].strip()


def provenance() -> dict:
    versions = report.library_versions()
    for package in MORE_PACKAGES:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    return {"code": code_digest(), "commit": commit(),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "driver": driver(), "cuda": torch.version.cuda, "versions": versions}
