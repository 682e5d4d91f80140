"""The cost model on a real group: every rank agrees on the model and the pick, explain lists what
the layout allows, and the automatic pick computes the right sum. argv[1]: what to expect
("one-host" or "hosts")."""

import sys
import zlib

import torch
from _harness import main

import commlib
from commlib.tuning import explain

EXPECT = sys.argv.pop(1)


def case_explain_agrees_and_runs():
    n = commlib.get_world_size()
    for nbytes in (8, 1 << 16, 1 << 22):
        e = explain("all_reduce", nbytes)
        names = [r.algorithm for r in e.rows]
        if EXPECT == "hosts":
            assert "hierarchical" in names and not any(a.startswith("shm") for a in names), names
            assert "@2" in e.source, e.source
        else:
            assert "shm_oneshot" in names and "hierarchical" not in names, names
        assert e.chosen == e.rows[0].algorithm and "cost model" in e.why, str(e)
        # every rank holds the same model, so the same table and the same pick
        mine = torch.tensor([float(r.seconds) for r in e.rows]
                            + [float(zlib.crc32(" ".join(names + [e.chosen]).encode()))],
                            dtype=torch.float64)
        every = torch.empty(n * mine.numel(), dtype=torch.float64)
        commlib.all_gather_into_tensor(every, mine)
        assert torch.equal(every.view(n, -1), mine.expand(n, -1)), every
        t = torch.full((nbytes // 4,), float(commlib.get_rank() + 1))
        commlib.all_reduce(t)  # the automatic pick
        assert torch.equal(t, torch.full_like(t, n * (n + 1) / 2))


def case_half_precision_prices_the_upcast():
    # MPI cannot reduce bfloat16: every algorithm but the shared-memory ones runs on a float32
    # copy twice the size and pays the casts; the shared-memory ones reduce bfloat16 themselves.
    n = commlib.get_world_size()
    for nbytes in (1 << 12, 1 << 20):
        half = {r.algorithm: r for r in explain("all_reduce", nbytes, dtype=torch.bfloat16).rows}
        same = {r.algorithm: r.seconds for r in explain("all_reduce", nbytes).rows}
        wide = {r.algorithm: r.seconds for r in explain("all_reduce", 2 * nbytes).rows}
        assert half.keys() == same.keys(), (half, same)
        for name, row in half.items():
            if name.startswith("shm"):
                assert row.seconds == same[name] and "upcast" not in row.how, row
            else:
                assert row.seconds > wide[name] and row.how.endswith("(x2 upcast)"), row
        if EXPECT == "hosts":
            assert not any(name.startswith("shm") for name in half), half
        t = torch.full((nbytes // 2,), float(commlib.get_rank() + 1), dtype=torch.bfloat16)
        commlib.all_reduce(t)  # the automatic pick for bfloat16
        assert torch.equal(t, torch.full_like(t, n * (n + 1) / 2))
    f32 = explain("all_reduce", 1 << 20, dtype=torch.float32)
    assert all("upcast" not in r.how for r in f32.rows), str(f32)


if __name__ == "__main__":
    main(globals())
