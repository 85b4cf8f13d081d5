"""Runtime: loads generated op modules, caches them and applies them to PyTorch models."""
