"""Runs FlashInfer's tests listed in ids.txt (one node id per line), passing the rest of argv to pytest."""
import sys
import pytest
ids = [l.strip() for l in open(sys.argv[1]) if l.strip()]
sys.exit(pytest.main(sys.argv[2:] + ids))
