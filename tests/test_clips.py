"""The video scene data and its detector (sdquant.quality.clips), checked against the clip renderer:
every attribute and the direction read back from clean and noisy renders, motion reversed reads as
the opposite direction, a clip that stands still moves in no direction, the temporal figures react
to flicker and to an object that changes, and prompts the model was never captioned with are scored
as missed."""

from __future__ import annotations

import numpy as np
import pytest

from sdquant.quality import clips


@pytest.mark.parametrize("objects", [1, 2])
def test_the_held_out_clips_are_apart_from_training_and_their_captions_parse_back(objects):
    training, held_out = clips.split(False, objects), clips.split(True, objects)
    assert held_out and not set(training) & set(held_out)
    assert len(training) + len(held_out) == len(clips.all_clips(objects))
    for clip in clips.sample(200, 0, objects=objects) + held_out[:50]:
        assert clips.parse_caption(clip.caption()) == clip


@pytest.mark.parametrize("objects", [1, 2])
@pytest.mark.parametrize("held_out", [False, True])
def test_every_attribute_and_the_direction_read_back_from_clean_renders(objects, held_out):
    group = clips.sample(8, 3, held_out=held_out, objects=objects)
    for clip, video in zip(group, clips.render(group)):
        scored = clips.score(video / 255.0, clip.caption())
        assert scored["all"] and scored["identity_kept"], (clip.caption(), scored)
        assert scored["jitter"] < 1.0 and scored["flicker"] == 0.0


def test_training_renders_with_jitter_and_noise_still_read_back():
    group = clips.sample(8, 5, objects=1) + clips.sample(4, 5, objects=2)
    videos = clips.render(group, seed=7).astype(np.float64)
    # Pixel noise of 4 levels, as a decoder's output carries: below every palette contrast.
    noisy = np.clip(videos + np.random.default_rng(0).normal(0, 4, videos.shape), 0, 255) / 255.0
    for clip, video in zip(group, noisy):
        scored = clips.score(video, clip.caption())
        assert scored["all"], (clip.caption(), scored)


def test_a_clip_played_backwards_moves_the_other_way():
    clip = clips.Clip("triangle", "green", "from top to bottom", "quickly", "black")
    backwards = clips.render([clip])[0][::-1] / 255.0
    assert not clips.score(backwards, clip.caption())["direction"]
    reversed_clip = clips.Clip("triangle", "green", "from bottom to top", "quickly", "black")
    assert clips.score(backwards, reversed_clip.caption())["all"]


@pytest.mark.parametrize("objects", [1, 2])
def test_a_motionless_clip_moves_in_no_direction(objects):
    """The first frame held for the whole clip: every attribute of a frame right, yet no motion, so
    a prompt that asks for motion in a direction is missed, for any direction it asks."""
    clip = clips.sample(1, 11, objects=objects)[0]
    still = np.repeat(clips.render([clip])[0][:1], clips.FRAMES, axis=0) / 255.0
    scored = clips.score(still, clip.caption())
    assert not scored["direction"] and not scored["all"]
    assert scored["colour"] and scored["shape"] and scored["identity_kept"]
    # The same objects asked to move any way their lanes (and, alone, any speed) allow.
    asked = [other.caption() for other in clips.all_clips(objects) if _motion_left_out(other) == _motion_left_out(clip)]
    assert len(asked) == (8 if objects == 1 else 4)
    for prompt in asked:
        assert not clips.score(still, prompt)["direction"], prompt


def _motion_left_out(clip) -> str:
    caption = clip.caption()
    for words in [*clips.DIRECTIONS, *clips.SPEEDS]:
        caption = caption.replace(words, "")
    return caption


def test_a_slow_clip_is_not_read_as_fast():
    slow = clips.Clip("circle", "blue", "from right to left", "slowly", "white")
    scored = clips.score(clips.render([slow])[0] / 255.0, slow.caption().replace("slowly", "quickly"))
    assert scored["direction"] and not scored["speed"] and not scored["all"]


def test_flicker_and_an_object_that_changes_show_in_the_temporal_figures():
    clip = clips.Clip("square", "red", "from left to right", "quickly", "gray")
    video = clips.render([clip])[0].astype(np.int16)
    steady = clips.score(video / 255.0, clip.caption())
    flickering = video.copy()
    flickering[1::2] += 12
    flickered = clips.score(np.clip(flickering, 0, 255) / 255.0, clip.caption())
    assert steady["flicker"] == 0.0 and flickered["flicker"] > 10
    # The square turns blue after the fourth frame: identity lost, whatever most frames show.
    changing = video.copy()
    square = np.all(changing[4:] == clips.COLOURS["red"], axis=-1)
    changing[4:][square] = clips.COLOURS["blue"]
    assert not clips.score(changing / 255.0, clip.caption())["identity_kept"]
    # A clip that draws nothing, or one of the two objects asked for, keeps no identity.
    blank = np.broadcast_to(np.asarray(clips.BACKGROUNDS["gray"]), video.shape)
    assert not clips.score(blank / 255.0, clip.caption())["identity_kept"]
    pair = clips.sample(1, 2, objects=2)[0]
    one_of_two = clips.render([pair])[0]
    one_of_two[np.all(one_of_two == clips.COLOURS[pair.second.colour], axis=-1)] = clips.BACKGROUNDS[pair.background]
    assert not clips.score(one_of_two / 255.0, pair.caption())["identity_kept"]


@pytest.mark.parametrize("prompt, unknown", [
    ("a red hexagon moving slowly from left to right, white background", {"shape": ["hexagon"]}),
    ("a red circle moving diagonally, white background", {"speed": [clips.NO_SPEED], "direction": ["diagonally"]}),
    ("a red circle at the top moving upwards and a blue square at the bottom moving from right to left, "
     "white background", {"direction": ["upwards"]}),
])
def test_a_prompt_never_captioned_is_scored_as_missed(prompt, unknown):
    clip = clips.Clip("circle", "red", "from left to right", "slowly", "white")
    scored = clips.score(clips.render([clip])[0] / 255.0, prompt)
    assert scored["scorable"] and not scored["all"] and scored["never_captioned"] == unknown


def test_a_prompt_that_is_no_clip_caption_is_not_scorable():
    video = clips.render([clips.Clip("circle", "red", "from left to right", "slowly", "white")])[0] / 255.0
    assert clips.score(video, "a photo of a cat") == {"scorable": False}


def test_evaluate_reads_each_videos_attributes_motion_and_temporal_figures(tmp_path, model_cache):
    """evaluate.py on a video model at the clips' size: every clip caption is scored by the clip
    detector (a random-weight model draws none of them right), the temporal figures are reported."""
    import json

    from sdquant.workflow.evaluate import run_evaluate

    from conftest import compose_config

    prompts = [clips.Clip("circle", "red", "from left to right", "slowly", "white").caption(),
               "a red circle moving diagonally, white background", "a photo of a cat"]
    report = run_evaluate(compose_config("sd_xl_evaluate", [
        "model=tiny_wan", "device=cpu", f"out_path={tmp_path}", f"sampling.prompts={json.dumps(prompts)}",
        "sampling.steps=2", "sampling.width=64", "sampling.height=64", "sampling.num_frames=9",
        "+variants.self=null"]))
    adherence = next(iter(report["adherence"].values()))
    assert (adherence["scored"], adherence["not_scorable"]) == (2, 1)
    assert {"direction", "speed"} <= set(adherence["attributes"]) and adherence["mean"]["all"] == 0.0
    assert set(adherence["temporal"]) == {"identity_kept", "jitter", "flicker"}
    assert adherence["per_prompt"][1]["never_captioned"]["direction"] == ["diagonally"]
    assert "Over time (the clip detector)" in (tmp_path / "quality.md").read_text()
    from PIL import Image

    # One row per prompt, a column per model (reference, self), each cell the first, middle and last
    # frames side by side.
    with Image.open(tmp_path / "grid.png") as grid:
        assert grid.size == (2 * 3 * 64, 3 * 64)
