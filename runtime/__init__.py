"""moeplan's runtime: the code bundles ship and run, copied verbatim next to their weights.

It never imports the planner: a bundle runs without moeplan installed. Modules use only
relative imports, so the same files work as `moeplan.runtime` and as a bundle's top-level
`runtime` package (`python -m runtime.serve`). A bundle ships these top-level modules and whole
subpackages (backends/common/files.py):

* top level, in every bundle: the rank entry (`serve.py`), reading a bundle (`bundle_io.py`,
  `checkpoint_reader.py`), prompt text (`text_codec.py`), counters and results;
* `model/`: the library's model with its MoE blocks replaced; `ep/`: expert parallelism (the
  engine, the exchanges, the replica rule); `serving/`: the inference service and its batch worker,
  the one generation loop (static runs too); torchrun and Kubernetes bundles ship these three;
* `offload/`: per-rank expert caches, only in bundles whose plan has them;
* `lambda_/`: the Lambda functions and front, in Lambda bundles (with `model/`, `ep/`, `serving/`).

What it imports outside the standard library: torch, numpy and safetensors; transformers for
Hugging Face models (and tokenizers, jinja2 for prompt text and chat templates, where the bundle
has a tokenizer); starlette and uvicorn for the HTTP server of `serving/` (rank 0 with `--serve`);
boto3 in the Lambda functions and front.
"""
