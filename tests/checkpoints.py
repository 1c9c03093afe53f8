"""Tiny Hugging Face-layout checkpoints and paged-KV batch builders for tests.

Not a test module: import it as `from tests.checkpoints import make_hf_checkpoint` (run pytest from the
repository root, e.g. `python -m pytest`, so that `tests` is importable as a namespace package).

The checkpoints are built with transformers itself (Qwen3ForCausalLM / Qwen2ForCausalLM /
LlamaForCausalLM) and saved with `save_pretrained`; MTP tensors are added by their checkpoint names,
written here independently of mtpserve's weight_names.py so that the loader is checked against an
outside statement of the layouts:

* DeepSeek layout: `model.layers.{L+k}.{enorm,hnorm,eh_proj,shared_head.norm}.weight` plus the
  decoder block's tensors under the same prefix (optionally `shared_head.head.weight` and
  `embed_tokens.weight`), `num_nextn_predict_layers` in config.json.
* MiMo layout: `model.mtp_layers.{k}.{token_layernorm,hidden_layernorm,input_proj,final_layernorm}.weight`
  plus the block's tensors; config.json keeps the Qwen2/Qwen3/Llama architecture (transformers cannot
  load "MiMoForCausalLM") and says `"mtp_layout": "mimo"` and `num_nextn_predict_layers`.

All weights are re-drawn from a seeded generator with larger spreads than transformers' init
(std 0.02 and unit norms give near-uniform logits, which would make the comparisons weak).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch
from safetensors.torch import load_file, save_file

from mtpserve.workers.attention import AttentionMetadata, LayerKV

FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
}

# DeepSeek-style and MiMo-style names of the four MTP-specific tensors, in the order
# (token-embedding norm, hidden norm, input projection, head norm).
DEEPSEEK_MTP_PARTS = ("enorm", "hnorm", "eh_proj", "shared_head.norm")
MIMO_MTP_PARTS = ("token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm")

_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")


def _hf_classes(family: str):
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"family must be one of {sorted(FAMILIES)}, got {family!r}")
    cfg_name, model_name = FAMILIES[family]
    return getattr(transformers, cfg_name), getattr(transformers, model_name)


def _quiet_transformers() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


def _random_like(name: str, shape: Sequence[int], gen: torch.Generator, *, matrix_std: float = 0.1) -> torch.Tensor:
    """A random tensor suited to the parameter's role: norms near 1, biases small, embeddings larger."""
    shape = tuple(shape)
    if name.endswith("norm.weight") or "layernorm" in name:
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    if name.endswith(".bias"):
        return 0.1 * torch.randn(shape, generator=gen)
    if name.endswith("embed_tokens.weight"):
        return 0.5 * torch.randn(shape, generator=gen)
    return matrix_std * torch.randn(shape, generator=gen)


def make_hf_checkpoint(
    path: str | Path,
    family: str = "qwen3",
    num_mtp: int = 0,
    mtp_layout: str = "deepseek",
    vocab_size: int = 97,
    hidden_size: int = 64,
    num_layers: int = 2,
    tie: bool = False,
    seed: int = 0,
    *,
    tokenizer: bool = False,
    mtp_own_head: bool = False,
    mtp_own_embed: bool = False,
    config_extra: dict[str, Any] | None = None,
    **overrides: Any,
) -> Path:
    """Build a tiny random transformers model, save it at `path` and return `path`.

    overrides go to the transformers config (e.g. rope_scaling=..., attention_bias=True,
    num_attention_heads=...). config_extra is merged into config.json afterwards (e.g. the
    mtp_hidden_pre_norm / mtp_pass_normed / mtp_hidden_first / mtp_mask_position0 switches).
    mtp_own_head / mtp_own_embed add per-module `shared_head.head.weight` / `embed_tokens.weight`
    (DeepSeek layout only).
    """
    if mtp_layout not in ("deepseek", "mimo"):
        raise ValueError(f"mtp_layout must be 'deepseek' or 'mimo', got {mtp_layout!r}")
    if (mtp_own_head or mtp_own_embed) and mtp_layout != "deepseek":
        raise ValueError("per-module head/embedding copies exist only in the DeepSeek layout")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config_cls, model_cls = _hf_classes(family)
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    kwargs.update(overrides)
    config = config_cls(**kwargs)
    _quiet_transformers()
    model = model_cls(config).to(torch.float32)

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        # named_parameters de-duplicates a tied lm_head, so the embedding is drawn once.
        for name, p in model.named_parameters():
            p.copy_(_random_like(name, p.shape, gen))
    model.save_pretrained(path)

    raw = json.loads((path / "config.json").read_text())
    if num_mtp > 0:
        block = {
            name[len("model.layers.0."):]: tuple(t.shape)
            for name, t in model.state_dict().items()
            if name.startswith("model.layers.0.")
        }
        tensors = load_file(str(path / "model.safetensors"))
        for k in range(num_mtp):
            if mtp_layout == "deepseek":
                prefix = f"model.layers.{num_layers + k}."
                parts = DEEPSEEK_MTP_PARTS
            else:
                prefix = f"model.mtp_layers.{k}."
                parts = MIMO_MTP_PARTS
            for name, shape in block.items():
                tensors[prefix + name] = _random_like(name, shape, gen, matrix_std=0.08)
            enorm, hnorm, proj, head_norm = parts
            tensors[f"{prefix}{enorm}.weight"] = _random_like("norm.weight", (hidden_size,), gen)
            tensors[f"{prefix}{hnorm}.weight"] = _random_like("norm.weight", (hidden_size,), gen)
            tensors[f"{prefix}{proj}.weight"] = _random_like("proj.weight", (hidden_size, 2 * hidden_size), gen, matrix_std=0.08)
            tensors[f"{prefix}{head_norm}.weight"] = _random_like("norm.weight", (hidden_size,), gen)
            if mtp_own_head:
                tensors[f"{prefix}shared_head.head.weight"] = _random_like("head.weight", (vocab_size, hidden_size), gen)
            if mtp_own_embed:
                tensors[f"{prefix}embed_tokens.weight"] = _random_like("embed_tokens.weight", (vocab_size, hidden_size), gen)
        write_tensors(path / "model.safetensors", tensors)
        raw["num_nextn_predict_layers"] = num_mtp
        if mtp_layout == "mimo":
            raw["mtp_layout"] = "mimo"
    raw.update(config_extra or {})
    (path / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    if tokenizer:
        write_tokenizer(path, vocab_size)
    return path


def token_strings(vocab_size: int) -> list[str]:
    """The tiny tokenizer's vocabulary: three special tokens, then words w3 ... w{vocab-1}."""
    return list(_SPECIAL_TOKENS) + [f"w{i}" for i in range(len(_SPECIAL_TOKENS), vocab_size)]


def write_tokenizer(path: str | Path, vocab_size: int) -> Path:
    """Write a whitespace WordLevel tokenizer.json over the model's vocabulary (ids match positions)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(token_strings(vocab_size))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with single spaces
    tok.add_special_tokens(list(_SPECIAL_TOKENS))
    out = Path(path) / "tokenizer.json"
    tok.save(str(out))
    return out


def read_config(path: str | Path) -> dict[str, Any]:
    return json.loads((Path(path) / "config.json").read_text())


def write_config(path: str | Path, raw: dict[str, Any]) -> None:
    (Path(path) / "config.json").write_text(json.dumps(raw, indent=2) + "\n")


def read_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a single-file checkpoint directory (or of one .safetensors file)."""
    path = Path(path)
    return load_file(str(path / "model.safetensors" if path.is_dir() else path))


def write_tensors(file: str | Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(file), metadata={"format": "pt"})


def load_hf_model(path: str | Path):
    """The transformers model saved at `path`, fp32, eager attention, in eval mode."""
    import transformers

    _quiet_transformers()
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager"
    ).eval()


# --------------------------------------------------------------------------------------------------
# Paged KV batches (one KV group): pools, block tables and metadata for flat batches.


def make_kv_pool(
    num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, *, seed: int = 0
) -> list[LayerKV]:
    """Per-layer K/V pools filled with large finite garbage, so reading an unwritten slot shows."""
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [LayerKV(100 * torch.randn(shape, generator=gen), 100 * torch.randn(shape, generator=gen)) for _ in range(num_layers)]


def model_kv_pool(cfg: Any, num_layers: int, num_blocks: int, block_size: int, *, seed: int = 0) -> list[LayerKV]:
    """make_kv_pool shaped for a model config: GQA K/V pools, or for latent attention (MLA) one garbage-filled
    [NB, BS, 1, kv_lora_rank + rope] pool per layer serving as both K and V."""
    if cfg.mla is None:
        return make_kv_pool(num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    pools = [100 * torch.randn(num_blocks, block_size, 1, cfg.mla.latent_dim, generator=gen) for _ in range(num_layers)]
    return [LayerKV(p, p) for p in pools]


def shuffled_block_tables(
    num_reqs: int, blocks_per_req: int, num_blocks: int, *, seed: int = 0
) -> list[list[int]]:
    """Disjoint block tables drawn from a random permutation of the pool's blocks."""
    if num_reqs * blocks_per_req > num_blocks:
        raise ValueError("pool too small for the requested block tables")
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    return [perm[r * blocks_per_req:(r + 1) * blocks_per_req] for r in range(num_reqs)]


def make_batch(
    chunks: Iterable[tuple[Sequence[int], int, Sequence[int]]], block_size: int
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Flat batch from (token ids of this step, position of the first of them, block table) per request.

    Returns input_ids [T], positions [T] and the AttentionMetadata (seq_len = start + len(tokens)).
    """
    chunks = list(chunks)
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    qsl = [0]
    seq_lens: list[int] = []
    max_blocks = max(len(bt) for _, _, bt in chunks)
    tables = []
    for tokens, start, table in chunks:
        n = len(tokens)
        if n == 0:
            raise ValueError("every request in a batch needs at least one token")
        if start + n > len(table) * block_size:
            raise ValueError("block table too short for the sequence")
        ids.extend(int(t) for t in tokens)
        for p in range(start, start + n):
            positions.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)
        qsl.append(qsl[-1] + n)
        seq_lens.append(start + n)
        tables.append(list(table) + [0] * (max_blocks - len(table)))
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=max(len(t) for t, _, _ in chunks),
        max_seq_len=max(seq_lens),
    )
    return torch.tensor(ids, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64), meta
