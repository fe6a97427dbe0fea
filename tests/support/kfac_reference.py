"""A plain serial K-FAC written for the tests only, independently of ``parallel.kfac``.

Patches are cut out of the whole padded tensor one kernel offset at a time (no unfold
views, no chunks); the preconditioned gradient is the solve of the explicit Kronecker
system ``(G kron A + damping I) vec(P) = vec(V)`` (no eigendecompositions). Definitions
(``docs/kfac.md``), for a loss that is a mean over the N rows of the batch, with ``g`` the
output gradient of that loss:

- Conv3d: a = input patch (channels x kernel offsets, then 1 for the bias) at each output
  position; A = mean over rows and positions of a a^T; G = N * sum of g g^T.
- ConvTranspose3d (adjoint view): A = mean over rows and input positions of x x^T; G = N *
  sum over them of p p^T, p = the patch of the uncropped output gradient each input
  position wrote; the bias takes the plain update.
- Linear: a = (input, 1); A = mean of a a^T; G = N * sum of g g^T.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def _pads(m: nn.Conv3d) -> list[tuple[int, int]]:
    if isinstance(m.padding, str):
        if m.padding == "valid":
            return [(0, 0)] * 3
        totals = [d * (k - 1) for k, d in zip(m.kernel_size, m.dilation)]
        return [(t // 2, t - t // 2) for t in totals]
    return [(p, p) for p in m.padding]


def _pad(x: torch.Tensor, pads: list[tuple[int, int]], mode: str = "constant") -> torch.Tensor:
    (dl, dr), (hl, hr), (wl, wr) = pads
    return F.pad(x, [wl, wr, hl, hr, dl, dr], mode=mode)


def patches(x: torch.Tensor, kernel, stride, dilation, out_dims) -> torch.Tensor:
    """(N * positions, C * K) patches of the padded ``x``, ordered (channel, kd, kh, kw)."""
    cols = []
    for kd in range(kernel[0]):
        for kh in range(kernel[1]):
            for kw in range(kernel[2]):
                o = [k * d for k, d in zip((kd, kh, kw), dilation)]
                cols.append(x[:, :, o[0]:o[0] + stride[0] * (out_dims[0] - 1) + 1:stride[0],
                              o[1]:o[1] + stride[1] * (out_dims[1] - 1) + 1:stride[1],
                              o[2]:o[2] + stride[2] * (out_dims[2] - 1) + 1:stride[2]])
    p = torch.stack(cols, dim=2)  # N, C, K, Do, Ho, Wo
    n, c, k = p.shape[:3]
    return p.permute(0, 3, 4, 5, 1, 2).reshape(-1, c * k)


def factors(m: nn.Module, x: torch.Tensor, y: torch.Tensor, gy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n = x.shape[0]
    if isinstance(m, nn.ConvTranspose3d):
        xa = x.permute(0, 2, 3, 4, 1).reshape(-1, x.shape[1])
        full = _pad(gy, [(p, p - op) for p, op in zip(m.padding, m.output_padding)])
        gp = patches(full, m.kernel_size, m.stride, m.dilation, x.shape[2:])
        return xa.t() @ xa / xa.shape[0], n * gp.t() @ gp
    if isinstance(m, nn.Conv3d):
        mode = "constant" if m.padding_mode == "zeros" else m.padding_mode
        a = patches(_pad(x, _pads(m), mode), m.kernel_size, m.stride, m.dilation, y.shape[2:])
        g = gy.permute(0, 2, 3, 4, 1).reshape(-1, gy.shape[1])
    else:
        a, g = x, gy
    if m.bias is not None:
        a = torch.cat([a, torch.ones(a.shape[0], 1, dtype=a.dtype)], dim=1)
    return a.t() @ a / a.shape[0], n * g.t() @ g


def grad_matrix(m: nn.Module) -> torch.Tensor:
    if isinstance(m, nn.ConvTranspose3d):
        return m.weight.grad.reshape(m.weight.shape[0], -1).t()
    v = m.weight.grad.reshape(m.weight.shape[0], -1)
    return v if m.bias is None else torch.cat([v, m.bias.grad[:, None]], dim=1)


def set_grad(m: nn.Module, v: torch.Tensor) -> None:
    if isinstance(m, nn.ConvTranspose3d):
        m.weight.grad.copy_(v.t().reshape(m.weight.shape))
        return
    k = m.weight[0].numel()
    m.weight.grad.copy_(v[:, :k].reshape(m.weight.shape))
    if m.bias is not None:
        m.bias.grad.copy_(v[:, k])


class ReferenceKFAC:
    """Serial K-FAC + torch SGD on ``model``; ``exclude``: names that take the plain update."""

    def __init__(self, model: nn.Module, *, lr: float, momentum: float, damping: float, factor_interval: int,
                 inverse_interval: int, decay: float, kl_clip: float, exclude: tuple[str, ...] = ()) -> None:
        self.model = model
        self.sgd = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
        self.lr, self.damping, self.decay, self.kl_clip = lr, damping, decay, kl_clip
        self.fi, self.ii = factor_interval, inverse_interval
        self.layers = {n: m for n, m in model.named_modules()
                       if isinstance(m, (nn.Conv3d, nn.ConvTranspose3d, nn.Linear)) and n not in exclude}
        self.seen: dict[str, tuple] = {}
        self.running: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.frozen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.t = 0
        for name, m in self.layers.items():
            m.register_forward_hook(self._hook(name))

    def _hook(self, name: str):
        def hook(m, inputs, out):
            # A tensor hook, not retain_grad: the gradient of this output even if a later
            # in-place activation overwrites it.
            entry = [inputs[0].detach(), out.detach(), None]
            out.register_hook(lambda g: entry.__setitem__(2, g))
            self.seen[name] = entry
        return hook

    def step(self) -> float:
        """Precondition, clip, SGD; returns the KL scale nu."""
        if self.t % self.fi == 0:
            for name, m in self.layers.items():
                x, out, gy = self.seen[name]
                a, g = factors(m, x, out, gy)
                old = self.running.get(name)
                self.running[name] = (a, g) if old is None else (
                    self.decay * old[0] + (1 - self.decay) * a, self.decay * old[1] + (1 - self.decay) * g)
        if self.t % self.ii == 0:
            self.frozen = dict(self.running)
        pre, vg = {}, 0.0
        for name, m in self.layers.items():
            a, g = self.frozen[name]
            v = grad_matrix(m)
            system = torch.kron(g, a) + self.damping * torch.eye(g.shape[0] * a.shape[0], dtype=a.dtype)
            p = torch.linalg.solve(system, v.reshape(-1)).reshape(v.shape)
            vg += float((p * v).sum()) * self.lr**2
            pre[name] = p
        nu = min(1.0, math.sqrt(self.kl_clip / abs(vg))) if self.kl_clip > 0 else 1.0
        for name, p in pre.items():
            set_grad(self.layers[name], p * nu)
        self.sgd.step()
        self.t += 1
        return nu
