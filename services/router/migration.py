"""Request migration, as Dynamo's ``--migration-limit``: when the replica of a stream fails after
outputs went out (it died, hung past its health checks, or its drain timed out: UNAVAILABLE), the
router sends the rest of the request to another replica, whose outputs continue the same stream; the
client sees no cut.

The continuation is the request with the tokens relayed so far appended to its prompt, and
``max_tokens`` / ``min_tokens`` less those tokens; its outputs carry the usage of the whole request
(the original prompt, every token generated). Greedy requests go on as they would have (up to the
rounding of one prefill against the decode steps it replaces); a seeded one goes on with a fresh
draw from its seed, so its text is not the one an uninterrupted run would give. Not migrated (cut
with an error as without migration), because a continuation would not be the same request:
structured output (the constraint would start again at the continuation's first token) and presence
or frequency penalties (they count only generated tokens, which the continuation sees as prompt).
"""

from services.common.pb import engine_pb2


class Migration:
    """One request's relayed tokens, and its continuation on another replica."""

    def __init__(self, request: engine_pb2.GenerateRequest, limit: int) -> None:
        self.request = request
        self.limit = limit
        self.count = 0  # continuations started
        self.generated: list[int] = []  # token ids relayed so far
        self._before = 0  # tokens relayed before the current attempt
        self._cached_prompt_tokens = 0  # as the first attempt reported them

    def relayed(self, output: engine_pb2.GenerateResponse) -> engine_pb2.GenerateResponse:
        """Records an output about to be relayed; a continuation's usage becomes the whole request's."""
        if self.count:
            output.usage.prompt_tokens = len(self.request.prompt_token_ids)
            output.usage.completion_tokens += self._before
            output.usage.cached_prompt_tokens = self._cached_prompt_tokens
        else:
            self._cached_prompt_tokens = output.usage.cached_prompt_tokens
        if self.limit:  # kept only where a continuation may need them
            self.generated.extend(output.token_ids)
        return output

    def refusal(self) -> str | None:
        """Why this request cannot go on elsewhere now; None when it can."""
        sampling = self.request.sampling
        if self.count >= self.limit:
            return f"--migration-limit {self.limit} reached" if self.limit else "migration is off"
        if self.request.HasField("structured_output"):
            return "structured output is not migrated"
        if sampling.presence_penalty or sampling.frequency_penalty:
            return "presence and frequency penalties are not migrated"
        return None

    def continuation(self) -> engine_pb2.GenerateRequest:
        """The rest of the request: the tokens relayed so far appended to its prompt."""
        done = len(self.generated)
        request = engine_pb2.GenerateRequest()
        request.CopyFrom(self.request)
        request.prompt_token_ids.extend(self.generated)
        request.stop.max_tokens = self.request.stop.max_tokens - done
        request.stop.min_tokens = max(0, self.request.stop.min_tokens - done)
        self.count += 1
        self._before = done
        return request
