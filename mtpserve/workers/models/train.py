"""Dense training of the target decoder and its MTP modules with the DeepSeek-V3 MTP objective: the forward and
the objective in dense.py (re-exported here), over the serving modules' own parameters, so a trained model is saved
with writer.save_checkpoint and served by loader.load_model unchanged.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from mtpserve.workers.models.config import ModelConfig
from mtpserve.workers.models.dense import IGNORE, dense_forward, head_targets, mtp_objective
from mtpserve.workers.models.decoder import TargetModel
from mtpserve.workers.models.mtp import MTPStack

# --- building, evaluating, training ------------------------------------------------------------


def build_models(hf_config: dict[str, Any], device: torch.device | str = "cpu") -> tuple[ModelConfig, TargetModel, MTPStack]:
    """Fresh fp32 target + MTP stack with GPT-style init (the modules' default init is for serving, not training)."""
    cfg = ModelConfig.from_dict(hf_config)
    target = TargetModel(cfg)
    mtp = MTPStack(cfg, target.rotary)
    init_weights(target, mtp)
    return cfg, target.to(device), mtp.to(device)


@torch.no_grad()
def init_weights(target: TargetModel, mtp: MTPStack, std: float = 0.02) -> None:
    # nn.Embedding's N(0, 1) would give huge logits through the tied head; residual-branch outputs
    # are scaled down by depth so the residual stream's variance does not grow with the layer count.
    depth = target.cfg.num_layers + len(mtp)
    for module in (target, mtp):
        for name, sub in module.named_modules():
            if isinstance(sub, nn.Linear):
                scaled = name.endswith(("o_proj", "down_proj"))
                sub.weight.normal_(0.0, std / math.sqrt(2 * depth) if scaled else std)
                if sub.bias is not None:
                    sub.bias.zero_()
            elif isinstance(sub, nn.Embedding):
                sub.weight.normal_(0.0, std)


def _autocast(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()


def _windows(tokens: torch.Tensor, seq_len: int, batch_size: int, max_tokens: int | None) -> Iterator[torch.Tensor]:
    n = tokens.numel() // seq_len
    if max_tokens is not None:
        n = min(n, max(1, max_tokens // seq_len))
    rows = tokens[: n * seq_len].view(n, seq_len)
    for i in range(0, n, batch_size):
        yield rows[i : i + batch_size]


@torch.no_grad()
def evaluate(
    target: TargetModel,
    mtp: MTPStack,
    tokens: torch.Tensor,
    seq_len: int,
    batch_size: int = 8,
    max_tokens: int | None = None,
) -> dict[str, list[float]]:
    """Teacher-forced held-out loss and top-1 accuracy per head over non-overlapping windows of a 1-D stream."""
    device = target.embed_tokens.weight.device
    seq_len = min(seq_len, tokens.numel())
    heads = 1 + len(mtp)
    loss_sum, hits, count = (torch.zeros(heads, dtype=torch.float64) for _ in range(3))
    for batch in _windows(tokens, seq_len, batch_size, max_tokens):
        batch = batch.to(device)
        with _autocast(device):
            logits = dense_forward(target, mtp, batch)
        for j, lg in enumerate(logits):
            tgt = head_targets(batch, j)
            valid = tgt != IGNORE
            loss_sum[j] += F.cross_entropy(lg[valid], tgt[valid], reduction="sum").double().cpu()
            hits[j] += (lg[valid].argmax(-1) == tgt[valid]).sum().cpu()
            count[j] += valid.sum().cpu()
    count = count.clamp(min=1)
    return {"loss": (loss_sum / count).tolist(), "top1": (hits / count).tolist(), "positions": count.tolist()}


def objective_of(metrics: dict[str, list[float]], mtp_lambda: float) -> float:
    loss = metrics["loss"]
    return loss[0] + (mtp_lambda * sum(loss[1:]) / len(loss[1:]) if len(loss) > 1 else 0.0)


@dataclass
class TrainConfig:
    seq_len: int = 128
    batch_size: int = 16
    steps: int = 200  # upper bound; a time budget may end training sooner
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    mtp_lambda: float = 0.3
    dropout: float = 0.0
    seed: int = 0
    log_every: int = 50
    eval_every: int = 0  # > 0: evaluate on val tokens, log, and keep the best weights by val objective
    eval_max_tokens: int | None = 131072
    deadline: float | None = None  # time.monotonic() value at which training must stop


@dataclass
class TrainResult:
    steps: int
    tokens_seen: int
    final_losses: list[float]  # per head, mean over the last logging window
    planned_steps: int
    best_step: int | None = None
    history: list[dict[str, Any]] = field(default_factory=list)


def lr_at(step: int, total: int, tc: TrainConfig) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio * lr at `total`."""
    if step < tc.warmup_steps:
        return tc.lr * (step + 1) / tc.warmup_steps
    progress = min(1.0, (step - tc.warmup_steps) / max(1, total - tc.warmup_steps))
    return tc.lr * (tc.min_lr_ratio + (1 - tc.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def _optimizer(target: TargetModel, mtp: MTPStack, tc: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    params = {id(p): p for m in (target, mtp) for p in m.parameters()}  # the tied head appears once
    decay = [p for p in params.values() if p.ndim >= 2]
    no_decay = [p for p in params.values() if p.ndim < 2]  # norm weights and biases
    groups = [{"params": decay, "weight_decay": tc.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=tc.lr, betas=(0.9, 0.95), fused=device.type == "cuda")


def _train_step(
    target: TargetModel, mtp: MTPStack, opt: torch.optim.AdamW, batch: torch.Tensor, tc: TrainConfig
) -> torch.Tensor:
    """One optimiser step on a [B, S] batch; returns the per-head CE, still on the device."""
    with _autocast(batch.device):
        logits = dense_forward(target, mtp, batch, tc.dropout)
        loss, ces = mtp_objective(logits, batch, tc.mtp_lambda)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], tc.grad_clip)
    opt.step()
    return ces


def _planned_steps(step: int, seconds: float, timed_steps: int, tc: TrainConfig) -> int:
    """Fix the cosine horizon once from the measured step time, so the schedule reaches its floor
    when the time budget runs out (3% kept for the periodic evaluations and jitter)."""
    assert tc.deadline is not None
    fit = step + int(0.97 * (tc.deadline - time.monotonic()) * timed_steps / seconds)
    return max(step + 1, min(tc.steps, fit))


def train(
    target: TargetModel,
    mtp: MTPStack,
    train_tokens: torch.Tensor,
    tc: TrainConfig,
    val_tokens: torch.Tensor | None = None,
    log: Callable[[str], None] = print,
) -> TrainResult:
    """Train in place on random windows of a 1-D token stream; returns what happened."""
    device = target.embed_tokens.weight.device
    # Offsets are drawn on the training device: a host-to-device copy per step would sync the stream.
    gen = torch.Generator(device=device).manual_seed(tc.seed)
    stream = train_tokens.to(device)
    span = stream.numel() - tc.seq_len
    if span <= 0:
        raise ValueError(f"{stream.numel()} training tokens cannot fill one window of {tc.seq_len}")
    arange = torch.arange(tc.seq_len, device=device)
    opt = _optimizer(target, mtp, tc, device)
    target.train(), mtp.train()
    total, step, tokens_seen, timer = tc.steps, 0, 0, 0.0
    window_sum, window_n, final = torch.zeros(1 + len(mtp), device=device), 0, []
    history: list[dict[str, Any]] = []
    best: tuple[float, int, dict[str, torch.Tensor], dict[str, torch.Tensor]] | None = None
    while step < total:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total, tc)
        starts = torch.randint(0, span + 1, (tc.batch_size,), generator=gen, device=device)
        batch = stream[starts[:, None] + arange]
        window_sum += _train_step(target, mtp, opt, batch, tc)  # summed on the device: no per-step sync
        window_n, step, tokens_seen = window_n + 1, step + 1, tokens_seen + batch.numel()
        if tc.deadline is not None and step in (5, 25):  # past the first steps' one-off warm-up costs
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if step == 5:
                timer = time.monotonic()
            else:
                total = _planned_steps(step, time.monotonic() - timer, 20, tc)
                log(f"step time {(time.monotonic() - timer) / 20 * 1e3:.1f} ms -> planning {total} steps")
        last = step == total or (tc.deadline is not None and time.monotonic() >= tc.deadline)
        if step % tc.log_every == 0 or last:
            final = (window_sum / window_n).tolist()
            window_sum.zero_()
            window_n = 0
            heads = " ".join(f"{'main' if j == 0 else f'mtp{j - 1}'}={v:.4f}" for j, v in enumerate(final))
            log(f"step {step}/{total} lr {lr_at(step - 1, total, tc):.2e} tokens {tokens_seen} loss {heads}")
            history.append({"step": step, "train_loss": final})
        if val_tokens is not None and tc.eval_every > 0 and (step % tc.eval_every == 0 or last):
            metrics = evaluate(target, mtp, val_tokens, tc.seq_len, tc.batch_size, tc.eval_max_tokens)
            objective = objective_of(metrics, tc.mtp_lambda)
            log(f"step {step} val loss {_fmt(metrics['loss'])} top1 {_fmt(metrics['top1'])}")
            history.append({"step": step, "val": metrics})
            if best is None or objective < best[0]:
                best = (objective, step, _snapshot(target), _snapshot(mtp))
        if last:
            break
    if best is not None:
        # Many epochs over a small corpus overfit; keep the weights that generalised best.
        target.load_state_dict(best[2])
        mtp.load_state_dict(best[3])
        log(f"keeping weights of step {best[1]} (best val objective {best[0]:.4f})")
    target.eval(), mtp.eval()
    return TrainResult(step, tokens_seen, final, total, best[1] if best else None, history)


def _snapshot(module: nn.Module) -> dict[str, torch.Tensor]:  # on the host: device memory is for training
    return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}


def _fmt(values: list[float]) -> str:
    return "[" + ", ".join(f"{v:.4f}" for v in values) + "]"


# --- tiny setting for tests -------------------------------------------------------------------


def tiny_config(vocab_size: int = 64, num_mtp: int = 3, eos_token_id: int = 0) -> dict[str, Any]:
    """A Qwen3-architecture config small enough to train in seconds on a CPU."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 512,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "num_nextn_predict_layers": num_mtp,
        "eos_token_id": eos_token_id,
        "bos_token_id": eos_token_id,
    }


def synthetic_tokens(vocab_size: int, n: int, seed: int = 0, noise: float = 0.1) -> torch.Tensor:
    """A Markov stream: t_{i+1} = perm[t_i], except a uniformly random token with probability `noise`.

    Every head (the target and each MTP module, whose input token is the one right before its
    target) can reach about 1 - noise top-1, so speculation on a model trained on it accepts often.
    The permutation depends on `seed`: take held-out tokens from the same stream, not another seed.
    """
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(vocab_size, generator=gen)
    rand = torch.randint(0, vocab_size, (n,), generator=gen)
    flip = torch.rand(n, generator=gen) < noise
    out = torch.empty(n, dtype=torch.long)
    out[0] = rand[0]
    for i in range(1, n):
        out[i] = rand[i] if flip[i] else perm[out[i - 1]]
    return out


def train_tiny(
    tokens: torch.Tensor,
    cfg_dict: dict[str, Any] | None = None,
    steps: int = 300,
    seed: int = 0,
    seq_len: int = 64,
    batch_size: int = 16,
    lr: float = 3e-3,
) -> tuple[TargetModel, MTPStack]:
    """Train a tiny fp32 model on CPU from a 1-D token stream; returns (target, mtp) in eval mode.

    (Engine fixtures choose `steps` to get partly trained modules; keep these defaults stable.)
    On synthetic_tokens(64, ...), steps=60, seq_len=32, lr=1e-2 bring every head near its
    ceiling in a few seconds.
    """
    torch.manual_seed(seed)
    _, target, mtp = build_models(cfg_dict or tiny_config(), "cpu")
    tc = TrainConfig(
        seq_len=seq_len, batch_size=batch_size, steps=steps, lr=lr,
        warmup_steps=max(1, steps // 10), seed=seed, log_every=steps,
    )
    with single_thread():
        train(target, mtp, tokens, tc, log=lambda _msg: None)
    return target, mtp


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """Run tiny CPU work on one thread: its ops are so small that intra-op threads cost more than
    they give, and several times more on a loaded CI machine (measured 5x on two busy cores)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)
