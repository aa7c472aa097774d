"""A step's metrics over its micro-batches: means, except extremes, which stay extremes."""
import pytest

from treelit.lightning.module import add_micro_batch_metrics


def test_extremes_stay_extremes_and_the_rest_is_the_mean():
    acc: dict = {}
    parts = [{"clip_frac": 0.2, "behavior/ratio_max": 1.5, "adv_min": -1.0, "adv_max": 0.5},
             {"clip_frac": 0.4, "behavior/ratio_max": 3.0, "adv_min": -2.5, "adv_max": 0.25},
             {"clip_frac": 0.6, "behavior/ratio_max": 1.1, "adv_min": 0.0, "adv_max": 2.0}]
    for m in parts:
        add_micro_batch_metrics(acc, m, len(parts))
    assert acc["clip_frac"] == pytest.approx(0.4)
    assert acc["behavior/ratio_max"] == 3.0
    assert acc["adv_min"] == -2.5 and acc["adv_max"] == 2.0
