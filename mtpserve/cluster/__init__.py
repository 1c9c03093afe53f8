"""Control plane: engine, scheduler, KV block accounting, gRPC router, metrics, placement and CLI."""
