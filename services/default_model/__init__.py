"""The built-in default checkpoint (`model.py`: built offline on first use), its training corpus
(`corpus.txt`) and `strata model init` (`cli.py`)."""
