"""The vllm target: `vllm serve` with expert parallelism, the plan's layout and its EPLB window (vLLM 0.32 loads no
placement file)."""
