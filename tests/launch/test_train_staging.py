"""The training loop stages with read-once staging between the MLPerf staging events."""

from __future__ import annotations

import json

from train_helpers import launch, prepare

TINY = ["--config-name", "quickstart", "train.global_batch_size=2", "model.conv_filters=4",
        "model.n_conv_blocks=2", "model.dense_sizes=[16]", "run.progress=false", "run.log_rank=-3",
        "train.max_steps=1", "train.eval_at_end=false", "train.eval_every=0", "run.tensorboard=false"]


def test_training_stages_read_once_and_checks_the_copy(tmp_path):
    data = prepare("cosmoflow", tmp_path / "data", 16, 4, 2)
    stage = tmp_path / "local"
    run = tmp_path / "run"
    launch("cosmoflow", 2, [*TINY, f"data.dir={data}", "parallel.spatial=[2,1,1]", f"data.stage_dir={stage}",
                            "data.stage_read_once=true", "data.stage_blocks_only=false", f"run.dir={run}"])
    names = sorted(p.name for p in (data / "train").glob("*.h5"))
    assert sorted(p.name for p in (stage / "train").glob("*.h5")) == names
    records = sorted(p.name for p in (stage / "train" / ".staged").glob("*.json"))  # each copy checked
    assert records == [f"{n}.json" for n in names]
    log = (run / "mlperf.log").read_text().splitlines()
    keys = [json.loads(l.split(":::MLLOG ", 1)[1])["key"] for l in log if ":::MLLOG" in l]
    assert keys.index("staging_start") < keys.index("staging_stop") < keys.index("run_start")
