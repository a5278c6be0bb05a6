"""Launch a torchrun bundle on this machine: `torchrun --standalone` over the bundle's own runtime/.

The ranks run from the bundle's `runtime/` (gloo on CPU, nccl if GPUs are visible) with no
PYTHONPATH, so a bundle never picks up moeplan's copy of the runtime. What a run's results mean
(verification, predicted locality) is the planner's business (`planner/pipeline/run.py`).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from moeplan.runtime.text_codec import prompt_lines
from moeplan.core.errors import UserError

DEFAULT_PROMPTS = ("The quick brown fox", "Once upon a time", "import torch\n", "Mixture of experts")


def torchrun_command(nproc: int, module: str, *args: str) -> list:
    """`torchrun --standalone --nproc-per-node N -m MODULE ARGS`: how a bundle's ranks start on this
    machine (a static run, the inference service)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "-m", module, *args]


def launch(root: Path, nproc: int, prompts_file: Path, new_tokens: int, mode: str, out_dir: Path,
           timeout: float, context: str = "auto") -> subprocess.CompletedProcess:
    """torchrun --standalone with the bundle's runtime; returns the finished process (`context`:
    coherent mode's context exchange, `runtime.serve --context`)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    env.pop("PYTHONPATH", None)  # the bundle must run from its own runtime/
    cmd = torchrun_command(nproc, "runtime.serve", "--prompts", str(prompts_file.resolve()), "--new-tokens", str(new_tokens),
                           "--mode", mode, "--out", str(out_dir.resolve())) + (["--context", context] if context != "auto" else [])
    try:
        return subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise UserError(f"the bundle did not finish within {timeout:.0f} s; raise --timeout or lower --new-tokens") from None


def failure_reason(output: str) -> str:
    """The line that says why the ranks stopped: the runtime's own `error:` line, else a rank's exception."""
    lines = output.splitlines()
    own = [l for l in lines if l.startswith("error:")]
    if own:
        return own[0]
    raised = [l for l in lines if re.match(r"^\[rank\d+\]: [\w.]*(Error|Exception)\b", l)]
    if raised:
        return raised[0]
    return next((l for l in reversed(lines) if l.strip()), "no output")


def read_prompts(prompts_path) -> list:
    """Prompts, one per line as the runtime reads them (`text_codec.prompt_lines`), or the defaults
    when no file is given; a missing, binary or empty file is a UserError."""
    if prompts_path is None:
        return [p.replace("\n", " ") for p in DEFAULT_PROMPTS]
    path = Path(prompts_path)
    if not path.is_file():
        raise UserError(f"prompts file '{path}' does not exist; give a text file with one prompt per line")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UserError(f"prompts file '{path}' is not UTF-8 text; give a text file with one prompt per line") from None
    except OSError as exc:
        raise UserError(f"cannot read prompts file '{path}' ({exc.strerror or exc})") from None
    if "\0" in text:
        raise UserError(f"prompts file '{path}' is binary; give a text file with one prompt per line")
    prompts = prompt_lines(text)
    if not prompts:
        raise UserError(f"prompts file '{path}' holds no prompt; write one prompt per line")
    return prompts
