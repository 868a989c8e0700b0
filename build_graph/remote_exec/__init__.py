"""Remote execution over REAPI: the client side (`bgraph build --remote-executor`) and the
worker (`bgraph worker`) that runs leases from a Remote Workers API server (BuildGrid)."""
