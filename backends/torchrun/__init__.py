"""The torchrun target: a Plan + weights become a self-contained expert-parallel bundle."""
