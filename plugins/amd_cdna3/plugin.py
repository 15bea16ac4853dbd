"""Plugin registration (filled in by its issue)."""
