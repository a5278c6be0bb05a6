"""`make demo`'s last step: serve a bundle, send one streaming chat request, print the reply, stop.

Starts `moeplan serve BUNDLE --port 0`, waits for its `serving on http://HOST:PORT` line, says what
model it serves (`about`), streams one chat completion through the `openai` client (printing the
text as it arrives, then the usage), and sends SIGTERM: the service drains and exits 0.

The example model (`examples/tiny_moe`) is a 6-block byte-level MoE of 2.9 M parameters trained for
200 steps (about 150 CPU seconds) on Python's documentation: its held-out loss, about 2.5 nats per
byte, is that of letter and space frequencies, not words, so its reply is text-like noise (greedy
decoding gives whitespace; the demo samples at temperature 0.8 with a fixed seed: the same reply
every time). The demo shows the deployment serving - expert parallelism over 4 ranks, the OpenAI
API, streaming, draining - not a language model; a Hugging Face model directory serves real text
the same way (README, "A Hugging Face model, step by step"). The demo says so before the reply.

    python examples/serve_demo.py BUNDLE [--message TEXT] [--max-tokens N] [--temperature T] [--seed S]
"""
from __future__ import annotations

import argparse
import signal
import subprocess
import sys
from pathlib import Path


EXAMPLE_MODEL = ("the example TinyMoE: byte-level, 2.9 M parameters, trained for 200 steps on Python's documentation "
                 "(examples/tiny_moe/train.py); it has learnt letter and space frequencies, not words, so its reply is "
                 "text-like noise. The demo shows the deployment serving it, not a language model: a Hugging Face model "
                 "directory serves real text the same way (README, \"A Hugging Face model, step by step\").")


def about(bundle) -> str:
    """One line: what model the bundle serves, read from its plan.json; plainly, for the example model."""
    import json

    model = json.loads((Path(bundle) / "plan.json").read_text())["model"]
    if model.get("architecture") == "tiny_moe":
        return f"model: {EXAMPLE_MODEL}"
    return f"model: {model.get('name')} ({model.get('architecture')})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle")
    ap.add_argument("--message", default="What does the import statement do?")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    moeplan = str(Path(sys.executable).parent / "moeplan")
    server = subprocess.Popen([moeplan, "serve", args.bundle, "--port", "0"], stdout=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline()
        if not line.startswith("serving on "):
            print(f"error: the service did not start (exit {server.wait()})", file=sys.stderr)
            return 1
        url = line.split()[-1]
        print(line.rstrip())
        print(about(args.bundle))
        import openai

        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        print(f"user: {args.message}\nassistant:", end="", flush=True)
        usage = None
        for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": args.message}],
                                                    max_tokens=args.max_tokens, temperature=args.temperature,
                                                    seed=args.seed, stream=True,
                                                    stream_options={"include_usage": True}):
            if chunk.choices and chunk.choices[0].delta.content:
                print(chunk.choices[0].delta.content, end="", flush=True)
            usage = chunk.usage or usage
        print(f"\n({usage.prompt_tokens} prompt tokens, {usage.completion_tokens} generated)")
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(60)
    print(f"service stopped (exit {code})")
    return code


if __name__ == "__main__":
    sys.exit(main())
