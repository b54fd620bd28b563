"""One Wan2.2 expert call split over the processes of a torchrun against the same call in one
process: the guidance halves over two processes (parallel.cfg=2), then the tokens over all of them
(parallel.ulysses), on the expert infer_trt.py would run (a quantize.py checkpoint in the torch
backend's FP8 kernels, or the unquantized one). Rank 0 prints the largest differences and writes
them with the device to --out.

    torchrun --nproc_per_node=2 benchmarks/wan_split_check.py --checkpoint quantized/<tiny_wan fp8 folder> \\
        --out benchmarks/results/wan_split_check_h100x2.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

from quality_recipes import compose_app
from sdquant import parallel
from sdquant.config import register_schemas
from sdquant.families import family_of
from sdquant.load import empty_backbones
from sdquant.runtime import torch_backend
from sdquant.workflow.settings import restore_quantized_backbones


def expert(args, device: torch.device) -> torch.nn.Module:
    """The second expert as the torch backend runs it: restored and in FP8 kernels where a
    checkpoint is given."""
    model = compose_app("sd_xl_quantize", [f"model={args.model}"]).model
    backbones = empty_backbones(model)
    if args.checkpoint:
        restore_quantized_backbones(model, "--checkpoint", args.checkpoint, backbones)
    module = backbones["transformer_2"].to(device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    if args.checkpoint:
        record = json.loads((Path(args.checkpoint) / "checkpoint.json").read_text())
        torch_backend.convert_quantized(module, family_of(model.family), "--checkpoint", "fp8", args.attention,
                                        record["settings"]["quantize"]["quant_level"])
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny_wan")
    parser.add_argument("--checkpoint", help="a quantize.py folder of --model (format=fp8); none: unquantized")
    parser.add_argument("--attention", default="auto", help="torch_backend.attention for the FP8 expert")
    parser.add_argument("--latent", default="5,16,16", help="latent frames, height, width")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    register_schemas()
    world = parallel.current_world()
    if world.size < 2:
        parser.error("run it under torchrun with 2 or more processes (--nproc_per_node)")
    device = parallel.rank_device(torch.device("cuda" if torch.cuda.is_available() else "cpu"), world)
    parallel.start(world, device)
    module = expert(args, device)
    dtype = next(module.parameters()).dtype
    torch.manual_seed(1)
    shape = [int(size) for size in args.latent.split(",")]
    inputs = {"hidden_states": torch.randn(2, module.config.in_channels, *shape).to(device, dtype),
              "timestep": torch.tensor([500.0, 500.0], device=device),
              "encoder_hidden_states": torch.randn(2, 64, module.config.text_dim).to(device, dtype)}
    results = {}
    with torch.no_grad():
        whole = module(**inputs, return_dict=False)[0]
        halves = parallel.place_of(parallel.SampleSplit(2, 1), world, device)
        stage = parallel.GuidanceHalf(lambda **call: {"latent": module(**call, return_dict=False)[0]}, halves)
        results["cfg_max_abs_difference"] = (stage(**inputs)["latent"] - whole).abs().max().item()
        tokens = parallel.place_of(parallel.SampleSplit(1, world.size), world, device)
        parallel.split_by_sequence([module], tokens, world.size)
        seen = []
        module.blocks[1].register_forward_hook(lambda layer, call, output: seen.append(tuple(output.shape)))
        results["ulysses_max_abs_difference"] = (module(**inputs, return_dict=False)[0] - whole).abs().max().item()
    results.update({"block_output_per_process": seen[0], "whole_output_max_abs": whole.abs().max().item(),
                    "fp8_processors_split": sum(getattr(getattr(layer, "processor", None), "sequence_group", None)
                                                is not None for layer in module.modules()),
                    "processes": world.size, "device": torch.cuda.get_device_name(device) if device.type == "cuda"
                    else "cpu", "checkpoint": args.checkpoint, "attention": args.attention, "dtype": str(dtype)})
    if world.is_main:
        print(json.dumps(results))
        if args.out:
            args.out.write_text(json.dumps(results, indent=1) + "\n")
    parallel.stop(world)


if __name__ == "__main__":
    main()
