"""The lambda target: a SAM application of dense-slice and expert functions run by Step Functions."""
