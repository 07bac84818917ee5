"""The tokenizer service: encode, chat templates, decode and incremental detokenization over gRPC.

`CheckpointTokenizer` (checkpoint_tokenizer.py) is the domain object; server.py is the thin gRPC
layer; run it with `python -m services.tokenizer --model DIR --port P`. Imports neither torch nor
transformers.
"""
