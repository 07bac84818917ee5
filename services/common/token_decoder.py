"""A checkpoint's decoding: its tokenizer and the ids that incremental detokenization treats apart.

The tokenizer service builds it from the checkpoint's files and hands it out (the `Decoder` RPC);
the gateway rebuilds it from that reply and detokenizes its streams in-process, with the same
`IncrementalDetokenizer` the service's `Detokenize` runs. One loader of the checkpoint's tokenizer,
no gRPC round trip per generated token.
"""

from collections.abc import Sequence
from dataclasses import dataclass

from tokenizers import Tokenizer

from services.common.detokenizer import IncrementalDetokenizer
from services.common.pb import tokenizer_pb2


@dataclass(frozen=True)
class TokenDecoder:
    """Decodes ids as `tokenizers` does: an id the tokenizer does not have decodes to nothing, as in
    transformers (a model's vocabulary may be larger than its tokenizer's). Read-only, safe to share."""

    backend: Tokenizer
    special_ids: frozenset[int]  # what skip_special_tokens leaves out
    byte_fallback_ids: frozenset[int]  # the <0xNN> ids, when the decoder has ByteFallback

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool) -> str:
        return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def detokenizer(self, skip_special_tokens: bool, prefix_ids: Sequence[int] = ()) -> IncrementalDetokenizer:
        """An incremental decoder of one generation whose text continues after `prefix_ids`."""
        return IncrementalDetokenizer(
            lambda ids: self.backend.decode(ids, skip_special_tokens=skip_special_tokens),
            prefix_ids,
            byte_fallback_ids=self.byte_fallback_ids,
            dropped_ids=self.special_ids if skip_special_tokens else frozenset(),
        )

    def to_proto(self) -> tokenizer_pb2.DecoderResponse:
        return tokenizer_pb2.DecoderResponse(tokenizer_json=self.backend.to_str(),
                                             special_token_ids=sorted(self.special_ids),
                                             byte_fallback_token_ids=sorted(self.byte_fallback_ids))

    @classmethod
    def from_proto(cls, reply: tokenizer_pb2.DecoderResponse) -> "TokenDecoder":
        """Parses the tokenizer JSON (megabytes for a large vocabulary: run it off the event loop)."""
        return cls(Tokenizer.from_str(reply.tokenizer_json), frozenset(reply.special_token_ids),
                   frozenset(reply.byte_fallback_token_ids))
