"""The 1D-vs-2D tensor-parallel planner (commlib.nn.tp_plan): closed forms checked against values
worked out by hand, the pricing of a schedule, the crossover, the errors and the command. Pure: no
ranks are started."""

import re
import sys

import pytest

from commlib.errors import CommArgumentError, CommError
from commlib.nn.tp_plan import (Prediction, Row, block_schedule, catalog_machine, compare,
                                crossover, local_machine, main, measure_gflops, mlp_schedule,
                                predict_block, predict_mlp, square_mesh, summa_panels)
from commlib.tuning import calibration
from commlib.tuning.model import LinkCost
from conftest import run_cmd


def free(*_):
    return 0.0


def sent(stages, layer=None, phase=None):
    return sum(c.sent for st in stages if layer in (None, st.layer) and phase in (None, st.phase)
               for c in st.pipelined + st.exposed)


@pytest.fixture(scope="module")
def v100_64():
    return catalog_machine("dgx1-v100", 8)


# ---- closed forms, by hand ---------------------------------------------------------------

def test_linear2d_bytes_by_hand():
    # r = c = 2, T = 8, in = 4, out = 6, s = 4 (fc1 of an MLP H=4 -> F=6)
    st = mlp_schedule(8, 4, 6, mesh=(2, 2), dtype_bytes=4)
    # forward: s·[(c-1)·T·in/(r·c) + (r-1)·in·out/(r·c)] = 4·[8·4/4 + 4·6/4] = 4·(8 + 6)
    assert sent(st, "fc1", "forward") == 56
    # backward: twice that + the bias all-reduce of out/c = 3 floats over r = 2: 2·1/2·12 = 12
    assert sent(st, "fc1", "backward") == 112 + 12
    # fc2 = Linear2D(6, 4): 4·[8·6/4 + 6·4/4] = 72 forward; 144 + all-reduce of 2 floats (8) back
    assert sent(st, "fc2", "forward") == 72
    assert sent(st, "fc2", "backward") == 144 + 8
    fwd = {s.layer: s for s in st if s.phase == "forward"}
    assert fwd["fc1"].flops == 2 * 8 * 4 * 6 // 4 == 96       # 2·T·in·out/(r·c)
    assert [s.flops for s in st if s.layer == "fc1" and s.phase == "backward"] == [192]
    # panels = lcm(2, 2) = 2: X panels of (T/r x in/2) = 4 x 2 floats, W panels 2 x 3 floats
    two = {s.layer: s for s in mlp_schedule(8, 4, 6, mesh=(2, 2), dtype_bytes=4, panels=2)
           if s.phase == "forward"}
    bx, bw = two["fc1"].pipelined
    assert (bx.collective, bx.axis, bx.nbytes, bx.count) == ("broadcast", "row", 32, 2)
    assert (bw.collective, bw.axis, bw.nbytes, bw.count) == ("broadcast", "col", 24, 2)
    # the layers' default: lcm(2, 2) = 2 panels; the bytes do not depend on the panels
    assert [c.count for c in fwd["fc1"].pipelined + fwd["fc2"].pipelined] == [2, 2, 2, 2]
    assert fwd["fc1"].pipelined[0].nbytes == 32
    wide = dict(mesh=(2, 2), dtype_bytes=4)  # 12 features: 2, 4 or 6 panels
    assert len({sent(mlp_schedule(8, 12, 24, panels=k, **wide)) for k in (2, 4, 6)}) == 1
    p = predict_mlp(8, 4, 6, mesh=(2, 2), dtype_bytes=4, comm=free, gflops=1.0)
    assert p.bytes_sent == 56 + 124 + 72 + 152 == 404
    # saved: X block 4x2 (fc1 input) + GELU input 4x3 + fc2 input 4x3 = 32 floats
    assert p.activation_bytes == 32 * 4
    assert isinstance(p.bytes_sent, int) and isinstance(p, Prediction)


def test_megatron_mlp_by_hand():
    # p = 4, T = 8, H = 4, F = 8, s = 4: two all-reduces of T·H·s = 128 bytes, 2·3/4·128 each
    p = predict_mlp(8, 4, 8, p=4, dtype_bytes=4, comm=free, gflops=1.0)
    assert p.bytes_sent == 2 * 192
    assert p.activation_bytes == (8 * 4 + 2 * 8 * 8 // 4) * 4  # T·H + 2·T·F/p
    # the all-reduce is floored per call, as the layers' traffic counter does: 2·2/3·10 = 13.33
    q = predict_mlp(5, 2, 3, p=3, dtype_bytes=1, comm=free, gflops=1.0)
    assert q.bytes_sent == 2 * 13


def test_block_bytes_and_memory_by_hand():
    # r = c = 2, batch 2, seq 4 (T = 8), H = 4, heads 2, F = 8, s = 4
    st = block_schedule(2, 4, 4, 8, 2, mesh=(2, 2), dtype_bytes=4)
    # LayerNorm2D: all-gather of 3 floats per local token (c-1)·3·(T/r)·4 = 48 forward; back an
    # all-reduce of those 32 bytes over the row (32) and of gamma+beta (2·H/c·s = 16) over the column
    assert sent(st, "ln1", "forward") == 48 and sent(st, "ln1", "backward") == 32 + 16
    # qkv = Linear2D(4, 12): 4·(8 + 12) = 80 forward, 160 + bias 6 floats (24) backward
    assert sent(st, "qkv") == 80 + 160 + 24
    assert sent(st, "proj") == 48 + 96 + 8          # Linear2D(4, 4)
    assert sent(st, "fc1") == 64 + 128 + 16         # Linear2D(4, 8)
    assert sent(st, "fc2") == 96 + 192 + 8          # Linear2D(8, 4)
    assert sent(st, "attention") == 0               # rows hold whole sequences: local
    assert sent(st) == 2 * (48 + 48) + 264 + 152 + 208 + 296 == 1112
    # saved: 8·T·H/p + 2·T·F/p + B·heads·S·S/p = 64 + 32 + 2·2·16/4 floats
    with_scores = predict_block(2, 4, 4, 8, 2, mesh=(2, 2), dtype_bytes=4, comm=free, gflops=1.0)
    flash = predict_block(2, 4, 4, 8, 2, mesh=(2, 2), dtype_bytes=4, comm=free, gflops=1.0,
                          attention_scores=False)
    assert with_scores.activation_bytes == (64 + 32 + 16) * 4
    assert flash.activation_bytes == (64 + 32) * 4
    # 1D over 2: four all-reduces of T·H·s = 128 bytes (2·1/2·128 each); saved 4·T·H + 4·T·H/p
    # + 2·T·F/p + A/p = 128 + 64 + 64 + 32 floats
    one = predict_block(2, 4, 4, 8, 2, p=2, dtype_bytes=4, comm=free, gflops=1.0)
    assert one.bytes_sent == 4 * 128
    assert one.activation_bytes == (128 + 64 + 64 + 32) * 4
    # layers multiply everything
    three = predict_block(2, 4, 4, 8, 2, p=2, dtype_bytes=4, comm=free, gflops=1.0, layers=3)
    assert (three.bytes_sent, three.activation_bytes) == (3 * one.bytes_sent, 3 * one.activation_bytes)


# ---- pricing -------------------------------------------------------------------------------

def test_time_with_and_without_overlap():
    ms = lambda *_: 1e-3  # noqa: E731 - every collective 1 ms
    # MLP 2x2, T=8, H=4, F=6: 576 flops in all at 1000 flops/s; per linear: forward 2 panels of
    # 2 broadcasts, backward 2 panels of 2 broadcasts + 2 reduces, and the bias all-reduce
    kw = dict(mesh=(2, 2), dtype_bytes=4, comm=ms, panels=2)
    plain = predict_mlp(8, 4, 6, gflops=1e-6, overlap=False, **kw)
    assert plain.compute_seconds == pytest.approx(0.576)
    assert plain.comm_seconds == pytest.approx(2 * (4 + 8 + 1) * 1e-3)
    assert plain.seconds == pytest.approx(0.576 + 0.026)
    # GEMM-bound: each layer's first panel's broadcasts forward, its first X broadcast and last
    # dX reduce backward (W's broadcast and dW's reduce hide behind the dW and dX GEMM halves),
    # and the bias all-reduce show
    hidden = predict_mlp(8, 4, 6, gflops=1e-6, overlap=True, **kw)
    assert hidden.comm_seconds == plain.comm_seconds
    assert hidden.seconds == pytest.approx(0.576 + 2 * (2e-3 + 2e-3 + 1e-3))
    # comm-bound: forward P + (L-1)·P + G per layer, backward L·P (W's broadcast and dW's reduce
    # cover its GEMM halves): all of the communication shows, and only the forward GEMMs
    # (96 flops per layer's panel) add to it
    fast = predict_mlp(8, 4, 6, gflops=1.0, overlap=True, **kw)
    assert fast.seconds - 0.026 == pytest.approx(2 * 48e-9)
    # busy: a collective beside a GEMM slows it by its busy share. All 1 (the cores copy):
    # nothing hides; columns 0.5, rows 0 (GEMM-bound): forward 2 + 0.5 ms a layer (the second
    # panel's column broadcast takes half its time from the GEMM), backward bx + 0.5 (W's
    # broadcast beside the dW half) + rx + 0.5 (dW's reduce beside the dX half) + 0.5 + 0.5 (the
    # second panel's W broadcast and dW reduce beside its GEMMs) = 4 ms, and the bias 1 ms
    assert predict_mlp(8, 4, 6, gflops=1e-6, busy=lambda *_: 1.0, **kw).seconds == \
        pytest.approx(plain.seconds)
    cols = predict_mlp(8, 4, 6, gflops=1e-6, busy=lambda size, stride: 0.5 * (stride > 1), **kw)
    assert cols.seconds == pytest.approx(0.576 + 2 * (2.5e-3 + 4e-3 + 1e-3))
    # 1D has nothing to overlap
    a = predict_mlp(8, 4, 8, p=4, dtype_bytes=4, comm=ms, gflops=1e-6, overlap=True)
    b = predict_mlp(8, 4, 8, p=4, dtype_bytes=4, comm=ms, gflops=1e-6, overlap=False)
    # two all-reduces; two layers of 2·T·H·F/p flops forward and twice that backward
    assert a == b and a.seconds == pytest.approx(2e-3 + 2 * 3 * (2 * 8 * 4 * 8 / 4) / 1e3)


def test_collectives_priced_on_the_right_groups():
    calls = []

    def comm(collective, nbytes, size, stride):
        calls.append((collective, nbytes, size, stride))
        return 0.0

    # mesh 4x2: rows of c = 2 consecutive ranks, columns of r = 4 ranks c = 2 apart
    predict_block(4, 2, 8, 16, 2, mesh=(4, 2), dtype_bytes=2, comm=comm, gflops=1.0)
    groups = {(c, size, stride) for c, _, size, stride in calls}
    assert ("broadcast", 2, 1) in groups and ("broadcast", 4, 2) in groups
    assert ("reduce", 2, 1) in groups and ("reduce", 4, 2) in groups
    # the all-gather is priced at its whole output: c · 3 float32 · T/r tokens = 2·12·2 bytes
    assert ("all_gather", 2 * 12 * 2, 2, 1) in calls
    calls.clear()
    predict_mlp(16, 8, 16, p=8, dtype_bytes=2, comm=comm, gflops=1.0)
    assert calls == [("all_reduce", 16 * 8 * 2, 8, 1)] * 2


# ---- 1D against 2D -------------------------------------------------------------------------

def test_2x2_sends_more_than_1d_and_8x8_sends_less_from_some_batch():
    small = [predict_mlp(t, 1024, 4096, mesh=(2, 2), comm=free, gflops=1.0).bytes_sent
             - predict_mlp(t, 1024, 4096, p=4, comm=free, gflops=1.0).bytes_sent
             for t in (64, 256, 1024, 4096, 16384)]
    # 2x2 sends 3·s·[T(H+F)/4 + H·F/2] + ..., 1D 3·s·T·H: with F = 4H, more at every T
    assert all(d > 0 for d in small)
    rows = compare([1, 2, 4, 8, 16, 32], seq=2048, hidden=4096, ffn=16384, mesh=(8, 8),
                   model="mlp", comm=free, gflops=1.0)
    more = [r.two_d.bytes_sent > r.one_d.bytes_sent for r in rows]
    assert more[0] and not more[-1]
    assert more == sorted(more, reverse=True)  # once 2D sends less it keeps sending less


def test_8x8_overtakes_64_from_some_batch_on_the_v100_cluster(v100_64):
    rows = compare([8, 16, 32, 64, 128, 256, 512, 1024], seq=2048, hidden=4096, ffn=16384,
                   heads=64, mesh=(8, 8), comm=v100_64.collective_seconds, gflops=v100_64.gflops)
    found = crossover(rows)
    assert found is not None
    # monotone: 1D wins every batch below the crossover, 2D every batch from it
    k = rows.index(found)
    assert all(r.winner() == "1D" for r in rows[:k]) and all(r.winner() == "2D" for r in rows[k:])
    gap = [r.one_d.seconds - r.two_d_overlap.seconds for r in rows]
    assert gap == sorted(gap)
    # overlap never makes 2D slower, and 2D always keeps fewer activations
    assert all(r.two_d_overlap.seconds <= r.two_d.seconds for r in rows)
    assert crossover(rows, metric="activation_bytes") is rows[0]


def test_crossover_is_none_when_2d_never_stays_ahead():
    one = Prediction(1.0, 0.5, 0.5, 10, 10)
    win, lose = Prediction(0.5, 0.1, 0.4, 5, 5), Prediction(2.0, 1.5, 0.5, 20, 20)
    rows = [Row(1, 8, one, lose, lose), Row(2, 16, one, win, win), Row(4, 32, one, lose, lose)]
    assert crossover(rows) is None
    rows.append(Row(8, 64, one, win, win))
    assert crossover(rows).batch == 8
    assert crossover([Row(1, 8, one, None, None), Row(2, 16, one, win, win)]).batch == 2


def test_summa_panels():
    # the layers' default (commlib/nn/_summa.py uses this function)
    # lcm(r, c), unless asked for more
    assert summa_panels(2, 2, 4) == 2 and summa_panels(2, 3, 6) == 6
    assert summa_panels(8, 8, 4096) == 8 and summa_panels(2, 1, 8) == 2
    assert summa_panels(3, 1, 9) == 3 and summa_panels(4, 2, 8, panels=8) == 8


def test_square_mesh():
    assert [square_mesh(p) for p in (4, 64, 128, 6, 7)] == [(2, 2), (8, 8), (16, 8), (3, 2), (7, 1)]


# ---- machines ------------------------------------------------------------------------------

def test_catalog_groups_share_the_hosts_rails(v100_64):
    from commlib.tuning.machine import plan_machine
    plan = plan_machine("dgx1-v100", 8)
    row = v100_64.table_of(8, 1)               # a mesh row: one host
    assert row.inter is None and row.link == plan.table.link
    whole = v100_64.table_of(64, 1)            # the 1D group: one ring over every host
    assert whole.inter == plan.table.inter and whole.local == 8
    col = v100_64.table_of(8, 8)               # a mesh column: one rank per host, 8 crossing at once
    assert col.local == 1
    assert 1 / col.inter.beta / 1e9 == pytest.approx(plan.rails * plan.rail_gbps / 8)
    assert v100_64.gflops == pytest.approx(0.7 * 125e3)  # V100 fp16, the assumed efficiency
    assert v100_64.busy_share(8, 1) == v100_64.busy_share(8, 8) == 0.0  # GPUs copy by DMA
    assert v100_64.collective_seconds("broadcast", 1 << 20, 8, 8) > \
        v100_64.collective_seconds("broadcast", 1 << 20, 8, 1)


def test_local_machine_from_a_tuning_file(tmp_path):
    path = tmp_path / "tuning.json"
    shm, net, rails = LinkCost(5e-6, 1e-9, 1e-10), LinkCost(3e-5, 1e-8), LinkCost(3e-5, 2e-8)
    calibration.save_entry(path, "mpi/2", {"shm": shm}, {})
    calibration.save_entry(path, "mpi/4@2", {"shm": shm, "net": net, "net_rails": rails}, {})
    m = local_machine(path, "mpi", 4, 2, gflops=10.0)
    assert m.hides_comm and m.gflops == 10.0
    assert m.table_of(4, 1).inter == net                   # the 1D group: its own entry
    assert m.table_of(2, 1).inter is None                  # a mesh row: one host, mpi/2
    col = m.table_of(2, 2)                                 # a column: both hosts' ranks cross
    assert col.inter == rails and col.local == 1 and col.link == shm
    assert not local_machine(path, "mpi", 2, 1, gflops=10.0).hides_comm
    # what a GEMM beside a collective loses: all of a copy inside a host, the link's busy across
    assert m.busy_share(2, 1) == 1.0 and m.busy_share(2, 2) == 0.0
    calibration.save_entry(path, "mpi/4@2", {"net": net, "net_rails": LinkCost(3e-5, 2e-8, busy=0.3)},
                           {})
    assert local_machine(path, "mpi", 4, 2, gflops=10.0).busy_share(2, 2) == 0.3
    with pytest.raises(CommError, match="no entry for engine 'gloo'"):
        local_machine(path, "gloo", 4, 2, gflops=1.0).table_of(4, 1)
    with pytest.raises(CommError, match="does not exist"):
        local_machine(tmp_path / "missing.json", "mpi", 4, 2, gflops=1.0)


def test_rails_come_from_an_entry_with_the_jobs_ranks_per_host(tmp_path):
    """``net_rails`` is the host's link shared by its ranks' streams: a column group of a 4-rank,
    2-host job (its own shape mpi/2@2, one rank per host: no sharing there) takes the rails of
    mpi/4@2, and ``net`` (one pair crossing) from its own entry."""
    path = tmp_path / "tuning.json"
    one, two = LinkCost(2e-5, 8e-9), LinkCost(2e-5, 1.6e-8, busy=0.25)
    calibration.save_entry(path, "mpi/2", {"shm": LinkCost(5e-6, 1e-9, 1e-10)}, {})
    calibration.save_entry(path, "mpi/2@2", {"net": one, "net_rails": one}, {})
    calibration.save_entry(path, "mpi/4@2", {"net": one, "net_rails": two}, {})
    col = local_machine(path, "mpi", 4, 2, gflops=10.0).table_of(2, 2)
    assert col.inter == two and col.shard_inter == two
    assert local_machine(path, "mpi", 2, 2, gflops=10.0).table_of(2, 1).inter == one
    assert calibration.load(path)["groups"]["mpi/4@2"]["links"]["net_rails"]["busy"] == 0.25
    assert "busy" not in calibration.load(path)["groups"]["mpi/2@2"]["links"]["net"]


def test_measure_gflops():
    assert measure_gflops() > 0


# ---- errors --------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, arg, text", [
    (dict(p=8, mesh=(2, 2)), "mesh", "has r*c = 4 ranks but p = 8"),
    (dict(mesh=(2, 3), tokens=12, hidden=10), "hidden", "multiple of 6"),
    (dict(mesh=(4, 2), tokens=6), "tokens", "multiple of 4"),
    (dict(p=3, ffn=8), "ffn", "multiple of 3"),
    (dict(), "p", "neither p nor mesh"),
    (dict(mesh=(2, 2), gflops=0), "gflops", "positive"),
    (dict(mesh=(2, 2), tokens=0), "tokens", "positive"),
    (dict(mesh=(2, 2), panels=3), "panels", "multiple of 2"),
    (dict(mesh=(2, 2), panels=8), "panels", "does not divide hidden = 12"),
])
def test_errors_name_the_argument_and_the_fix(kwargs, arg, text):
    args = dict(tokens=8, hidden=12, ffn=24, comm=free, gflops=1.0) | kwargs
    with pytest.raises(CommError) as info:
        predict_mlp(args.pop("tokens"), args.pop("hidden"), args.pop("ffn"), **args)
    msg = str(info.value)
    assert f"argument '{arg}'" in msg and text in msg and "Fix:" in msg


def test_block_errors():
    with pytest.raises(CommArgumentError, match="argument 'heads'.*multiple of 4"):
        predict_block(2, 4, 16, 32, 2, p=4, comm=free, gflops=1.0)
    with pytest.raises(CommArgumentError, match="argument 'batch'.*multiple of 2"):
        predict_block(3, 4, 16, 32, 4, mesh=(2, 2), comm=free, gflops=1.0)
    with pytest.raises(CommArgumentError, match="argument 'gflops'"):
        catalog_machine("pcie-2xk80")
    with pytest.raises(CommArgumentError, match="argument 'dtype'.*V100 has no bf16"):
        catalog_machine("dgx1-v100", dtype="bf16")
    with pytest.raises(CommArgumentError, match="argument 'metric'"):
        crossover([], metric="bytes")


# ---- the command ---------------------------------------------------------------------------

def test_command_on_the_catalog():
    proc = run_cmd([sys.executable, "-m", "commlib.nn.tp_plan", "--topology", "dgx1-v100",
                    "--nodes", "8", "--hidden", "4096", "--ffn", "16384", "--seq", "2048",
                    "--batch", "8,16,...,1024"], timeout=120)
    assert re.search(r"^2D 8x8 overtakes 1D p=64 from batch \d+ \(tokens \d+\)$", proc.stdout,
                     re.M), proc.stdout
    assert "needs less activation memory than 1D p=64 from batch 8 (tokens 16384)" in proc.stdout
    assert len([ln for ln in proc.stdout.splitlines() if re.match(r"\s+\d+\s+\d+\s", ln)]) == 8


def test_command_on_this_machine(tmp_path):
    path = tmp_path / "tuning.json"
    calibration.save_entry(path, "mpi/2", {"shm": LinkCost(5e-6, 1e-9, 1e-10)}, {})
    proc = run_cmd([sys.executable, "-m", "commlib.nn.tp_plan", "--local", "--tuning-file",
                    str(path), "--ranks", "2", "--gflops", "10", "--model", "mlp", "--hidden",
                    "256", "--seq", "64", "--batch", "1,4,16", "--mesh", "2x1,1x2"], timeout=120)
    assert proc.stdout.count("overtakes (no overlap possible here)") == 2, proc.stdout


@pytest.mark.parametrize("argv, text", [
    (["--topology", "dgx1-v100", "--nodes", "8", "--mesh", "4x4"], "argument 'mesh'"),
    (["--topology", "dgx1-v100", "--ranks", "16"], "argument 'ranks'"),
    (["--topology", "pcie-2xk80"], "argument 'gflops'"),
    (["--local", "--tuning-file", "/nonexistent/tuning.json", "--ranks", "2", "--gflops", "1"],
     "does not exist"),
])
def test_command_errors_exit_2(argv, text, capsys):
    assert main(argv + ["--hidden", "4096", "--seq", "2048", "--batch", "8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and text in err and "Fix:" in err
