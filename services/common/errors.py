"""Domain errors shared by every service; the gRPC layer maps them to status codes in one place."""


class InvalidRequestError(ValueError):
    """A request that can never succeed as given (gRPC INVALID_ARGUMENT, HTTP 400). ``param`` names the
    OpenAI request parameter at fault and ``code`` is OpenAI's error code, when there are such; they
    travel in the gRPC status details (`services.common.error_details`) to the gateway."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class ResourceExhaustedError(RuntimeError):
    """A request that may succeed later, when load is lower (gRPC RESOURCE_EXHAUSTED, HTTP 429/503)."""


class ServiceUnavailableError(RuntimeError):
    """The service cannot take requests now: still loading, or draining (gRPC UNAVAILABLE, HTTP 503)."""
