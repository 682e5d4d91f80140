"""commlib.init() with no argument in each launch mode commlib can see here: under mpiexec
(backend mpi, world size -n) and in a plain process (backend self, world size 1); init twice,
finalize and init again; the README example."""

import sys

from conftest import base_env, mpiexec_path, run_cmd

PLAIN = """
import commlib, torch
w = commlib.init()
assert w is commlib.init() and commlib.is_initialized()
print("world", w.backend.name, commlib.get_world_size(), commlib.get_rank())
ops = [commlib.ReduceOp.SUM, commlib.ReduceOp.AVG, commlib.ReduceOp.PRODUCT, commlib.ReduceOp.MIN,
       commlib.ReduceOp.MAX]
x = torch.tensor([1.5, -2.0, 3.25])
for op in ops:  # a world of one: every reduction is the identity
    t = x.clone(); commlib.all_reduce(t, op=op); assert torch.equal(t, x), (op, t)
    t = x.clone(); commlib.reduce(t, dst=0, op=op); assert torch.equal(t, x), (op, t)
    o = torch.empty(3); commlib.reduce_scatter_tensor(o, x, op=op); assert torch.equal(o, x)
t = x.clone(); commlib.broadcast(t, src=0); assert torch.equal(t, x)
o = torch.empty(1, 3); commlib.all_gather_into_tensor(o, x); assert torch.equal(o[0], x)
o = torch.empty(3); commlib.all_to_all_single(o, x); assert torch.equal(o, x)
commlib.barrier()
commlib.finalize()
assert not commlib.is_initialized()
w2 = commlib.init()
assert w2 is not w and w2.size == 1
t = x.clone(); commlib.all_reduce(t); assert torch.equal(t, x)
print("reinit", w2.backend.name, w2.size)
"""


def test_plain_process_is_a_world_of_one():
    proc = run_cmd([sys.executable, "-c", PLAIN], timeout=60)
    assert proc.stdout.split("\n")[:2] == ["world self 1 0", "reinit self 1"], proc.stdout


def test_readme_example_prints_sixes_on_every_rank(tmp_path):
    code = ("import commlib, torch; commlib.init(); t = torch.full((5,), "
            "float(commlib.get_rank() + 1)); commlib.all_reduce(t); print(t)")
    # No COMMLIB_* variable at all: the defaults, exactly as a user runs it (so the job probes
    # its all-reduce at init: on a cache of its own, which the other tests do not read).
    env = {k: v for k, v in base_env().items() if not k.startswith("COMMLIB_")}
    env["XDG_CACHE_HOME"] = str(tmp_path)
    proc = run_cmd([mpiexec_path(), "-n", "3", sys.executable, "-c", code], timeout=120, env=env)
    # each rank's print is one write; lines of different ranks may interleave, tensors do not
    assert proc.stdout.count("tensor([6., 6., 6., 6., 6.])") == 3, proc.stdout
    assert proc.stdout.count("tensor(") == 3, proc.stdout
