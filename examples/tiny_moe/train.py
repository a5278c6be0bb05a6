"""Train the TinyMoE example deterministically on the committed pydoc corpus (CPU, 2 threads).

    python examples/tiny_moe/train.py --out examples/tiny_moe [--if-missing] [--steps N] [--seed S]

Language-model loss on random byte windows of the training text plus a small Switch-style
balance loss, AdamW with warm-up and cosine decay. Same seed, steps and thread count -> the same
weights, bit for bit. Writes DIR/model.safetensors (fp16 storage: `model.load` casts to fp32) and
DIR/config.json if DIR has none; prints train and held-out loss.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

# Idle OpenMP threads must sleep, not spin: on a shared 2-core machine spinning threads made a
# 2-thread step ~20x slower. Only takes effect if torch is not imported yet.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
THREADS = 2
DEFAULTS = dict(steps=200, seed=0, batch=16, seq_len=128, lr=3e-3, warmup=50,
                weight_decay=0.01, balance_weight=0.01)


def _import_sibling(name: str):
    """Import model.py / corpus.py by path: the example directory is not a package."""
    spec = importlib.util.spec_from_file_location(f"tiny_moe_{name}", HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


model_lib = _import_sibling("model")
corpus = _import_sibling("corpus")


def make_deterministic(seed: int) -> None:
    torch.manual_seed(seed)
    torch.set_num_threads(THREADS)
    torch.use_deterministic_algorithms(True)


def as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def random_windows(data: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator):
    """(inputs, targets) [batch, seq_len]: random windows of the text, targets shifted by one."""
    starts = torch.randint(0, len(data) - seq_len - 1, (batch,), generator=gen)
    rows = torch.stack([data[s: s + seq_len + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


@torch.no_grad()
def evaluate(model, data: torch.Tensor, seq_len: int, batch: int = 32) -> float:
    """Mean next-byte cross-entropy (nats) over consecutive non-overlapping windows."""
    model.eval()
    n = (len(data) - 1) // seq_len
    inputs = data[: n * seq_len].view(n, seq_len)
    targets = data[1: n * seq_len + 1].view(n, seq_len)
    total = 0.0
    for i in range(0, n, batch):
        logits = model(inputs[i: i + batch])
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets[i: i + batch].reshape(-1),
                                 reduction="sum").item()
    model.train()
    return total / (n * seq_len)


def learning_rate(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(config: dict, steps: int, seed: int, batch: int, seq_len: int, lr: float, warmup: int,
          weight_decay: float, balance_weight: float, log_every: int = 50, heldout: bool = True):
    """Train from scratch; returns (model, {final losses}); `heldout=False` skips the held-out pass."""
    make_deterministic(seed)
    cfg = model_lib.TinyMoEConfig.from_dict(config)
    model = model_lib.TinyMoE(cfg)
    model.train()
    train_data = as_tensor(corpus.read_bytes(corpus.TRAIN_FILE))
    heldout_data = as_tensor(corpus.read_bytes(corpus.HELDOUT_FILE))
    gen = torch.Generator().manual_seed(seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))
    lm_avg = None
    started = time.perf_counter()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, steps, lr, warmup)
        inputs, targets = random_windows(train_data, batch, seq_len, gen)
        logits = model(inputs)
        lm = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss = lm + balance_weight * model.balance_loss()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        lm_avg = lm.item() if lm_avg is None else 0.95 * lm_avg + 0.05 * lm.item()
        if log_every and (step + 1) % log_every == 0:
            print(f"step {step + 1}/{steps}  train loss {lm_avg:.3f}  ({time.perf_counter() - started:.0f} s)",
                  flush=True)
    metrics = {"train_loss_ema": lm_avg,
               "heldout_loss": evaluate(model, heldout_data, seq_len) if heldout else None}
    return model.eval(), metrics


def save_weights(model, directory: Path) -> Path:
    """Write model.safetensors (fp16) atomically into `directory`."""
    from safetensors.torch import save_file

    target = directory / model_lib.WEIGHTS_FILE
    state = {k: v.detach().to(torch.float16).contiguous() for k, v in sorted(model.state_dict().items())}
    fd, tmp = tempfile.mkstemp(prefix=".model.", suffix=".safetensors", dir=directory)
    os.close(fd)
    try:
        save_file(state, tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it private; a checkpoint is an ordinary file
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return target


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="directory for model.safetensors (+ config.json)")
    parser.add_argument("--if-missing", action="store_true", help="do nothing if DIR/model.safetensors exists")
    for name in ("steps", "seed", "batch", "seq_len"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=DEFAULTS[name])
    for name in ("lr", "balance_weight"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=float, default=DEFAULTS[name])
    args = parser.parse_args(argv)

    out: Path = args.out
    if args.if_missing and (out / model_lib.WEIGHTS_FILE).is_file():
        print(f"{out / model_lib.WEIGHTS_FILE} exists; not retraining (--if-missing)")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    config_path = out / model_lib.CONFIG_FILE
    if not config_path.is_file():
        shutil.copyfile(HERE / model_lib.CONFIG_FILE, config_path)
    config = json.loads(config_path.read_text())

    started, cpu_started = time.perf_counter(), time.process_time()
    model, metrics = train(config, steps=args.steps, seed=args.seed, batch=args.batch, seq_len=args.seq_len,
                           lr=args.lr, warmup=DEFAULTS["warmup"], weight_decay=DEFAULTS["weight_decay"],
                           balance_weight=args.balance_weight)
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    path = save_weights(model, out)
    print(f"trained {args.steps} steps in {elapsed:.1f} s ({cpu:.1f} CPU s) on {THREADS} threads: "
          f"train loss {metrics['train_loss_ema']:.3f}, held-out loss {metrics['heldout_loss']:.3f} nats/byte; "
          f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
