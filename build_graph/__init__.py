"""bgraph: a hermetic, content-addressed build graph for GPU inference stacks."""

__version__ = "0.1.0"
