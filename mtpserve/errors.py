"""Exceptions that name what went wrong, shared by every package."""


class MTPServeError(Exception):
    """Base class of mtpserve's own errors."""


class CheckpointError(MTPServeError):
    """A checkpoint directory, its config.json or its tensors are not what the model needs."""


class InvalidRequestError(MTPServeError, ValueError):
    """A request or its sampling settings are invalid; the message names the field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class DeploymentError(MTPServeError):
    """A deployment could not start (placement, a worker's load) or lost a worker; the message names the cause."""


class WorkerLost(DeploymentError):
    """A worker died, closed its channel, failed or hung during a step; the replica may recover from it."""


class ReplicaFailed(DeploymentError):
    """The replica gave up: recovery failed or faults came faster than its budget allows."""
