"""One request's GenerateMany entries as the outputs they stand for."""

from services.common.pb import engine_pb2


def as_outputs(entries: list[engine_pb2.GenerateManyOutput]) -> list[engine_pb2.GenerateResponse]:
    """A ``next_token`` entry is the token alone, with the previous output's usage one completion token
    further and its replica; an ``output`` entry is its output."""
    outputs = []
    for entry in entries:
        if entry.HasField("next_token"):
            output = engine_pb2.GenerateResponse(token_ids=[entry.next_token], replica_id=outputs[-1].replica_id)
            output.usage.CopyFrom(outputs[-1].usage)
            output.usage.completion_tokens += 1
        else:
            output = entry.output
        outputs.append(output)
    return outputs
