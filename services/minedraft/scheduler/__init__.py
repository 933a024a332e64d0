"""The scheduler: the public gRPC API, request lifecycle, and the step loop driving the workers."""
