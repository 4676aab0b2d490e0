"""The models that the examples and tests run the library in: SmolLM2-135M-Instruct and
all-MiniLM-L6-v2 in NumPy (their files come from PyPI packages, their dependencies from the
``examples`` extra), the real-input fixtures captured from them, and tiny PyTorch and MLX
transformers for training. Import the submodule you need: each imports its own framework."""
