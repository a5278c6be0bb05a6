"""The syntax of the Kubernetes flags of compile: image references, node selectors, tolerations and
object names, parsed where click parses the flag so a bad value is one line, never a pod that the API
server or the kubelet refuses later.

The rules are Kubernetes' own (k8s.io/apimachinery 1.31, `pkg/util/validation/validation.go`:
qualified names, label values, DNS-1123 subdomains) and the container image reference grammar
(distribution/reference v0.6.0, `regexp.go`: domain, path components, tag, digest). Written from
those definitions, not copied.

    --node-selector KEY=VALUE[,KEY=VALUE...]      -> {KEY: VALUE}
    --toleration KEY[=VALUE][:EFFECT][,...]       -> [{"key", "operator", "value"?, "effect"?}]
                                                     (kubectl taint's spelling; no VALUE: Exists)
    --image-pull-secret NAME[,NAME...]            -> [NAME]
"""
from __future__ import annotations

import re

from moeplan.core.cli_types import OneLineType

EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
_NAME = r"[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?"           # a qualified name's name part, <= 63
_SUBDOMAIN = r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?(?:\.[a-z0-9](?:[-a-z0-9]*[a-z0-9])?)*"  # DNS-1123, <= 253
_PATH_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_DOMAIN_COMPONENT = r"(?:[A-Za-z0-9]|[A-Za-z0-9][-A-Za-z0-9]*[A-Za-z0-9])"
_DOMAIN = rf"{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*(?::[0-9]+)?"
_TAG = r"[\w][\w.-]{0,127}"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
_IMAGE = re.compile(rf"(?:(?P<domain>{_DOMAIN})/)?(?P<path>{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*)"
                    rf"(?::(?P<tag>{_TAG}))?(?:@(?P<digest>{_DIGEST}))?")


def is_subdomain(text: str) -> bool:
    """A DNS-1123 subdomain: the name of a Secret, a storage class."""
    return len(text) <= 253 and re.fullmatch(_SUBDOMAIN, text) is not None


def label_key_problem(key: str) -> str | None:
    """Why `key` is not a qualified name ([DNS-subdomain/]name, name <= 63), or None."""
    prefix, _, name = key.rpartition("/")
    if "/" in key and not is_subdomain(prefix):
        return f"its prefix {prefix!r} is not a DNS subdomain (lower-case letters, digits, '-', '.')"
    if not name or len(name) > 63 or re.fullmatch(_NAME, name) is None:
        return (f"{name!r} is not a name (1 to 63 letters, digits, '-', '_', '.', starting and ending with a "
                f"letter or digit)")
    return None


def label_value_problem(value: str) -> str | None:
    """Why `value` is not a label value (empty, or a name of at most 63 characters), or None."""
    if value == "" or (len(value) <= 63 and re.fullmatch(_NAME, value)):
        return None
    return f"{value!r} is not a label value (at most 63 letters, digits, '-', '_', '.', starting and ending with one)"


def _items(text: str) -> list:
    items = [t.strip() for t in str(text).split(",")]
    if not any(items) or not all(items):
        raise ValueError(f"has an empty entry in {text!r}")
    return items


def parse_node_selector(text: str) -> dict:
    """'KEY=VALUE[,KEY=VALUE...]' -> {KEY: VALUE}; ValueError says what is wrong."""
    out = {}
    for item in _items(text):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"entry {item!r} is not KEY=VALUE")
        problem = label_key_problem(key) or label_value_problem(value)
        if problem:
            raise ValueError(f"entry {item!r}: {problem}")
        if key in out:
            raise ValueError(f"names {key!r} twice")
        out[key] = value
    return out


def format_node_selector(selector: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in selector.items())


def parse_tolerations(text: str) -> list:
    """'KEY[=VALUE][:EFFECT][,...]' -> tolerations; without a VALUE the operator is Exists, without
    an EFFECT the toleration covers every effect."""
    out = []
    for item in _items(text):
        body, sep, effect = item.rpartition(":") if ":" in item else (item, "", "")
        if sep and effect not in EFFECTS:
            raise ValueError(f"entry {item!r}: effect {effect!r} is not one of {', '.join(EFFECTS)}")
        key, eq, value = body.partition("=")
        problem = label_key_problem(key) or (label_value_problem(value) if eq else None)
        if problem:
            raise ValueError(f"entry {item!r}: {problem}")
        toleration = {"key": key, "operator": "Equal" if eq else "Exists"}
        if eq:
            toleration["value"] = value
        if effect:
            toleration["effect"] = effect
        if toleration in out:
            raise ValueError(f"names {item!r} twice")
        out.append(toleration)
    return out


def format_tolerations(tolerations: list) -> str:
    return ",".join(t["key"] + (f"={t['value']}" if t["operator"] == "Equal" else "")
                    + (f":{t['effect']}" if "effect" in t else "") for t in tolerations)


def parse_names(text: str) -> list:
    """'NAME[,NAME...]' -> [NAME] of Kubernetes objects (DNS-1123 subdomains), each once."""
    out = []
    for item in _items(text):
        if not is_subdomain(item):
            raise ValueError(f"{item!r} is not an object name (lower-case letters, digits, '-', '.'; at most 253)")
        if item in out:
            raise ValueError(f"names {item!r} twice")
        out.append(item)
    return out


def image_problem(reference: str) -> str | None:
    """Why `reference` is not a container image reference ([REGISTRY/]PATH[:TAG][@DIGEST]), or None."""
    match = _IMAGE.fullmatch(reference)
    if match is None:
        return (f"{reference!r} is not an image reference (REGISTRY/NAME:TAG: lower-case path components of "
                f"letters, digits and '.', '_', '-', a tag of at most 128 of those)")
    domain = match.group("domain")
    name = (domain + "/" if domain else "") + match.group("path")
    if len(name) > 255:
        return f"its name is {len(name)} characters, more than the 255 an image name may have"
    return None


class _Parsed(OneLineType):
    """A flag whose value a `parse` function reads (its ValueError is the message)."""

    def __init__(self, name: str, parse):
        self.name, self.parse = name, parse

    def convert(self, value, param, ctx):
        if not isinstance(value, str):  # already parsed (the Python API passes the dict or list)
            value = (format_node_selector(value) if isinstance(value, dict) else
                     format_tolerations(value) if value and isinstance(value[0], dict) else ",".join(value))
        try:
            return self.parse(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


class ImageReference(OneLineType):
    name = "image"

    def convert(self, value, param, ctx):
        problem = image_problem(str(value))
        if problem:
            self.fail(f"must be an image reference: {problem}", param, ctx)
        return str(value)


def parse_weights_source(text: str) -> str:
    """'image', 'volume' or an http(s) URL with a host (presigned S3/GCS URLs are https URLs)."""
    from urllib.parse import urlsplit

    if text in ("image", "volume"):
        return text
    parts = urlsplit(text)
    if parts.scheme in ("s3", "gs"):
        raise ValueError(f"takes an https URL, not {parts.scheme}:// (the image has no cloud tools or credentials): "
                         f"give the object's presigned URL ('aws s3 presign {text}' or 'gcloud storage sign-url {text}')")
    if parts.scheme not in ("http", "https") or not parts.hostname or any(c.isspace() or ord(c) < 32 for c in text):
        raise ValueError(f"takes image, volume or an http(s) URL of the bundle's tar, got {text!r}")
    return text


def _storage_class(text: str) -> str:
    if not is_subdomain(text):
        raise ValueError(f"{text!r} is not a storage class name (lower-case letters, digits, '-', '.')")
    return text


NODE_SELECTOR = _Parsed("selector", parse_node_selector)
TOLERATIONS = _Parsed("tolerations", parse_tolerations)
OBJECT_NAMES = _Parsed("names", parse_names)
WEIGHTS_SOURCE = _Parsed("source", parse_weights_source)
STORAGE_CLASS = _Parsed("class", _storage_class)
IMAGE = ImageReference()
