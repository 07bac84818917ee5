"""Domain errors shared by every service; the gRPC layer maps them to status codes in one place."""


class InvalidRequestError(ValueError):
    """A request that can never succeed as given (gRPC INVALID_ARGUMENT, HTTP 400)."""


class ResourceExhaustedError(RuntimeError):
    """A request that may succeed later, when load is lower (gRPC RESOURCE_EXHAUSTED, HTTP 429/503)."""


class ServiceUnavailableError(RuntimeError):
    """The service cannot take requests now: still loading, or draining (gRPC UNAVAILABLE, HTTP 503)."""
