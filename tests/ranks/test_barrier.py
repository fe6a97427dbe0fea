"""A bounded barrier that times out names its caller and how long it waited, on real ranks."""

import multiprocessing as mp

from parallel.runtime.launch import free_port


def test_a_bounded_barrier_names_its_caller_and_the_wait():
    import comm_cases

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port("127.0.0.1")
    procs = [ctx.Process(target=comm_cases.late_barrier, args=(r, 2, port, results), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = dict(results.get(timeout=60) for _ in range(2))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert got[0] == "comm_cases.late_barrier: not every one of the 2 ranks reached the barrier within 0.5 s"
    assert [p.exitcode for p in procs] == [0, 0]
