"""The kubernetes target: manifests that run a torchrun bundle as an indexed Job."""
