"""FP8 attention as one torch op, ``torch.ops.sdquant.fp8_attention``: FP8 q, k and v in, the FP8
output out, scaled for the FP8 GEMM that reads it.

On a CUDA GPU it runs cuDNN's fused FP8 attention (through nvidia-cudnn-frontend, imported when
first needed). FlashAttention-3's FP8 forward is a second op on the same inputs,
``torch.ops.sdquant.flash3_fp8_attention``, whose output is 16-bit: ``flash3_attention_rounded``
rounds it to FP8 as cuDNN's is, outside the op, so that under torch.compile the rounding fuses with
the kernel that reads the output (sdquant.runtime.attention says when the torch backend asks for
FlashAttention-3). On the CPU each runs a twin in plain torch: ``reference_attention`` computes
what ModelOpt's fake quantization of the attention computes (the dequantized q, k and v, fp32
scores and softmax, the softmax output rounded to FP8 at its constant range 1, as the exported
graph and TensorRT do) followed by the next layer's FP8 input quantizer; FlashAttention-3's op
takes the same attention before that rounding (``_unrounded_reference``) to 16 bits, as its kernel
returns it. The GPU tests
compare the two. They differ where cuDNN rounds the softmax output: its online softmax rounds each
probability relative to the running row maximum rather than to the row's sum, which is finer.

Layouts: q, k and v are (batch, heads, tokens, head_dim) with any strides whose last is 1, so the
(batch, tokens, heads, head_dim) memory a projection writes is read as it is. The output is
(batch, heads, tokens, head_dim) over (batch, tokens, heads, head_dim) memory, so that flattening
its heads for the next GEMM is a view. Fake (meta) implementations give torch.compile the outputs'
shapes and strides, so a compiled model traces each op as one node and a CUDA graph captures the
kernel.
"""

from __future__ import annotations

import importlib
import importlib.util

import torch

from ...quantize.recipe import SOFTMAX_AMAX
from .fp8 import fake_fp8, fp8_scales, to_fp8

FP8 = torch.float8_e4m3fn


def _output(q: torch.Tensor, v: torch.Tensor, dtype: torch.dtype = FP8) -> torch.Tensor:
    batch, heads, tokens, _ = q.shape
    return torch.empty((batch, tokens, heads, v.shape[-1]), dtype=dtype, device=q.device).transpose(1, 2)


def _unrounded_reference(q, k, v, q_scale, k_scale, v_scale, softmax_scale: float) -> torch.Tensor:
    """The twins' attention before its output is rounded: q, k, v dequantized with their scales
    (amax / 448), fp32 scores times `softmax_scale`, softmax, its output rounded to FP8 at range 1,
    times v, in fp32."""
    probability_inverse, probability_scale = _softmax_scales(q.device)
    scores = (q.float() * q_scale) @ (k.float() * k_scale).transpose(-2, -1) * softmax_scale
    probabilities = fake_fp8(scores.softmax(dim=-1), probability_inverse, probability_scale)
    return probabilities @ (v.float() * v_scale)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_scale: torch.Tensor,
                        k_scale: torch.Tensor, v_scale: torch.Tensor, softmax_scale: float,
                        out_inverse_scale: torch.Tensor) -> torch.Tensor:
    """The op's twin in plain torch, on any device: the attention of the dequantized q, k and v
    (_unrounded_reference) rounded to FP8 with `out_inverse_scale` (448 / the next layer's input
    amax)."""
    out = _output(q, v)
    out.copy_(to_fp8(_unrounded_reference(q, k, v, q_scale, k_scale, v_scale, softmax_scale), out_inverse_scale))
    return out


@torch.library.custom_op("sdquant::fp8_attention", mutates_args=(), device_types="cpu")
def fp8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_scale: torch.Tensor, k_scale: torch.Tensor,
                  v_scale: torch.Tensor, softmax_scale: float, out_inverse_scale: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T * softmax_scale) v on FP8 q, k and v (each with its scale, amax / 448), rounded
    to FP8 with `out_inverse_scale` (448 / the reading layer's input amax)."""
    return reference_attention(q, k, v, q_scale, k_scale, v_scale, softmax_scale, out_inverse_scale)


@fp8_attention.register_fake
def _(q, k, v, q_scale, k_scale, v_scale, softmax_scale, out_inverse_scale):
    return _output(q, v)


# FlashAttention-3's FP8 forward returns 16 bits (bf16), in the layout of its (batch, tokens, heads,
# head_dim) inputs.
FLASH3_OUTPUT = torch.bfloat16


@torch.library.custom_op("sdquant::flash3_fp8_attention", mutates_args=(), device_types="cpu")
def flash3_fp8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_scale: torch.Tensor,
                         k_scale: torch.Tensor, v_scale: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """fp8_attention's attention by FlashAttention-3 on a GPU, its 16-bit output not rounded; on the
    CPU the same twin, its fp32 output taken to 16 bits as FlashAttention-3's is."""
    out = _output(q, v, FLASH3_OUTPUT)
    out.copy_(_unrounded_reference(q, k, v, q_scale, k_scale, v_scale, softmax_scale))
    return out


@flash3_fp8_attention.register_fake
def _(q, k, v, q_scale, k_scale, v_scale, softmax_scale):
    return _output(q, v, FLASH3_OUTPUT)


def flash3_attention_rounded(q, k, v, q_scale, k_scale, v_scale, softmax_scale: float,
                             out_inverse_scale: torch.Tensor) -> torch.Tensor:
    """fp8_attention by FlashAttention-3: its output rounded to FP8 as cuDNN's is, in torch ops that
    torch.compile fuses with the output's reader."""
    return to_fp8(flash3_fp8_attention(q, k, v, q_scale, k_scale, v_scale, softmax_scale), out_inverse_scale)


# The cuDNN side, per process: a handle per GPU, the softmax output's constant scales per GPU, and a
# built graph per (device, shapes, strides, softmax scale), since building one takes milliseconds
# and a denoising run calls each attention shape thousands of times.
_HANDLES: dict[int, object] = {}
_SOFTMAX_SCALES: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
_GRAPHS: dict[tuple, "CudnnGraph"] = {}


def cuda_kernel_missing(device: torch.device) -> str | None:
    """Why cuDNN's FP8 attention cannot run on CUDA `device`, in words; None when it can."""
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        return (f"cuDNN's FP8 attention needs a Hopper or newer GPU (sm90+), and {torch.cuda.get_device_name(device)} "
                f"is sm{major}{minor}")
    try:
        import cudnn  # noqa: F401
    except (ImportError, OSError) as error:
        return f"cuDNN's FP8 attention needs the nvidia-cudnn-frontend package (import cudnn: {error})"
    return None


def _handle(device: torch.device):
    import cudnn

    if device.index not in _HANDLES:
        with torch.cuda.device(device):
            _HANDLES[device.index] = cudnn.create_handle()
    return _HANDLES[device.index]


def _softmax_scales(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(448, 1 / 448) on `device`: the softmax output's FP8 scale and its reciprocal, at range 1."""
    if device.index not in _SOFTMAX_SCALES:
        _SOFTMAX_SCALES[device.index] = tuple(s.to(device) for s in fp8_scales(torch.tensor(SOFTMAX_AMAX)))
    return _SOFTMAX_SCALES[device.index]


class CudnnGraph:
    """cuDNN's FP8 attention graph for one set of shapes and strides, built and planned once, with
    the graph tensors each execution binds. `every_plan`: the plans of cuDNN's heuristic B too, for
    use_plan (benchmarks/fp8_attention_plans.py times each); the first plan that builds runs."""

    def __init__(self, handle, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 softmax_scale: float, every_plan: bool = False):
        import cudnn

        fp8, fp32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
        graph = cudnn.pygraph(io_data_type=fp8, intermediate_data_type=fp32, compute_data_type=fp32, handle=handle)
        self.inputs = {name: graph.tensor(name=name, dim=list(t.shape), stride=list(t.stride()), data_type=fp8)
                       for name, t in (("q", q), ("k", k), ("v", v))}
        scalar = {"dim": [1, 1, 1, 1], "stride": [1, 1, 1, 1], "data_type": fp32}
        self.scales = {name: graph.tensor(name=name, **scalar)
                       for name in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")}
        out_tensor, _stats, _amax_s, amax_o = graph.sdpa_fp8(
            q=self.inputs["q"], k=self.inputs["k"], v=self.inputs["v"], **self.scales, generate_stats=False,
            attn_scale=softmax_scale, use_causal_mask=False, name="fp8_attention")
        # Hopper's FP8 attention refuses a 16-bit output: it is FP8, scaled by scale_o.
        out_tensor.set_output(True).set_dim(list(out.shape)).set_stride(list(out.stride())).set_data_type(fp8)
        amax_o.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(fp32)
        self.out, self.amax_o = out_tensor, amax_o
        graph.validate()
        graph.build_operation_graph()
        heuristics = [cudnn.heur_mode.A, cudnn.heur_mode.B] if every_plan else [cudnn.heur_mode.A]
        graph.create_execution_plans([*heuristics, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
        self.graph = graph
        # Made once: executions of one graph follow each other on the stream, and allocating per call
        # costs host time on the paths that run without CUDA graphs (the step caches' hooks). cuDNN
        # writes the output's range too; nothing reads it.
        self.unread_amax = torch.empty((1, 1, 1, 1), dtype=torch.float32, device=q.device)
        self.workspace = self._workspace(graph.get_workspace_size())
        # None: the plan cuDNN's build chose; an index once use_plan pins one.
        self.plan: int | None = None

    def _workspace(self, workspace_bytes: int) -> torch.Tensor | None:
        device = self.unread_amax.device
        return torch.empty(workspace_bytes, dtype=torch.uint8, device=device) if workspace_bytes else None

    def plan_names(self) -> list[str]:
        """The name of each plan the heuristics ranked, in their order."""
        return [self.graph.get_plan_name_at_index(index) for index in range(self.graph.get_execution_plan_count())]

    def use_plan(self, index: int) -> None:
        """Builds the plan at `index` and runs it from now on (a plain execute would keep running the
        plan the first build chose); cuDNN's error where it declines."""
        self.graph.build_plan_at_index(index)
        self.workspace = self._workspace(self.graph.get_workspace_size_plan_at_index(index))
        self.plan = index

    def execute(self, handle, tensors: dict[str, torch.Tensor], scales: dict[str, torch.Tensor],
                out: torch.Tensor) -> None:
        pack = {self.inputs[name]: tensors[name] for name in self.inputs}
        pack.update({self.scales[name]: scales[name] for name in self.scales})
        pack[self.amax_o] = self.unread_amax
        pack[self.out] = out
        if self.plan is None:
            self.graph.execute(pack, self.workspace, handle=handle)
        else:
            self.graph.execute_plan_at_index(pack, self.workspace, index=self.plan, handle=handle)


def _graph(handle, q, k, v, out, softmax_scale: float) -> CudnnGraph:
    import cudnn

    key = (q.device.index, softmax_scale, *((tuple(t.shape), t.stride()) for t in (q, k, v)))
    if key not in _GRAPHS:
        try:
            _GRAPHS[key] = CudnnGraph(handle, q, k, v, out, softmax_scale)
        except (cudnn.cudnnGraphNotSupportedError, RuntimeError, ValueError) as error:
            raise RuntimeError(f"cuDNN builds no FP8 attention for q {tuple(q.shape)}, k {tuple(k.shape)}, v "
                               f"{tuple(v.shape)} (batch, heads, tokens, head_dim; head_dim must be a multiple of 16): "
                               f"{type(error).__name__}: {error}; set torch_backend.attention=fp16 to run attention "
                               "in 16 bits") from error
    return _GRAPHS[key]


# FlashAttention-3's Python modules, the first installed taken: the source build's
# (benchmarks/build_flash3.sh), then fa3-fwd's from PyPI (the fp8-attention extra), a build of the
# same forward kernels under another module name whose flash_attn_func takes the same arguments.
FLASH3_MODULES = ("flash_attn_interface", "fa3_fwd_interface")


def flash3_module() -> str | None:
    """The FlashAttention-3 module installed (FLASH3_MODULES' first found); None without one."""
    return next((name for name in FLASH3_MODULES if importlib.util.find_spec(name) is not None), None)


def flash3_function():
    """FlashAttention-3's flash_attn_func, from the module installed."""
    return importlib.import_module(flash3_module()).flash_attn_func


@flash3_fp8_attention.register_kernel("cuda")
def _(q, k, v, q_scale, k_scale, v_scale, softmax_scale):
    # FlashAttention-3 reads (batch, tokens, heads, head_dim) views and takes descales per (batch,
    # head): the per-tensor ones, repeated.
    flash_attn_func = flash3_function()
    batch, heads = q.shape[:2]
    descales = {f"{name}_descale": scale.reshape(1, 1).expand(batch, heads).contiguous()
                for name, scale in (("q", q_scale), ("k", k_scale), ("v", v_scale))}
    return flash_attn_func(*(x.transpose(1, 2) for x in (q, k, v)), softmax_scale=softmax_scale,
                           **descales).transpose(1, 2)


@fp8_attention.register_kernel("cuda")
def _(q, k, v, q_scale, k_scale, v_scale, softmax_scale, out_inverse_scale):
    import cudnn

    out = _output(q, v)
    handle = _handle(q.device)
    # cuDNN launches on its handle's stream: torch's current one, which a CUDA graph capture records.
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(q.device).cuda_stream)
    probability_inverse, probability_scale = _softmax_scales(q.device)
    scales = {"descale_q": q_scale, "descale_k": k_scale, "descale_v": v_scale, "descale_s": probability_scale,
              "scale_s": probability_inverse, "scale_o": out_inverse_scale}
    _graph(handle, q, k, v, out, softmax_scale).execute(handle, {"q": q, "k": k, "v": v}, scales, out)
    return out
