"""The bundle's inference service: an OpenAI-compatible HTTP front on rank 0 over continuous
batching under expert parallelism (issue 29). `contract.py` is the seam between the two halves."""
