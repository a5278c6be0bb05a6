"""The cost model's package: what a plan's deployment will take, in seconds and bytes (issue 38 item 7)."""
