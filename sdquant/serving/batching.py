"""Which requests share a pipeline call, and each one's noise: requests of the same geometry, steps,
guidance, negative prompt and step cache are drawn together, at most the batch limit of images a
call, each image seeded as a call for its request alone seeds it (the request's seed + k)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..families.pipeline import SamplingSettings


@dataclass(frozen=True)
class Call:
    """One pipeline call: the requests it draws (their indices in the batch Ray gave) and its
    settings, every request's images in order, one prompt an image."""

    members: tuple[int, ...]
    settings: SamplingSettings


def share_key(settings: SamplingSettings) -> tuple:
    """What requests must agree on to be drawn in one call."""
    return (settings.geometry, settings.steps, settings.guidance_scale, settings.guidance_scale_2,
            settings.negative_prompt, settings.cache, settings.long_prompts)


def plan_calls(requests: list[SamplingSettings], max_images: int, seeds_mix: bool) -> list[Call]:
    """The calls that draw `requests`: those that share a key, in their order, packed into calls of
    at most `max_images` images; `seeds_mix`: false where the scheduler draws noise at every step
    from the call's seeds, so that each request needs a call of its own to draw its own images."""
    groups: dict[tuple, list[int]] = {}
    for index, settings in enumerate(requests):
        key = share_key(settings) if seeds_mix else (index,)
        groups.setdefault(key, []).append(index)
    calls = []
    for members in groups.values():
        packed: list[int] = []
        for index in members:
            if packed and _images(requests, packed) + len(requests[index].image_prompts) > max_images:
                calls.append(_call(requests, packed))
                packed = []
            packed.append(index)
        calls.append(_call(requests, packed))
    return calls


def _images(requests: list[SamplingSettings], members: list[int]) -> int:
    return sum(len(requests[index].image_prompts) for index in members)


def _call(requests: list[SamplingSettings], members: list[int]) -> Call:
    first = requests[members[0]]
    prompts = [prompt for index in members for prompt in requests[index].image_prompts]
    return Call(tuple(members), dataclasses.replace(first, prompts=prompts, images_per_prompt=1))


def call_latents(flow, requests: list[SamplingSettings], call: Call) -> torch.Tensor:
    """The call's initial noise: each request's own, drawn from its seeds as its call alone draws it."""
    return torch.cat([flow.initial_latents(requests[index]) for index in call.members])


def split(samples: torch.Tensor, requests: list[SamplingSettings], call: Call) -> dict[int, torch.Tensor]:
    """The call's samples by request index."""
    sizes = [len(requests[index].image_prompts) for index in call.members]
    return dict(zip(call.members, samples.split(sizes)))
