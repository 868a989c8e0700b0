"""Remote execution (issue 36): the client that sends actions to a REAPI Execution service
(client.py, input_root.py) and the worker that runs them (worker.py)."""
