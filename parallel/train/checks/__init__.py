"""What a training job decides and refuses before its first step, each refusal one clear
message (``InputError``: exit 2, alike on every rank; ``docs/failures.md``).

``parallel.train.lifecycle.train`` calls them in this order, each once, in plain calls:

1. ``before_grid(cfg, family)``, before any process group: the config's values
   (``config``), the sample facts read once from the first training file (``samples``),
   the network at the volume it trains on (``fit``) -> a ``JobPlan``. With
   ``parallel.spatial=auto`` rank 0 chooses the split from that plan once the world is
   known (``autosplit``);
2. ``on_grid(plan, cfg, family, grid)``, collective: the sample files of both splits,
   each rank a share (``samples``), and every crop, window and case against the network
   and the split (``fit``) -> the plan, with every case's shape;
3. ``budget.start``: the grid's predicted peak per rank against ``parallel.memory_limit``,
   then (CPUs) the budget held while the job runs;
4. once the model is built and converted, the split model against its serial self
   (``equivalence``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from parallel.grid import Grid
from parallel.job.config import JobConfig
from parallel.job.errors import ConfigError, InputError
from parallel.job.family import Family
from parallel.train.checks.config import Shape, is_auto, train_volume, validate_config, window
from parallel.train.checks.fit import check_cases, check_model, check_volume
from parallel.train.checks.samples import SampleFacts, check_data, read_facts

__all__ = ["ConfigError", "InputError", "JobPlan", "SampleFacts", "before_grid", "check_cases", "check_data",
           "check_model", "is_auto", "on_grid", "read_facts", "train_volume", "validate_config", "window"]


@dataclass(frozen=True)
class JobPlan:
    """The facts a job starts from, found once and handed on: to the split's choice, the
    readers, the model and the summary."""

    facts: SampleFacts
    """The samples: volume, channels, stored bytes; after ``on_grid``, every case's shape."""
    volume: Shape
    """What the network trains on: the crop, or the cases' volume (the first case's)."""


def before_grid(cfg: JobConfig, family: Family) -> JobPlan:
    """The checks that need no process group (every rank alike): ``ConfigError`` naming the
    first key whose value cannot work; ``InputError`` for a training split without sample
    files, or a network that cannot run at the volume it trains on."""
    validate_config(cfg)
    facts = read_facts(cfg.data, family)
    volume = train_volume(cfg.data.crop, facts.volume)
    check_volume(family, cfg.model, volume, facts.channels)
    return JobPlan(facts, volume)


def on_grid(plan: JobPlan, cfg: JobConfig, family: Family, grid: Grid) -> JobPlan:
    """The checks that need the grid (collective): both splits' files, each rank a share,
    and every crop, window and case against the network and the split; the plan with
    every case's shape."""
    facts = check_data(cfg.data, cfg.model, family, grid, plan.facts)
    check_cases(cfg, family, grid, facts.channels, facts.train_shapes, facts.val_shapes)
    check_model(family, cfg.model, plan.volume, facts.channels, grid,
                local_batch=cfg.train.global_batch_size // max(1, grid.data_size * cfg.train.accum_steps))
    return dataclasses.replace(plan, facts=facts)
