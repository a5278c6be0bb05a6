"""Running bundles on this machine: `moeplan run`, `serve` and `calibrate` start them here.

Not code generation (backends/ writes bundles; these run them): torchrun bundles' ranks
(`torchrun_launch.py`, the service `torchrun_serve.py`) and their check against the source model
(`torchrun_verify.py`); Lambda bundles over a local cloud (`lambda_cloud.py`: S3, Invoke,
StartSyncExecution, with the state-machine interpreter `lambda_asl.py`), run and verified by
`lambda_run.py`, served over HTTP by `lambda_serve.py`.
"""
