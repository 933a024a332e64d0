"""What every service process shares (scheduler, gateway, drafter, verifier, pool drafter): its gRPC server's
plumbing (`grpc_server`: message limits, the services' names, health and reflection, its port), health as the
services ask and tell it (`health`), and the process's life (`lifetime`: it runs until SIGTERM and dies with
the parent that started it).

Not `transport/`: that is the core's torch.distributed channel, which knows nothing of gRPC.
"""
