"""Lower bounds on the cross-GPU transitions of any placement."""
