"""Local search over placements: the moves and the searches that take them."""
