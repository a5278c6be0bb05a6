"""Platform model: documented Lambda defaults, YAML overrides, and user errors for bad values."""
import pytest

from moeplan.core.errors import UserError
from moeplan.core.platforms import load_platform


def test_defaults_are_the_documented_lambda_values():
    p = load_platform()
    assert p.name == "aws_lambda"
    assert len(p.memory_options_mb) == 14 and p.memory_options_mb[0] == 128 and p.memory_options_mb[-1] == 3072
    assert p.mb_per_vcpu == 1769 and p.vcpus(1769) == pytest.approx(1.0)
    assert p.vcpus(100_000) == p.max_vcpus == 6
    assert p.price_per_gb_s == pytest.approx(0.0000166667)
    assert p.payload_limit_bytes == 6 * 1024 * 1024
    assert p.max_replicas == 8


def test_yaml_overrides_only_the_given_keys(tmp_path):
    f = tmp_path / "mine.yaml"
    f.write_text("memory_options_mb: [512, 256, 1024]\nmax_replicas: 4\n")
    p = load_platform(f)
    assert p.memory_options_mb == (256, 512, 1024)  # sorted
    assert p.max_replicas == 4
    assert p.price_per_gb_s == load_platform().price_per_gb_s


@pytest.mark.parametrize("text, words", [
    ("memroy_options_mb: [128]\n", "unknown platform key"),
    ("max_replicas: 0\n", "max_replicas"),
    ("price_per_gb_s: -1\n", "price_per_gb_s"),
    ("memory_options_mb: []\n", "memory_options_mb"),
    ("s3_latency_s: fast\n", "s3_latency_s"),
    ("- 1\n- 2\n", "mapping"),
])
def test_bad_overrides_are_one_line_user_errors(tmp_path, text, words):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(UserError) as err:
        load_platform(f)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_missing_platform_file_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_platform(tmp_path / "nope.yaml")
