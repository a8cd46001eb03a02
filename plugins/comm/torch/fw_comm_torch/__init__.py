"""Collectives over torch.distributed: gloo on CPU, NCCL on CUDA."""
