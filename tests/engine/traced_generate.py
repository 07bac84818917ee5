"""An engine Generate call made in-process inside a span, as the gRPC server's tracing interceptor makes it."""

from services.common.pb import engine_pb2


async def generate_in_a_span(servicer, tracer, request_id: str, prompt: list[int], max_tokens: int) -> list:
    """``servicer.Generate`` of a greedy, EOS-ignoring request under a ``strata.v1.Engine/Generate``
    span of ``tracer``; its responses."""
    request = engine_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=prompt,
                                         stop=engine_pb2.StopCriteria(max_tokens=max_tokens, ignore_eos=True))
    with tracer.start_as_current_span("strata.v1.Engine/Generate"):
        return [response async for response in servicer.Generate(request, None)]
