"""The α-β-γ formulas of commlib/tuning/model.py against values worked out by hand from the step
structure of each algorithm (commlib/algorithms/), and the measured-curve interpolation."""

import math

import pytest

from commlib.tuning.model import Curve, LinkCost, Table, cost_names, predict

# α = 1 s, β = 1 ms/B, γ = 0.1 ms/B: each term is visible in the total.
LINK = LinkCost(alpha=1.0, beta=1e-3, gamma=1e-4)
N = 1200


def by_name(collective, p, n=N, table=None):
    return {x.algorithm: x.seconds for x in predict(collective, n, p, table or Table(LINK))}


def test_all_reduce_at_four_ranks():
    t = by_name("all_reduce", 4)
    # ring: 6 steps; 3/4 of the buffer out twice (RS + AG); 3/4 of it reduced
    assert t["ring"] == pytest.approx(6 + 2 * 900 * 1e-3 + 900 * 1e-4)
    # recursive doubling: 2 steps, whole buffer sent and reduced each time
    assert t["recursive_doubling"] == pytest.approx(2 * (1 + 1.2 + 0.12))
    # Rabenseifner: 4 steps; halves 600+300 out in RS, 300+600 in AG; 600+300 reduced
    assert t["rabenseifner"] == pytest.approx(4 + 1.8 + 0.09)
    # binomial: reduce (2 levels) + broadcast (2 levels), whole buffer each step
    assert t["binomial"] == pytest.approx(4 * (1 + 1.2) + 2 * 0.12)


def test_non_power_of_two_pays_the_fold():
    t = by_name("all_reduce", 3)
    # p2 = 2: one doubling step, plus the fold in (whole buffer, reduced) and out (whole buffer)
    assert t["recursive_doubling"] == pytest.approx((1 + 1.2 + 0.12) + (2 + 2.4 + 0.12))
    t = by_name("all_gather", 3)
    # one doubling step of half the (p2-blocked) buffer, fold in one block, fold out everything
    assert t["recursive_doubling"] == pytest.approx(1 + 0.6 + 2 + (400 + 1200) * 1e-3)


def test_other_collectives_at_two_ranks():
    assert by_name("reduce_scatter", 2)["ring"] == pytest.approx(1 + 600 * 1.1e-3)
    assert by_name("all_gather", 2)["ring"] == pytest.approx(1 + 0.6)
    assert by_name("broadcast", 2)["binomial"] == pytest.approx(1 + 1.2)
    assert by_name("reduce", 2)["binomial"] == pytest.approx(1 + 1.2 + 0.12)


def test_predictions_are_sorted_and_native_falls_back_to_the_best_formula():
    preds = predict("all_reduce", 8, 4, Table(LINK))
    assert [p.seconds for p in preds] == sorted(p.seconds for p in preds)
    native = [p for p in preds if p.algorithm == "native"][0]
    assert native.how == "formula (recursive_doubling)"
    assert set(cost_names("all_reduce")) == {"ring", "recursive_doubling", "rabenseifner", "binomial",
                                             "pipelined_doubling",
                                             "shm_oneshot", "shm_twoshot"}
    # shared-memory algorithms run only where a group has a segment: listed only when asked
    assert not {p.algorithm for p in preds} & {"shm_oneshot", "shm_twoshot"}


def test_shared_memory_formulas():
    shm = LinkCost(alpha=1.0, beta=1e-3, gamma=1e-4)
    t = {x.algorithm: x.seconds for x in
         predict("all_reduce", N, 4, Table(shm), ["shm_oneshot", "shm_twoshot"])}
    # one-shot: copy in, copy the first region out, reduce 3 more regions into it
    assert t["shm_oneshot"] == pytest.approx(1 + 2 * 1.2 + 3 * 0.12)
    # two-shot: two handshakes; copy in the 3 quarters the peers reduce, write own reduced
    # quarter twice (output and region), copy the 3 others out
    assert t["shm_twoshot"] == pytest.approx(2 + (0.75 + 0.5 + 0.75) * 1.2 + 0.75 * 0.12)
    rs = predict("reduce_scatter", N, 4, Table(shm), ["shm"])[0]
    assert rs.seconds == pytest.approx(1 + (0.75 + 0.25) * 1.2 + 0.75 * 0.12)
    bc = predict("broadcast", N, 4, Table(shm), ["shm"])[0]
    assert bc.seconds == pytest.approx(1 + 2.4)


def test_a_measured_curve_wins_over_the_formula():
    table = Table(LINK, curves={"all_reduce": {"ring": Curve({8: 1e-6, 1 << 20: 1e-3})}})
    ring = [p for p in predict("all_reduce", 8, 4, table) if p.algorithm == "ring"][0]
    assert ring == ("ring", 1e-6, "measured")


def test_native_uses_its_measured_curve():
    curve = Curve({8: 5e-6, 1024: 9e-6, 1 << 20: 500e-6})
    table = Table(LINK, curves={"all_reduce": {"native": curve}})
    native = [p for p in predict("all_reduce", 1024, 2, table) if p.algorithm == "native"][0]
    assert native == ("native", 9e-6, "measured")
    # log-log interpolation: the geometric midpoint of sizes gets the geometric mean of times
    mid = int(math.sqrt(1024 * (1 << 20)))
    assert curve(mid) == pytest.approx(math.sqrt(9e-6 * 500e-6), rel=1e-3)
    # beyond the largest size: the straight line through the last two points
    slope = (500e-6 - 9e-6) / ((1 << 20) - 1024)
    assert curve(1 << 21) == pytest.approx(500e-6 + slope * (1 << 20))


def test_curves_never_fall_with_size():
    # a spike at 512 B (a noisy measurement) is bounded by what 4 KiB took
    curve = Curve({8: 2e-6, 512: 90e-6, 4096: 5e-6, 32768: 20e-6})
    assert curve.times == [2e-6, 5e-6, 5e-6, 20e-6]
    assert curve(512) == 5e-6


def test_eligible_restricts_and_one_rank_costs_nothing():
    assert [p.algorithm for p in predict("all_reduce", N, 4, Table(LINK), ["ring"])] == ["ring"]
    assert predict("all_reduce", N, 1, Table(LINK))[0].seconds == 0.0
    with pytest.raises(ValueError):
        Curve({8: 1e-6})


def test_latency_ties_between_measured_curves_go_by_the_formulas():
    """Two measured curves within 10% of each other where both formulas are latency-bound: the
    formula's cheaper one (one handshake, not two) comes first, saying why; 20% apart, or in the
    bandwidth regime, the measurement decides."""
    shm = LinkCost(alpha=1e-6, beta=1e-10, gamma=1e-10)  # 1 us handshake, 10 GB/s

    def table(one, two):
        return Table(shm, curves={"all_reduce": {
            "shm_oneshot": Curve({8: one, 1 << 20: 400e-6}),
            "shm_twoshot": Curve({8: two, 1 << 20: 300e-6})}})

    names = ["shm_oneshot", "shm_twoshot"]
    tied = predict("all_reduce", 8, 2, table(1.05e-6, 1.0e-6), names)
    assert tied[0].algorithm == "shm_oneshot" and "formulas decide" in tied[0].how
    assert tied[0].seconds == pytest.approx(1.05e-6)  # its measured time, unchanged
    apart = predict("all_reduce", 8, 2, table(1.25e-6, 1.0e-6), names)
    assert [x.algorithm for x in apart] == ["shm_twoshot", "shm_oneshot"]
    assert apart[0].how == "measured"
    big = predict("all_reduce", 1 << 20, 2, Table(shm, curves={"all_reduce": {
        "shm_oneshot": Curve({8: 1e-6, 1 << 20: 310e-6}),
        "shm_twoshot": Curve({8: 2e-6, 1 << 20: 300e-6})}}), names)
    assert big[0].algorithm == "shm_twoshot" and big[0].how == "measured"  # bandwidth-bound


def test_across_hosts_the_doubling_family_pays_the_hosts_shared_link():
    """4 ranks, 2 per host. The ring crosses hosts once per host and step: priced on one rank's
    link (``inter``). Recursive doubling and halving exchange at the far distance with every rank
    crossing at once: priced on the hosts' link shared by its 2 ranks (``shard_inter``, β twice
    ``inter``'s). ``native`` is priced as the cheapest formula on each one's own link."""
    intra = LinkCost(alpha=1.0, beta=1e-6, gamma=1e-4)
    inter = LinkCost(alpha=1.0, beta=1e-3, gamma=1e-4)
    shared = LinkCost(alpha=1.0, beta=2e-3, gamma=1e-4)
    table = Table(intra, local=2, inter=inter, shard_inter=shared)
    t = by_name("all_reduce", 4, table=table)
    assert t["ring"] == pytest.approx(6 + 2 * 900 * 1e-3 + 900 * 1e-4)
    assert t["recursive_doubling"] == pytest.approx(2 * (1 + 2.4 + 0.12))
    assert t["rabenseifner"] == pytest.approx(4 + 3.6 + 0.09)
    assert t["pipelined_doubling"] == pytest.approx(2 * (1 + 2.4 + 0.12))  # one chunk at 1200 B
    # the cheapest formula, on its own (shared) link: 7.04, not the 4.64 of one rank's link
    assert t["native"] == pytest.approx(t["recursive_doubling"]) and t["native"] < t["ring"]
    # one rank per host (local 1 < p, no sharing): the same algorithms on one rank's link
    flat = by_name("all_reduce", 4, table=Table(intra, local=1, inter=inter, shard_inter=inter))
    assert flat["recursive_doubling"] == pytest.approx(2 * (1 + 1.2 + 0.12))
