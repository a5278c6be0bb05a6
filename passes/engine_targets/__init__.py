"""The serving-engine targets' passes (sglang, trtllm): decoder layers, placement with the engines' defaults, plan."""
