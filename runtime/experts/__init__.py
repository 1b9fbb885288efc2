"""Expert residency: tiers (device slots ← host slots ← disk cache file), policies, prefetch, the managed backend."""
