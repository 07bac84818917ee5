"""Benchmarks, `strata bench <tool>` (the tools: `services.bench.__main__.TOOLS`): `serve` (a running
server over HTTP), `offline` (the engine in-process), `overhead` (the stack against the engine
in-process), `routing` (cache-aware against round-robin), `structured` (constrained against free
streams), `compare` (two results side by side), `llamacpp` (the llama.cpp baseline). Importing this
package loads no torch."""
