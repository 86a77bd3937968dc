"""The demo behind `python -m extensible_kv demo`: a small transformer (`model`) decoding on an
extensible KV cache and on a legacy one (`demo`), and its command line (`cli`).

Not the library's API: it needs torch at import and exists to show and check the flow end to
end. A serving stack imports `extensible_kv` itself.
"""
