"""Test-session settings shared by every test module."""

import os
import sys
from pathlib import Path

import torch

# Tiny models on a small shared machine: one intra-op thread per process avoids OpenMP threads spinning
# against each other (tests start several processes at once). Child processes inherit the variable.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

sys.path.insert(0, str(Path(__file__).parent))  # tiny_models
