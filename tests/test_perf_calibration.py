"""The performance model against every published measurement of the calibration set, in CI: the
error over all points, per regime and with each source left out of the fit, and the runtime
pairs. The full report is printed at the end of the run."""

from __future__ import annotations

import math

import pytest

from advisor.perf.calibration import as_percent, calibrate, error, to_page, to_text
from advisor.perf.calibration import points as calibration_points
from advisor.perf.efficiency import fitted
from advisor.perf.fit import left_out

from . import conftest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def report():
    result = calibrate(fitted(), left_out(calibration_points(), fitted()))
    conftest.REPORTS["performance model against published measurements"] = to_text(result).splitlines()
    return result


def test_error_over_all_points(report):
    assert report.median <= 25
    assert report.worst <= 2.0, [(r.point.id, r.ratio) for r in report.rows
                                 if error(r.estimate, r.point.value) > math.log(2)]


def test_error_with_each_source_left_out_of_the_fit(report):
    assert report.median_left_out <= 35


@pytest.mark.parametrize("regime", ["prefill-heavy", "decode-heavy", "moe", "fp4"])
def test_hard_regimes_within_the_same_bounds(report, regime):
    rows = [r for r in report.rows if regime in r.point.regimes]
    errors = sorted(error(r.estimate, r.point.value) for r in rows)
    assert rows and as_percent(errors[len(errors) // 2]) <= 25 and math.exp(errors[-1]) <= 2.0  # all within 2x


def test_runtime_pairs_are_ordered_as_published(report):
    right = [p for p in report.pairs if p["same_direction"]]
    assert len(right) >= 5 and len(right) > len(report.pairs) / 2


def test_the_committed_report_is_what_the_model_says_today(report):
    """docs/advisor-calibration.md is `servegate advise --calibration`'s output: a change to the
    model, its fit or the points that moves any figure shows up here."""
    from pathlib import Path

    assert (Path(__file__).resolve().parents[1] / "docs" / "advisor-calibration.md").read_text() == to_page(report)
