"""K-FAC: second-order preconditioning of Conv3d, ConvTranspose3d and Linear gradients that
equals the serial K-FAC step at any spatial x data grid (``docs/kfac.md``).

>>> opt = KFAC(pmodel, grid, KFACConfig(damping=1e-3), lr=0.01, momentum=0.9)
>>> costs = kfac_costs(serial_model, (4, 4, 128, 128, 128), KFACConfig(), spatial=(2, 1, 1), world_size=8)
"""

from parallel.kfac.config import Dtype, KFACConfig
from parallel.kfac.costs import KFACCosts, kfac_costs
from parallel.kfac.layers import shard_policy
from parallel.kfac.optimizer import KFAC

__all__ = ["KFAC", "KFACConfig", "KFACCosts", "Dtype", "kfac_costs", "shard_policy"]
