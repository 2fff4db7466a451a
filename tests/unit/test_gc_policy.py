"""cluster/gc_policy.py: a serving process collects its youngest generation rarely, the older ones as before."""

import gc

from cluster.gc_policy import SERVING_GEN0_THRESHOLD, tune_for_serving


def test_tune_for_serving_raises_only_the_youngest_generations_threshold():
    before = gc.get_threshold()
    try:
        gc.set_threshold(700, 7, 9)
        tune_for_serving()
        assert gc.get_threshold() == (SERVING_GEN0_THRESHOLD, 7, 9)
        assert gc.isenabled()
    finally:
        gc.set_threshold(*before)
