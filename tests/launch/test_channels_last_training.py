"""channels-last in the training loop (``parallel.channels_last``): a float64 run ends with
the default NCDHW run's weights, checkpoints unchanged. (Layer by layer:
tests/ranks/test_channels_last.py.)"""

import json


def test_training_loop_channels_last_equals_default_in_float64(tmp_path):
    """parallel.channels_last, and parallel.conv_path=window, through the training loop: 2
    steps at spatial 2x1x1 end with the default's weights (float64: only the summation order
    may differ); the summary says which path the split convolutions took."""
    from train_helpers import launch, max_rel_diff, prepare, weights

    data = prepare("cosmoflow", tmp_path / "data", 16, 4, 2)
    common = ["--config-name", "quickstart", f"data.dir={data}", "train.max_steps=2", "train.eval_every=0",
              "train.eval_at_end=false", "run.progress=false", "run.tensorboard=false", "mlperf.enabled=false",
              "train.precision=fp64", "model.conv_filters=4", "model.n_conv_blocks=3", "model.dense_sizes=[8]",
              "model.dropout=0.0", "train.global_batch_size=2", "parallel.spatial=[2,1,1]"]
    runs = {}
    for name, option in (("false", []), ("true", ["parallel.channels_last=true"]),
                         ("window", ["parallel.conv_path=window"])):
        runs[name] = tmp_path / f"run_{name}"
        launch("cosmoflow", 2, [*common, f"run.dir={runs[name]}", *option], timeout=300)
    diff, key = max_rel_diff(weights(runs["false"]), weights(runs["true"]))
    assert diff < 1e-9, f"channels-last: {key} differs from the default layout by {diff:.2e} relative"
    diff, key = max_rel_diff(weights(runs["false"]), weights(runs["window"]))
    assert diff < 1e-9, f"conv_path=window: {key} differs from the default shell path by {diff:.2e} relative"
    paths = {name: json.loads((run / "summary.json").read_text())["conv_paths"] for name, run in runs.items()}
    assert paths["false"] == {"shell": 3} and paths["window"] == {"window": 3}, paths
    # the default (auto) resolves to NCDHW at float64, not measured faster there; true is true
    layouts = {name: json.loads((run / "summary.json").read_text())["channels_last"] for name, run in runs.items()}
    assert layouts == {"false": False, "true": True, "window": False}, layouts
