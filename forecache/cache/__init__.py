"""Expert store (host), slot cache (device), policies, prefetcher and compute reordering."""
