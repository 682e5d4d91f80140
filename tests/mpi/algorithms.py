"""Every registered algorithm x collective x op x dtype x element count x root, checked against
references computed here from every rank's input (each rank rebuilds all inputs from (rank, seed));
plus each point-to-point algorithm's message pattern, counted on a wrapped backend."""

import torch
from _harness import main

import commlib
from commlib.algorithms import Ctx, algorithm_names, get_algorithm
from commlib.ops import ReduceOp

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int8, torch.uint8, torch.int32, torch.int64]
DTYPES = FLOATS + INTS + [torch.bool]
OPS_FLOAT = ["SUM", "AVG", "PRODUCT", "MIN", "MAX"]
OPS_INT = ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]
TOL = {torch.float16: 1e-2, torch.bfloat16: 2e-2, torch.float32: 1e-6, torch.float64: 1e-12}

_COMBINE = {
    "SUM": torch.add, "AVG": torch.add, "PRODUCT": torch.mul, "MIN": torch.minimum,
    "MAX": torch.maximum, "BAND": torch.bitwise_and, "BOR": torch.bitwise_or,
    "BXOR": torch.bitwise_xor,
}
# bool reduces as in ProcessGroupNCCL: SUM/MAX are OR, PRODUCT/MIN are AND.
_BOOL_OP = {"SUM": "BOR", "MAX": "BOR", "PRODUCT": "BAND", "MIN": "BAND"}


def data(rank, count, dtype, op):
    """Rank ``rank``'s input: small values, so that PRODUCT and SUM stay exact in every dtype."""
    g = torch.Generator().manual_seed(1000 * rank + count)
    if dtype is torch.bool:
        return torch.randint(0, 2, (count,), generator=g).bool()
    if op == "PRODUCT":
        return torch.randint(1, 3, (count,), generator=g).to(dtype)
    high = 4 if dtype in (torch.int8, torch.uint8) else 50
    return torch.randint(0, high, (count,), generator=g).to(dtype)


def reference(inputs, op, dtype):
    """The reduction in float64 / int64 with plain torch, cast back to ``dtype``."""
    if dtype is torch.bool:
        op = _BOOL_OP.get(op, op)
    wide = torch.float64 if dtype.is_floating_point else torch.int64
    acc = inputs[0].to(wide)
    for x in inputs[1:]:
        acc = _COMBINE[op](acc, x.to(wide))
    if op == "AVG":
        acc = acc / len(inputs)
    return acc.to(dtype) if dtype is not torch.bool else acc.bool()


def close(got, want):
    if got.dtype.is_floating_point:
        tol = TOL[got.dtype]
        return torch.allclose(got.double(), want.double(), rtol=tol, atol=tol)
    return torch.equal(got, want)


def counts(n):
    return sorted({0, 1, n - 1, n * 3 + 1, 3001})


def case_reductions():
    r, n = commlib.get_rank(), commlib.get_world_size()
    roots = sorted({0, n - 1})
    checked = 0
    for dtype in DTYPES:
        for op in OPS_FLOAT if dtype.is_floating_point else OPS_INT:
            for count in counts(n):
                inputs = [data(k, count, dtype, op) for k in range(n)]
                want = reference(inputs, op, dtype)
                for name in algorithm_names("all_reduce"):
                    t = inputs[r].clone()
                    commlib.all_reduce(t, op=op, algorithm=name)
                    assert close(t, want), ("all_reduce", name, dtype, op, count, t, want)
                    checked += 1
                for name in algorithm_names("reduce"):
                    for root in roots:
                        t = inputs[r].clone()
                        commlib.reduce(t, dst=root, op=op, algorithm=name)
                        ok = close(t, want) if r == root else torch.equal(t, inputs[r])
                        assert ok, ("reduce", name, dtype, op, count, root, t, want)
                        checked += 1
                blocks = [data(k, count * n, dtype, op) for k in range(n)]
                full = reference(blocks, op, dtype)[r * count:(r + 1) * count]
                for name in algorithm_names("reduce_scatter"):
                    out = torch.empty(count, dtype=dtype)
                    mine = blocks[r].clone()
                    commlib.reduce_scatter_tensor(out, mine, op=op, algorithm=name)
                    assert torch.equal(mine, blocks[r]), ("reduce_scatter changed input", name)
                    assert close(out, full), ("reduce_scatter", name, dtype, op, count, out, full)
                    checked += 1
    assert checked > 0


def case_movement():
    r, n = commlib.get_rank(), commlib.get_world_size()
    for dtype in DTYPES:
        for count in counts(n):
            inputs = [data(k, count, dtype, "SUM") for k in range(n)]
            for name in algorithm_names("broadcast"):
                for root in sorted({0, n - 1}):
                    t = inputs[r].clone()
                    commlib.broadcast(t, src=root, algorithm=name)
                    assert torch.equal(t, inputs[root]), ("broadcast", name, dtype, count, root)
            for name in algorithm_names("all_gather"):
                out = torch.empty(count * n, dtype=dtype)
                commlib.all_gather_into_tensor(out, inputs[r], algorithm=name)
                assert torch.equal(out, torch.cat(inputs)), ("all_gather", name, dtype, count)


def case_shapes():
    """Buffers of any shape: the algorithms flatten them themselves."""
    r, n = commlib.get_rank(), commlib.get_world_size()
    inputs = [data(k, 2 * 3 * 5, torch.float32, "SUM").view(2, 3, 5) for k in range(n)]
    want = reference(inputs, "SUM", torch.float32)
    for name in algorithm_names("all_reduce"):
        t = inputs[r].clone()
        commlib.all_reduce(t, algorithm=name)
        assert close(t, want), name
    for name in algorithm_names("all_gather"):
        out = torch.empty(n, 2, 3, 5)
        commlib.all_gather_into_tensor(out, inputs[r], algorithm=name)
        assert torch.equal(out, torch.stack(inputs)), name
    for name in algorithm_names("reduce_scatter"):
        out = torch.empty(3, 5)
        commlib.reduce_scatter_tensor(out, torch.cat([inputs[r]] * n).view(n, 2, 3, 5)[:, 0],
                                      algorithm=name)
        assert close(out, want[0]), name


def case_async():
    """Several multi-step algorithms in flight at once, waited in reverse order."""
    r, n = commlib.get_rank(), commlib.get_world_size()
    inputs = [[data(k, 1000 + i, torch.float64, "SUM") for k in range(n)] for i in range(4)]
    bufs = [inp[r].clone() for inp in inputs]
    names = ["ring", "recursive_doubling", "rabenseifner", "binomial"]
    works = [commlib.all_reduce(b, algorithm=a, async_op=True) for b, a in zip(bufs, names,
                                                                               strict=True)]
    for w in reversed(works):
        w.wait()
    for b, inp, a in zip(bufs, inputs, names, strict=True):
        assert close(b, reference(inp, "SUM", torch.float64)), a


def case_pipelined_doubling_in_chunks():
    """pipelined_doubling with 16-byte chunks (so every count above 4 floats is cut): bitwise
    recursive doubling's result for every dtype and op, and log2(p) x chunks messages per rank
    (the fold's as recursive doubling's)."""
    from commlib.algorithms import pipelined_doubling as pd

    r, n = commlib.get_rank(), commlib.get_world_size()
    saved = pd.CHUNK_BYTES
    pd.CHUNK_BYTES = 16
    try:
        for dtype in DTYPES:
            for op in OPS_FLOAT if dtype.is_floating_point else OPS_INT:
                for count in counts(n):
                    x = data(r, count, dtype, op)
                    a, b = x.clone(), x.clone()
                    commlib.all_reduce(a, op=op, algorithm="pipelined_doubling")
                    commlib.all_reduce(b, op=op, algorithm="recursive_doubling")
                    assert torch.equal(a, b), (dtype, op, count, a, b)
        commlib.barrier()
        for m in (60, 0):
            c = Counting(commlib.get_world_group().backend)
            x = torch.full((m,), r + 1.0)
            drive(c, get_algorithm("all_reduce", "pipelined_doubling"), x)
            assert torch.equal(x, torch.full((m,), n * (n + 1) / 2)), x
            chunks = pd.chunk_count(m * 4)
            assert chunks == (min(pd.MAX_CHUNKS, 15) if m else 1), chunks
            p2 = 1 << (n.bit_length() - 1)
            rem, log2 = n - p2, p2.bit_length() - 1
            if r < 2 * rem and r % 2 == 0:  # folded out: its buffer in, the result back
                want = 1
            else:
                want = log2 * chunks + (r < 2 * rem)
            assert c.sends == want, (m, c.sends, want)
    finally:
        pd.CHUNK_BYTES = saved


# ----- message pattern ------------------------------------------------------------------------
class Counting:
    """A backend that forwards to the real one and counts this rank's sends and their elements."""

    def __init__(self, backend):
        self._backend, self.sends, self.elements = backend, 0, 0

    def isend(self, buf, peer, tag, user=False):
        self.sends += 1
        self.elements += buf.numel()
        return self._backend.isend(buf, peer, tag, user)

    def __getattr__(self, name):
        return getattr(self._backend, name)


def drive(backend, fn, *args):
    """Run one algorithm directly (no collectives layer, so zero-length buffers reach it too)."""
    ctx = Ctx(backend, backend.rank, backend.size, 0, ReduceOp.SUM)
    steps = fn(ctx, *args)
    for handles in [steps] if isinstance(steps, list) else steps:
        backend.wait(handles)


def expected_pattern(n, r):
    """(algorithm, collective) -> (sends, elements or None) of this rank, for 60 elements per
    buffer (all_reduce, broadcast, reduce; root 0) or per block (all_gather, reduce_scatter)."""
    p2 = 1 << (n.bit_length() - 1)
    log2, rem = p2.bit_length() - 1, n - p2
    out = r < 2 * rem and r % 2 == 0  # folded out of the power-of-two core
    odd = r < 2 * rem and r % 2 == 1  # folded in an even rank, hands it the result back

    def core(steps, elements):  # the fold adds one whole-buffer message on its 2 * rem ranks
        return (1, 60) if out else (steps + odd, elements + 60 * odd)

    return {
        ("ring", "all_reduce"): (2 * (n - 1), 2 * (n - 1) * 60 // n),  # 2(p-1)/p of the buffer
        ("ring", "reduce_scatter"): (n - 1, (n - 1) * 60),
        ("ring", "all_gather"): (n - 1, (n - 1) * 60),
        ("recursive_doubling", "all_reduce"): core(log2, log2 * 60),  # whole buffer per step
        ("recursive_doubling", "all_gather"): ((1, 60) if out else (log2 + odd, None)),
        ("rabenseifner", "all_reduce"): core(2 * log2, 2 * (p2 - 1) * 60 // p2),
        ("rabenseifner", "reduce_scatter"): ((1, 60 * n) if out else (log2 + odd, None)),
        ("binomial", "reduce"): (int(r != 0), 60 * (r != 0)),  # one message up the tree each
        ("binomial", "broadcast"): (((n - 1).bit_length(), None) if r == 0 else (None, None)),
        ("binomial", "all_reduce"): (None, None),
    }


def case_message_pattern():
    r, n = commlib.get_rank(), commlib.get_world_size()
    backend = commlib.get_world_group().backend
    want = expected_pattern(n, r)
    totals = {}
    commlib.barrier()  # no collective of an earlier case is still in flight
    for name in ("ring", "recursive_doubling", "rabenseifner", "binomial"):
        for coll in ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce"):
            fn = get_algorithm(coll, name)
            if fn is None:
                continue
            assert (name, coll) in want, f"no expected pattern for {name} {coll}"
            for m in (60, 0):  # zero-length slices are sent too, so the count is the same
                c = Counting(backend)
                x = torch.full((m,), r + 1.0)
                if coll == "all_reduce":
                    drive(c, fn, x)
                    assert torch.equal(x, torch.full((m,), n * (n + 1) / 2)), (name, x)
                elif coll in ("broadcast", "reduce"):
                    drive(c, fn, x, 0)
                elif coll == "all_gather":
                    drive(c, fn, torch.empty(n * m), x)
                else:
                    drive(c, fn, torch.empty(m), torch.cat([x] * n))
                sends, elements = want[name, coll]
                assert sends is None or c.sends == sends, (name, coll, m, c.sends, sends)
                if m:
                    assert elements is None or c.elements == elements, \
                        (name, coll, c.elements, elements)
                totals[name, coll] = c.sends
    # Whole-tree counts: a binomial broadcast or reduce sends p - 1 messages in all.
    names = sorted(totals)
    summed = torch.tensor([totals[k] for k in names])
    commlib.all_reduce(summed)
    summed = dict(zip(names, summed.tolist(), strict=True))
    assert summed["binomial", "broadcast"] == n - 1, summed
    assert summed["binomial", "reduce"] == n - 1, summed
    assert summed["binomial", "all_reduce"] == 2 * (n - 1), summed


if __name__ == "__main__":
    main(globals())
