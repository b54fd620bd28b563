"""A diffusion transformer's AdaLN modulations for every step of a generation in one pass, before
the denoising loop, instead of at each step.

A DiT's blocks scale, shift and gate their activations by linear maps of one embedding of the
timestep (and guidance) and the pooled text (AdaLN). Each map reads all of its weights for the
batch's few rows: Flux.1-dev's 77 maps hold 3.2 billion parameters, 6.5 GB in bf16, and read
them at every step (2.60 ms a step on an H100, 73 ms of an image's 28 steps). Their inputs are
known before the loop (the scheduler's timesteps, the guidance, the pooled text), so the torch
backend computes every step's modulations at once, one GEMM per map over all steps' rows, which
reads the weights once (one GEMM over all maps' weights joined took 2.31 ms for all 28 steps,
benchmarks/results/flux_double_adaln_h100.json), and hands each step its own rows as an input of
the transformer's call, which a CUDA graph copies in with the others (Flux.1-dev: 2.1 MB a step
and image, 59 MB an image's 28 steps). FP8 Flux ran 2.317 s an image against 2.372 computing them at
each step (flux_modulations_h100.json). Every value is the one the step would compute, but for
the GEMM's summation order over more rows.

Each family that takes the form (Flux, SD3) says which of its transformer's modules are AdaLN norms,
gives the stage's graph, which hands the embedding its inputs as the transformer's forward does, and
its pipeline asks for the rows before its loop (TextToImage.step_modulations).
"""

from __future__ import annotations

import torch

# The rows take the place of the pooled text in the transformer's call: it passes that input to
# its time_text_embed, and nothing else reads it.
ROWS_INPUT = "pooled_projections"
# The stage that computes them (the family's generation_stages) and its output.
MODULATIONS = "modulations"


class ModulationColumns(torch.nn.Module):
    """In place of one AdaLN's linear map: its own columns of the step's precomputed rows."""

    def __init__(self, start: int, stop: int):
        super().__init__()
        self.start, self.stop = start, stop

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return rows[:, self.start:self.stop]


class StepModulations(torch.nn.Module):
    """In place of a transformer's time_text_embed: that embedding and every AdaLN's linear map of
    it, whose outputs side by side `rows` computes for any number of rows at once; called as the
    transformer calls its embedding, it hands on the rows the transformer was given in place of the
    pooled text, and each AdaLN then reads its columns of them (ModulationColumns)."""

    def __init__(self, embed: torch.nn.Module, layers: list[torch.nn.Linear]):
        super().__init__()
        self.embed = embed
        self.layers = torch.nn.ModuleList(layers)
        self.width = sum(layer.out_features for layer in layers)

    def forward(self, *embedding_inputs: torch.Tensor) -> torch.Tensor:
        rows = embedding_inputs[-1]
        if rows.shape[-1] != self.width:
            raise ValueError(f"this transformer's AdaLN modulations are precomputed (sdquant.runtime.step_modulations): "
                             f"call it with a step's {self.width} modulations as {ROWS_INPUT}, not {rows.shape[-1]} "
                             "values")
        return rows

    def rows(self, *embedding_inputs: torch.Tensor) -> torch.Tensor:
        """(rows, width): every AdaLN's modulations of each row of the embedding's inputs."""
        embedding = torch.nn.functional.silu(self.embed(*embedding_inputs))
        return torch.cat([layer(embedding.to(layer.weight.dtype)) for layer in self.layers], dim=-1)


def precompute_modulations(transformer, adaln_norms: tuple[type, ...]) -> bool:
    """Moves every AdaLN linear map of `transformer` (the modules of the family's `adaln_norms`
    classes, each mapping the embedding it is given as linear(silu(emb))) into a StepModulations in
    place of its time_text_embed, in place, so that its calls take each step's modulations
    precomputed. For a transformer whose every AdaLN reads the embedding of time_text_embed and
    nothing else does (Flux, SD3). All or nothing: False, with nothing changed, where a map is not a
    plain Linear (a LoRA's unfused layer, fake quantization) or an AdaLN embeds its own inputs, and
    where the modulations are precomputed already."""
    adalns = [module for module in transformer.modules() if isinstance(module, adaln_norms)]
    if isinstance(getattr(transformer, "time_text_embed", None), StepModulations) or not adalns:
        return False
    if not all(type(adaln.linear) is torch.nn.Linear and type(adaln.silu) is torch.nn.SiLU
               and getattr(adaln, "emb", None) is None for adaln in adalns):
        return False
    layers = [adaln.linear for adaln in adalns]
    start = 0
    for adaln, layer in zip(adalns, layers):
        adaln.linear, adaln.silu = ModulationColumns(start, start + layer.out_features), torch.nn.Identity()
        start += layer.out_features
    transformer.time_text_embed = StepModulations(transformer.time_text_embed, layers)
    return True


def use_step_modulations(transformer, adaln_norms: tuple[type, ...]) -> None:
    """precompute_modulations, saying so where it cannot apply; not under a cache hook. A hook
    decides on the host before each block, so the compiler compiles the blocks one by one, and takes
    each ModulationColumns' integers as constants of its code: every block compiled its own, and
    Flux.1-dev at FP8 level 4 under TaylorSeer over whole blocks took 4.47 s an image against 1.32
    computing its modulations at each step (H100, benchmarks/results/flux_forms_cache_h100.json,
    flux_cache_diag_h100.json). Columns as an index buffer compile to one code for all blocks, but
    the whole-model graph then ran FP8 level 4 at 1.562x compiled bf16 in its run, against 1.604x and
    1.622x with integers in two others (flux_modulations_buffer_h100.json)."""
    if getattr(transformer, "is_cache_enabled", False):
        return
    if not precompute_modulations(transformer, adaln_norms):
        print("note: the transformer computes its AdaLN modulations at every step (precompute_modulations): one of "
              "them is not a plain Linear layer (a LoRA's, fake quantization), or they are precomputed already")


def modulations_stages(transformer, graph: torch.nn.Module, network) -> dict:
    """{MODULATIONS: the stage of `graph`, in the maps' precision} for a transformer whose
    modulations are precomputed; {} for one that computes them itself."""
    from .stages import TorchStage

    embedding = transformer.time_text_embed
    if not isinstance(embedding, StepModulations):
        return {}
    return {MODULATIONS: TorchStage(graph, network, embedding.layers[0].weight.dtype)}
