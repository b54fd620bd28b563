"""Quality of the speed tables' second peer, torchao's dynamic FP8 per row on the backbone's Linear
layers (harness.peers.torchao_fp8, as its speed row sets it up), on a scene model's held-out
prompts beside the unquantized model of the same run: evaluate.py's report and grid, and a summary
in quality_over_calibrations.py's form (one run: torchao calibrates nothing) for the tables'
quality cell.

    python benchmarks/peer_quality.py                          # scenes_sdxl on a CPU
    python benchmarks/peer_quality.py --model scenes_flux

Only the Linear layers change: each runs in bf16 (torchao's per-row
FP8 takes bf16 weights; its speed row runs the whole backbone so), its output back in the
reference's dtype. torchao refuses FP8 below compute capability 8.9 by a check ahead of its
arithmetic; off such a GPU the check is set aside and torch's _scaled_mm computes the same scaled
e4m3 product on the CPU (tests/test_peer_quality.py holds it to the arithmetic written out).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
from pathlib import Path

import torch

from harness.peers import torchao_fp8
from quality_over_calibrations import RESULTS, Setting, summarized, summary_markdown
from quality_recipes import copy_report, held_out_file
from sdquant.api import compose
from sdquant.assembly import assemble
from sdquant.cli import exits_cleanly
from sdquant.config import register_schemas
from sdquant.errors import UserError
from sdquant.runs.evaluate import settle_evaluate
from sdquant.workflow.evaluate import evaluate

VARIANT = "torchao_row"


def torchao_linear_layers(backbone: torch.nn.Module, dtype: torch.dtype) -> dict:
    """Turns `backbone`'s Linear layers into torchao's dynamic FP8 per row, each in bf16 between
    casts from and back to `dtype`; returns what torchao_fp8 recorded."""
    allow_torchao_off_fp8_gpus()

    def to_bf16(_module, args, kwargs):
        cast = [arg.to(torch.bfloat16) if torch.is_tensor(arg) else arg for arg in [*args, *kwargs.values()]]
        return tuple(cast[:len(args)]), dict(zip(kwargs, cast[len(args):]))

    def back(_module, _args, output):
        return output.to(dtype)

    for module in backbone.modules():
        if isinstance(module, torch.nn.Linear):
            module.to(torch.bfloat16)
            module.register_forward_pre_hook(to_bf16, with_kwargs=True)
            module.register_forward_hook(back)
    return torchao_fp8(backbone, "PerRow")


def allow_torchao_off_fp8_gpus() -> None:
    """Sets aside torchao's refusal of FP8 where no GPU of compute capability 8.9 or more is (its
    quantize_ checks the hardware, not the arithmetic, which torch runs on the CPU too)."""
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9):
        return
    from torchao.quantization import quant_api

    quant_api._check_hardware_support = lambda granularity: None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="scenes_sdxl")
    parser.add_argument("--work", default=".scratch/peer_quality", help="the report's folder")
    parser.add_argument("--prompts-file", help="default: the shipped model's held-out prompts")
    parser.add_argument("--device", default="cpu")
    exits_cleanly(measure)(parser.parse_args())


def measure(args) -> None:
    if importlib.util.find_spec("torchao") is None:
        raise UserError("torchao is not installed: pip install -e \".[peers]\"")
    register_schemas()
    name = f"quality_means_{args.model}_{args.device}_torchao"
    run = settle_evaluate(compose("sd_xl_evaluate", args.model, [
        f"out_path={Path(args.work) / 'report'}", "sampling.batch_size=16", f"device={args.device}",
        f"sampling.prompts_file={held_out_file(args)}", "sampling.steps=20", f"+variants.{VARIANT}=null"]))
    peer = assemble(run.reference)
    record = {attribute: torchao_linear_layers(module, peer.dtype) for attribute, module in peer.modules.items()}
    described = ("torchao's dynamic FP8 per row on the Linear layers (bf16 between casts), "
                 f"torchao {next(iter(record.values()))['version']}")
    run = dataclasses.replace(run, variants={VARIANT: dataclasses.replace(run.variants[VARIANT], source=described)})
    report = evaluate(run, built={VARIANT: peer})
    args.calibrations, args.calib_size, args.kernels = 1, None, "torchao"
    summary = summarized(report, {VARIANT: Setting(None)}, args) | {"torchao": record}
    (RESULTS / f"{name}_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (RESULTS / f"{name}_summary.md").write_text(summary_markdown(summary))
    copy_report(name, Path(args.work) / "report")
    print(summary_markdown(summary))


if __name__ == "__main__":
    main()
