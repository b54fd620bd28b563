"""The Flux kernels that stand between FP8 level 4 and 1.6x (docs/speed.md), each compiled in
the form the torch backend traced and in candidate forms, at a block's full-size shapes
(1024x1024: 4608 tokens, 512 of them text, 24 heads of 128), timed per call with the kernels each
form compiles to, and how far its FP8 values are from the first form's. A candidate that wins here
is worth a form in the torch backend and a whole-pipeline run (flux_full_size.py). The `qk` and
`gelu_cat` cases ran on an H200 (benchmarks/results/flux_kernel_forms_h200.json), and
`rotate_half` became sdquant.families.flux.graphs.use_rotary_halves; the `double` and `adaln` cases ran
on an H100 (benchmarks/results/flux_double_adaln_h100.json): `all_steps` became
sdquant.runtime.step_modulations, and `per_stream_fp8`, twice as fast alone, gained nothing in the
whole model (docs/speed.md).

- `qk`: q and k of the fused q/k/v GEMM's output through RMSNorm, RoPE and the FP8 cast that
  FP8 attention reads. `interleaved` is diffusers' rotary embedding on neighbouring pairs (the
  compiler made it a two-pass reduction with four masked loads per element); `rotate_half` is
  the same attention with every head's features permuted evens-then-odds (in a model: the rows
  of to_q and to_k, the norms' weights and the rotary tables permuted alike, which leaves q.k
  unchanged), so each rotary pair is two contiguous halves; `multi_kernel` is `interleaved`
  compiled with inductor's multi-kernel choice between a persistent and a looped reduction.
- `gelu_cat`: a single block's `proj_out` input: the attention's FP8 output beside GELU of the
  MLP, cast to FP8. `dequantized` is what the block does today (the FP8 attention output
  dequantized, concatenated in bf16, cast again with the same scale); `fp8_cat` concatenates
  the FP8 attention output as it is with the FP8-cast GELU.
- `double`: a double block's q and k in rotary halves order, as use_rotary_halves leaves them:
  each stream's q/k norm, then RoPE and the FP8 cast. `joint` is the processor's order today
  (norms, the text and image tokens joined, RoPE over the joined tokens, cast), which compiled to
  five kernels taking 154 us a block on an H100, twice a single block's 79 for as many tokens;
  `per_stream` rotates each stream with its own rows of the tables before joining them, so each
  stream's norm and RoPE can be one reduction; `per_stream_fp8` also casts each stream and joins
  the FP8 bytes.
- `adaln`: every AdaLN modulation of a Flux.1-dev step (both streams' of 19 double blocks, 38
  single blocks', norm_out's: 77 bf16 GEMMs of one row each, reading 6.5 GB of weights, which
  took 79 ms of an FP8 image's 28 steps on an H100). `per_step` is what a call runs today;
  `all_steps` is one GEMM over all 28 steps' embeddings at once, as a pipeline could run before
  its loop (the timesteps, guidance and pooled text are known by then): its time is for all 28
  steps, and its values are held against `per_step`'s for the first step (bf16 rounding apart).

    python benchmarks/flux_kernel_forms.py --out benchmarks/results/flux_kernel_forms_h100.json
    python benchmarks/flux_kernel_forms.py --cases double,adaln --out benchmarks/results/flux_double_adaln_h100.json
    python benchmarks/flux_kernel_forms.py --device cpu --tokens 64 --out /tmp/forms.json   (a check)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from sdquant import report
from sdquant.runtime.compiled_forms import tanh_gelu
from sdquant.runtime.kernels.fp8 import to_fp8
from group_norm_kernels import ms_per_call
from harness.measure import kernel_profile

HEADS, HEAD_DIM, MLP = 24, 128, 12288
EPS = 1e-6


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, EPS)


def rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """diffusers' rotary embedding for Flux: neighbouring features rotated as pairs."""
    real, imag = x.unflatten(-1, (-1, 2)).unbind(-1)
    rotated = torch.stack([-imag, real], dim=-1).flatten(-2)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def rotary_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The same rotation on features permuted evens-then-odds: pair i is features i and i + 64."""
    first, second = x.chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def qk_form(rotary):
    def run(qkv, q_weight, k_weight, cos, sin, q_inverse, k_inverse):
        query, key, _ = (x.unflatten(-1, (HEADS, HEAD_DIM)) for x in qkv.chunk(3, dim=-1))
        query = rotary(rms_norm(query, q_weight), cos, sin)
        key = rotary(rms_norm(key, k_weight), cos, sin)
        # (batch, heads, tokens, head_dim) over (batch, tokens, heads, head_dim) memory, as the FP8
        # attention op takes them.
        return to_fp8(query.transpose(1, 2), q_inverse), to_fp8(key.transpose(1, 2), k_inverse)
    return run


def double_qk_form(per_stream: bool = False, fp8_per_stream: bool = False):
    def run(image_qkv, text_qkv, q_weights, k_weights, cos, sin, q_inverse, k_inverse):
        image_query, image_key, _ = (x.unflatten(-1, (HEADS, HEAD_DIM)) for x in image_qkv.chunk(3, dim=-1))
        text_query, text_key, _ = (x.unflatten(-1, (HEADS, HEAD_DIM)) for x in text_qkv.chunk(3, dim=-1))
        text_tokens = text_qkv.shape[1]
        outputs = []
        for image, text, (weight, added_weight), inverse in ((image_query, text_query, q_weights, q_inverse),
                                                              (image_key, text_key, k_weights, k_inverse)):
            image, text = rms_norm(image, weight), rms_norm(text, added_weight)
            if not per_stream:
                joined = rotary_halves(torch.cat([text, image], dim=1), cos, sin)
            else:
                parts = (rotary_halves(text, cos[:, :text_tokens], sin[:, :text_tokens]),
                         rotary_halves(image, cos[:, text_tokens:], sin[:, text_tokens:]))
                if fp8_per_stream:
                    # Joined as bytes: torch.cat has no FP8 kernel on every device.
                    fp8 = torch.cat([to_fp8(part, inverse).view(torch.uint8) for part in parts], dim=1)
                    outputs.append(fp8.view(torch.float8_e4m3fn).transpose(1, 2))
                    continue
                joined = torch.cat(parts, dim=1)
            outputs.append(to_fp8(joined.transpose(1, 2), inverse))
        return tuple(outputs)
    return run


def double_qk_inputs(tokens: int, device, dtype) -> dict:
    """A double block's fused q/k/v outputs of both streams, its four q/k norms' weights and the
    rotary tables over the joined tokens (text first), all in rotary halves order."""
    text_tokens = 512 if tokens > 1024 else tokens // 4
    generator = torch.Generator().manual_seed(2)
    inputs = permuted_qk_inputs(qk_inputs(tokens, device, dtype))

    def weight():
        return (1 + 0.1 * torch.randn(HEAD_DIM, generator=generator)).to(device, dtype)

    return {"image_qkv": inputs["qkv"][:, text_tokens:], "text_qkv": inputs["qkv"][:, :text_tokens].clone(),
            "q_weights": (weight(), weight()), "k_weights": (weight(), weight()), "cos": inputs["cos"],
            "sin": inputs["sin"], "q_inverse": inputs["q_inverse"], "k_inverse": inputs["k_inverse"]}


def gelu_cat_dequantized(attention_fp8, mlp, out_scale, out_inverse):
    attention = (attention_fp8.float() * out_scale).to(mlp.dtype)
    return to_fp8(torch.cat([attention, tanh_gelu(mlp)], dim=-1), out_inverse)


def gelu_cat_fp8(attention_fp8, mlp, out_scale, out_inverse):
    gelu_fp8 = to_fp8(tanh_gelu(mlp), out_inverse)
    # Concatenated as bytes: torch.cat has no FP8 kernel on every device.
    return torch.cat([attention_fp8.view(torch.uint8), gelu_fp8.view(torch.uint8)], dim=-1).view(torch.float8_e4m3fn)


def evens_then_odds(features: int) -> torch.Tensor:
    return torch.cat([torch.arange(0, features, 2), torch.arange(1, features, 2)])


def qk_inputs(tokens: int, device, dtype) -> dict:
    generator = torch.Generator().manual_seed(0)
    angles = torch.rand(tokens, HEAD_DIM // 2, generator=generator) * 6.28
    return {"qkv": torch.randn(1, tokens, 3 * HEADS * HEAD_DIM, generator=generator).to(device, dtype),
            "q_weight": (1 + 0.1 * torch.randn(HEAD_DIM, generator=generator)).to(device, dtype),
            "k_weight": (1 + 0.1 * torch.randn(HEAD_DIM, generator=generator)).to(device, dtype),
            # diffusers' tables: each pair's angle repeated for both of its features.
            "cos": angles.cos().repeat_interleave(2, -1)[None, :, None, :].to(device),
            "sin": angles.sin().repeat_interleave(2, -1)[None, :, None, :].to(device),
            "q_inverse": torch.tensor(448 / 8.0, device=device), "k_inverse": torch.tensor(448 / 8.0, device=device)}


def permuted_qk_inputs(inputs: dict) -> dict:
    """`inputs` as the rotate-half form takes them: q's and k's features permuted per head."""
    order = evens_then_odds(HEAD_DIM).to(inputs["qkv"].device)
    q, k, v = (x.unflatten(-1, (HEADS, HEAD_DIM)) for x in inputs["qkv"].chunk(3, dim=-1))
    qkv = torch.cat([q[..., order].flatten(-2), k[..., order].flatten(-2), v.flatten(-2)], dim=-1)
    return {**inputs, "qkv": qkv, "q_weight": inputs["q_weight"][order], "k_weight": inputs["k_weight"][order],
            "cos": inputs["cos"][..., order], "sin": inputs["sin"][..., order]}


def gelu_cat_inputs(tokens: int, device, dtype) -> dict:
    generator = torch.Generator().manual_seed(1)
    out_inverse = torch.tensor(448 / 6.0, device=device)
    attention = torch.randn(1, tokens, HEADS * HEAD_DIM, generator=generator).to(device)
    return {"attention_fp8": to_fp8(attention, out_inverse), "mlp": torch.randn(1, tokens, MLP, generator=generator).to(device, dtype),
            "out_scale": 1 / out_inverse, "out_inverse": out_inverse}


def agreement(got, want) -> dict:
    """How far a form's values are from today's: the share that differ, and by how much at most
    (a summation order or a skipped bf16 rounding moves an FP8 value by one step now and then)."""
    pairs = list(zip(got, want)) if isinstance(got, tuple) else [(got, want)]
    differing = sum((a != b).sum().item() if a.dtype != torch.float8_e4m3fn else
                    (a.view(torch.uint8) != b.view(torch.uint8)).sum().item() for a, b in pairs)
    return {"differing_fraction": differing / sum(b.numel() for _, b in pairs),
            "max_abs_difference": max((a.float() - b.float()).abs().max().item() for a, b in pairs),
            "max_abs_value": max(b.float().abs().max().item() for _, b in pairs)}


def qk_cases(tokens: int, device, dtype) -> dict:
    """Each case: (compiled form, its inputs, the first form's output in the case's order)."""
    qk = qk_inputs(tokens, device, dtype)
    order = evens_then_odds(HEAD_DIM).to(device)
    reference = torch.compile(qk_form(rotary_interleaved))(**qk)
    return {"qk_interleaved": (torch.compile(qk_form(rotary_interleaved)), qk, reference),
            "qk_rotate_half": (torch.compile(qk_form(rotary_halves)), permuted_qk_inputs(qk),
                               tuple(x[..., order] for x in reference)),
            "qk_multi_kernel": (torch.compile(qk_form(rotary_interleaved), options={"triton.multi_kernel": 1}), qk,
                                reference)}


def gelu_cat_cases(tokens: int, device, dtype) -> dict:
    gelu = gelu_cat_inputs(tokens, device, dtype)
    dequantized = torch.compile(gelu_cat_dequantized)
    return {"gelu_cat_dequantized": (dequantized, gelu, dequantized(**gelu)),
            "gelu_cat_fp8": (torch.compile(gelu_cat_fp8), gelu, dequantized(**gelu))}


def double_cases(tokens: int, device, dtype) -> dict:
    double = double_qk_inputs(tokens, device, dtype)
    joint = torch.compile(double_qk_form())
    reference = joint(**double)
    return {"double_joint": (joint, double, reference),
            "double_per_stream": (torch.compile(double_qk_form(per_stream=True)), double, reference),
            "double_per_stream_fp8": (torch.compile(double_qk_form(per_stream=True, fp8_per_stream=True)), double,
                                      reference)}


# Output widths, per 3072 features of the embedding, of Flux.1-dev's AdaLN modulations, and its steps.
ADALN_OUTPUTS = (6,) * (2 * 19) + (3,) * 38 + (2,)
STEPS = 28


def adaln_cases(tokens: int, device, dtype) -> dict:
    # The full width only where the shapes are the full model's: its weights are 6.5 GB.
    width = HEADS * HEAD_DIM if tokens > 1024 else 64
    outputs = [width * multiple for multiple in ADALN_OUTPUTS]
    generator = torch.Generator(device=device).manual_seed(3)
    weight = torch.randn(sum(outputs), width, generator=generator, device=device, dtype=dtype) / width**0.5
    bias = torch.randn(sum(outputs), generator=generator, device=device, dtype=dtype)
    layers = list(zip(weight.split(outputs), bias.split(outputs)))
    embeddings = torch.randn(STEPS, width, generator=generator, device=device, dtype=dtype)

    def per_step(embedding):
        x = torch.nn.functional.silu(embedding)
        return tuple(torch.nn.functional.linear(x, layer_weight, layer_bias) for layer_weight, layer_bias in layers)

    def all_steps(embeddings):
        return torch.nn.functional.linear(torch.nn.functional.silu(embeddings), weight, bias)

    first_step = {"embedding": embeddings[:1]}
    return {"adaln_per_step": (per_step, first_step, per_step(**first_step)),
            "adaln_all_steps": (all_steps, {"embeddings": embeddings}, per_step(**first_step),
                                lambda got: tuple(got[:1].split(outputs, dim=-1)))}


CASES = {"qk": qk_cases, "gelu_cat": gelu_cat_cases, "double": double_cases, "adaln": adaln_cases}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", type=int, default=4608)
    parser.add_argument("--cases", default="qk,gelu_cat,double", help="groups of forms, of: " + ", ".join(CASES))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16
    results = {"benchmark": "flux_kernel_forms", "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               "versions": report.library_versions(), "tokens": args.tokens, "forms": {}}
    cases = {}
    for group in args.cases.split(","):
        cases.update(CASES[group](args.tokens, device, dtype))
    for name, (fn, inputs, want, *comparable) in cases.items():
        got = fn(**inputs)
        if comparable:
            got = comparable[0](got)
        row = {"against_today": agreement(got, want)}
        if device.type == "cuda":
            row["ms_per_call"] = ms_per_call(lambda: fn(**inputs), calls=50)
            row["kernels"] = kernel_profile(lambda: fn(**inputs), top=8)
        results["forms"][name] = row
        print(f"{name}: {row.get('ms_per_call', float('nan')):.4f} ms a call; against today's form "
              f"{row['against_today']}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
