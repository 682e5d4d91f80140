"""Every rank gets CommUnsupportedError when 'hierarchical' is forced on a layout it cannot run."""

import torch

import commlib

commlib.init()
t = torch.ones(10)
try:
    commlib.all_reduce(t, algorithm="hierarchical")
except commlib.CommUnsupportedError as exc:
    print(f"refused: rank {commlib.get_rank()}: {exc}", flush=True)
commlib.all_reduce(t)  # the group is still usable
assert torch.equal(t, torch.full((10,), float(commlib.get_world_size())))
commlib.finalize()
