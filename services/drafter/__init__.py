"""Drafters, registered by name in ``services.drafter.base.DRAFTERS``."""

from services.drafter import draft_lm, eagle3_drafter, ngram, suffix  # noqa: F401  (registration side effect)
