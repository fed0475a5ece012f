"""cudadoctor: diagnose CUDA / PyTorch extension environments."""

__version__ = "0.1.0"
