"""The parameter (and OpenAI error code) of an INVALID_ARGUMENT, carried in the gRPC status details as
the standard `google.rpc.BadRequest` field violation and `google.rpc.ErrorInfo`, so a client (the
gateway) can name the parameter at fault without checking the request again."""

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

from services.common.errors import InvalidRequestError

_DETAILS_KEY = "grpc-status-details-bin"  # where gRPC carries a google.rpc.Status
_DOMAIN = "strata"


def trailing_metadata(error: InvalidRequestError) -> tuple[tuple[str, bytes], ...]:
    """The trailing metadata that carries ``error``'s parameter and code (none when it names neither)."""
    if error.param is None and error.code is None:
        return ()
    status = status_pb2.Status(code=code_pb2.INVALID_ARGUMENT, message=str(error))
    if error.param is not None:
        violation = error_details_pb2.BadRequest.FieldViolation(field=error.param, description=str(error))
        status.details.append(_packed(error_details_pb2.BadRequest(field_violations=[violation])))
    if error.code is not None:
        status.details.append(_packed(error_details_pb2.ErrorInfo(reason=error.code, domain=_DOMAIN)))
    return ((_DETAILS_KEY, status.SerializeToString()),)


def passed_on(error: grpc.RpcError) -> tuple[tuple[str, bytes], ...]:
    """A failed call's status details as trailing metadata, for a proxy (the router) to pass them on."""
    metadata = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    return tuple((key, value) for key, value in metadata or () if key == _DETAILS_KEY)


def param_and_code(error: grpc.RpcError) -> tuple[str | None, str | None]:
    """The parameter and OpenAI error code a failed call's status details name (None where they do not)."""
    raw = next((value for _, value in passed_on(error)), None)
    if raw is None:
        return None, None
    status = status_pb2.Status.FromString(raw)
    param = code = None
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad_request = error_details_pb2.BadRequest()
            detail.Unpack(bad_request)
            param = next((v.field for v in bad_request.field_violations), None)
        elif detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            code = info.reason or None
    return param, code


def _packed(message) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed
