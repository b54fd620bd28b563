#!/usr/bin/env bash
# Data-parallel calibration on two GPUs (torchrun, NCCL, CUDA graph) against one GPU, on the tiny
# SDXL: every quantizer tensor of the two checkpoints must be identical. Needs two CUDA GPUs.
#   bash benchmarks/data_parallel_check.sh benchmarks/results/data_parallel_check.json
set -euo pipefail
out="${1:?usage: data_parallel_check.sh OUT.json}"
work="$(mktemp -d)"
common=(model=tiny_sdxl quantize.n_steps=4 quantize.calib_size=8 quantize.batch_size=1 quantize.quant_level=3)
python3 quantize.py "${common[@]}" out_dir="$work/one" hydra.run.dir="$work/h1"
python3 -m torch.distributed.run --standalone --nproc_per_node=2 quantize.py "${common[@]}" \
    out_dir="$work/two" hydra.run.dir="$work/h2"
python3 - "$work" "$out" <<'PY'
import glob, json, sys, torch
work, out = sys.argv[1:]
one, two = (glob.glob(f"{work}/{d}/*/unet.mto")[0] for d in ("one", "two"))
a = torch.load(one, weights_only=False, map_location="cpu")["model_state_dict"]
b = torch.load(two, weights_only=False, map_location="cpu")["model_state_dict"]
keys = [k for k in a if "quantizer" in k]
sidecar = json.load(open(two.replace("unet.mto", "checkpoint.json")))
report = {"check": "data_parallel", "device": torch.cuda.get_device_name(), "gpus": torch.cuda.device_count(),
          "quantizer_tensors": len(keys), "differing": sum(not torch.equal(a[k], b[k]) for k in keys),
          "processes": sidecar["job"]["processes"], "batches": sidecar["calibration"]["batches"]}
print(json.dumps(report))
open(out, "w").write(json.dumps(report, indent=2) + "\n")
PY
