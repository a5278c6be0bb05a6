"""`moeplan serve` on compiled Lambda bundles: the OpenAI API of the bundle's own front function over
the local cloud (its state machine, every function in its own process, S3 through moto), hit by the
real `openai` client, for TinyMoE (examples/tiny_moe) and a transformers Qwen3-MoE with its own
tokenizer (examples/qwen3_moe). Greedy answers equal the source model's; bad requests get
OpenAI-shaped 400s; the cost each response states equals `moeplan simulate` for the same request."""
import json
import signal
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from moeplan.passes.analysis.trace.format import save_trace
from synth_routing import synthesize_routed_tokens
from moeplan.planner.cli import main
from runtime_fixtures import EXAMPLE
from serving_helpers import ServerProcess, client, metrics, raw

MOEPLAN = str(Path(sys.executable).parent / "moeplan")
QWEN = EXAMPLE.parent / "qwen3_moe"
COST_HEADERS = {"x-moeplan-billed-gb-seconds": "billed_gb_s", "x-moeplan-request-charges-usd": "request_charges_usd",
                "x-moeplan-predicted-cost-usd": "predicted_cost_usd"}


def compiled(tmp, model, layers, experts, methods, *extra) -> object:
    save_trace(synthesize_routed_tokens(tokens=2000, layers=layers, experts=experts, top_k=2, seq_len=64, seed=0),
               tmp / "trace.npz")
    out = tmp / "bundle"
    result = CliRunner().invoke(main, ["compile", str(model), "--trace", str(tmp / "trace.npz"), "--target", "lambda",
                                       "--slo", "60", "--batch-tokens", "512", "--methods", methods, "--profile-budget", "1",
                                       "--cache-dir", str(tmp / "cache"), "--out", str(out), "--quiet", *extra])
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lambda_serve_tiny")
    bundle = compiled(tmp, EXAMPLE, 6, 16, "direct")
    server = ServerProcess([MOEPLAN, "serve", str(bundle), "--port", "0"], ready_timeout_s=180)
    yield bundle, server
    server.kill()


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lambda_serve_qwen")
    bundle = compiled(tmp, QWEN, 4, 8, "s3", "--http-entry", "http-api")
    server = ServerProcess([MOEPLAN, "serve", str(bundle), "--port", "0", "--api-key", "sesame"], ready_timeout_s=180)
    yield bundle, server
    server.kill()


def tiny_greedy(prompt: list, n: int) -> list:
    from moeplan.passes.importers.resolve import import_file

    model = import_file(EXAMPLE / "model.py").load(EXAMPLE)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(torch.argmax(model(torch.tensor([ids]))[0, -1])))
    return ids[len(prompt):]


def simulated(bundle, prompt_tokens: int, steps: int) -> dict:
    result = CliRunner().invoke(main, ["simulate", str(bundle / "plan.json"), "--prompt-tokens", str(prompt_tokens),
                                       "--new-tokens", str(steps), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output.strip().splitlines()[-1])


def check_cost(bundle, headers, prompt_tokens: int) -> dict:
    """The response's predicted cost equals moeplan simulate's for its prompt and forward steps."""
    steps = int(headers["x-moeplan-forward-steps"])
    assert int(headers["x-moeplan-prompt-tokens"]) == prompt_tokens
    sim = simulated(bundle, prompt_tokens, steps)
    for header, key in COST_HEADERS.items():
        assert float(headers[header]) == sim[key], header
    return {key: float(headers[h]) for h, key in COST_HEADERS.items()}


def tiny_sampled(prompt: list, n: int, temperature: float, top_p: float, seed: int) -> list:
    """The torchrun service's seeded sampling (serving/sampler.py) on the source model's logits."""
    from moeplan.runtime.serving.sampler import Sampler
    from moeplan.passes.importers.resolve import import_file

    model = import_file(EXAMPLE / "model.py").load(EXAMPLE)
    ids = list(prompt)
    with torch.no_grad():
        for i in range(n):
            logits = model(torch.tensor([ids]))[0, -1:]
            ids += Sampler().sample(logits, [(temperature, top_p, 0, seed)], [i])
    return ids[len(prompt):]


def test_tiny_moe_completions_chat_and_stream_equal_the_source_model(tiny):
    bundle, server = tiny
    api = client(server, timeout=300)
    raw_response = api.completions.with_raw_response.create(
        model="tiny_moe", prompt="The object", max_tokens=6, temperature=0, extra_body={"return_token_ids": True})
    r = raw_response.parse()
    prompt = list(b"The object")
    assert r.choices[0].token_ids == tiny_greedy(prompt, 6) and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == 6
    costs = [check_cost(bundle, raw_response.headers, len(prompt))]

    chat = api.chat.completions.with_raw_response.create(
        model="tiny_moe", messages=[{"role": "user", "content": "def f():"}], max_tokens=5, temperature=0)
    c = chat.parse()
    expected = tiny_greedy(list(b"user: def f():\nassistant:"), 5)  # TinyMoE has no chat template: the fallback
    assert c.choices[0].message.content == bytes(expected).decode("utf-8", errors="replace")
    costs.append(check_cost(bundle, chat.headers, c.usage.prompt_tokens))

    pieces = list(api.completions.create(model="tiny_moe", prompt="The object", max_tokens=6, temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in pieces if p.choices) == r.choices[0].text
    text = r.choices[0].text
    cut = api.completions.create(model="tiny_moe", prompt="The object", max_tokens=6, temperature=0, stop=[text[2:4]])
    assert cut.choices[0].text == text[:2] and cut.choices[0].finish_reason == "stop"
    sampled = api.completions.create(model="tiny_moe", prompt="The object", max_tokens=5, temperature=0.8, top_p=0.9,
                                     seed=11, extra_body={"return_token_ids": True})
    assert sampled.choices[0].token_ids == tiny_sampled(prompt, 5, 0.8, 0.9, 11)
    m = metrics(server)
    assert m[("moeplan_executions_total", ())] >= 3
    assert m[("moeplan_predicted_billed_gb_seconds_total", ())] >= sum(x["billed_gb_s"] for x in costs)


def test_bad_requests_get_openai_shaped_400s_and_the_server_keeps_serving(tiny):
    import openai

    _, server = tiny
    api = client(server, timeout=300)
    cases = [dict(model="another-model", prompt="x", max_tokens=2),
             dict(model="tiny_moe", prompt="x", max_tokens=10_000),
             dict(model="tiny_moe", prompt="x", max_tokens=2, temperature=-1),
             dict(model="tiny_moe", prompt="x", max_tokens=2, n=2)]
    for case in cases:
        with pytest.raises(openai.BadRequestError) as err:
            api.completions.create(**case)
        body = err.value.body
        assert set(body) >= {"message", "type", "code"} and body["code"] == 400, body
    status, _, text = raw(server, "POST", "/v1/completions", body=b"{not json")
    assert status == 400 and json.loads(text)["error"]["code"] == 400
    status, _, text = raw(server, "GET", "/v1/nothing")
    assert status == 404 and "error" in json.loads(text)
    ok = api.completions.create(model="tiny_moe", prompt="x", max_tokens=1, temperature=0)
    assert ok.choices[0].finish_reason == "length"


def test_a_transformers_model_with_its_tokenizer_and_api_key(qwen):
    import openai
    import transformers
    from tokenizers import Tokenizer

    bundle, server = qwen
    with pytest.raises(openai.AuthenticationError):
        client(server, api_key="wrong", timeout=300).completions.create(model="qwen3_moe", prompt="x", max_tokens=1)
    api = client(server, api_key="sesame", timeout=300)
    name = json.loads((bundle / "plan.json").read_text())["model"]["name"]
    assert [m.id for m in api.models.list().data] == [name]
    tokenizer = Tokenizer.from_file(str(QWEN / "tokenizer.json"))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(QWEN), dtype=torch.float32).eval()

    def greedy(ids, n):
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
        return out[0, len(ids):].tolist()

    text = "The object of the function"
    r = api.completions.with_raw_response.create(model=name, prompt=text, max_tokens=6, temperature=0,
                                                extra_body={"ignore_eos": True, "return_token_ids": True})
    ids = tokenizer.encode(text).ids
    assert r.parse().choices[0].token_ids == greedy(ids, 6)
    assert r.parse().choices[0].text == tokenizer.decode(greedy(ids, 6))
    check_cost(bundle, r.headers, len(ids))
    chat = api.chat.completions.with_raw_response.create(
        model=name, messages=[{"role": "user", "content": "The object"}], max_tokens=4, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True})
    c = chat.parse()
    prompt = tokenizer.encode("user: The object\nassistant:").ids  # no chat template in its tokenizer: the fallback
    assert c.model_extra["prompt_token_ids"] == prompt and c.choices[0].token_ids == greedy(prompt, 4)
    check_cost(bundle, chat.headers, len(prompt))
    with pytest.raises(openai.BadRequestError) as err:
        api.chat.completions.create(model=name, messages=[], max_tokens=2)
    assert err.value.body["code"] == 400
    # behind an HTTP API (30 s): a request predicted to take longer is refused, naming what fits
    room = 256 - len(ids)
    assert simulated(bundle, len(ids), room)["latency_s"] > 30
    with pytest.raises(openai.BadRequestError) as err:
        api.completions.create(model=name, prompt=text, max_tokens=room, extra_body={"ignore_eos": True})
    fit = int(err.value.body["message"].split("at most ")[1].split()[0])
    assert "30 s" in err.value.body["message"] and 0 < fit < room
    assert simulated(bundle, len(ids), fit)["latency_s"] <= 30 < simulated(bundle, len(ids), fit + 1)["latency_s"]


def test_rank_flags_are_refused_for_lambda_bundles(tiny):
    bundle, _ = tiny
    result = CliRunner().invoke(main, ["serve", str(bundle), "--nproc", "2"])
    assert result.exit_code == 2 and "--nproc" in result.output and "Lambda" in result.output


def test_sigterm_stops_the_local_service_with_exit_0(tiny):
    """Last in the file: it stops the module's TinyMoE service, after the requests the other tests
    sent, rather than starting a service of its own."""
    _, server = tiny
    assert raw(server, "GET", "/health")[0] == 200
    server.signal(signal.SIGTERM)
    assert server.wait(60) == 0
    assert server.stdout == [f"serving on {server.url}\n"]
