"""Speculative decoding: drafters (EAGLE, MTP), the rejection sampler, the speculative runner step,
auto-off, and online drafter training. See each module's docstring; the engine wires them in when
`EngineConfig.speculative` is set.
"""
