"""Plan passes that assemble one target's Plan from the facts the other passes decided."""
