"""Bad input ends with one clear line naming the key and a non-zero exit, and writes nothing."""

from __future__ import annotations

import pytest

from sdquant.cli import exits_cleanly
from sdquant.errors import EXIT_USER_ERROR
from sdquant.workflow.quantize import run_quantize

BAD_QUANTIZE = [
    (["quantize.quant_level=2.7"], "quantize.quant_level=2.7 is unknown"),
    (["quantize.quant_level=4"], "needs quantize.format=fp8"),
    (["quantize.calib_size=3"], "quantize.calib_size=3 must be a multiple of quantize.batch_size=2"),
    (["quantize.calib_size=4", "quantize.batch_size=8"], "quantize.calib_size=4 must be a multiple"),
    (["quantize.percentile=0"], "quantize.percentile=0.0 is outside (0, 1]"),
    (["quantize.percentile=1.5"], "quantize.percentile=1.5 is outside (0, 1]"),
    (["quantize.percentile=0.1"], "keeps no step"),
    (["quantize.alpha=1.2"], "quantize.alpha=1.2 is outside [0, 1]"),
    (["quantize.alpha=-0.1"], "quantize.alpha=-0.1 is outside [0, 1]"),
    (["quantize.collect_method=median"], "quantize.collect_method='median' is unknown"),
    (["model.tiny=false", "model.source=/nonexistent/sdxl"], "model.source=/nonexistent/sdxl: no such folder"),
    (["model.tiny=false", "model.source=/nonexistent/sdxl.safetensors"], "no such checkpoint file"),
    (["quantize.calib_size=400"], "holds 320 prompts but quantize.calib_size=400"),
    (["prompts_file=/nonexistent/prompts.txt"], "prompts_file=/nonexistent/prompts.txt: no such file"),
]


@pytest.mark.parametrize("overrides,message", BAD_QUANTIZE, ids=[" ".join(o) for o, _ in BAD_QUANTIZE])
def test_bad_quantize_settings_are_refused(quantize_cfg, tmp_path, capsys, overrides, message):
    cfg = quantize_cfg(*overrides)
    with pytest.raises(SystemExit) as exit_info:
        exits_cleanly(run_quantize)(cfg)
    assert exit_info.value.code == EXIT_USER_ERROR
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err
    assert len(err.splitlines()) == 1
    assert not (tmp_path / "quantized").exists()


def test_prompts_file_shorter_than_calib_size(quantize_cfg, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\n\na dog\n")
    cfg = quantize_cfg(f"prompts_file={prompts}")
    with pytest.raises(SystemExit):
        exits_cleanly(run_quantize)(cfg)
    assert f"prompts_file={prompts} holds 2 prompts but quantize.calib_size=4" in capsys.readouterr().err


@pytest.mark.parametrize("override,message", [
    ("quantize.quant_levle=3", "quant_levle"),
    ("quantize.format=int4", "int4"),
    ("quantize.n_steps=many", "n_steps"),
])
def test_script_refuses_wrong_key_or_type_at_start(run_script, tmp_path, override, message):
    result = run_script("quantize.py", "model=tiny_sdxl", override, f"out_dir={tmp_path / 'q'}")
    assert result.returncode != 0
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "q").exists()


def test_script_reports_validation_error_without_traceback(run_script, tmp_path):
    result = run_script("quantize.py", "model=tiny_sdxl", "quantize.quant_level=4", f"out_dir={tmp_path / 'q'}")
    assert result.returncode == EXIT_USER_ERROR
    assert result.stderr.strip().splitlines()[-1].startswith("error: quantize.quant_level=4")
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "q").exists()
