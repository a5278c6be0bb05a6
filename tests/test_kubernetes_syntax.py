"""The Kubernetes flags' syntax (core/kubernetes_syntax.py): what parses round-trips and is what the
API server accepts (checked against the strict schemas where a schema has a pattern), and anything
else is a ValueError whose text is the one-line message, never another exception."""
import string

import kubernetes_validate
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moeplan.backends.kubernetes.codegen import MIN_KUBERNETES_VERSION
from moeplan.core import kubernetes_syntax as K

ALNUM = string.ascii_letters + string.digits
LOWER = string.ascii_lowercase + string.digits


def _name(alphabet: str, inner: str, max_len: int):
    """Names of `alphabet` at both ends and `inner` between, 1..max_len characters."""
    ends = st.sampled_from(alphabet)
    return st.one_of(ends, st.tuples(ends, st.text(alphabet + inner, max_size=max_len - 2), ends).map("".join))


label_names = _name(ALNUM, "-_.", 63)
label_values = st.one_of(st.just(""), label_names)
subdomains = st.lists(_name(LOWER, "-", 20), min_size=1, max_size=4).map(".".join)
label_keys = st.one_of(label_names, st.tuples(subdomains, label_names).map("/".join))
selectors = st.dictionaries(label_keys, label_values, min_size=1, max_size=4)
tolerations = st.lists(st.builds(lambda key, value, effect: {
    "key": key, "operator": "Exists" if value is None else "Equal", **({} if value is None else {"value": value}),
    **({} if effect is None else {"effect": effect})}, label_keys, st.none() | label_values,
    st.none() | st.sampled_from(K.EFFECTS)), min_size=1, max_size=4, unique_by=lambda t: repr(sorted(t.items())))


@settings(max_examples=150, deadline=None)
@given(selectors)
def test_node_selectors_round_trip(selector):
    assert K.parse_node_selector(K.format_node_selector(selector)) == selector


@settings(max_examples=150, deadline=None)
@given(tolerations)
def test_tolerations_round_trip_and_are_valid_pod_tolerations(given_tolerations):
    parsed = K.parse_tolerations(K.format_tolerations(given_tolerations))
    assert parsed == given_tolerations
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
           "spec": {"containers": [{"name": "c", "image": "x"}], "tolerations": parsed}}
    kubernetes_validate.validate(pod, MIN_KUBERNETES_VERSION, strict=True)


@settings(max_examples=150, deadline=None)
@given(st.lists(subdomains, min_size=1, max_size=4, unique=True))
def test_object_names_round_trip(names):
    assert K.parse_names(",".join(names)) == names


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=40))
def test_any_text_parses_or_says_what_is_wrong_in_one_line(text):
    for parse in (K.parse_node_selector, K.parse_tolerations, K.parse_names, K.parse_weights_source):
        try:
            parse(text)
        except ValueError as exc:
            assert str(exc) and "\n" not in str(exc)
    problem = K.image_problem(text)
    assert problem is None or "\n" not in problem


path_components = st.lists(_name(LOWER, "", 8), min_size=1, max_size=3).map("-".join)
images = st.builds(lambda domain, path, tag, digest: (domain + "/" if domain else "") + path
                   + (":" + tag if tag else "") + ("@sha256:" + digest if digest else ""),
                   st.none() | st.sampled_from(["registry.example.com", "localhost:5000", "123456789.dkr.ecr.us-east-1.amazonaws.com"]),
                   st.lists(path_components, min_size=1, max_size=3).map("/".join),
                   st.none() | _name(ALNUM + "_", "_.-", 30), st.none() | st.text("0123456789abcdef", min_size=64, max_size=64))


@settings(max_examples=200, deadline=None)
@given(images)
def test_image_references_of_the_grammar_are_accepted(image):
    assert K.image_problem(image) is None


@pytest.mark.parametrize("image", ["", "r.io/UPPER:1", "x:", "x@sha256:12", "-x", "x//y", "x y", "x:" + "a" * 129, "a" * 256])
def test_image_references_outside_the_grammar_are_refused(image):
    assert K.image_problem(image) is not None


@pytest.mark.parametrize("text, message", [
    ("a=b,", "empty entry"), ("a", "is not KEY=VALUE"), ("-a=b", "is not a name"), ("a=b,a=c", "twice"),
    ("Bad_Prefix/a=b", "is not a DNS subdomain"), ("a=" + "v" * 64, "is not a label value")])
def test_bad_node_selectors_say_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=message):
        K.parse_node_selector(text)


@pytest.mark.parametrize("text, message", [("a:NoWay", "is not one of NoSchedule"), ("a:", "is not one of"),
                                           ("a=b:NoSchedule,a=b:NoSchedule", "twice"), ("=b", "is not a name")])
def test_bad_tolerations_say_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=message):
        K.parse_tolerations(text)


@pytest.mark.parametrize("text, message", [("s3://bucket/key", "aws s3 presign s3://bucket/key"),
                                           ("gs://bucket/key", "gcloud storage sign-url"),
                                           ("ftp://h/x", "http"), ("https://", "http"), ("images", "http")])
def test_weights_sources_other_than_image_volume_or_http_are_refused(text, message):
    with pytest.raises(ValueError, match=message):
        K.parse_weights_source(text)
    assert K.parse_weights_source("https://b.s3.amazonaws.com/k.tar?X-Amz-Signature=0").startswith("https://")
