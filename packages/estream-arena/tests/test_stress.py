"""The real GroupLoader under concurrency: random layers, routes, drops, read delays and kernel
times; every consumed record is compared byte for byte with the file, before and after the
"kernel" (a bank refilled while InUse would change under the consumer)."""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest

from estream_arena import ALIGN, Arena, GroupLoader, GroupRequest, RecordLayout
from estream_arena.testing import DelayedReader, write_record_file


def random_layout(rng: random.Random) -> RecordLayout:
    sizes = [rng.randint(1, 2) * ALIGN for _ in range(3)]
    gaps = [rng.choice([0, 0, ALIGN]) for _ in range(4)]
    order = rng.sample(range(3), 3)
    planes: list[tuple[int, int]] = [(0, 0)] * 3
    pos = gaps[0]
    for k, j in enumerate(order):
        planes[j] = (pos, sizes[j])
        pos += sizes[j] + gaps[k + 1]
    return RecordLayout(pos, tuple(planes))


class Layer:
    """One layer's consumers: take routed groups in submit order, check bytes, "compute",
    check bytes again, release."""

    def __init__(self, ld, arena, records, step, routed, first_batch, seed) -> None:
        self.ld, self.arena, self.records, self.step = ld, arena, records, step
        self.todo = list(routed)
        self.first_batch = set(first_batch)
        self.all_in = threading.Event()
        self.lock = threading.Lock()
        self.rng = random.Random(seed)
        self.consumed = 0
        self.errors: list[BaseException] = []

    def consume(self) -> None:
        ld, arena, G = self.ld, self.arena, self.arena.group_size
        planes = arena.layout.planes
        try:
            while True:
                with self.lock:
                    if not self.todo:
                        return
                    k = self.todo.pop(0)
                    pause = self.rng.uniform(0, 0.002)
                if k not in self.first_batch:
                    self.all_in.wait(30)  # acquiring a never-submitted group is an error
                bank = ld.acquire(k, timeout=30)
                assert (bank.group, bank.layer) == (k, self.step)
                vis = ld.residency()
                expected = []
                for i, slot in enumerate(bank.slots):
                    assert vis[k * G + i] == slot
                    rec = self.records[k * G + i]
                    for j, (off, size) in enumerate(planes):
                        exp = rec[off : off + size]
                        assert np.array_equal(arena.slot_view(j, slot), exp), (k, i, j)
                        expected.append((j, slot, exp))
                time.sleep(pause)  # the "kernel"
                for j, slot, exp in expected:  # nobody refilled the bank meanwhile
                    assert np.array_equal(arena.slot_view(j, slot), exp)
                ld.check_valid()
                ld.release(bank)
                with self.lock:
                    self.consumed += 1
        except BaseException as e:
            self.errors.append(e)


@pytest.mark.parametrize("merge", [False, True], ids=["one-group-reads", "merged-reads"])
@pytest.mark.parametrize("seed", range(8))
def test_stress_random_layers_and_routes(workdir, seed: int, merge: bool) -> None:
    rng = random.Random(seed)
    layout = random_layout(rng)
    G, B, Q = rng.randint(1, 4), rng.randint(1, 5), rng.randint(1, 4)
    n_file_layers, experts = 3, rng.randint(6, 20)
    rf = write_record_file(workdir / "experts.bin", layout, n_file_layers * experts, seed=seed)
    data = np.fromfile(rf.path, dtype=np.uint8).reshape(-1, layout.record_bytes)
    rb = layout.record_bytes
    n_groups = -(-experts // G)
    steps = 240 if n_groups <= 3 else 120
    consumed = 0
    routed_of: dict[int, list[int]] = {}
    unrouted_of: dict[int, set[int]] = {}
    with (
        Arena(layout, B, G) as arena,
        GroupLoader(
            arena,
            rf.path,
            Q,
            verify=rng.random() < 0.5,
            reader=DelayedReader(0.002, seed),
            merge_bytes=3 * G * rb if merge else 0,  # up to 3 adjacent groups per read
        ) as ld,
    ):
        for step in range(steps):
            fl = rng.randrange(n_file_layers)  # the same file layer may come back
            base = fl * experts
            ld.begin_layer(step)
            order = list(range(n_groups))
            if rng.random() < 0.3:
                rng.shuffle(order)  # any submit order works, not only storage order
            reqs = []
            for k in order:
                n = min(G, experts - k * G)
                sums = tuple(rf.checksums[base + k * G : base + k * G + n])
                reqs.append(GroupRequest(k, (base + k * G) * rb, n, sums))
            routed = [k for k in order if rng.random() < 0.6]
            unrouted = [k for k in order if k not in routed]
            routed_of[step], unrouted_of[step] = routed, set(unrouted)
            cut = rng.randint(0, len(reqs))
            layer = Layer(
                ld, arena, data[base : base + experts], step, routed,
                [r.group for r in reqs[:cut]], rng.random(),
            )  # fmt: skip
            workers = [threading.Thread(target=layer.consume) for _ in range(rng.randint(1, 2))]
            ld.submit(reqs[:cut])
            for w in workers:
                w.start()
            time.sleep(rng.uniform(0, 0.002))
            ld.submit(reqs[cut:])
            layer.all_in.set()
            time.sleep(rng.uniform(0, 0.004))  # routing: some unrouted groups are read already
            ld.drop(unrouted)
            for w in workers:
                w.join(60)
                assert not w.is_alive()
            assert not layer.errors, layer.errors
            assert layer.consumed == len(routed)
            consumed += layer.consumed
            ld.check_valid()
            ld.end_layer()
            assert ld.residency() == {}
        stats = ld.stats
    assert stats.n_failed == 0 and len(stats.events) == stats.n_reads
    reads = {}
    for e in stats.events:
        assert (e.layer, e.group) not in reads, "a group was read twice in one layer"
        reads[e.layer, e.group] = e.outcome
        if e.outcome == "retired":  # dropped while its read was in flight
            assert e.group in unrouted_of[e.layer]
    for step, routed in routed_of.items():
        assert all(reads[step, k] == "published" for k in routed)
    assert consumed > 250
    print(f"seed {seed}: B={B} G={G} Q={Q}, {len(reads)} group reads, {consumed} consumed")
