"""Structured output in the engine, on the built-in model (random weights: every valid output is the
constraint's doing): JSON schemas, regexes, choices and Lark/GBNF grammars hold at temperature 1 for
several seeds, in one batch with unconstrained requests that are not disturbed, through preemption;
a bad constraint is refused before anything is queued; compiled constraints are cached; the masks'
fill and wait times and the cache lookups are counted."""

import json
import re

import jsonschema
import lark
import pytest
import torch
from tokenizers import Tokenizer

from services.common.errors import InvalidRequestError
from services.common.pb import engine_pb2
from services.engine.config import EngineConfig
from services.engine.llm import LLM
from services.engine.protocol import sampling_params_from_proto
from services.engine.request import Request
from services.engine.sampling_params import SamplingParams
from services.engine.scheduler_output import ScheduledChunk
from services.engine.structured_output.constraint import Constraint

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "minItems": 1, "maxItems": 3},
                         "ratio": {"type": "number", "minimum": 0, "maximum": 1}}}
REGEX = r"[a-z]{3,8}@example\.(com|org)"
CHOICES = ["yes", "no", 'a "quoted" one', "ünïcode\n"]
LARK = """start: expr
expr: NUMBER | "(" expr OP expr ")"
OP: "+" | "*"
NUMBER: /[0-9]{1,3}/
"""
GBNF = 'root ::= "[" item ("," item){0,3} "]"\nitem ::= [a-c]+ | "null"'
PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def llm(default_model_dir):
    return LLM(EngineConfig(model=str(default_model_dir), max_num_seqs=16, num_kv_blocks=256, enforce_eager=True))


@pytest.fixture(scope="module")
def decode(default_model_dir):
    tokenizer = Tokenizer.from_file(str(default_model_dir / "tokenizer.json"))
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def constrained(kind: str, source: str, seed: int, max_tokens: int = 300) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens,
                          structured_output=Constraint(kind, source))


def lark_parser(grammar: str) -> lark.Lark:
    return lark.Lark(grammar, start="start", parser="earley", lexer="dynamic")


@pytest.mark.parametrize("kind, source, check", [
    ("json_schema", json.dumps(SCHEMA), lambda text: jsonschema.validate(json.loads(text), SCHEMA)),
    ("json_object", "", lambda text: isinstance(json.loads(text), dict) or pytest.fail(text)),
    ("regex", REGEX, lambda text: re.fullmatch(REGEX, text) or pytest.fail(text)),
    ("choice", json.dumps(CHOICES), lambda text: text in CHOICES or pytest.fail(text)),
    ("grammar", LARK, lambda text: lark_parser(LARK).parse(text)),
    ("grammar", GBNF, lambda text: re.fullmatch(r"\[([a-c]+|null)(,([a-c]+|null)){0,3}\]", text) or pytest.fail(text)),
], ids=["json_schema", "json_object", "regex", "choice", "lark", "gbnf"])
def test_every_output_keeps_to_its_constraint_at_temperature_1(llm, decode, kind, source, check):
    seeds = range(8)
    outputs = llm.generate([PROMPT] * len(seeds), [constrained(kind, source, seed) for seed in seeds])
    if kind == "json_object":  # any object: its keys and strings are unbounded, so a random model may run out
        outputs = [o for o in outputs if o.finish_reason == "stop"]
        assert outputs
    for output in outputs:
        assert output.finish_reason == "stop", (output.finish_reason, decode(output.token_ids))
        check(decode(output.token_ids))
    if kind in ("json_schema", "regex"):  # the seeds matter: not one output for all
        assert len({decode(o.token_ids) for o in outputs}) > 1


def test_constrained_and_free_requests_share_a_batch_without_disturbing_each_other(llm, decode):
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = llm.generate([PROMPT], [free])[0]
    mixed = llm.generate([PROMPT, PROMPT, [9, 10]], [free, constrained("regex", REGEX, 1),
                                                     constrained("json_schema", json.dumps(SCHEMA), 2)])
    assert mixed[0].token_ids == alone.token_ids
    assert re.fullmatch(REGEX, decode(mixed[1].token_ids))
    jsonschema.validate(json.loads(decode(mixed[2].token_ids)), SCHEMA)


def test_greedy_decoding_follows_the_constraint_too(llm, decode):
    output = llm.generate([PROMPT], [SamplingParams(temperature=0.0, max_tokens=300,
                                                    structured_output=Constraint("json_schema", json.dumps(SCHEMA)))])
    jsonschema.validate(json.loads(decode(output[0].token_ids)), SCHEMA)


def test_max_tokens_cuts_a_constrained_output_with_length(llm):
    output = llm.generate([PROMPT], [constrained("json_schema", json.dumps(SCHEMA), 0, max_tokens=3)])[0]
    assert output.finish_reason == "length" and len(output.token_ids) == 3


def test_preempted_requests_resume_their_matchers(default_model_dir, decode):
    # 12 blocks of 16 tokens for 6 requests that grow to 45-85 tokens each: some are preempted and recomputed.
    llm = LLM(EngineConfig(model=str(default_model_dir), max_num_seqs=6, num_kv_blocks=12, enforce_eager=True))
    regex = r"(ab|cd){40}"
    outputs = llm.generate([PROMPT] * 6, [constrained("regex", regex, seed, max_tokens=100) for seed in range(6)])
    assert llm.core.stats().num_preemptions > 0
    for output in outputs:
        assert output.finish_reason == "stop" and re.fullmatch(regex, decode(output.token_ids))


@pytest.mark.parametrize("kind, source, message", [
    ("json_schema", '{"type": "object", "properties": {"a": {"type": "strin"}}}', "invalid JSON schema"),
    ("json_schema", "{not json", "not JSON"),
    ("json_schema", "[1, 2]", "a schema is an object or a boolean"),
    ("regex", "a(b", "unclosed group"),
    ("grammar", "start: foo", 'unknown name: "foo"'),
    ("grammar", 'root ::= "a" (', "invalid grammar"),
    ("choice", "[]", "the list of choices is empty"),
])
def test_a_bad_constraint_is_refused_before_anything_is_queued(llm, kind, source, message):
    with pytest.raises(InvalidRequestError, match=re.escape(message)):
        llm.core.add_request("bad", PROMPT, constrained(kind, source, 0))
    assert not llm.core.has_unfinished_requests()


def test_compiled_constraints_are_cached_and_the_masks_timed(llm):
    manager = llm.core.structured_output
    manager.take_stats()
    schema = json.dumps({"type": "object", "properties": {"k": {"enum": [1, 2, 3]}}, "required": ["k"]})
    llm.generate([PROMPT] * 3, [constrained("json_schema", schema, seed) for seed in range(3)])
    grammars, masks = manager.take_stats()
    # One lookup per request (when it is checked; the matcher it gets when queued is not counted again).
    assert len(grammars.compile_seconds) == 1 and grammars.cache_queries == 3 and grammars.cache_hits == 2
    assert masks.fill_seconds and len(masks.wait_seconds) == len(masks.fill_seconds)
    llm.generate([PROMPT], [constrained("json_schema", schema, 9)])
    grammars, _ = manager.take_stats()
    assert grammars.compile_seconds == [] and grammars.cache_hits == grammars.cache_queries == 1


def test_the_constraint_travels_in_the_generate_request():
    def params(**structured_output):
        request = engine_pb2.GenerateRequest(prompt_token_ids=[1], stop=engine_pb2.StopCriteria(max_tokens=4),
                                             structured_output=engine_pb2.StructuredOutput(**structured_output))
        return sampling_params_from_proto(request).structured_output

    assert params() is None
    assert params(json_schema='{"type": "string"}') == Constraint("json_schema", '{"type": "string"}')
    assert params(json_object=True) == Constraint("json_object", "")
    assert params(regex="a+") == Constraint("regex", "a+")
    assert params(choice=engine_pb2.Choices(choices=["x", "y"])) == Constraint("choice", '["x", "y"]')
    assert params(grammar="start: /a+/") == Constraint("grammar", "start: /a+/")


def test_eos_is_allowed_exactly_where_the_constraint_may_end(llm, default_model_dir):
    tokenizer = Tokenizer.from_file(str(default_model_dir / "tokenizer.json"))
    request = Request("eos", PROMPT, SamplingParams())
    request.num_computed_tokens = request.num_tokens  # its prompt is in the cache: it samples next
    request.grammar = llm.core.structured_output.matcher(Constraint("choice", json.dumps(["ab", "abab"])))
    eos = list(llm.core.eos_token_ids)  # the engine's own EOS ids: each ends the request

    def allowed() -> torch.Tensor:
        masks = llm.core.structured_output.start_masks([ScheduledChunk(request, 0, [])])  # samples: nothing new
        logits = torch.zeros(1, llm.core.vocab_size)
        masks.apply(logits, [request], unprocessed=logits.clone())
        return torch.isfinite(logits[0])

    assert not allowed()[eos].any() and allowed().sum() > 0  # nothing chosen yet: no end
    for token in tokenizer.encode("ab", add_special_tokens=False).ids:
        assert allowed()[token]
        assert request.grammar.consume_token(token)
    after_ab = allowed()
    assert after_ab[eos].all() and after_ab[tokenizer.encode("ab", add_special_tokens=False).ids[0]]  # end, or go on


def test_a_constraint_that_starts_after_some_tokens_leaves_those_before_free(llm, decode):
    """A reasoning model's answer keeps to the constraint, its thinking does not: the tokens up to the
    end-of-thinking ones are what the free model writes, the rest is the constraint's."""
    free = llm.generate([PROMPT], [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)])[0].token_ids
    end = tuple(free[3:5])  # where the free output has them (a thought's end tag)
    after = Constraint("regex", REGEX, starts_after=end)
    output = llm.generate([PROMPT], [SamplingParams(temperature=0.0, max_tokens=60, structured_output=after)])[0]
    assert output.token_ids[:5] == free[:5]
    assert re.fullmatch(REGEX, decode(output.token_ids[5:])) and output.finish_reason == "stop"
    never = Constraint("regex", REGEX, starts_after=(free[0], free[0], free[0]))  # never written: never applies
    unconstrained = llm.generate([PROMPT], [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                                           structured_output=never)])[0]
    assert unconstrained.token_ids == free


def test_starts_after_travels_in_the_generate_request_and_is_checked(llm):
    request = engine_pb2.GenerateRequest(prompt_token_ids=[1], stop=engine_pb2.StopCriteria(max_tokens=4),
                                         structured_output=engine_pb2.StructuredOutput(regex="a+", starts_after=[7, 8]))
    assert sampling_params_from_proto(request).structured_output == Constraint("regex", "a+", (7, 8))
    with pytest.raises(InvalidRequestError, match=r"starts_after must be in \[0, \d+\), got \[-1\]"):
        llm.core.add_request("bad", PROMPT, SamplingParams(structured_output=Constraint("regex", "a+", (-1,))))
