"""File formats, registered by name, detected from a file's content.

``load(path)`` reads any registered topology format; ``load_graphs(path)`` reads NCCL graph files
(``NCCL_GRAPH_FILE``, channel lists rather than machines). Adding a format is one
``register_format`` call.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Callable

import networkx as nx

from ..errors import arg_error
from .matrix import read_matrix
from .matrix import sniff as _sniff_matrix
from .model import Diagnostic, Topology, TopologyError, TopologyFormatError, register_operation
from .nccl_xml import read_graphs, read_topology


@dataclass(frozen=True)
class Format:
    name: str
    sniff: Callable[[str], bool]
    read: Callable[[str, str], Topology]


FORMATS: dict[str, Format] = {}


def register_format(name: str, sniff, read) -> None:
    FORMATS[name] = Format(name, sniff, read)


def _strip(text: str) -> str:
    return text.lstrip("\ufeff").lstrip()


def _is_xml_system(text: str) -> bool:
    return _strip(text).startswith("<") and "<system" in text


def _is_xml_graphs(text: str) -> bool:
    return _strip(text).startswith("<") and "<graphs" in text and "<system" not in text


def _is_json(text: str) -> bool:
    return _strip(text).startswith("{")


@register_operation("write_json")
def write_json(topo: Topology) -> str:
    data = nx.node_link_data(topo.graph, edges="links")
    return json.dumps({"commlib_topology": 1, "gpus": topo.gpus, "nics": topo.nics, "hosts": topo.hosts,
                       "source": topo.source, "notes": [[n.code, n.message] for n in topo.notes],
                       "graph": data}, indent=1, sort_keys=True)


def read_json(text: str, path: str) -> Topology:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TopologyFormatError(path, exc.lineno, f"malformed JSON: {exc.msg}",
                                  "write it with Topology.to_json()") from None
    if not isinstance(data, dict) or data.get("commlib_topology") != 1:
        raise TopologyFormatError(path, 1, "not a commlib topology JSON (no \"commlib_topology\": 1)",
                                  "write it with Topology.to_json()")
    g = nx.node_link_graph(data["graph"], edges="links")
    return Topology(g, list(data["gpus"]), list(data["nics"]), list(data["hosts"]), data.get("source", path),
                    [Diagnostic(c, m) for c, m in data.get("notes", [])])


def _read_graphs_as_topology(text, path):
    raise TopologyFormatError(path, None, "this is an NCCL graph file (NCCL_GRAPH_FILE: channels over GPU "
                              "indices), not a machine topology",
                              "read it with commlib.topology.load_graphs(path)")


register_format("nccl-xml", _is_xml_system, read_topology)
register_format("nccl-graph", _is_xml_graphs, _read_graphs_as_topology)
register_format("json", _is_json, read_json)
register_format("nvidia-smi", _sniff_matrix, read_matrix)


def _read_text(path, fn: str) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise arg_error(fn, "path", path, "must be a file path", "pass a str or pathlib.Path",
                        cls=TopologyError)
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError as exc:
        raise arg_error(fn, "path", str(path), f"cannot be read ({exc.strerror})",
                        "pass an existing topology file (NCCL XML, nvidia-smi topo -m text or JSON)",
                        cls=TopologyError) from None


def detect(text: str) -> str | None:
    for f in FORMATS.values():
        if f.sniff(text):
            return f.name
    return None


def load(path) -> Topology:
    """Read a topology file of any registered format (detected from its content)."""
    text = _read_text(path, "topology.load")
    name = detect(text)
    if name is None:
        raise TopologyFormatError(str(path), None, "not a known topology format (expected NCCL topology XML, "
                                  "'nvidia-smi topo -m' output or commlib JSON)",
                                  "pass one of those; see docs/topology.md")
    return FORMATS[name].read(text, str(path))


def loads(text: str, name: str = "<string>") -> Topology:
    fmt = detect(text)
    if fmt is None:
        raise TopologyFormatError(name, None, "not a known topology format", "see docs/topology.md")
    return FORMATS[fmt].read(text, name)


def load_graphs(path):
    """Read an NCCL graph file (``<graphs>``): a list of :class:`NcclGraph`."""
    return read_graphs(_read_text(path, "topology.load_graphs"), str(path))
