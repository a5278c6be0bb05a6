"""The serving-engine targets' passes (sglang, vllm, trtllm): decoder layers, the deployment, placement with the
engines' defaults, vLLM's EPLB window from the trace's drift, plan."""
