"""The Wan scene VAE's training step replayed as CUDA graphs (vae.cuda_graph=true) against the same
step run eagerly, at the recipe's sizes. Skipped without a CUDA GPU.

Run on the GPU machine:
    python -m pytest -m gpu tests/test_scene_training_gpu.py -n 0
"""

from __future__ import annotations

import copy

import pytest
import torch
from omegaconf import OmegaConf

from sdquant.quality.training import VaeLoss

from conftest import compose_config

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none is visible here)")]


def _pixels(seed: int, batch: int) -> torch.Tensor:
    generator = torch.Generator("cuda").manual_seed(seed)
    return torch.rand((batch, 3, 9, 64, 64), device="cuda", generator=generator) * 2 - 1


def _batch(seed: int, batch: int, latent_shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator("cuda").manual_seed(seed + 100)
    return _pixels(seed, batch), torch.randn(latent_shape, device="cuda", generator=generator, dtype=torch.bfloat16)


def test_the_vae_step_replayed_as_cuda_graphs_gives_the_eager_loss_and_gradients():
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    sizes = OmegaConf.to_object(compose_config("train_scene_wan", [])).architecture.sizes(64)
    eager_vae = AutoencoderKLWan(**dict(sizes.vae)).cuda().train()
    eager = VaeLoss(eager_vae, 1e-7)
    replayed_vae = copy.deepcopy(eager_vae)
    batch = 4
    with torch.no_grad():
        latent_shape = tuple(eager.posterior(_pixels(0, batch)).mean.shape)
    replayed = torch.cuda.make_graphed_callables(VaeLoss(replayed_vae, 1e-7), _batch(0, batch, latent_shape))
    losses = []
    # Two batches: a replay that kept its first inputs would give the first batch's loss twice.
    for seed in (1, 2):
        inputs = _batch(seed, batch, latent_shape)
        for vae in (eager_vae, replayed_vae):
            vae.zero_grad(set_to_none=True)
        want, got = eager(*inputs), replayed(*inputs)
        want.backward()
        got.backward()
        assert got.item() == pytest.approx(want.item(), rel=1e-3)
        for (name, a), b in zip(eager_vae.named_parameters(), replayed_vae.parameters()):
            error = ((b.grad - a.grad).norm() / a.grad.norm().clamp_min(1e-12)).item()
            assert error < 2e-2, f"{name}: the replayed gradient is {error:.4f} (relative) from the eager one"
        losses.append(got.item())
    assert losses[0] != losses[1]
