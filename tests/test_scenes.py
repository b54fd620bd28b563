"""The captioned scene generator and the detector that scores prompt adherence."""

from __future__ import annotations

import numpy as np
import pytest

from sdquant.quality import scenes


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


def _two(first, second, background="white") -> scenes.TwoObjectScene:
    return scenes.TwoObjectScene(scenes.Placed(*first), scenes.Placed(*second), background)


def test_detector_reads_both_objects_of_500_two_object_scenes_also_blurred():
    from scipy.ndimage import gaussian_filter

    drawn = scenes.sample(400, seed=31, objects=2) + scenes.sample(100, seed=32, held_out=True, objects=2)
    images = scenes.render(drawn, seed=33) / 255.0
    assert np.mean([scenes.detect_two(image) == scene for image, scene in zip(images, drawn)]) >= 0.99
    assert np.mean([scenes.score(image, scene.caption())["all"] for image, scene in zip(images, drawn)]) >= 0.99
    noise = np.random.default_rng(1)
    blurred = [gaussian_filter(image, (1.2, 1.2, 0)) + noise.normal(0, 0.03, image.shape) for image in images[:200]]
    assert np.mean([scenes.detect_two(image) == scene for image, scene in zip(blurred, drawn)]) >= 0.97


def test_held_out_colour_orders_reach_training_only_swapped():
    held_out = scenes.held_out_colour_orders()
    assert len(held_out) == scenes.HELD_OUT_COLOUR_ORDERS
    seen = {(s.first.colour, s.second.colour) for s in scenes.split(held_out=False, objects=2)}
    assert not held_out & seen
    assert {(second, first) for first, second in held_out} <= seen
    assert all(scenes.is_held_out(scene) for scene in scenes.split(held_out=True, objects=2))


def test_every_two_object_caption_parses_back_to_its_scene():
    for scene in scenes.all_scenes(objects=2):
        assert scenes.parse_caption(scene.caption()) == scene
    # Named right to left, the same scene.
    assert scenes.parse_caption("a blue square on the right and a red circle on the left, white background") == \
        _two(("circle", "red", "left"), ("square", "blue", "right"))


@pytest.mark.parametrize("prompt", ["a red circle on the left and a red square on the right, white background",
                                    "a red circle on the left and a blue square at the top, white background",
                                    "a red circle on the left and a teal square on the right, white background"])
def test_two_objects_of_one_colour_or_at_unpaired_places_are_not_scorable(prompt):
    image = scenes.render([_two(("circle", "red", "left"), ("square", "blue", "right"))])[0] / 255.0
    assert scenes.score(image, prompt) == {"scorable": False}


def test_swapped_objects_get_neither_shape_nor_colour_right():
    image = scenes.render([_two(("circle", "red", "left"), ("square", "blue", "right"))])[0] / 255.0
    right = scenes.score(image, "a red circle on the left and a blue square on the right, white background")
    assert right["all"] and right["objects"] == 2 and "size" not in right
    swapped = scenes.score(image, "a blue square on the left and a red circle on the right, white background")
    assert not swapped["shape"] and not swapped["colour"] and not swapped["all"]
    assert swapped["position"] and swapped["background"]
    # Only one of the two drawn: its place is not enough.
    one = scenes.render([scenes.Scene("circle", "red", "left", "small", "white")])[0] / 255.0
    assert not scenes.score(one, "a red circle on the left and a blue square on the right, white background")["all"]
