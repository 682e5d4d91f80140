"""The tuning file: fitting, merging, loading, errors; and bench/calibrate.py run for real under
mpiexec, its file read back into the model."""

import json
import re
import sys

import pytest

from commlib.errors import CommConfigError
from commlib.tuning.calibration import FORMAT, fit_alpha_beta, load, save_entry, table_for
from commlib.tuning.model import LinkCost, predict
from conftest import ROOT, base_env, mpiexec_path, run_cmd, run_mpi_hosts


def test_fit_recovers_a_line():
    alpha, beta = 5e-6, 1 / 4e9
    points = {n: alpha + n * beta for n in (8, 512, 32768, 1 << 21)}
    a, b = fit_alpha_beta(points)
    assert a == pytest.approx(alpha, rel=1e-6) and b == pytest.approx(beta, rel=1e-6)
    with pytest.raises(ValueError):
        fit_alpha_beta({8: 1e-6})


def test_entries_merge_and_the_nearest_size_serves(tmp_path):
    path = tmp_path / "t.json"
    save_entry(path, "mpi/2", {"shm": LinkCost(1e-6, 1e-9, 1e-10)},
               {"all_reduce": {"native": {8: 2e-6, 1024: 3e-6}}})
    save_entry(path, "mpi/4", {"shm": LinkCost(4e-6, 2e-9, 1e-10)}, {})
    save_entry(path, "mpi/4@2", {"shm": LinkCost(3e-6, 2e-9, 1e-10), "net": LinkCost(9e-6, 1e-8)}, {})
    doc = load(path)
    assert doc["format"] == FORMAT and sorted(doc["groups"]) == ["mpi/2", "mpi/4", "mpi/4@2"]
    two = table_for(doc, "mpi", 2)
    assert two.link.alpha == 1e-6 and two.curves["all_reduce"]["native"](1024) == 3e-6
    three = table_for(doc, "mpi", 3)  # nearest is 2 (ties go to the smaller): no measured curve
    assert three.link.alpha == 1e-6 and three.curves == {}
    assert table_for(doc, "torch", 2) is None and table_for(None, "mpi", 2) is None
    # a shape across hosts is its own entry: never the nearest single-host one
    assert table_for(doc, "mpi", 4, hosts=2).link.alpha == 3e-6
    assert table_for(doc, "mpi", 6, hosts=2) is None
    native = [x for x in predict("all_reduce", 1024, 2, two) if x.algorithm == "native"][0]
    assert native.how == "measured"


def test_one_rank_per_host_is_its_own_entry(tmp_path):
    """2 hosts x 1 rank and 2 ranks on one host are different groups: the first is keyed
    ``mpi/2@2`` (its link is the one between hosts, ``net``), never the one-host ``mpi/2``. They
    shared ``mpi/2`` before, and whichever was calibrated last priced the other: the 2D planner
    then priced the broadcasts inside a host at the network's speed (x0.5 of the measured)."""
    from commlib.topology.host import HostLayout

    assert HostLayout(((0,), (1,))).host_count == 2 and HostLayout(((0, 1),)).host_count == 1
    assert not HostLayout(((0,), (1,))).spans_hosts  # no hierarchy to run: still two hosts
    path = tmp_path / "t.json"
    save_entry(path, "mpi/2", {"shm": LinkCost(1e-6, 1e-10, 1e-10)}, {})
    save_entry(path, "mpi/2@2", {"net": LinkCost(2e-5, 8e-9), "net_rails": LinkCost(2e-5, 8e-9)},
               {"all_reduce": {"native": {8: 5e-5, 1 << 20: 9e-3}}})
    doc = load(path)
    across = table_for(doc, "mpi", 2, hosts=2)
    assert across.link.alpha == 2e-5 and across.link.beta == 8e-9
    assert across.curves["all_reduce"]["native"](1 << 20) == 9e-3
    assert table_for(doc, "mpi", 2).link.alpha == 1e-6  # the one-host entry is untouched


def test_bad_files_name_the_file(tmp_path, monkeypatch):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(CommConfigError, match=r"bad\.json is not valid JSON \(line 1"):
        load(bad)
    bad.write_text(json.dumps({"format": "other"}))
    with pytest.raises(CommConfigError, match="has format 'other'"):
        load(bad)
    monkeypatch.setenv("COMMLIB_TUNING_FILE", str(tmp_path / "missing.json"))
    with pytest.raises(CommConfigError, match="missing.json does not exist"):
        load()
    monkeypatch.delenv("COMMLIB_TUNING_FILE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert load() is None  # no calibration yet: the model uses its defaults


def test_calibrate_writes_a_file_the_model_reads(tmp_path):
    exe = mpiexec_path()
    if exe is None:
        pytest.fail("mpiexec not found: install the 'mpich' extra (pip install mpich)")
    out = tmp_path / "tuning.json"
    # sizes to 4 MiB (13 s here; to 64 MiB, the default, 34 s): the model extends the curves
    proc = run_cmd([exe, "-n", "2", sys.executable, str(ROOT / "bench" / "calibrate.py"), "--quick",
                    "--max-bytes", str(4 << 20), "--out", str(out)], timeout=240, env=base_env())
    assert "# link shm: alpha" in proc.stdout
    table = table_for(load(out), "mpi", 2)
    assert table.link.alpha > 0 and table.link.beta > 0 and table.link.gamma > 0
    assert table.link.curve is not None
    assert set(table.curves) == {"all_reduce", "all_gather", "reduce_scatter", "broadcast"}
    # every algorithm eligible on 2 ranks of one host: the engine's, the shared-memory ones (the
    # group has a segment) and the point-to-point ones; not hierarchical (one host)
    assert set(table.curves["all_reduce"]) == {"native", "shm_oneshot", "shm_twoshot", "ring",
                                               "pipelined_doubling",
                                               "recursive_doubling", "rabenseifner", "binomial"}
    assert set(table.curves["broadcast"]) == {"native", "shm", "binomial"}
    # times grow with size: 64 MiB (beyond the sizes measured) takes longer than 8 B for every one
    for algos in table.curves.values():
        for curve in algos.values():
            assert curve(64 << 20) > 10 * curve(8)


def test_if_missing_measures_an_entry_only_a_probe_wrote(tmp_path):
    exe = mpiexec_path()
    if exe is None:
        pytest.fail("mpiexec not found: install the 'mpich' extra (pip install mpich)")
    out = tmp_path / "tuning.json"
    save_entry(out, "mpi/2", {"shm": LinkCost(9e-6, 1e-9, 1e-10)},
               {"all_reduce": {"native": {8: 9e-6, 1024: 1e-5}}}, {"how": "probed in the job", "runs": 3})
    cmd = [exe, "-n", "2", sys.executable, str(ROOT / "bench" / "calibrate.py"), "--quick",
           "--max-bytes", "4096", "--patience", "0", "--if-missing", "--out", str(out)]
    first = run_cmd(cmd, timeout=240, env=base_env())
    assert "# link shm: alpha" in first.stdout, first.stdout
    entry = load(out)["groups"]["mpi/2"]
    assert "probe" not in entry and "all_gather" in entry["curves"]
    again = run_cmd(cmd, timeout=240, env=base_env())
    assert "already has mpi/2; nothing to do" in again.stdout, again.stdout


def test_calibrate_across_virtual_hosts_and_select_from_it(tmp_path):
    """2 x 2 ranks on virtual hosts: calibration measures each link class (intra-host, one rail,
    all rails), the group's entry is its own shape, and every rank then selects from it."""
    out = tmp_path / "tuning.json"
    hosts = ["a", "a", "b", "b"]
    # up to 128 KiB: from 64 KiB on, calls across hosts are timed after a smaller one
    proc = run_mpi_hosts(hosts, str(ROOT / "bench" / "calibrate.py"), "--quick", "--max-bytes",
                         "131072", "--out", str(out), timeout=300)
    assert "4 ranks on 2 host(s)" in proc.stdout, proc.stdout
    doc = load(out)
    links = doc["groups"]["mpi/4@2"]["links"]
    assert set(links) == {"shm", "net", "net_rails"}
    # the share of a transfer's time a matmul beside it lost, on the links between hosts only
    found = re.search(r"^# links between hosts: busy ([01]\.\d\d) of a transfer's time", proc.stdout, re.M)
    assert found, proc.stdout
    busy = links["net_rails"].get("busy", 0.0)
    assert busy == links["net"].get("busy", 0.0) and f"{busy:.2f}" == found.group(1)
    assert 0.0 <= busy <= 1.0 and "busy" not in links["shm"]
    # a call timed after a smaller one, less that one's time, still costs at least as much
    for algos in table_for(doc, "mpi", 4, hosts=2).curves.values():
        for curve in algos.values():
            assert curve(131072) >= curve(32768) > 0
    proc = run_mpi_hosts(hosts, "tuning_explain.py", "hosts", timeout=240,
                         COMMLIB_TUNING_FILE=str(out))
    assert "ok case_explain_agrees_and_runs (world size 4)" in proc.stdout
    assert "ok case_half_precision_prices_the_upcast (world size 4)" in proc.stdout


def test_explain_on_one_host_without_calibration():
    proc = run_mpi_hosts(["a", "a", "a"], "tuning_explain.py", "one-host", timeout=240)
    assert "ok case_explain_agrees_and_runs (world size 3)" in proc.stdout
    assert "ok case_half_precision_prices_the_upcast (world size 3)" in proc.stdout


def test_model_accuracy_bench_reports_its_shares(tmp_path):
    out = tmp_path / "acc.json"
    proc = run_cmd([sys.executable, str(ROOT / "bench" / "model_accuracy.py"), "--ranks", "2",
                    "--quick", "--max-bytes", "4096", "--json", str(out)], timeout=300, env=base_env())
    for line in ("# prediction within ±25%:", "# selection within 10% of the fastest algorithm:",
                 "# commlib.all_reduce within 10% of the best"):
        assert line in proc.stdout, proc.stdout
    (doc,) = json.loads(out.read_text())
    assert doc["p"] == 2 and "defaults and probe" in doc["model"]
    rows = doc["rows"]
    assert {r["collective"] for r in rows} == {"all_reduce", "all_gather", "reduce_scatter", "broadcast"}
    ar = [r for r in rows if r["collective"] == "all_reduce"]
    assert [r["size"] for r in ar] == [8, 32, 128, 512, 2048]
    for r in ar:  # the shared-memory algorithms are eligible on one host; hierarchical is not
        assert {"shm_oneshot", "shm_twoshot", "native", "ring"} <= set(r["measured"])
        assert "hierarchical" not in r["measured"]
        assert set(r["others"]) == {"(auto)", "(mpi4py)", "(gloo)"}
        assert r["picked"] in r["measured"] and all(t > 0 for t in r["measured"].values())
        # the automatic call's score comes from a second, head-to-head timing of the sweep's best
        c = r["confirm"]
        sweep = {**r["measured"], **{k: v for k, v in r["others"].items() if k != "(auto)"}}
        assert c["best"] == min(sweep, key=sweep.get) and c["auto"] > 0 and c["best_time"] > 0
        assert c["ratio"] > 0
    assert all(r["confirm"] is None for r in rows if r["collective"] != "all_reduce")
