"""What each script does, stage by stage: one module per script, named as the script is (quantize,
export_trt, infer_trt, evaluate, train_scene_model), and what their flows share in common; the
scripts themselves only hand over the config."""
