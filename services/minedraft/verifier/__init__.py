"""The verifier service: the target model on tensor-parallel ranks; rank 0 serves gRPC."""
