"""Which expert loads read disk and which copy from host memory: the simulator's tier split.

Why: a rank holds its plan's host-tier keys in host memory from the start (the runtime preloads
them, runtime/offload/expert_store.py) and reads every other key from disk at each load, which
is the planner's timing model (`Timing.copy_s`: NVMe first only for keys outside `host_keys`).
So the split of a run's loads follows from the loaded keys alone: a load of a host key is a host
copy, any other load a disk read. `LoadRecorder` collects the loaded keys from a simulation
without changing it (it wraps the policy, whose `inserted` the driver calls once per load, demand
or prefetch), and `tier_split` counts them. Deterministic: the same stream gives the same split.
"""
from __future__ import annotations

TIER_COUNTERS = ("disk_loads", "disk_bytes", "host_loads", "host_bytes")


class LoadRecorder:
    """A policy that records every key the simulator loads and otherwise is `policy` itself.

    The initial fill (`start`) is not recorded: residents are in place before the stream."""

    def __init__(self, policy):
        self._policy = policy
        self.loaded = []

    def inserted(self, key: int, r: int) -> None:
        self.loaded.append(int(key))
        self._policy.inserted(key, r)

    def __getattr__(self, name):
        return getattr(self._policy, name)


def tier_split(loaded, host_keys, disk_expert_bytes: int, host_expert_bytes: int) -> dict:
    """{disk_loads, disk_bytes, host_loads, host_bytes} of the loaded keys: host keys copy from
    host memory (`host_expert_bytes`, the float32 copy), others read disk (`disk_expert_bytes`)."""
    host = {int(k) for k in host_keys}
    host_loads = sum(1 for k in loaded if int(k) in host)
    disk_loads = len(loaded) - host_loads
    return {"disk_loads": disk_loads, "disk_bytes": disk_loads * int(disk_expert_bytes),
            "host_loads": host_loads, "host_bytes": host_loads * int(host_expert_bytes)}


def tier_totals(loaded_by_rank, host_keys_by_rank, disk_expert_bytes: int, host_expert_bytes: int,
                computed_by_rank=None) -> dict:
    """`tier_split` summed over ranks: each rank's loaded keys against its own host tier. Keys a
    rank computed on the host (`computed_by_rank`, host compute on a miss) move nothing to the
    device, but one outside its host tier is read from disk for it: a disk read each."""
    splits = [tier_split(loaded, host, disk_expert_bytes, host_expert_bytes)
              for loaded, host in zip(loaded_by_rank, host_keys_by_rank)]
    out = {k: sum(one[k] for one in splits) for k in TIER_COUNTERS}
    for computed, host in zip(computed_by_rank or [], host_keys_by_rank):
        held = {int(k) for k in host}
        reads = sum(1 for k in computed if int(k) not in held)
        out["disk_loads"] += reads
        out["disk_bytes"] += reads * int(disk_expert_bytes)
    return out
