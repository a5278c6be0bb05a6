"""Per-rank expert caches: the bounded pool and its backing store (`expert_cache.py`,
`expert_store.py`), host compute on a miss, live speculation, and the decisions the planner's
simulator imports from here (`policies.py`, `next_use.py`, `prefetch.py`, `stepper.py`,
`eam_match.py`). Shipped only in bundles whose plan has expert caches."""
