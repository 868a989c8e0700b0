"""Rules: one module per target kind, each a pydantic attrs model plus a pure plan()."""
