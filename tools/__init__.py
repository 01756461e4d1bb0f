"""tools: see the issue for this package; not built yet."""
