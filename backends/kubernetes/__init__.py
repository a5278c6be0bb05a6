"""The kubernetes target: manifests that run a torchrun bundle as a service (StatefulSets) or, with
--batch-job, as an indexed Job."""
