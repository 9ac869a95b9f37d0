"""Token trees: structure (masks, positions, paths), choices shapes and the verification budget."""
