"""What crosses between the control plane (cluster/) and the data plane (workers/): the per-step
messages and the channel that carries them. Both sides import this package; it imports neither."""
