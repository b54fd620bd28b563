"""Each model's own guidance (model.guidance_scale, .guidance_scale_2) is what quantize.py and the
sampling scripts take where theirs are null, and a checkpoint made at a model's own guidance is the
same checkpoint whether its guidance was asked for by value or left null."""

from __future__ import annotations

import pytest

from sdquant.config import settled_config
from sdquant.errors import UserError
from sdquant.families import family_of
from sdquant.runs.quantize import settle_quantize

from conftest import compose_config


def _sampling_guidance(model: str, *overrides: str) -> dict:
    app = settled_config(compose_config("sd_xl_trt_inference", [f"model={model}", *overrides]))
    scales = family_of(app.model.family).settle_guidance(app.model, "sampling.", app.sampling.guidance_scale,
                                                         app.sampling.guidance_scale_2)
    return dict(zip(("guidance_scale", "guidance_scale_2"), scales))


def _calibration(*overrides: str) -> dict:
    return settle_quantize(compose_config("sd_xl_quantize", ["device=cpu", *overrides])).calibration.calibration.settings()


@pytest.mark.parametrize("model,first,second", [("sdxl_base", 5.0, None), ("flux_dev", 3.5, None),
                                                ("sd35_large_turbo", 0.0, None), ("wan22_t2v_a14b", 4.0, 3.0)])
def test_null_guidance_takes_the_models_own(model, first, second):
    assert _sampling_guidance(model) == {"guidance_scale": first, "guidance_scale_2": second}


def test_a_scale_given_wins_and_the_other_stays_the_models():
    assert _sampling_guidance("wan22_t2v_a14b", "sampling.guidance_scale=6.0") == {"guidance_scale": 6.0,
                                                                                     "guidance_scale_2": 3.0}
    assert _sampling_guidance("wan22_t2v_a14b", "sampling.guidance_scale_2=1.0") == {"guidance_scale": 4.0,
                                                                                       "guidance_scale_2": 1.0}


def test_an_image_models_own_guidance_and_the_same_value_given_make_one_checkpoint(model_cache):
    by_null = _calibration("model=tiny_sdxl")
    assert by_null["quantize"]["guidance_scale"] == 5.0 and by_null["quantize"]["guidance_scale_2"] is None
    assert by_null == _calibration("model=tiny_sdxl", "quantize.guidance_scale=5.0")
    assert _calibration("model=tiny_sdxl", "quantize.guidance_scale=3.0") != by_null


def test_a_models_own_guidance_and_the_same_value_given_make_one_checkpoint(model_cache):
    assert (_calibration("model=tiny_wan", "model.guidance_scale=4.0", "model.guidance_scale_2=3.0")
            == _calibration("model=tiny_wan", "quantize.guidance_scale=4.0", "quantize.guidance_scale_2=3.0"))


def test_a_second_scale_on_a_model_of_one_backbone_is_refused():
    with pytest.raises(UserError, match="model.guidance_scale_2=3.0"):
        _sampling_guidance("tiny_sdxl", "model.guidance_scale_2=3.0")
