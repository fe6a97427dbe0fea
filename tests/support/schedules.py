"""The MLPerf HPC CosmoFlow learning-rate schedule written out from its reference, for
tests/unit/test_schedule_reference.py and tests/launch/test_schedule_loop.py."""


def hpc_reference_lr(epoch: int, batch: int) -> float:
    """The MLPerf HPC CosmoFlow schedule as its reference describes it: Keras calls it with
    the 0-based epoch at each epoch's start; base 0.001 at batch 64, linear scaling, 4
    warmup epochs from the unscaled base, then the peak times the factor of the latest
    boundary strictly before the epoch ({32: 0.25, 64: 0.125})."""
    base, peak = 0.001, 0.001 * batch / 64
    if epoch < 4:
        return base + epoch * (peak - base) / 4
    factor = 1.0
    for boundary, f in ((32, 0.25), (64, 0.125)):
        if boundary < epoch:
            factor = f
    return peak * factor
