"""The scheduler: the step loop that drives the workers (`loop.py`) over gRPC (`remote_executor.py`), below the
frontends, which reach it through `engine_client.EngineClient`; and the process that wires both together
(`server.py`, `minedraft scheduler`)."""
