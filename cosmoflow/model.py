"""The MLPerf HPC CosmoFlow network, its loss (MSE) and its metric (MAE).

A plain serial ``torch.nn.Module``: it knows nothing of the process grid. The
spatially parallel form comes from ``parallel.parallelize(model, grid)``, which is why
the head is an ``nn.Sequential`` whose ``nn.Flatten`` is followed directly by an
``nn.Linear`` (channels-first flatten; the MLPerf reference flattens channels-last,
which only permutes the first dense layer's weights).

Reference architecture (``CosmoFlowConfig()`` defaults): five blocks of
Conv3d(k=3, 'same') -> LeakyReLU(0.3) -> MaxPool3d(2) with 32, 64, 128, 256, 512
filters; Flatten -> Linear 128 -> LeakyReLU -> Dropout -> Linear 64 -> LeakyReLU ->
Dropout -> Linear 4 -> tanh -> x1.2. Xavier-uniform weights, zero biases.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import nn


@dataclass
class CosmoFlowConfig:
    """Shape of the CosmoFlow network (section ``model`` of the CosmoFlow job)."""

    in_channels: int = 4
    """Input channels (4 redshifts in the MLPerf data)."""
    input_shift: float = 0.0
    """Subtracted from the (log-count) input before the first conv (0: reference behaviour)."""
    input_scale: float = 1.0
    """The shifted input is multiplied by this; a unit-variance input trains much faster."""
    n_conv_blocks: int = 5
    """Conv -> LeakyReLU -> MaxPool(2) blocks; the input size must be >= 2**n_conv_blocks."""
    conv_filters: int = 32
    """Filters of the first conv block; each further block doubles them (up to max_filters)."""
    max_filters: int = 512
    """Cap on the filters of any conv block (keeps deep 512^3 networks affordable)."""
    kernel_size: int = 3
    """Conv kernel size (odd: 'same' padding)."""
    dense_sizes: list[int] = field(default_factory=lambda: [128, 64])
    """Hidden dense layers of the head, before the output layer."""
    n_outputs: int = 4
    """Predicted parameters (Omega_m, sigma_8, n_s, Omega_b in the MLPerf data)."""
    dropout: float = 0.5
    """Dropout probability after each hidden dense layer (MLPerf reference 0.5; later submissions 0)."""
    leaky_slope: float = 0.3
    """Negative slope of the LeakyReLU activations (Keras default 0.3)."""
    output_scale: float = 1.2
    """The tanh output is multiplied by this (labels lie in [-1, 1])."""


class Scale(nn.Module):
    """Multiply by a constant (the reference's ``1.2 * tanh``)."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = float(factor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor

    def extra_repr(self) -> str:
        return f"factor={self.factor}"


def conv_filters(cfg: CosmoFlowConfig) -> list[int]:
    """Filters of each conv block."""
    return [min(cfg.conv_filters * 2**i, cfg.max_filters) for i in range(cfg.n_conv_blocks)]


class CosmoFlow(nn.Module):
    """CosmoFlow for inputs of shape (N, in_channels, D, H, W).

    ``input_size`` is the global (D, H, W) of a sample; it fixes the first dense layer.
    """

    def __init__(self, cfg: CosmoFlowConfig, input_size: Sequence[int] | int = 128) -> None:
        super().__init__()
        size = (input_size,) * 3 if isinstance(input_size, int) else tuple(int(s) for s in input_size)
        if len(size) != 3:
            raise ValueError(f"CosmoFlow input_size needs three dims (D, H, W), got {size}")
        if cfg.kernel_size % 2 != 1:
            raise ValueError(f"model.kernel_size must be odd for 'same' padding, got {cfg.kernel_size}")
        if not 0.0 <= cfg.dropout < 1.0:
            raise ValueError(f"model.dropout must lie in [0, 1), got {cfg.dropout}")
        out = [s // 2**cfg.n_conv_blocks for s in size]
        if min(out) < 1:
            raise ValueError(
                f"model.n_conv_blocks={cfg.n_conv_blocks} halves the input {size} "
                f"{cfg.n_conv_blocks} times to {tuple(out)}: use at most "
                f"{min(s.bit_length() - 1 for s in size)} blocks or a larger input"
            )
        self.input_size = size
        self.input_shift, self.input_scale = float(cfg.input_shift), float(cfg.input_scale)
        layers: list[nn.Module] = []
        cin = cfg.in_channels
        for cout in conv_filters(cfg):
            layers += [
                nn.Conv3d(cin, cout, cfg.kernel_size, padding=cfg.kernel_size // 2),
                nn.LeakyReLU(cfg.leaky_slope),
                nn.MaxPool3d(2),
            ]
            cin = cout
        self.features = nn.Sequential(*layers)
        head: list[nn.Module] = [nn.Flatten()]
        width = cin * out[0] * out[1] * out[2]
        for hidden in cfg.dense_sizes:
            head += [nn.Linear(width, hidden), nn.LeakyReLU(cfg.leaky_slope), nn.Dropout(cfg.dropout)]
            width = hidden
        head += [nn.Linear(width, cfg.n_outputs), nn.Tanh(), Scale(cfg.output_scale)]
        self.head = nn.Sequential(*head)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Xavier-uniform weights and zero biases, as in the reference."""
        for m in self.modules():
            if isinstance(m, (nn.Conv3d, nn.Linear)):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_shift != 0.0 or self.input_scale != 1.0:
            x = (x - self.input_shift) * self.input_scale
        return self.head(self.features(x))


def reference_decayed(model: CosmoFlow) -> list[str]:
    """Names of the parameters the MLPerf reference decays: the hidden dense layers'
    weights (its Keras ``l2`` kernel regularisers sit on those two layers only; no conv,
    bias or output weight). Keras' ``l2(c)`` adds ``c w^2`` to the loss, a gradient of
    ``2 c w``: it equals ``optim.weight_decay = 2 c`` here."""
    dense = [name for name, m in model.head.named_children() if isinstance(m, nn.Linear)]
    return [f"head.{name}.weight" for name in dense[:-1]]


def mse_loss(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error over the local batch and the parameters (the training loss).

    ``pred`` is the model's replicated (n, 4) output, so no spatial reduction is needed;
    the mean over data groups is the gradient sync's job.
    """
    dtype = torch.promote_types(pred.dtype, torch.float32)  # bf16/fp16 in float32; fp64 kept
    return torch.mean((pred.to(dtype) - target.to(dtype)) ** 2)


def mae_per_sample(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean absolute error of each sample over its parameters: shape (n,)."""
    dtype = torch.promote_types(pred.dtype, torch.float32)
    return torch.mean(torch.abs(pred.to(dtype) - target.to(dtype)), dim=1)
