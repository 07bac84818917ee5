"""The allowed-token masks of a step's constrained requests: filled while the model runs, applied
before sampling.

`MaskFiller.start(chunks)` is called before the forward pass: it hands the matchers of the requests
that sample in this step to a background thread, which fills one bitmask row each (llguidance works
without the GIL, in parallel over rows). `StepMasks.apply(logits, requests)` waits for that and sets
every disallowed logit to -inf, in the rows of the constrained requests only (on the CPU in one native
pass, `cpu_kernels/sampling.py`: 64 rows of a 152k vocabulary took 37 ms through numpy and torch, 2.2 ms
so). The time spent filling
and the part of it the step waited for (not hidden behind the forward) go to the metrics.
"""

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from services.engine.cpu_kernels import sampling
from services.engine.request import Request
from services.engine.scheduler_output import ScheduledChunk
from services.engine.structured_output.grammars import GrammarCompiler


@dataclass
class MaskStats:
    """Per step with constrained requests: seconds filling the masks, and seconds the step waited for them."""
    fill_seconds: list[float] = field(default_factory=list)
    wait_seconds: list[float] = field(default_factory=list)

    def take(self) -> "MaskStats":
        taken = MaskStats(self.fill_seconds, self.wait_seconds)
        self.fill_seconds, self.wait_seconds = [], []
        return taken


class MaskFiller:
    def __init__(self, compiler: GrammarCompiler) -> None:
        from llguidance import LLExecutor

        self.compiler = compiler
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        self._executor = LLExecutor()
        self.stats = MaskStats()

    def start(self, chunks: list[ScheduledChunk]) -> "StepMasks | None":
        """Starts filling the masks of the constrained requests that sample in this step; None if none do."""
        constrained = [c.request for c in chunks if c.samples and c.request.grammar is not None]
        if not constrained:
            return None
        words = (self.compiler.tokenizer.vocab_size + 31) // 32
        bitmask = torch.empty((len(constrained), words), dtype=torch.int32)
        filled = self._thread.submit(self._fill, [r.grammar for r in constrained], bitmask)
        return StepMasks({r.request_id: row for row, r in enumerate(constrained)}, bitmask, filled, self.stats)

    def _fill(self, matchers, bitmask: torch.Tensor) -> None:
        started = time.perf_counter()
        self._executor.unsafe_compute_mask_ptr([(m, row) for row, m in enumerate(matchers)],
                                               bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0])
        self.stats.fill_seconds.append(time.perf_counter() - started)


@dataclass
class StepMasks:
    rows: dict[str, int]  # request id -> its row of the bitmask
    bitmask: torch.Tensor  # [constrained requests, words] int32, bit j of word w: token 32 * w + j allowed
    filled: Future
    stats: MaskStats

    def apply(self, logits: torch.Tensor, requests: list[Request], unprocessed: torch.Tensor) -> None:
        """Sets the disallowed logits of the constrained rows of ``logits`` (row i: ``requests[i]``) to -inf.

        A row left with no finite logit (the constraint allows only what a penalty or min_tokens
        took away, such as EOS before min_tokens) takes its ``unprocessed`` logits, masked: the
        constraint wins."""
        started = time.perf_counter()
        self.filled.result()
        self.stats.wait_seconds.append(time.perf_counter() - started)
        logit_rows = [i for i, r in enumerate(requests) if r.request_id in self.rows]
        if not logit_rows:
            return
        if sampling.can_run(logits) and sampling.can_run(unprocessed):  # one native pass over the rows
            sampling.apply_bitmask(logits, logit_rows, self.bitmask, [self.rows[requests[i].request_id]
                                                                      for i in logit_rows], unprocessed)
            return
        mask_rows = torch.tensor([self.rows[requests[i].request_id] for i in logit_rows])
        bits = np.unpackbits(self.bitmask.index_select(0, mask_rows).numpy().view(np.uint8), axis=1,
                             bitorder="little")[:, :logits.shape[1]]
        disallowed = ~torch.from_numpy(bits).to(torch.bool)
        index = torch.tensor(logit_rows)
        masked = logits.index_select(0, index).masked_fill_(disallowed, float("-inf"))
        emptied = torch.isneginf(masked).all(dim=1)
        if emptied.any():
            fallback = unprocessed.index_select(0, index).masked_fill_(disallowed, float("-inf"))
            masked[emptied] = fallback[emptied]
        logits.index_copy_(0, index, masked)
