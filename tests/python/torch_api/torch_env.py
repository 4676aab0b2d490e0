"""What every PyTorch test imports first: PyTorch (the test module is skipped when it is not
installed) running its operations on one thread. Between operations PyTorch's OpenMP threads spin,
and on a machine whose cores are shared they starve the CPU engine's workers (measured: a tiny
training step took 1 s instead of 0.1 s)."""

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install -e 'python[torch]')")
torch.set_num_threads(1)
