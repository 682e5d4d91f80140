"""Topology discovery: the machine's NVLink / PCIe / NUMA / network graph, and plans from it.

``discover()`` describes this host (sysfs and NVML, or ``COMMLIB_TOPO_FILE``); ``load(path)``
reads NCCL topology XML, ``nvidia-smi topo -m`` text or commlib JSON; ``catalog`` names real
systems; ``compose`` joins hosts into a cluster. A :class:`Topology` answers ``path_type`` and
``bandwidth`` between devices and plans rings, trees and the node hierarchy. This is commlib's
bottom layer: it imports nothing from the layers above it.
"""

# Modules that register Topology's operations (model.register_operation) on import, imported here so
# that its methods always find them; plan and formats (write_json) are imported below for their names.
from . import diagnose, draw, json_format, matrix, nccl_xml  # noqa: F401
from .catalog import catalog_dir, catalog_names, cluster, compose, load_catalog
from .formats import FORMATS, load, load_graphs, loads, register_format
from .gather import gather_topology
from .host import host_hash, host_id
from .model import PATH_TYPES, Diagnostic, Topology, TopologyError, TopologyFormatError
from .plan import DoubleTree, RingPlan, hierarchy, mesh_order, plan_ring, plan_trees
from .sources import SOURCES, SourceUnavailable, discover, register_source

__all__ = [
    "Topology", "TopologyError", "TopologyFormatError", "Diagnostic", "PATH_TYPES",
    "discover", "load", "loads", "load_graphs", "register_format", "FORMATS",
    "register_source", "SOURCES", "SourceUnavailable",
    "catalog_dir", "catalog_names", "load_catalog", "compose", "cluster", "gather_topology",
    "plan_ring", "plan_trees", "hierarchy", "mesh_order", "RingPlan", "DoubleTree",
    "host_id", "host_hash",
]
