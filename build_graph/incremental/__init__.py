"""The incremental core's shared pieces: file state (one stamp, one racy-clean rule)."""
