"""A job for tests/launch/test_jobpool.py: reports what it sees as JSON, then ends as told.

    python tests/support/pool_probe.py [exit N | raise | os_exit N | hang | process_group] ...
"""

import json
import os
import sys
import time

if __name__ == "__main__":
    seen = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                                           "POOL_PROBE")}
    print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "env": seen}), flush=True)
    what = sys.argv[1] if len(sys.argv) > 1 else "ok"
    rank = int(os.environ.get("RANK", "0"))
    if what == "exit":
        raise SystemExit(int(sys.argv[2]))
    if what == "raise":
        raise ValueError("pool_probe was told to raise")
    if what == "os_exit" and rank == int(sys.argv[3]):
        os._exit(int(sys.argv[2]))
    if what in ("os_exit", "hang"):
        time.sleep(600)  # the others wait, as ranks in a collective would
    if what == "process_group":
        import torch.distributed as dist

        dist.init_process_group("gloo")  # left running: the pool must not reuse this worker
        print(json.dumps({"world": dist.get_world_size()}), flush=True)
