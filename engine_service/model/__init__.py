"""The model side: runner (one forward per step), models, weight loading, model config,
sampler, sampling parameters and the incremental detokenizer."""
