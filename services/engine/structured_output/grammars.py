"""Constraints compiled against the checkpoint's tokenizer, cached by key, and one matcher per request.

The tokenizer is the one the tokenizer service serves (`CheckpointTokenizer`: the checkpoint's
`tokenizer.json` with the changes transformers makes on load), so the token bytes the matcher reasons
about are the bytes the client will read. Its EOS ids are the engine's own (the ids that end a
request), and its vocabulary is the model's (ids past the tokenizer's are never allowed).

Compiling a constraint gives llguidance's grammar and a pristine matcher over it; that pair is
cached by the constraint's key (most recently used kept), so a repeated schema costs a matcher copy.
An invalid constraint raises InvalidRequestError naming the problem, before the request is queued.
"""

import json
import logging
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from services.common.errors import InvalidRequestError
from services.engine.structured_output.constraint import Constraint

log = logging.getLogger(__name__)

# JSON is generated compact (as OpenAI's structured outputs are): free whitespace would let a model
# pad its output with blanks until max_tokens.
_JSON_OPTIONS = {"whitespace_flexible": False}
_MAX_SOURCE_CHARS = 1 << 20  # a constraint longer than this is refused (compilation cost grows with it)


@dataclass
class GrammarStats:
    """What the compiler did since its stats were last taken (`GrammarCompiler.take_stats`)."""
    compile_seconds: list[float] = field(default_factory=list)
    cache_queries: int = 0
    cache_hits: int = 0


class GrammarCompiler:
    def __init__(self, model_dir: str, vocab_size: int, eos_token_ids: Sequence[int], cache_size: int = 256) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.cache_size = cache_size
        self._tokenizer = None
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()  # key -> pristine LLMatcher
        self._lock = threading.Lock()  # compile() runs on the gRPC threads, matcher() on the engine thread
        self._stats = GrammarStats()

    @property
    def tokenizer(self):
        """The llguidance tokenizer, built on first use (a checkpoint without constrained requests never pays)."""
        if self._tokenizer is None:
            self._tokenizer = _load_tokenizer(self.model_dir, self.vocab_size, self.eos_token_ids)
        return self._tokenizer

    def compile(self, constraint: Constraint, counted: bool = True):
        """The pristine matcher of ``constraint``, compiled or from the cache; raises InvalidRequestError.
        ``counted``: a lookup the cache metrics count (a request's first; `matcher` looks again)."""
        with self._lock:
            self._stats.cache_queries += counted
            cached = self._cache.get(constraint.key)
            if cached is not None:
                self._cache.move_to_end(constraint.key)
                self._stats.cache_hits += counted
                return cached
        started = time.perf_counter()
        matcher = self._compile(constraint)
        elapsed = time.perf_counter() - started
        with self._lock:
            self._stats.compile_seconds.append(elapsed)
            self._cache[constraint.key] = matcher
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return matcher

    def take_stats(self) -> GrammarStats:
        with self._lock:
            taken, self._stats = self._stats, GrammarStats()
        return taken

    def matcher(self, constraint: Constraint):
        """A new matcher for one request, at the start of its output (its constraint was compiled when the
        request was checked, so this is a cache hit unless it was evicted meanwhile)."""
        return self.compile(constraint, counted=False).deep_copy()

    def _compile(self, constraint: Constraint):
        from llguidance import LLMatcher

        if len(constraint.source) > _MAX_SOURCE_CHARS:
            raise InvalidRequestError(f"the structured output constraint is too long ({len(constraint.source)} "
                                      f"characters; at most {_MAX_SOURCE_CHARS})")
        grammar = _grammar(constraint)
        error = LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise InvalidRequestError(f"invalid {_NAMES[constraint.kind]}: {error.strip()}")
        matcher = LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"invalid {_NAMES[constraint.kind]}: {matcher.get_error()}")
        return matcher


_NAMES = {"json_schema": "JSON schema", "json_object": "JSON object constraint", "regex": "regex",
          "choice": "choice", "grammar": "grammar"}


def _grammar(constraint: Constraint) -> str:
    """llguidance's grammar for the constraint (not yet checked)."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    kind, source = constraint.kind, constraint.source
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
    if kind == "json_schema":
        try:
            schema = json.loads(source)
        except json.JSONDecodeError as error:
            raise InvalidRequestError(f"invalid JSON schema: not JSON ({error})") from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequestError(f"invalid JSON schema: a schema is an object or a boolean, "
                                      f"not {type(schema).__name__}")
        return LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(source)
    if kind == "choice":
        choices = json.loads(source)
        if not choices:
            raise InvalidRequestError("invalid choice: the list of choices is empty")
        # Lark string literals take JSON's escapes, so each choice is matched exactly as written.
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices))
    try:
        return LLMatcher.grammar_from_lark(any_to_lark(source))  # Lark as it is; GBNF (`::=`) converted
    except Exception as error:  # the GBNF converter's parse errors
        raise InvalidRequestError(f"invalid grammar: {error}") from None


def _load_tokenizer(model_dir: str, vocab_size: int, eos_token_ids: list[int]):
    from llguidance import LLTokenizer

    from services.tokenizer.checkpoint_tokenizer import CheckpointTokenizer

    try:
        backend = CheckpointTokenizer.from_dir(model_dir).backend
    except (OSError, ValueError) as error:
        raise InvalidRequestError(f"structured output needs the checkpoint's tokenizer, which did not load: "
                                  f"{error}") from None
    with tempfile.TemporaryDirectory() as tmp:  # llguidance reads a tokenizer.json from a path
        path = Path(tmp) / "tokenizer.json"
        path.write_text(backend.to_str())
        # The model's ids, or the tokenizer's where it has more (ids the model lacks never get a logit).
        n_vocab = max(vocab_size, backend.get_vocab_size(with_added_tokens=True))
        tokenizer = LLTokenizer(str(path), n_vocab=n_vocab, eos_token=eos_token_ids or None)
    log.info("structured output: tokenizer of %d ids loaded (eos %s)", tokenizer.vocab_size, tokenizer.eos_tokens)
    return tokenizer
