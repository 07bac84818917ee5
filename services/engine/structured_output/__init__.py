"""Structured output: the engine keeps each constrained request's tokens inside its constraint (a JSON
schema, a regex, a list of choices, a Lark or GBNF grammar), with llguidance.

`constraint.py` reads the constraint off the wire; `grammars.py` compiles it against the checkpoint's
own tokenizer, cached by key, and makes one matcher per request; `masks.py` fills the allowed-token
bitmask of every constrained request of a step while the model runs and applies it before sampling.
The scheduler advances a request's matcher with each token it accepts (`Request.grammar`).

Why llguidance rather than xgrammar (measured on the built-in model, a 20-property schema, one run):
grammar from the schema and matcher 1.8 ms vs 3.0-3.7 ms compile; a mask 9 us median vs 1.7 us
(both far below a step, and filled while the model runs); it reads `tokenizer.json` itself and has no
dependencies (xgrammar needs transformers and apache-tvm-ffi at run time), and it takes Lark grammars
as well as GBNF.
"""
