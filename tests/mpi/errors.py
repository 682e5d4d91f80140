"""Argument errors at a real world size (run in the same job as api.py): every rank passes the
same bad argument and raises locally; each message names the function, the argument, the value
or rule, and a fix. Run with COMMLIB_DEBUG=1 too, where a failed check is exchanged first."""

import numpy as np
import torch

import commlib
from commlib import ReduceOp


class raises:
    """Expect ``exc`` with every fragment (and 'Fix:') in its message."""

    def __init__(self, exc, *fragments):
        self.exc, self.fragments = exc, fragments

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        assert kind is not None, f"nothing raised; expected {self.exc.__name__} {self.fragments}"
        if not issubclass(kind, self.exc):
            return False  # re-raise the unexpected exception with its traceback
        text = str(value)
        for fragment in self.fragments + ("Fix:",):
            assert fragment in text, f"{fragment!r} not in {text!r}"
        return True


ArgErr, TypeErr = commlib.CommArgumentError, commlib.CommTypeError


def case_errors_sizes_and_splits():
    n = commlib.get_world_size()
    with raises(ArgErr, "commlib.all_gather()", "'tensor_list'", "<list of", f"group size ({n})",
                "torch.empty_like"):
        commlib.all_gather([torch.empty(2) for _ in range(n + 1)], torch.ones(2))
    with raises(TypeErr, "commlib.all_gather()", "'tensor_list'", "must be a list"):
        commlib.all_gather(torch.empty(n, 2), torch.ones(2))
    with raises(ArgErr, "all_gather()", "'tensor_list[0]'", "as many elements as 'tensor' (2)"):
        commlib.all_gather([torch.empty(3) for _ in range(n)], torch.ones(2))
    with raises(ArgErr, "commlib.all_gather_into_tensor()", "'output_tensor'",
                f"group size ({n}) x input elements (3) = {3 * n} elements", "torch.empty"):
        commlib.all_gather_into_tensor(torch.empty(3 * n + 1), torch.ones(3))
    with raises(ArgErr, "commlib.reduce_scatter_tensor()", "'input'",
                f"group size ({n}) x output elements (2) = {2 * n} elements"):
        commlib.reduce_scatter_tensor(torch.empty(2), torch.ones(2 * n + 1))
    a2a = commlib.all_to_all_single
    with raises(ArgErr, "commlib.all_to_all_single()", "'input_split_sizes'",
                f"must be {n} non-negative sizes summing to dim 0 ({n})", "one size per rank"):
        a2a(torch.empty(n), torch.ones(n), input_split_sizes=[1] * (n + 1))
    with raises(ArgErr, "'output_split_sizes'", "non-negative", f"summing to dim 0 ({n})"):
        a2a(torch.empty(n), torch.ones(n), output_split_sizes=[-1] + [1] * (n - 2) + [2])
    with raises(ArgErr, "'input_split_sizes'", f"summing to dim 0 ({n})"):
        a2a(torch.empty(n), torch.ones(n), input_split_sizes=[2] * n)
    with raises(ArgErr, "'input_split_sizes'", "must be a list of ints"):
        a2a(torch.empty(n), torch.ones(n), input_split_sizes=["a"] * n)
    if n > 1:
        with raises(ArgErr, "'input_split_sizes'", f"dim 0 ({n + 1}) must divide by the group size ({n})"):
            a2a(torch.empty(n + 1), torch.ones(n + 1))
    with raises(ArgErr, "all_to_all_single()", "'output'", "trailing dims (2,)"):
        a2a(torch.empty(n, 3), torch.ones(n, 2))
    with raises(ArgErr, "all_to_all_single()", "'input'", "0-d tensor", "reshape"):
        a2a(torch.empty(n), torch.tensor(1.0))


def case_errors_dtypes_and_ops():
    n = commlib.get_world_size()
    with raises(TypeErr, "all_gather_into_tensor()", "'input_tensor'", "dtype of 'output_tensor' (float64)"):
        commlib.all_gather_into_tensor(torch.empty(n, dtype=torch.float64), torch.ones(1))
    with raises(TypeErr, "reduce_scatter_tensor()", "'input'", "dtype of 'output' (int32)"):
        commlib.reduce_scatter_tensor(torch.empty(1, dtype=torch.int32), torch.ones(n))
    with raises(TypeErr, "all_to_all_single()", "'input'", "dtype of 'output' (bfloat16)"):
        commlib.all_to_all_single(torch.empty(n, dtype=torch.bfloat16), torch.ones(n))
    with raises(TypeErr, "all_gather()", f"'tensor_list[{n - 1}]'", "dtype of 'tensor' (float32)"):
        commlib.all_gather([torch.empty(2)] * (n - 1) + [torch.empty(2, dtype=torch.int64)], torch.ones(2))
    for dtype in (torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool):
        with raises(ArgErr, "commlib.all_reduce()", "'op'", "AVG is defined on floating dtypes",
                    "reduce with SUM and divide"):
            commlib.all_reduce(torch.zeros(2, dtype=dtype), op=ReduceOp.AVG)
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        for op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR):
            with raises(ArgErr, "commlib.reduce()", "'op'", f"{op.name} is a bitwise op",
                        "an integer dtype"):
                commlib.reduce(torch.zeros(2, dtype=dtype), dst=0, op=op)
    with raises(ArgErr, "reduce_scatter_tensor()", "'op'", "AVG is defined on floating dtypes"):
        commlib.reduce_scatter_tensor(torch.zeros(1, dtype=torch.int32),
                                      torch.zeros(n, dtype=torch.int32), op="avg")
    for bad in ("median", 3, None):
        with raises(TypeErr, "all_reduce()", "'op'", "is not a reduction operator", "ReduceOp.SUM"):
            commlib.all_reduce(torch.zeros(2), op=bad)
    with raises(TypeErr, "all_reduce()", "'tensor'", "unsupported dtype", "complex64", "bfloat16"):
        commlib.all_reduce(torch.zeros(2, dtype=torch.complex64))
    with raises(TypeErr, "broadcast()", "'tensor'", "unsupported dtype", "int16"):
        commlib.broadcast(torch.zeros(2, dtype=torch.int16), src=0)
    with raises(TypeErr, "all_reduce()", "'tensor'", "unsupported dtype"):
        commlib.all_reduce(np.zeros(2, dtype=np.uint16))
    with raises(TypeErr, "all_reduce()", "'tensor'", "dtype=object", "unsupported dtype"):
        commlib.all_reduce(np.array([1, "a"], dtype=object))


def case_errors_types_roots_and_buffers():
    r, n = commlib.get_rank(), commlib.get_world_size()
    for bad in ([1.0, 2.0], 3.0, None, "tensor"):
        with raises(TypeErr, "commlib.all_reduce()", "'tensor'", "must be a torch.Tensor, numpy.ndarray",
                    "torch.as_tensor"):
            commlib.all_reduce(bad)
    with raises(TypeErr, "all_gather_into_tensor()", "'input_tensor'", "must be a torch.Tensor"):
        commlib.all_gather_into_tensor(torch.empty(n), [1.0])
    with raises(TypeErr, "all_reduce()", "'group'", "must be a commlib.Group", "new_group"):
        commlib.all_reduce(torch.ones(1), group="world")
    mesh = commlib.Mesh((n,))
    with raises(ArgErr, "all_reduce()", "'group'", "a Mesh is not a group", "mesh.group("):
        commlib.all_reduce(torch.ones(1), group=mesh)
    with raises(ArgErr, "commlib.broadcast()", "'src'", f"= {n}", "must be a world rank in group 'world'",
                "group_src="):
        commlib.broadcast(torch.ones(1), src=n)
    with raises(ArgErr, "broadcast()", "'src'", "'0'"):
        commlib.broadcast(torch.ones(1), src="0")
    for bad in (-1, n):
        with raises(ArgErr, "broadcast()", "'group_src'", f"0..{n - 1}"):
            commlib.broadcast(torch.ones(1), group_src=bad)
    with raises(ArgErr, "broadcast()", "'src'", "given together with group_src", "only one"):
        commlib.broadcast(torch.ones(1), src=0, group_src=0)
    with raises(ArgErr, "commlib.reduce()", "'dst'", "world rank in group"):
        commlib.reduce(torch.ones(1), dst=-1)
    with raises(ArgErr, "reduce()", "'group_dst'", f"0..{n - 1}"):
        commlib.reduce(torch.ones(1), group_dst=n)
    if n > 1:  # a world rank that is not in the group
        g = commlib.new_group([0])
        if r == 0:
            with raises(ArgErr, "reduce()", "'dst'", "world ranks [0]"):
                commlib.reduce(torch.ones(1), dst=1, group=g)
    ro = np.ones(n, dtype=np.float32)
    ro.flags.writeable = False
    for call in (lambda: commlib.all_reduce(ro), lambda: commlib.broadcast(ro, src=0),
                 lambda: commlib.reduce(ro, dst=0)):
        with raises(ArgErr, "'tensor'", "read-only", "receives the result", "np.array"):
            call()
    with raises(ArgErr, "all_gather_into_tensor()", "'output_tensor'", "read-only"):
        commlib.all_gather_into_tensor(ro, np.ones(1, dtype=np.float32))
    with raises(ArgErr, "reduce_scatter_tensor()", "'output'", "read-only"):
        commlib.reduce_scatter_tensor(ro[:1], np.ones(n, dtype=np.float32))
    with raises(ArgErr, "all_to_all_single()", "'output'", "read-only"):
        commlib.all_to_all_single(ro, np.ones(n, dtype=np.float32))
    with raises(ArgErr, "irecv()", "'tensor'", "read-only"):
        commlib.irecv(ro, src=0)
    with raises(ArgErr, "all_reduce()", "negative strides", "np.ascontiguousarray"):
        commlib.all_reduce(np.ones(4)[::-1])
    with raises(TypeErr, "all_reduce()", "'tensor'", ">f4", "byte order", "newbyteorder"):
        commlib.all_reduce(np.ones(3, dtype=">f4"))
    # outputs whose elements share memory (expand) are refused before anything is posted
    with raises(ArgErr, "commlib.all_reduce()", "'tensor'", "stride=(0,)", "share memory", "clone()"):
        commlib.all_reduce(torch.ones(1).expand(4))
    with raises(ArgErr, "commlib.broadcast()", "'tensor'", "share memory"):
        commlib.broadcast(torch.zeros(2, 1).expand(2, 3), src=0)
    with raises(ArgErr, "commlib.all_gather_into_tensor()", "'output_tensor'", "share memory"):
        commlib.all_gather_into_tensor(torch.zeros(1).expand(2 * n), torch.ones(2))
    with raises(ArgErr, "commlib.reduce_scatter_tensor()", "'output'", "share memory"):
        commlib.reduce_scatter_tensor(torch.zeros(1).expand(2), torch.ones(2 * n))
    with raises(ArgErr, "commlib.all_reduce()", "'algorithm'", "'ringg'", "no such algorithm",
                "'native'", "'ring'", "'rabenseifner'"):
        commlib.all_reduce(torch.ones(2), algorithm="ringg")
    with raises(ArgErr, "commlib.broadcast()", "'algorithm'", "'binomial'"):
        commlib.broadcast(torch.ones(2), algorithm="nope")


def case_errors_point_to_point():
    r, n = commlib.get_rank(), commlib.get_world_size()
    other = (r + 1) % n
    for bad in (-1, 32768, 1.5, "3"):
        with raises(ArgErr, "commlib.isend()", "'tag'", "must be an int in 0..32767"):
            commlib.isend(torch.ones(2), dst=other, tag=bad)
    with raises(ArgErr, "commlib.send()", "'dst'", "is required", "dst=<world rank>"):
        commlib.send(torch.ones(2))
    with raises(ArgErr, "commlib.send()", "'dst'", f"= {n}", "world rank in group"):
        commlib.send(torch.ones(2), dst=n)
    with raises(ArgErr, "commlib.recv()", "'group_src'", f"0..{n - 1}"):
        commlib.recv(torch.ones(2), group_src=n)
    # blocking messages to oneself never complete (large ones, on MPI): refused at every size
    with raises(ArgErr, "commlib.send()", "'dst'", "is this rank itself", "isend/irecv"):
        commlib.send(torch.ones(2), dst=r)
    with raises(ArgErr, "commlib.recv()", "'src'", "is this rank itself", "isend/irecv"):
        commlib.recv(torch.ones(2), src=r)
    with raises(TypeErr, "batch_isend_irecv()", "'p2p_op_list'", "non-empty list of P2POp"):
        commlib.batch_isend_irecv([])
    with raises(TypeErr, "batch_isend_irecv()", "'p2p_op_list[0]'", "must be a commlib.P2POp"):
        commlib.batch_isend_irecv([(commlib.isend, torch.ones(1), other)])
    with raises(ArgErr, "batch_isend_irecv()", "'p2p_op_list[0].op'", "must be isend or irecv"):
        commlib.batch_isend_irecv([commlib.P2POp(commlib.send, torch.ones(1), other)])
    with raises(ArgErr, "batch_isend_irecv()", "'p2p_op_list[0].peer'", "needs its peer"):
        commlib.batch_isend_irecv([commlib.P2POp(commlib.irecv, torch.ones(1))])
    with raises(TypeErr, "commlib.isend()", "'tensor'", "must be a torch.Tensor"):
        commlib.isend([1], dst=other)
