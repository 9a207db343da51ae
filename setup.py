"""fl-megatron: federated sharded data parallelism for LLM pre-training."""

from setuptools import find_packages, setup

setup(
    name="fl-megatron",
    version="0.1.0",
    description="Federated sharded data parallelism (FL+FSDP, FL+HSDP) for pre-training LLMs "
                "on clusters whose inter-node links are the bottleneck",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["fl_megatron", "fl_megatron.*"]),
    package_data={"fl_megatron.data": ["corpus/*.jsonl.gz"]},
    install_requires=[
        # Install torch first on CPU-only machines (pip install torch==2.13.0) so that pip does
        # not pull a CUDA build; on GPU nodes a CUDA build of torch >= 2.13 (the floor in
        # fl_megatron/torch_version.py: the version the tests run on).
        "torch>=2.13",
        "numpy>=1.24",
        "sentencepiece>=0.2",
        # checkpoints (random states) and Hugging Face export/import
        "safetensors>=0.4",
    ],
    extras_require={
        # the DeepSpeed backend reads ZeRO-3's partitions: 0.19.8 is the version it is tested with
        "deepspeed": ["deepspeed>=0.19.8,<0.20"],
        # --backend megatron and the Megatron-LM integration reach into the distributed optimizer's
        # shards: 0.16.1 (the release for Python 3.11 and Megatron-LM core_v0.16.1) is tested;
        # its parallel_state needs einops (undeclared) for partial distributed optimizers
        "megatron": ["megatron-core==0.16.1", "einops>=0.8"],
        # a patched Megatron-LM checkout (patches/megatron-lm/): its training code imports six (the
        # BERT tokenizer module, loaded by every pretrain script), which megatron-core does not declare
        "megatron-lm": ["megatron-core==0.16.1", "einops>=0.8", "six>=1.16"],
        # Hugging Face tokenizer.json files for tools/preprocess_data.py (--tokenizer-type HuggingFaceTokenizer)
        "data": ["tokenizers>=0.19"],
        # --tensorboard-dir writes TensorBoard event files; --wandb-project logs to Weights & Biases
        "tensorboard": ["tensorboard>=2.14"],
        "wandb": ["wandb>=0.17"],
        # loading exported Hugging Face directories (the README's CPU path generates with it)
        "hf": ["transformers>=4.45", "tokenizers>=0.19"],
        # tools/plot_runs.py and the two-tier benchmark's figures
        "plots": ["matplotlib>=3.7"],
        # the peer rows of tools/bench_cluster.py (torchft LocalSGD and DiLoCo)
        "peers": ["torchft==0.2.0"],
        # elastic federation groups (fl_megatron/elastic: the inter-group tier on torchft)
        "elastic": ["torchft==0.2.0"],
        # megatron-core: format compatibility tests of the indexed datasets (its dataset code needs no GPU)
        "test": ["pytest>=8", "pytest-timeout>=2.3", "transformers>=4.45", "safetensors>=0.4",
                 "tokenizers>=0.19", "deepspeed==0.19.8", "megatron-core==0.16.1", "einops>=0.8",
                 "tensorboard>=2.14", "matplotlib>=3.7", "torchft==0.2.0", "hypothesis==6.170.17",
                 "ruff==0.17.6"],
    },
    entry_points={"console_scripts": ["fl-megatron-pretrain=fl_megatron.pretrain:run_and_exit"]},
)
