"""MoE dispatch/combine with DeepEP's kernels; every other collective is fw-comm-torch's (NCCL)."""
