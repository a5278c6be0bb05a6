"""Suite-wide settings that must precede any torch import."""
import os

# Busy-waiting OpenMP threads starve each other when tests, torchrun ranks and other processes
# share two cores; passive waiting keeps 2-thread torch jobs from slowing down many-fold.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
