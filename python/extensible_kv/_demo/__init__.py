"""The demo behind `python -m extensible_kv demo`: transformers' continuous batching on its own
KV cache and on extensible-kv's, side by side (`serve`), and its command line (`cli`).

Not the library's API: it needs torch and transformers (the `demo` extra) and exists to show
the integration end to end. A serving stack imports `extensible_kv` itself.
"""
