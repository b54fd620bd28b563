"""Each variant in a process of its own (its peak memory, compiled code and CUDA graphs its own),
its row added to one results file."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import traceback
from pathlib import Path

from .provenance import provenance


def add_process_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--variant-timeout", type=float, default=0,
                        help="with several variants, seconds after which a variant's process is stopped and its "
                             "row says so (0: none)")


def one_process_each(args, variants: list[str]) -> bool:
    """With several variants, runs this script again for each, in a process of its own and with the
    same arguments (the last --variants wins), and says that it did; a variant's process that is
    stopped (--variant-timeout) or dies before writing its row gets the reason as its row. Exits 1
    after the last variant if any failed."""
    if len(variants) < 2:
        return False
    failed = []
    for variant in variants:
        code = run_alone([sys.executable, sys.argv[0], *sys.argv[1:], "--variants", variant], args.variant_timeout)
        error = (f"stopped after {args.variant_timeout:g} s (its log says the step it was in)" if code is None
                 else f"its process was killed by signal {-code}" if code < 0 else None)
        if error:
            results = json.loads(args.out.read_text()) if args.out.is_file() else {"variants": {}}
            results["variants"][variant] = {"error": error}
            write_results(results, args.out)
        if code:
            print(f"{variant}: failed ({error or f'exit code {code}'})", flush=True)
            failed.append(variant)
    if failed:
        sys.exit(1)
    return True


def run_alone(command: list[str], timeout: float) -> int | None:
    """`command`'s exit code, run in a process group of its own; None where it ran past `timeout`
    seconds (0: no limit) and was stopped, with its children (the compiler's workers)."""
    process = subprocess.Popen(command, start_new_session=True)
    try:
        return process.wait(timeout=timeout or None)
    except subprocess.TimeoutExpired:
        return None
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def write_results(results: dict, out: Path) -> None:
    """Writes `results` with what names the code and the machine of its first row (provenance),
    under a temporary name renamed when complete."""
    results.setdefault("provenance", provenance())
    out.parent.mkdir(parents=True, exist_ok=True)
    temporary = out.with_name(out.name + ".tmp")
    temporary.write_text(json.dumps(results, indent=2) + "\n")
    os.replace(temporary, out)


def record_variant(results: dict, out: Path, variant: str, run) -> None:
    """`run()` (the variant's name and row) as the variant's row in `out`; where it raises, the
    error as its row (one line for a module that does not import, else the traceback on stderr),
    and the process exits 1."""
    try:
        name, row = run()
    except Exception as error:  # written down, then the process fails
        if isinstance(error, ImportError):
            print(f"{variant}: {error.name or 'a module'} does not import: {error}", flush=True)
        else:
            traceback.print_exc()
        results["variants"][variant] = {"error": f"{type(error).__name__}: {error}"}
        write_results(results, out)
        sys.exit(1)
    results["variants"][name] = row
    write_results(results, out)
