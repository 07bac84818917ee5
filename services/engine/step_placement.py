"""Where `AsyncEngine.drive` runs a scheduled step: on the event loop's own thread when it will be
short, else on a step thread while the loop goes on serving.

A step's time is predicted from the steps before it: a decode step (one token per request) as long
as the last one, longer in proportion when it has more rows (decode time grows more slowly than
that), and each prompt token beyond one per row at the seconds per prompt token the last step with
prompt tokens took beyond its decodes. Until a kind of step has been seen, its time is unknown and it
runs on the step thread.
"""

# The longest step that runs on the event loop's own thread. Meanwhile the loop answers nothing else
# (health checks: the router's time out after 1 s; load reports; requests arriving wait for the
# step's end, as they would to join a batch), so a longer one goes to the step thread. The longer
# this, the more steps run inline, which serves faster: through `strata up` on 2 cores, small model,
# bfloat16, 64 streams of 64-512-token prompts (where steps with a prompt chunk take 0.1-0.3 s), five
# alternating runs each: 1,374 tok/s at 0.25 s, 1,322 at 0.1 s, 1,223 with every step on a thread
# of its own (the loop beside it then takes the GIL from the step's Python between kernels).
INLINE_STEP_MAX_S = 0.25


class StepPlacement:
    def __init__(self, inline_max_s: float = INLINE_STEP_MAX_S) -> None:
        self.inline_max_s = inline_max_s
        self._decode: tuple[int, float] | None = None  # (rows, seconds) of the last decode-only step
        self._prompt_token_s: float | None = None  # seconds per prompt token, of the last step with some

    def inline(self, rows: int, tokens: int) -> bool:
        """Whether a step of ``rows`` requests and ``tokens`` tokens runs on the event loop's thread."""
        predicted = self.predict(rows, tokens)
        return predicted is not None and predicted < self.inline_max_s

    def predict(self, rows: int, tokens: int) -> float | None:
        """The step's predicted seconds; None until steps like it have been seen."""
        if self._decode is None:
            return None
        decode_rows, decode_s = self._decode
        seconds = decode_s * max(1.0, rows / decode_rows)
        if tokens > rows:
            if self._prompt_token_s is None:
                return None
            seconds += (tokens - rows) * self._prompt_token_s
        return seconds

    def observe(self, rows: int, tokens: int, seconds: float) -> None:
        """A step that ran: ``rows`` requests, ``tokens`` tokens, ``seconds`` long."""
        if tokens <= rows:
            self._decode = (rows, seconds)
            return
        decodes_s = 0.0 if self._decode is None else min(self._decode[1], seconds)  # rows: some prefill
        self._prompt_token_s = (seconds - decodes_s) / (tokens - rows)
