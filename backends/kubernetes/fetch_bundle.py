"""The init container `fetch` of Kubernetes pods compiled with `--weights-from URL`: puts the bundle on
the pod's own volume, once.

The manifests run this file's text as `python -c TEXT URL VOLUME PLAN_SHA256` in the pods' image
(Python's standard library only: the image holds nothing of moeplan). VOLUME/complete holds the
sha256 of the plan.json fetched last: when it is PLAN_SHA256, the bundle is already there (a pod
restarted on its claim) and nothing is downloaded. Otherwise the tar at URL (plain or compressed,
streamed, never stored whole) is extracted into VOLUME/partial with tarfile's `data` filter (no
links out, no absolute paths, no device files); its plan.json must be the plan these manifests were
written from, and only then does it become VOLUME/bundle, which the ranks mount read-only.
`launch.sh` then checks every file against manifest.json, as it does wherever a bundle runs.
"""
import hashlib
import shutil
import sys
import tarfile
import urllib.request
from pathlib import Path

TIMEOUT_S = 60  # per blocking read: a stalled download fails the container, and the kubelet retries it


def plan_sha256(bundle: Path) -> str:
    path = bundle / "plan.json"
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "none (no plan.json)"


def fetch(url: str, volume: str, expected: str) -> int:
    volume = Path(volume)
    marker, bundle, partial = volume / "complete", volume / "bundle", volume / "partial"
    if marker.is_file() and marker.read_text().strip() == expected and bundle.is_dir():
        print(f"fetch: the bundle of plan {expected[:12]} is already on this volume")
        return 0
    marker.unlink(missing_ok=True)
    for old in (partial, bundle):
        shutil.rmtree(old, ignore_errors=True)
    partial.mkdir(parents=True)
    print(f"fetch: downloading the bundle into {bundle}", flush=True)
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response, tarfile.open(fileobj=response, mode="r|*") as tar:
            tar.extractall(partial, filter="data")
    except (OSError, tarfile.TarError, EOFError) as exc:  # HTTP errors (an expired presigned URL: 403), a cut stream
        print(f"error: cannot fetch the bundle from the --weights-from URL: {exc}", file=sys.stderr)
        return 1
    found = plan_sha256(partial)
    if found != expected:
        print(f"error: the tar at the --weights-from URL holds a bundle whose plan.json has sha256 {found}, not "
              f"{expected} (the plan of these manifests); upload the tar of the bundle these manifests came from "
              f"(its README, step 2)", file=sys.stderr)
        return 2
    partial.rename(bundle)
    marker.write_text(expected + "\n")
    print("fetch: done")
    return 0


if __name__ == "__main__":
    sys.exit(fetch(*sys.argv[1:4]))
