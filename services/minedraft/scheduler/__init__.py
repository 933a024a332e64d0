"""The scheduler's engine side: the step loop that drives the workers (`loop.py`) over gRPC
(`remote_executor.py`). Below the frontends, which reach it through `engine_client.EngineClient`; the
process that wires both together is `scheduler_server.py`."""
