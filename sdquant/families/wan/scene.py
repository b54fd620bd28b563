"""The Wan2.2 scene model (the A14B's two experts): its training schema (tools/train_scene_model.py
--config-name train_scene_wan), its architecture from it, its phases and its training loss."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ...config import DenoiserTraining, SceneTrainingApp, Settled, VaeTraining
from ...errors import UserError
from .graphs import Umt5Graph
from .sizes import WanSizes
from ..training import ScenePhase, autocast, kept


@dataclass
class WanSceneArchitecture(Settled):
    """Sizes of the Wan2.2 scene model: two WanTransformer3DModel experts of heads x head_dim width
    (as the A14B's high- and low-noise experts), a UMT5 encoder of heads of 32, and a Wan VAE of 16
    latent channels that scales each side by 2 per level after the first and the frames by 2 in each
    of its last vae_frame_levels levels."""

    heads: int = 4
    head_dim: int = 32
    layers: int = 8
    ffn: int = 512
    text_width: int = 128
    text_layers: int = 2
    vae_base: int = 16
    # Each level's width as a multiple of vae_base; three levels scale the sides 4x.
    vae_dim_mult: list[int] = field(default_factory=lambda: [1, 2, 2])
    vae_res_blocks: int = 1
    # How many of the last levels also halve the frames (the A14B's VAE: 2, so 4x; 81 -> 21 frames;
    # the scene model's clips keep their shapes whole only at 1).
    vae_frame_levels: int = 1

    def sizes(self, image_size: int) -> WanSizes:
        """These sizes as the family's (a clip's size is its frames', whatever `image_size`): UMT5
        with heads of 32, a Wan VAE of 16 channels whose levels after the first each halve the sides
        (the last vae_frame_levels also the frames), unit latent statistics that training replaces
        with the latents' own, and the A14B's flow shift."""
        levels = len(self.vae_dim_mult) - 1
        frame_levels = self.vae_frame_levels
        return WanSizes(text_width=self.text_width, text_layers=self.text_layers, text_heads=self.text_width // 32,
                        text_head_width=32, text_ff=2 * self.text_width, heads=self.heads, head_dim=self.head_dim,
                        ffn=self.ffn, layers=self.layers, latent_channels=16, freq_dim=128, rope_max_tokens=64,
                        flow_shift=3.0,
                        vae=(("base_dim", self.vae_base), ("z_dim", 16), ("dim_mult", list(self.vae_dim_mult)),
                             ("num_res_blocks", self.vae_res_blocks), ("temperal_downsample", [False] * (levels - frame_levels) + [True] * frame_levels),
                             # WanPipeline sizes its latent frames by this, not by the levels.
                             ("scale_factor_spatial", 2 ** levels), ("scale_factor_temporal", 2 ** frame_levels),
                             ("latents_mean", [0.0] * 16), ("latents_std", [1.0] * 16)))


# The architecture's counts, each at least 1.
COUNTS = ("heads", "layers", "ffn", "text_layers", "vae_base", "vae_res_blocks")


@dataclass
class ExpertsTraining(DenoiserTraining):
    """The experts of a model with several (the Wan2.2 scene model's two) and its text encoder."""

    # Steps in which the first expert learns every noise level alone before both start from its
    # weights for `steps` more on their own shares (0: each learns its share from the start).
    shared_steps: int = 0


@dataclass
class TrainWanSceneApp(SceneTrainingApp):
    """The built-in Wan2.2 scene model, on clips of moving shapes (tools/train_scene_model.py
    --config-name train_scene_wan)."""

    config_name: ClassVar[str] = "train_scene_wan"
    # Its encoder's tokenizer, by kind.
    tokenizers: ClassVar[tuple[str, ...]] = ("t5",)
    out_dir: str = "scenes_wan"
    family: str = "wan"
    dataset_size: int = 32768
    architecture: WanSceneArchitecture = field(default_factory=WanSceneArchitecture)
    vae: VaeTraining = field(default_factory=lambda: VaeTraining(steps=4000, batch_size=64, learning_rate=4e-4,
                                                                 kl_weight=1e-7, cuda_graph=True))
    denoiser: ExpertsTraining = field(default_factory=lambda: ExpertsTraining(steps=5000, shared_steps=4000,
                                                                              batch_size=512, learning_rate=1e-3,
                                                                              compile=True))

    def check(self) -> None:
        """Refuses, naming the key, sizes the architecture cannot be built with and shared steps below 0."""
        arch = self.architecture
        if arch.text_width < 32 or arch.text_width % 32:
            raise UserError(f"architecture.text_width={arch.text_width}: give a multiple of 32 (UMT5's heads are 32 "
                            "wide)")
        if len(arch.vae_dim_mult) < 3 or min(arch.vae_dim_mult) < 1:
            raise UserError(f"architecture.vae_dim_mult={list(arch.vae_dim_mult)}: give three or more positive "
                            "multiples (each level after the first halves the sides)")
        if not 0 <= arch.vae_frame_levels <= len(arch.vae_dim_mult) - 1:
            raise UserError(f"architecture.vae_frame_levels={arch.vae_frame_levels}: give 0 to "
                            f"{len(arch.vae_dim_mult) - 1}, the levels after the first of vae_dim_mult")
        if arch.head_dim < 6 or arch.head_dim % 2:
            raise UserError(f"architecture.head_dim={arch.head_dim}: give an even number of 6 or more (the rotary "
                            "embedding splits it into frame, height and width parts)")
        for key in COUNTS:
            if getattr(arch, key) < 1:
                raise UserError(f"architecture.{key}={getattr(arch, key)}: give 1 or more")
        if self.denoiser.shared_steps < 0:
            raise UserError(f"denoiser.shared_steps={self.denoiser.shared_steps}: give 0 or more")


def scene_phases(pipe, latents: torch.Tensor, data, block, generator: torch.Generator, experts: tuple[str, ...],
                 together: list) -> list:
    """With denoiser.shared_steps, the first expert and UMT5 learn every noise level first (one
    expert's cost a step, where the experts would each learn the captions' binding apart), then
    both experts start from its weights and learn their own shares together (the phases
    `together`). `experts`: their attributes on the pipeline, the high-noise expert first."""
    if not block.shared_steps:
        return together
    first, *others = (getattr(pipe, attribute) for attribute in experts)

    def share() -> None:
        for other in others:
            other.load_state_dict(first.state_dict())

    alone = ScenePhase(f"{experts[0]} at every noise level", [pipe.text_encoder, first],
                       scene_loss(pipe, latents, data, block, generator, experts, everywhere=True),
                       block.shared_steps, share)
    return [alone, *together]


def scene_loss(pipe, latents: torch.Tensor, data, block, generator: torch.Generator, experts: tuple[str, ...],
               everywhere: bool = False):
    """Each expert predicts the velocity (noise minus clip) of the straight path from the clip's
    latent to noise, on its own share of the noise levels as the A14B's experts serve them: the
    first from the pipeline's boundary up, the second below it (`everywhere`: the first alone,
    on every level). Within each share the levels are drawn as the sampler steps through them:
    uniform before the scheduler's flow shift, then shifted, so the pure noise a video starts
    from and the levels either side of the boundary are trained as often as the sampler visits
    them. Both experts see the same clips and captions each step (UMT5 runs once), each with its
    own noise; UMT5's states go in as the pipeline feeds them (zero past each caption), a dropped
    caption being the empty one, WanPipeline's negative prompt. `experts`: their attributes on the
    pipeline, the high-noise expert first."""
    import torch.nn.functional as F

    device = latents.device
    modules = [getattr(pipe, attribute) for attribute in experts]
    config = pipe.scheduler.config
    shift, train_steps = config.flow_shift, config.num_train_timesteps

    def unshifted(sigma: float) -> float:
        return sigma / (shift - (shift - 1) * sigma)

    boundary = unshifted(pipe.config.boundary_ratio)
    shares = [(0.0, 1.0)] if everywhere else [(boundary, 1.0), (0.0, boundary)]
    encoder = Umt5Graph(pipe.text_encoder)
    pad = pipe.tokenizer.pad_token_id

    def expert_loss(expert, share: tuple[float, float], clean: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        noise = torch.randn(clean.shape, device=device, generator=generator)
        low, high = share
        drawn = low + (high - low) * torch.rand(len(clean), device=device, generator=generator)
        sigma = shift * drawn / (1 + (shift - 1) * drawn)
        noisy = clean + sigma.view(-1, 1, 1, 1, 1) * (noise - clean)
        with autocast(device):
            velocity = expert(hidden_states=noisy, timestep=sigma * train_steps, encoder_hidden_states=text,
                              return_dict=False)[0]
        return F.mse_loss(velocity.float(), noise - clean)

    def loss_of(indices: torch.Tensor) -> torch.Tensor:
        ids = torch.where(kept(block, generator, device)[:, None], data.token_ids["t5"][indices],
                          data.empty_ids["t5"])
        with autocast(device):
            text = encoder(ids, (ids != pad).long())
        return sum(expert_loss(expert, share, latents[indices], text)
                   for expert, share in zip(modules, shares)) / len(shares)

    return loss_of
