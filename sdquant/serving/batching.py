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
    settings, every request's images in order, one prompt an image, then `padding` images drawn
    only to reach a batch the pipeline was warmed at, and dropped."""

    members: tuple[int, ...]
    settings: SamplingSettings
    padding: int = 0


def share_key(settings: SamplingSettings) -> tuple:
    """What requests must agree on to be drawn in one call. Prompts encoded window by window
    (long_prompts=chunk) are padded to the call's longest, so such a request draws alone."""
    alone = (id(settings),) if settings.long_prompts == "chunk" else ()
    return (settings.geometry, settings.steps, settings.guidance_scale, settings.guidance_scale_2,
            settings.negative_prompt, settings.cache, settings.long_prompts, *alone)


def taken(waiting: list[SamplingSettings], max_images: int, seeds_mix: bool) -> list[int]:
    """The waiting requests the next call draws: the first one and, in their order, those that can
    share its call, up to `max_images` images (the first alone where seeds do not mix)."""
    if not seeds_mix:
        return [0]
    key = share_key(waiting[0])
    chosen, images = [0], images_of(waiting[:1])
    for index, settings in enumerate(waiting[1:], start=1):
        if share_key(settings) == key and images + len(settings.image_prompts) <= max_images:
            chosen.append(index)
            images += len(settings.image_prompts)
    return chosen


def padded(call: Call, images: int) -> Call:
    """`call` drawing `images` images: its own, then empty prompts."""
    extra = images - len(call.settings.image_prompts)
    if extra <= 0:
        return call
    settings = dataclasses.replace(call.settings, prompts=[*call.settings.prompts, *[""] * extra])
    return Call(call.members, settings, extra)


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
        images = 0
        for index in members:
            size = len(requests[index].image_prompts)
            if packed and images + size > max_images:
                calls.append(_call(requests, packed))
                packed, images = [], 0
            packed.append(index)
            images += size
        calls.append(_call(requests, packed))
    return calls


def images_of(requests: list[SamplingSettings]) -> int:
    """What requests count against the batch limit: their images."""
    return sum(len(settings.image_prompts) for settings in requests)


def _call(requests: list[SamplingSettings], members: list[int]) -> Call:
    first = requests[members[0]]
    prompts = [prompt for index in members for prompt in requests[index].image_prompts]
    return Call(tuple(members), dataclasses.replace(first, prompts=prompts, images_per_prompt=1))


def call_latents(flow, requests: list[SamplingSettings], call: Call) -> torch.Tensor:
    """The call's initial noise: each request's own, drawn from its seeds as its call alone draws
    it, then the padding's."""
    noise = [flow.initial_latents(requests[index]) for index in call.members]
    if call.padding:
        first = requests[call.members[0]]
        noise.append(flow.initial_latents(dataclasses.replace(first, prompts=[""] * call.padding, images_per_prompt=1)))
    return torch.cat(noise)


def split(samples: torch.Tensor, requests: list[SamplingSettings], call: Call) -> dict[int, torch.Tensor]:
    """The call's samples by request index, the padding's dropped."""
    sizes = [len(requests[index].image_prompts) for index in call.members]
    return dict(zip(call.members, samples[:sum(sizes)].split(sizes)))
