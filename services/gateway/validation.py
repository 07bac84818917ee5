"""Request validation: OpenAI bodies -> one validated ``GenerationParams``. The rules of the API
itself (n, stop strings, messages, stream options, limits) raise an ``OpenAIError`` (400/404) naming
the parameter here; the rules on sampling values, token ids and lengths are the engine's (its
SamplingParams and EngineCore.validate), whose refusal comes back naming its parameter, which
``GenerationParams.request_param`` turns into the client's field name.

Every value must also fit the engine's protobuf field (a float32, a uint32), or the request would
fail as a 500 when it is encoded. Rules follow vLLM where OpenAI is silent: ``top_k`` -1 or 0 is
off, and past the vocabulary it is the whole vocabulary; ``n`` > 1 with greedy sampling
(temperature 0) is refused, as vLLM does ("n must be 1 when using greedy sampling"); with a
``seed`` and ``n`` > 1, choice i samples with ``seed + i`` (vLLM's parallel sampling).
"""

import math
from dataclasses import dataclass, field

from services.common.pb import engine_pb2
from services.gateway import errors
from services.gateway.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, SamplingFields
from services.gateway.structured_output import Constraint, request_constraint

MAX_TOP_LOGPROBS = 20  # OpenAI's and vLLM's cap on chat top_logprobs
_UINT64 = 1 << 64
_UINT32 = 1 << 32
_INT32 = 1 << 31
_FLOAT32_MAX = 3.4028234663852886e38  # the engine's sampling floats are protobuf floats


@dataclass(frozen=True)
class ModelFacts:
    """What validation needs to know about the served model (from the engine and tokenizer)."""
    name: str
    max_model_len: int
    eos_token_ids: frozenset[int] = frozenset()
    generate_many: bool = False  # the engine answers GenerateMany (a router does not)
    default_max_tokens: int | None = None  # the model's, for a request without max_tokens (generation_config.json)
    default_temperature: float = 1.0  # the model's, for a request without temperature (generation_config.json)
    aliases: tuple[str, ...] = ()  # more names clients may send for it (--served-model-name's after the first)

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    def answering_as(self, requested: str | None) -> str:
        """The name a response carries: the one the request sent, as vLLM echoes it (the first by default)."""
        return requested if requested in self.aliases else self.name


@dataclass(frozen=True)
class Limits:
    """Per-request caps, each set by a gateway flag.

    ``max_sequences_per_request`` bounds what one call fans out to (n x prompts): each sequence is
    a Generate stream and a seat in an engine's batch or queue. 256 stays below one engine's default
    capacity (--max-num-seqs 64 + --max-waiting-requests 256), so a lone request is never refused
    by a default engine as overload (503, retried) when it could never fit at all."""
    max_n: int = 16
    max_stop_strings: int = 16
    max_prompts: int = 64
    max_body_bytes: int = 8 << 20
    max_sequences_per_request: int = 256


@dataclass
class GenerationParams:
    """A validated request, independent of any one prompt."""
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    continuous_usage_stats: bool = False
    max_tokens: int | None = None  # None: the rest of the context
    max_tokens_param: str = "max_tokens"
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    num_logprobs: int | None = None  # top alternatives per token; None: no logprobs
    num_prompt_logprobs: int | None = None  # per prompt token (echo with logprobs, prompt_logprobs); None: none
    echo: bool = False
    echo_only: bool = False  # echo with max_tokens 0: the prompt alone (one token generated, not shown)
    cache_salt: str = ""
    sampling: dict = field(default_factory=dict)  # engine SamplingParams fields that were set
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    constraint: Constraint | None = None  # structured output, the same for every choice
    logprobs_param: str = "logprobs"  # chat's is top_logprobs
    reasoning_end_token_id: int | None = None  # --reasoning-parser: the thinking's end, for usage's reasoning_tokens

    def request_param(self, engine_param: str | None) -> str | None:
        """The client's name for the field an engine refusal names (the engine speaks of max_tokens,
        logprobs and structured_output whatever the request called them)."""
        renamed = {"max_tokens": self.max_tokens_param, "logprobs": self.logprobs_param,
                   "structured_output": self.constraint.param if self.constraint else None}
        return renamed.get(engine_param) or engine_param

    def is_greedy(self, default_temperature: float = 1.0) -> bool:
        """Whether the engine will decode greedily: the request's temperature, else the model's default, is 0."""
        return self.sampling.get("temperature", default_temperature) == 0.0

    def sampling_proto(self, choice_index: int) -> engine_pb2.SamplingParams:
        """The engine's sampling params of choice ``choice_index`` (its own seed when seeded)."""
        proto = engine_pb2.SamplingParams(**self.sampling)
        if self.seed is not None:
            proto.seed = (self.seed + choice_index) % _UINT64
        if self.num_logprobs is not None:
            proto.logprobs = self.num_logprobs
        if self.num_prompt_logprobs is not None:
            proto.prompt_logprobs = self.num_prompt_logprobs
        return proto

    def stop_proto(self, max_tokens: int) -> engine_pb2.StopCriteria:
        return engine_pb2.StopCriteria(max_tokens=max_tokens, min_tokens=self.min_tokens,
                                       stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos)


def _check(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise errors.bad_request(message, param=param)


def _check_finite(value: float | None, param: str) -> None:
    _check(value is None or (math.isfinite(value) and abs(value) <= _FLOAT32_MAX),
           f"{param} must be a finite number, got {value}.", param)


def check_token_ids(ids: list[int], param: str) -> None:
    """400 for an id the engine's and the tokenizer's uint32 fields cannot carry (each side refuses ids
    past its vocabulary itself)."""
    bad = [i for i in ids if not 0 <= i < _UINT32]
    _check(not bad, f"{param} must be token ids, got {bad[:1]}.", param)


def check_model(requested: str | None, facts: ModelFacts) -> None:
    if requested is not None and requested not in facts.names:
        raise errors.model_not_found(requested)


def _common(req: SamplingFields, facts: ModelFacts, limits: Limits) -> GenerationParams:
    check_model(req.model, facts)
    params = GenerationParams()
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        _check_finite(getattr(req, name), name)

    _check(1 <= req.n <= limits.max_n, f"n must be between 1 and {limits.max_n}, got {req.n}.", "n")
    _check_sequences(req.n, 1, limits)
    params.n = req.n
    params.constraint = request_constraint(req)
    _check(req.stream or req.stream_options is None,
           "Stream options can only be defined when `stream=True`.", "stream_options")
    params.stream = req.stream
    if req.prompt_logprobs is not None:
        _check(0 <= req.prompt_logprobs < _UINT32,
               f"prompt_logprobs must be non-negative, got {req.prompt_logprobs}.", "prompt_logprobs")
        _check(not req.stream, "`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
        params.num_prompt_logprobs = req.prompt_logprobs
    if req.stream_options is not None:
        params.include_usage = bool(req.stream_options.include_usage)
        params.continuous_usage_stats = bool(req.stream_options.continuous_usage_stats)

    # The sampling rules themselves (ranges, max_tokens against the context, token ids against the
    # vocabulary) are the engine's SamplingParams' and EngineCore.validate's; a refusal comes back as
    # INVALID_ARGUMENT naming its parameter (`request_param` renames it to the client's field).
    # Here only what the protobuf fields can carry is checked, or encoding the request would fail.
    sampling = params.sampling
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        if getattr(req, name) is not None:
            sampling[name] = getattr(req, name)
    if req.top_k is not None:  # past 32 bits: still past the vocabulary (all of it), or still below -1
        sampling["top_k"] = min(max(req.top_k, -_INT32), _INT32 - 1)
    if req.logit_bias:
        sampling["logit_bias"] = _logit_bias(req.logit_bias)
    _check(not (params.is_greedy(facts.default_temperature) and req.n > 1),
           f"n must be 1 when using greedy sampling, got {req.n}.", "n")
    if req.seed is not None:  # vLLM's range, a signed 64-bit integer (a larger one was wrapped, seed 2**64 as 0)
        _check(-_UINT64 // 2 <= req.seed < _UINT64 // 2,
               f"seed must be a 64-bit signed integer (from -2**63 to 2**63 - 1), got {req.seed}.", "seed")
        params.seed = req.seed % _UINT64

    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    _check(len(stops) <= limits.max_stop_strings,
           f"At most {limits.max_stop_strings} stop strings are allowed, got {len(stops)}.", "stop")
    _check(all(stops), "Stop strings must not be empty.", "stop")
    params.stop = stops
    params.include_stop_str_in_output = req.include_stop_str_in_output
    params.skip_special_tokens = req.skip_special_tokens

    ids = list(req.stop_token_ids or [])
    check_token_ids(ids, "stop_token_ids")
    params.stop_token_ids = ids
    params.ignore_eos = req.ignore_eos
    _check(0 <= req.min_tokens < _UINT32, f"min_tokens must be non-negative, got {req.min_tokens}.", "min_tokens")
    params.min_tokens = req.min_tokens
    params.cache_salt = req.cache_salt or ""
    return params


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
    out = {}
    for key, value in bias.items():
        try:
            token_id = int(key)
        except ValueError:
            raise errors.bad_request(f"logit_bias keys must be token ids, got {key!r}.", "logit_bias")
        _check(0 <= token_id < _UINT32, f"logit_bias keys must be token ids, got {key!r}.", "logit_bias")
        _check_finite(value, "logit_bias")
        out[token_id] = value
    return out


def _max_tokens(params: GenerationParams, value: int | None, param: str) -> None:
    if value is None:
        return
    _check(0 <= value < _UINT32, f"{param} must be at least 1, got {value}.", param)
    params.max_tokens, params.max_tokens_param = value, param


def check_continuation(add_generation_prompt: bool, continue_final_message: bool) -> None:
    """A chat either opens a new assistant turn or continues its final message, as vLLM requires."""
    _check(not (add_generation_prompt and continue_final_message), "Cannot set both `continue_final_message` and "
           "`add_generation_prompt` to true: set add_generation_prompt to false to continue the final message.",
           "continue_final_message")


def check_messages(messages: list[ChatMessage]) -> None:
    """At least one message, and text content only."""
    _check(len(messages) > 0, "messages must contain at least one message.", "messages")
    for i, message in enumerate(messages):
        if isinstance(message.content, list):
            for part in message.content:
                _check(part.type == "text" and part.text is not None,
                       f"Only text content parts are supported, got {part.type!r}.",
                       f"messages.[{i}].content")


def validate_chat(req: ChatCompletionRequest, facts: ModelFacts, limits: Limits) -> GenerationParams:
    params = _common(req, facts, limits)
    check_messages(req.messages)
    check_continuation(req.add_generation_prompt, req.continue_final_message)
    if req.max_completion_tokens is not None:
        _max_tokens(params, req.max_completion_tokens, "max_completion_tokens")
    else:
        _max_tokens(params, req.max_tokens, "max_tokens")
    if req.top_logprobs is not None:
        _check(bool(req.logprobs), "when using `top_logprobs`, `logprobs` must be set to true.",
               "top_logprobs")
        _check(0 <= req.top_logprobs <= MAX_TOP_LOGPROBS,  # OpenAI's cap; the engine's --max-logprobs is its own
               f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {req.top_logprobs}.", "top_logprobs")
    if req.logprobs:
        params.num_logprobs = req.top_logprobs or 0
    params.logprobs_param = "top_logprobs"
    return params


def validate_completion(req: CompletionRequest, facts: ModelFacts, limits: Limits) -> GenerationParams:
    params = _common(req, facts, limits)
    _check(req.suffix is None, "suffix is not currently supported.", "suffix")
    _check(req.best_of is None or req.best_of == req.n,
           f"best_of is not supported (use n); got best_of={req.best_of}, n={req.n}.", "best_of")
    _max_tokens(params, req.max_tokens, "max_tokens")
    if req.echo and req.max_tokens == 0:  # OpenAI's scoring request, as vLLM serves it: one token, not shown
        params.max_tokens, params.echo_only = 1, True
    if req.logprobs is not None:
        _check(0 <= req.logprobs < _UINT32, f"logprobs must be non-negative, got {req.logprobs}.", "logprobs")
        params.num_logprobs = req.logprobs
        if req.echo:  # the echoed prompt's tokens come with their logprobs too
            params.num_prompt_logprobs = max(req.logprobs, params.num_prompt_logprobs or 0)
    params.echo = req.echo
    prompts = completion_prompts(req)
    _check(0 < len(prompts) <= limits.max_prompts,
           f"prompt must hold between 1 and {limits.max_prompts} prompts, got {len(prompts)}.", "prompt")
    _check_sequences(params.n, len(prompts), limits)
    for prompt in prompts:  # ids past the vocabulary are the engine's to refuse; these cannot be encoded
        _check(not isinstance(prompt, list) or not prompt or (min(prompt) >= 0 and max(prompt) < _UINT32),
               "Token ids in prompt must be non-negative 32-bit integers.", "prompt")
    return params


def _check_sequences(n: int, num_prompts: int, limits: Limits) -> None:
    num_sequences = n * num_prompts
    _check(num_sequences <= limits.max_sequences_per_request,
           f"This request asks for {num_sequences} sequences (n={n} x {num_prompts} prompts); at most "
           f"{limits.max_sequences_per_request} are allowed per request (--max-sequences-per-request).", "n")


def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    """The prompt field as a list of prompts, each a text or a list of token ids."""
    prompt = req.prompt
    if isinstance(prompt, str):
        return [prompt]
    if prompt and isinstance(prompt[0], int):
        return [list(prompt)]
    return list(prompt)


def resolve_max_tokens(params: GenerationParams, num_prompt_tokens: int, facts: ModelFacts) -> int:
    """The max_tokens of one prompt: the requested one, else the rest of the context (at least 1: a
    prompt that fills the context is the engine's to refuse, with vLLM's message), capped by the
    model's default max_tokens when it has one."""
    if params.max_tokens is not None:
        return params.max_tokens
    rest = max(facts.max_model_len - num_prompt_tokens, 1)
    return rest if facts.default_max_tokens is None else min(rest, facts.default_max_tokens)
