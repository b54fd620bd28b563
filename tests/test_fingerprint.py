"""A checkpoint's fingerprint holds the recipe as data: an edit of any row of the family's level
table, another level or format, or other tied ranges make another checkpoint, and the same settings
give the same fingerprint in any process. Checkpoints of an older layout are refused in one line;
one of an earlier fingerprint still loads by folder, but quantize.py never reuses it."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

from sdquant.assembly import restore
from sdquant.config import settled_config
from sdquant.families import family_of
from sdquant.families.sd import SDXL
from sdquant.quantize import checkpoint
from sdquant.runs.model import Model, settle_checkpoint
from sdquant.runs.quantize import calibration_of
from sdquant.workflow.export_trt import run_export
from sdquant.workflow.quantize import run_quantize

from conftest import FAST_QUANTIZE, REPO, compose_config, refused_in_one_line, settled_model


def _fingerprint(cfg) -> str:
    app = settled_config(cfg)
    return calibration_of(app, Model(app.model, family_of(app.model.family), {})).fingerprint()


def test_an_edit_of_any_row_of_the_level_table_is_another_checkpoint(quantize_cfg, monkeypatch):
    cfg = quantize_cfg("quantize.quant_level=2")
    before = _fingerprint(cfg)
    table = SDXL.level_table
    feed_forward = next(group for group in table.groups if group.level == 2.0)
    edits = {
        "a group's pattern": {"groups": tuple(dataclasses.replace(group, pattern="*.ff.*") if group is feed_forward
                                              else group for group in table.groups)},
        # Level 3's every-Linear row, which level 2 does not read.
        "a group above the level asked": {"groups": table.groups[:-1]},
        "a high-precision pattern": {"high_precision": (*table.high_precision, "*proj_in*")},
        "the attention scope": {"attention_scope": "*"},
    }
    for edit, change in edits.items():
        with monkeypatch.context() as patch:
            patch.setattr(SDXL, "level_table", dataclasses.replace(table, **change))
            assert _fingerprint(cfg) != before, edit
    assert _fingerprint(cfg) == before


def test_every_level_and_format_is_another_checkpoint(quantize_cfg):
    recipes = [("int8", level) for level in (1, 2, 2.5, 3)] + [("fp8", level) for level in (1, 2, 2.5, 3, 4)]
    fingerprints = {_fingerprint(quantize_cfg(f"quantize.format={fmt}", f"quantize.quant_level={level}"))
                    for fmt, level in recipes}
    assert len(fingerprints) == len(recipes)


def test_the_tied_ranges_are_in_fp8_fingerprints_only(quantize_cfg, monkeypatch):
    fp8, int8 = quantize_cfg("quantize.format=fp8", "quantize.quant_level=3"), quantize_cfg("quantize.quant_level=3")
    before = {"fp8": _fingerprint(fp8), "int8": _fingerprint(int8)}
    names = dataclasses.replace(SDXL.attention_projections, kv=(("to_k", "to_v", "to_out.0"), "to_kvo"))
    monkeypatch.setattr(SDXL, "attention_projections", names)
    assert _fingerprint(fp8) != before["fp8"]
    assert _fingerprint(int8) == before["int8"], "INT8 ranges are per channel and never tied"


def test_the_same_settings_give_the_same_fingerprint_in_another_process(model_cache):
    overrides = ["model=tiny_sdxl", "device=cpu", *FAST_QUANTIZE, "quantize.format=fp8", "quantize.quant_level=4"]
    here = _fingerprint(compose_config("sd_xl_quantize", overrides))
    code = ("import sys; sys.path.insert(0, 'tests'); from conftest import compose_config;"
            "from test_fingerprint import _fingerprint;"
            f"print(_fingerprint(compose_config('sd_xl_quantize', {overrides!r})))")
    # Another hash seed orders sets and dicts of strings otherwise, which a fingerprint must not follow.
    there = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": "12345"}).stdout.strip()
    assert there == here


def test_the_record_holds_the_level_table_it_was_calibrated_with(quantize_cfg):
    folder = run_quantize(quantize_cfg("quantize.quant_level=1"))
    record = json.loads((folder / checkpoint.RECORD_FILE).read_text())
    assert record["settings"]["recipe"]["level_table"] == json.loads(json.dumps(dataclasses.asdict(SDXL.level_table)))
    assert record["fingerprint"] == checkpoint.fingerprint(record["settings"])


def test_a_folder_of_the_layout_before_backbone_named_files_is_refused_in_one_line(quantize_cfg, tmp_path, capsys):
    folder = run_quantize(quantize_cfg("quantize.quant_level=1"))
    (folder / checkpoint.RECORD_FILE).rename(folder / "unet.json")
    cfg = compose_config("sd_xl_export", ["model=tiny_sdxl", "device=cpu", f"quantized_unet={folder}",
                                          f"infer.out_path={tmp_path / 'export'}"])
    capsys.readouterr()
    err = refused_in_one_line(run_export, cfg, capsys)
    assert f"quantized_unet={folder} is a checkpoint of the layout before" in err
    assert "(its record unet.json)" in err and err.endswith("quantize again with force=true")
    assert not (tmp_path / "export").exists()


def test_a_checkpoint_of_an_earlier_fingerprint_loads_by_folder_but_is_calibrated_again(
        quantize_cfg, tiny_pipeline, capsys):
    cfg = quantize_cfg("quantize.quant_level=1")
    folder = run_quantize(cfg)
    record_file = folder / checkpoint.RECORD_FILE
    record = json.loads(record_file.read_text())
    # As the settings were fingerprinted before they held the recipe.
    del record["settings"]["recipe"]
    record["fingerprint"] = checkpoint.fingerprint(record["settings"])
    record_file.write_text(json.dumps(record))

    unet = tiny_pipeline().unet
    restored = settle_checkpoint(settled_model("tiny_sdxl"), "quantized_unet", str(folder))
    restore(restored, {"unet": unet})
    assert restored.record["fingerprint"] == record["fingerprint"]
    assert any(module.is_enabled for name, module in unet.named_modules() if name.endswith("input_quantizer"))

    capsys.readouterr()
    assert run_quantize(cfg) == folder
    assert "reused" not in capsys.readouterr().out
    assert json.loads(record_file.read_text())["fingerprint"] == _fingerprint(cfg)
