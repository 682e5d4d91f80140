"""Parallel layers built on commlib's collectives: sequence-parallel attention.

``commlib.nn.functional``: :func:`ring_attention` (blockwise ring or the RSA scheme),
:func:`ulysses_attention`, :func:`shard_sequence`, :func:`unshard_sequence`.
``commlib.nn.SequenceParallelAttention``: the attention module of a transformer block whose
activations are sharded along the sequence.
"""

from . import functional
from .attention import SequenceParallelAttention

__all__ = ["functional", "SequenceParallelAttention"]
