from __future__ import annotations

import threading

import numpy as np

import estream_htp as htp
from estream_htp import testing as T


def test_ops_from_several_python_threads_are_serialised_and_correct() -> None:
    # cffi releases the GIL: concurrent calls (and a concurrent set_num_threads) must not
    # corrupt the pool's scratch buffers
    rng = np.random.default_rng(4)
    n, k = 96, 256
    buf = T.pack_q4_0_t32r4(rng.standard_normal((n, k)).astype(np.float32))
    xs = [rng.standard_normal((t, k)).astype(np.float32) for t in (5, 33, 64, 7)]
    q = rng.standard_normal((70, 4, 32)).astype(np.float32)
    kv = rng.standard_normal((70, 2, 32)).astype(np.float32)
    want_g = [htp.gemm(x, buf, n) for x in xs]
    want_a = htp.attention(q, kv, kv, 0.2)
    errors: list[str] = []

    def work(i: int) -> None:
        for _ in range(20):
            if not np.array_equal(htp.gemm(xs[i], buf, n), want_g[i]):
                errors.append(f"gemm {i}")
            if not np.array_equal(htp.attention(q, kv, kv, 0.2), want_a):
                errors.append(f"attention {i}")

    old = htp.get_num_threads()
    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for _ in range(5):
        htp.set_num_threads(old)  # same count: results stay bit-identical
    for th in threads:
        th.join()
    assert errors == []
