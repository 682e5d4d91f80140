"""Every registered point-to-point algorithm x collective x op x dtype x element count, checked
against references computed here from every rank's known input; plus the message pattern."""

import torch
from _harness import main

import commlib
from commlib.algorithms import algorithm_names

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int8, torch.uint8, torch.int32, torch.int64]
OPS_FLOAT = ["SUM", "AVG", "PRODUCT", "MIN", "MAX"]
OPS_INT = ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]
P2P = ["ring", "recursive_doubling", "rabenseifner", "binomial"]


def data(rank, count, dtype, op):
    """Rank ``rank``'s input: small values so that PRODUCT and SUM stay exact in every dtype."""
    g = torch.Generator().manual_seed(1000 * rank + count)
    if dtype is torch.bool:
        return torch.randint(0, 2, (count,), generator=g).bool()
    if op == "PRODUCT":
        return torch.randint(1, 3, (count,), generator=g).to(dtype)
    high = 4 if dtype in (torch.int8, torch.uint8) else 50
    return torch.randint(0, high, (count,), generator=g).to(dtype)


def reference(inputs, op, dtype):
    acc = inputs[0].to(torch.float64) if dtype.is_floating_point else inputs[0].to(torch.int64)
    for x in inputs[1:]:
        x = x.to(acc.dtype)
        acc = {
            "SUM": lambda a, b: a + b, "AVG": lambda a, b: a + b, "PRODUCT": lambda a, b: a * b,
            "MIN": torch.minimum, "MAX": torch.maximum, "BAND": lambda a, b: a & b,
            "BOR": lambda a, b: a | b, "BXOR": lambda a, b: a ^ b,
        }[op](acc, x)
    if op == "AVG":
        acc = acc / len(inputs)
    return acc.to(dtype)


def close(got, want):
    if got.dtype.is_floating_point:
        tol = {torch.float16: 1e-2, torch.bfloat16: 2e-2}.get(got.dtype, 1e-6)
        return torch.allclose(got.double(), want.double(), rtol=tol, atol=tol)
    return torch.equal(got, want)


def counts(n):
    return sorted({1, max(n - 1, 1), n * 3 + 1, 1027})


def case_reductions():
    r, n = commlib.get_rank(), commlib.get_world_size()
    checked = 0
    for dtype in FLOATS + INTS + [torch.bool]:
        ops = OPS_FLOAT if dtype.is_floating_point else OPS_INT
        for op in ops:
            for count in counts(n):
                inputs = [data(k, count, dtype, op) for k in range(n)]
                want = reference(inputs, op, dtype) if dtype is not torch.bool else None
                if dtype is torch.bool:  # SUM/MAX are OR, PRODUCT/MIN are AND
                    stacked = torch.stack(inputs)
                    want = {"SUM": stacked.any(0), "MAX": stacked.any(0), "BOR": stacked.any(0),
                            "PRODUCT": stacked.all(0), "MIN": stacked.all(0),
                            "BAND": stacked.all(0),
                            "BXOR": (stacked.sum(0) % 2).bool()}[op]
                for name in algorithm_names("all_reduce"):
                    t = inputs[r].clone()
                    commlib.all_reduce(t, op=op, algorithm=name)
                    assert close(t, want), (name, dtype, op, count, t, want)
                    checked += 1
                for name in algorithm_names("reduce"):
                    for root in {0, n - 1}:
                        t = inputs[r].clone()
                        commlib.reduce(t, dst=root, op=op, algorithm=name)
                        ok = close(t, want) if r == root else torch.equal(t, inputs[r])
                        assert ok, ("reduce", name, dtype, op, count, root, t)
                for name in algorithm_names("reduce_scatter"):
                    big = [data(k, count * n, dtype, op) for k in range(n)]
                    full = reference(big, op, dtype) if dtype is not torch.bool else None
                    if dtype is torch.bool:
                        continue
                    out = torch.empty(count, dtype=dtype)
                    mine = big[r].clone()
                    commlib.reduce_scatter_tensor(out, mine, op=op, algorithm=name)
                    assert torch.equal(mine, big[r]), "reduce_scatter changed its input"
                    assert close(out, full[r * count:(r + 1) * count]), (name, dtype, op, out)
    assert checked > 0


def case_movement():
    r, n = commlib.get_rank(), commlib.get_world_size()
    for dtype in FLOATS + INTS + [torch.bool]:
        for count in [0] + counts(n):
            inputs = [data(k, count, dtype, "SUM") for k in range(n)]
            for name in algorithm_names("broadcast"):
                for root in {0, n - 1}:
                    t = inputs[r].clone()
                    commlib.broadcast(t, src=root, algorithm=name)
                    assert torch.equal(t, inputs[root]), (name, dtype, count, root)
            for name in algorithm_names("all_gather"):
                out = torch.empty(count * n, dtype=dtype)
                commlib.all_gather_into_tensor(out, inputs[r], algorithm=name)
                assert torch.equal(out, torch.cat(inputs)), (name, dtype, count)


class Counting:
    """The real backend, with its point-to-point sends counted."""

    def __init__(self, backend):
        self.backend, self.sends = backend, 0
        self._isend = backend.isend

    def __enter__(self):
        def isend(*args, **kwargs):
            self.sends += 1
            return self._isend(*args, **kwargs)

        self.backend.isend = isend
        return self

    def __exit__(self, *exc):
        del self.backend.isend


def case_message_pattern():
    r, n = commlib.get_rank(), commlib.get_world_size()
    backend = commlib.get_world_group().backend
    p2, rem = 1 << (n.bit_length() - 1), n - (1 << (n.bit_length() - 1))
    log2 = p2.bit_length() - 1
    folded_out = r < 2 * rem and r % 2 == 0  # sits out the power-of-two core
    fold_sends = 1 if r < 2 * rem else 0
    expected = {
        "ring": 2 * (n - 1),
        "recursive_doubling": fold_sends + (0 if folded_out else log2),
        "rabenseifner": fold_sends + (0 if folded_out else 2 * log2),
    }
    for name, want in expected.items():
        with Counting(backend) as c:
            commlib.all_reduce(torch.ones(64), algorithm=name)
        assert c.sends == want, (name, n, r, c.sends, want)
    with Counting(backend) as c:  # a binomial broadcast sends n - 1 messages in all
        commlib.broadcast(torch.ones(8), src=0, algorithm="binomial")
    total = torch.tensor([c.sends])
    commlib.all_reduce(total)
    assert int(total) == n - 1, total


if __name__ == "__main__":
    main(globals())
