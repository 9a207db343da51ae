"""Optimiser, schedule, batch and run-length settings."""

from dataclasses import dataclass, field
from typing import Optional

OPTIMIZERS = ("adamw", "sgd")
DECAY_STYLES = ("cosine", "constant", "linear")


@dataclass
class TrainingConfig:
    """How one run trains: batches, optimiser, learning-rate schedule, logging and evaluation."""

    seq_length: int = field(default=128, metadata={"help": "tokens per training sample"})
    micro_batch_size: int = field(default=4, metadata={"help": "samples per rank per micro-batch"})
    global_batch_size: Optional[int] = field(
        default=None, metadata={"help": "samples per optimizer step over ALL ranks (Megatron semantics): "
                                        "micro-batch x world size x accumulation steps; one group's step "
                                        "sees global / F of them"})
    gradient_accumulation_steps: Optional[int] = field(
        default=None, metadata={"help": "micro-batches per optimizer step (alternative to --global-batch-size)"})
    train_iters: int = field(default=100, metadata={"help": "optimizer steps to train"})
    optimizer: str = field(default="adamw", metadata={"help": "inner optimizer: adamw or sgd"})
    lr: float = field(default=3e-4, metadata={"help": "peak learning rate"})
    min_lr: float = field(default=0.0, metadata={"help": "learning rate at the end of the decay"})
    lr_warmup_iters: int = field(default=0, metadata={"help": "steps of linear warm-up from 0 to --lr"})
    lr_decay_style: str = field(default="cosine", metadata={"help": "after warm-up: cosine, linear or constant"})
    lr_decay_iters: Optional[int] = field(
        default=None, metadata={"help": "step at which the decay reaches --min-lr (default: --train-iters)"})
    weight_decay: float = field(default=0.1, metadata={"help": "decoupled weight decay (AdamW) or L2 (SGD)"})
    adam_beta1: float = field(default=0.9, metadata={"help": "AdamW beta1"})
    adam_beta2: float = field(default=0.95, metadata={"help": "AdamW beta2"})
    adam_eps: float = field(default=1e-8, metadata={"help": "AdamW epsilon"})
    sgd_momentum: float = field(default=0.0, metadata={"help": "SGD momentum"})
    clip_grad: float = field(default=1.0, metadata={"help": "clip the global gradient norm to this; 0 disables"})
    bf16: bool = field(default=False, metadata={"help": "bf16 compute and communication with fp32 master shards"})
    grad_reduce_dtype: Optional[str] = field(
        default=None, metadata={"help": "with --bf16, the dtype gradients are reduced in (megatron: also accumulated "
                                        "in): fp32 (the fsdp2 and megatron default) or bf16 (half the gradient "
                                        "traffic; on megatron also half its whole-model gradient buffer); "
                                        "DeepSpeed takes it from its JSON (communication_data_type)"})
    recompute_activations: bool = field(
        default=False, metadata={"help": "keep only each block's input and recompute the block in the "
                                         "backward pass (less memory, about a third more compute)"})
    seed: int = field(default=1234, metadata={"help": "seed for initialisation and data order"})
    deterministic_mode: bool = field(
        default=False, metadata={"help": "the same bits from the same inputs on GPUs too (an exact resume compares "
                                         "equal): torch's deterministic algorithms, e.g. FlashAttention's "
                                         "deterministic backward, and cuBLAS with a fixed workspace; slower. "
                                         "CPU runs are deterministic without it"})
    eval_interval: int = field(default=0, metadata={"help": "evaluate every this many steps (0: only at the end)"})
    eval_iters: int = field(default=4, metadata={"help": "micro-batches per rank in one evaluation (0: no evaluation)"})
    log_interval: int = field(default=10, metadata={"help": "print and record metrics every this many steps"})
    run_dir: str = field(default="runs/latest", metadata={"help": "directory for config.json, metrics.jsonl and summary.json"})
    tensorboard_dir: Optional[str] = field(
        default=None, metadata={"help": "also write every metrics.jsonl scalar as TensorBoard events here "
                                        "(needs pip install -e \".[tensorboard]\")"})
    wandb_project: Optional[str] = field(
        default=None, metadata={"help": "also log every metrics.jsonl scalar to this Weights & Biases project "
                                        "(needs pip install -e \".[wandb]\"; WANDB_MODE applies)"})
    wandb_exp_name: Optional[str] = field(
        default=None, metadata={"help": "name of the Weights & Biases run (default: the run dir's name)"})

    def decay_iters(self) -> int:
        """Step at which the learning rate reaches min_lr."""
        return self.lr_decay_iters if self.lr_decay_iters is not None else self.train_iters

    def validate(self) -> None:
        errors = []
        for name in ("seq_length", "micro_batch_size", "train_iters"):
            if getattr(self, name) < 1:
                errors.append(f"{name}={getattr(self, name)} must be at least 1")
        for name in ("global_batch_size", "gradient_accumulation_steps"):
            value = getattr(self, name)
            if value is not None and value < 1:
                errors.append(f"{name}={value} must be at least 1")
        if self.optimizer not in OPTIMIZERS:
            errors.append(f"optimizer={self.optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
        if self.lr_decay_style not in DECAY_STYLES:
            errors.append(f"lr_decay_style={self.lr_decay_style!r} is not one of {', '.join(DECAY_STYLES)}")
        if self.lr < 0 or self.min_lr < 0:
            errors.append(f"lr={self.lr} and min_lr={self.min_lr} must not be negative")
        if self.min_lr > self.lr:
            errors.append(f"min_lr={self.min_lr} is larger than lr={self.lr}")
        if self.lr_warmup_iters < 0 or self.lr_warmup_iters > self.train_iters:
            errors.append(f"lr_warmup_iters={self.lr_warmup_iters} must be between 0 and "
                          f"train_iters={self.train_iters}")
        if self.lr_decay_iters is not None and self.lr_decay_iters < self.lr_warmup_iters:
            errors.append(f"lr_decay_iters={self.lr_decay_iters} is before the end of warm-up "
                          f"(lr_warmup_iters={self.lr_warmup_iters})")
        if self.weight_decay < 0:
            errors.append(f"weight_decay={self.weight_decay} must not be negative")
        if not (0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1):
            errors.append(f"adam betas ({self.adam_beta1}, {self.adam_beta2}) must lie in [0, 1)")
        if self.adam_eps <= 0:
            errors.append(f"adam_eps={self.adam_eps} must be positive")
        if not 0 <= self.sgd_momentum < 1:
            errors.append(f"sgd_momentum={self.sgd_momentum} must lie in [0, 1)")
        if self.grad_reduce_dtype not in (None, "fp32", "bf16"):
            errors.append(f"grad_reduce_dtype={self.grad_reduce_dtype!r} is not one of fp32, bf16")
        elif self.grad_reduce_dtype == "bf16" and not self.bf16:
            errors.append("grad_reduce_dtype='bf16' needs --bf16 (fp32 training reduces fp32 gradients)")
        if self.clip_grad < 0:
            errors.append(f"clip_grad={self.clip_grad} must be >= 0 (0 disables clipping)")
        for name in ("eval_interval", "eval_iters"):
            if getattr(self, name) < 0:
                errors.append(f"{name}={getattr(self, name)} must be >= 0")
        if self.log_interval < 1:
            errors.append(f"log_interval={self.log_interval} must be at least 1")
        if self.wandb_exp_name is not None and self.wandb_project is None:
            errors.append(f"wandb_exp_name={self.wandb_exp_name!r} is set but wandb_project is not; "
                          "give --wandb-project too")
        if errors:
            raise ValueError("invalid training settings: " + "; ".join(errors))
