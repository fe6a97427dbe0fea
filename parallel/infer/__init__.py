"""Inference and evaluation over whole cases: the MLPerf sliding window and one-pass
whole-volume inference, both split across the spatial group.

    from parallel.infer import WindowCrop, case_logits, evaluate_cases, plan_windows, sliding_window_logits
"""

from parallel.infer.evaluate import case_logits, evaluate_cases
from parallel.infer.sliding import sliding_window_logits
from parallel.infer.windows import (
                                    PAD_VALUE,
                                    CaseRegion,
                                    WindowCrop,
                                    WindowPlan,
                                    importance_map,
                                    kept_range,
                                    plan_windows,
)

__all__ = ["PAD_VALUE", "CaseRegion", "WindowCrop", "WindowPlan", "case_logits", "evaluate_cases",
           "importance_map", "kept_range", "plan_windows", "sliding_window_logits"]
