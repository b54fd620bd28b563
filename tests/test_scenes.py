"""The captioned scene generator and the detector that scores prompt adherence."""

from __future__ import annotations

import numpy as np
import pytest

from sdquant import scenes


def test_detector_reads_back_what_the_generator_drew_on_500_scenes():
    drawn = scenes.sample(400, seed=11) + scenes.sample(100, seed=12, held_out=True)
    images = scenes.render(drawn, seed=13)
    agree = [scenes.detect(image / 255.0) == scene for image, scene in zip(images, drawn)]
    assert np.mean(agree) >= 0.99


def test_detector_tolerates_the_blur_of_a_decoder():
    from scipy.ndimage import gaussian_filter

    drawn = scenes.sample(200, seed=21)
    noise = np.random.default_rng(0)
    blurred = [gaussian_filter(image / 255.0, (1.2, 1.2, 0)) + noise.normal(0, 0.03, image.shape)
               for image in scenes.render(drawn, seed=22)]
    assert np.mean([scenes.detect(image) == scene for image, scene in zip(blurred, drawn)]) >= 0.97


def test_held_out_combinations_never_reach_the_training_split():
    held_out = scenes.held_out_combinations()
    assert len(held_out) == scenes.HELD_OUT_COUNT
    training = {(s.colour, s.shape, s.position) for s in scenes.split(held_out=False)}
    assert not held_out & training
    # Every single attribute still appears in training: held-out scenes only combine them anew.
    for index, values in enumerate((scenes.COLOURS, scenes.SHAPES, scenes.POSITIONS)):
        assert {combination[index] for combination in training} == set(values)


def test_rendering_and_sampling_are_deterministic_by_seed():
    first, second = scenes.sample(50, seed=3), scenes.sample(50, seed=3)
    assert first == second and first != scenes.sample(50, seed=4)
    assert np.array_equal(scenes.render(first, seed=5), scenes.render(second, seed=5))
    assert not np.array_equal(scenes.render(first, seed=5), scenes.render(first, seed=6))


def test_every_caption_parses_back_to_its_scene():
    for scene in scenes.all_scenes():
        assert scenes.parse_caption(scene.caption()) == scene


@pytest.mark.parametrize("prompt", ["a small crimson circle on the left, white background",
                                    "a large red hexagon in the centre, gray background",
                                    "a photo of an astronaut riding a horse on mars", ""])
def test_a_prompt_with_an_unknown_word_is_not_scorable(prompt):
    image = scenes.render([scenes.Scene("circle", "red", "left", "small", "white")])[0] / 255.0
    assert scenes.score(image, prompt) == {"scorable": False}


def test_score_names_the_wrong_attribute():
    image = scenes.render([scenes.Scene("circle", "red", "left", "small", "white")])[0] / 255.0
    row = scenes.score(image, "a small red square on the left, white background")
    assert row["scorable"] and not row["shape"] and not row["all"]
    assert row["colour"] and row["position"] and row["size"] and row["background"]


def test_a_plain_image_has_no_scene():
    assert scenes.detect(np.full((64, 64, 3), 0.5)) is None
