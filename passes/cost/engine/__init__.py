"""What an engine target (sglang, vllm, trtllm) runs, priced op by op.

The step is composed here, layer by layer as the engine's model code runs it (`step.py`), each op is
priced from aiconfigurator-core's measured kernel tables where they cover it (`measured.py`) and by
the roofline of the hardware profile elsewhere (`roofline.py`), and the MoE op of each rank is priced
at that rank's own token count under the plan's placement of the real trace (`rank_rows.py`).
`serving.py` turns steps into a workload's TPOT, TTFT, throughput and memory per GPU.
"""
