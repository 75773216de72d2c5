import math

import pytest

from learner.metrics import average_accuracy, average_forgetting, forgetting, mean_ci95

# a[i][j]: accuracy on task j after training tasks 1..i (0-based), hand-made
MATRIX = [
    [90.0, 0.0, 0.0],
    [60.0, 80.0, 0.0],
    [70.0, 40.0, 85.0],
]


def test_average_accuracy_is_the_mean_of_the_last_row():
    assert average_accuracy(MATRIX) == pytest.approx((70 + 40 + 85) / 3)


def test_forgetting_uses_the_best_earlier_accuracy():
    # task 1: best before the end is 90 (after task 1), now 70 -> 20; task 2: 80 -> 40 -> 40
    assert forgetting(MATRIX, 2, 0) == pytest.approx(20.0)
    assert forgetting(MATRIX, 2, 1) == pytest.approx(40.0)
    assert average_forgetting(MATRIX) == pytest.approx(30.0)


def test_forgetting_can_be_negative_when_accuracy_recovers():
    assert average_forgetting([[50.0, 0.0], [60.0, 70.0]]) == pytest.approx(-10.0)


def test_single_task_forgetting_is_undefined():
    assert math.isnan(average_forgetting([[50.0]]))
    with pytest.raises(ValueError):
        forgetting(MATRIX, 1, 1)


def test_confidence_interval():
    mean, ci = mean_ci95([10.0, 12.0, 14.0])
    assert mean == pytest.approx(12.0)
    assert ci == pytest.approx(4.303 * 2 / math.sqrt(3), rel=1e-3)  # t_{0.975, 2} * sem
