"""Engine logprobs -> the two OpenAI shapes. Token strings come from the tokenizer's Decode of
each single id (``Upstream.token_texts``); ``-inf`` is sent as -9999.0, as vLLM does."""

import math

from services.common.pb import engine_pb2

_MIN_LOGPROB = -9999.0


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _MIN_LOGPROB


def token_ids_of(logprobs: list[engine_pb2.SampledLogprobs]) -> set[int]:
    """Every id whose text the formatted logprobs need."""
    ids = set()
    for entry in logprobs:
        ids.add(entry.sampled.token_id)
        ids.update(top.token_id for top in entry.top)
    return ids


def chat_content(logprobs: list[engine_pb2.SampledLogprobs], texts: dict[int, str]) -> list[dict]:
    """``choices[].logprobs.content`` of a chat completion (or of one chunk)."""
    def item(candidate: engine_pb2.TokenLogprob) -> dict:
        text = texts[candidate.token_id]
        return {"token": text, "logprob": _finite(candidate.logprob), "bytes": list(text.encode())}

    return [{**item(entry.sampled), "top_logprobs": [item(top) for top in entry.top]}
            for entry in logprobs]


class CompletionLogprobs:
    """``choices[].logprobs`` of a text completion, built up step by step; ``text_offset`` counts
    characters from the start of the choice's text (echoed prompt included)."""

    def __init__(self, text_offset: int = 0) -> None:
        self._offset = text_offset

    def format(self, logprobs: list[engine_pb2.SampledLogprobs], texts: dict[int, str], first_id: int | None = None,
               num_top: int | None = None) -> dict:
        """``first_id``: a token before the entries, without a logprob (null, as the first token of an
        echoed prompt); ``num_top``: at most this many alternatives each (default: all the entry has)."""
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        if first_id is not None:
            for key, value in (("tokens", texts[first_id]), ("token_logprobs", None), ("top_logprobs", None),
                               ("text_offset", self._offset)):
                out[key].append(value)
            self._offset += len(texts[first_id])
        for entry in logprobs:
            text = texts[entry.sampled.token_id]
            out["tokens"].append(text)
            out["token_logprobs"].append(_finite(entry.sampled.logprob))
            top = {texts[t.token_id]: _finite(t.logprob) for t in entry.top[:num_top]}
            top.setdefault(text, _finite(entry.sampled.logprob))  # vLLM always lists the sampled one
            out["top_logprobs"].append(top)
            out["text_offset"].append(self._offset)
            self._offset += len(text)
        return out


def prompt_logprobs(entries: list[engine_pb2.SampledLogprobs], texts: dict[int, str], num_top: int) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: None for the first prompt token, then per token ``{id: {logprob, rank,
    decoded_token}}`` for the prompt token and its ``num_top`` most likely alternatives."""
    def item(candidate: engine_pb2.TokenLogprob, rank: int) -> dict:
        return {"logprob": _finite(candidate.logprob), "rank": rank, "decoded_token": texts[candidate.token_id]}

    out: list[dict | None] = [None]
    for entry in entries:
        alternatives = {str(entry.sampled.token_id): item(entry.sampled, entry.sampled_rank)}
        for rank, top in enumerate(entry.top[:num_top], start=1):
            alternatives.setdefault(str(top.token_id), item(top, rank))
        out.append(alternatives)
    return out


def merge_completion(parts: list[dict]) -> dict | None:
    """Concatenates the per-step dicts of one choice (for a non-streamed response)."""
    if not parts:
        return None
    return {key: [value for part in parts for value in part[key]] for key in parts[0]}
