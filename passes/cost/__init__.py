"""The cost model and what prices with it (issue 38 item 7: one cost-model package).

`cost_model.py`: bytes, messages and seconds per token of a placement under a mode, with the runtime's
replica rule; `by_predicted_time.py`: the mode and the placement policy chosen by predicted time;
`time_prices.py`: the ILP's load cap priced in the profile's seconds; `capacity.py`: the sequences
and context the ranks hold (plan.json `communication.capacity`); `cost_pass.py`: the cost and
placement passes of the torchrun and Kubernetes targets, and the prediction `moeplan run` checks;
`runtime_ops.py`: the runtime's launch counts (counted per model class, or the fitted ones) and their op cost.
`engine/`: what an engine target (sglang, vllm, trtllm) runs, priced op by op from measured kernels
(aiconfigurator-core's database, roofline elsewhere), and the serving prediction of a workload
(docs/engine_pricing.md).
"""
