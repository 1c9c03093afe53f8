"""Data plane: model runner, drafter, KV pools, sampling and verification, and the Ray worker actors."""
