"""commlib.topology on real files (the catalog in topology/, copies of public captures) and on this
machine's sysfs. Expected counts are taken from the files' text with regular expressions, not from
the parser under test."""

from __future__ import annotations

import os
import pathlib
import re
import socket
import subprocess
import sys

import pytest

from commlib.topology import (TopologyError, TopologyFormatError, catalog_dir, catalog_names, cluster, discover,
                              load, load_catalog, load_graphs, loads, mesh_order)
from commlib.topology.build import Builder
from commlib.topology.host import interface_addresses
from commlib.topology.catalog import source_line
from commlib.topology.matrix import write_matrix
from commlib.topology.nccl_xml import write_graphs
from commlib.topology.nvml import apply_records
from commlib.topology.plan import double_tree
from conftest import ROOT, base_env

CATALOG = ROOT / "topology"
SAMPLES = pathlib.Path("/work/shared/topology-samples")
FILES = sorted(p for p in CATALOG.iterdir() if ".graph." not in p.name)
XML = [p for p in FILES if p.suffix == ".xml"]
TXT = [p for p in FILES if p.suffix == ".txt"]


# --- independent reading of the files (regular expressions, no commlib) ---------------------------

def table_rows(text: str) -> tuple[list[str], list[list[str]]]:
    """Header device labels and rows (label + cells) of a topo -m capture, by whitespace split."""
    lines = text.splitlines()
    h = next(i for i, ln in enumerate(lines) if ln[:1] in "\t " and ln.split()[:1] == ["GPU0"])
    header = re.split(r"\t|\s{2,}", lines[h].strip())
    devices = [c for c in header if c and c not in ("CPU Affinity", "NUMA Affinity", "GPU NUMA ID")]
    rows = []
    for ln in lines[h + 1:]:
        if not ln.strip() or ln.strip().startswith("Legend"):
            break
        toks = ln.split()
        rows.append([toks[0]] + toks[1:1 + len(devices)])
    return devices, rows


def xml_counts(text: str) -> tuple[int, int, int]:
    gpus = len(re.findall(r'<pci [^>]*class="0x03', text))
    nic_pci = len(re.findall(r'<pci [^>]*class="0x02', text))
    # a <nic> directly under <cpu> (no PCI function around it)
    bare = len(re.findall(r"\n    <nic>", text))  # indentation of a cpu-level <nic> in these files
    return gpus, nic_pci + bare, len(re.findall(r"<nvlink ", text))


def test_catalog_has_every_sample_with_its_source_line():
    names = catalog_names()
    for want in ("dgx-a100", "hgx-h100-8", "azure-ndv4", "aws-p4d", "aws-p5", "pcie-4xa10", "dgx1-v100"):
        assert want in names
    for p in CATALOG.iterdir():
        first = p.read_text().splitlines()[0]
        assert "source:" in first, p
    assert source_line("dgx1-v100").startswith("# source: https://www.microway.com/")
    if SAMPLES.is_dir():  # the catalog keeps the shared captures verbatim
        bodies = {p.read_text() for p in CATALOG.iterdir()}
        for s in SAMPLES.iterdir():
            assert s.read_text() in bodies, f"{s.name} is not in topology/"
    # reachable through the package too (package data link), not only from the repository
    assert (ROOT / "commlib" / "topology" / "catalog").resolve() == CATALOG.resolve()
    assert catalog_dir().resolve() == CATALOG.resolve()


@pytest.mark.parametrize("path", XML, ids=lambda p: p.name)
def test_xml_counts_and_round_trip(path):
    text = path.read_text()
    topo = load(path)
    gpus, nics, nvlinks = xml_counts(text)
    assert (len(topo.gpus), len(topo.nics), topo.nvlink_count()) == (gpus, nics, nvlinks)
    assert len(topo.cpus) == len(re.findall(r"<cpu ", text))
    again = loads(topo.to_nccl_xml(), "rewritten.xml")
    assert again.same_graph(topo)
    assert loads(topo.to_json(), "rewritten.json").same_graph(topo)


def test_graph_file_parses_and_round_trips():
    path = CATALOG / "azure-ncv4.graph.xml"
    text = path.read_text()
    graphs = load_graphs(path)
    assert len(graphs) == len(re.findall(r"<graph ", text))
    assert sum(len(g.channels) for g in graphs) == len(re.findall(r"<channel>", text))
    assert [g.pattern for g in graphs] == ["RING", "BALANCED_TREE", "TREE"]
    assert graphs[0].channels[1] == [("gpu", 0), ("gpu", 3), ("gpu", 2), ("gpu", 1)]
    with pytest.raises(TopologyFormatError, match="load_graphs"):
        load(path)
    rewritten = write_graphs(graphs)
    from commlib.topology.nccl_xml import read_graphs
    assert read_graphs(rewritten, "x") == graphs


@pytest.mark.parametrize("path", TXT, ids=lambda p: p.name)
def test_matrix_counts_cells_and_rewrite(path):
    text = path.read_text()
    devices, rows = table_rows(text)
    topo = load(path)
    gpu_labels = [d for d in devices if d.startswith("GPU")]
    nic_labels = [d for d in devices if not d.startswith("GPU")]
    assert len(topo.gpus) == len(gpu_labels) and len(topo.nics) == len(nic_labels)
    node = {d: f"GPU{gpu_labels.index(d)}" if d in gpu_labels else f"NIC{nic_labels.index(d)}" for d in devices}
    nv_cells = 0
    for row in rows:
        for col, cell in zip(devices, row[1:]):
            if col == row[0]:
                continue
            got = topo.path_type(node[row[0]], node[col])
            m = re.fullmatch(r"NV(\d+)", cell)
            if m:
                nv_cells += 1
                assert got == "NVL" and topo.nvlink_peers(node[row[0]])[node[col]] == int(m.group(1))
            else:
                want = {"SOC": "SYS"}.get(cell, cell)
                assert topo.pcie_type(node[row[0]], node[col]) == want, (row[0], col, cell)
                assert got in (want, "NVB"), (row[0], col, cell, got)  # NVLink through a peer GPU beats PCIe
    assert sum(len(topo.nvlink_peers(g)) for g in topo.gpus) == nv_cells
    # the matrix writer reproduces every cell
    _devices2, rows2 = table_rows(write_matrix(topo))
    cells = [[{"SOC": "SYS"}.get(c, c) for c in r[1:]] for r in rows]
    assert [r[1:] for r in rows2] == cells


NAMED = [  # (catalog name, a, b, path class) read off the files
    ("dgx-a100", "GPU0", "GPU1", "NVL"), ("dgx-a100", "GPU0", "NIC0", "PXB"), ("dgx-a100", "GPU0", "NIC2", "SYS"),
    ("dgx-a100", "NIC4", "NIC5", "PIX"), ("hgx-h100-8", "GPU0", "NIC0", "PIX"), ("hgx-h100-8", "GPU1", "NIC0", "NODE"),
    ("aws-p4d", "GPU0", "GPU1", "PIX"), ("aws-p4d", "GPU0", "GPU2", "PHB"), ("aws-p4d", "GPU0", "GPU4", "SYS"),
    ("aws-p4d", "GPU0", "NIC0", "PIX"), ("aws-p5", "GPU0", "NIC3", "PIX"), ("aws-p5", "GPU0", "NIC4", "PHB"),
    ("ibm-hgx-h100-vsi", "GPU0", "GPU7", "NVL"), ("ibm-hgx-h100-vsi", "GPU0", "NIC0", "PIX"),
    ("ibm-hgx-h100-vsi", "GPU0", "NIC4", "SYS"), ("dgx1-v100", "GPU0", "GPU5", "NVB"),
    ("dgx1-v100", "GPU0", "GPU3", "NVL"), ("azure-ndv4", "GPU0", "NIC0", "PIX"), ("pcie-4xa10", "NIC0", "NIC1", "PIX"),
    ("azure-ndv2", "GPU0", "GPU4", "SYS"), ("azure-ncv4", "GPU0", "GPU1", "SYS"),
]


@pytest.mark.parametrize("name,a,b,kind", NAMED)
def test_named_path_classes(name, a, b, kind):
    topo = load_catalog(name)
    assert topo.path_type(a, b) == kind
    assert topo.path_type(b, a) == kind


def test_bandwidths_follow_nccl_constants():
    ibm = load_catalog("ibm-hgx-h100-vsi")
    assert ibm.bandwidth(0, 1) == pytest.approx(18 * 20.6)  # 5+5+4+4 links to the NVSwitches, sm90
    p4d = load_catalog("aws-p4d")
    assert p4d.bandwidth("GPU0", "GPU1") == pytest.approx(16 * 60 / 80)  # Gen3 x16 under one switch
    assert p4d.bandwidth("GPU0", "GPU4") == pytest.approx(10.0)  # Skylake UPI (modelid 85)
    p5 = load_catalog("aws-p5")
    assert p5.bandwidth("GPU0", "NIC0") == pytest.approx(8 * 120 / 80)  # Gen4 x8 EFA link
    v100 = load_catalog("dgx1-v100")
    assert v100.bandwidth(0, 3) == pytest.approx(2 * 20.0) and v100.bandwidth(0, 1) == pytest.approx(20.0)
    with pytest.raises(TopologyError, match="names no node"):
        v100.path_type("GPU0", "GPU9")
    with pytest.raises(TopologyError, match="GPU index"):
        v100.bandwidth(0, 8)


def test_dgx1_v100_ring_uses_only_nvlink_hops():
    path = CATALOG / "dgx1-v100.txt"
    devices, rows = table_rows(path.read_text())
    cell = {(r[0], c): v for r in rows for c, v in zip(devices, r[1:])}
    plan = load(path).ring_plan()
    assert sorted(plan.order) == list(range(8)) and not plan.degraded
    for a, b in zip(plan.order, plan.order[1:] + plan.order[:1]):
        assert cell[(f"GPU{a}", f"GPU{b}")].startswith("NV"), (a, b)
    assert {h[2] for h in plan.hops} == {"NVL"}
    assert plan.bandwidth >= 20.0


@pytest.mark.parametrize("name", ["pcie-2xk80", "dgx1-v100-pcie"])
def test_pcie_only_ring_keeps_gpus_under_one_switch_adjacent(name):
    path = catalog_dir() / f"{name}.txt"
    devices, rows = table_rows(path.read_text())
    pix_pairs = {frozenset((r[0], c)) for r in rows for c, v in zip(devices, r[1:])
                 if v == "PIX" and r[0].startswith("GPU") and c.startswith("GPU")}
    assert pix_pairs
    order = load(path).ring()
    adjacent = {frozenset((f"GPU{a}", f"GPU{b}")) for a, b in zip(order, order[1:] + order[:1])}
    assert pix_pairs <= adjacent


def test_ring_is_deterministic_and_budget_bounded():
    topo = load_catalog("aws-p4d")
    full = topo.ring_plan()
    assert topo.ring_plan().order == full.order and not full.degraded
    cut = topo.ring_plan(budget=50)
    assert cut.degraded and "budget 50" in cut.reason and sorted(cut.order) == list(range(8))
    assert cut.bandwidth <= full.bandwidth
    with pytest.raises(TopologyError, match="budget"):
        topo.ring_plan(budget=0)


def test_multi_node_ring_is_rail_aligned_and_trees_are_double_binary():
    topo = cluster("hgx-h100-8", 16, nics_per_host=8, nic_gbps=400)
    assert len(topo.gpus) == 128 and len(topo.nics) == 128 and len(topo.hosts) == 16
    plan = topo.ring_plan()
    assert sorted(plan.order) == list(range(128)) and len(plan.crossings) == 16
    for _host_out, nic_out, _host_in, nic_in in plan.crossings:
        assert nic_out.split("/")[1] == nic_in.split("/")[1]  # same NIC index: same rail
    for k in range(16):  # the GPUs at each host boundary sit next to the rail NIC
        first = topo.gpus[plan.order[8 * k]]
        nic = plan.crossings[k - 1][3]
        assert topo.path_type(first, nic) == "PIX"
    assert plan.bandwidth == pytest.approx(48.0)  # the NIC's Gen5 x16 PCIe link, below 400 Gb/s = 50 GB/s
    trees = topo.trees()
    assert len(trees.chains) == 16 and all(len(c) == 8 for c in trees.chains)


@pytest.mark.parametrize("n", range(1, 10))
def test_double_binary_tree_shape(n):
    trees = double_tree(n)
    interior = [set(), set()]
    for t, tree in enumerate(trees):
        roots = [r for r, (p, _c) in tree.items() if p < 0]
        assert len(roots) == 1
        edges = {(p, r) for r, (p, _c) in tree.items() if p >= 0}
        assert edges == {(r, c) for r, (_p, ch) in tree.items() for c in ch}
        assert len(edges) == n - 1 and all(len(ch) <= 2 for _p, ch in tree.values())
        reach, todo = set(roots), list(roots)  # spanning: every rank reachable from the root
        while todo:
            for c in tree[todo.pop()][1]:
                reach.add(c)
                todo.append(c)
        assert reach == set(range(n))
        interior[t] = {r for r, (_p, ch) in tree.items() if ch}
    if n % 2 == 0:  # mirrored trees (even counts): a rank forwards in at most one tree
        assert not (interior[0] & interior[1])


def test_hierarchy_follows_numa_column():
    text = (CATALOG / "dgx-a100.txt").read_text()
    numa = [int(m) for m in re.findall(r"^GPU\d.*\t(\d+)$", text, flags=re.M)]
    h = load_catalog("dgx-a100").hierarchy()
    assert len(h.groups) == 1 and len(h.groups[0]) == 1  # one host, one NVLink domain (NVSwitch)
    expect = {}
    for gpu, n in enumerate(numa):
        expect.setdefault(n, []).append(gpu)
    assert sorted(h.groups[0][0]) == sorted(expect.values())
    pcie = load_catalog("pcie-4xa10").hierarchy()
    assert len(pcie.groups[0]) == 4  # no NVLink: each GPU its own domain


def test_mesh_order_keeps_inner_dimension_on_a_host():
    keys = [(r % 2, -1, 0) for r in range(8)]  # ranks launched round-robin over two hosts
    plan = mesh_order(keys, (2, 4))
    assert plan.order == [0, 2, 4, 6, 1, 3, 5, 7]
    assert plan.levels == ["network", "numa"] and not plan.degraded
    with pytest.raises(TopologyError, match="positions"):
        mesh_order(keys, (3, 3))


# --- malformed input ---------------------------------------------------------------------------

def test_truncated_xml_names_file_and_line(tmp_path):
    text = (CATALOG / "aws-p4d.xml").read_text()
    bad = tmp_path / "truncated.xml"
    bad.write_text(text[: len(text) // 2])
    last = len(bad.read_text().splitlines())
    with pytest.raises(TopologyFormatError) as exc:
        load(bad)
    msg = str(exc.value)
    assert "truncated.xml:" in msg and "malformed XML" in msg and "Fix:" in msg
    assert exc.value.line is not None and exc.value.line >= last


def test_unknown_xml_tag_names_file_and_line(tmp_path):
    lines = (CATALOG / "ibm-hgx-h100-vsi.xml").read_text().splitlines()
    at = next(i for i, ln in enumerate(lines) if "<nvlink " in ln)
    lines.insert(at + 1, '          <nvswitch target="0000:f5:00.0"/>')
    bad = tmp_path / "unknown.xml"
    bad.write_text("\n".join(lines))
    with pytest.raises(TopologyFormatError, match=rf"unknown\.xml:{at + 2}: unknown element <nvswitch> inside <gpu>"):
        load(bad)


def test_matrix_row_with_missing_column_names_file_and_line(tmp_path):
    lines = (CATALOG / "dgx-a100.txt").read_text().splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.startswith("GPU3\t"))
    cells = lines[at].split("\t")
    del cells[5]  # one matrix cell missing; the affinity columns shift left
    lines[at] = "\t".join(cells)
    bad = tmp_path / "short.txt"
    bad.write_text("\n".join(lines))
    with pytest.raises(TopologyFormatError, match=rf"short\.txt:{at + 1}: row 'GPU3' has 19 cells but the header "
                       "has 20 device columns"):
        load(bad)
    lines = (CATALOG / "pcie-4xa10.txt").read_text().splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.startswith("GPU1 "))
    lines[at] = lines[at].replace("SYS", "QPI", 1)
    bad.write_text("\n".join(lines))
    with pytest.raises(TopologyFormatError, match=rf"short\.txt:{at + 1}: .*unknown path 'QPI'"):
        load(bad)


def test_unreadable_and_unknown_files(tmp_path):
    with pytest.raises(TopologyError, match="cannot be read"):
        load(tmp_path / "missing.xml")
    junk = tmp_path / "junk.txt"
    junk.write_text("hello\n")
    with pytest.raises(TopologyFormatError, match="junk.txt: not a known topology format"):
        load(junk)


# --- live discovery on this machine ------------------------------------------------------------

def _sysfs_pci():
    base = "/sys/bus/pci/devices"
    return {d: open(f"{base}/{d}/class").read().strip() for d in os.listdir(base)}


def test_live_discovery_is_this_host(monkeypatch):
    monkeypatch.delenv("COMMLIB_TOPO_FILE", raising=False)
    topo = discover()
    nodes = sorted(p for p in os.listdir("/sys/devices/system/node") if re.fullmatch(r"node\d+", p))
    assert len(topo.cpus) == max(1, len(nodes))
    for cpu, node in zip(topo.cpus, nodes):
        assert topo.graph.nodes[cpu]["cpulist"] == open(f"/sys/devices/system/node/{node}/cpulist").read().strip()
    pci = _sysfs_pci()
    nvidia = {d for d in pci if pci[d].startswith("0x03") and
              open(f"/sys/bus/pci/devices/{d}/vendor").read().strip() == "0x10de"}
    nics = {d for d in pci if pci[d].startswith("0x02")}
    busids = {(topo.graph.nodes[n].get("pci") or {}).get("busid") for n in topo.graph}
    assert set(pci) <= busids
    assert len(topo.gpus) == len(nvidia) and len(topo.nics) == len(nics)
    netdevs = {os.path.basename(p) for p in os.listdir("/sys/class/net")
               if "/devices/virtual/" not in os.path.realpath(f"/sys/class/net/{p}")}
    names = {n.get("name") for x in topo.nics for n in topo.graph.nodes[x]["nets"]}
    assert netdevs <= names
    assert loads(topo.to_nccl_xml(), "live.xml").summary()["nics"] == len(nics)


def test_discover_uses_commlib_topo_file(monkeypatch):
    monkeypatch.setenv("COMMLIB_TOPO_FILE", str(CATALOG / "aws-p5.xml"))
    topo = discover()
    assert len(topo.gpus) == 8 and len(topo.nics) == 32 and "aws-p5.xml" in topo.source


def test_command_describes_this_host_and_files(tmp_path):
    pic = tmp_path / "host.svg"
    env = base_env()
    proc = subprocess.run([sys.executable, "-m", "commlib.topology", "--picture", str(pic)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for node in sorted(p for p in os.listdir("/sys/devices/system/node") if re.fullmatch(r"node\d+", p)):
        cpus = open(f"/sys/devices/system/node/{node}/cpulist").read().strip()
        assert f"NUMA {node[4:]}, CPUs {cpus}" in out
    for dev, cls in _sysfs_pci().items():
        if cls.startswith("0x02"):
            assert dev in out
    assert pic.read_text().startswith("<svg")
    png = tmp_path / "v100.png"
    proc = subprocess.run([sys.executable, "-m", "commlib.topology", "dgx1-v100", "--picture", str(png)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "ring:" in proc.stdout and "tree0" in proc.stdout and "NV2" in proc.stdout
    assert png.read_bytes()[:4] == b"\x89PNG"
    bad = subprocess.run([sys.executable, "-m", "commlib.topology", str(tmp_path / "nope.xml")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "nope.xml" in bad.stderr


# --- NVML building on recorded values, diagnostics, picture ------------------------------------

def _ibm_records(remote):
    """NVML link records of the IBM HGX H100 file's GPU0/GPU1 (5+5+4+4 links per GPU)."""
    gpus = []
    for busid, counts in (("00000000:A4:00.0", {"F5": 5, "F4": 5, "F3": 4, "F6": 4}),
                          ("00000000:AE:00.0", {"F6": 4, "F4": 5, "F5": 5, "F3": 4})):
        links = []
        for sw, k in counts.items():
            for _ in range(k):
                links.append({"link": len(links), "remote_busid": remote(sw), "remote_type": 2})
        gpus.append({"busid": busid, "sm": 90, "numa": 0, "pcie_max": (5, 16), "pcie_cur": (1, 16),
                     "nvlinks": links})
    return {"gpus": gpus, "p2p": {(0, 1): 0, (1, 0): 0}}


def test_nvml_records_build_nvswitch_links():
    b = Builder("nvml-test")
    apply_records(b, _ibm_records(lambda sw: f"00000000:{sw}:00.0"))
    topo = b.finish()
    assert len(topo.gpus) == 2 and topo.path_type(0, 1) == "NVL"
    assert topo.bandwidth(0, 1) == pytest.approx(18 * 20.6)
    assert [x["count"] for x in topo.graph.nodes["GPU0"]["nvlinks"]] == [5, 5, 4, 4]
    codes = {d.code for d in topo.diagnose()}
    assert "pcie-below-max" in codes and "nvlink-hidden" not in codes


def test_nvml_records_from_a_vm_hide_the_switch():
    rec = _ibm_records(lambda sw: "FFFFFFFF:FF:FF.0")
    rec["p2p"] = {(0, 1): 4, (1, 0): 4}
    b = Builder("nvml-vm")
    apply_records(b, rec)
    topo = b.finish()
    assert topo.graph.nodes["GPU0"]["nvlinks"] == [{"target": "fffffff:ffff:ff", "count": 18, "tclass": "0x068000"}]
    assert topo.path_type(0, 1) == "NVL"
    text = "\n".join(map(str, topo.diagnose()))
    assert "FFFFFFFF" in text and "disabled by regkey" in text


def test_diagnostics_on_real_files():
    a10 = {d.code for d in load_catalog("pcie-4xa10").diagnose()}
    assert {"no-p2p", "nic-far", "numa-inconsistent"} <= a10
    assert "no-p2p" not in {d.code for d in load_catalog("dgx-a100").diagnose()}
    assert "nvlink-self" in {d.code for d in load_catalog("azure-ncv4").diagnose()}


def test_picture_has_every_device_and_nvlink(tmp_path):
    topo = load_catalog("dgx1-v100")
    svg = pathlib.Path(topo.draw(tmp_path / "v100.svg")).read_text()
    assert svg.count("<title>GPU") == 8 and svg.count("<title>NIC") == 4
    pairs = sum(len(topo.nvlink_peers(g)) for g in topo.gpus) // 2
    assert svg.count('<path d="M') == pairs == 16
    with pytest.raises(TopologyError, match=r"\.svg or \.png"):
        topo.draw(tmp_path / "v100.gif")


def test_interface_addresses_are_ipv4_with_loopback_last():
    """This host's interface addresses (Linux): dotted IPv4 quads, the loopback interface's among
    them, every loopback address after every other one."""
    found = interface_addresses()
    assert "127.0.0.1" in found, found
    for a in found:
        socket.inet_aton(a)
    loop = [a.startswith("127.") for a in found]
    assert loop == sorted(loop), found
