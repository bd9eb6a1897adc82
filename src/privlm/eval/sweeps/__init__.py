"""Named benchmark sweeps."""
