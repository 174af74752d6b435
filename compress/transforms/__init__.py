"""Function-preserving rewrites of a model: rotations of the residual stream, smoothing scales folded between layers,
and planted outlier features for tests."""
