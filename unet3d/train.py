"""Train the MLPerf 3D U-Net with spatial x data parallelism.

Configs live in ``configs/unet3d/`` (``default`` = MLPerf KiTS19 settings: 128^3 crops,
sliding-window evaluation from epoch 1000; ``quickstart`` the tiny CPU run); every field
can be overridden. Generate data first (cases of varying shape, chunked for the crops:
``python -m unet3d.prepare synthetic --out data/unet3d_quick --size-range 32,48 --crop 32``).

Single process (CPU or one GPU)::

    python -m unet3d.train --config-name quickstart data.dir=data/unet3d_quick run.dir=runs/unet

torchrun, 2 ranks splitting each volume in depth::

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 -m unet3d.train \\
        --config-name quickstart parallel.spatial=[2,1,1] run.dir=runs/unet2

mpirun / mpiexec (8 ranks: data 2 x spatial 2x2x1)::

    mpirun -n 8 python -m unet3d.train parallel.spatial=[2,2,1] data.dir=/data/kits19_h5

srun (128^3 crops and windows split 4 ways, 2 data groups; whole CT volumes: data.crop=null
eval.mode=whole)::

    srun -N 2 --ntasks-per-node 4 python -m unet3d.train parallel.spatial=[4,1,1] data.dir=/data/kits19_h5

Resume: add ``train.resume=true`` (continues from ``run.dir/checkpoints/last.pt``).
"""

from parallel.train.cli import main
from unet3d.family import FAMILY

if __name__ == "__main__":
    main(FAMILY)
