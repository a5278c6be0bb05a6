"""What a Kubernetes plan records of its deployment (the plan's `deployment`), from compile's flags,
and the combinations refused before anything is planned.

A Kubernetes bundle is a deployment of one kind of node, so two choices are made at compile, never
by editing a hashed manifest afterwards:
* the hardware: pods request the plan's GPUs, and the plan is priced on that GPU's profile
  (`--hardware`, required), or `--cpu-only` pods request none and the plan is priced on a CPU
  profile (cpu-gloo unless --hardware names a calibrated one);
* the image (`--image`, required): no default, because no name is right for every cluster; a
  registry-less default resolves to Docker Hub, where the user cannot push it and anyone may own it.

The weights reach the pods (`--weights-from`) in the image (default: nothing else to provide), from
an http(s) URL onto one ReadWriteOnce volume per pod (what every cluster's default storage class
provides), or from one shared volume the user fills (needs a class with ReadWriteMany volumes).
"""
from __future__ import annotations

from moeplan.core.errors import UserError

GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
SHARED_ACCESS = ("ReadWriteMany", "ReadOnlyMany")


def weights_mode(source: str) -> str:
    """'image', 'volume' or 'url' for a recorded `weights_from`."""
    return source if source in ("image", "volume") else "url"


def _gpu_profiles() -> str:
    from moeplan.core.hardware import BUILTIN, load_hardware

    return ", ".join(n for n in BUILTIN if not load_hardware(n).device_is_host)


def _check_hardware(values: dict) -> None:
    """A GPU profile for GPU pods, a CPU profile (or none: cpu-gloo) for --cpu-only pods."""
    from moeplan.core.hardware import load_hardware

    if values["hardware"] is None:
        if not values["cpu_only"]:
            raise UserError(f"--target kubernetes needs --hardware NAME, the GPU its pods run on ({_gpu_profiles()}, or "
                            f"a YAML profile), or --cpu-only for pods without GPUs (priced on cpu-gloo)")
        return
    on_host = load_hardware(values["hardware"]).device_is_host
    if values["cpu_only"] and not on_host:
        raise UserError(f"--cpu-only pods run on CPUs, but --hardware {values['hardware']} is a GPU profile; give a CPU "
                        f"profile (cpu-gloo, this-machine or a 'moeplan calibrate' file) or drop --cpu-only")
    if not values["cpu_only"] and on_host:
        raise UserError(f"--hardware {values['hardware']} prices ranks on CPUs, but without --cpu-only the pods request "
                        f"GPUs; give the GPU's profile ({_gpu_profiles()}) or add --cpu-only")


def _check_volume(values: dict, mode: str, nodes: int) -> str | None:
    """The weights volumes' access mode (None in image mode)."""
    access = values["access_mode"]
    if mode == "image":
        if values["storage_class"] is not None or access is not None:
            raise UserError("--storage-class and --access-mode are for the weights volumes of --weights-from URL or "
                            "volume; --weights-from image (the default) puts the bundle in the image and uses no volume")
        return None
    if mode == "url":
        if access == "ReadOnlyMany":
            raise UserError("--access-mode ReadOnlyMany: with --weights-from URL each pod's init container writes the "
                            "bundle onto its own volume; use ReadWriteOnce (the default) or ReadWriteMany")
        return access or "ReadWriteOnce"
    if values["storage_class"] is None:
        raise UserError("--weights-from volume needs --storage-class: a class whose volumes many nodes mount at once "
                        "(ReadWriteMany, e.g. EFS, Filestore, Azure Files); the big clouds' default classes give "
                        "ReadWriteOnce volumes only, and the claim would stay Pending. Or use --weights-from URL")
    access = access or "ReadWriteMany"
    if nodes > 1 and access not in SHARED_ACCESS:
        raise UserError(f"--access-mode {access}: the one shared volume of --weights-from volume is mounted on all "
                        f"{nodes} nodes; use ReadWriteMany or ReadOnlyMany, or --weights-from URL (a volume per pod)")
    return access


def deployment(values: dict) -> dict:
    """The plan's `deployment` of a Kubernetes plan from the flags' values; UserError for a missing
    choice or a combination that cannot run."""
    _check_hardware(values)
    if values["image"] is None:
        raise UserError("--target kubernetes needs --image REGISTRY/NAME:TAG, the image its pods run: the bundle "
                        "README's docker build line builds it from kubernetes/Dockerfile, and you push it there")
    mode = weights_mode(values["weights_from"])
    access = _check_volume(values, mode, values["nodes"])
    spec = {"image": values["image"], "storage_class": values["storage_class"], "weights_from": values["weights_from"]}
    optional = {"access_mode": access, "cpu_only": values["cpu_only"] or None, "batch_job": values["batch_job"] or None,
                "node_selector": values["node_selector"], "tolerations": values["tolerations"],
                "image_pull_secrets": values["image_pull_secrets"]}
    return {**spec, **{k: v for k, v in optional.items() if v is not None}}


def tolerations(deployment: dict) -> list:
    """The pods' tolerations: GPU pods tolerate the GPU nodes' usual taint, then the user's."""
    given = list(deployment.get("tolerations") or [])
    base = [] if deployment.get("cpu_only") else [GPU_TOLERATION]
    return base + [t for t in given if t not in base]
