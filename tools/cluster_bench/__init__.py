"""Benchmark helpers that run fl-megatron jobs on an emulated two-tier cluster.

Import convention: this folder is the package `cluster_bench`; put `tools/` on sys.path
(e.g. `PYTHONPATH=tools python -m cluster_bench.measure_netns`) and import
`from cluster_bench.netns_cluster import EmulatedCluster, run_job`.
Modules inside the package import each other as `cluster_bench.<module>`.
"""
