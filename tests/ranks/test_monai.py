"""MONAI 1.6 networks split in space equal their serial selves (float64: every output, the
input gradient, every parameter gradient) at spatial 2x1x1, 1x2x2 and data 2 x spatial
2x1x1; networks that cannot be split are refused by name; verification stops a network
whose own forward resizes a split tensor. The three heaviest cases are marked slow."""

import monai  # installed by the test set-up (the 'monai' extra, scripts/setup.sh): missing, this fails loudly
import pytest

import monai_cases as mc

D2, S122 = (2, 1, 1), (1, 2, 2)
slow = pytest.mark.slow

# (network, {config: global input shape}); sizes give every block at least one voxel at
# the deepest level, several unevenly (UNet 12 -> 3 split 2, SegResNet 24 -> 3, HighResNet 11).
NETS = [
    ("UNet", {"D2": (1, 1, 12, 8, 8), "S122": (1, 1, 8, 12, 12), "data2": (2, 1, 12, 8, 8)}),
    ("BasicUNet", {"D2": (1, 1, 32, 16, 16), "S122": (1, 1, 16, 32, 32), "data2": (2, 1, 32, 16, 16)}),
    ("DynUNet", {"D2": (1, 1, 16, 8, 8), "S122": (1, 1, 8, 16, 16), "data2": (2, 1, 16, 8, 8)}),
    ("SegResNet", {"D2": (1, 1, 24, 8, 8), "S122": (1, 1, 8, 16, 16), "data2": (2, 1, 16, 8, 8)}),
    ("SegResNetDS", {"D2": (1, 1, 16, 8, 8), "S122": (1, 1, 8, 16, 16), "data2": (2, 1, 16, 8, 8)}),
    # VNet (16-256 channels, no width option) at the two spatial grids only: its data 2 x spatial 2
    # case cost 25 s and proved what D2 and the other networks' data2 cases prove
    ("VNet", {"D2": (1, 1, 32, 16, 16), "S122": (1, 1, 16, 32, 32)}),
    ("AttentionUnet", {"D2": (1, 1, 12, 8, 8), "S122": (1, 1, 8, 12, 12), "data2": (2, 1, 12, 8, 8)}),
    ("DenseNet121", {"D2": (1, 1, 64, 32, 32), "S122": (1, 1, 32, 64, 64), "data2": (2, 1, 64, 32, 32)}),
    ("resnet10", {"D2": (1, 1, 64, 32, 32), "S122": (1, 1, 32, 64, 64), "data2": (2, 1, 64, 32, 32)}),
    ("resnet18", {"D2": (1, 1, 64, 32, 32), "S122": (1, 1, 32, 64, 64), "data2": (2, 1, 64, 32, 32)}),
    ("HighResNet", {"D2": (1, 1, 11, 8, 8), "S122": (1, 1, 8, 9, 7), "data2": (2, 1, 11, 8, 8)}),
    # The classification network with a global pool before its head: squeeze-and-excitation
    # blocks (replicated pools times split blocks), "same" padding by ConstantPad3d.
    ("EfficientNet", {"D2": (1, 1, 32, 32, 32), "S122": (1, 1, 32, 32, 32), "data2": (2, 1, 32, 32, 32)}),
]
GRIDS = {"D2": (2, D2), "S122": (4, S122), "data2": (4, D2)}
SLOW = {("VNet", "S122"), ("BasicUNet", "S122")}  # ~30 s each on a loaded 2-core machine (VNet's: nightly,
# tests/conftest.py NIGHTLY names what carries its proof in CI)
CASES = [pytest.param(name, config, shape, id=f"{name}-{config}", marks=slow if (name, config) in SLOW else ())
         for name, shapes in NETS for config, shape in shapes.items()]


@pytest.mark.parametrize("name,config,shape", CASES)
def test_network_equals_its_serial_self(pools, name, config, shape):
    world, spatial = GRIDS[config]
    data_size = world // (spatial[0] * spatial[1] * spatial[2])
    ref = mc.serial_reference(name, shape, data_size)  # once, here, not on every rank
    errors = pools.run(world, mc.check_net, name, ref, spatial=spatial, timeout=600)
    assert all(max(e.values()) <= mc.RTOL for e in errors)


def test_segresnetvae_is_refused_by_name_with_the_reason(pools):
    message = pools.run(2, mc.refused, "SegResNetVAE", spatial=D2)[0]
    assert "'SegResNetVAE' (SegResNetVAE) cannot be split in space" in message
    assert "view(-1, in_features)" in message and "F.mse_loss" in message


def test_dynunet_deep_supervision_on_uneven_blocks_is_stopped(pools):
    # Deep supervision resizes the half-resolution head with F.interpolate to the *local*
    # output shape: right where blocks halve exactly, wrong on 10 split 3 (4, 3, 3) -> 20 (7, 7, 6).
    messages = pools.run(3, mc.verify_stops, "DynUNet", (1, 1, 20, 8, 8), spatial=(3, 1, 1), timeout=300)
    assert "the output of module '<model>' (DynUNet) differs" in messages[0], messages[0]
    assert "F.interpolate on a split tensor" in messages[0], messages[0]


def test_segresnet_verifies_on_a_probe_sized_from_the_network(pools):
    reports = pools.run(2, mc.verify_passes, "SegResNet", spatial=D2, timeout=300)
    assert reports[0]["outputs"] < 1e-3 and reports[0]["gradients"] < 1e-3


def test_monai_is_the_version_the_extra_pins():
    major, minor = (int(v) for v in monai.__version__.split(".")[:2])
    assert (major, minor) == (1, 6), monai.__version__  # pyproject.toml: monai>=1.6,<1.7
