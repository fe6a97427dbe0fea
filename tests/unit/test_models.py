"""The serial networks (CosmoFlow, 3D U-Net), their losses and metrics. (The U-Net loss
reduced across a spatial split: tests/ranks/test_losses_split.py.)"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cosmoflow.model import CosmoFlow, CosmoFlowConfig, conv_filters, mae_per_sample, mse_loss
from unet3d.losses import class_dice, dice_ce_loss, dice_per_sample
from unet3d.model import UNet3D, UNet3DConfig, level_filters


# -- CosmoFlow ------------------------------------------------------------------------
def test_cosmoflow_reference_shape():
    cfg = CosmoFlowConfig()
    assert conv_filters(cfg) == [32, 64, 128, 256, 512]
    m = CosmoFlow(cfg, 128)
    linears = [l for l in m.head if isinstance(l, nn.Linear)]
    # 128 / 2**5 = 4 voxels per dim, 512 channels, flattened channels-first.
    assert [(l.in_features, l.out_features) for l in linears] == [(512 * 4**3, 128), (128, 64), (64, 4)]
    assert isinstance(m.head[0], nn.Flatten) and isinstance(m.head[1], nn.Linear)
    assert [d.p for d in m.head if isinstance(d, nn.Dropout)] == [0.5, 0.5]
    slopes = {a.negative_slope for a in m.modules() if isinstance(a, nn.LeakyReLU)}
    assert slopes == {0.3}
    assert all(torch.count_nonzero(l.bias) == 0 for l in m.modules() if isinstance(l, (nn.Conv3d, nn.Linear)))



@pytest.mark.parametrize("size,blocks", [(16, 3), (32, 4), ((16, 32, 8), 3)], ids=["16^3-b3", "32^3-b4", "16x32x8-b3"])
def test_cosmoflow_forward_range(size, blocks):
    torch.manual_seed(0)
    m = CosmoFlow(CosmoFlowConfig(conv_filters=4, n_conv_blocks=blocks, dense_sizes=[16], dropout=0.0), size)
    dims = (size,) * 3 if isinstance(size, int) else size
    y = m(torch.randn(3, 4, *dims) * 5)
    assert y.shape == (3, 4)
    assert y.abs().max() <= 1.2  # 1.2 * tanh



def test_cosmoflow_input_normalisation_is_affine():
    torch.manual_seed(0)
    cfg = CosmoFlowConfig(conv_filters=2, n_conv_blocks=2, dense_sizes=[4], dropout=0.0)
    plain = CosmoFlow(cfg, 8)
    shifted = CosmoFlow(CosmoFlowConfig(**{**cfg.__dict__, "input_shift": 3.0, "input_scale": 2.0}), 8)
    shifted.load_state_dict(plain.state_dict())
    x = torch.randn(2, 4, 8, 8, 8)
    torch.testing.assert_close(shifted(x), plain((x - 3.0) * 2.0))



def test_cosmoflow_rejects_too_many_blocks():
    with pytest.raises(ValueError, match=r"n_conv_blocks=6.*\(16, 16, 16\).*at most 4"):
        CosmoFlow(CosmoFlowConfig(n_conv_blocks=6), 16)
    with pytest.raises(ValueError, match="kernel_size must be odd"):
        CosmoFlow(CosmoFlowConfig(kernel_size=4), 32)



def test_cosmoflow_loss_and_metric():
    pred = torch.tensor([[0.1, 0.2, -0.3, 0.0], [1.0, -1.0, 0.5, 0.5]])
    target = torch.zeros(2, 4)
    torch.testing.assert_close(mse_loss(pred, target), (pred**2).mean())
    torch.testing.assert_close(mae_per_sample(pred, target), pred.abs().mean(1))



# -- 3D U-Net ---------------------------------------------------------------------------
def test_unet_mlperf_filters_and_layers():
    cfg = UNet3DConfig()
    assert level_filters(cfg) == [32, 64, 128, 256, 320, 320]
    m = UNet3D(cfg)
    convs = [c for c in m.modules() if type(c) is nn.Conv3d]
    # every 3x3x3 conv is normalised, so bias-free; the 1x1x1 output conv has a bias
    assert all(c.bias is None for c in convs if c.kernel_size == (3, 3, 3))
    assert m.output.bias is not None and m.output.out_channels == 3
    strided = [c for c in convs if c.stride == (2, 2, 2)]
    assert len(strided) == 5
    ups = [c for c in m.modules() if isinstance(c, nn.ConvTranspose3d)]
    assert [(u.in_channels, u.out_channels) for u in ups] == [(320, 320), (320, 256), (256, 128), (128, 64), (64, 32)]
    assert all(u.kernel_size == (2, 2, 2) and u.stride == (2, 2, 2) and u.bias is not None for u in ups)
    assert sum(isinstance(n, nn.InstanceNorm3d) and n.affine for n in m.modules()) == len(convs) - 1



@pytest.mark.parametrize("norm", ["instance", "batch", "group", "none"])
def test_unet_forward_shapes(norm):
    torch.manual_seed(0)
    m = UNet3D(UNet3DConfig(depth=2, base_filters=4, max_filters=8, norm=norm, norm_groups=2))
    x = torch.randn(2, 1, 8, 12, 16)
    y = m(x)
    assert y.shape == (2, 3, 8, 12, 16)
    y.sum().backward()
    assert all(p.grad is not None for p in m.parameters())



# -- U-Net loss and metric ---------------------------------------------------------------
def _reference_dice_ce(logits, labels):
    """MONAI DiceCELoss(softmax, to_onehot_y, include_background=False, smooth 1e-6, batch=False)."""
    p = torch.softmax(logits, 1)
    onehot = F.one_hot(labels, logits.shape[1]).movedim(-1, 1).float()
    dims = (2, 3, 4)
    dice = (2 * (p * onehot).sum(dims) + 1e-6) / (p.sum(dims) + onehot.sum(dims) + 1e-6)
    return ((1 - dice[:, 1:].mean()) + F.cross_entropy(logits, labels)) / 2



def test_dice_ce_matches_reference_and_gradient():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 6, 5, 4, requires_grad=True)
    labels = torch.randint(0, 3, (2, 6, 5, 4))
    ours = dice_ce_loss(logits, labels[:, None])
    (g1,) = torch.autograd.grad(ours, logits)
    ref = _reference_dice_ce(logits, labels)
    (g2,) = torch.autograd.grad(ref, logits)
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(g1, g2)



def test_dice_metric_values():
    labels = torch.zeros(1, 4, 4, 4, dtype=torch.long)
    labels[0, :2] = 1
    labels[0, 3, 3, 3] = 2
    perfect = F.one_hot(labels, 3).movedim(-1, 1).float() * 10
    assert torch.allclose(dice_per_sample(perfect, labels), torch.ones(1))
    wrong = perfect.clone()
    wrong[0, :, 3, 3, 3] = torch.tensor([10.0, 0, 0])  # the tumour voxel called background
    d = class_dice(wrong, labels)
    assert d[0, 1].item() == pytest.approx(1.0)
    assert d[0, 2].item() == pytest.approx(1e-6 / (1 + 1e-6), abs=1e-6)
    assert dice_per_sample(wrong, labels).item() == pytest.approx(0.5, abs=1e-6)
