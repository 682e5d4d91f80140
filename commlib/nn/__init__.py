"""Parallel layers built on commlib's collectives: sequence-parallel attention and Megatron-style
tensor parallelism.

``commlib.nn.functional``: :func:`ring_attention` (blockwise ring or the RSA scheme),
:func:`ulysses_attention`, :func:`shard_sequence`, :func:`unshard_sequence`,
:func:`column_parallel_linear`, :func:`row_parallel_linear`.
``commlib.nn.SequenceParallelAttention``: the attention module of a transformer block whose
activations are sharded along the sequence.
``commlib.nn.ColumnParallelLinear``, ``RowParallelLinear``, ``ParallelMLP``: linear layers and
the MLP with weights split over a tensor-parallel group (optionally sequence-parallel, with
communication overlapped with computation); ``from_dense``/``to_dense`` convert to and from
``torch.nn.Linear``.
``commlib.nn.Linear2D``, ``LayerNorm2D``, ``Embedding2D``, ``TransformerBlock2D``: Optimus-style
2D tensor parallelism, weights and activations split over an (r, c) ``commlib.Mesh`` and
multiplied with SUMMA (``TransformerBlock`` is the dense block they are compared with).
"""

from . import functional
from .attention import SequenceParallelAttention
from .tensor_parallel import ColumnParallelLinear, ParallelMLP, RowParallelLinear
from .layers_2d import Embedding2D, LayerNorm2D, TransformerBlock, TransformerBlock2D
from .tensor_parallel_2d import Linear2D

__all__ = ["functional", "SequenceParallelAttention", "ColumnParallelLinear", "RowParallelLinear",
           "ParallelMLP", "Linear2D", "LayerNorm2D", "Embedding2D", "TransformerBlock2D",
           "TransformerBlock"]
