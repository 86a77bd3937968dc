"""What the tests share besides fixtures (those are in `tests/conftest.py`): the device list and
the CUDA skip reason (`devices`), the stacks' loaders (`stack_env`, `vllm_env`, `sglang_env`),
transformers' fixtures, models and pooled engines (`transformers_fixtures`,
`transformers_models`, `transformers_pool`), the pool's ledgers and members
(`pool_ledgers`, `pool_members`), the settled free memory of a device (`memory`),
vLLM's layouts (`vllm_cases`), an engine core's workers, manager and requests
(`vllm_workers`), the KV cache helpers (`kv_helpers`), the tensor tests' checks
(`tensor_checks`), the spawned command-loop process of the tests that need another process
(`child`), rank processes (`ranks`), the benchmark scripts as modules (`bench_scripts`), the
`/proc/PID/stat` lines both start-time tests read (`proc_stat_lines.txt`), vLLM's own core
tests' pytest plugin, its resize-between-steps cases and the hub config they need
(`vllm_core_plugin`, `vllm_core_resize_cases`, `hf/`), and the Rust integration tests'
`common.rs`. Imported as `from support import ...`: pytest puts `tests/` on
`sys.path`."""
