"""The public frontends: gRPC and the OpenAI-compatible HTTP API over one generate interface."""
