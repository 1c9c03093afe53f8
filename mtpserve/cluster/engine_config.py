"""Engine configuration: what the user sets (EngineConfig) and what follows from it (ResolvedConfig)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from mtpserve.errors import CheckpointError
from mtpserve.sampling_params import MAX_SPECULATIVE_TOKENS, SPEC_AUTO, SpecTokens, valid_spec_tokens
from mtpserve.workers.chain import CHAIN_MODES
from mtpserve.workers.kv_cache import bytes_per_block
from mtpserve.workers.model_runner import RunnerConfig
from mtpserve.workers.models.config import ModelConfig
from mtpserve.workers.models.loader import ModelSource

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "default_model"


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # checkpoint directory; None = the embedded default model
    dtype: str = "auto"  # float32 on CPU, bfloat16 on CUDA
    device: str = "auto"
    # Default per request: "auto" chooses each step's drafts from measured acceptance and step costs (design
    # §9), a number fixes them (0 = off), None = one per MTP module.
    num_speculative_tokens: SpecTokens = SPEC_AUTO
    max_auto_speculative_tokens: int | None = None  # "auto"'s upper bound; None = MTP modules + 1
    mtp_chain: str = "depth"  # "depth" (DeepSeek style, recursive past the last module) or "recursive" (EAGLE)
    draft_top_m: int = 32
    block_size: int = 16
    num_kv_blocks: int | None = None  # per KV group; None = sized from memory
    kv_cache_memory_gb: float = 1.0  # CPU: memory for all KV groups together
    gpu_memory_utilization: float = 0.85  # CUDA: fraction of GPU memory for weights + KV
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    prefill_hold_steps: int = 4  # while requests decode, arrivals wait up to this many steps to prefill together
    max_model_len: int | None = None
    tensor_parallel_size: int = 1
    drafter_devices: int = 0  # 0 = drafter colocated with target rank 0
    use_ray: bool = False
    seed: int = 0
    cuda_graphs: bool = True  # replay whole uniform steps (a drafter group's ranks their parts) as CUDA graphs
    capture_graphs_at_start: bool = True  # k=0 and the default k, every batch bucket; False: on first use only
    prefill_step_rows: int = 4096  # prompt chunks run as fixed-shape (graphed) steps up to this many padded rows; 0: off
    # Before serving, run synthetic prompts through every rank so that the eager prompt path compiles its kernels
    # then (cluster/warmup.py); None = where prompts take that path on a GPU (a drafter group, prefill steps off).
    compile_warmup: bool | None = None
    uniform_steps: bool = True  # device-resident fixed-shape steps when every request is at its frontier
    pad_uniform_steps: bool | None = None  # pad them to batch buckets; None = where CUDA graphs run (tests: True)
    async_scheduling: bool | None = None  # plan decode step n+1 while n runs; None = on CUDA
    enable_prefix_caching: bool = True  # reuse the KV blocks of shared prompt prefixes, in every KV group
    # Ray deployment (tensor_parallel_size > 1, drafter_devices > 0 or use_ray):
    ray_address: str | None = None  # None: ray.init()'s default (RAY_ADDRESS, else a local instance)
    placement_timeout_s: float = 60.0  # waiting for the placement groups
    startup_timeout_s: float = 600.0  # every worker's join + load, and each collective afterwards
    target_resources: dict[str, float] | None = None  # extra Ray resources per target bundle (pin to nodes)
    drafter_resources: dict[str, float] | None = None  # extra Ray resources per drafter bundle
    # Worker faults (Ray): a step past the timeout counts as a hung worker; None = twice the slowest step
    # seen plus the margin. Faults are recovered from until `max_faults` happen within `fault_window_s`.
    step_timeout_s: float | None = None
    step_timeout_margin_s: float = 5.0
    max_faults: int = 3
    fault_window_s: float = 600.0

    def __post_init__(self) -> None:
        if self.mtp_chain not in CHAIN_MODES:
            raise ValueError(f"mtp_chain: must be one of {CHAIN_MODES}, got {self.mtp_chain!r}")
        if not valid_spec_tokens(self.num_speculative_tokens):
            raise ValueError(f"num_speculative_tokens: must be \"auto\", null or in [0, {MAX_SPECULATIVE_TOKENS}], "
                             f"got {self.num_speculative_tokens!r}")
        auto_max = self.max_auto_speculative_tokens
        if auto_max is not None and not 1 <= auto_max <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"max_auto_speculative_tokens: must be in [1, {MAX_SPECULATIVE_TOKENS}], got {auto_max}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "draft_top_m", "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.prefill_step_rows < 0:
            raise ValueError(f"prefill_step_rows: must be >= 0, got {self.prefill_step_rows}")
        if self.prefill_hold_steps < 0:
            raise ValueError(f"prefill_hold_steps: must be >= 0, got {self.prefill_hold_steps}")
        if self.drafter_devices < 0:
            raise ValueError(f"drafter_devices: must be >= 0, got {self.drafter_devices}")
        if self.step_timeout_s is not None and not self.step_timeout_s > 0:
            raise ValueError(f"step_timeout_s: must be > 0, got {self.step_timeout_s}")
        if self.max_faults < 1:
            raise ValueError(f"max_faults: must be >= 1, got {self.max_faults}")
        for name in ("placement_timeout_s", "startup_timeout_s", "step_timeout_margin_s", "fault_window_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class ResolvedConfig:
    config: EngineConfig
    model_path: Path
    model_config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    num_mtp_modules: int  # KV groups for MTP modules in use
    default_num_spec: int  # a request's drafts when it names none (with default_auto: the upper bound)
    max_model_len: int
    num_blocks: int
    eos_token_ids: tuple[int, ...]
    async_scheduling: bool
    # Adaptive speculation (design §9): whether "auto" chooses per step (it needs the in-process chain; with
    # a drafter group "auto" means max_auto_spec drafts), its upper bound, and whether it is the default.
    adaptive: bool = False
    max_auto_spec: int = 0
    default_auto: bool = False

    @staticmethod
    def resolve(config: EngineConfig) -> "ResolvedConfig":
        path = Path(config.model) if config.model else DEFAULT_MODEL_DIR
        if not path.is_dir():
            raise CheckpointError(f"checkpoint path {str(path)!r} is not a directory")
        cfg = ModelConfig.from_dir(path)
        device = torch.device(config.device if config.device != "auto" else
                              ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = _dtype(config.dtype, device)
        modules = cfg.mtp.num_modules if config.mtp_chain == "depth" else min(cfg.mtp.num_modules, 1)
        auto_max = 0 if cfg.mtp.num_modules == 0 else \
            config.max_auto_speculative_tokens or min(cfg.mtp.num_modules + 1, MAX_SPECULATIVE_TOKENS)
        default_auto = config.num_speculative_tokens == SPEC_AUTO and auto_max > 0
        default_spec = config.num_speculative_tokens
        if default_spec is None:
            default_spec = min(cfg.mtp.num_modules, MAX_SPECULATIVE_TOKENS)
        elif default_spec == SPEC_AUTO:
            default_spec = auto_max
        max_len = config.max_model_len or cfg.max_position
        if max_len > cfg.max_position:
            raise ValueError(f"max_model_len: {max_len} exceeds the model's {cfg.max_position} positions")
        return ResolvedConfig(
            config, path, cfg, device, dtype, modules, default_spec, max_len,
            _num_blocks(config, cfg, path, modules, max_len, dtype, device), _eos_ids(path, cfg),
            config.async_scheduling if config.async_scheduling is not None else device.type == "cuda",
            adaptive=auto_max > 0 and config.drafter_devices == 0, max_auto_spec=auto_max, default_auto=default_auto,
        )

    def make_executor(self):
        if self.config.use_ray or self.config.tensor_parallel_size > 1 or self.config.drafter_devices > 0:
            from mtpserve.cluster.ray_executor import RayExecutor

            return RayExecutor(self)
        from mtpserve.workers.local_executor import LocalExecutor

        return LocalExecutor(self.model_source(), self.runner_config())

    def model_source(self) -> ModelSource:
        return ModelSource(self.model_path, self.dtype, self.device)

    def runner_config(self) -> RunnerConfig:
        c = self.config
        # Tensor-parallel ranks capture their collectives inside the graphs: every rank applies the same plans,
        # so all of them capture the same graphs in the same order. Eager, a default-model step at c = 1 took
        # ~14 ms on two H200s (run 135), its kernels launched one by one from Python; graphed on one, 0.3 ms.
        return RunnerConfig(self.num_blocks, c.block_size, c.max_num_seqs, self.num_mtp_modules, c.mtp_chain,
                            c.draft_top_m, cuda_graphs=c.cuda_graphs,
                            max_model_len=self.max_model_len, uniform_steps=c.uniform_steps,
                            pad_uniform_steps=c.pad_uniform_steps,
                            capture_at_start=self._captured_at_start() if c.capture_graphs_at_start else (),
                            prefill_step_rows=c.prefill_step_rows)

    def _captured_at_start(self) -> tuple[int, ...]:
        """k = 0 and the default k; with adaptive speculation by default every k it may choose (so the first
        steps at each k do not wait on a capture, and the cost model sees each k's real step)."""
        if self.adaptive and self.default_auto:
            return tuple(range(self.max_auto_spec + 1))
        return (0, self.default_num_spec)


def _dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in table:
        raise ValueError(f"dtype: must be one of {sorted(table)} or 'auto', got {name!r}")
    return table[name]


def _num_blocks(config: EngineConfig, cfg: ModelConfig, path: Path, modules: int, max_len: int,
                dtype: torch.dtype, device: torch.device) -> int:
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    shards = 1 if cfg.mla is not None else config.tensor_parallel_size  # a latent pool is whole on every rank
    per_block = bytes_per_block(cfg, config.block_size, modules, dtype) // shards
    # Never more than every running request at full length needs (plus draft slack).
    enough = config.max_num_seqs * -(-(max_len + 2 * MAX_SPECULATIVE_TOKENS) // config.block_size)
    if device.type == "cuda":
        if not torch.cuda.is_available():  # e.g. a CPU-only driver deploying onto a GPU Ray cluster
            raise ValueError("num_kv_blocks: this process has no GPU to size the KV cache from; set it explicitly")
        weights = sum(p.stat().st_size for p in path.glob("*.safetensors")) // config.tensor_parallel_size
        budget = torch.cuda.get_device_properties(device).total_memory * config.gpu_memory_utilization - weights
        budget -= 2 * 1024**3  # activations, logits and the allocator's slack
    else:
        budget = config.kv_cache_memory_gb * 1024**3
    return max(1, min(enough, int(budget // per_block)))


def _eos_ids(path: Path, cfg: ModelConfig) -> tuple[int, ...]:
    ids = list(cfg.eos_token_ids)
    gen = path / "generation_config.json"
    if gen.is_file():
        value = json.loads(gen.read_text()).get("eos_token_id")
        ids += [value] if isinstance(value, int) else list(value or [])
    return tuple(dict.fromkeys(ids))
