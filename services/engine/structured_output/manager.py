"""The engine's structured output in one place: constraints checked and compiled (cached), a matcher
per request, the masks of each step (as vLLM's StructuredOutputManager).

Nothing here is built until the first constrained request: llguidance is imported then, and the
checkpoint's tokenizer loaded.
"""

from services.common.errors import InvalidRequestError
from services.engine.scheduler_output import ScheduledChunk
from services.engine.structured_output.constraint import Constraint
from services.engine.structured_output.grammars import GrammarCompiler, GrammarStats
from services.engine.structured_output.masks import MaskFiller, MaskStats, StepMasks


class StructuredOutputManager:
    def __init__(self, model_dir: str, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.compiler = GrammarCompiler(model_dir, vocab_size, eos_token_ids)
        self._filler: MaskFiller | None = None

    def check(self, constraint: Constraint) -> None:
        """Compiles ``constraint`` (or finds it cached); raises InvalidRequestError naming what is wrong
        (its parameter: ``structured_output``, which the gateway maps to the field the client used)."""
        try:
            self.compiler.compile(constraint)
        except InvalidRequestError as error:
            raise InvalidRequestError(str(error), param="structured_output") from None

    def matcher(self, constraint: Constraint):
        """A new matcher for a request's output (``Request.grammar``)."""
        return self.compiler.matcher(constraint)

    def start_masks(self, chunks: list[ScheduledChunk]) -> StepMasks | None:
        """Starts filling the masks of the step's constrained requests that sample (None: there are none)."""
        if not any(c.request.grammar is not None for c in chunks):
            return None
        if self._filler is None:
            self._filler = MaskFiller(self.compiler)
        return self._filler.start(chunks)

    def take_stats(self) -> tuple[GrammarStats, MaskStats]:
        """What happened since the last call: compilations, cache lookups, mask fill and wait times."""
        return self.compiler.take_stats(), self._filler.stats.take() if self._filler else MaskStats()
