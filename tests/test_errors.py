"""Argument checks of every public entry, in one process (world of one: the checks are local).

Each message must name the function, the argument, the rule and a fix.
"""

import numpy as np
import pytest
import torch

import commlib
from commlib import ReduceOp


@pytest.fixture(autouse=True, scope="module")
def world():
    commlib.init(backend="self")
    yield
    commlib.finalize()


class raises:
    """``pytest.raises`` that also checks the message holds each fragment and a fix."""

    def __init__(self, exc, *fragments):
        self.ctx, self.fragments = pytest.raises(exc), fragments

    def __enter__(self):
        self.info = self.ctx.__enter__()
        return self.info

    def __exit__(self, *exc_info):
        handled = self.ctx.__exit__(*exc_info)
        text = str(self.info.value)
        for fragment in self.fragments:
            assert fragment in text, f"{fragment!r} not in {text!r}"
        assert "Fix:" in text, text
        return handled


def test_wrong_type():
    with raises(commlib.CommTypeError, "commlib.all_reduce()", "'tensor'", "torch.Tensor"):
        commlib.all_reduce([1.0, 2.0])


def test_unsupported_dtypes():
    with raises(commlib.CommTypeError, "all_reduce", "unsupported dtype", "complex64"):
        commlib.all_reduce(torch.zeros(2, dtype=torch.complex64))
    with raises(commlib.CommTypeError, "all_reduce", "unsupported dtype"):
        commlib.all_reduce(np.zeros(2, dtype=np.uint16))


def test_avg_on_integers_and_bitwise_on_floats():
    with raises(commlib.CommArgumentError, "'op'", "AVG is defined on floating dtypes", "SUM"):
        commlib.all_reduce(torch.zeros(2, dtype=torch.int32), op=ReduceOp.AVG)
    with raises(commlib.CommArgumentError, "'op'", "BXOR is a bitwise op", "float32"):
        commlib.all_reduce(torch.zeros(2), op=ReduceOp.BXOR)
    with raises(commlib.CommArgumentError, "'op'", "AVG", "bool"):
        commlib.all_reduce(torch.zeros(2, dtype=torch.bool), op="avg")


def test_bad_op():
    with raises(commlib.CommTypeError, "'op'", "is not a reduction operator", "ReduceOp.SUM"):
        commlib.all_reduce(torch.zeros(2), op="median")


def test_torch_reduce_op_is_accepted():
    t = torch.ones(3)
    commlib.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    assert torch.equal(t, torch.ones(3))


def test_bad_roots():
    with raises(commlib.CommArgumentError, "broadcast", "'src'", "world rank in group"):
        commlib.broadcast(torch.zeros(2), src=3)
    with raises(commlib.CommArgumentError, "reduce", "'group_dst'", "0..0"):
        commlib.reduce(torch.zeros(2), group_dst=1)
    with raises(commlib.CommArgumentError, "'dst'", "given together with group_dst"):
        commlib.reduce(torch.zeros(2), dst=0, group_dst=0)


def test_output_sizes():
    with raises(commlib.CommArgumentError, "all_gather_into_tensor", "'output_tensor'",
                "group size (1) x input elements (3)"):
        commlib.all_gather_into_tensor(torch.empty(4), torch.ones(3))
    with raises(commlib.CommArgumentError, "reduce_scatter_tensor", "'input'", "group size"):
        commlib.reduce_scatter_tensor(torch.empty(2), torch.ones(3))
    with raises(commlib.CommTypeError, "'input_tensor'", "dtype of 'output_tensor'"):
        commlib.all_gather_into_tensor(torch.empty(3), torch.ones(3, dtype=torch.float64))


def test_split_sizes():
    with raises(commlib.CommArgumentError, "all_to_all_single", "'input_split_sizes'",
                "non-negative sizes summing to dim 0 (4)"):
        commlib.all_to_all_single(torch.empty(4), torch.ones(4), input_split_sizes=[3])
    with raises(commlib.CommArgumentError, "'output_split_sizes'", "must be 1 non-negative"):
        commlib.all_to_all_single(torch.empty(4), torch.ones(4), output_split_sizes=[2, 2])


def test_tensor_list_length():
    with raises(commlib.CommArgumentError, "all_gather", "'tensor_list'", "group size (1)"):
        commlib.all_gather([torch.empty(2), torch.empty(2)], torch.ones(2))


def test_read_only_numpy_output():
    a = np.ones(3, dtype=np.float32)
    a.flags.writeable = False
    with raises(commlib.CommArgumentError, "all_reduce", "read-only", "np.array"):
        commlib.all_reduce(a)


def test_bad_tag_and_self_send():
    with raises(commlib.CommArgumentError, "send", "'tag'", "0..32767"):
        commlib.send(torch.ones(2), dst=0, tag=-1)
    with raises(commlib.CommArgumentError, "recv", "'src'"):
        commlib.recv(torch.ones(2), src=5)
    with raises(commlib.CommTypeError, "batch_isend_irecv", "P2POp"):
        commlib.batch_isend_irecv([])


def test_bad_algorithm_names_the_valid_ones():
    with raises(commlib.CommArgumentError, "'algorithm'", "no such algorithm", "ring",
                "rabenseifner"):
        commlib.all_reduce(torch.ones(2), algorithm="ringg")


def test_bad_group():
    with raises(commlib.CommTypeError, "'group'", "commlib.Group"):
        commlib.all_reduce(torch.ones(2), group="world")


def test_mesh_shape():
    with raises(commlib.CommArgumentError, "Mesh", "'shape'", "has 2 ranks but the group has 1"):
        commlib.Mesh((2, 1))
    mesh = commlib.Mesh((1, 1), ("dp", "tp"))
    with raises(commlib.CommArgumentError, "Mesh.group", "'dim'", "('dp', 'tp')"):
        mesh.group("pp")


def test_self_messages_and_world_of_one():
    work = commlib.isend(torch.arange(3.0), dst=0, tag=7)
    got = torch.empty(3)
    assert commlib.irecv(got, src=0, tag=7).result() == 0
    work.wait()
    assert torch.equal(got, torch.arange(3.0))
    t = torch.arange(4.0)
    commlib.all_reduce(t, op=ReduceOp.AVG)
    assert torch.equal(t, torch.arange(4.0))


def test_numbers_are_not_ops():
    # torch's op enum compares equal to ints (3 == MIN): a number must not pass as an operator
    for bad in (0, 3, True, 1.0):
        with raises(commlib.CommTypeError, "'op'", "is not a reduction operator"):
            commlib.all_reduce(torch.ones(2), op=bad)
    t = torch.ones(2)
    commlib.all_reduce(t, op="max")  # names are fine
    commlib.all_reduce(t, op=torch.distributed.ReduceOp.RedOpType.MIN)
    assert torch.equal(t, torch.ones(2))


def test_blocking_message_to_oneself_is_refused_at_world_size_one():
    with raises(commlib.CommArgumentError, "commlib.send()", "'dst'", "is this rank itself", "isend/irecv"):
        commlib.send(torch.ones(2), dst=0)
    with raises(commlib.CommArgumentError, "commlib.recv()", "'src'", "is this rank itself"):
        commlib.recv(torch.ones(2), src=0)


def test_receive_without_a_send_in_a_world_of_one():
    work = commlib.irecv(torch.empty(2), src=0, tag=11)
    assert not work.is_completed()
    with raises(commlib.CommStateError, "no matching send", "isend"):
        work.wait()


def test_any_shape_buffers_on_self_backend():
    out = torch.zeros(3, 1)
    commlib.all_gather_into_tensor(out, torch.arange(3.0))
    assert torch.equal(out.view(-1), torch.arange(3.0))
    out = torch.zeros(2, 2)
    commlib.reduce_scatter_tensor(out, torch.arange(4.0))
    assert torch.equal(out, torch.arange(4.0).view(2, 2))
    out = torch.zeros(2, 2)
    commlib.all_to_all_single(out, torch.arange(4.0).view(2, 2).t())
    assert torch.equal(out, torch.arange(4.0).view(2, 2).t())


def test_groups_and_meshes_arguments():
    with raises(commlib.CommArgumentError, "new_group", "'ranks'", "ranks [1] are outside the world (size 1)"):
        commlib.new_group([0, 1])
    with raises(commlib.CommArgumentError, "new_group", "'ranks'", "no repeated rank"):
        commlib.new_group([0, 0])
    with raises(commlib.CommArgumentError, "new_group", "'ranks'", "non-empty"):
        commlib.new_group([])
    with raises(commlib.CommArgumentError, "new_group", "'ranks'", "sequence of world ranks"):
        commlib.new_group(["a"])
    with raises(commlib.CommArgumentError, "Mesh", "'shape'", "positive integers"):
        commlib.Mesh((0, 1))
    with raises(commlib.CommArgumentError, "Mesh", "'dim_names'", "2 distinct names"):
        commlib.Mesh((1, 1), ("a", "a"))
    mesh = commlib.Mesh((1, 1))
    with raises(commlib.CommArgumentError, "Mesh.group", "'dim'", "must index a dimension of (1, 1)"):
        mesh.group(2)


def test_init_arguments():
    with raises(commlib.CommStateError, "already initialized with backend 'self'", "finalize"):
        commlib.init(backend="mpi")
    commlib.finalize()
    try:
        with raises(commlib.CommStateError, "not initialized", "commlib.init()"):
            commlib.get_world_group()
        with raises(commlib.CommArgumentError, "commlib.init()", "'timeout'", ">= 0"):
            commlib.init(backend="self", timeout=-1)
        with raises(commlib.CommArgumentError, "commlib.init()", "'timeout'"):
            commlib.init(backend="self", timeout="soon")
        with raises(commlib.CommArgumentError, "commlib.init()", "'timeout_mode'", "'abort' or 'raise'"):
            commlib.init(backend="self", timeout_mode="explode")
        with raises(commlib.CommBackendError, "commlib.init()", "'backend'", "'ucx'", "'mpi'", "'self'"):
            commlib.init(backend="ucx")
    finally:
        commlib.init(backend="self")
