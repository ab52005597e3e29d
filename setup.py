"""Packaging for colossal_lite (metadata lives here; tool settings in pyproject.toml)."""
import re
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent
VERSION = re.search(r'__version__ = "([^"]+)"', (HERE / "colossal_lite" / "_version.py").read_text()).group(1)

setup(
    name="colossal_lite",
    version=VERSION,
    description="The legacy Colossal-AI engine + trainer workflow on plain PyTorch",
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.9",
    packages=find_packages(include=["colossal_lite", "colossal_lite.*"]),
    install_requires=[
        "torch>=2.6",
        "torchvision",
        "rich",
        "colorama",
        "psutil",
        # zlib-ng: the CRC-32 that checks every checkpoint file as it is written and loaded (zlib's values, faster)
        "zlib-ng>=0.5",
    ],
    extras_require={
        # mlflow-skinny is the MLflow client the tests need (the full ``mlflow`` package depends on it);
        # sqlalchemy and alembic let it open MLflow's default store, a SQLite file
        # pytest-xdist runs the suite on two workers (the README's test command), one test file per worker
        # transformers: the Hugging Face tests, docs/huggingface.md and examples/hf_text
        "dev": ["pytest>=7", "pytest-timeout", "pytest-xdist", "numpy", "scikit-learn", "ruff", "tensorboard",
                "torchmetrics", "matplotlib", "mlflow-skinny>=2.12", "sqlalchemy", "alembic", "transformers"],
        "hf": ["transformers"],  # Hugging Face models and ckpt export --hf (safetensors comes with it)
        "examples": ["scikit-learn"],
        "tensorboard": ["tensorboard"],
        "mlflow": ["mlflow>=2.12"],
        "plot": ["matplotlib"],
    },
    entry_points={"console_scripts": ["colossal-lite=colossal_lite.cli:main"]},
)
