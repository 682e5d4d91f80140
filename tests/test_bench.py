"""The benchmarks are tests too: every collective's bench file runs under mpiexec, checks its
results (#wrong == 0 for commlib, mpi4py and gloo) and prints nccl-tests' columns; and the checker
itself catches a corrupted result (the hidden ``--inject-error`` flag)."""

from __future__ import annotations

import json
import re
import sys

import pytest

from conftest import ROOT, base_env, mpiexec_path, run_cmd

BENCH = ROOT / "bench"
QUICK = ["-b", "8", "-e", "64K", "-f", "64", "-w", "1", "-n", "3", "--rounds", "2", "-q"]
COLLECTIVES = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "alltoall",
               "sendrecv"]


def bench(n: int, name: str, *args: str, check: bool = True):
    exe = mpiexec_path()
    if exe is None:
        pytest.fail("mpiexec not found: install the 'mpich' extra (pip install mpich)")
    cmd = [exe, "-n", str(n), sys.executable, str(BENCH / f"{name}.py"), *args]
    return run_cmd(cmd, timeout=120, env=base_env(), check=check)


@pytest.mark.parametrize("name", COLLECTIVES)
def test_compare_is_correct(name, tmp_path):
    out = tmp_path / "r.json"
    proc = bench(2, name, *QUICK, "--compare", "--patience", "1", "--json", str(out))
    for column in ("commlib µs", "mpi4py µs", "gloo µs", "commlib-mpi4py (µs)",
                   "commlib/mpi4py", "gloo/commlib"):
        assert column in proc.stdout, proc.stdout
    assert "# Out of bounds values : 0 OK" in proc.stdout
    assert "# slow phases: waited" in proc.stdout, proc.stdout  # the canary ran before each round
    doc = json.loads(out.read_text())
    assert [r["size"] for r in doc["rows"]] == [8, 512, 32768]
    for row in doc["rows"]:
        for impl, res in row["impls"].items():
            assert res is not None, (impl, row)
            assert res["wrong"] == 0, (impl, row)
            assert len(res["rounds_us"]) == 2 and res["median_us"] > 0
    assert doc["wrong_total"] == 0


@pytest.mark.parametrize("name", ["all_gather", "reduce_scatter", "broadcast"])
def test_compare_on_shared_buffers(name, tmp_path):
    """--shared: every buffer from commlib.shared_empty, read in place by commlib's shared-memory
    collectives (several chunks at 4 MiB), still correct for all three implementations."""
    out = tmp_path / "s.json"
    args = ["-b", "8", "-e", "4M", "-f", "512", "-w", "1", "-n", "3", "--rounds", "2", "-q"]
    proc = bench(3, name, *args, "--compare", "--shared", "--patience", "1", "--json", str(out))
    assert "buffers commlib.shared_empty" in proc.stdout, proc.stdout
    doc = json.loads(out.read_text())
    assert doc["options"]["shared"] is True
    sizes = [r["size"] for r in doc["rows"]]  # rounded to whole elements per rank
    assert len(sizes) == 3 and sizes[-1] > 2_000_000, sizes
    assert all(res["wrong"] == 0 for r in doc["rows"] for res in r["impls"].values())
    assert doc["wrong_total"] == 0


def test_table_columns_and_placements(tmp_path):
    out = tmp_path / "t.json"
    proc = bench(2, "reduce_scatter", *QUICK, "-d", "bf16", "-o", "avg", "--json", str(out))
    head = proc.stdout
    for column in ("size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong",
                   "out-of-place", "in-place", "# Avg bus bandwidth"):
        assert column in head, head
    doc = json.loads(out.read_text())
    assert doc["busbw_factor"] == 0.5 and doc["redop"] == "avg" and doc["dtype"] == "bfloat16"
    for row in doc["rows"]:
        for key in ("out_of_place", "in_place"):
            assert row[key]["wrong"] == 0 and row[key]["iters"] == 3, row
            assert row[key]["busbw"] == pytest.approx(row[key]["algbw"] * 0.5)


def test_checker_catches_a_wrong_result(tmp_path):
    out = tmp_path / "bad.json"
    proc = bench(2, "all_reduce", *QUICK, "--inject-error", "--json", str(out), check=False)
    assert proc.returncode != 0
    assert "FAILED" in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["wrong_total"] > 0
    assert all(r[k]["wrong"] > 0 for r in doc["rows"] for k in ("out_of_place", "in_place"))


def test_seq_attention_bench_runs_and_checks(tmp_path):
    """bench/seq_attention.py at 2 ranks on short sequences: every algorithm's gathered output
    matches one process, the budget search reports a reach, and each timing round passed the
    slow-phase gate."""
    out = tmp_path / "sa.json"
    proc = bench(2, "seq_attention", "-s", "256", "--rounds", "1", "--search-cap", "2",
                 "--patience", "1", "--heads", "2", "--head-dim", "16", "--json", str(out))
    assert "ring on 2 ranks:" in proc.stdout and "# slow phases: waited" in proc.stdout, proc.stdout
    rows = json.loads(out.read_text())["rows"]
    assert sorted(r["algorithm"] for r in rows) == ["ring", "rsa", "ulysses"]
    for r in rows:
        assert r["err"] < 1e-5 and r["tn_ms"] > 0 and r["t1_ms"] > 0, r


def test_tensor_parallel_2d_bench_runs_and_checks(tmp_path):
    """bench/tensor_parallel_2d.py at 2 ranks on a tiny model: every 2D and 1D row matches the
    dense model, 2D's counted bytes equal the closed form on every rank, the MLP's measured
    activation memory equals its closed form, and the JSON carries every row."""
    out = tmp_path / "tp2d.json"
    proc = bench(2, "tensor_parallel_2d", "--hidden", "32", "--batch", "4", "--seq", "8",
                 "--heads", "4", "--rounds", "1", "--patience", "0", "--json", str(out))
    assert "# wrong results: 0 OK" in proc.stdout, proc.stdout
    doc = json.loads(out.read_text())
    parts = {p["part"]: p["rows"] for p in doc["parts"]}
    assert set(parts) == {"mlp", "block"}
    for part, rows in parts.items():
        measured = [r for r in rows if r["variant"] != "compute"]
        assert {r["name"] for r in measured} >= {"2D 1x2 overlap", "2D 2x1 blocking",
                                                 "1D 2 blocking"}, rows
        for r in measured:
            assert r["error"] < 1e-4 and r["seconds"] > 0, r
            if r["scheme"] == "2d":
                assert r["bytes_sent"] == r["bytes_sent_min"] == r["bytes_sent_closed_form"], r
            if part == "mlp":
                assert r["activation_bytes"] == r["activation_closed_form"], r


def test_reshard_bench_runs_and_checks(tmp_path):
    """bench/reshard.py on tiny tensors: at 4 ranks on one host (source side ranks 0-1,
    destination 2-3) every case and implementation is exact and the counted bytes equal the
    plans'; at 2 + 2 ranks on two virtual hosts (COMMLIB_TEST_HOST) the meshes follow the host
    layout, the all-gather mode crosses the host link once (counted), naive twice, and the
    issue's checks are printed."""
    from conftest import run_mpi_hosts

    args = ["--sizes", "4K,64K", "--rounds", "1", "--patience", "0", "--time", "0.01"]
    out = tmp_path / "one.json"
    proc = bench(4, "reshard", *args, "--json", str(out))
    assert "# wrong results: 0 OK" in proc.stdout, proc.stdout
    assert "# counted bytes against the plans: ok" in proc.stdout, proc.stdout
    doc = json.loads(out.read_text())
    assert doc["hosts"] == [[0, 1, 2, 3]] and doc["source_side"] == [0, 1]
    rows = [r for p in doc["points"] for r in p["rows"]]
    assert len(rows) == 3 * 2 * 5, rows  # cases x sizes x (4 strategies + naive)
    for r in rows:
        assert r["wrong"] == 0 and r["seconds"] > 0 and r["cross_bytes"] == 0, r
        assert r["plan_bytes_ok"] is (None if r["impl"] == "naive" else True), r

    out = tmp_path / "two.json"
    proc = run_mpi_hosts(["a", "a", "b", "b"], str(BENCH / "reshard.py"), *args,
                         "--cases", "1-to-m,n-to-m-replicate", "--json", str(out), timeout=120)
    assert "# wrong results: 0 OK" in proc.stdout, proc.stdout
    assert "# issue 19, replicated on a 2-rank mesh on another host" in proc.stdout, proc.stdout
    doc = json.loads(out.read_text())
    assert doc["hosts"] == [[0, 1], [2, 3]] and doc["destination_side"] == [2, 3]
    for point in doc["points"]:
        by = {r["impl"]: r for r in point["rows"]}
        assert by["allgather"]["cross_bytes"] == point["size"], point["rows"]
        assert by["naive"]["cross_bytes"] == by["sendrecv"]["cross_bytes"] == 2 * point["size"]
        assert point["checks"]["cross_once"] is (by["auto"]["cross_bytes"] == point["size"])
        assert by["auto"]["bound_seconds"] > 0 and by["auto"]["plan_bytes_ok"] is True


def test_compress_bench_runs_and_checks():
    """bench/compress.py on small sizes at 2 ranks: the C codecs' table beside memcpy, and the
    compressed collectives beside MPI's and commlib's, with the counted wire bytes equal to the
    formula (no DIFF) and the one-host check of the automatic choice printed."""
    proc = bench(2, "compress", "--sizes", "256K", "--rounds", "1", "--iters", "1",
                 "--patience", "0", "--codecs", "int8,int4")
    text = proc.stdout
    assert "encode" in text and "memcpy" in text, text
    for name in ("int8", "int4"):
        assert re.search(rf"{name}\s+compressed \|.*\| +[0-9.]+ +ok \|", text), text
    assert "DIFF" not in text, text
    assert "on one host auto never picks a slower compression" in text, text
