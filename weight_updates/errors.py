"""The one error type of the weight-update protocol."""


class WeightUpdateError(ValueError):
    """An update was rejected, or a session was misused. Weights and version are unchanged.

    The message names what was wrong: the parameter, the bound or the expected value.
    """
