"""planner: the perfectly balanced expert-parallel planner (pure integer code, no communication).

``plan`` computes where every routed (token, expert) slot is computed so that each rank gets exactly its
share; ``verify`` re-derives every guarantee; ``rebalance_experts`` is the DeepSeek EPLB-compatible static
balancer. See ``planner/README.md`` for the theorem and its proof.
"""

from planner.core import Plan, plan
from planner.eplb import rebalance_experts
from planner.slack import CostModel, row_bound
from planner.tensor_plan import TensorPlan
from planner.verify import PlanVerificationError, verify

__all__ = [
    "CostModel",
    "Plan",
    "PlanVerificationError",
    "TensorPlan",
    "plan",
    "rebalance_experts",
    "row_bound",
    "verify",
]
