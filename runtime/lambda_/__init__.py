"""The AWS Lambda runtime: dense and expert functions (`handlers.py`, `model.py`), the K/V a function
keeps (`kv.py`), the generation loop's state (`decode.py`, `state.py`), the OpenAI front over
StartSyncExecution (`front.py`), the request cost model (`request_cost.py`, also run by
`moeplan simulate`) and the billing rule it and the planner price with (`charges.py`), the wire format and the local stand-in for containers (`wire.py`, `worker.py`).
Shipped in Lambda bundles only."""
