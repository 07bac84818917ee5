"""What names a service process in traces and logs: the package version and a per-process id."""

import importlib.metadata
import uuid
from functools import cache


@cache
def version() -> str:
    """The installed ``strata`` package's version (``service.version``)."""
    try:
        return importlib.metadata.version("strata")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that is not installed
        return "0+unknown"


@cache
def process_instance_id() -> str:
    """A ``service.instance.id`` for a process that has no id of its own (an engine has its replica
    id): random, and the same for the life of the process."""
    return str(uuid.uuid4())
