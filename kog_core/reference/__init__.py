"""The CPU reference backend (numpy, float32): the oracle every GPU backend is tested against."""
