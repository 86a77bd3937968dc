"""An example outside the package: the seed's own path end to end. A small decoder-only
transformer (`model`, seeded random weights, paged attention in plain torch) decodes on a
`KVCacheFlow` of one of our layouts (the hybrid Mamba cache with `--hybrid`) extended after its
decode step was captured, and on a legacy cache (`demo`); its command line is `cli`:

    cd examples && python -m decoder --layout FLASHINFER

It needs torch and exists to show and check the flow end to end; `tests/test_demo.py` runs it.
"""
