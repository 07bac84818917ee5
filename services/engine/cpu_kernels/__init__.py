"""Native CPU kernels for the engine's hot paths (C++ with OpenMP, see ``build``), each beside the
pure-torch code it replaces, which stays the fallback and the reference in tests."""
