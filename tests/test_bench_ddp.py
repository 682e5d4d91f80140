"""bench/ddp.py is a test too: DDP on the "commlib" backend and on gloo, at 2 ranks on tiny
models, completes, prints every configuration's row and the goal lines, and the DDP copies'
parameters agree with gloo's (#wrong 0)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from conftest import ROOT, base_env
from test_bench import bench

TINY = ["--mlp-width", "64", "--mlp-layers", "3", "--mlp-batch", "4", "--tf-dim", "32",
        "--tf-heads", "2", "--tf-layers", "1", "--tf-seq", "8", "--tf-batch", "2",
        "--rounds", "2", "--steps", "1", "--warmup", "3", "--patience", "1"]


def test_ddp_bench_runs_and_checks(tmp_path):
    out = tmp_path / "ddp.json"
    proc = bench(2, "ddp", *TINY, "--json", str(out))
    text = proc.stdout
    assert "# wrong parameters" in text and ": 0 OK" in text, text
    for line in ("# goal: commlib >= 1.5x faster than gloo", "# goal: not slower than gloo",
                 "# goal: on the vcluster >= 60% hidden: n/a (one host)", "# slow phases: waited"):
        assert line in text, text
    assert re.search(r"# goal: not slower than gloo anywhere: worst gloo/commlib [0-9.]+x "
                     r"\(\w+ [\w-]+, faster than gloo in [0-2] of 2 rounds, slower in [0-2]: "
                     r"sign test p [0-9.]+\) (PASS|TIE|MISS)", text), text
    doc = json.loads(out.read_text())
    assert doc["nranks"] == 2 and doc["hosts"] == 1 and doc["wrong_total"] == 0
    assert [m["model"] for m in doc["models"]] == ["mlp", "transformer"]
    for model in doc["models"]:
        rows = {r["config"]: r for r in model["rows"]}
        assert {"commlib", "commlib-avg", "mpi", "gloo", "compute"} <= set(rows), rows
        if "commlib-tuned" not in rows:  # left out only where commlib proposes no buckets
            assert "left out" in model["tuned"], model["tuned"]
        for name, r in rows.items():
            assert f"  {name:>17} | " in text, (name, text)
            assert len(r["rounds_s"]) == 2 and r["step_s"] > 0, r
            assert 0 < r["backward_s"] < max(r["rounds_s"]), r  # a part of the step
            if name == "compute":
                assert r["wrong"] is None and r["hidden"] is None and not r["buckets"], r
                assert r["hidden_bound"] is None and r["behind"] is None, r
                assert 0 <= r["exposed_s"] < r["backward_s"], r
            else:
                assert r["wrong"] == 0 and 0 <= r["hidden"] <= 1, r
                # behind the backward only where the all-reduces run beside it: gloo's always
                assert r["asynchronous"] or not name.startswith("gloo"), r
                assert (r["behind"] is None) == (not r["asynchronous"]), r
                assert r["behind"] is None or 0 <= r["behind"] <= 1, r
                # the time after the last gradient is a part of the backward
                assert 0 <= r["exposed_s"] <= r["backward_s"], r
                # one bucket is ready only when the backward ends: nothing of it can hide
                assert 0 <= r["hidden_bound"] <= 1, r
                assert (r["hidden_bound"] == 0) == (len(r["buckets"]) == 1), r
                # DDP's rebuilt buckets hold every gradient once (bytes, float32)
                assert sum(r["buckets"]) == 4 * model["params"], r
                assert len(r["comm_rounds_s"]) == 2 and r["comm_alone_s"] > 0, r


def test_ddp_bench_runs_the_rows_asked_for():
    """``--rows``: only those DDP configurations, beside the references gloo and compute, and
    ``gloo-tuned`` (gloo with commlib's proposed buckets) only when asked for; a row that does
    not exist is refused, naming the ones that do."""
    proc = bench(2, "ddp", "--models", "mlp", *TINY, "--rows", "commlib-tuned-avg,gloo-tuned")
    rows = [line.split("|")[0].strip() for line in proc.stdout.splitlines()
            if "|" in line and not line.startswith("#")]
    assert rows == ["commlib-tuned-avg", "gloo", "gloo-tuned", "compute"], proc.stdout
    buckets = dict(re.findall(r"^#\s+(\S+) buckets: (.*)$", proc.stdout, re.M))
    assert buckets["gloo-tuned"] == buckets["commlib-tuned-avg"], proc.stdout
    assert ": 0 OK" in proc.stdout, proc.stdout  # gloo-tuned's parameters checked like the rest
    bad = bench(2, "ddp", "--models", "mlp", *TINY, "--rows", "commlib,nccl", check=False)
    assert bad.returncode == 2 and "--rows takes commlib, commlib-tuned" in bad.stderr, bad.stderr
    assert "gloo-tuned" in bad.stderr, bad.stderr


def test_ddp_bench_device_waits_lengthen_the_backward_only(tmp_path):
    """``--device-ms``: the backward waits that long in all, with the CPU free (the compute row's
    backward takes at least as long as the waits, where these tiny models compute it in about a
    millisecond), every module with parameters gets its share (the header counts them: the
    transformer's attention, its two linears, two norms and the head), and the parameters still
    agree with gloo's."""
    out = tmp_path / "ddp.json"
    proc = bench(2, "ddp", "--models", "transformer", *TINY, "--rows", "commlib-tuned",
                 "--device-ms", "40", "--json", str(out))
    assert "the backward waits 40 ms with the CPU free, over 6 modules" in proc.stdout, proc.stdout
    assert ": 0 OK" in proc.stdout, proc.stdout
    rows = {r["config"]: r for r in json.loads(out.read_text())["models"][0]["rows"]}
    assert rows["compute"]["backward_s"] >= 0.040, rows["compute"]
    assert rows["gloo"]["backward_s"] >= 0.040, rows["gloo"]


def test_ddp_trace_reports_each_configuration():
    """bench/ddp_trace.py at 2 ranks on tiny models: a row per configuration (commlib's
    compressed hook too) whose times are consistent (the backward and the tail fit in the step,
    the last bucket's all-reduce within the step), DDP rows with buckets and an overlapped share,
    the compute row with none, and each DDP row's steps paired with gloo's."""
    tiny = TINY[:TINY.index("--rounds")]  # the models' options; the trace has no rounds
    proc = bench(2, "ddp_trace", "--models", "mlp,transformer", *tiny, "--steps", "2", "--int8")
    names = ["commlib", "int8", "int8-call", "gloo", "compute"]
    rows = [line.split("|") for line in proc.stdout.splitlines()
            if line.strip().split(" ")[0] in names]
    assert [r[0].strip() for r in rows] == names * 2, proc.stdout
    for name, step, cpu, backward, tail, last, overlapped, buckets in ([c.strip() for c in r]
                                                                       for r in rows):
        step, backward, tail = float(step), float(backward), float(tail)
        assert 0 < backward and 0 <= tail and backward + tail <= step, (name, proc.stdout)
        assert float(cpu) > 0, (name, proc.stdout)  # the step computed: it took CPU time
        if name == "compute":
            assert overlapped == last == "-" and buckets == "0" and tail == 0, proc.stdout
        else:
            assert 0 <= int(overlapped.rstrip("%")) <= 100 and int(buckets) >= 1, proc.stdout
            assert 0 < float(last) < step, (name, proc.stdout)
    for model in ("mlp", "transformer"):  # the steps' pairs with gloo's, one line per DDP row
        for name in ("commlib", "int8", "int8-call"):
            assert f"# {model} {name}: gloo/{name} step median " in proc.stdout, proc.stdout
            assert f"{name} faster in " in proc.stdout and " of 2 steps" in proc.stdout


def test_ddp_trace_with_ddps_default_buckets_and_a_bad_size():
    """``--bucket-cap-mb ddp``: DDP's own buckets (the header says so, and on these tiny models
    every gradient fits DDP's first bucket: one); ``--threads``: each row's CPU by thread, the
    caller's on every rank, and the caller's preemptions; a size that is not above 0 is refused."""
    tiny = TINY[:TINY.index("--rounds")]
    proc = bench(2, "ddp_trace", "--models", "mlp", *tiny, "--steps", "1", "--bucket-cap-mb", "ddp",
                 "--threads")
    assert "bucket_cap_mb DDP default" in proc.stdout, proc.stdout
    for name in ("commlib", "gloo", "compute"):
        line = next(l for l in proc.stdout.splitlines() if l.startswith(f"# {name} threads"))
        main = re.search(r"main (\d+\.\d)/(\d+\.\d)(;|$)", line)
        assert main and float(main[1]) > 0 and float(main[2]) > 0, line
        line = next(l for l in proc.stdout.splitlines()
                    if l.startswith(f"# {name} main thread preempted"))
        assert re.search(r"rank\): \d+(\.\d+)?/\d+(\.\d+)?$", line), line
    rows = {line.split("|")[0].strip(): line.split("|") for line in proc.stdout.splitlines()
            if "|" in line and not line.startswith("#")}
    assert rows["commlib"][-1].strip() == "1" and rows["gloo"][-1].strip() == "1", proc.stdout
    bad = bench(2, "ddp_trace", "--models", "mlp", *tiny, "--bucket-cap-mb", "0", check=False)
    assert bad.returncode == 2 and "--bucket-cap-mb a number of MiB above 0" in bad.stderr, \
        bad.stderr


@pytest.mark.parametrize("off,suffix", [("idle", "-noidle"), ("nap", "-spin")])
def test_ddp_pace_ab_runs_each_commlib_row_twice(off, suffix):
    """bench/ddp_pace_ab.py: each commlib row asked for and its twin with the rule ``--off`` in
    the same rounds, both checked against gloo, and one paired line per twin."""
    proc = bench(2, "ddp_pace_ab", "--models", "mlp", *TINY, "--rows", "commlib,commlib-avg",
                 "--off", off)
    rows = [line.split("|")[0].strip() for line in proc.stdout.splitlines()
            if "|" in line and not line.startswith("#")]
    assert rows == ["commlib", "commlib-avg", "gloo", "compute", "commlib" + suffix,
                    "commlib-avg" + suffix], proc.stdout
    assert ": 0 OK" in proc.stdout, proc.stdout
    for name in ("commlib", "commlib-avg"):
        assert f"# mlp {name}: {suffix[1:]}/{off} median " in proc.stdout, proc.stdout
        assert f"{off} faster in " in proc.stdout and " of 2 rounds" in proc.stdout, proc.stdout


def test_wait_cpu_gives_each_row_its_wall_and_cpu_time():
    """bench/wait_cpu.py: gloo, commlib and commlib with the endless spin, blocking and
    asynchronous, each with a wall and a CPU time per iteration, and each commlib row against
    gloo's."""
    proc = bench(2, "wait_cpu", "--sizes", "0.25,0.5", "--iters", "1", "--rounds", "2")
    table = {line.split("|")[0].strip(): [float(x) for x in line.split("|")[1:]]
             for line in proc.stdout.splitlines() if "|" in line and not line.startswith("#")}
    assert list(table) == [f"{name}-{how}" for name in ("gloo", "commlib", "commlib-spin")
                           for how in ("blocking", "async")], proc.stdout
    for name, (wall, cpu, share) in table.items():
        assert wall > 0 and cpu >= 0, (name, proc.stdout)
        # the share comes from the unrounded times: within what rounding to 0.01 ms allows
        low, high = (cpu - 0.005) / (wall + 0.005), (cpu + 0.005) / max(wall - 0.005, 1e-9)
        assert low - 0.005 <= share <= high + 0.005, (name, proc.stdout)
    for name in list(table)[2:]:
        assert f"# {name}: CPU " in proc.stdout and "x gloo's, wall " in proc.stdout, proc.stdout


def test_ddp_bench_goal_lines_across_hosts():
    """bench/ddp.py's goal lines for a run across hosts (its ``goals``, on rows given here): the
    hidden share is judged on the rows with commlib's proposed buckets, each with its bound, in
    both measures (the step time saved, and the share not after the backward's compute); the
    rows with DDP's default buckets are shown beside, unjudged (their last bucket is issued when
    the backward ends); the worst commlib row against gloo decides "not slower": below 1 it is
    a TIE unless the rounds' sign test says slower (p < 0.05), then a MISS naming the rows."""
    def row(config, ratio, hidden, behind, bound, rounds):
        return {"config": config, "gloo_over_this": ratio, "hidden": hidden, "behind": behind,
                "hidden_bound": bound, "rounds_s": rounds}

    def goals(rows):
        code = ("import json, sys; sys.path.insert(0, 'bench'); import ddp; "
                f"print(json.dumps(ddp.goals([{{'model': 'transformer', 'rows': {rows!r}}}], 2)))")
        proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                              text=True, timeout=120, env=base_env())
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout.strip().splitlines()[-1])

    gloo = [0.2] * 6
    rows = [row("commlib", 1.01, 0.05, 0.09, 0.1, [0.19] * 6),
            row("commlib-tuned", 1.3, 0.75, 0.9, 0.94, [0.15] * 6),
            # faster in 2 rounds, slower in 3, one equal: p = P(at least 3 of 5) = 0.5
            # its bound below the goal: no backend can meet it there (a short backward)
            row("commlib-tuned-avg", 0.98, 0.55, 0.8, 0.54, [0.19, 0.19, 0.2, 0.21, 0.21, 0.21]),
            row("gloo", 1.0, 0.02, 0.08, 0.1, gloo)]
    lines = goals(rows)
    assert lines[0].endswith("n/a (across hosts)"), lines
    assert lines[1] == ("# goal: not slower than gloo anywhere: worst gloo/commlib 0.980x "
                        "(transformer commlib-tuned-avg, faster than gloo in 2 of 6 rounds, "
                        "slower in 3: sign test p 0.50) TIE"), lines
    assert lines[2] == ("# goal: on the vcluster >= 60% hidden (commlib's proposed buckets; of the "
                        "step / behind the backward): transformer commlib-tuned 75.0% PASS / "
                        "90.0% PASS (bound 94%), transformer commlib-tuned-avg 55.0% MISS / "
                        "80.0% PASS (bound 54%: no backend can)"), lines
    assert lines[3] == ("#   DDP's default buckets (the last one issued when the backward ends): "
                        "transformer commlib 5.0% / 9.0% (bound 10%)"), lines
    # slower in every one of 6 rounds: p = 1/64, a MISS; every row at 1 or above: a PASS
    rows[1].update(gloo_over_this=0.99, rounds_s=[0.21] * 6)
    assert goals(rows)[1] == (
        "# goal: not slower than gloo anywhere: worst gloo/commlib 0.980x (transformer "
        "commlib-tuned-avg, faster than gloo in 2 of 6 rounds, slower in 3: sign test p 0.50) "
        "MISS (slower: transformer commlib-tuned)")
    for r in rows:
        r.update(gloo_over_this=max(1.0, r["gloo_over_this"]), rounds_s=gloo)
    assert goals(rows)[1] == (
        "# goal: not slower than gloo anywhere: worst gloo/commlib 1.000x (transformer "
        "commlib-tuned, faster than gloo in 0 of 6 rounds, slower in 0: sign test p 1.00) PASS")
