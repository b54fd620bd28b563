"""Each default has one source: every value the scripts' YAML files set equals their dataclass
schema's default, so reading either tells the truth (the YAML carries the comments a user reads)."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from sdquant import config
from sdquant.families import all_families

from conftest import compose_config

SCHEMAS = {"sd_xl_quantize": config.QuantizeApp, "sd_xl_export": config.ExportApp,
           "sd_xl_trt_inference": config.InferApp, "sd_xl_evaluate": config.EvaluateApp,
           **{family.scene_app.config_name: family.scene_app for family in all_families() if family.scene_app}}


def _leaves(node, prefix: str = "") -> dict:
    if isinstance(node, dict):
        return {key: value for name, child in node.items() for key, value in _leaves(child, f"{prefix}{name}.").items()}
    return {prefix.rstrip("."): node}


@pytest.mark.parametrize("config_name", sorted(SCHEMAS))
def test_the_yaml_and_the_schema_give_the_same_defaults(config_name):
    composed = OmegaConf.to_container(compose_config(config_name, []), resolve=False)
    schema = OmegaConf.to_container(OmegaConf.structured(SCHEMAS[config_name]), resolve=False)
    composed.pop("model", None), schema.pop("model", None)
    yaml_values, schema_values = _leaves(composed), _leaves(schema)
    differing = {key: (value, schema_values.get(key)) for key, value in yaml_values.items()
                 if schema_values.get(key, "<absent>") != value}
    assert not differing, f"{config_name}.yaml and its schema disagree (yaml, schema): {differing}"
