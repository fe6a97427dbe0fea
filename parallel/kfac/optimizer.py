"""SGD with momentum on K-FAC-preconditioned gradients, exact under any grid.

    opt = KFAC(pmodel, grid, KFACConfig(), lr=0.01, momentum=0.9)
    for x, y in batches:
        opt.zero_grad(set_to_none=True)      # also drops statistics of a step never taken
        loss_fn(pmodel(x), y).backward()     # hooks capture the factors' parts
        opt.step()                           # reduce factors, decompose, precondition, SGD

``KFAC`` is a ``torch.optim.SGD``: the training loop's schedule sets ``group["lr"]`` as it
does for SGD, ``GradScaler.step`` and gradient clipping work as for SGD, and with no layer
preconditioned it is SGD. At step ``t`` (counted from 0): if ``t % factor_interval == 0``
the forwards and backwards of the step captured statistics and the factors' running
averages are updated (one all-reduce over the world); if ``t % inverse_interval == 0``
the eigendecompositions are recomputed (spread over ranks, then broadcast); then the
preconditioned gradients are scaled by the KL clip and SGD takes its step.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable

import torch
from torch import nn

from parallel.kfac.capture import Recorder
from parallel.kfac.config import KFACConfig
from parallel.kfac.factors import packed_size, reduce_factors, unpack
from parallel.kfac import local, lowrank, state
from parallel.kfac.inverse import EIGH_FLOPS_PER_DIM3, Eigen, Item, eigen, precondition, spread
from parallel.kfac.lowrank import NYSTROM_FLOPS_PER_DM2, Blocked, Structured, nystrom, omega, sketch_width
from parallel.kfac.subsample import Staleness, own_spans, relative_change
from parallel.kfac.layers import Layer, find_layers, serial_type
from parallel.kfac.local import LocalBlocked
from parallel.model.parallel_module import ParallelModule

log = logging.getLogger("parallel.kfac")


class KFAC(torch.optim.SGD):
    """K-FAC preconditioning of Conv3d, ConvTranspose3d and Linear gradients, then SGD.

    ``model`` is the serial model or its ``ParallelModule`` (unwrapped: layer names and
    state keys are the serial model's); ``grid`` is None for a single process. Every
    parameter of the model is optimised; layers not preconditioned take the plain update.
    ``grad_scaler``: the fp16 scaler (``parallel.train.precision.LossScaler`` or torch's ``GradScaler``:
    ``is_enabled()``, ``get_scale()``) whose scale the captured output gradients carry.
    ``params``: the parameters or parameter groups to optimise (default: all the model's;
    groups set their own ``weight_decay``, which SGD adds after the preconditioning); they
    must hold the weight of every preconditioned layer.
    """

    def __init__(self, model: nn.Module, grid: Any = None, cfg: KFACConfig | None = None, *, lr: float,
                 momentum: float = 0.9, nesterov: bool = False, weight_decay: float = 0.0,
                 grad_scaler: Any = None, params: Iterable[Any] | None = None) -> None:
        module = model.module if isinstance(model, ParallelModule) else model
        super().__init__(module.parameters() if params is None else params, lr=lr, momentum=momentum,
                         nesterov=nesterov, weight_decay=weight_decay)
        self.cfg = cfg if cfg is not None else KFACConfig()
        self.cfg.validate()
        self.grid = grid
        self.grad_scaler = grad_scaler
        self.layers, skipped = find_layers(module, self.cfg)
        optimised = {id(p) for group in self.param_groups for p in group["params"]}
        missing = [layer.key for layer in self.layers if id(layer.weight) not in optimised]
        if missing:
            raise ValueError(f"K-FAC preconditions {', '.join(missing)}, but the parameters given to the "
                             "optimiser do not include them: pass the model's parameters (or exclude those "
                             "layers with kfac.exclude)")
        for name, why in skipped:
            log.info("kfac: layer '%s' takes the plain update (%s)", name, why)
        log.info("kfac: preconditioning %d layers: %s", len(self.layers),
                 ", ".join(f"{layer.name} ({serial_type(layer.module)} A {layer.dim_a} G {layer.dim_g})"
                           for layer in self.layers))
        wide = torch.float64 if any(layer.weight.dtype == torch.float64 for layer in self.layers) else torch.float32
        self.factor_dtype, self.inverse_dtype = self.cfg.dtypes(wide)
        self._structure_wide_factors(skipped)
        self.steps = 0
        self.staleness = Staleness.of(self.cfg)  # the factor interval (``kfac.stale_tol``)
        self.factors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.eigen: dict[str, tuple[Eigen | Structured, Eigen | Structured]] = {}
        self.cores: dict[str, torch.Tensor] = {}
        self.last_nu: torch.Tensor | None = None
        self.pending: dict[str, dict[str, torch.Tensor]] = {}  # loaded before a forward showed the blocks
        self.flatten_hooks = self._watch_flattens(module)
        self._accept_shards()
        self.logged: set[str] = set()  # hierarchical layers whose blocks' memory was logged
        self.recorder = Recorder(self.layers, self.cfg, self.factor_dtype)
        self.recorder.arm(self.captures(self.steps))

    def _structure_wide_factors(self, skipped: list[tuple[str, str]]) -> None:
        """Draw the test matrix of every factor above ``max_factor_dim`` and log its rank and memory."""
        cfg = self.cfg
        size = torch.finfo(self.factor_dtype).bits // 8
        for layer in self.layers:
            if layer.wide is None:
                continue
            d, other = layer.dim(layer.wide), layer.dim("G" if layer.wide == "A" else "A")
            m = sketch_width(d, cfg.rank, cfg.oversample)
            layer.omega = omega(layer.key, d, m, self.factor_dtype, layer.weight.device)
            mem = size * lowrank.memory_elements(d, other, cfg.rank, cfg.oversample)
            log.info("kfac: layer '%s' (%s): factor %s is %d wide > kfac.max_factor_dim %d: held as rank %d plus "
                     "diagonal (sketch of %d columns), %.1f MiB per rank (dense: %.1f MiB)", layer.name,
                     serial_type(layer.module), layer.wide, d, cfg.max_factor_dim, layer.rank, m, mem / 2**20,
                     size * 3.5 * d * d / 2**20)
        if not any("max_factor_dim" in why for _, why in skipped):
            log.info("kfac: no layer takes the plain update for its width (%d held low rank)",
                     sum(layer.wide is not None for layer in self.layers))

    def _accept_shards(self) -> None:
        """A hierarchical Flatten+Linear whose weight is still whole is sharded at its first
        forward where ``flat_blocks`` matches or refines the grid's split of its volume: its
        diagonal blocks are then held by the ranks that own their features
        (``parallel.kfac.local``); elsewhere it stays whole, its features assembled."""
        for layer in self.layers:
            if layer.kind == "flat" and layer.split is not None and getattr(layer.module, "shard", None) is None:
                layer.module.shard_policy = (  # type: ignore[assignment]
                    lambda m, shape, split=layer.split: local.refines(split, m.grid.spatial, shape[1:]))

    def _watch_flattens(self, model: nn.Module) -> list[Any]:
        """Hooks on the Flatten before each hierarchical Linear (serial): its input's shape
        fixes the diagonal blocks (a SpatialLinear's window hook does it in a split model)."""
        by_name = {layer.name: layer for layer in self.layers if layer.split is not None and layer.kind == "linear"}
        handles = []
        for prefix, mod in model.named_modules():
            kids = list(mod.named_children()) if isinstance(mod, nn.Sequential) else []
            for (_, a), (name, b) in zip(kids, kids[1:]):
                layer = by_name.get(f"{prefix}.{name}" if prefix else name)
                if isinstance(a, nn.Flatten) and layer is not None:
                    handles.append(a.register_forward_hook(
                        lambda m, i, o, layer=layer: layer.see_volume(tuple(i[0].shape[1:])) if i[0].dim() == 5
                        else None))
        return handles

    def report(self) -> dict[str, Any]:
        """What the run's summary shows of K-FAC (``state.report``): the layers, the low-rank
        factors' widths, ranks (as set and as kept at the last inverse update), memory per
        rank, a hierarchical A's diagonal blocks on this rank, and the factors' staleness."""
        out = state.report(self.layers, self.eigen, self.cfg, self.factor_dtype, self.inverse_dtype)
        return {**out, "staleness": self.staleness.report()}

    # -- the schedule of the work --------------------------------------------------------
    def captures(self, step: int) -> bool:
        """Whether optimiser step ``step`` (from 0) updates the factors (``subsample.Staleness``)."""
        return self.staleness.captures(step)

    def decomposes(self, step: int) -> bool:
        return step % self.cfg.inverse_interval == 0

    def seek(self, step: int) -> None:
        """Make the next step step ``step`` of the schedule (what it captures and decomposes);
        drops what was captured so far. For benchmarks that time each kind of step."""
        self.steps = step
        self.recorder.clear()
        self.recorder.arm(self.captures(step))

    # -- one step ----------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients and drop the statistics captured since the last step."""
        super().zero_grad(set_to_none=set_to_none)
        self.recorder.clear()

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            self._precondition()
        super().step()
        self.steps += 1
        self.recorder.clear()
        self.recorder.arm(self.captures(self.steps))
        return loss

    def _precondition(self) -> None:
        cfg = self.cfg
        for key in list(self.pending):  # a forward has run: the blocks are known if they ever will be
            layer = next(x for x in self.layers if x.key == key)
            self._load_layer(layer, self.pending.pop(key))
        if self.captures(self.steps):
            self.update_factors()
        if self.decomposes(self.steps):
            self.update_eigen()
        lr_of = {id(p): group["lr"] for group in self.param_groups for p in group["params"]}
        done: list[tuple[Layer, torch.Tensor]] = []
        vg = None
        for layer in self.layers:
            eig = self.eigen.get(layer.key)
            v = layer.grad_matrix()
            if eig is None or v is None:
                continue
            held = None
            if layer.wide is None:
                p = precondition(v, eig[0], eig[1], cfg.damping)  # type: ignore[arg-type]
            else:
                held, dense = (eig[0], eig[1]) if layer.wide == "A" else (eig[1], eig[0])
                if isinstance(held, LocalBlocked):
                    p = local.precondition(v, held, dense, self.cores[layer.key], cfg.damping)  # type: ignore[arg-type]
                elif isinstance(held, Blocked):
                    p = lowrank.blocked_precondition(v, held, dense, self.cores[layer.key], cfg.damping)  # type: ignore[arg-type]
                else:
                    p = lowrank.precondition(v, layer.wide, held, dense, self.cores[layer.key], cfg.damping)  # type: ignore[arg-type]
            # a weight sharded by block holds its columns only: its term is summed over the spatial group
            inner = local.inner(p, v, held) if isinstance(held, LocalBlocked) else (p * v.to(p.dtype)).sum()
            term = inner * lr_of[id(layer.weight)] ** 2
            vg = term if vg is None else vg + term
            done.append((layer, p))
        if not done:
            self.last_nu = None
            return
        nu = torch.ones((), dtype=done[0][1].dtype, device=done[0][1].device)
        # vg is global, so every rank clips alike: the preconditioned gradients are the
        # synchronised (replicated) ones, the eigenbases are broadcast, and the term of a
        # weight sharded over the spatial group is summed over it (``local.inner``).
        if cfg.kl_clip > 0:
            nu = torch.clamp(torch.sqrt(cfg.kl_clip / vg.abs()), max=1.0)  # type: ignore[union-attr]
        self.last_nu = nu
        for layer, p in done:
            layer.set_grad(p * nu)

    def update_factors(self) -> None:
        """Reduce this step's statistics and fold them into the running averages (collective)."""
        scale = 1.0
        if self.grad_scaler is not None and self.grad_scaler.is_enabled():
            scale = float(self.grad_scaler.get_scale())
        new = reduce_factors(self.layers, self.factor_dtype, self.grid, scale)
        decay, before = self.cfg.factor_decay, dict(self.factors)
        for layer, fresh in zip(self.layers, new):
            if fresh is None:
                continue
            old = self.factors.get(layer.key)
            # Out of place: a state_dict taken earlier keeps its values.
            self.factors[layer.key] = fresh if old is None else (
                old[0] * decay + fresh[0] * (1 - decay), old[1] * decay + fresh[1] * (1 - decay))
        self.staleness.observe(self.steps, relative_change(before, self.factors, *own_spans(self.layers, self.grid)))

    def update_eigen(self) -> None:
        """Eigendecompose every dense factor and approximate every low-rank one, spread over
        the ranks (collective); then each rank forms the low-rank factors' Woodbury cores."""
        have = [layer for layer in self.layers if layer.key in self.factors]
        if not have:
            return
        cfg, idt = self.cfg, self.inverse_dtype
        items = []
        for layer in have:
            for side, f in zip("AG", self.factors[layer.key]):
                d = layer.dim(side)
                if side == layer.wide:
                    f = self._sketch(layer, f) if side == "A" else f
                    om, m, r = layer.omega, f.shape[1] - 1, layer.rank
                    items.append(Item(NYSTROM_FLOPS_PER_DM2 * d * m * m / EIGH_FLOPS_PER_DIM3,
                                      lambda f=f, om=om, r=r: nystrom(f, om, r, cfg.rank_tol, idt).tensors(),
                                      [(d, r), (r,), (d,)]))
                else:
                    items.append(Item(float(d) ** 3, lambda f=f: list(eigen(f, idt)), [(d, d), (d,)]))
        grid = self.grid
        world, rank = (grid.world_size, grid.rank) if grid is not None else (1, 0)
        results = spread(items, idt, have[0].weight.device, grid.world_group if grid is not None else None, world,
                         rank)
        # hierarchical factors: each diagonal block's residual past the coupling, one work item
        # per block, spread over the ranks like the factors (the blocks in parallel)
        blocks: list[Item] = []
        for i, layer in enumerate(have):
            if self._hierarchical(layer) and layer.own is None:  # (blocks held locally: below, by their owner)
                u, lam = results[2 * i][0], results[2 * i][1]
                for b, gram in zip(layer.blocks, self._grams(layer, self.factors[layer.key][0])):  # type: ignore[arg-type]
                    blocks.append(Item(float(len(b)) ** 3, lambda b=b, gram=gram, u=u, lam=lam: list(
                        eigen(gram.to(idt) - (u[b] * lam) @ u[b].t(), idt)), [(len(b), len(b)), (len(b),)]))
        done = spread(blocks, idt, have[0].weight.device, grid.world_group if grid is not None else None, world,
                      rank) if blocks else []
        self.eigen, self.cores = {}, {}
        for i, layer in enumerate(have):
            a, g = results[2 * i], results[2 * i + 1]
            if self._hierarchical(layer):
                if layer.own is not None:  # each rank its own blocks (in parallel over the spatial group)
                    u, lam = a[0], a[1]
                    mine = [eigen(gram.to(idt) - (u[b] * lam) @ u[b].t(), idt) for b, gram in
                            zip(layer.leaves, self._grams(layer, self.factors[layer.key][0]))]
                else:
                    mine, done = done[:len(layer.blocks)], done[len(layer.blocks):]  # type: ignore[arg-type]
                a = [a[0], a[1], torch.cat([q.reshape(-1) for q, _ in mine]), torch.cat([e for _, e in mine])]
                if layer.key not in self.logged:
                    self.logged.add(layer.key)
                    state.log_blocks(layer, self.factor_dtype, self.inverse_dtype)
            self._set_eigen(layer, a, g)
        kept = [f"{layer.name} {self._held(layer).kept}/{layer.rank}" for layer in have if layer.wide is not None]
        if kept:
            log.info("kfac: step %d: low-rank factors keep ranks %s", self.steps, ", ".join(kept))

    @staticmethod
    def _hierarchical(layer: Layer) -> bool:
        return layer.wide == "A" and layer.blocks is not None

    def _sketch(self, layer: Layer, f: torch.Tensor) -> torch.Tensor:
        """The running ``[A Omega | diag(A)]`` of a low-rank A (the head of a hierarchical one's)."""
        if not self._hierarchical(layer):
            return f
        d, m = layer.dim_a, layer.omega.shape[1]  # type: ignore[union-attr]
        return f[:d * (m + 1)].view(d, m + 1)

    def _grams(self, layer: Layer, f: torch.Tensor) -> list[torch.Tensor]:
        """The running diagonal blocks of a hierarchical A (those this rank holds)."""
        offset = layer.dim_a * (layer.omega.shape[1] + 1)  # type: ignore[union-attr]
        out = []
        for b in layer.leaves:
            n = packed_size(len(b))
            out.append(unpack(f[offset:offset + n], len(b)))
            offset += n
        return out

    def _held(self, layer: Layer) -> Structured:
        return self.eigen[layer.key][0 if layer.wide == "A" else 1]  # type: ignore[return-value]

    def _set_eigen(self, layer: Layer, a: list[torch.Tensor], g: list[torch.Tensor]) -> None:
        """Store one layer's decompositions (and, for a low-rank factor, form its cores)."""
        xa: Eigen | Structured | Blocked
        if self._hierarchical(layer):
            sizes = [len(b) for b in layer.leaves]
            qs = [q.view(n, n) for q, n in zip(torch.split(a[2], [n * n for n in sizes]), sizes)]
            es = list(torch.split(a[3], sizes))
            own = layer.own
            if own is not None:
                rows = own.cols if not own.shared else torch.cat(
                    [own.cols, torch.tensor([layer.dim_a - 1], device=own.cols.device)])
                xa = LocalBlocked(a[0], a[1], a[0][rows], own.pos, qs, es, own.shared, self.grid.spatial_group)
            else:
                xa = Blocked(a[0], a[1], layer.blocks, qs, es)  # type: ignore[arg-type]
        else:
            xa = Structured(*a) if layer.wide == "A" else (a[0], a[1])
        xg: Eigen | Structured = Structured(*g) if layer.wide == "G" else (g[0], g[1])
        self.eigen[layer.key] = (xa, xg)
        if layer.wide is not None:
            held, dense = (xa, xg) if layer.wide == "A" else (xg, xa)
            if isinstance(held, LocalBlocked):
                self.cores[layer.key] = local.cores(held, dense[1], self.cfg.damping)  # type: ignore[index]
            elif isinstance(held, Blocked):
                self.cores[layer.key] = lowrank.blocked_cores(held, dense[1], self.cfg.damping)  # type: ignore[index]
            else:
                self.cores[layer.key] = lowrank.cores(held, dense[1], self.cfg.damping)  # type: ignore[arg-type,index]

    # -- state (``parallel.kfac.state``) ------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """SGD's state plus ``kfac``: the step counter and, per layer (keyed by the serial
        weight's name), factors ``A``, ``G`` and eigendecompositions ``QA``, ``lA``, ``QG``,
        ``lG``; a low-rank factor (say A) is its running sketch and diagonal ``A`` (d, m + 1)
        and its form ``UA``, ``lA``, ``dA``. Plain tensors and ints, the same on every rank
        and at every grid: diagonal blocks held by their owners (``parallel.kfac.local``) are
        gathered over the spatial group, so every rank calls this where a layer holds them;
        ``staleness``: the factor interval."""
        sd = super().state_dict()
        by_key = {layer.key: layer for layer in self.layers}
        layers = {key: state.entry(by_key[key], a, g, self.eigen.get(key), self.grid)
                  for key, (a, g) in self.factors.items()}
        sd["kfac"] = {"steps": self.steps, "layers": layers, "staleness": self.staleness.state()}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved at any grid. A state without ``kfac`` (an SGD checkpoint)
        starts the factors afresh; layers no longer preconditioned are dropped (logged)."""
        kf = state_dict.get("kfac")
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "kfac"})
        self.factors, self.eigen, self.cores, self.pending = {}, {}, {}, {}
        self.staleness.load(None if kf is None else kf.get("staleness"))
        if kf is None:
            log.warning("kfac: the optimiser state has no K-FAC part (an SGD checkpoint?): factors start afresh")
            self.steps = 0
        else:
            self.steps = int(kf["steps"])
            by_key = {layer.key: layer for layer in self.layers}
            for key, entry in kf["layers"].items():
                layer = by_key.get(key)
                if layer is None:
                    log.warning("kfac: state for '%s' dropped: the layer is not preconditioned now", key)
                    continue
                if layer.split is not None and layer.blocks is None:
                    self.pending[key] = entry  # its shapes are known once a forward has shown the volume
                else:
                    self._load_layer(layer, entry)
        self.recorder.clear()
        self.recorder.arm(self.captures(self.steps))

    def _load_layer(self, layer: Layer, entry: dict[str, torch.Tensor]) -> None:
        device = layer.weight.device
        entry, want = state.checked(layer, entry)
        fdt, idt = self.factor_dtype, self.inverse_dtype
        self.factors[layer.key] = (entry["A"].to(device, fdt), entry["G"].to(device, fdt))
        if all(k in entry for k in want):
            parts = {side: [entry[k].to(device, idt) for k in want if k != side and k[1:] == side]
                     for side in "AG"}
            self._set_eigen(layer, parts["A"], parts["G"])

    def remove_hooks(self) -> None:
        """Detach from the model (its layers then run as without K-FAC)."""
        self.recorder.remove()
        for h in self.flatten_hooks:
            h.remove()
        for layer in self.layers:
            if layer.kind == "flat" and layer.split is not None:
                layer.module.shard_policy = None  # type: ignore[assignment]
