"""Dashboard panels; each updates itself in place from snapshot pieces."""
