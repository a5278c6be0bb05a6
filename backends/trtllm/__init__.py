"""The trtllm target: a static TensorRT-LLM MoE load-balancer configuration and its launch command."""
