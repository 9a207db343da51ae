"""The checks of tools/gpu_check.py: what they share (common), those one GPU can run (one_gpu),
those that need several (multi_gpu), and the scripts they start (codec_speed, gloo_probe)."""
