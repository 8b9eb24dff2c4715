"""Yield predictor of Hybrid Verified Decoding: features φ_t and the MLP g_θ(φ_t) → ŷ_t."""
