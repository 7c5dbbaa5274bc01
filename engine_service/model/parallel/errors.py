"""The one error a tensor-parallel engine raises when its ranks cannot go on."""


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank died, failed or did not answer in time, or a message between
    ranks failed its authentication: the engine cannot go on."""
