"""fl-megatron: federated sharded data parallelism (FL+FSDP, FL+HSDP) for LLM pre-training."""

__version__ = "0.1.0"
