"""FP8 attention on the CPU (torch_backend.quantized=fp8 at quant_level=4): the op's CPU twin computes
ModelOpt's fake quantization of an attention layer (with its softmax quantizer), every converted
layer computes its fake-quant twin, q/k/v run as one FP8 GEMM of the tied checkpoint, torch.compile
traces the op, and the recipe and settings around it. On the scene models, calibrated at level 4
with real ModelOpt; each comparison is per layer on the layer's own input, so no CPU's rounding luck
can add up across layers."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.attention_processor import AttnProcessor

from sdquant.runtime import torch_backend
from sdquant.errors import UserError
from sdquant.families.flux.graphs import FluxTorchAttnProcessor, TransformerGraph, use_rotary_halves
from sdquant.families.sd.graphs import UNetGraph
from sdquant.runtime.kernels.fp8_layers import Fp8Linear
from sdquant.runtime.kernels.fp8 import fp8_scales, to_fp8
from sdquant.runtime.kernels.fp8_attention import flash3_attention_rounded, reference_attention
from sdquant.quantize.shared_ranges import attention_layers, output_groups, projection_groups
from sdquant.workflow.infer_trt import run_infer
from sdquant.workflow.quantize import run_quantize
from sdquant.families import family_of
from sdquant.families.sd import SDXL

from conftest import FAST_QUANTIZE, compose_config, restored_backbones

# What diffusers' attention modules call their projections, as every family says (the default).
NAMES = SDXL.attention_projections

MODELS = ("scenes_sdxl", "scenes_flux")
# One layer of each kind per model: SDXL's self-attention; Flux's joint (double) and single-stream.
LAYERS = {"scenes_sdxl": ("down_blocks.1.attentions.0.transformer_blocks.0.attn1",),
          "scenes_flux": ("transformer_blocks.0.attn", "single_transformer_blocks.0.attn")}
TEXT_TOKENS, IMAGE_SIDE = 32, 8   # the Flux scene model's T5 length; 64x64 pixels, 8x8 packed tokens


def _quantize(tmp_path_factory, model: str, level: int, calibration: list[str] = FAST_QUANTIZE):
    return run_quantize(compose_config("sd_xl_quantize", [
        f"model={model}", f"out_dir={tmp_path_factory.mktemp('quantized')}", "device=cpu", *calibration,
        "quantize.format=fp8", f"quantize.quant_level={level}"]))


@pytest.fixture(scope="module")
def level4(tmp_path_factory):
    return {model: _quantize(tmp_path_factory, model, 4) for model in MODELS}


def _restored(model: str, folder):
    (backbone,) = restored_backbones(model, folder).values()
    return backbone.float().eval()


def _family(model: str):
    return family_of(compose_config("sd_xl_quantize", [f"model={model}"]).model.family)


def _converted(model: str, folder):
    backbone = _restored(model, folder)
    conversion = torch_backend.convert_quantized(backbone, _family(model), str(folder), "fp8")
    return backbone, conversion


def _call(model: str, backbone) -> torch.Tensor:
    """One backbone call on random inputs (seeded), at the scene models' own sizes."""
    generator = torch.Generator().manual_seed(0)
    if model == "scenes_sdxl":
        inputs = (torch.randn(1, 4, 8, 8, generator=generator), torch.tensor([700.0]),
                  torch.randn(1, 77, 192, generator=generator), torch.randn(1, 176, generator=generator))
        return UNetGraph(backbone)(*inputs)
    rows, columns = torch.meshgrid(torch.arange(IMAGE_SIDE), torch.arange(IMAGE_SIDE), indexing="ij")
    image_ids = torch.stack([torch.zeros_like(rows), rows, columns], dim=-1).reshape(-1, 3).float()
    return TransformerGraph(backbone)(torch.randn(1, IMAGE_SIDE**2, 64, generator=generator),
                               torch.randn(1, TEXT_TOKENS, 128, generator=generator),
                               torch.randn(1, 64, generator=generator), torch.tensor([0.7]), image_ids,
                               torch.zeros(TEXT_TOKENS, 3))


def _readers(backbone, name: str) -> list:
    """The fake-quant layers that read the attention output, in the order of its tokens (a joint
    attention's text tokens come first)."""
    attn = backbone.get_submodule(name)
    if output_groups(attn, NAMES):
        return [attn.to_add_out, attn.to_out[0]]
    return [attn.to_out[0]] if isinstance(getattr(attn, "to_out", None), torch.nn.ModuleList) else \
        [backbone.get_submodule(name.rpartition(".")[0]).proj_out]


def _attention_calls(backbone, names: list[str]) -> tuple[dict, list]:
    """The hooks that record each named layer's call (its inputs and output) in the backbone calls
    to come, and where they record them."""
    calls = {}

    def keep(name: str):
        def hook(_module, args, kwargs, out):
            calls.setdefault(name, (args, kwargs, out))
        return hook

    return calls, [backbone.get_submodule(name).register_forward_hook(keep(name), with_kwargs=True) for name in names]


def _captured_attention(model: str, backbone, names: list[str]) -> dict:
    """What each layer of `names` computes in one fake-quant backbone call: q, k and v where
    ModelOpt's quantizers see them (entering scaled_dot_product_attention), the output where the
    reading layers' input quantizers see it (before and after them), and the layer's own call."""
    seen: dict = {name: {} for name in names}
    hooks = []

    def keep(name: str, role):
        width = backbone.get_submodule(name).inner_dim

        def hook(_module, args, out):
            seen[name].setdefault(role, (args[0][..., :width], out[..., :width]))
        return hook

    for name in names:
        attn = backbone.get_submodule(name)
        hooks += [getattr(attn, f"{role}_bmm_quantizer").register_forward_hook(keep(name, role)) for role in "qkv"]
        hooks += [reader.input_quantizer.register_forward_hook(keep(name, index))
                  for index, reader in enumerate(_readers(backbone, name))]
    calls, call_hooks = _attention_calls(backbone, names)
    with torch.no_grad():
        _call(model, backbone)
    for hook in hooks + call_hooks:
        hook.remove()
    for name in names:
        parts = [seen[name].pop(index) for index in range(len(_readers(backbone, name)))]
        seen[name].update(out=tuple(torch.cat(pair, dim=1) for pair in zip(*parts)), call=calls[name])
    return seen


def _fp8_steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many FP8 (E4M3) values apart a and b are, element by element: E4M3 codes count up with the
    magnitude, the top bit holding the sign."""
    def ordinal(x):
        bits = x.contiguous().view(torch.uint8).int()
        return torch.where(bits >= 128, 128 - bits, bits)

    return (ordinal(a) - ordinal(b)).abs()


def _assert_within_fp32_rounding(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Two FP8 tensors computed the same way in fp32 by different kernels: equal but where a float
    ulp moved a value across an FP8 rounding boundary, to the next FP8 value."""
    steps = _fp8_steps(actual, expected)
    flipped = float((steps > 0).float().mean())
    print(f"{what}: {flipped:.3%} of {steps.numel()} FP8 values one step apart, at most {int(steps.max())}")
    assert int(steps.max()) <= 1 and flipped < 0.01, what


def _modelopt_attention(attn, q, k, v) -> torch.Tensor:
    """ModelOpt's fake quantization of the attention, written out from the layer's own quantizers,
    its softmax quantizer (constant range 1) included: what its export gives TensorRT."""
    scores = attn.q_bmm_quantizer(q) @ attn.k_bmm_quantizer(k).transpose(-2, -1) * q.shape[-1] ** -0.5
    return attn.softmax_quantizer(scores.softmax(dim=-1)) @ attn.v_bmm_quantizer(v)


def _twin(attn, q, k, v, out_amax) -> torch.Tensor:
    """The op's CPU twin on the layer's q, k and v, rounded to FP8 with its checkpoint ranges, as
    (batch, tokens, heads x head_dim) FP8 values."""
    scales = {role: fp8_scales(getattr(attn, f"{role}_bmm_quantizer").amax) for role in "qkv"}
    fp8 = [to_fp8(x, scales[role][0]) for role, x in zip("qkv", (q, k, v))]
    out = reference_attention(*fp8, *(scales[role][1] for role in "qkv"), q.shape[-1] ** -0.5,
                              fp8_scales(out_amax)[0])
    return out.transpose(1, 2).flatten(2)


@pytest.mark.parametrize("model", MODELS)
def test_cpu_twin_computes_modelopt_fake_quantization_of_the_attention(level4, model):
    fake = _restored(model, level4[model])
    captured = _captured_attention(model, fake, list(LAYERS[model]))
    for name in LAYERS[model]:
        attn = fake.get_submodule(name)
        seen = captured[name]
        (q, q_fake), (k, k_fake), (v, v_fake) = seen["q"], seen["k"], seen["v"]
        # q, k and v are rounded with the checkpoint's own ranges, bit for bit as ModelOpt rounds them.
        for role, x, x_fake in zip("qkv", (q, k, v), (q_fake, k_fake, v_fake)):
            inverse, scale = fp8_scales(getattr(attn, f"{role}_bmm_quantizer").amax)
            assert torch.equal(to_fp8(x, inverse).float() * scale, x_fake), f"{name}: {role}"
        out_amax = _readers(fake, name)[0].input_quantizer.amax
        inverse = fp8_scales(out_amax)[0]
        with torch.no_grad():
            expected = to_fp8(_modelopt_attention(attn, q, k, v).transpose(1, 2).flatten(2), inverse)
            twin = _twin(attn, q, k, v, out_amax)
        _assert_within_fp32_rounding(twin, expected, f"{model} {name}: the twin against ModelOpt's quantizers")


def test_twin_equals_modelopt_forward_where_modelopt_rounds_softmax(level4):
    """diffusers' bmm attention processor, through which ModelOpt's fake quantization does round the
    softmax output, on a UNet self-attention layer: the twin gives the to_out input it quantizes."""
    fake = _restored("scenes_sdxl", level4["scenes_sdxl"])
    name = LAYERS["scenes_sdxl"][0]
    attn = fake.get_submodule(name)
    attn.set_processor(AttnProcessor())
    seen = _captured_attention("scenes_sdxl", fake, [name])[name]
    out_amax = attn.to_out[0].input_quantizer.amax
    # The bmm processor's q, k and v are (batch x heads, tokens, head_dim), k transposed.
    q, k, v = (seen[role][0].unflatten(0, (1, attn.heads)) for role in "qkv")
    with torch.no_grad():
        twin = _twin(attn, q, k.transpose(-2, -1), v, out_amax)
    expected = to_fp8(seen["out"][1], fp8_scales(out_amax)[0])
    _assert_within_fp32_rounding(twin, expected, "the twin against ModelOpt's bmm forward")


def _fake_quant_twin(backbone, name: str, seen: dict):
    """The fake-quant layer's output on its own q, k and v, with ModelOpt's softmax quantizer: its
    attention written out from its quantizers, then its own output layers (fake quantization)."""
    attn = backbone.get_submodule(name)
    q, k, v = (seen[role][0] for role in "qkv")
    readers = _readers(backbone, name)
    out = readers[0].input_quantizer(_modelopt_attention(attn, q, k, v).transpose(1, 2).flatten(2))
    if len(readers) == 2:
        text, image = out.tensor_split([seen["call"][1]["encoder_hidden_states"].shape[1]], dim=1)
        return attn.to_out[0](image), attn.to_add_out(text)
    # A UNet layer's output goes through its to_out; a single block's is read by the block's proj_out.
    return attn.to_out[0](out) if isinstance(getattr(attn, "to_out", None), torch.nn.ModuleList) else out


def _pairs(actual, expected):
    return zip(*(x if isinstance(x, tuple) else (x,) for x in (actual, expected)))


@pytest.mark.parametrize("model", MODELS)
def test_every_converted_attention_layer_computes_its_fake_quant_twin(level4, model):
    fake = _restored(model, level4[model])
    names = [name for name, attn in attention_layers(fake, NAMES) if attn.q_bmm_quantizer.is_enabled]
    captured = _captured_attention(model, fake, names)
    real, conversion = _converted(model, level4[model])
    # The converted layers hold fused projections in place of to_q, to_k and to_v.
    assert names == [name for name, module in real.named_modules() if hasattr(module, "fp8_attention")]
    assert conversion.attention == len(names) == {"scenes_sdxl": 11, "scenes_flux": 12}[model]
    worst = {"twin": 0.0, "modelopt": 0.0}
    for name in names:
        args, kwargs, modelopt_out = captured[name]["call"]
        with torch.no_grad():
            actual = real.get_submodule(name)(*args, **kwargs)
            twin = _fake_quant_twin(fake, name, captured[name])
        if isinstance(modelopt_out, torch.Tensor) and model == "scenes_flux":
            # A single block's attention output goes to proj_out, whose FP8 input quantizer rounds it
            # next; the converted layer gives it already rounded with that range.
            modelopt_out = _readers(fake, name)[0].input_quantizer(modelopt_out)
        for reference, expected in (("twin", twin), ("modelopt", modelopt_out)):
            for got, want in _pairs(actual, expected):
                worst[reference] = max(worst[reference], float((got - want).norm() / want.norm()))
    print(f"{model}: {len(names)} FP8 attention layers, the largest relative error against the fake-quant twin "
          f"{worst['twin']:.2e}, against ModelOpt's forward (softmax unrounded) {worst['modelopt']:.4f}")
    assert worst["twin"] < 5e-3
    assert worst["modelopt"] < 0.06


@pytest.mark.parametrize("model", MODELS)
def test_fused_qkv_gemm_equals_the_three_fp8_gemms_of_the_tied_checkpoint(level4, model):
    fake = _restored(model, level4[model])
    real, _ = _converted(model, level4[model])
    generator = torch.Generator().manual_seed(1)
    groups = 0
    for name, attn in attention_layers(fake, NAMES):
        for names, fused_name in projection_groups(attn, NAMES):
            layers = [attn.get_submodule(layer) for layer in names]
            weight_amax = [layer.weight_quantizer.amax for layer in layers]
            assert all(torch.equal(amax, weight_amax[0]) for amax in weight_amax), f"{name}: {names} not tied"
            separate = [Fp8Linear.from_linear(layer, layer.weight_quantizer.amax,
                                                            layer.input_quantizer.amax) for layer in layers]
            fused = getattr(real.get_submodule(name), fused_name)
            assert not any(hasattr(real.get_submodule(name), layer) for layer in names)
            x = torch.randn(1, 16, fused.in_features, generator=generator) * float(layers[0].input_quantizer.amax) / 3
            with torch.no_grad():
                for part, layer in zip(fused(x).chunk(len(names), dim=-1), separate):
                    assert float((part - layer(x)).norm() / layer(x).norm()) < 1e-6, f"{name}.{fused_name}"
            groups += 1
    # SDXL: 11 self- (q/k/v) and 11 cross-attention layers (k/v); Flux: 4 double blocks' two streams
    # and 8 single blocks.
    assert groups == {"scenes_sdxl": 22, "scenes_flux": 16}[model]
    # A checkpoint whose ranges are not tied keeps its three GEMMs.
    untied = [Fp8Linear.from_linear(torch.nn.Linear(8, 8), torch.tensor(amax), torch.tensor(1.0))
              for amax in (1.0, 2.0)]
    assert Fp8Linear.stacked(untied) is None


def test_joint_attention_outputs_share_their_input_range(level4):
    fake = _restored("scenes_flux", level4["scenes_flux"])
    joint = [attn for _, attn in attention_layers(fake, NAMES) if output_groups(attn, NAMES)]
    assert len(joint) == 4
    for attn in joint:
        assert torch.equal(attn.to_out[0].input_quantizer.amax, attn.to_add_out.input_quantizer.amax)


@pytest.mark.parametrize("model", MODELS)
def test_compile_traces_a_converted_attention_layer_as_one_graph_with_the_op(level4, model):
    real, _ = _converted(model, level4[model])
    calls, hooks = _attention_calls(real, list(LAYERS[model]))
    with torch.no_grad():
        _call(model, real)
    for hook in hooks:
        hook.remove()
    for name in LAYERS[model]:
        attn = real.get_submodule(name)
        args, kwargs, eager = calls[name]
        graphs = []

        def keep(graph_module, _example_inputs):
            graphs.append(graph_module)
            return graph_module.forward

        torch._dynamo.reset()
        with torch.no_grad():
            compiled = torch.compile(attn, fullgraph=True, backend=keep)(*args, **kwargs)
        ops = [node.target for node in graphs[0].graph.nodes if node.op == "call_function"]
        assert len(graphs) == 1 and torch.ops.sdquant.fp8_attention.default in ops, name
        for got, want in _pairs(compiled, eager):
            assert torch.equal(got, want), name
        # AOT autograd traces the op's fake implementation too, as inductor does before lowering.
        torch._dynamo.reset()
        with torch.no_grad():
            compiled = torch.compile(attn, fullgraph=True, backend="aot_eager")(*args, **kwargs)
        for got, want in _pairs(compiled, eager):
            assert float((got - want).norm() / want.norm()) < 1e-5, name


def test_flux_rotary_halves_give_every_fp8_attention_todays_q_and_k_in_halves_order(level4):
    """Layer by layer, on the inputs today's order gave each attention layer, so that no CPU's
    rounding adds up across layers: q and k where they enter FP8 attention are today's, reordered."""
    from sdquant.families.flux.graphs import _evens_then_odds, _tables_in_halves_order
    from sdquant.runtime.attention import Fp8Attention

    today, conversion = _converted("scenes_flux", level4["scenes_flux"])
    halves, _ = _converted("scenes_flux", level4["scenes_flux"])
    assert use_rotary_halves(halves)
    layers = [module for module in halves.modules() if isinstance(getattr(module, "processor", None), FluxTorchAttnProcessor)]
    assert len(layers) == 12 and all(attn.processor.rotary_halves for attn in layers)
    names = [name for name, module in today.named_modules() if isinstance(module, Fp8Attention)]
    assert len(names) == conversion.attention == 12
    entering: dict = {"today": {}, "halves": {}}

    def keep(order: str, name: str):
        def hook(_module, args):
            entering[order][name] = args
        return hook

    for order, model in (("today", today), ("halves", halves)):
        for name in names:
            model.get_submodule(name).register_forward_pre_hook(keep(order, name))
    attention_names = [name.rpartition(".")[0] for name in names]
    calls, hooks = _attention_calls(today, attention_names)
    with torch.no_grad():
        _call("scenes_flux", today)
        for hook in hooks:
            hook.remove()
        worst_output = 0.0
        for attention_name, name in zip(attention_names, names):
            args, kwargs, want = calls[attention_name]
            kwargs = {**kwargs, "image_rotary_emb": _tables_in_halves_order(None, None, kwargs["image_rotary_emb"])}
            got = halves.get_submodule(attention_name)(*args, **kwargs)
            back = torch.argsort(_evens_then_odds(entering["today"][name][0].shape[-1]))
            for role, today_value, halves_value in zip("qkv", entering["today"][name], entering["halves"][name]):
                if role != "v":
                    halves_value = halves_value[..., back]
                scale = float(today_value.abs().max())
                assert float((halves_value - today_value).abs().max()) <= 1e-5 * scale, f"{name}: {role}"
            for got_part, want_part in _pairs(got, want):
                worst_output = max(worst_output, float((got_part - want_part).norm() / want_part.norm()))
    # q.k sums the same products in another order, which moves an FP8 rounding of the softmax now
    # and then: the layers' outputs are today's up to those.
    print(f"FP8 level 4 attention layers, rotary halves against today's order: largest relative output "
          f"difference {worst_output:.2e}")
    assert worst_output < 5e-3


def test_flux_rotary_halves_leave_a_fake_quantized_transformer_as_it_is(level4):
    fake = _restored("scenes_flux", level4["scenes_flux"])
    weights = {name: tensor.clone() for name, tensor in fake.state_dict().items()}
    assert not use_rotary_halves(fake)
    assert all(torch.equal(tensor, weights[name]) for name, tensor in fake.state_dict().items())
    assert not fake.pos_embed._forward_hooks


def test_sdxl_level4_quantizes_self_attention_only(level4):
    fake = _restored("scenes_sdxl", level4["scenes_sdxl"])
    enabled = {name: [getattr(attn, f"{kind}_quantizer").is_enabled for kind in ("q_bmm", "k_bmm", "v_bmm", "softmax")]
               for name, attn in attention_layers(fake, NAMES)}
    assert {name for name, flags in enabled.items() if all(flags)} == {n for n in enabled if n.endswith(".attn1")}
    assert not any(any(flags) for name, flags in enabled.items() if name.endswith(".attn2"))


def test_fp8_attention_for_a_checkpoint_without_attention_ranges_names_its_level(tmp_path_factory, tmp_path):
    level3 = _quantize(tmp_path_factory, "scenes_sdxl", 3, ["quantize.n_steps=2", "quantize.calib_size=1"])
    with pytest.raises(UserError, match=r"torch_backend.attention=fp8: .* made at quant_level=3.*quant_level=4"):
        run_infer(compose_config("sd_xl_trt_inference", [
            "model=scenes_sdxl", "backend=torch", "device=cpu", f"out_path={tmp_path}", f"quantized_unet={level3}",
            "torch_backend.quantized=fp8", "torch_backend.attention=fp8"]))
    with pytest.raises(UserError, match="torch_backend.attention=fp16 applies to torch_backend.quantized=fp8"):
        run_infer(compose_config("sd_xl_trt_inference", [
            "model=scenes_sdxl", "backend=torch", "device=cpu", f"out_path={tmp_path}", f"quantized_unet={level3}",
            "torch_backend.attention=fp16"]))


def test_fp16_attention_keeps_a_level4_checkpoints_attention_in_16_bits(level4):
    backbone = _restored("scenes_sdxl", level4["scenes_sdxl"])
    conversion = torch_backend.convert_quantized(backbone, SDXL, "level 4", "fp8", attention="fp16")
    assert conversion.attention == 0
    layers = [attn for _, attn in attention_layers(backbone, NAMES)]
    assert not any(hasattr(attn, "fp8_attention") for attn in layers)
    # Its projections still run as one FP8 GEMM per group.
    assert all(isinstance(getattr(attn, "to_kv" if attn.is_cross_attention else "to_qkv"), Fp8Linear)
               for attn in layers)
    with torch.no_grad():
        _call("scenes_sdxl", backbone)


def test_centred_values_attend_as_the_values_do_within_fp8_rounding(monkeypatch):
    """The GPU's path, which takes the values' mean out of FP8 attention and adds it back, run here
    on the twin: values mostly on one side of their mean (so that, centred, they spread past their
    calibrated range) under peaked attention come as near exact attention as the plain path does."""
    import torch.nn.functional as F

    from sdquant.runtime.attention import Fp8Attention

    torch.manual_seed(0)
    heads, tokens, dim = 2, 256, 32
    q = torch.randn(1, heads, tokens, dim) * 1.5
    k = q + 0.1 * torch.randn(1, heads, tokens, dim)
    v = torch.where(torch.rand(1, heads, tokens, dim) < 0.75, 1.0, -1.0)
    exact = F.scaled_dot_product_attention(q, k, v)
    reader = Fp8Linear.from_linear(torch.nn.Linear(heads * dim, heads * dim), torch.tensor(1.0),
                                   exact.abs().amax())
    attention = Fp8Attention({"q": q.abs().amax(), "k": k.abs().amax(), "v": torch.tensor(1.0)}, reader)

    def error() -> float:
        out = attention.dequantize(attention(q, k, v), torch.float32)
        return float((out - exact).norm() / exact.norm())

    plain = error()
    monkeypatch.setattr(Fp8Attention, "centred_on", ("cpu",))
    centred = error()
    # Centred values rounded in their calibrated range would be clipped: 16% from exact here.
    print(f"plain {plain:.4f}, centred {centred:.4f}")
    assert plain < 0.05 and centred < plain + 0.02, (plain, centred)


def test_the_attention_kernel_is_settled_before_anything_runs(tmp_path):
    from sdquant.runtime.attention import chosen_kernel

    with pytest.raises(UserError, match="torch_backend.attention_kernel='cudnn' is unknown: choose auto, flash3, torch"):
        run_infer(compose_config("sd_xl_trt_inference", [
            "model=scenes_sdxl", "backend=torch", "device=cpu", f"out_path={tmp_path}",
            "torch_backend.attention_kernel=cudnn"]))
    assert not any(tmp_path.iterdir())
    cpu = torch.device("cpu")
    # auto falls back to torch's kernels where FlashAttention-3 cannot run; flash3 insists.
    assert (chosen_kernel("auto", cpu), chosen_kernel("torch", cpu)) == ("torch", "torch")
    with pytest.raises(UserError, match="torch_backend.attention_kernel=flash3: FlashAttention-3 runs on CUDA GPUs"):
        chosen_kernel("flash3", cpu)


def test_a_hopper_run_that_falls_back_to_torchs_attention_says_why(monkeypatch):
    from sdquant.runtime import attention

    # No CUDA device here: a GPU's compute capability and flash3_missing's answer stand in.
    missing = "flash_attn_interface is not installed"
    monkeypatch.setattr(attention, "flash3_missing", lambda device: missing)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    gpu = torch.device("cuda")
    assert attention.fallback_note("auto", gpu).endswith(missing)
    assert attention.fallback_note("torch", gpu) is None
    # FlashAttention-3 runs on Hoppers only: another GPU falling back is nothing to say.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 9))
    assert attention.fallback_note("auto", gpu) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    monkeypatch.setattr(attention, "flash3_missing", lambda device: None)
    assert attention.fallback_note("auto", gpu) is None
    monkeypatch.undo()
    assert attention.fallback_note("auto", torch.device("cpu")) is None


def test_flash3_marks_every_attention_layer_and_its_fp8_attention_rounds_in_the_graph(level4):
    from sdquant.runtime.attention import FLASH3, attention_modules, use_attention_kernel

    backbone = _restored("scenes_sdxl", level4["scenes_sdxl"])
    torch_backend.convert_quantized(backbone, SDXL, "level 4", "fp8")
    use_attention_kernel(backbone, "torch")
    layers = attention_modules(backbone)
    # Every attention layer of the UNet: self- and cross-attention of each transformer block.
    assert len(layers) == 2 * sum(1 for name, _ in backbone.named_modules() if name.endswith("attn1"))
    assert not any(hasattr(attn, FLASH3) for attn in layers)
    use_attention_kernel(backbone, "flash3")
    assert all(getattr(attn, FLASH3) for attn in layers)
    # FlashAttention-3's op returns 16 bits, rounded to FP8 outside it; on the CPU it runs the twin,
    # whose fp32 output goes through bf16 first, as FlashAttention-3's does: within one FP8 step of
    # the cuDNN op's twin, in the same layout.
    generator = torch.Generator().manual_seed(0)
    q, k, v = (to_fp8(torch.randn(1, 2, 64, 32, generator=generator), torch.tensor(100.0)) for _ in range(3))
    scale, inverse = torch.tensor(0.01), torch.tensor(50.0)
    args = (q, k, v, scale, scale, scale, 32 ** -0.5, inverse)
    flash3, cudnn = flash3_attention_rounded(*args), torch.ops.sdquant.fp8_attention(*args)
    assert flash3.dtype == cudnn.dtype and flash3.shape == cudnn.shape and flash3.stride() == cudnn.stride()
    assert torch.allclose(flash3.float(), cudnn.float(), rtol=2 ** -3, atol=2 ** -9)
    torch.library.opcheck(torch.ops.sdquant.flash3_fp8_attention.default, args[:7], test_utils=("test_faketensor",))
    # Compiled, the op is one node whose output's rounding stays in the graph for the compiler to fuse
    # with its reader; its fake implementation promises what the op returns.
    graphs = []

    def keep(graph_module, _example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    torch._dynamo.reset()
    compiled = torch.compile(flash3_attention_rounded, fullgraph=True, backend=keep)(*args)
    ops = [node.target for node in graphs[0].graph.nodes if node.op in ("call_function", "call_method")]
    assert ops.count(torch.ops.sdquant.flash3_fp8_attention.default) == 1
    assert torch.ops.sdquant.fp8_attention.default not in ops and "clamp" in ops
    torch._dynamo.reset()
    through_fakes = torch.compile(flash3_attention_rounded, fullgraph=True, backend="aot_eager")(*args)
    for got in (compiled, through_fakes):
        assert torch.equal(got.float(), flash3.float()) and got.stride() == flash3.stride()
