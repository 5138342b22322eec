"""`anatomist plan`: search the recipe space for the fastest recipe that fits, and write it out."""

from anatomist.plan.search import DEFAULT_MARGIN, Candidate, Plan, plan
from anatomist.plan.space import SearchSpace

__all__ = ["DEFAULT_MARGIN", "Candidate", "Plan", "SearchSpace", "plan"]
