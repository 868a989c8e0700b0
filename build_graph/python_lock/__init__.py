"""Python runtime closures pinned in a lock (`python_lock` targets, `bgraph py lock`)."""
