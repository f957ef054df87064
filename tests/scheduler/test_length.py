"""Length prediction: calibration on synthetic lognormal lengths, conditioning on tokens generated, the tail model,
agreement of the vectorized predictor with a per-request reference, and the calibration report on real traces."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from das.drafter.records import RolloutRecord, load_rollouts
from das.scheduler.difficulty import DifficultyBook
from das.scheduler.length import (
    PRIOR_ATOMS,
    PRIOR_REFRESH,
    LengthCurve,
    LengthCurveTable,
    LengthForecast,
    LengthPredictor,
    calibration_report,
)

FIXTURE = Path(__file__).parents[1] / "fixtures" / "traces-smollm2.jsonl.gz"


def _book(lengths: dict[str, list[int]], **bounds: int) -> DifficultyBook:
    book = DifficultyBook(**bounds)
    for pid, xs in lengths.items():
        for x in xs:
            book.history(pid).add_length(0, x)
    return book


def _lognormal_records(seed: int, sigma: float, problems: int = 40, versions: int = 4,
                       samples: int = 16) -> tuple[list[RolloutRecord], np.ndarray]:
    """Rollouts whose lengths (tokens) are lognormal with a per-problem median in [40, 400]; returns the records
    and those medians."""
    rng = np.random.default_rng(seed)
    mu = rng.uniform(np.log(40), np.log(400), problems)
    records = [RolloutRecord(f"p{p}", v, s, (1,), (7,) * int(np.ceil(np.exp(rng.normal(mu[p], sigma)))), "stop")
               for v in range(versions) for p in range(problems) for s in range(samples)]
    return records, np.exp(mu)


def _oracle_error(records: list[RolloutRecord], medians: np.ndarray) -> float:
    """Median |true median - L| / L over versions >= 1: the error of a predictor that knows the distribution."""
    evaluated = [r for r in records if r.policy_version >= 1]
    true = np.array([len(r.output_token_ids) for r in evaluated])
    median = medians[[int(r.problem_id[1:]) for r in evaluated]]
    return float(np.median(np.abs(median - true) / true))


# --- calibration on known distributions -----------------------------------------------------------------------

@pytest.mark.parametrize(("seed", "sigma"), [(0, 0.35), (1, 0.6)])
def test_calibrated_on_lognormal_lengths(seed: int, sigma: float) -> None:
    records, medians = _lognormal_records(seed, sigma)
    report = calibration_report(records, warm_versions=1)
    assert report["versions_evaluated"] == [1, 2, 3]
    assert report["g0"]["pairs"] == report["g_half"]["pairs"] == len(records) * 3 // 4
    for setting in ("g0", "g_half"):
        assert 0.65 <= report[setting]["coverage"] <= 0.95, report
    # Every decoding step counted once: where a perfect predictor sits at 0.8, so the bound is tighter.
    assert 0.72 <= report["g_steps"]["coverage"] <= 0.88, report
    assert 0.03 <= report["g_steps"]["below_p10"] <= 0.17 and 0.03 <= report["g_steps"]["above_p90"] <= 0.17
    oracle = _oracle_error(records, medians)
    assert report["g0"]["median_abs_rel_error"] <= oracle + 0.05, (report, oracle)
    # Knowing half the length only helps.
    assert report["g_half"]["median_abs_rel_error"] <= report["g0"]["median_abs_rel_error"] + 0.02


def test_the_calibration_test_can_tell_a_bad_predictor() -> None:
    # A prior weight so large that every problem looks like the global mix: the error bound above must catch it.
    records, medians = _lognormal_records(0, 0.35)
    report = calibration_report(records, prior_weight=1e6)
    assert report["g0"]["median_abs_rel_error"] > _oracle_error(records, medians) + 0.1


def test_calibration_report_rejects_too_few_versions() -> None:
    records, _ = _lognormal_records(0, 0.35, problems=2, versions=2, samples=2)
    with pytest.raises(ValueError, match="warm_versions"):
        calibration_report(records, warm_versions=2)
    with pytest.raises(ValueError, match="warm_versions"):
        calibration_report(records, warm_versions=0)
    with pytest.raises(ValueError, match="step_stride"):
        calibration_report(records, step_stride=0)


def test_calibration_report_on_the_real_traces() -> None:
    records = load_rollouts(FIXTURE)
    versions = sorted({r.policy_version for r in records})
    report = calibration_report(records, warm_versions=1)
    evaluated = [r for r in records if r.policy_version != versions[0]]
    assert report["versions_evaluated"] == versions[1:]
    assert report["g0"]["pairs"] == report["g_half"]["pairs"] == len(evaluated)
    assert report["g_steps"]["pairs"] == sum(-(-len(r.output_token_ids) // 16) for r in evaluated)
    for setting in ("g0", "g_half", "g_steps"):
        figures = report[setting]
        assert figures["coverage"] + figures["below_p10"] + figures["above_p90"] == pytest.approx(1.0)
        assert figures["median_abs_rel_error"] >= 0


# --- conditioning and the tail model --------------------------------------------------------------------------

def test_conditioning_on_tokens_generated() -> None:
    own = list(range(100, 201, 5))
    book = _book({"p": own, "q": [50, 60, 70, 80, 3000]})
    predictor = LengthPredictor(book)
    g = int(np.quantile(own, 0.9))  # above most of p's past lengths
    f = predictor.predict(["p", "p"], np.array([0, g]))
    assert f.p50[1] > g and f.p10[1] >= g + 1
    assert f.p50[1] > f.p50[0]
    assert not f.extrapolated.any()
    # Past every length of p, the prior (q's long sample) still holds mass above g: no extrapolation yet.
    f = predictor.predict(["p"], np.array([250]))
    assert not f.extrapolated[0] and f.p50[0] > 250


def test_tail_model_past_every_known_length() -> None:
    lengths = [100, 200, 300, 400, 500, 600, 700, 800]
    book = _book({"p": lengths})
    f = LengthPredictor(book).predict(["p", "new"], np.array([10_000, 10_000]))
    assert f.extrapolated.all()
    # Relative overshoot above the median 450: lengths 500..800 -> 1/9, 1/3, 5/9, 7/9; their median is 4/9.
    np.testing.assert_allclose(f.p50, 10_000 * (1 + 4 / 9))
    np.testing.assert_allclose(f.mean, 10_000 * (1 + np.mean([1 / 9, 3 / 9, 5 / 9, 7 / 9])))
    assert (f.p10 < f.p50).all() and (f.p50 < f.p90).all()


def test_an_empty_book_doubles_what_was_generated() -> None:
    f = LengthPredictor(DifficultyBook()).predict(["a", "b"], np.array([0, 40]))
    assert f.extrapolated.all()
    np.testing.assert_allclose(f.p50, [1, 80])
    np.testing.assert_allclose(f.remaining_mean, [1, 40])


def test_a_new_problem_is_predicted_from_the_prior() -> None:
    rng = np.random.default_rng(3)
    book = _book({f"p{i}": rng.integers(10, 1000, 30).tolist() for i in range(20)})
    f = LengthPredictor(book).predict(["never-seen"], np.array([0]))
    everything = book.all_lengths()
    # Within the resolution of the compressed prior.
    tolerance = 2 / PRIOR_ATOMS
    for q, got in ((0.1, f.p10[0]), (0.5, f.p50[0]), (0.9, f.p90[0])):
        assert abs(np.mean(everything <= got) - q) <= tolerance, (q, got)
    assert f.mean[0] == pytest.approx(everything.mean(), rel=0.02)


def test_many_rollouts_outweigh_the_prior() -> None:
    book = _book({"short": [20] * 64, **{f"long{i}": [2000] * 64 for i in range(10)}})
    f = LengthPredictor(book, prior_weight=2.0).predict(["short"], np.array([0]))
    assert f.p50[0] == 20 and f.p90[0] == 20
    few = _book({"short": [20] * 2, **{f"long{i}": [2000] * 64 for i in range(10)}})
    assert LengthPredictor(few, prior_weight=2.0).predict(["short"], np.array([0])).p90[0] > 1000


def test_the_prior_follows_the_book() -> None:
    book = _book({"a": [100] * 10})
    predictor = LengthPredictor(book)
    assert predictor.predict(["new"], np.array([0])).p50[0] == 100
    book.history("b").add_length(0, 900)
    for _ in range(30):
        book.history("b").add_length(0, 900)
    assert predictor.predict(["new"], np.array([0])).p50[0] == 900


def test_a_big_prior_is_refreshed_after_enough_changes() -> None:
    book = _book({f"p{i}": [100] * 50 for i in range(40)})  # 2000 lengths
    predictor = LengthPredictor(book)
    assert predictor.predict(["new"], np.array([0])).p90[0] == 100
    for _ in range(int(PRIOR_REFRESH * 2000)):
        book.history("long0").add_length(0, 5000)
    assert predictor.predict(["new"], np.array([0])).p90[0] == 100  # stale on purpose: too few changes
    # A problem's own lengths are never stale.
    assert predictor.predict(["long0"], np.array([0])).p50[0] == 5000
    for i in range(1, 11):  # 20 % of the lengths are now long
        for _ in range(50):
            book.history(f"long{i}").add_length(0, 5000)
    assert predictor.predict(["new"], np.array([0])).p90[0] == 5000


def test_forecast_is_read_only_and_typed() -> None:
    f = LengthPredictor(_book({"a": [5, 6, 7]})).predict(["a"], [1])
    assert isinstance(f, LengthForecast) and len(f) == 1
    with pytest.raises(ValueError):
        f.p50[0] = 0
    assert f.extrapolated.dtype == bool and f.p50.dtype == np.float64


def test_empty_batch() -> None:
    f = LengthPredictor(_book({"a": [5]})).predict([], np.zeros(0, dtype=np.int64))
    assert len(f) == 0 and f.mean.shape == (0,)


def test_integer_valued_floats_are_token_counts() -> None:
    predictor = LengthPredictor(_book({"a": [5, 9, 30]}))
    floats = predictor.predict(["a", "a"], np.array([0.0, 7.0]))
    ints = predictor.predict(["a", "a"], np.array([0, 7]))
    np.testing.assert_array_equal(floats.p50, ints.p50)
    np.testing.assert_array_equal(floats.mean, ints.mean)


@pytest.mark.parametrize(("ids", "generated"), [(["a", "b"], [1]), (["a"], [-1]), (["a"], [1.5]),
                                                (["a"], [float("nan")]), (["a"], [float("inf")]), (["a"], [True]),
                                                (["a"], [-1.0]), (["a"], [[1]])])
def test_bad_input(ids: list[str], generated: list[object]) -> None:
    with pytest.raises(ValueError):
        LengthPredictor(_book({"a": [5]})).predict(ids, np.array(generated))


@pytest.mark.parametrize("weight", [-1.0, float("nan"), float("inf")])
def test_bad_prior_weight(weight: float) -> None:
    with pytest.raises(ValueError):
        LengthPredictor(DifficultyBook(), prior_weight=weight)


# --- the vectorized predictor against a per-request reference ---------------------------------------------------

def _reference(book: DifficultyBook, prior_weight: float, pid: str, g: int) -> tuple[list[float], bool]:
    """p10, p50, p90, mean of one request, written out directly from the model in the module docstring."""
    everything = np.sort(book.all_lengths())
    if len(everything) > PRIOR_ATOMS:
        everything = everything[np.round(np.linspace(0, len(everything) - 1, PRIOR_ATOMS)).astype(int)]
    # (length, source, weight): on equal lengths the problem's own (source 0) come before the prior's (source 1).
    atoms = [(float(x), 0, 1.0) for x in book.lengths(pid)]
    if prior_weight > 0:
        atoms += [(float(x), 1, prior_weight / len(everything)) for x in everything]
    above = [(x, w) for x, _, w in sorted(atoms) if x > g]
    if not above:
        all_lengths = book.all_lengths()
        m = np.median(all_lengths) if len(all_lengths) else 0.0
        over = all_lengths[all_lengths > m] / m - 1 if m > 0 else np.zeros(0)
        r = [*np.quantile(over, [0.1, 0.5, 0.9]), over.mean()] if len(over) else [1.0] * 4
        return [max(g * (1 + x), g + 1) for x in r], True
    values = np.array([x for x, _ in above])
    weights = np.array([w for _, w in above])
    positions = np.cumsum(weights)  # Weibull: the j-th atom at its cumulative weight, of total + one observation
    total = positions[-1] + (weights**2).sum() / weights.sum()
    quantiles = [float(np.interp(np.clip(q * total, positions[0], positions[-1]), positions, values))
                 for q in (0.1, 0.5, 0.9)]
    return [*quantiles, float((values * weights).sum() / weights.sum())], False


@settings(max_examples=80, deadline=None)
@given(st.dictionaries(st.sampled_from(["a", "b", "c", "d"]), st.lists(st.integers(0, 400), max_size=12),
                       max_size=4),
       st.lists(st.tuples(st.sampled_from(["a", "b", "c", "d", "e"]), st.integers(0, 500)), max_size=12),
       st.sampled_from([0.0, 0.5, 2.0, 10.0]))
def test_matches_the_per_request_reference(lengths: dict[str, list[int]], requests: list[tuple[str, int]],
                                           prior_weight: float) -> None:
    book = _book({pid: xs for pid, xs in lengths.items() if xs})
    ids = [pid for pid, _ in requests]
    g = np.array([x for _, x in requests], dtype=np.int64)
    f = LengthPredictor(book, prior_weight).predict(ids, g)
    for i, (pid, gi) in enumerate(requests):
        expected, extrapolated = _reference(book, prior_weight, pid, gi)
        got = [f.p10[i], f.p50[i], f.p90[i], f.mean[i]]
        np.testing.assert_allclose(got, np.maximum(expected, gi + 1), rtol=1e-9, err_msg=f"{pid} g={gi}")
        assert f.extrapolated[i] == extrapolated
    assert (f.p10 >= g + 1).all() and (f.p10 <= f.p50).all() and (f.p50 <= f.p90).all()
    assert (f.mean >= g + 1).all()
    np.testing.assert_allclose(f.remaining_mean, f.mean - g)


def test_a_batch_equals_its_requests_one_by_one() -> None:
    rng = np.random.default_rng(7)
    book = _book({f"p{i}": rng.integers(1, 3000, int(rng.integers(1, 80))).tolist() for i in range(30)})
    ids = [f"p{i}" for i in rng.integers(0, 35, 256)]  # some never seen
    g = rng.integers(0, 3500, 256)
    predictor = LengthPredictor(book)
    batch = predictor.predict(ids, g)
    for i in range(0, 256, 17):
        one = predictor.predict([ids[i]], g[i:i + 1])
        for name in ("p10", "p50", "p90", "mean", "remaining_mean", "extrapolated"):
            assert getattr(one, name)[0] == pytest.approx(getattr(batch, name)[i], rel=1e-12), (name, i)


# --- curves: the forecast as a function of tokens generated, for the engine -----------------------------------

@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.sampled_from(["a", "b", "c"]), st.lists(st.integers(0, 300), max_size=10), max_size=3),
       st.sampled_from([0.0, 0.5, 2.0]))
def test_a_curve_is_the_p90_forecast_at_every_g(lengths: dict[str, list[int]], prior_weight: float) -> None:
    book = _book({pid: xs for pid, xs in lengths.items() if xs})
    predictor = LengthPredictor(book, prior_weight)
    ids = ["a", "b", "c", "unseen", "a"]
    curves = predictor.curves(ids)
    assert curves[0] is curves[4]  # one object per problem
    g = np.arange(0, 700)
    for pid, curve in zip(ids, curves):
        expected = predictor.predict([pid] * len(g), g).p90
        np.testing.assert_allclose([curve.at(int(x)) for x in g], expected, rtol=1e-9, err_msg=pid)


def test_curves_on_the_real_traces_cover_a_sample_that_outlives_its_problem() -> None:
    book = DifficultyBook()
    book.add_records([r for r in load_rollouts(FIXTURE) if r.policy_version == 0])
    predictor = LengthPredictor(book)
    pid = "gsm_symbolic/0"
    (curve,) = predictor.curves([pid])
    longest = int(book.lengths(pid).max())
    # Past every length the problem has had, the forecast does not end the sample (a fixed prediction would leave
    # it one token): the global prior's long samples say it may run on, and past those the tail model.
    assert curve.at(longest + 50) - (longest + 50) > 100
    assert curve.tail_ratio > 0 and curve.at(2 * curve.tail_from) > 2 * curve.tail_from + 1
    g = np.array([0, longest // 2, longest, 3 * longest, 2 * curve.tail_from])
    np.testing.assert_allclose([curve.at(int(x)) for x in g], predictor.predict([pid] * len(g), g).p90)


def test_curves_for_an_empty_book_or_batch() -> None:
    predictor = LengthPredictor(DifficultyBook())
    assert predictor.curves([]) == []
    (curve,) = predictor.curves(["x"])
    assert curve == LengthCurve((), (), 0, 1.0) and curve.at(0) == 1.0 and curve.at(40) == 80.0


def test_curve_round_trip_and_bad_curves() -> None:
    curve = LengthCurve((0, 10, 30), (25.0, 40.0, 60.0), 90, 0.5)
    assert LengthCurve.from_dict(curve.to_dict()) == curve
    assert [curve.at(g) for g in (0, 9, 10, 29, 30, 89, 90, 100)] == [25, 25, 40, 40, 60, 90, 135, 150]
    for bad in [((1, 10), (25.0, 40.0), 90, 0.5), ((0, 10, 10), (25.0, 40.0, 50.0), 90, 0.5),
                ((0, 10), (25.0,), 90, 0.5), ((0, 10), (25.0, 5.0), 90, 0.5), ((0, 10), (25.0, 40.0), 10, 0.5),
                ((), (), 3, 0.5), ((0,), (25.0,), 90, -1.0), ((0,), (float("nan"),), 90, 0.5)]:
        with pytest.raises(ValueError):
            LengthCurve(*bad)
    with pytest.raises(ValueError, match="not a length curve"):
        LengthCurve.from_dict({"starts": [0]})


def test_the_curve_table_reads_every_slot_as_its_curve_does_through_starts_clears_and_compaction():
    rng = np.random.default_rng(5)
    table, held = LengthCurveTable(), {}

    def random_curve() -> LengthCurve | None:
        kind = rng.integers(4)
        if kind == 0:
            return None
        if kind == 1:  # no starts: the tail model from 0
            return LengthCurve((), (), 0, float(rng.uniform(0, 2)))
        starts = np.unique(np.concatenate([[0], rng.integers(1, 400, rng.integers(1, 30))]))
        ends = starts + rng.uniform(1, 300, starts.size)
        return LengthCurve(tuple(int(s) for s in starts), tuple(float(e) for e in ends),
                           int(starts[-1]) + int(rng.integers(1, 50)), float(rng.uniform(0, 2)))

    for _ in range(300):
        slot = int(rng.integers(0, 40))
        if rng.random() < 0.3:
            table.clear(slot)
            held.pop(slot, None)
        else:
            held[slot] = random_curve()
            table.set(slot, held[slot])
        slots = rng.integers(0, 48, 25)  # slots never given a curve included
        generated = rng.integers(0, 700, 25)
        got = table.at(slots, generated)
        want = [held[s].at(int(g)) if held.get(s) is not None else np.nan for s, g in zip(slots, generated)]
        np.testing.assert_array_equal(got, want)
        assert table._keys.size <= 2 * table._live_keys  # removed curves' keys are dropped as they pile up
    assert table.at(np.zeros(0, np.int64), np.zeros(0, np.int64)).shape == (0,)
