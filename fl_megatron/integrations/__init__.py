"""Integrations of the federated outer loop into other training frameworks.

`megatron_lm`: Megatron-LM (core_v0.16.1), driven by the thin patch series in
patches/megatron-lm/. Nothing here is imported by fl_megatron itself; megatron-core is imported
only when these modules are used.
"""
