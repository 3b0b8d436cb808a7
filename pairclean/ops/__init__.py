"""Operations: atomic writes, torch.distributed, fault points, benchmarks."""
