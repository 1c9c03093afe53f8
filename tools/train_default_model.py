#!/usr/bin/env python
"""Train mtpserve's embedded default model: a small Qwen3-style code model with three MTP modules.

Corpus: the running interpreter's standard library (*.py, test suites excluded), sorted by relative
path; about 5% of the files, chosen by a stable hash of the path, are held out (half of them, the
"val" half, picks the best weights during training; the other, "test", half only reports).
Tokenizer: byte-level BPE (vocab 8192, "<|endoftext|>" as eos/bos, appended after every file).
Objective: DeepSeek-V3 MTP (main CE + lambda * mean of the modules' CE), mtpserve.workers.models.dense.

    python tools/train_default_model.py --out DIR --device cuda --minutes 8     # the real run (H100)
    python tools/train_default_model.py --out DIR --device cpu --tiny            # CI smoke, seconds

Writes DIR/{config.json, model.safetensors (bf16), tokenizer.json, tokenizer_config.json,
generation_config.json, training_facts.json}. Needs only torch, tokenizers, safetensors, numpy.
"""

from __future__ import annotations

import time

_T0 = time.monotonic()  # the --minutes budget counts from here, imports included

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import sysconfig  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, installed or not

import tokenizers  # noqa: E402
import torch  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402

from mtpserve.workers.models import train as T  # noqa: E402
from mtpserve.workers.models.config import ModelConfig  # noqa: E402
from mtpserve.workers.models.loader import load_model  # noqa: E402
from mtpserve.workers.models.weight_names import mtp_specs, target_specs  # noqa: E402
from mtpserve.workers.models.writer import save_checkpoint  # noqa: E402

EOT = "<|endoftext|>"
MAX_CHECKPOINT_BYTES = 24_000_000  # the package-data budget for model.safetensors
# Directories that are not library source: test suites, third-party installs, build leftovers.
EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
HEADS = ("main", "mtp0", "mtp1", "mtp2")
FINAL_RESERVE_S = 25.0  # kept from the budget for the final evaluation and saving


def log(msg: str) -> None:
    print(f"[{time.monotonic() - _T0:7.1f}s] {msg}", flush=True)


def stdlib_files(root: Path) -> list[tuple[str, str]]:
    """(relative posix path, text) of every library .py file, sorted by path."""
    found: list[tuple[str, str]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS and not d.startswith("config-"))
        for name in filenames:
            # _sysconfigdata_* is the machine's build configuration, not library code.
            if not name.endswith(".py") or name.startswith("_sysconfigdata"):
                continue
            path = Path(dirpath) / name
            try:
                text = path.read_bytes().decode("utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            if text.strip():
                found.append((path.relative_to(root).as_posix(), text))
    return sorted(found)


def split_of(rel: str) -> str:
    """'train', 'val' or 'test' from a hash of the path: stable across machines and runs."""
    digest = hashlib.sha256(rel.encode()).digest()
    if int.from_bytes(digest[:4], "big") % 100 >= 5:
        return "train"
    return "val" if digest[4] % 2 == 0 else "test"


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    # Byte-level pre-tokenisation round-trips any text exactly, indentation included.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def encode_stream(tok: Tokenizer, texts: list[str], eot_id: int) -> torch.Tensor:
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eot_id)
    return torch.tensor(ids, dtype=torch.long)


def model_config(vocab_size: int, eot_id: int, tiny: bool) -> dict[str, Any]:
    if tiny:
        return T.tiny_config(vocab_size=vocab_size, num_mtp=3, eos_token_id=eot_id)
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab_size,
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "num_nextn_predict_layers": 3,
        # DeepSeek wiring, stated so that no reader has to rely on layout defaults.
        "mtp_hidden_first": False,
        "mtp_hidden_pre_norm": False,
        "mtp_pass_normed": False,
        "mtp_mask_position0": True,
        "eos_token_id": eot_id,
        "bos_token_id": eot_id,
    }


def checkpoint_bytes(hf_config: dict[str, Any]) -> int:
    cfg = ModelConfig.from_dict(hf_config)
    return 2 * sum(math.prod(s.shape) for s in target_specs(cfg) + mtp_specs(cfg) if not s.optional)


def train_config(args: argparse.Namespace, deadline: float | None) -> T.TrainConfig:
    if args.tiny:
        return T.TrainConfig(
            seq_len=64, batch_size=8, steps=args.steps or 30, lr=1e-2, warmup_steps=5,
            seed=args.seed, log_every=5, eval_every=15, eval_max_tokens=4096, deadline=deadline,
        )
    return T.TrainConfig(
        seq_len=2048, batch_size=16, steps=args.steps or 10**9, lr=2e-3, min_lr_ratio=0.1,
        warmup_steps=200, weight_decay=0.1, grad_clip=1.0, mtp_lambda=0.3, dropout=0.1,
        seed=args.seed, log_every=50, eval_every=250, eval_max_tokens=131072, deadline=deadline,
    )


def named(values: list[float]) -> dict[str, float]:
    return {HEADS[j]: round(v, 5) for j, v in enumerate(values)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, type=Path, help="checkpoint directory to write")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--minutes", type=float, default=8.0, help="wall budget of the whole run, imports to saving")
    p.add_argument("--steps", type=int, default=0, help="fixed step count (default: fill the time budget)")
    p.add_argument("--tiny", action="store_true", help="tiny model, corpus subset, few steps (CPU smoke test)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    elif args.tiny:
        torch.set_num_threads(1)  # see train.single_thread: tiny ops lose to threading overhead
    deadline = _T0 + 60.0 * args.minutes - FINAL_RESERVE_S

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_files(stdlib)
    parts: dict[str, list[tuple[str, str]]] = {"train": [], "val": [], "test": []}
    for rel, text in files:
        parts[split_of(rel)].append((rel, text))
    if args.tiny:
        parts = {name: _prefix_by_bytes(items, 300_000 if name == "train" else 30_000) for name, items in parts.items()}
    log(f"corpus {stdlib}: " + ", ".join(f"{k} {len(v)} files / {sum(len(t) for _, t in v)} chars" for k, v in parts.items()))

    tok = train_tokenizer([t for _, t in parts["train"]], 512 if args.tiny else 8192)
    eot_id = tok.token_to_id(EOT)
    streams = {name: encode_stream(tok, [t for _, t in items], eot_id) for name, items in parts.items()}
    log(f"tokenizer vocab {tok.get_vocab_size()}; tokens " + ", ".join(f"{k} {v.numel()}" for k, v in streams.items()))

    hf_config = model_config(tok.get_vocab_size(), eot_id, args.tiny)
    size = checkpoint_bytes(hf_config)
    if not args.tiny and size > MAX_CHECKPOINT_BYTES:
        raise SystemExit(f"model would be {size} bytes in bf16, over the {MAX_CHECKPOINT_BYTES} budget")
    cfg, target, mtp = T.build_models(hf_config, device)
    n_params = sum(p.numel() for p in {id(p): p for m in (target, mtp) for p in m.parameters()}.values())
    log(f"model {n_params} parameters, {size} bytes in bf16, {cfg.mtp.num_modules} MTP modules")

    tc = train_config(args, deadline)
    val = streams["val"] if streams["val"].numel() else streams["test"]
    t_train = time.monotonic()
    result = T.train(target, mtp, streams["train"], tc, val_tokens=val, log=log)
    train_s = time.monotonic() - t_train

    out: Path = args.out
    save_checkpoint(out, hf_config, target, mtp, dtype=torch.bfloat16)
    tok.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOT, "eos_token": EOT,
        "model_max_length": hf_config["max_position_embeddings"],
    })
    _write_json(out / "generation_config.json", {"bos_token_id": eot_id, "eos_token_id": eot_id, "pad_token_id": eot_id})

    # Report what the saved (bf16) checkpoint does, read back through the serving loader.
    loaded = load_model(out, torch.bfloat16 if device.type == "cuda" else torch.float32, device)
    held = {}
    for name in ("val", "test"):
        if streams[name].numel() > 1:
            m = T.evaluate(loaded.target, loaded.mtp, streams[name], tc.seq_len, tc.batch_size)
            held[name] = {"loss": named(m["loss"]), "top1": named(m["top1"]), "positions": int(m["positions"][0])}
            log(f"held-out {name}: top1 {held[name]['top1']} loss {held[name]['loss']}")

    facts = {
        "steps": result.steps,
        "planned_steps": result.planned_steps,
        "kept_weights_of_step": result.best_step,
        "tokens_seen": result.tokens_seen,
        "final_train_loss": named(result.final_losses),
        "heldout_top1": held.get("test", {}).get("top1"),
        "heldout": held,
        "train_time_s": round(train_s, 1),
        "wall_time_s": round(time.monotonic() - _T0, 1),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.processor() or platform.machine()})",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "tokenizers": tokenizers.__version__,
        "seed": args.seed,
        "tiny": args.tiny,
        "corpus": {
            "stdlib": str(stdlib),
            "files": {k: len(v) for k, v in parts.items()},
            "tokens": {k: int(v.numel()) for k, v in streams.items()},
            "split": "sha256(relative path): first 4 bytes mod 100 < 5 held out; byte 4 even -> val, odd -> test",
        },
        "model": {"parameters": n_params, "safetensors_bytes": (out / "model.safetensors").stat().st_size},
        "train_config": {k: v for k, v in dataclasses.asdict(tc).items() if k != "deadline"},
        "history": result.history,
    }
    _write_json(out / "training_facts.json", facts)
    log(f"wrote {out} ({facts['model']['safetensors_bytes']} bytes of weights) in {facts['wall_time_s']} s")
    return 0


def _prefix_by_bytes(items: list[tuple[str, str]], budget: int) -> list[tuple[str, str]]:
    """The first files in path order whose text fits the budget (at least one file)."""
    kept, used = [], 0
    for rel, text in items:
        if kept and used + len(text) > budget:
            continue
        kept.append((rel, text))
        used += len(text)
    return kept


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
