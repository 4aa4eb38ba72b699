"""Expert parallelism (EP), the expert load balancer (EPLB) and DP attention over torch.distributed.

Design: ``docs/expert-parallel.md``. ``placement`` (where experts live), ``eplb`` (the balancer's policy, pure),
``dispatch`` (token dispatch / combine over ``all_to_all_single``), ``sharding`` (each rank reads only its
experts from the checkpoint), ``rearrange`` (moving experts, the EPLB controller), ``config`` (the parallel config,
the DP step agreement, the prefill allocation), ``dp_step`` (a rank's step loop), ``launch`` (one process per
rank), ``serve`` (serving over the ranks).
"""

from .eplb import ExpertLoadWindow, balancedness, mean_peak_load, rank_loads, rebalance
from .placement import ExpertPlacement

__all__ = ["ExpertLoadWindow", "ExpertPlacement", "balancedness", "mean_peak_load", "rank_loads", "rebalance"]
