"""Drafters, registered by name in ``services.drafter.base.DRAFTERS``."""
from services.drafter import draft_lm, eagle3_drafter, suffix  # noqa: F401  (registration side effect)
